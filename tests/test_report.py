"""The report stage on run directories made here (tests/fixtures/report.py): verl-format
attempt logs of a resumed run whose attempts overlap, the other stages' documented files,
secrets planted in the environment and config, and the embedded default with no training.
The stage runs in-process (``report.run``/``report.build`` on a Layout of the run), through
the ``hy3rl report`` console script, and as Snakemake's rule."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from fixtures.common import REPO_ROOT, make_config, run_snakemake
from fixtures.report import (
    CONFIG_BLOB,
    MODEL_REPO,
    MODEL_SHA,
    RECIPE_SHA,
    VAL_KEY,
    VERL_SHA,
    RunSpec,
    write_cpu_stages,
    write_eval,
    write_gpu_checks,
    write_training,
)
from hy3rl import report
from hy3rl.errors import StageError
from hy3rl.layout import REPORT_FIGURES, REPORT_FILES, Layout
from hy3rl.redact import Redactor, make_redactor
from hy3rl.report.read import by_step, selection_view
from hy3rl.settings import Config
from hy3rl.smk import triggers
from hy3rl.verl_log import merge_metrics

OUTPUTS = sorted(n for n, _ in REPORT_FILES)
TRAINING_FIGURES = ("fig_training_published.png", "fig_training_extra.png", "fig_step_time.png")

SECRET_WANDB = "9f8e7d6c5b4a39281706f5e4d3c2b1a098765432"  # 40 hex, like a W&B key
SECRET_HF = "hf_QwErTyUiOpAsDfGhJkLzXcVbNm123456"
SECRET_SK = "sk-proj-AbCdEfGhIjKlMnOpQrStUv987654"
SECRET_PW = "correct-horse-battery-staple"


def _config(gpu: bool = True, **sections: dict) -> Config:
    """The embedded default, smaller figures (a faster suite), and a 2 x 8 GPU cluster."""
    sections["report"] = {"dpi": 60, **sections.get("report", {})}
    if gpu:
        sections["cluster"] = {"gpu": True, "nodes": 2, "gpus_per_node": 8}
    return make_config(**sections)


def _gather(results: Path, cfg: Config):
    return report.gather(cfg, Layout.of_results(results))


def _build(results: Path, cfg: Config, env: dict | None = None) -> dict[str, bytes]:
    return report.build(cfg, Layout.of_results(results), env or {})


def _run(results: Path, cfg: Config, out: Path | None = None) -> Path:
    """report.run into ``out`` (default: the layout's report folder); returns the folder."""
    layout = Layout.of_results(results)
    outputs = {n: (out / n if out else Path(layout.report_file(n))) for n in OUTPUTS}
    report.run(cfg, results=layout, outputs=outputs)
    return outputs["index.html"].parent


def _csv(blob: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(blob.decode())))


# ---- merging the attempts' logs ----


def test_merge_of_overlapping_attempts_keeps_the_later_values(tmp_path: Path):
    results = tmp_path / "results" / "r"
    written = write_training(results, RunSpec(attempts=[(0, 27, 20), (20, 40, 40)]))
    found = _gather(results, _config())
    assert [log.attempt for log in found.logs] == [1, 2]
    assert found.logs[0].dropped_tail and not found.logs[1].dropped_tail
    merged = found.metrics  # no train/metrics.jsonl: the report merged the attempt logs
    assert sorted(merged) == list(range(0, 41))
    # steps 21..26 were logged by both attempts: the later attempt's values win
    for step in range(21, 27):
        assert merged[step] == written[2][step] != written[1][step]
    # step 20: attempt 1 trained it (and saved); attempt 2 only re-ran validation there
    assert merged[20]["critic/rewards/mean"] == written[1][20]["critic/rewards/mean"]
    assert merged[20][VAL_KEY] == written[2][20][VAL_KEY] != written[1][20][VAL_KEY]
    for step in range(1, 20):
        assert merged[step] == written[1][step]
    # the line cut mid-write (step 27 of attempt 1) is not read; attempt 2 logged 27
    assert 27 in merged and merged[27] == written[2][27]


def test_report_merges_attempts_itself_when_no_merged_file(report_run_factory):
    results = report_run_factory()
    found = _gather(results, _config())
    assert "merged here from 2 attempt log(s)" in found.metrics_source
    assert any("truncated last line dropped" in n for n in found.notes)
    x, _ = report.series(found.metrics, "critic/rewards/mean")
    assert list(x) == list(range(1, 41))
    assert report.resume_points(found.attempts, found.logs) == [(20, "attempt 2 (job 4712)")]


def test_train_stage_merged_file_is_used_and_compared(report_run_factory):
    """train/metrics.jsonl (written by hy3rl.train's own merge) is what the report plots; it
    agrees with the report's merge of the attempt logs, and a disagreement is reported."""
    results = report_run_factory(RunSpec(merged_file=True))
    found = _gather(results, _config())
    assert found.metrics_source.startswith("train/metrics.jsonl")
    assert found.metrics == by_step(merge_metrics(log.records for log in found.logs))
    assert not any("differs" in n for n in found.notes)
    path = results / "train/metrics.jsonl"
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    lines[5]["data"]["critic/rewards/mean"] = -1.0
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    found = _gather(results, _config())
    assert any("differs from the merge of the attempt logs" in n and
               f"different values: [{lines[5]['step']}]" in n for n in found.notes)


def _real_training(results: Path) -> list[dict]:
    """Attempt records, merged log and sentinel written by the train stage's own code
    (hy3rl.train): attempt 1 crashes at step 27 after its step-20 checkpoint, attempt 2 is
    killed without writing its record (closed later by finalise_stale), attempt 3 resumes
    from step 30 and finishes at 40."""
    from dataclasses import asdict

    from fixtures.report import step_metrics, val_metrics
    from hy3rl import train
    from hy3rl.atomic import write_json_atomic

    layout = Layout.of_results(results, checkpoint_root=str(results.parent / "ckpt"))
    layout.checkpoint_dir.mkdir(parents=True)
    tdir = Path(layout.train_attempts)
    tdir.mkdir(parents=True)
    plan = [(0, 27, 20, "trainer failed (FAILED, exit 1)"), (20, 33, 30, None),
            (30, 40, 40, "succeeded")]
    for k, (first, last, ckpt, reason) in enumerate(plan, start=1):
        rng = np.random.default_rng(k)
        lines = [(first, val_metrics(first, rng))] + [
            (s, step_metrics(s, k, rng, 10, 10)) for s in range(first + 1, last + 1)]
        Path(layout.attempt_metrics(k)).write_text(
            "".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in lines))
        rec = asdict(train.AttemptRecord(
            attempt=k, run="r", executor="slurm", slurm_job_id=str(900 + k), host="gpu-n1",
            nodes=["gpu-n1", "gpu-n2"], num_nodes=2, gpus_per_node=8, cpus_per_node=96,
            submission_id=f"r-{900 + k}-{k}", checkpoint_dir=str(layout.checkpoint_dir),
            start_step=first, started_at=f"2026-11-2{k}T08:00:00+00:00",
            metrics_log=Path(layout.attempt_metrics(k)).name, log_dir=f"attempt-{k}/"))
        if reason is None:  # killed: the record stays `running` until the next attempt
            write_json_atomic(Path(layout.attempt_record(k)), rec)
            assert train.finalise_stale(layout, ckpt) == [k]
        else:
            rec = train.close_record(rec, layout, ckpt, reason, 0 if k == 3 else 1)
            rec["ended_at"] = f"2026-11-2{k}T10:00:00+00:00"  # 2 h of wall time
            rec["wall_s"] = 7200.0
            write_json_atomic(Path(layout.attempt_record(k)), rec)
    train.write_merged(tdir, Path(layout.train_metrics))
    train.write_done(layout, 40, 40, Path(layout.train_done), Path(layout.train_metrics))
    return [json.loads(Path(layout.attempt_record(k)).read_text()) for k in (1, 2, 3)]


def _real_eval(results: Path, tags: tuple[str, ...], n: int = 8) -> dict[str, dict]:
    """metrics.json per tag and summary.json written by hy3rl.metrics from scores in the
    graders' format (30 problems x n samples; some format failures, truncations, a
    timeout, and two-way majority ties)."""
    from hy3rl import metrics as mmod

    rng = np.random.default_rng(5)
    base_p = rng.uniform(0, 1, size=30)
    scores: dict[str, list[dict]] = {}
    for j, tag in enumerate(tags):
        rows = []
        for pid in range(30):
            gt = str(100 + pid)
            for k in range(n):
                ok = bool(rng.random() < min(1.0, base_p[pid] + 0.1 * j))
                fmt = not ok and rng.random() < 0.1  # right answer, "Answer: 123." format
                pred = gt if ok else (f"{gt}." if fmt else str(k % 2))
                status = "timeout" if (pid, k) == (3, 0) else "ok"
                rows.append({
                    "problem_id": str(pid), "sample_index": k, "ground_truth": gt,
                    "finish_reason": "length" if rng.random() < 0.05 else "stop",
                    "num_tokens": int(rng.integers(100, 900)),
                    "math_dapo": {"status": status, "acc": ok and status == "ok",
                                  "score": 1.0 if ok else -1.0, "pred": pred},
                    "math_verify": {"status": "ok", "acc": ok or fmt, "pred": pred.rstrip(".")}})
        scores[tag] = rows
    boot = {"resamples": 500, "level": 0.95, "seed": 3}
    out = {}
    for tag in tags:
        m = mmod.compute_metrics(scores[tag], tag, {"math_dapo": {"implementation": "x"}}, boot,
                                 scores["base"] if tag != "base" else None)
        mmod.write_json_atomic(results / "eval" / tag / "metrics.json", m, indent=1)
        out[tag] = m
    mmod.write_json_atomic(results / "eval" / "summary.json",
                           mmod.summarize(list(out.values())), indent=1)
    return out


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_report_reads_what_train_and_evaluate_really_write(tmp_path: Path):
    """The contract with the upstream stages, through their own writers (hy3rl.train's
    records, merge and sentinel; hy3rl.metrics' metrics.json): every number on the page
    and in the CSVs is the one those files hold."""
    results = tmp_path / "results" / "r"
    records = _real_training(results)
    ev = _real_eval(results, ("base", "step20", "final"))
    write_cpu_stages(results, "r")
    files = _build(results, _config())
    html = files["index.html"].decode()

    stages = {r["stage"]: r for r in _csv(files["stages.csv"])}
    assert stages["train"]["status"] == "done"
    assert "final step 40, 3 attempt(s), 10 step(s) lost in total" in stages["train"]["detail"]
    att = _csv(files["attempts.csv"])
    assert [(a["attempt"], a["start_step"], a["end_step"], a["last_logged_step"],
             a["steps_lost"]) for a in att] == [
        (str(r["attempt"]), str(r["start_step"]), str(r["end_step"]),
         str(r["last_logged_step"]), str(r["steps_lost"])) for r in records]
    assert [a["steps_lost"] for a in att] == ["7", "3", "0"]
    assert att[1]["exit_reason"].startswith("killed (no record written")
    assert att[1]["gpu_hours"] == ""  # unknown wall time: not guessed
    assert float(att[0]["gpu_hours"]) == pytest.approx(2 * 2 * 8)
    assert "attempt 2 (job 902) resumed at step 20" in html
    assert "attempt 3 (job 903) resumed at step 30" in html
    # the train stage's merged file is plotted, and it agrees with the report's own merge
    assert "41 logged steps, from train/metrics.jsonl (merged by the train stage)" in html
    assert not any("differs" in n for n in _gather(results, _config()).notes)

    head = {(r["tag"], r["grader"].removesuffix(" (primary)")): r
            for r in _csv(files["eval_headline.csv"])}
    assert len(head) == 6
    for (tag, g), row in head.items():
        m, bg = ev[tag], ev[tag]["by_grader"][g]
        assert float(row["avg@n"]) == pytest.approx(bg["avg@n"], rel=1e-5)
        assert float(row["sampling_se"]) == pytest.approx(bg["sampling_se"], rel=1e-5)
        lo, hi = (float(x) for x in row["bootstrap_95"].strip("[]").split(","))
        assert (lo, hi) == pytest.approx(
            (bg["bootstrap_ci"]["low"], bg["bootstrap_ci"]["high"]), rel=1e-3)
        assert [p.split("=")[0] for p in row["pass@k"].split("; ")] == [
            "pass@1", "pass@2", "pass@4", "pass@8"]
        for part in row["pass@k"].split("; ") + row["maj@k"].split("; "):
            name, val = part.split("=")
            kind, k = name.split("@")
            assert float(val) == pytest.approx(bg[f"{kind}@k"][k], abs=6e-3)
        assert float(row["pass@n"]) == pytest.approx(bg["pass@k"]["8"], rel=1e-5)
        assert float(row["maj@n"]) == pytest.approx(bg["maj@k"]["8"], rel=1e-5)
        assert float(row["format_failure_rate"]) == pytest.approx(m["format_failure_rate"],
                                                                  rel=1e-5)
        assert int(row["format_failures"]) == m["format_failures"] > 0
        assert float(row["truncation_rate"]) == pytest.approx(m["truncation_rate"], rel=1e-5)
        assert row["grader_failures"] == ('{"error": 0, "timeout": 1}' if g == "math_dapo"
                                          else "0")
    assert head[("final", "math_dapo")]["step"] == "40"  # from train/done.json
    assert head[("step20", "math_dapo")]["step"] == "20" and head[("base", "math_dapo")][
        "step"] == ""
    at_k = html.split('id="eval-at-k"', 1)[1].split("</table>", 1)[0]
    assert "<th>pass@8</th>" in at_k and "<th>maj@1</th>" in at_k
    final_md = ev["final"]["by_grader"]["math_dapo"]
    assert f"<td>{final_md['pass@k']['2']:.4g}</td>" in at_k
    assert f"<td>{final_md['maj@k']['4']:.4g}</td>" in at_k
    pp = _csv(files["eval_per_problem.csv"])
    assert [r["problem"] for r in pp] == [str(i) for i in range(30)]
    for r in pp:
        for tag in ("base", "step20", "final"):
            want = ev[tag]["per_problem"][int(r["problem"])]["math_dapo"]["acc"]
            assert float(r[tag]) == pytest.approx(want, rel=1e-5)
    paired = {r["grader"]: r for r in _csv(files["eval_paired.csv"])}
    for g in ("math_dapo", "math_verify"):
        vb = ev["final"]["vs_base"][g]
        assert float(paired[g]["diff"]) == pytest.approx(vb["mean_diff"], rel=1e-5)
        assert float(paired[g]["base_avg"]) == pytest.approx(
            ev["base"]["by_grader"][g]["avg@n"], rel=1e-5)
        ci = vb["paired_bootstrap_ci"]
        assert paired[g]["paired_interval"] == f"[{ci['low']:.4g}, {ci['high']:.4g}]"


def _heldout_and_selection(results: Path, values: dict[str, float],
                           select: bool = True) -> dict | None:
    """The held-out set's metrics.json per tag (hy3rl.metrics on synthetic scores: every
    problem right with probability ``values[tag]``), eval/selected.json (hy3rl.selection,
    the default rule) and summary.json with both (hy3rl.metrics.run_summary), over the
    test set's files _real_eval wrote."""
    from hy3rl import metrics as mmod
    from hy3rl import selection

    rng = np.random.default_rng(11)
    boot = {"resamples": 500, "level": 0.95, "seed": 3}
    paths, base = {}, None
    for tag, p in values.items():
        rows = [{"problem_id": str(pid), "sample_index": k, "ground_truth": "7",
                 "finish_reason": "stop", "num_tokens": 10,
                 "math_dapo": {"status": "ok", "acc": (ok := bool(rng.random() < p)),
                               "score": 1.0, "pred": "7" if ok else "1"},
                 "math_verify": {"status": "ok", "acc": ok, "pred": "7" if ok else "1"}}
                for pid in range(30) for k in range(8)]
        step = {"base": None, "final": 40}[tag] if tag in ("base", "final") else int(tag[4:])
        m = mmod.compute_metrics(rows, f"heldout/{tag}", {}, boot, base, step=step)
        base = base or rows
        paths[tag] = results / "eval" / "heldout" / tag / "metrics.json"
        mmod.write_json_atomic(paths[tag], m, indent=1)
    test = {t: results / "eval" / t / "metrics.json" for t in ("base", "step20", "final")}
    doc = None
    if select:
        doc = selection.run({"set": "dapo_heldout", "grader": "math_dapo", "metric": "avg",
                             "k": None}, heldout=paths, test=test,
                            out=results / "eval" / "selected.json", boot=boot)
    mmod.run_summary(metrics=list(test.values()), heldout=list(paths.values()),
                     selected=results / "eval" / "selected.json" if select else None,
                     out=results / "eval" / "summary.json")
    return doc


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_the_checkpoint_selection_section_and_the_curves(tmp_path: Path):
    """Held-out results and eval/selected.json: the rule as the plan holds it, a change
    since training started, the candidates, the selected step, AIME-2024 of base, selected
    and final with the paired comparison and the verdict, the curves figure; the held-out
    tags stay out of the test set's tables. Mid-run (no selected.json yet): the selection
    so far over what exists."""
    results = tmp_path / "results" / "r"
    _real_training(results)
    _real_eval(results, ("base", "step20", "final"))
    write_cpu_stages(results, "r")
    doc = _heldout_and_selection(results, {"base": 0.2, "step20": 0.8, "final": 0.4})
    plan_path = results / "preflight" / "plan.json"
    plan = json.loads(plan_path.read_text())
    plan["selection"] = {**doc["rule"], "set_sha256": "ab" * 32}
    plan_path.write_text(json.dumps(plan))
    first = results / "train" / "attempts" / "attempt-1.json"
    rec = json.loads(first.read_text())
    rec["selection"] = {**plan["selection"], "metric": "pass", "key": "math_dapo pass@8"}
    first.write_text(json.dumps(rec))
    cfg = _config(eval={"steps": [20]})
    files = _build(results, cfg)
    html = files["index.html"].decode()
    section = html.split('<h2 id="selection">', 1)[1].split('<h2 id="provenance">', 1)[0]
    assert "highest math_dapo avg@8 on held-out set dapo_heldout (sha256 abababababab)" in \
        section and "preflight/plan.json" in section
    assert "The rule changed after training started</strong>: was highest math_dapo pass@8" \
        in section and "now highest math_dapo avg@8" in section
    cands = section.split('id="selection-candidates"', 1)[1].split("</table>", 1)[0]
    assert [c["tag"] for c in doc["candidates"]] == ["step20", "final"]
    for c in doc["candidates"]:
        assert f"<td>{c['tag']}</td><td>{c['step']}</td><td>{c['value']:.4g}</td>" \
               f"<td>[{c['interval'][0]:.4g}, {c['interval'][1]:.4g}]</td>" in cands
    assert "base (reference, never a candidate)" in cands
    assert "Selected: <strong>step20</strong> (step 20)" in section
    test = section.split('id="selection-test"', 1)[1].split("</table>", 1)[0]
    assert [r["role"] for r in doc["test"]["rows"]] == ["base", "selected", "final"]
    sel_row = doc["test"]["rows"][1]
    assert f"<td>selected</td><td>step20</td><td>20</td><td>math_dapo</td>" \
           f"<td>{sel_row['math_dapo_avg']:.4g}</td>" in test
    paired = section.split('id="selection-paired"', 1)[1].split("</table>", 1)[0]
    d = doc["selected_vs_final"]["math_dapo"]
    assert f"<td>math_dapo</td><td>{sel_row['math_dapo_avg']:.4g}</td>" in paired
    assert f"<td>{d['mean_diff']:.4g}</td>" in paired
    assert doc["verdict"] in section.replace("&#39;", "'")
    assert 'id="fig-eval-curves"' in section
    img = mpimg.imread(io.BytesIO(files["fig_eval_curves.png"]), format="png")
    assert img.shape[0] > 200 and float(np.std(img[..., :3])) > 0.05
    # the held-out tags are not test-set rows
    assert {r["tag"] for r in _csv(files["eval_headline.csv"])} == {"base", "step20", "final"}
    assert list(_csv(files["eval_per_problem.csv"])[0]) == ["problem", "base", "step20",
                                                             "final"]
    found = _gather(results, cfg)
    assert [e.tag for e in found.heldout] == ["heldout/base", "heldout/step20", "heldout/final"]
    assert [e.step for e in found.heldout] == [None, 20, 40]

    # mid-run: final not evaluated on the held-out set yet, no selected.json
    (results / "eval" / "selected.json").unlink()
    (results / "eval" / "heldout" / "final" / "metrics.json").unlink()
    (results / "eval" / "summary.json").unlink()
    html = _build(results, cfg)["index.html"].decode()
    section = html.split('<h2 id="selection">', 1)[1].split('<h2 id="provenance">', 1)[0]
    assert "selection so far (1 of 2 steps evaluated)" in section
    assert "Selected: <strong>step20</strong>" in section
    assert "Not evaluated on the held-out set yet: final." in section


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_a_report_without_a_selection_rule(tmp_path: Path, report_run_factory):
    """eval.select null (and a plan that says so): the section says so, and the curves
    figure still has the test set's steps and the held-out set's avg@n."""
    results = report_run_factory()
    _heldout_and_selection(results, {"base": 0.3, "step20": 0.5, "final": 0.6}, select=False)
    plan_path = results / "preflight" / "plan.json"
    plan_path.write_text(json.dumps({**json.loads(plan_path.read_text()), "selection": None}))
    files = _build(results, _config(eval={"select": None}))
    html = files["index.html"].decode()
    section = html.split('<h2 id="selection">', 1)[1].split('<h2 id="provenance">', 1)[0]
    assert 'id="selection-none"' in section and "No selection rule configured" in section
    assert 'id="fig-eval-curves"' in section and 'id="selection-candidates"' not in section
    assert {r["tag"] for r in _csv(files["eval_headline.csv"])} == {"base", "step20", "final"}
    # neither a held-out set nor a rule (no held-out files): the page renders all the same
    cfg = _config(data={"heldout": None}, eval={"select": None})
    assert "No selection rule configured" in _build(
        report_run_factory(RunSpec(eval_tags=("base",)), run="plain"), cfg)["index.html"].decode()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_bad_log_line_names_file_and_line(tmp_path: Path, report_run_factory):
    """In-process a StageError naming file and line; `hy3rl report` prints it and exits 1,
    writing nothing."""
    results = report_run_factory()
    log = results / "train/attempts/attempt-2.metrics.jsonl"
    lines = log.read_text().splitlines()
    lines[3] = lines[3][:25]
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(StageError, match=r"attempt-2\.metrics\.jsonl:4: not a verl metrics"):
        _gather(results, _config())
    site = tmp_path / "site.yaml"
    site.write_text(json.dumps({"run": {"name": results.name,
                                        "results_root": str(results.parent)}}))
    proc = subprocess.run(
        [sys.executable, "-m", "hy3rl.cli", "report", "--configfile",
         str(REPO_ROOT / "config/config.yaml"), "--configfile", str(site)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "hy3rl report: error:" in proc.stderr
    assert "attempt-2.metrics.jsonl:4: not a verl metrics line" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (results / "report").exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_the_console_script_writes_every_file(tmp_path: Path, report_run_factory):
    """`hy3rl report --configfile ...` writes the layout's report files of the run."""
    results = report_run_factory()
    site = tmp_path / "site.yaml"
    site.write_text(json.dumps({"run": {"name": results.name,
                                        "results_root": str(results.parent)},
                                "cluster": {"gpu": True, "nodes": 2, "gpus_per_node": 8},
                                "train": {"cpu": {"enable": False}},
                                "report": {"dpi": 50}}))
    proc = subprocess.run(
        [sys.executable, "-m", "hy3rl.cli", "report", "--configfile",
         str(REPO_ROOT / "config/config.yaml"), "--configfile", str(site)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"report: wrote {len(OUTPUTS)} files" in proc.stdout
    assert sorted(p.name for p in (results / "report").iterdir()) == OUTPUTS


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_a_report_of_a_run_still_going(tmp_path: Path, report_run_factory):
    """`hy3rl report --out DIR` mid-run: what exists now, the open training attempt marked
    running, written to DIR only (the run's own report outputs, which Snakemake compares
    by time, are not touched; nothing of the run is written)."""
    results = report_run_factory()
    rec_path = results / "train" / "attempts" / "attempt-2.json"
    rec = json.loads(rec_path.read_text())
    for key in ("ended_at", "wall_s"):
        rec.pop(key, None)
    rec["exit_reason"] = rec["outcome"] = "running"  # as hy3rl.train opens a record
    rec_path.write_text(json.dumps(rec))
    (results / "train" / "done.json").unlink(missing_ok=True)
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    site = tmp_path / "site.yaml"
    site.write_text(json.dumps({"run": {"name": results.name,
                                        "results_root": str(results.parent)},
                                "cluster": {"gpu": True, "nodes": 2, "gpus_per_node": 8},
                                "train": {"cpu": {"enable": False}},
                                "report": {"dpi": 50}}))
    out = tmp_path / "now"
    proc = subprocess.run(
        [sys.executable, "-m", "hy3rl.cli", "report", "--configfile",
         str(REPO_ROOT / "config/config.yaml"), "--configfile", str(site), "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS
    assert not (results / "report").exists()
    assert {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()} == before
    html = (out / "index.html").read_text()
    assert 'id="running"' in html
    assert "training attempt 2 (job 4712, started " in html and "is running" in html


# ---- the page and its files ----


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_full_resumed_run_renders_every_section(report_run_factory):
    results = report_run_factory()
    files = _build(results, _config())
    assert sorted(files) == OUTPUTS
    for name in REPORT_FIGURES:
        assert files[name].startswith(b"\x89PNG\r\n\x1a\n")
        img = mpimg.imread(io.BytesIO(files[name]), format="png")
        assert img.shape[0] > 200 and float(np.std(img[..., :3])) > 0.05, name
    html = files["index.html"].decode()
    assert html.count("data:image/png;base64,") == len(REPORT_FIGURES)
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html)
    assert "attempt 2 (job 4712) resumed at step 20" in html
    assert "Actor loss: actor/loss" in html
    assert 'id="training-not-run"' not in html and 'id="training-no-metrics"' not in html
    assert 'id="claims-table"' in html

    stages = {r["stage"]: r for r in _csv(files["stages.csv"])}
    assert stages["train"]["status"] == "done" and stages["evaluate"]["status"] == "done"
    assert stages["check_bridge"]["status"] == "not run"
    assert stages["cluster_probe"]["status"] == "pass"
    attempts = _csv(files["attempts.csv"])
    assert [(a["slurm_job_id"], a["start_step"], a["steps_lost"]) for a in attempts] == [
        ("4711", "0", "6"), ("4712", "20", "0")]
    # GPU-hours: wall hours x 2 nodes x 8 GPUs
    assert float(attempts[0]["gpu_hours"]) == pytest.approx(27 * 0.25 * 16)
    claims = {r["claim"].split(" (")[0]: r for r in _csv(files["claims.csv"])}
    assert "% of 40 steps under 0.015" in claims["Probability drift"]["this_run"]
    assert claims["Probability drift"]["verdict"].startswith("above 0.015 on")
    assert claims["Reward trend"]["verdict"] == "rising"
    assert "first 0.8" in claims["AIME validation"]["this_run"]

    head = _csv(files["eval_headline.csv"])
    assert {(r["tag"], r["grader"]) for r in head} == {
        (t, g) for t in ("base", "step20", "final")
        for g in ("math_dapo (primary)", "math_verify")}
    assert all(r["bootstrap_95"].startswith("[") and "pass@32=" in r["pass@k"] for r in head)
    per_problem = _csv(files["eval_per_problem.csv"])
    assert len(per_problem) == 30 and list(per_problem[0]) == [
        "problem", "base", "step20", "final"]
    paired = _csv(files["eval_paired.csv"])
    assert {r["grader"] for r in paired} == {"math_dapo", "math_verify"}
    prov = _csv(files["provenance.csv"])
    values = " ".join(r["value"] for r in prov)
    assert "220e9039902c6db56860e2afd659803dc34ec005 (verified = pin)" in values
    assert _config().hash in values
    assert "ab" * 32 in values  # the train parquet's sha256
    assert "job 4711; nodes gpu-n1,gpu-n2" in values


def test_actor_loss_panel_says_which_key():
    keys = {"actor/pg_loss", "actor/entropy"}
    assert report.pick_key(keys, ["actor/loss", "actor/pg_loss"]) == "actor/pg_loss"
    assert report.pick_key(keys | {"actor/loss"}, ["actor/loss", "actor/pg_loss"]) == "actor/loss"
    assert report.pick_key({"val-core/aime/acc/mean@32"}, ["val-core/math_dapo/acc/mean@1"],
                           r"val-core/.+/acc/mean@\d+") == "val-core/aime/acc/mean@32"


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_curves_mark_resume_points(report_run_factory):
    """The same run drawn without its second attempt's record differs exactly by the
    resume markers: the markers are really drawn."""
    results = report_run_factory()
    found = _gather(results, _config())
    red = Redactor()
    with_marks, _ = report.fig_published(found, red, 60, False, 0.015, "")
    found.attempts[1].start_step = None
    found.logs = []  # no other source of the resume step
    without, _ = report.fig_published(found, red, 60, False, 0.015, "")
    a = mpimg.imread(io.BytesIO(with_marks), format="png")
    b = mpimg.imread(io.BytesIO(without), format="png")
    assert a.shape == b.shape and not np.array_equal(a, b)


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_secrets_never_reach_any_output(report_run_factory, tmp_path: Path, monkeypatch):
    spec = RunSpec(extra_attempt={
        "exit_reason": f"launcher error: HF_TOKEN={SECRET_HF} rejected",
        "env": {"WANDB_API_KEY": SECRET_WANDB, "DB_PASSWORD": SECRET_PW},
    })
    results = report_run_factory(spec)
    cfg = _config(report={"redact_env": ["MY_VAULT"]}, train={
        "env": {"NOTES_API_KEY": SECRET_PW},  # under a secret-looking name
        "verl_overrides": {"trainer.notes": f"+trainer.wandb_key={SECRET_SK} x=1"},  # free text
    })
    monkeypatch.setenv("WANDB_API_KEY", SECRET_WANDB)
    monkeypatch.setenv("HF_TOKEN", SECRET_HF)
    monkeypatch.setenv("MY_VAULT", "vault-value-1234")
    monkeypatch.setenv("SLURM_JOB_NAME", f"job-with-{SECRET_SK}")
    out = _run(results, cfg, tmp_path / "out")  # the environment: this process's
    names = sorted(p.name for p in out.iterdir())
    assert names == OUTPUTS
    secrets = [SECRET_WANDB, SECRET_HF, SECRET_SK, SECRET_PW, "vault-value-1234"]
    for p in out.iterdir():
        blob = p.read_bytes()
        for s in secrets:
            assert s.encode() not in blob, f"{s} in {p.name}"
            assert base64.b64encode(s.encode())[:20] not in blob, f"{s} (base64) in {p.name}"
    html = (out / "index.html").read_text()
    assert html.count("[REDACTED]") >= 5  # the redaction really ran on planted values
    # not over-redacted: git SHAs, hashes, token budgets and tokenizer paths stay
    for kept in (VERL_SHA, RECIPE_SHA, cfg.hash, "resources/tiny-hy3"):
        assert kept in html
    assert "[REDACTED]" in (out / "provenance.csv").read_text()
    assert "[REDACTED]" in (out / "config.resolved.yaml").read_text()
    env_rows = {r["name"]: r["value"] for r in _csv((out / "provenance.csv").read_bytes())
                if r["section"] == "environment variable"}
    assert env_rows["HF_TOKEN"] == "[REDACTED]"  # listed (HF_ prefix), its value never


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_model_provenance_repo_revision_and_manifest_hash(report_run_factory):
    """The checkpoint's provenance (hy3rl.hub.provenance of model/manifest.json): repo id,
    the resolved revision (a 40-hex SHA, not taken for a secret) and the manifest's sha256,
    in the table, the CSV and the stages; the manifest's file list stays out of the page."""
    import hashlib

    results = report_run_factory(training=False)
    manifest = results / "model" / "manifest.json"
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    files = _build(results, _config(gpu=False), env={"HF_TOKEN": SECRET_HF})
    prov = {r["name"]: r for r in _csv(files["provenance.csv"])}
    assert prov["model.source"]["value"] == f"hub: {MODEL_REPO}"
    assert prov["model.revision"]["value"] == MODEL_SHA
    assert prov["model.manifest_sha256"]["value"] == digest
    assert prov["model.files"]["value"] == "2 files, 6040002316 bytes"
    assert prov["model.source"]["section"] == "model (model/manifest.json)"
    stages = {r["stage"]: r for r in _csv(files["stages.csv"])}
    assert stages["model"]["status"] == "done" and MODEL_SHA in stages["model"]["detail"]
    html = files["index.html"].decode()
    for kept in (MODEL_REPO, MODEL_SHA, digest):
        assert kept in html
    assert CONFIG_BLOB not in html  # the file list is not rendered
    assert all(SECRET_HF.encode() not in blob for blob in files.values())
    # A manifest that is not one is named, not rendered.
    manifest.write_text("{}")
    with pytest.raises(StageError, match="model/manifest.json: not a model manifest"):
        _build(results, _config(gpu=False))


def test_redactor_rules():
    r = make_redactor(
        {"WANDB_API_KEY": SECRET_WANDB, "TOKENIZERS_PARALLELISM": "false", "HOME": "/root"},
        [{"deps": {"verl": {"commit": "220e9039902c6db56860e2afd659803dc34ec005"}},
          "train": {"ppo_max_token_len_per_gpu": 30720, "hf_token": SECRET_HF,
                    "tokenizer": "resources/tiny-hy3"}}],
    )
    assert r.text(f"key {SECRET_WANDB} end") == "key [REDACTED] end"
    assert r.text("other 40-hex 0123456789abcdef0123456789abcdef01234567") == \
        "other 40-hex [REDACTED]"
    assert r.text("pin 220e9039902c6db56860e2afd659803dc34ec005") == \
        "pin 220e9039902c6db56860e2afd659803dc34ec005"
    assert r.text("sha256 " + "ab" * 32) == "sha256 " + "ab" * 32
    assert r.text(f"x {SECRET_HF} y {SECRET_SK}") == "x [REDACTED] y [REDACTED]"
    assert r.text("--password=hunter2hunter") == "--password=[REDACTED]"
    assert r.text("ppo_max_token_len_per_gpu: 30720") == "ppo_max_token_len_per_gpu: 30720"
    assert r.text("false and /root stay") == "false and /root stay"
    # a secret name inside a run of key characters (the key starts where the run starts),
    # and after a long run with none (base64 in a page: scanned once, not quadratically)
    assert r.text("env:x.run-1.hf_token_b=abcdefgh") == "env:x.run-1.hf_token_b=[REDACTED]"
    assert r.text("QUJD" * 20000 + " api_key: 'abcdefgh'") == "QUJD" * 20000 + \
        " api_key: '[REDACTED]'"
    assert r({"api_key": "abcdefgh", "total_num_tokens": 5, "tokenizer": "resources/t"}) == {
        "api_key": "[REDACTED]", "total_num_tokens": 5, "tokenizer": "resources/t"}


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_rule_params_hold_no_config_and_the_job_redacts_it(report_run_factory):
    """The rule's params are its rerun triggers only (run.name and the report section:
    they reach `snakemake --report`'s record); the job reads the whole config, hashes it
    unredacted (cfg.hash) and redacts it before anything is written, SHAs kept."""
    cfg = _config(train={"verl_overrides": {"+trainer.wandb_api_key": SECRET_SK}})
    params = triggers(cfg.raw, "run.name", "report")
    assert {v.split("=", 1)[0] for v in params.values()} == {
        "run.name", *(f"report.{k}" for k in cfg.raw["report"])}
    assert SECRET_SK not in json.dumps(params)
    files = _build(report_run_factory(), cfg)
    assert cfg.hash in files["index.html"].decode()
    assert cfg.hash in files["provenance.csv"].decode()
    resolved = files["config.resolved.yaml"].decode()
    assert "+trainer.wandb_api_key: '[REDACTED]'" in resolved
    assert VERL_SHA in resolved  # pinned SHAs kept
    assert all(SECRET_SK.encode() not in blob for blob in files.values())


# ---- partial runs ----


def test_embedded_default_without_training_renders_and_says_why(tmp_path: Path):
    """No training (cluster.gpu false, the CPU path off): ONE explanation, why and how to run
    training, instead of figures of empty panels; every declared PNG still exists, the three
    training figures as one small figure saying the same."""
    results = tmp_path / "results" / "tiny-default"
    results.mkdir(parents=True)
    cfg = _config(gpu=False, train={"cpu": {"enable": False}})
    out = _run(results, cfg)
    assert out == results / "report"
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS
    html = (out / "index.html").read_text()
    assert html.count('id="training-not-run"') == 1
    notice = html.split('id="training-not-run"', 1)[1].split("</div>", 1)[0]
    assert "Training did not run: cluster.gpu is false" in notice
    assert "cluster.gpu: true" in notice and "snakemake --profile profiles/slurm" in notice
    assert 'id="training-no-metrics"' not in html and "no data" not in html
    for fig in ("fig-training-published", "fig-training-extra", "fig-step-time",
                "fig-eval-checkpoints", "fig-eval-heatmap"):  # no eval here either
        assert f'id="{fig}"' not in html
    assert 'id="claims-table"' not in html and "Nothing to compare" in html
    pngs = {name: (out / name).read_bytes() for name in REPORT_FIGURES}
    assert len({pngs[n] for n in TRAINING_FIGURES}) == 1  # one small figure, three names
    small = mpimg.imread(io.BytesIO(pngs[TRAINING_FIGURES[0]]), format="png")
    assert small.shape[0] < 200  # at 60 dpi (the six panels: 510 px high)
    assert float(np.std(small[..., :3])) > 0.02  # the text is really drawn
    for name in ("fig_eval_checkpoints.png", "fig_eval_heatmap.png"):
        assert pngs[name].startswith(b"\x89PNG\r\n\x1a\n")
    stages = {r["stage"]: r for r in _csv((out / "stages.csv").read_bytes())}
    assert stages["train"]["status"] == "not run" and "cluster.gpu is false" in \
        stages["train"]["detail"]
    assert stages["deps"]["status"] == "missing"
    assert _csv((out / "attempts.csv").read_bytes()) == []
    # the pins still show, from the config (no lock file)
    assert "220e9039902c6db56860e2afd659803dc34ec005" in (out / "provenance.csv").read_text()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_cpu_stages_and_base_eval_only(report_run_factory):
    """The embedded default after its CPU stages: no training, base evaluation only."""
    results = report_run_factory(RunSpec(eval_tags=("base",)), training=False)
    files = _build(results, _config(gpu=False, train={"cpu": {"enable": False}}))
    stages = {r["stage"]: r["status"] for r in _csv(files["stages.csv"])}
    assert stages == {"deps": "done", "data": "done", "model": "done",
                      "check_checkpoint": "pass (some not run)",
                      "check_bridge": "not run", "cluster_probe": "not run",
                      "preflight": "pass", "rehearsal": "not run", "train": "not run",
                      "evaluate": "done"}
    assert len(_csv(files["eval_per_problem.csv"])) == 30
    assert _csv(files["eval_paired.csv"]) == []
    html = files["index.html"].decode()
    assert "Not available: needs both" in html
    # one explanation of the missing training; the evaluation's two figures are shown
    assert html.count('id="training-not-run"') == 1
    assert html.count("data:image/png;base64,") == 2 and 'id="fig-eval-heatmap"' in html


def test_generation_not_run_is_shown_with_its_reason(report_run_factory):
    """backend vllm on a machine without vLLM: evaluate writes samples.meta.json with status
    `not run` and no metrics (docs/formats/eval.md); the page says so, not `missing`."""
    results = report_run_factory(RunSpec(eval_tags=()), training=False)
    meta = {"tag": "base", "status": "not run", "reason": "vllm is not installed here",
            "backend": "vllm"}
    (results / "eval/base").mkdir(parents=True)
    (results / "eval/base/samples.meta.json").write_text(json.dumps(meta))
    stages = {r["stage"]: r for r in _csv(_build(results, _config(gpu=False))["stages.csv"])}
    assert stages["evaluate"]["status"] == "not run"
    assert stages["evaluate"]["detail"] == \
        "eval/base/samples.meta.json: vllm is not installed here"


def test_eval_tags_not_in_the_summary_are_ignored(report_run_factory):
    results = report_run_factory(RunSpec(eval_tags=("base", "step20")), training=False)
    (results / "eval/summary.json").write_text(json.dumps({"tags": ["base"], "rows": []}))
    found = _gather(results, _config(gpu=False))
    assert [e.tag for e in found.evals] == ["base"]
    assert any("eval/step20/metrics.json ignored" in n for n in found.notes)


def test_rule_outputs_come_from_the_layout_with_captions():
    """The rule keeps no list of its own: its outputs are hy3rl.layout.REPORT_FILES (through
    common.smk's report_outputs), each with its caption (report/captions/<stem>.rst).
    test_snakemake_report_rule_and_snakemake_report checks them in `snakemake --report`."""
    rule = (REPO_ROOT / "rules/report.smk").read_text()
    assert "**report_outputs()" in rule
    for name, _ in REPORT_FILES:
        assert name not in rule, f"{name} spelled in rules/report.smk"
        assert (REPO_ROOT / "report/captions" / f"{name.split('.')[0]}.rst").is_file(), name


# ---- through Snakemake ----


def _report_rule_inputs(workdir: Path, configfile: Path) -> list[str]:
    """The report rule's inputs as Snakemake resolves them (other stages' targets of `all`),
    read from the dry run's missing-input message while only `report` may run."""
    # the target first: after --allowed-rules (nargs +) it would be one more allowed rule,
    # and the run would build `all`
    proc = run_snakemake(["report", "-n", "-c1", "--configfile", str(configfile),
                          "--allowed-rules", "report"], workdir, check=False)
    text = proc.stdout + proc.stderr
    assert "Missing input files for rule report" in text, text[-3000:]
    block = text.split("affected files:", 1)[1]
    return [ln.strip() for ln in block.splitlines() if ln.startswith("        ")]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("gpu", [False, True], ids=["embedded-default", "with-training"])
def test_snakemake_report_rule_and_snakemake_report(gpu: bool, tmp_path: Path):
    """`snakemake report` (only the report rule may run; the other stages' targets are made
    here in their documented formats) writes every declared output, and `snakemake --report`
    packs them into its own record (checked once, with training)."""
    workdir = tmp_path / "wd"
    workdir.mkdir()
    configfile = tmp_path / "test.yaml"
    over = {"run": {"name": "wf"}, "report": {"dpi": 50}}
    if gpu:
        over["cluster"] = {"gpu": True, "nodes": 2, "gpus_per_node": 8}
        # a secret in the config itself (the job reads it from snakemake.config)
        over["train"] = {"verl_overrides": {"+trainer.wandb_api_key": SECRET_SK},
                         "cpu": {"enable": False}}
    configfile.write_text(json.dumps(over))
    results = workdir / "results" / "wf"
    inputs = _report_rule_inputs(workdir, configfile)
    assert "results/wf/deps/lock.json" in inputs
    assert any(i.startswith("results/wf/train/") for i in inputs) == gpu
    write_cpu_stages(results, "wf")
    if gpu:
        write_gpu_checks(results)
        write_training(results, RunSpec(), "wf")
    write_eval(results, ("base", "step20", "final") if gpu else ("base",))
    for rel in inputs:  # targets whose content the report does not read
        (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (workdir / rel).touch()
    env = {"WANDB_API_KEY": SECRET_WANDB, "HF_TOKEN": SECRET_HF}  # as a real job would have
    run_snakemake(["report", "-c1", "--configfile", str(configfile), "--allowed-rules",
                   "report"], workdir, env=env)
    out = results / "report"
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS
    html = (out / "index.html").read_text()
    assert ('id="training-not-run"' in html) != gpu
    log = (results / "logs" / "report.log").read_text()
    assert f"report: wrote {len(OUTPUTS)} files" in log and "run.name=" in log  # the triggers
    assert SECRET_SK not in log
    if not gpu:
        return  # one `snakemake --report` (below) is enough
    run_snakemake(["report", "--configfile", str(configfile), "--allowed-rules", "report",
                   "--report", str(tmp_path / "record.zip")], workdir)
    with zipfile.ZipFile(tmp_path / "record.zip") as z:
        names = z.namelist()
        blobs = {n: z.read(n) for n in names}
    for name in OUTPUTS:
        assert any(n.endswith(f"/{name}") for n in names), f"{name} not in snakemake --report"
    for where, blob in [*blobs.items(), *((p.name, p.read_bytes()) for p in out.iterdir())]:
        for secret in (SECRET_WANDB, SECRET_HF, SECRET_SK):
            assert secret.encode() not in blob, f"{secret} in {where}"


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_provenance_names_the_runtime_of_the_newest_attempt(report_run_factory):
    """The training runtime (docs/formats/train.md `runtime`) as the newest attempt record
    names it: the image digest, both sides' Ray; an interpreter with its freeze; an older
    record without one says so."""
    pinned = "docker://verlai/verl@sha256:" + "4f" * 32
    runtime = {"prefix": f"apptainer exec --nv {pinned}", "python": "python3",
               "identity": {"kind": "image", "id": pinned, "image": pinned,
                            "digest": "sha256:" + "4f" * 32, "pinned": True},
               "ray": {"client": "2.60.0", "cluster": "2.60.0", "match": True}}
    results = report_run_factory(RunSpec(extra_attempt={"runtime": runtime}))
    first = results / "train" / "attempts" / "attempt-1.json"
    rec = json.loads(first.read_text())
    rec["runtime"] = {"prefix": "apptainer exec docker://verlai/verl:old", "python": "python3",
                      "identity": {"kind": "image", "id": "docker://verlai/verl:old",
                                   "tag": "old", "pinned": False, "note": "a tag can move"}}
    first.write_text(json.dumps(rec))

    def rows(files):
        return {r["name"]: r for r in _csv(files["provenance.csv"])
                if r["section"].startswith("training runtime")}

    files = _build(results, _config())
    prov = rows(files)
    assert prov["identity (image)"]["value"] == pinned
    assert prov["identity (image)"]["section"] == \
        "training runtime (train/attempts/attempt-2.json)"
    assert prov["prefix"]["value"] == f"apptainer exec --nv {pinned}"
    assert prov["ray (job client / cluster)"]["value"] == "2.60.0 / 2.60.0 (equal)"
    assert "identity note" not in prov and "verl:old" not in files["provenance.csv"].decode()
    assert pinned in files["index.html"].decode()

    rec = json.loads((results / "train" / "attempts" / "attempt-2.json").read_text())
    rec["runtime"] = {"prefix": "", "python": "/venv/bin/python", "ray": None, "identity": {
        "kind": "interpreter", "id": "python 3.11.9 /venv/bin/python, freeze sha256:ab (2 "
        "packages)", "python": "/venv/bin/python", "python_version": "3.11.9",
        "freeze_sha256": "ab" * 32, "freeze_method": "pip freeze --all",
        "freeze": ["ray==2.60.0", "verl==0.7.0"]}}
    (results / "train" / "attempts" / "attempt-2.json").write_text(json.dumps(rec))
    prov = rows(_build(results, _config()))
    assert prov["prefix"]["value"] == "(none: the workflow env)"
    assert prov["identity (interpreter)"]["value"].startswith("python 3.11.9 /venv/bin/python")
    assert prov["freeze_sha256"]["value"] == "ab" * 32
    assert prov["freeze (pip freeze --all)"]["value"] == "ray==2.60.0; verl==0.7.0"
    assert prov["ray (job client / cluster)"]["value"] == "not recorded (no Ray head ran)"

    del rec["runtime"]
    (results / "train" / "attempts" / "attempt-2.json").write_text(json.dumps(rec))
    assert rows(_build(results, _config()))["runtime"]["value"] == "not recorded"


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_failed_attempts_link_their_logs_and_the_wandb_run(report_run_factory, tmp_path):
    """Attempt 1 hung: the page lists its outcome, exit reason and error, and links its
    folder, each node's Ray logs (copied by hy3rl.nodelogs, listed as the train stage lists
    them) and the hang diagnostics, relative to the page; a log the record names that is
    gone is shown as not found. Attempt 2 succeeded: no logs listed. Both logged into one
    W&B run, whose page attempt 2's output printed."""
    from hy3rl.nodelogs import copy_ray_logs

    results = report_run_factory()
    layout = Layout.of_results(results)
    ray_logs = tmp_path / "ray" / "session_2026-11-21_08-00-00_1" / "logs"
    ray_logs.mkdir(parents=True)
    for name in ("raylet.out", "gcs_server.out", "worker-01-02.err"):
        (ray_logs / name).write_text(f"{name}: last lines\n")
    copy_ray_logs(tmp_path / "ray", Path(layout.attempt_node_logs(1, "gpu-n1")), 10**6)
    attempts_dir = Path(layout.train_attempts)
    node_logs = {"gpu-n1": sorted(str(f.relative_to(attempts_dir)) for f in Path(
        layout.attempt_node_logs(1, "gpu-n1")).rglob("*") if f.is_file()),
        "gpu-n2": ["attempt-1/nodes/gpu-n2/raylet.out"]}  # named, but gone since
    hang = Path(layout.attempt_diagnostics(1)).resolve()  # the launcher writes it absolute
    (hang / "gpu-n1").mkdir(parents=True)
    (hang / "gpu-n1" / "ray_stack.txt").write_text("stack\n")
    run_id, url = "test-run-0123abcd", "https://wandb.ai/lab/hy3rl/runs/test-run-0123abcd"
    for k, extra in ((1, {"outcome": "hung", "exit_reason": "hung at step 28 (no progress "
                          "for 31 min)", "failed_at_step": 28,
                          "error": "RuntimeError: NCCL watchdog timeout", "node_logs": node_logs,
                          "diagnostics": {"dir": str(hang), "collected": {"gpu-n1": [
                              "ray_stack.txt"]}, "not_collected": {}},
                          "wandb": {"run_id": run_id, "project": "hy3rl", "url": None}}),
                     (2, {"outcome": "succeeded", "node_logs": {},
                          "wandb": {"run_id": run_id, "project": "hy3rl", "url": url}})):
        path = Path(layout.attempt_record(k))
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))

    files = _build(results, _config())
    att = _csv(files["attempts.csv"])
    assert [(a["outcome"], a["failed_at_step"], a["error"]) for a in att] == [
        ("hung", "28", "RuntimeError: NCCL watchdog timeout"), ("succeeded", "", "")]
    html = files["index.html"].decode()
    failed = re.search(r'<ul id="failed-attempts">(.*?)</ul>', html, re.S).group(1)
    assert "attempt 1: hung, hung at step 28 (no progress for 31 min); error " \
           "<code>RuntimeError: NCCL watchdog timeout</code>" in failed
    assert "attempt 2" not in failed
    links = dict((label, href) for href, label in re.findall(r'<a href="([^"]+)">([^<]+)</a>',
                                                             failed))
    assert set(links) == {"attempt folder", "gpu-n1: raylet.out", "gpu-n1: gcs_server.out",
                          "gpu-n1: worker-01-02.err", "gpu-n1: copied.json",
                          "hang diagnostics"}
    def target(href: str) -> Path:  # where the link leads from the page's folder
        return Path(os.path.normpath(Path(layout.report_dir) / href))

    for label, href in links.items():
        assert not href.startswith("/") and target(href).exists(), (label, href)
    assert target(links["gpu-n1: raylet.out"]).read_text() == "raylet.out: last lines\n"
    assert target(links["hang diagnostics"]).resolve() == hang
    assert "gpu-n2: raylet.out (<code>train/attempts/attempt-1/nodes/gpu-n2/raylet.out</code>" \
           " not found)" in failed
    runs = re.findall(r'<p class="wandb-run">(.*?)</p>', html, re.S)
    assert len(runs) == 1
    assert f"W&amp;B run <code>{run_id}</code> (project hy3rl; attempts 1, 2): " \
           f'<a href="{url}">{url}</a>' in runs[0]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_an_offline_wandb_run_is_named_without_a_link(report_run_factory):
    results = report_run_factory(RunSpec(extra_attempt={
        "wandb": {"run_id": "test-run-0123abcd", "project": None, "url": None}}))
    html = _build(results, _config())["index.html"].decode()
    runs = re.findall(r'<p class="wandb-run">(.*?)</p>', html, re.S)
    assert len(runs) == 1 and "<code>test-run-0123abcd</code> (project n/a; attempts 1, 2)" \
        in runs[0] and "no run page recorded" in runs[0] and "href" not in runs[0]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_the_time_profile_and_the_supervisors_model(report_run_factory):
    """Where the training time went (verl's own validation share: TEST_FREQ) from the
    merged metrics, and the newest attempt's time model (hy3rl.watchdog) with its basis."""
    results = report_run_factory()
    rec_path = results / "train" / "attempts" / "attempt-2.json"
    rec = json.loads(rec_path.read_text())
    rec["timing"] = {"startup_s": 5400.0, "phase": "shutdown", "model": {
        "step": {"s": 960.0, "learned": True, "samples": 19},
        "save": {"s": 4100.0, "learned": False, "samples": 0}}}
    rec_path.write_text(json.dumps(rec))
    files = _build(results, _config())
    html = files["index.html"].decode()
    from hy3rl.verl_log import merged_attempts

    metrics = [r["data"] for r in merged_attempts(results / "train" / "attempts")]
    test = sum(d.get("timing_s/testing", 0.0) for d in metrics)
    total = sum(d.get("timing_s/step", 0.0) for d in metrics) + test
    assert test > 0
    assert f"{100 * test / total:.3g}%: a larger <code>TEST_FREQ</code> lowers it" in html
    assert "<td>step</td><td>16</td><td>learned from 19 record(s)</td>" in html
    assert "<td>save</td><td>68.3</td><td>allowance (not seen yet)</td>" in html


def test_a_changed_candidate_set_is_a_rule_change_with_both_versions(report_run_factory):
    """Training started with eval.steps [20, 40]; step 60 was added later (plan.json
    re-rendered): the report says the rule changed and shows both candidate sets. A record
    from before the candidate set was recorded (a sentence there) is no change."""
    from hy3rl.preflight.heldout import selection_record

    results = report_run_factory()
    cfg = _config(eval={"steps": [20, 40, 60]})
    first = results / "train" / "attempts" / "attempt-1.json"
    rec = json.loads(first.read_text())
    rec["selection"] = selection_record(_config(eval={"steps": [20, 40]}), None)
    first.write_text(json.dumps(rec))
    plan_path = results / "preflight" / "plan.json"
    plan = json.loads(plan_path.read_text())
    plan["selection"] = selection_record(cfg, None)
    plan_path.write_text(json.dumps(plan))
    # the view the page's selection-changed note renders (its template line is checked by
    # test_the_checkpoint_selection_section_and_the_curves)
    changed = selection_view(_gather(results, cfg))["changed"]
    assert changed["attempt"] == 1 and changed["record"] == "train/attempts/attempt-1.json"
    assert changed["was"].startswith("highest math_dapo avg@")
    assert changed["was"].endswith("among step20, step40 and final")
    assert changed["now"].endswith("among step20, step40, step60 and final")
    rec["selection"]["candidates"] = "eval.steps and final"  # written before the change
    first.write_text(json.dumps(rec))
    assert selection_view(_gather(results, cfg))["changed"] is None


def test_a_runtime_change_between_attempts_is_a_column_and_a_marker(report_run_factory,
                                                                    monkeypatch):
    """Attempt 1 ran in one image, attempt 2 (resumed at step 20) in another (train.runtime
    is operational): attempts.csv and the page's attempts table name each attempt's runtime,
    the page says where it changed, and every training curve has a marker at step 20 naming
    the new runtime (the figures' artists, not their pixels). The same runtime twice: none."""
    from hy3rl.report import figures, page
    from hy3rl.report.read import runtime_changes

    old = "docker://verlai/verl@sha256:" + "1a" * 32
    new = "docker://verlai/verl@sha256:" + "2b" * 32
    results = report_run_factory()
    for k, image in ((1, old), (2, new)):
        path = results / "train" / "attempts" / f"attempt-{k}.json"
        rec = json.loads(path.read_text())
        rec["runtime"] = {"prefix": f"apptainer exec --nv {image}", "python": "python3",
                          "identity": {"kind": "image", "id": image, "image": image,
                                       "pinned": True}}
        path.write_text(json.dumps(rec))
    cfg = _config()
    found = _gather(results, cfg)
    assert [a.runtime for a in found.attempts] == [old, new]
    assert runtime_changes(found.attempts, found.logs) == [(20, "attempt 2", old, new)]

    files = page.render(found, Redactor(), {}, {n: b"" for n in REPORT_FIGURES}, [])
    assert [r["runtime"] for r in _csv(files["attempts.csv"])] == [old, new]
    html = files["index.html"].decode()
    table = html.split('<table id="attempts">', 1)[1].split("</table>", 1)[0]
    assert "<th>runtime</th>" in table and old in table and new in table
    note = html.split('id="runtime-changes">', 1)[1].split("</p>", 1)[0]
    assert f"attempt 2 at step 20: was <code>{old}</code>, now <code>{new}</code>" in note

    drawn = []
    monkeypatch.setattr(figures, "_png", lambda fig, *a, **k: drawn.append(fig) or b"")
    red = Redactor()
    figures.fig_published(found, red, 40, False, 0.015, "")
    figures.fig_extra(found, red, 40, "")
    figures.fig_step_time(found, red, 40, "")
    axes = [ax for fig in drawn for ax in fig.axes  # the twin axis shares its panel's marker
            if not ax.get_ylabel().startswith("share")]
    assert len(axes) == 6 + 4 + 1
    for ax in axes:
        marks = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [20, 20]
                 and ln.get_linestyle() == "--"]
        assert len(marks) == 1, ax.get_title()
        label = marks[0].get_label()
        assert label.startswith("_") or (label.startswith(
            "runtime change: attempt 2 @ 20: docker://verlai/verl@") and label.endswith(
            "2b" * 11)), label  # unlabelled (a panel without data), or naming the new one
    assert any(ln.get_label().startswith("runtime change") for ax in axes
               for ln in ax.get_lines())

    path = results / "train" / "attempts" / "attempt-1.json"
    rec = json.loads(path.read_text())
    rec["runtime"]["identity"]["id"] = new
    path.write_text(json.dumps(rec))
    found = _gather(results, cfg)
    assert runtime_changes(found.attempts, found.logs) == []
    assert 'id="runtime-changes"' not in page.render(
        found, Redactor(), {}, {n: b"" for n in REPORT_FIGURES}, [])["index.html"].decode()


def test_local_changes_a_run_ran_are_shown_with_their_diff(report_run_factory):
    """Issue 40: a run under deps.allow_local_changes shows each clone's diff and its sha256
    (the run identity's pin.<name> suffix); a clean run shows none."""
    results = report_run_factory()
    clean = _build(results, _config())["index.html"].decode()
    assert 'id="local-diff-' not in clean
    path = results / "preflight" / "plan.json"
    plan = json.loads(path.read_text())
    plan["pins"] = {"verl": {"path": "/deps/verl", "head": "220e" * 10, "changes": [
        " M verl/trainer/config/actor/actor.yaml"], "diff_sha256": "cd" * 32,
        "diff": "-  weight_decay: 0.01\n+  weight_decay: 0.5\n"}}
    path.write_text(json.dumps(plan))
    files = _build(results, _config())
    html = files["index.html"].decode()
    assert 'id="local-diff-verl"' in html and "+  weight_decay: 0.5" in html
    rows = {r["name"]: r["value"] for r in _csv(files["provenance.csv"])}
    assert rows["verl diff sha256 (pin.verl)"] == "cd" * 32
