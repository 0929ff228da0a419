"""Checkpoint selection (hy3rl.selection): the pure rule over recorded values (highest wins,
a tie to the earliest step, missing steps listed and never chosen, pass@k/maj@k keys, a
final at an evaluated step counted once), and selected.json from metrics.json documents
that hy3rl.metrics itself computed from synthetic scores."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from fixtures.common import make_config
from hy3rl import metrics, selection
from hy3rl.layout import Layout, heldout_tag
from hy3rl.metrics import compute_metrics
from hy3rl.selection import SelectionError, metric_value, select

BOOT = {"resamples": 2000, "level": 0.95, "seed": 7}
RULE = {"set": "dapo_heldout", "grader": "math_dapo", "metric": "avg", "k": None}


def _c(tag, step, value):
    return {"tag": tag, "step": step, "value": value}


# ---- the pure rule ----


def test_highest_value_wins():
    got = select([_c("step10", 10, 0.4), _c("step20", 20, 0.6), _c("final", 30, 0.5)], RULE)
    assert (got["tag"], got["step"], got["value"]) == ("step20", 20, 0.6)
    assert got["ties"] == [] and got["missing"] == [] and got["considered"] == 3


def test_a_tie_goes_to_the_earliest_step_whatever_the_order():
    cands = [_c("final", 40, 0.6), _c("step30", 30, 0.6), _c("step10", 10, 0.2),
             _c("step20", 20, 0.6)]
    got = select(cands, RULE)
    assert got["tag"] == "step20" and got["ties"] == ["step30", "final"]
    assert "earliest step wins" in got["reason"]
    # equal up to float rounding (the same accuracy summed in another order) is a tie
    assert select([_c("step20", 20, 0.1 + 0.2), _c("step10", 10, 0.3)], RULE)["tag"] == "step10"


def test_a_missing_step_is_listed_and_never_chosen():
    got = select([_c("step10", 10, 0.3), _c("step20", 20, None), _c("final", 30, 0.1)], RULE)
    assert got["tag"] == "step10" and got["missing"] == ["step20"] and got["considered"] == 2


def test_all_missing_selects_nothing_and_says_why():
    got = select([_c("step10", 10, None), _c("final", None, None)], RULE)
    assert got["tag"] is None and got["step"] is None and got["considered"] == 0
    assert got["missing"] == ["step10", "final"]
    assert "no candidate has a held-out math_dapo avg@n" in got["reason"]
    assert "no checkpoint tag" in select([], RULE)["reason"]


def test_a_final_of_unknown_step_loses_a_tie():
    got = select([_c("final", None, 0.5), _c("step20", 20, 0.5)], RULE)
    assert got["tag"] == "step20" and got["ties"] == ["final"]


def _scores(p: np.ndarray, n: int, seed: int, answers: bool = False) -> list[dict]:
    """Scores in the graders' format: problem i right with probability p[i]."""
    rng = np.random.default_rng(seed)
    rows = []
    for pid, pi in enumerate(p):
        for k in range(n):
            ok = bool(rng.random() < pi)
            pred = "7" if ok else (str(k % 3) if answers else "[INVALID]")
            rows.append({"problem_id": str(pid), "sample_index": k, "ground_truth": "7",
                         "finish_reason": "stop", "num_tokens": 10,
                         "math_dapo": {"status": "ok", "acc": ok, "score": 1.0, "pred": pred},
                         "math_verify": {"status": "ok", "acc": ok, "pred": pred}})
    return rows


def test_metric_value_reads_avg_pass_and_maj_keys():
    m = compute_metrics(_scores(np.linspace(0.1, 0.9, 12), 8, 1, answers=True), "heldout/step10",
                        {}, BOOT)
    bg = m["by_grader"]
    assert metric_value(m, RULE) == bg["math_dapo"]["avg@n"]
    assert metric_value(m, {**RULE, "metric": "pass", "k": 4}) == bg["math_dapo"]["pass@k"]["4"]
    assert metric_value(m, {**RULE, "metric": "pass"}) == bg["math_dapo"]["pass@k"]["8"]
    assert metric_value(m, {**RULE, "grader": "math_verify", "metric": "maj", "k": 2}) == \
        bg["math_verify"]["maj@k"]["2"]
    assert metric_value(m, {**RULE, "metric": "maj", "k": 3}) is None  # no such k
    assert metric_value({"by_grader": {}}, RULE) is None
    # the interval of pass@k is the problem bootstrap of the per-problem estimator
    ci = selection.metric_interval(m, {**RULE, "metric": "pass", "k": 4}, BOOT)
    assert ci[0] <= bg["math_dapo"]["pass@k"]["4"] <= ci[1]
    assert selection.metric_interval(m, RULE, BOOT) == [bg["math_dapo"]["bootstrap_ci"]["low"],
                                                        bg["math_dapo"]["bootstrap_ci"]["high"]]
    assert selection.metric_interval(m, {**RULE, "metric": "maj", "k": 2}, BOOT) is None


def test_a_final_at_an_evaluated_step_is_one_candidate():
    cands = [_c("step10", 10, 0.2), _c("step20", 20, 0.5), _c("final", 20, 0.5)]
    kept, same = selection.dedup_final(cands)
    assert [c["tag"] for c in kept] == ["step10", "step20"] and same == "step20"
    assert selection.dedup_final(cands[:2] + [_c("final", 30, 0.1)])[1] is None


def test_candidate_tags_follow_the_evaluated_tags():
    cfg = make_config(cluster={"gpu": True}, eval={"steps": [20, 10], "final": True})
    assert selection.candidate_tags(cfg) == ["step20", "step10", "final"]  # not heldout/
    # the embedded default trains on the CPU path; without it there are no checkpoints
    assert selection.candidate_tags(make_config(eval={"steps": [10]})) == ["step10", "final"]
    assert selection.candidate_tags(make_config(eval={"steps": [10]},
                                                train={"cpu": {"enable": False}})) == []


# ---- selected.json from real metrics documents ----


N_PROB, N = 30, 8


def _write_tag(root: Path, tag: str, p: np.ndarray, seed: int, base: list[dict] | None,
               step: int | None) -> tuple[Path, list[dict]]:
    scores = _scores(p, N, seed)
    m = compute_metrics(scores, tag, {"math_dapo": {"implementation": "x"}}, BOOT, base,
                        step=step)
    path = root / tag / "metrics.json"
    metrics.write_json_atomic(path, m, indent=1)
    return path, scores


def _run_dir(root: Path, heldout_p: dict[str, np.ndarray], test_p: dict[str, np.ndarray],
             seeds: dict[str, int] | None = None) -> tuple[dict[str, Path], dict[str, Path]]:
    """metrics.json of each tag on both sets, by hy3rl.metrics; steps: step<N> -> N,
    final -> 30. ``seeds``: the scores' seed per test tag (the same seed and p: the same
    samples, as one checkpoint evaluated twice)."""
    seeds = seeds or {}
    out: dict[str, dict[str, Path]] = {"heldout": {}, "test": {}}
    for where, ps in (("heldout", heldout_p), ("test", test_p)):
        base = None
        for j, (tag, p) in enumerate(ps.items()):
            step = 30 if tag == "final" else (int(tag[4:]) if tag.startswith("step") else None)
            name = heldout_tag(tag) if where == "heldout" else tag
            seed = seeds.get(tag, 100 + j) if where == "test" else 200 + j
            path, scores = _write_tag(root, name, p, seed, base, step)
            base = base or scores
            out[where][tag] = path
    return out["heldout"], out["test"]


def test_run_writes_selected_json_and_a_large_gap_differs(tmp_path: Path):
    lo, hi = np.full(N_PROB, 0.15), np.full(N_PROB, 0.85)
    heldout, test = _run_dir(
        tmp_path, {"base": lo, "step10": lo, "step20": hi, "final": lo},
        {"base": lo, "step10": lo, "step20": hi, "final": lo})
    out = tmp_path / "selected.json"
    cfg = make_config()
    doc = selection.run(RULE, heldout=heldout, test=test, out=out, boot=cfg.eval.bootstrap)
    assert json.loads(out.read_text()) == doc
    assert doc["rule"] == {**RULE, "k": N, "key": f"math_dapo avg@{N}", "tie": "earliest step"}
    sel = doc["selected"]
    assert (sel["tag"], sel["step"], sel["missing"], sel["considered"]) == ("step20", 20, [], 3)
    h20 = json.loads(heldout["step20"].read_text())
    assert sel["value"] == h20["by_grader"]["math_dapo"]["avg@n"]
    cand = {c["tag"]: c for c in doc["candidates"]}
    assert [c["tag"] for c in doc["candidates"]] == ["step10", "step20", "final"]
    assert cand["final"]["step"] == 30  # from the metrics document's step
    assert cand["step20"]["interval"] == [h20["by_grader"]["math_dapo"]["bootstrap_ci"][k]
                                          for k in ("low", "high")]
    assert doc["heldout_base"]["tag"] == "base"
    rows = {r["role"]: r for r in doc["test"]["rows"]}
    assert [r["role"] for r in doc["test"]["rows"]] == ["base", "selected", "final"]
    t20 = json.loads(test["step20"].read_text())
    assert rows["selected"]["tag"] == "step20" and rows["selected"]["step"] == 20
    assert rows["selected"]["math_dapo_avg"] == t20["by_grader"]["math_dapo"]["avg@n"]
    assert rows["final"]["math_dapo_ci"] == [
        json.loads(test["final"].read_text())["by_grader"]["math_dapo"]["bootstrap_ci"][k]
        for k in ("low", "high")]
    cmp = doc["selected_vs_final"]["math_dapo"]
    assert cmp["mean_diff"] == pytest.approx(
        rows["selected"]["math_dapo_avg"] - rows["final"]["math_dapo_avg"])
    assert cmp["paired_bootstrap_ci"]["low"] > 0
    assert set(cmp["per_problem"][0]) == {"problem_id", "selected", "final", "diff"}
    assert doc["differ_beyond_intervals"] is True
    assert "excludes 0: selected and final differ beyond the interval" in doc["verdict"]
    # summary.json carries the held-out rows and the selection, its old keys unchanged
    summary = tmp_path / "summary.json"
    metrics.run_summary(metrics=list(test.values()), out=summary,
                        heldout=list(heldout.values()), selected=out)
    s = json.loads(summary.read_text())
    assert s["tags"] == ["base", "step10", "step20", "final"] and len(s["rows"]) == 4
    assert s["heldout"]["tags"] == ["heldout/base", "heldout/step10", "heldout/step20",
                                    "heldout/final"]
    assert s["selected"]["tag"] == "step20" and len(s["selected"]["rows"]) == 3


def test_equal_checkpoints_do_not_differ_and_a_tie_picks_the_earliest(tmp_path: Path):
    p = np.linspace(0.2, 0.8, N_PROB)
    heldout, test = _run_dir(tmp_path, {"step10": p, "step20": p, "final": p},
                             {"base": p, "step10": p, "step20": p, "final": p},
                             seeds={"step10": 5, "final": 5})
    doc = selection.run({**RULE, "metric": "pass", "k": 4}, heldout=heldout, test=test,
                        out=tmp_path / "selected.json", boot=BOOT)
    assert doc["rule"]["key"] == "math_dapo pass@4"
    assert doc["selected"]["value"] == max(c["value"] for c in doc["candidates"])
    # the same samples on every held-out file: a tie, the earliest step wins
    same = {}
    for tag, step in (("final", 30), ("step20", 20), ("step10", 10)):
        same[tag], _ = _write_tag(tmp_path / "same", heldout_tag(tag), p, 9, None, step)
    doc = selection.run(RULE, heldout=same, test=test, out=tmp_path / "s2.json", boot=BOOT)
    assert doc["selected"]["tag"] == "step10" and doc["selected"]["ties"] == ["step20", "final"]
    # step10 and final on the test set: the same samples (seed 5), a zero difference
    cmp = doc["selected_vs_final"]["math_dapo"]
    assert cmp["mean_diff"] == 0 and cmp["paired_bootstrap_ci"]["low"] == 0 == \
        cmp["paired_bootstrap_ci"]["high"]
    assert doc["differ_beyond_intervals"] is False
    assert "includes 0: selected and final do not differ" in doc["verdict"]


def test_the_final_checkpoint_selected_is_not_compared(tmp_path: Path):
    lo, hi = np.full(N_PROB, 0.2), np.full(N_PROB, 0.9)
    heldout, test = _run_dir(tmp_path, {"step10": lo, "final": hi},
                             {"base": lo, "step10": lo, "final": hi})
    doc = selection.run(RULE, heldout=heldout, test=test, out=tmp_path / "s.json", boot=BOOT)
    assert doc["selected"]["tag"] == "final" and doc["selected_vs_final"] is None
    assert doc["differ_beyond_intervals"] is None and "the final checkpoint" in doc["verdict"]
    assert [r["role"] for r in doc["test"]["rows"]] == ["base", "selected", "final"]


def test_a_final_at_step_of_a_step_tag_is_counted_once(tmp_path: Path):
    p = np.full(N_PROB, 0.5)
    heldout, test = _run_dir(tmp_path, {"step30": p, "final": p},
                             {"base": p, "step30": p, "final": p})
    doc = selection.run(RULE, heldout=heldout, test=test, out=tmp_path / "s.json", boot=BOOT)
    assert [c["tag"] for c in doc["candidates"]] == ["step30"]
    assert doc["selected"]["tag"] == "step30" and "final is the checkpoint of step30" in \
        doc["selected"]["reason"]
    assert doc["selected_vs_final"] is None  # the same checkpoint as final


def test_run_names_an_unreadable_file(tmp_path: Path):
    bad = tmp_path / "heldout" / "step10" / "metrics.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{")
    with pytest.raises(SelectionError, match=r"heldout/step10/metrics.json: cannot read"):
        selection.run(RULE, heldout={"step10": bad}, test={}, out=tmp_path / "s.json",
                      boot=BOOT)
    assert not (tmp_path / "s.json").exists()


def test_run_rule_finds_the_tags_by_the_layouts_paths(tmp_path: Path):
    """Rule eval_select's entry point: the plan's rule, else eval.select (and it says so)."""
    cfg = make_config(run={"name": "r", "results_root": str(tmp_path)},
                      cluster={"gpu": True}, eval={"steps": [10], "final": True})
    layout = Layout.from_config(cfg)
    root = Path(layout.eval_dir)
    lo, hi = np.full(N_PROB, 0.2), np.full(N_PROB, 0.7)
    for name, p, step in (("heldout/step10", hi, 10), ("heldout/final", lo, 30),
                          ("base", lo, None), ("step10", hi, 10), ("final", lo, 30)):
        _write_tag(root, name, p, 4, None, step)
    heldout = [Path(layout.eval_metrics(t)) for t in ("heldout/step10", "heldout/final")]
    test = [Path(layout.eval_metrics(t)) for t in ("base", "step10", "final")]
    out = Path(layout.eval_selected)
    plan_rule = {**RULE, "metric": "pass", "k": 2, "key": "math_dapo pass@2",
                 "tie": "earliest step", "set_sha256": "ab" * 32}
    doc = selection.run_rule(cfg, plan_rule, heldout=heldout, test=test, out=out)
    assert doc["rule"]["set_sha256"] == "ab" * 32 and doc["rule_source"] == "preflight/plan.json"
    assert doc["selected"]["tag"] == "step10" and doc["differ_beyond_intervals"] is True
    doc = selection.run_rule(cfg, None, heldout=heldout, test=test, out=out)
    assert doc["rule"]["key"] == f"math_dapo avg@{N}" and doc["rule_source"].startswith("config")
    with pytest.raises(SelectionError, match="not the metrics.json of a tag of this run"):
        selection.run_rule(cfg, None, heldout=[tmp_path / "x.json"], test=test, out=out)


def test_so_far_lists_the_steps_not_evaluated_yet(tmp_path: Path):
    cfg = make_config(run={"name": "r", "results_root": str(tmp_path)},
                      cluster={"gpu": True}, eval={"steps": [10, 20], "final": True})
    layout = Layout.from_config(cfg)
    root = Path(layout.eval_dir)
    p, q = np.full(N_PROB, 0.3), np.full(N_PROB, 0.6)
    _write_tag(root, "heldout/step10", p, 1, None, 10)
    _write_tag(root, "heldout/step20", q, 2, None, 20)
    _write_tag(root, "base", p, 3, None, None)
    assert selection.so_far(layout, cfg, None) is None
    doc = selection.so_far(layout, cfg, cfg.eval.select)
    assert doc["selected"]["tag"] == "step20" and doc["selected"]["missing"] == ["final"]
    assert (doc["tag"], doc["step"]) == ("step20", 20)  # what retention keeps
    assert doc["progress"] == {"evaluated": 2, "expected": 3, "complete": False,
                               "label": "selection so far (2 of 3 steps evaluated)"}
    assert doc["test"]["missing"] == ["step20", "final"]
    assert "not evaluated on the test set (yet)" in doc["verdict"]


def test_metrics_run_records_the_step_of_the_samples(tmp_path: Path):
    """metrics.json's optional `step` (what final's candidate step is read from): from the
    samples' meta when given, else scores.meta.json's, else null."""
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps(s) + "\n" for s in _scores(np.full(3, 0.5), 4, 0)))
    meta = tmp_path / "scores.meta.json"
    meta.write_text(json.dumps({"graders": {}}))
    smeta = tmp_path / "samples.meta.json"
    smeta.write_text(json.dumps({"tag": "final", "step": 40}))
    boot = make_config().eval.bootstrap
    out = tmp_path / "m.json"
    metrics.run(boot, tag="final", scores=scores, scores_meta=meta, out=out, samples_meta=smeta)
    assert json.loads(out.read_text())["step"] == 40
    metrics.run(boot, tag="base", scores=scores, scores_meta=meta, out=out)
    assert json.loads(out.read_text())["step"] is None
    smeta.write_text(json.dumps({"step": "forty"}))
    with pytest.raises(metrics.MetricsError, match=r"samples.meta.json: 'step' is not an int"):
        metrics.run(boot, tag="final", scores=scores, scores_meta=meta, out=out,
                    samples_meta=smeta)


def test_the_candidate_set_is_part_of_the_rule_fixed_in_the_plan() -> None:
    """plan.json's selection names its candidates: a step added to eval.steps after seeing
    results, or final dropped, is another rule (and its description says which)."""
    from hy3rl.preflight.heldout import selection_record

    two = make_config(cluster={"gpu": True}, eval={"steps": [20, 40]})
    three = make_config(cluster={"gpu": True}, eval={"steps": [20, 40, 60]})
    a, b = selection_record(two, None), selection_record(three, None)
    assert a["candidates"] == {"steps": [20, 40], "final": True}
    assert b["candidates"] == {"steps": [20, 40, 60], "final": True}
    assert a != b and {k: v for k, v in a.items() if k != "candidates"} == \
        {k: v for k, v in b.items() if k != "candidates"}
    assert selection.describe(a).endswith("among step20, step40 and final")
    assert selection.describe(b).endswith("among step20, step40, step60 and final")
    no_final = dataclasses.replace(three, eval=dataclasses.replace(three.eval, final=False))
    assert selection.candidate_set(no_final) == {"steps": [20, 40, 60], "final": False}
    assert selection.describe({**a, "candidates": selection.candidate_set(no_final)}) \
        .endswith("among step20, step40 and step60")
    # without training in the DAG no checkpoint is a candidate
    assert selection.candidate_set(make_config(train={"cpu": {"enable": False}})) == \
        {"steps": [], "final": False}
