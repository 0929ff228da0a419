"""The training-health guard in the launcher (issue 30): train.run's real code (attempt loop,
watchdog monitor, hy3rl.health.Guard, records, retention, job-exit.json) on the trainer
double (tests/fixtures/trainer_double.py) run as a local process in place of the Ray job
(``launch.launch`` replaced, as tests/test_train.py replaces it; the Ray path itself is
tests/test_train_ray.py's and the SLURM path tests/test_train_slurm.py's)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from fixtures.trainer_double import TrainSetup, local_launch
from hy3rl import ckptdir, launch, resubmit, runtime_id, train
from hy3rl.health import UNHEALTHY, Event


@pytest.fixture(scope="module", autouse=True)
def _torch() -> None:
    """torch, which the double's saves need, imported once before any fork."""
    import torch  # noqa: F401


@pytest.fixture
def guarded(train_setup, monkeypatch):
    """``guarded(faults, health=..., **setup)``: a TrainSetup whose train.run goes through
    local_launch; returns (setup, run) where run() calls train.run on its paths."""
    def make(faults: dict, health: dict | None = None, notify: str = "", **kw):
        setup = train_setup(step_s=0.15, **kw)
        setup.config["train"].update({"health": health or {}, "notify_command": notify,
                                      "watchdog": {"poll_s": 0.05}})
        setup.faults.write_text(json.dumps(faults))
        monkeypatch.setattr(launch, "launch", local_launch(setup))
        # the runtime's identity (pip freeze: seconds) is not what these tests are about
        monkeypatch.setattr(runtime_id, "identify", lambda prefix, python, cache=None: {
            "id": "test-runtime", "kind": "test"})

        cfg: list = []  # the typed config, built once (a second each)

        def run() -> None:
            cfg[:] = cfg or [setup.cfg()]
            train.run(cfg[0].train, cfg[0].cluster, setup.layout(), keep_steps=[],
                      **setup.run_paths())
        run.cfg = lambda: cfg[0]
        return setup, run
    return make


def _record(setup: TrainSetup, k: int = 1) -> dict:
    return json.loads(Path(setup.layout().attempt_record(k)).read_text())


def _stopped(setup: TrainSetup, run, match: str) -> dict:
    """Run; the job fails with ``match`` and its one attempt is recorded unhealthy, never
    restarted in the allocation. Returns the record."""
    with pytest.raises(train.TrainFailed, match=match):
        run()
    rec = _record(setup)
    assert (rec["outcome"], rec["exit_reason"]) == (UNHEALTHY, UNHEALTHY)
    assert train.attempt_numbers(setup.layout()) == [1]
    return rec


def _complete(setup: TrainSetup) -> list[int]:
    return [c.step for c in ckptdir.scan(setup.ckpt) if c.complete]


def test_nan_grad_norm_stops_at_once_and_is_not_resubmitted(guarded) -> None:
    """NaN at step 3: the trainer is stopped at once (no save after it), the record names
    the rule, the step, the value and the last healthy checkpoint (2); job-exit.json and
    resubmit's decision refuse a resubmission naming the rule."""
    setup, run = guarded({"nan_grad_at": 3}, total=8, save_freq=2)
    started = train.utc_now()
    with pytest.raises(train.TrainFailed, match=r"unhealthy: health rule nonfinite "
                       r"\(actor/grad_norm\) fired at step 3 .*values nan@3.*stopped at once"
                       r".*last healthy checkpoint: step 2 .*hy3rl rewind --step 2.*"
                       r"not resubmitted"):
        run()
    rec = _record(setup)
    assert (rec["outcome"], rec["exit_reason"]) == (UNHEALTHY, UNHEALTHY)
    stop = rec["health_stop"]
    assert (stop["rule"], stop["step"], stop["metric"]) == ("nonfinite", 3, "actor/grad_norm")
    assert stop["values"] == [[3, "nan"]] and stop["stopped_after_save"] is None
    # as verl's file logger writes it (orjson): null, read as a non-finite value
    raw = Path(setup.layout().attempt_metrics(1)).read_bytes()
    assert b'"actor/grad_norm":null' in raw and b"NaN" not in raw
    assert "logged as null" in rec["health"][0]["message"]
    assert stop["last_healthy_step"] == 2
    assert stop["last_healthy_checkpoint"] == str(setup.ckpt / "global_step_2")
    assert [e["rule"] for e in rec["health"]] == ["nonfinite"]
    assert rec["last_logged_step"] <= 4 and _complete(setup) == [2]  # stopped at once
    assert train.attempt_numbers(setup.layout()) == [1]  # no restart in the allocation
    assert not rec.get("crash_loop")
    job_exit = json.loads(Path(setup.layout().train_job_exit).read_text())
    assert job_exit["retry"] is False and "health rule nonfinite" in job_exit["reason"]
    decision = resubmit.decide(setup.layout(), 2, started)
    assert decision.stop and "health rule nonfinite" in decision.stop
    assert "last healthy checkpoint: step 2" in decision.stop


def test_drift_stops_right_after_the_next_save_and_retention_keeps_the_last_healthy(
        guarded, monkeypatch, tmp_path: Path) -> None:
    """Drift above 0.02 from step 5 for 2 logged steps fires at step 6, right after the save
    of step 6 (verl logs a step after its save): the trainer is stopped. The last healthy
    checkpoint is step 3 (step 5 generated with checkpoint 4's weights, so the drift is
    checkpoint 4's); checkpoint_keep 1 would prune it, the guard keeps it. The
    double waits before step 7 until it is stopped (pause_at, never released): however slow
    the poll on a loaded machine, no save after step 6 can come before the stop."""
    monkeypatch.setenv("HY3RL_DOUBLE_RELEASE", str(tmp_path / "never-released"))
    setup, run = guarded({"drift_from": 5, "pause_at": 7},
                         health={"drift": {"steps": 2, "when": "next_save"}},
                         total=12, save_freq=3, keep=1)
    rec = _stopped(setup, run, r"health rule drift .* fired at step 6 \(from step 5; values "
                   r"0.05@5, 0.05@6\).*right after the complete save of step 6.*last "
                   r"healthy checkpoint: step 3")
    stop = rec["health_stop"]
    assert (stop["rule"], stop["step"], stop["first_step"]) == ("drift", 6, 5)
    assert stop["stopped_after_save"] == 6 and stop["last_healthy_step"] == 3
    assert rec["end_step"] == 6 and rec["last_logged_step"] in (6, 7)
    assert _complete(setup) == [3, 6]  # 3 kept (keep 1); nothing saved after 6
    # the retention the launcher runs: the last healthy one stays while the rule's steps
    # are in the lineage
    cfg = run.cfg()
    job = train.Job(cfg.train, cfg.cluster, setup.layout(), {}, target=12, total=12,
                    keep_steps=[], launch_script=Path(), runtime_env=Path(),
                    metrics=Path(setup.layout().train_metrics))
    job.watcher = job.lineage_watcher()
    assert job.protected() == [3]
    assert ckptdir.prune(setup.ckpt, 1, job.protected) == [] and _complete(setup) == [3, 6]
    assert ckptdir.prune(setup.ckpt, 1, []) == [3]  # what retention did without the guard


def test_rerun_is_refused_then_a_rewind_goes_on_in_a_new_lineage(guarded) -> None:
    """After the drift stop, a plain rerun would resume from step 6 (trained through the
    drift): refused, naming the rewind. `hy3rl rewind --step 3` moves 6 aside (nothing
    deleted), a new lineage; the rerun with the collapse gone and a changed config
    (on_config_change: resume) trains from step 3 to the end, its metrics without the
    drifted steps of the old lineage."""
    from fixtures.trainer_double import plan_json
    from hy3rl.cli import main

    setup, run = guarded({"drift_from": 5}, health={"drift": {"steps": 2}}, total=8,
                         save_freq=3, keep=1)
    # no effect while the trajectory is the same; used by the run after the rewind
    setup.config["train"]["on_config_change"] = "resume"
    with pytest.raises(train.TrainFailed):
        run()
    with pytest.raises(train.TrainError, match=r"step 6, was trained through steps where "
                       r"health rule drift .*last healthy checkpoint: step 3.*hy3rl rewind"):
        run()
    assert train.attempt_numbers(setup.layout()) == [1]
    # issue 41: the records decide that refusal before any job is submitted (the
    # controller's first-submission decision, hy3rl.resubmit.decide), for a plan resuming
    # from step 6; not for one that starts afresh
    from hy3rl.resubmit import decide

    layout = setup.layout()
    plan = json.loads(Path(layout.train_plan).read_text())
    for action, refused in (("same", True), ("resume_changed", True), ("fresh", False)):
        plan.setdefault("identity", {})["decision"] = {"action": action, "newest_step": 6}
        Path(layout.train_plan).write_text(json.dumps(plan))
        stop = decide(layout, 1, "2026-01-01T00:00:00+00:00").stop
        assert bool(stop) is refused, (action, stop)
    assert stop is None
    plan["identity"]["decision"] = {"action": "same", "newest_step": 6}
    Path(layout.train_plan).write_text(json.dumps(plan))
    assert train.sick_resume(layout).startswith(
        "the launch would resume from step 6 in ") and "hy3rl rewind --step 3" in \
        train.sick_resume(layout)
    conf = setup.config_file()
    cwd = os.getcwd()
    os.chdir(setup.root)  # results/ is relative to where hy3rl runs
    try:
        assert main(["rewind", "--step", "3", "--configfile", str(conf)]) == 0
    finally:
        os.chdir(cwd)
    with pytest.raises(ckptdir.CheckpointDirError, match=r"global_step_5: not a complete "
                       r"checkpoint .*the complete ones are steps \[3\]"):
        ckptdir.rewind(setup.ckpt, 5, attempt=2)
    assert _complete(setup) == [3] and ckptdir.read_tracker(setup.ckpt) == 3
    aside = [p for p in setup.ckpt.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "global_step_6").is_dir()
    ident = ckptdir.read_identity(setup.ckpt)
    assert ident["lineage"] == 2 and ident["rewinds"][0]["step"] == 3
    # after the rewind the newest checkpoint (3) is healthy: nothing refuses the submission
    plan["identity"]["decision"] = {"action": "resume_changed", "newest_step": 3}
    Path(layout.train_plan).write_text(json.dumps(plan))
    assert train.sick_resume(layout) is None
    setup.faults.write_text("{}")  # the cause fixed by the changed configuration
    setup.write_plan(plan_json(setup.ckpt, 8, 3, setup.run, lr="5e-7"))
    run()
    rec = _record(setup, 2)
    assert rec["start_step"] == 3 and rec["outcome"] == "succeeded"
    assert rec["identity_action"] == "resume_changed" and rec["health"] == []
    merged = [json.loads(x) for x in
              Path(setup.layout().train_metrics).read_text().splitlines()]
    drift = {m["step"]: m["data"].get("training/rollout_probs_diff_mean") for m in merged}
    assert all(v is None or v < 0.02 for v in drift.values()), drift


def test_warn_goes_to_the_record_and_the_notify_command(guarded, tmp_path: Path) -> None:
    """The entropy rule set to warn with a floor: the event is in the record while the run
    goes on to the end, and the notify command got the record."""
    got = tmp_path / "notified.txt"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ncat \"$1\" > {got}.tmp && mv {got}.tmp {got}\n")
    hook.chmod(0o755)
    setup, run = guarded({"entropy_collapse_from": 2},
                         health={"entropy": {"action": "warn", "floor": 0.05, "steps": 2}},
                         notify=str(hook), total=5, save_freq=5)
    run()
    rec = _record(setup)
    assert rec["outcome"] == "succeeded" and rec["health_stop"] is None
    [event] = rec["health"]
    assert (event["rule"], event["action"], event["step"]) == ("entropy", "warn", 3)
    assert event["values"] == [[2, 0.001], [3, 0.001]]
    assert "below the floor 0.05" in event["message"]
    for _ in range(50):
        if got.exists():
            break
        time.sleep(0.1)
    notified = json.loads(got.read_text())
    assert notified["attempt"] == 1 and notified["health"][0]["rule"] == "entropy"


def test_a_normal_double_run_raises_nothing(guarded) -> None:
    """The embedded default's rules on a normal double run: no event, retention as
    configured (no checkpoint kept for health)."""
    setup, run = guarded({}, total=6, save_freq=2, keep=1)
    run()
    rec = _record(setup)
    assert rec["outcome"] == "succeeded" and rec["health"] == [] and rec["health_stop"] is None
    assert _complete(setup) == [6]


def test_reward_floor_stops_after_the_save(guarded) -> None:
    setup, run = guarded({"reward_min_from": 2},
                         health={"reward_floor": {"steps": 2, "when": "next_save"}},
                         total=6, save_freq=2)
    rec = _stopped(setup, run, r"health rule reward_floor \(critic/score/mean\) fired at "
                   r"step 3 .*save of step 4.*no complete checkpoint")
    assert rec["health_stop"]["last_healthy_step"] is None


def test_a_stop_rule_stops_at_once_by_default(guarded, monkeypatch, tmp_path: Path) -> None:
    """Issue 41, `when` per stop rule: by default (at_once; validation: next_save) the drift
    from step 6 that fires at step 7 stops the trainer there, without waiting for the save
    of step 8 (past the first sick step, so never the last healthy checkpoint); the record
    says so. Step 6 generated with checkpoint 5's weights: the last healthy checkpoint is
    4, which retention (keep 1) kept. The double waits before step 8 until stopped."""
    monkeypatch.setenv("HY3RL_DOUBLE_RELEASE", str(tmp_path / "never-released"))
    setup, run = guarded({"drift_from": 6, "pause_at": 8}, health={"drift": {"steps": 2}},
                         total=12, save_freq=2, keep=1)
    assert setup.cfg().train.health.drift.when == "at_once"
    assert setup.cfg().train.health.validation.when == "next_save"
    rec = _stopped(setup, run, r"health rule drift .* fired at step 7 .*the trainer was "
                   r"stopped at once \(train.health.drift.when: at_once\).*last healthy "
                   r"checkpoint: step 4")
    stop = rec["health_stop"]
    assert stop["stopped_after_save"] is None and stop["last_healthy_step"] == 4, stop
    assert rec["last_logged_step"] == 7, rec
    assert _complete(setup) == [4, 6]  # no save of step 8: stopped before it


def test_resubmit_refuses_an_unhealthy_record_without_job_exit(tmp_path: Path) -> None:
    """The controller's guard on the record alone (a job killed before job-exit.json)."""
    from hy3rl.layout import Layout

    layout = Layout(str(tmp_path / "results"), "r")
    Path(layout.train_attempts).mkdir(parents=True)
    since = train.utc_now()
    rec = {"attempt": 1, "outcome": UNHEALTHY, "exit_reason": UNHEALTHY, "started_at":
           train.utc_now(), "health_stop": {"message": "unhealthy: health rule drift ..."}}
    Path(layout.attempt_record(1)).write_text(json.dumps(rec))
    assert resubmit.decide(layout, 2, since).stop == "unhealthy: health rule drift ..."


def test_after_attempt_never_restarts_an_unhealthy_attempt() -> None:
    e = Event("drift", "stop", 5, 4, "m", ((4, 0.05),), 0.02, "x")
    rec = {"attempt": 1, "outcome": UNHEALTHY, "exit_reason": UNHEALTHY, "lost_nodes": [],
           "health_stop": {"message": f"unhealthy: {e.message}"}}
    step = train.after_attempt(rec, [rec], restarts_left=3, lost=[], allocation=["n"],
                               nodes_needed=1, time_left=None, interval=None)
    assert (step.restart, step.retry, step.reason) == (False, False, "unhealthy: x")


def test_a_stop_rule_that_fired_before_the_trainer_ended_on_its_own(guarded) -> None:
    """Drift fires at step 3, the next save is step 6, and the trainer crashes at step 4
    before it: the attempt is still unhealthy (not a crash to restart), and says how the
    trainer ended."""
    setup, run = guarded({"drift_from": 2, "crash_at": 4},
                         health={"drift": {"steps": 2, "when": "next_save"}},
                         total=6, save_freq=6)
    rec = _stopped(setup, run, r"health rule drift .* fired at step 3 .*the trainer ended "
                   r"\(failed: exit 1\) before the guard stopped it; last healthy "
                   r"checkpoint: none")  # not restarted as a crash
    assert rec["health_stop"]["stopped_after_save"] is None


def test_retention_keeps_the_checkpoint_before_a_run_that_may_still_fire(
        tmp_path: Path, ckpt_writer) -> None:
    """Drift over 2 steps, crossed at step 4 only so far, and step 4's checkpoint saved: the
    rule may fire at step 5 with its first step 4, which calls checkpoint 3 sick (step 4
    generated with its weights), so step 2 (the last healthy then) is kept from retention
    (keep 1); once a healthy value closes the run, it may go."""
    from fixtures.common import make_config
    from fixtures.trainer_double import double_module
    from hy3rl.layout import Layout

    cfg = make_config(train={"checkpoint_root": str(tmp_path / "ckpt"),
                             "health": {"drift": {"steps": 2}}})
    layout = Layout(str(tmp_path / "results"), "r", str(tmp_path / "ckpt"))
    for step in (2, 4):
        ckpt_writer(layout.checkpoint_dir, step)
    job = train.Job(cfg.train, cfg.cluster, layout, {}, target=8, total=8, keep_steps=[7],
                    launch_script=Path(), runtime_env=Path(),
                    metrics=Path(layout.train_metrics))
    job.watcher = train.Watcher(cfg.train.health)
    assert job.protected() == [7]
    metrics = double_module().metrics
    for step in range(1, 5):
        data = metrics(step, 8)
        if step == 4:
            data["training/rollout_probs_diff_mean"] = 0.05
        assert job.watcher.feed({"step": step, "data": data}) == []
    assert job.watcher.open_from() == 3 and job.protected() == [2, 7]
    assert ckptdir.prune(layout.checkpoint_dir, 1, job.protected) == []
    job.watcher.feed({"step": 5, "data": metrics(5, 8)})  # healthy again: the run ends
    assert job.watcher.open_from() is None and job.protected() == [4, 7]
    assert ckptdir.prune(layout.checkpoint_dir, 1, job.protected) == [2]
    # step 6 saved before its metrics are read (verl logs a step after its save): not known
    # healthy yet, so step 4 stays until the guard has judged step 6
    ckpt_writer(layout.checkpoint_dir, 6)
    assert job.protected() == [4, 7]
    assert ckptdir.prune(layout.checkpoint_dir, 1, job.protected) == []
    job.watcher.feed({"step": 6, "data": metrics(6, 8)})
    assert job.protected() == [6, 7]
    assert ckptdir.prune(layout.checkpoint_dir, 1, job.protected) == [4]


def test_open_from_of_a_falling_window() -> None:
    """The entropy fall (window 3) as a stop rule: a later window holds the latest 2 values,
    so a fall may still start there (at step 4: checkpoint 3's entropy, a rollout-side
    metric); as a warn rule it bounds nothing."""
    from fixtures.common import make_config

    for action, expected in (("stop", 3), ("warn", None)):
        cfg = make_config(train={"health": {"entropy": {"action": action, "max_fall": 0.5,
                                                        "window": 3}}})
        w = train.Watcher(cfg.train.health)
        for step in range(1, 6):
            w.feed({"step": step, "data": {"actor/entropy": 0.5}})
        assert w.open_from() == expected, action


def test_rewind_refuses_without_an_identity_and_while_a_trainer_holds_the_dir(
        ckpt: Path) -> None:
    """`hy3rl rewind` on checkpoints no run of this workflow recorded, and on a directory a
    live trainer holds: refused by name, nothing moved."""
    import socket
    import subprocess

    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(ckptdir.CheckpointDirError, match="no run identity file: nothing to "
                       "rewind"):
        ckptdir.rewind(ckpt, 2, attempt=1)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ckptdir.acquire_lock(ckpt, ckptdir.LockInfo(
            None, "local", socket.gethostname(), live.pid,
            ckptdir._pid_create_time(live.pid), 1, "t"))
        with pytest.raises(ckptdir.LockHeld, match=f"local process {live.pid}"):
            ckptdir.rewind(ckpt, 2, attempt=1)
    finally:
        live.kill()
        live.wait()
    assert sorted(p.name for p in ckpt.iterdir() if p.name != ckptdir.LOCK_NAME) == before
