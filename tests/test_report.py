"""The report stage on run directories made here (tests/fixtures/report.py): verl-format
attempt logs of a resumed run whose attempts overlap, the other stages' documented files,
secrets planted in the environment and config, and the embedded default with no training."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import zipfile
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from fixtures.common import REPO_ROOT, run_snakemake
from fixtures.report import (
    RECIPE_SHA,
    VAL_KEY,
    VERL_SHA,
    RunSpec,
    write_cpu_stages,
    write_eval,
    write_gpu_checks,
    write_training,
)
from hy3rl import config as cfgmod
from hy3rl import report

SECRET_WANDB = "9f8e7d6c5b4a39281706f5e4d3c2b1a098765432"  # 40 hex, like a W&B key
SECRET_HF = "hf_QwErTyUiOpAsDfGhJkLzXcVbNm123456"
SECRET_SK = "sk-proj-AbCdEfGhIjKlMnOpQrStUv987654"
SECRET_PW = "correct-horse-battery-staple"


def _config(gpu: bool = True) -> dict:
    cfg = cfgmod.load(REPO_ROOT / "config/config.yaml")
    cfg["report"]["dpi"] = 60  # smaller figures: a faster suite
    if gpu:
        cfg["cluster"].update(gpu=True, nodes=2, gpus_per_node=8)
    return cfg


def _csv(blob: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(blob.decode())))


# ---- merging the attempts' logs ----


def test_merge_of_overlapping_attempts_keeps_the_later_values(tmp_path: Path):
    results = tmp_path / "results" / "r"
    written = write_training(results, RunSpec(attempts=[(0, 27, 20), (20, 40, 40)]))
    logs = [report.read_verl_log(results / f"train/attempts/attempt-{k}.metrics.jsonl")
            for k in (1, 2)]
    assert logs[0].dropped_tail and not logs[1].dropped_tail
    merged = report.merge_logs(logs)
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
    found = report.gather(results, _config())
    assert "merged here from 2 attempt log(s)" in found.metrics_source
    assert any("truncated last line dropped" in n for n in found.notes)
    x, _ = report.series(found.metrics, "critic/rewards/mean")
    assert list(x) == list(range(1, 41))
    assert report.resume_points(found.attempts, found.logs) == [(20, "attempt 2 (job 4712)")]


def test_train_stage_merged_file_is_used_and_compared(report_run_factory):
    """train/metrics.jsonl (written by hy3rl.train's own merge) is what the report plots; it
    agrees with the report's merge of the attempt logs, and a disagreement is reported."""
    results = report_run_factory(RunSpec(merged_file=True))
    found = report.gather(results, _config())
    assert found.metrics_source.startswith("train/metrics.jsonl")
    assert found.metrics == report.merge_logs(found.logs)
    assert not any("differs" in n for n in found.notes)
    path = results / "train/metrics.jsonl"
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    lines[5]["data"]["critic/rewards/mean"] = -1.0
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    found = report.gather(results, _config())
    assert any("differs from the merge of the attempt logs" in n and
               f"different values: [{lines[5]['step']}]" in n for n in found.notes)


def test_bad_log_line_names_file_and_line(tmp_path: Path, report_run_factory):
    results = report_run_factory()
    log = results / "train/attempts/attempt-2.metrics.jsonl"
    lines = log.read_text().splitlines()
    lines[3] = lines[3][:25]
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(report.ReportInputError, match=r"attempt-2\.metrics\.jsonl:4: not valid"):
        report.gather(results, _config())
    rc = report.main(["--results", str(results), "--config-json", json.dumps(_config())])
    assert rc == 1
    assert not (results / "report" / "index.html").exists()


# ---- the page and its files ----


def test_full_resumed_run_renders_every_section(report_run_factory):
    results = report_run_factory()
    files = report.build(results, _config(), {})
    assert set(files) == set(report.OUTPUTS)
    for name in report.FIGURES:
        assert files[name].startswith(b"\x89PNG\r\n\x1a\n")
        img = mpimg.imread(io.BytesIO(files[name]), format="png")
        assert img.shape[0] > 200 and float(np.std(img[..., :3])) > 0.05, name
    html = files["index.html"].decode()
    assert html.count("data:image/png;base64,") == len(report.FIGURES)
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html)
    assert "attempt 2 (job 4712) resumed at step 20" in html
    assert "Actor loss: actor/loss" in html
    assert "id=\"training-not-run\"" not in html

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
    assert cfgmod.config_hash(_config()) in values
    assert "ab" * 32 in values  # the train parquet's sha256
    assert "job 4711; nodes gpu-n1,gpu-n2" in values


def test_actor_loss_panel_says_which_key():
    keys = {"actor/pg_loss", "actor/entropy"}
    assert report.pick_key(keys, ["actor/loss", "actor/pg_loss"]) == "actor/pg_loss"
    assert report.pick_key(keys | {"actor/loss"}, ["actor/loss", "actor/pg_loss"]) == "actor/loss"
    assert report.pick_key({"val-core/aime/acc/mean@32"}, ["val-core/math_dapo/acc/mean@1"],
                           r"val-core/.+/acc/mean@\d+") == "val-core/aime/acc/mean@32"


def test_curves_mark_resume_points(report_run_factory):
    """The same run drawn without its second attempt's record differs exactly by the
    resume markers: the markers are really drawn."""
    results = report_run_factory()
    found = report.gather(results, _config())
    red = report.Redactor()
    with_marks, _ = report.fig_published(found, red, 60, False, 0.015, "")
    found.attempts[1].start_step = None
    found.logs = []  # no other source of the resume step
    without, _ = report.fig_published(found, red, 60, False, 0.015, "")
    a = mpimg.imread(io.BytesIO(with_marks), format="png")
    b = mpimg.imread(io.BytesIO(without), format="png")
    assert a.shape == b.shape and not np.array_equal(a, b)


def test_secrets_never_reach_any_output(report_run_factory, tmp_path: Path, monkeypatch):
    spec = RunSpec(extra_attempt={
        "exit_reason": f"launcher error: HF_TOKEN={SECRET_HF} rejected",
        "env": {"WANDB_API_KEY": SECRET_WANDB, "DB_PASSWORD": SECRET_PW},
    })
    results = report_run_factory(spec)
    cfg = _config()
    cfg["report"]["redact_env"] = ["MY_VAULT"]
    cfg["run"]["notes_api_key"] = SECRET_PW  # planted (not a schema key: never validated here)
    cfg["run"]["extra_overrides"] = [f"+trainer.wandb_key={SECRET_SK}", "x=1"]
    monkeypatch.setenv("WANDB_API_KEY", SECRET_WANDB)
    monkeypatch.setenv("HF_TOKEN", SECRET_HF)
    monkeypatch.setenv("MY_VAULT", "vault-value-1234")
    monkeypatch.setenv("SLURM_JOB_NAME", f"job-with-{SECRET_SK}")
    out = tmp_path / "out"
    assert report.main(["--results", str(results), "--out-dir", str(out),
                        "--config-json", json.dumps(cfg)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(report.OUTPUTS)
    secrets = [SECRET_WANDB, SECRET_HF, SECRET_SK, SECRET_PW, "vault-value-1234"]
    for p in out.iterdir():
        blob = p.read_bytes()
        for s in secrets:
            assert s.encode() not in blob, f"{s} in {p.name}"
            assert base64.b64encode(s.encode())[:20] not in blob, f"{s} (base64) in {p.name}"
    html = (out / "index.html").read_text()
    assert html.count("[REDACTED]") >= 5  # the redaction really ran on planted values
    # not over-redacted: git SHAs, hashes, token budgets and tokenizer paths stay
    for kept in (VERL_SHA, RECIPE_SHA, cfgmod.config_hash(cfg), "resources/tiny-hy3"):
        assert kept in html
    assert "[REDACTED]" in (out / "provenance.csv").read_text()
    assert "[REDACTED]" in (out / "config.resolved.yaml").read_text()


def test_redactor_rules():
    r = report.make_redactor(
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
    assert r({"api_key": "abcdefgh", "total_num_tokens": 5, "tokenizer": "resources/t"}) == {
        "api_key": "[REDACTED]", "total_num_tokens": 5, "tokenizer": "resources/t"}


# ---- partial runs ----


def test_embedded_default_without_training_renders_and_says_why(tmp_path: Path):
    results = tmp_path / "results" / "tiny-default"
    results.mkdir(parents=True)
    cfg = _config(gpu=False)
    assert report.main(["--results", str(results), "--config-json", json.dumps(cfg)]) == 0
    out = results / "report"
    assert sorted(p.name for p in out.iterdir()) == sorted(report.OUTPUTS)
    html = (out / "index.html").read_text()
    assert 'id="training-not-run"' in html
    assert "training did not run: cluster.gpu is false" in html
    stages = {r["stage"]: r for r in _csv((out / "stages.csv").read_bytes())}
    assert stages["train"]["status"] == "not run" and "cluster.gpu is false" in \
        stages["train"]["detail"]
    assert stages["deps"]["status"] == "missing"
    assert _csv((out / "attempts.csv").read_bytes()) == []
    # the pins still show, from the config (no lock file)
    assert "220e9039902c6db56860e2afd659803dc34ec005" in (out / "provenance.csv").read_text()


def test_cpu_stages_and_base_eval_only(report_run_factory):
    """The embedded default after its CPU stages: no training, base evaluation only."""
    results = report_run_factory(RunSpec(eval_tags=("base",)), training=False)
    files = report.build(results, _config(gpu=False), {})
    stages = {r["stage"]: r["status"] for r in _csv(files["stages.csv"])}
    assert stages == {"deps": "done", "data": "done", "check_checkpoint": "pass (some not run)",
                      "check_bridge": "not run", "cluster_probe": "not run",
                      "preflight": "pass", "train": "not run",
                      "evaluate": "done"}
    assert len(_csv(files["eval_per_problem.csv"])) == 30
    assert _csv(files["eval_paired.csv"]) == []
    assert "Not available: needs both" in files["index.html"].decode()


def test_eval_tags_not_in_the_summary_are_ignored(report_run_factory):
    results = report_run_factory(RunSpec(eval_tags=("base", "step20")), training=False)
    (results / "eval/summary.json").write_text(json.dumps({"tags": ["base"], "rows": []}))
    found = report.gather(results, _config(gpu=False))
    assert [e.tag for e in found.evals] == ["base"]
    assert any("eval/step20/metrics.json ignored" in n for n in found.notes)


def test_rule_declares_every_output_as_report_item():
    text = (REPO_ROOT / "rules/report.smk").read_text()
    for name in report.OUTPUTS:
        m = re.search(rf'report\(\s*f"{{REPORT_DIR}}/{re.escape(name)}",\s*caption="([^"]+)"',
                      text)
        assert m, f"{name} is not a report() output of rule report"
        assert (REPO_ROOT / "rules" / m.group(1)).resolve().is_file(), m.group(1)


# ---- through Snakemake ----


def _report_rule_inputs(workdir: Path, configfile: Path) -> list[str]:
    """The report rule's inputs as Snakemake resolves them (other stages' targets of `all`),
    read from the dry run's missing-input message while only `report` may run."""
    proc = run_snakemake(["-n", "-c1", "--configfile", str(configfile), "--allowed-rules",
                          "report", "report"], workdir, check=False)
    text = proc.stdout + proc.stderr
    assert "Missing input files for rule report" in text, text[-3000:]
    block = text.split("affected files:", 1)[1]
    return [ln.strip() for ln in block.splitlines() if ln.startswith("        ")]


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
    run_snakemake(["-c1", "--configfile", str(configfile), "--allowed-rules", "report",
                   "report"], workdir, env=env)
    out = results / "report"
    assert sorted(p.name for p in out.iterdir()) == sorted(report.OUTPUTS)
    html = (out / "index.html").read_text()
    assert ('id="training-not-run"' in html) != gpu
    assert (results / "logs" / "report.log").read_text().startswith("report: wrote")
    if not gpu:
        return  # one `snakemake --report` (below) is enough
    run_snakemake(["--configfile", str(configfile), "--allowed-rules", "report",
                   "--report", str(tmp_path / "record.zip"), "report"], workdir)
    with zipfile.ZipFile(tmp_path / "record.zip") as z:
        names = z.namelist()
        blobs = {n: z.read(n) for n in names}
    for name in report.OUTPUTS:
        assert any(n.endswith(f"/{name}") for n in names), f"{name} not in snakemake --report"
    for where, blob in [*blobs.items(), *((p.name, p.read_bytes()) for p in out.iterdir())]:
        for secret in (SECRET_WANDB, SECRET_HF):
            assert secret.encode() not in blob, f"{secret} in {where}"
