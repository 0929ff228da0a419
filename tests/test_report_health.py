"""The report's health panel and the selection's health bound (issue 30), at unit level: pages
built from real records (attempt records and logs as hy3rl.train writes them, checkpoints
written by the trainer double's own writer), no Snakemake, no browser."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fixtures.common import make_config
from fixtures.trainer_double import double_module
from hy3rl import ckptdir, report, selection, train
from hy3rl.atomic import write_json_atomic
from hy3rl.layout import Layout
from hy3rl.redact import make_redactor
from hy3rl.report.page import health_view, render

DRIFT_FROM = 5
# step 5 generated with checkpoint 4's weights: the drift (rollout-side) calls it sick
SICK_FROM = DRIFT_FROM - 1


@pytest.fixture(scope="module", autouse=True)
def _torch() -> None:
    """torch, which the double's checkpoint writer needs, imported once for the module."""
    import torch  # noqa: F401


def _run(tmp_path: Path, drift: bool, drop: str | None = None) -> tuple:
    """A run whose attempt 1 logged steps 0-7 (the double's metrics; drift from step 5 when
    ``drift``; metric ``drop`` never logged), saved steps 3 and 6 and, with drift, was
    stopped by the guard after the save of step 6 (its record as the launcher writes it)."""
    cfg = make_config(run={"name": "r"}, cluster={"gpu": True},
                      train={"checkpoint_root": str(tmp_path / "ckpt"),
                             "health": {"drift": {"steps": 2}}},
                      report={"dpi": 50})
    layout = Layout(str(tmp_path / "results"), "r", str(tmp_path / "ckpt"))
    double = double_module()
    for step in (3, 6):
        double.save_checkpoint(str(layout.checkpoint_dir), step)
    Path(layout.train_attempts).mkdir(parents=True)
    lines = []
    for step in range(8):
        data = double.metrics(step, 8)
        if drift and step >= DRIFT_FROM:
            data["training/rollout_probs_diff_mean"] = 0.05
        data.pop(drop, None)
        lines.append({"step": step, "data": data})
    Path(layout.attempt_metrics(1)).write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = train.Job(cfg.train, cfg.cluster, layout, {}, target=8, total=8, keep_steps=[],
                    launch_script=Path(), runtime_env=Path(),
                    metrics=Path(layout.train_metrics))
    rec = dataclasses.asdict(train.AttemptRecord(
        attempt=1, run="r", executor="local", slurm_job_id=None, host="h", nodes=["h"],
        num_nodes=1, gpus_per_node=8, cpus_per_node=8, submission_id="r-local-1",
        checkpoint_dir=str(layout.checkpoint_dir), start_step=0,
        metrics_log=Path(layout.attempt_metrics(1)).name, log_dir="attempt-1"))
    job.rec = rec
    job.watcher = train.Watcher(cfg.train.health)
    record = Path(layout.attempt_record(1))
    for line in lines:
        for event in job.watcher.feed(line):
            job.on_health(record, event)
    train.close_record(rec, layout, 6, "x", 1)
    if drift:
        rec["outcome"] = rec["exit_reason"] = "unhealthy"
        rec["health_stop"] = job.health_stop(job.watcher.events[0], 6)
    write_json_atomic(record, rec)
    train.write_merged(Path(layout.train_attempts), Path(layout.train_metrics))
    return cfg, layout


def _page(cfg, layout: Layout) -> str:
    found = report.gather(cfg, layout)
    figs = {n: b"" for n in ("fig_training_published.png", "fig_training_extra.png",
                             "fig_step_time.png", "fig_eval_checkpoints.png",
                             "fig_eval_heatmap.png", "fig_eval_curves.png")}
    return render(found, make_redactor({}, [cfg.raw]), {}, figs, [])["index.html"].decode()


def test_health_panel_names_each_rule_where_it_fired_and_the_last_healthy(tmp_path: Path):
    cfg, layout = _run(tmp_path, drift=True)
    view = health_view(report.gather(cfg, layout))
    rules = {r["rule"]: r for r in view["rules"]}
    assert set(rules) == {name for name, _ in cfg.train.health.rules()}
    assert rules["drift"]["fired"] == "step 6" and rules["drift"]["action"] == "stop"
    assert rules["drift"]["metrics"] == "training/rollout_probs_diff_mean"
    assert rules["drift"]["threshold"] == "max 0.02, steps 2"
    assert rules["nonfinite"]["fired"] == "never"
    assert view["last_healthy_step"] == 3 and view["last_healthy"] == "step 3"
    [stop] = view["stops"]
    assert stop["attempt"] == 1 and "last healthy checkpoint: step 3" in stop["message"]
    html = _page(cfg, layout)
    assert 'id="health-rules"' in html and 'id="last-healthy">step 3<' in html
    assert "health rule drift (stop) fired at step 6" in html
    assert 'id="health-stop-1"' in html


def test_health_panel_of_a_healthy_run(tmp_path: Path):
    cfg, layout = _run(tmp_path, drift=False)
    view = health_view(report.gather(cfg, layout))
    assert all(r["fired"] == "never" for r in view["rules"]) and view["events"] == []
    assert all(r["blind"] == "never" for r in view["rules"])
    # each threshold rule judged every logged step (8)
    judged = {r["rule"]: r["judged"] for r in view["rules"]}
    assert all(judged[r] == 8 for r in ("nonfinite", "drift", "entropy", "response_length",
                                        "reward_floor")), judged
    assert view["last_healthy"] == "step 6 (no stop rule fired: the newest)"
    assert view["stops"] == []


def test_health_panel_shows_a_blind_rule(tmp_path: Path):
    """Issue 41: a rule whose metric never came judged 0 steps and went blind (a warn in the
    attempt record, as the launcher recorded it, and a column of the panel), where a
    healthy rule's "never" would otherwise read the same."""
    cfg, layout = _run(tmp_path, drift=False, drop="training/rollout_probs_diff_mean")
    view = health_view(report.gather(cfg, layout))
    drift = next(r for r in view["rules"] if r["rule"] == "drift")
    assert (drift["judged"], drift["fired"]) == (0, "never"), drift
    assert drift["blind"] == "step 4 (training/rollout_probs_diff_mean)", drift
    rec = json.loads(Path(layout.attempt_record(1)).read_text())
    assert [(e["rule"], e["kind"], e["action"]) for e in rec["health"]] == [
        ("drift", "blind", "warn")], rec["health"]
    html = _page(cfg, layout)
    assert "health rule drift is blind: training/rollout_probs_diff_mean" in html
    assert '<td class="status-blind">0 of 8</td>' in html


def test_selection_never_picks_a_checkpoint_past_a_fired_stop_rule(tmp_path: Path):
    """The best held-out value is at step 6, after the drift from step 5 (which calls
    checkpoint 4 sick: step 5 generated with its weights): passed over, step 3 is
    selected; without the stop, step 6. The bound comes from the lineage's records, and a
    rewind to step 3 leaves it (its events are past the rewind)."""
    cands = [{"tag": "step3", "step": 3, "value": 0.5},
             {"tag": "step6", "step": 6, "value": 0.7},
             {"tag": "final", "step": None, "value": 0.9}]
    assert selection.select(cands)["tag"] == "final"
    chosen = selection.select(cands, stop_at=SICK_FROM)
    assert chosen["tag"] == "step3" and chosen["unhealthy"] == ["step6", "final"]
    assert "stop rule that fired (from checkpoint 4): step6, final" in chosen["reason"]
    none = selection.select(cands[1:], stop_at=2)
    assert none["tag"] is None and none["unhealthy"] == ["step6", "final"]

    cfg, layout = _run(tmp_path, drift=True)
    assert train.health_stop_at(layout) == SICK_FROM
    ckptdir.apply_identity(layout.checkpoint_dir, ckptdir.IdentityDecision("new", 0),
                           {"id": "t", "values": {}}, 8, 0, attempt=1)
    ckptdir.rewind(layout.checkpoint_dir, 3, attempt=2)
    assert train.health_stop_at(layout) is None
