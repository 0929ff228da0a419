"""Unit tests of the train stage on real directories in verl's checkpoint layout (written by
the trainer double's own writer, tests/fixtures/trainer_double.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.common import REPO_ROOT, make_config
from fixtures.trainer_double import launch_sh, partial_checkpoint, plan_json
from hy3rl import ckptdir, identity, launch, raynode, runtime_id, train, verl_log
from hy3rl.errors import StageError
from hy3rl.layout import Layout
from hy3rl.settings import Runtime

# ---------------------------------------------------------------- completeness / resume


def test_complete_checkpoints_detected(ckpt: Path) -> None:
    partial_checkpoint(ckpt, 6)
    states = {c.step: c for c in ckptdir.scan(ckpt)}
    assert sorted(states) == [2, 4, 6]
    assert states[2].complete and states[4].complete
    assert not states[6].complete and "ckpt_contents.json" in states[6].reason
    assert ckptdir.read_tracker(ckpt) == 4
    assert ckptdir.newest_complete(states.values()).step == 4


def test_truncated_data_pt_is_incomplete(ckpt: Path) -> None:
    data = ckpt / "global_step_4" / "data.pt"
    data.write_bytes(data.read_bytes()[:20])
    ok, why = ckptdir.check_complete(ckpt / "global_step_4", 4)
    assert not ok and "data.pt" in why
    manifest = ckpt / "global_step_2" / "actor" / "ckpt_contents.json"
    manifest.write_text(json.dumps({"global_step": 3}))
    ok, why = ckptdir.check_complete(ckpt / "global_step_2", 2)
    assert not ok and "global_step 3 != 2" in why


def test_resume_moves_incomplete_newest_aside(ckpt: Path, caplog) -> None:
    partial_checkpoint(ckpt, 6)
    caplog.set_level(logging.INFO, "hy3rl.ckptdir")
    start, actions = ckptdir.prepare_resume(ckpt, attempt=2)
    assert start == 4
    assert ckptdir.read_tracker(ckpt) == 4
    assert not (ckpt / "global_step_6").exists()
    aside = ckpt / "global_step_6.incomplete-2"
    assert (aside / "actor" / "optimizer" / "dist_ckpt" / "__0_0.distcp").exists()  # kept
    assert any("global_step_6" in a for a in actions)
    assert "resume: starting from step 4" in caplog.text


def test_resume_finishes_an_interrupted_retention(ckpt: Path) -> None:
    """A `.pruning-global_step_N` left by a retention cut off mid-removal (issue 19) is
    removed at the next start; nothing else is touched."""
    os.rename(ckpt / "global_step_2", ckpt / ".pruning-global_step_2")
    start, actions = ckptdir.prepare_resume(ckpt, attempt=2)
    assert start == 4 and not (ckpt / ".pruning-global_step_2").exists()
    assert actions == ["finished removing .pruning-global_step_2 (retention was interrupted)"]
    assert [c.step for c in ckptdir.scan(ckpt)] == [4]


def test_resume_rewrites_tracker_naming_incomplete(ckpt: Path, ckpt_writer, caplog) -> None:
    ckpt_writer(ckpt, 6)  # tracker -> 6, then the manifest goes missing
    (ckpt / "global_step_6" / "actor" / "ckpt_contents.json").unlink()
    caplog.set_level(logging.INFO, "hy3rl.ckptdir")
    start, actions = ckptdir.prepare_resume(ckpt, attempt=3)
    assert start == 4 and ckptdir.read_tracker(ckpt) == 4
    assert "tracker named step 6" in caplog.text and "rewritten to 4" in caplog.text
    assert (ckpt / "global_step_6.incomplete-3").is_dir()


def test_resume_without_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    partial_checkpoint(root, 2)
    (root / ckptdir.TRACKER).write_text("2")
    start, actions = ckptdir.prepare_resume(root, attempt=1)
    assert start == 0
    assert not (root / ckptdir.TRACKER).exists()
    assert (root / f"{ckptdir.TRACKER}.invalid-1").read_text() == "2"
    assert (root / "global_step_2.incomplete-1").is_dir()


def test_bad_tracker_is_an_error(ckpt: Path) -> None:
    (ckpt / ckptdir.TRACKER).write_text("four")
    with pytest.raises(ckptdir.CheckpointDirError, match="latest_checkpointed_iteration.txt"):
        ckptdir.prepare_resume(ckpt, attempt=1)


# ---------------------------------------------------------------- retention


def test_retention_keeps_newest_and_eval_steps(ckpt: Path, ckpt_writer) -> None:
    for step in (6, 8):
        ckpt_writer(ckpt, step)
    partial_checkpoint(ckpt, 10)
    removed = ckptdir.prune(ckpt, keep=2, protected=[2])
    assert removed == [4]
    assert sorted(c.step for c in ckptdir.scan(ckpt)) == [2, 6, 8, 10]
    assert not list(ckpt.glob(".pruning-*"))
    assert ckptdir.prune(ckpt, keep=0, protected=[]) == []  # 0 keeps everything


def test_retention_never_prunes_before_newer_complete(tmp_path: Path, ckpt_writer) -> None:
    root = tmp_path / "c"
    ckpt_writer(root, 2)
    partial_checkpoint(root, 4)  # a save in progress
    assert ckptdir.prune(root, keep=1, protected=[]) == []
    assert (root / "global_step_2").is_dir()
    ckpts = ckptdir.scan(root)
    assert ckptdir.retention_victims(ckpts, keep=1, protected=[]) == []


# ---------------------------------------------------------------- lock


def _me(job: str | None = "200", pid: int = 1) -> ckptdir.LockInfo:
    return ckptdir.LockInfo(job_id=job, executor="slurm" if job else "local", host="h",
                          pid=pid, pid_create_time=None, attempt=1, acquired_at="t")


def test_lock_refuses_live_job_and_takes_over_stale(tmp_path: Path, caplog) -> None:
    root = tmp_path / "c"
    assert ckptdir.acquire_lock(root, _me("100")) == []
    with pytest.raises(ckptdir.LockHeld, match=r"SLURM job 100 .*scancel 100"):
        ckptdir.acquire_lock(root, _me("200"), alive=lambda info: True)
    assert json.loads((root / ckptdir.LOCK_NAME).read_text())["job_id"] == "100"
    caplog.set_level(logging.INFO, "hy3rl.ckptdir")
    actions = ckptdir.acquire_lock(root, _me("200"), alive=lambda info: False)
    assert actions and "stale lock of SLURM job 100" in actions[0]
    assert "took over the stale lock" in caplog.text
    assert json.loads((root / ckptdir.LOCK_NAME).read_text())["job_id"] == "200"
    ckptdir.release_lock(root, _me("100"))  # not ours: stays
    assert (root / ckptdir.LOCK_NAME).exists()
    ckptdir.release_lock(root, _me("200"))
    assert not (root / ckptdir.LOCK_NAME).exists()


def test_local_lock_alive_check_uses_real_processes(tmp_path: Path) -> None:
    import socket

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = ckptdir.LockInfo(None, "local", socket.gethostname(), live.pid,
                                ckptdir._pid_create_time(live.pid), 1, "t")
        assert ckptdir.lock_holder_alive(holder)
        holder_reused = ckptdir.LockInfo(None, "local", socket.gethostname(), live.pid,
                                       1.0, 1, "t")  # same pid, another process
        assert not ckptdir.lock_holder_alive(holder_reused)
    finally:
        live.kill()
        live.wait()
    assert not ckptdir.lock_holder_alive(holder)
    with pytest.raises(ckptdir.LockHeld, match="another host"):
        ckptdir.lock_holder_alive(ckptdir.LockInfo(None, "local", "elsewhere", 1, None, 1, "t"))


# ---------------------------------------------------------------- metrics / attempts


def _line(step: int, **data) -> str:
    return json.dumps({"step": step, "data": data}) + "\n"


def test_metrics_merge_later_attempt_wins(tmp_path: Path) -> None:
    a = tmp_path / "attempts"
    a.mkdir()
    (a / "attempt-1.metrics.jsonl").write_text(
        _line(0, **{"val-core/x": 0.8}) + _line(1, r=1.0) + _line(2, r=2.0) + _line(3, r=3.0)
        + '{"step": 4, "da')  # cut off by a crash
    (a / "attempt-2.metrics.jsonl").write_text(
        _line(2, **{"val-core/x": 0.9}) + _line(3, r=30.0) + _line(4, r=40.0))
    (a / "attempt-10.metrics.jsonl").write_text(_line(4, r=400.0))
    n = train.write_merged(a, tmp_path / "metrics.jsonl")
    merged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert n == 5 and [m["step"] for m in merged] == [0, 1, 2, 3, 4]
    assert merged[2]["data"] == {"r": 2.0, "val-core/x": 0.9}  # resume validation added
    assert merged[3]["data"] == {"r": 30.0}
    assert merged[4]["data"] == {"r": 400.0}  # attempt 10 after attempt 2 (numeric order)


def test_metrics_bad_line_named(tmp_path: Path) -> None:
    """The train stage merges with hy3rl.verl_log: a bad line (not the last) is a stage
    error naming file and line."""
    a = tmp_path / "attempts"
    a.mkdir()
    p = a / "attempt-1.metrics.jsonl"
    p.write_text(_line(1, r=1) + "not json\n" + _line(2, r=2))
    with pytest.raises(StageError, match=r"attempt-1.metrics.jsonl:2"):
        verl_log.read_metrics(p)
    with pytest.raises(StageError, match=r"attempt-1.metrics.jsonl:2"):
        train.write_merged(a, tmp_path / "metrics.jsonl")


def test_stale_running_attempt_is_closed(tmp_path: Path) -> None:
    layout = Layout(str(tmp_path / "results"), "r")
    a = Path(layout.train_attempts)
    a.mkdir(parents=True)
    Path(layout.attempt_metrics(1)).write_text(_line(1) + _line(2) + _line(3))
    Path(layout.attempt_record(1)).write_text(json.dumps(
        {"attempt": 1, "exit_reason": "running", "metrics_log": "attempt-1.metrics.jsonl",
         "started_at": "2026-12-02T10:00:00+00:00"}))
    assert train.finalise_stale(layout, end_step=2) == [1]
    rec = json.loads((a / "attempt-1.json").read_text())
    assert rec["exit_reason"].startswith("killed")
    assert (rec["end_step"], rec["last_logged_step"], rec["steps_lost"]) == (2, 3, 1)


def test_close_record_times_in_the_one_format(tmp_path: Path) -> None:
    layout = Layout(str(tmp_path / "results"), "r")
    rec = {"attempt": 1, "metrics_log": "", "started_at": "2026-12-02T10:00:00Z"}
    train.close_record(rec, layout, 4, "succeeded", 0)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", rec["ended_at"])
    assert rec["wall_s"] > 0 and rec["steps_lost"] == 0


# ---------------------------------------------------------------- refusals (no Ray)


def _setup(tmp_path: Path) -> tuple:
    """A run `run` whose checkpoint root is tmp_path/ckpt, with plan, launch and runtime env
    where its layout puts them: (typed config, layout, run()'s path arguments)."""
    ckpt_root = tmp_path / "ckpt"
    cfg = make_config(run={"name": "run"},
                      cluster={"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1},
                      train={"checkpoint_root": str(ckpt_root)})
    layout = Layout(str(tmp_path / "results"), "run", str(ckpt_root))
    ckpt_dir = layout.checkpoint_dir
    assert ckpt_dir == ckpt_root / "run"
    paths = {"plan": Path(layout.preflight_plan), "launch_script": Path(layout.preflight_launch),
             "runtime_env": Path(layout.deps_runtime_env), "sentinel": Path(layout.train_done),
             "metrics": Path(layout.train_metrics)}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    paths["plan"].write_text(json.dumps(plan_json(ckpt_dir, 4, 2, "run")))
    paths["launch_script"].write_text(launch_sh(ckpt_dir, 4, 2))
    paths["runtime_env"].write_text("working_dir: /nonexistent\n")
    return cfg, layout, paths


def _run(cfg, layout: Layout, paths: dict) -> None:
    train.run(cfg.train, cfg.cluster, layout, keep_steps=cfg.eval_keep_steps, **paths)


def _live_lock(ckpt_dir: Path, live: subprocess.Popen) -> None:
    import socket

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / ckptdir.LOCK_NAME).write_text(json.dumps({
        "job_id": None, "executor": "local", "host": socket.gethostname(),
        "pid": live.pid, "pid_create_time": ckptdir._pid_create_time(live.pid),
        "attempt": 4, "acquired_at": "t"}))


def test_run_refuses_when_lock_held_by_live_process(tmp_path: Path) -> None:
    cfg, layout, paths = _setup(tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _live_lock(layout.checkpoint_dir, live)
        with pytest.raises(ckptdir.LockHeld) as exc:
            _run(cfg, layout, paths)
        assert isinstance(exc.value, StageError)
        with pytest.raises(ckptdir.LockHeld, match="second trainer"):
            ckptdir.check_lock_free(layout.checkpoint_dir)  # what onstart: runs
    finally:
        live.kill()
        live.wait()
    assert f"local process {live.pid}" in str(exc.value)
    assert "second trainer" in str(exc.value)
    assert not Path(layout.attempt_record(1)).exists()
    ckptdir.check_lock_free(layout.checkpoint_dir)  # the holder is gone: free


def test_hy3rl_train_refusal_is_a_message_and_exit_1(tmp_path: Path) -> None:
    """`hy3rl train` (the console script) on the layout's paths: a live lock is refused
    with its message (no traceback), exit 1; so is a plan preflight did not launch."""
    cfg, layout, paths = _setup(tmp_path)
    conf = tmp_path / "c.yaml"
    conf.write_text(json.dumps({"run": {"name": "run"},
                                "train": {"checkpoint_root": str(tmp_path / "ckpt")}}))
    cmd = [sys.executable, "-m", "hy3rl.cli", "train", "--configfile",
           str(REPO_ROOT / "config" / "config.yaml"), "--configfile", str(conf)]
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _live_lock(layout.checkpoint_dir, live)
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        live.kill()
        live.wait()
    assert proc.returncode == 1, proc.stderr
    assert f"is in use by local process {live.pid}" in proc.stderr
    assert "Traceback" not in proc.stderr
    plan = json.loads(paths["plan"].read_text())
    paths["plan"].write_text(json.dumps({**plan, "launched": False,
                                         "not_launched_reason": "no GPU"}))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "preflight did not plan a launch: no GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_checkpoint_dir_must_be_the_layouts(tmp_path: Path) -> None:
    """The one checkpoint directory is Layout.checkpoint_dir; a plan rendered for another
    (stale preflight output) is refused, naming both."""
    cfg, layout, paths = _setup(tmp_path)
    plan = json.loads(paths["plan"].read_text())
    plan["checkpoint"]["dir"] = "/elsewhere/run"
    paths["plan"].write_text(json.dumps(plan))
    with pytest.raises(train.TrainError, match=rf"checkpoint.dir /elsewhere/run differs .*"
                       rf"{re.escape(str(layout.checkpoint_dir))}.*rerun preflight"):
        _run(cfg, layout, paths)
    assert not (layout.checkpoint_dir / ckptdir.LOCK_NAME).exists()


def test_nothing_to_launch_rewrites_done(tmp_path: Path, ckpt_writer) -> None:
    """Training already at its last step (a forced rerun): no Ray, done.json from the
    checkpoints, retention steps from the config."""
    cfg, layout, paths = _setup(tmp_path)
    for step in (2, 4):
        ckpt_writer(layout.checkpoint_dir, step)
    _run(cfg, layout, paths)
    done = json.loads(paths["sentinel"].read_text())
    assert done["final_step"] == 4 and done["total_training_steps"] == 4
    assert done["checkpoint_dir"] == str(layout.checkpoint_dir)
    assert done["hf_model"] == str(layout.checkpoint_hf_model(4))
    assert done["metrics"] == str(paths["metrics"]) and paths["metrics"].exists()
    assert done["kept_checkpoints"] == [2, 4] and done["attempts"] == []
    assert done["written_at"].endswith("+00:00")
    assert not (layout.checkpoint_dir / ckptdir.LOCK_NAME).exists()


def _records(layout: Layout) -> dict[Path, tuple[bytes, int]]:
    """Every file of the run's train/ directory and of its checkpoint directory: bytes and
    modification time."""
    files = [p for root in (Path(layout.train_dir), layout.checkpoint_dir)
             for p in sorted(root.rglob("*")) if p.is_file()]
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def test_a_refused_change_changes_no_record_and_restoring_it_submits_nothing(
        tmp_path: Path, ckpt_writer) -> None:
    """Issue 27 item 12, through the real functions on a real finished run (checkpoints of
    steps 2 and 4, the run identity, done.json, the final job's keys record): a learning-rate
    change names a keys record that is missing (the training job is in the DAG) and is
    refused by the identity check; nothing under train/ or in the checkpoint directory has
    changed (done.json is not set aside). Restoring the old value names the record still
    there: the job is complete, nothing is submitted. A job that does train under the new
    value removes the old record, so returning to it runs the job again."""
    from fixtures.common import REPO_ROOT as root
    from hy3rl.config import deep_merge, load
    from hy3rl.settings import Config

    cfg, layout, paths = _setup(tmp_path)
    before = load(root / "config" / "config.yaml")
    before = deep_merge(before, {"run": {"name": "run"}, "cluster": {"gpu": True},
                                 "train": {"checkpoint_root": str(tmp_path / "ckpt"),
                                           "cpu": {"enable": False}}})
    for step in (2, 4):
        ckpt_writer(layout.checkpoint_dir, step)
    _run(cfg, layout, paths)  # the finished run: nothing to launch, done.json
    record_a = Path(layout.train_keys("final", train.keys_digest(before, final=True)))
    train.record_keys(layout, "final", record_a, before)
    values = json.loads(record_a.read_text())["values"]
    assert f"train.checkpoint_root={json.dumps(str(tmp_path / 'ckpt'))}" in values
    assert not [v for v in values if v.startswith(("train.watchdog", "train.checkpoint_keep"))]
    records = _records(layout)
    assert Path(layout.train_done) in records and record_a in records

    changed = deep_merge(before, {"train": {"env": {"ACTOR_LR": 5e-6}}})
    Config.from_dict(changed)  # a valid config
    record_b = Path(layout.train_keys("final", train.keys_digest(changed, final=True)))
    assert record_b != record_a and not record_b.exists()  # the job is to run
    plan_b = plan_json(layout.checkpoint_dir, 4, 2, "run", lr="5e-6")
    d = ckptdir.decide_identity(layout.checkpoint_dir, plan_b["identity"]["trajectory"], 4,
                                "refuse")
    assert d.action == "refuse" and "actor_rollout_ref.actor.optim.lr" in d.error
    assert _records(layout) == records  # a refused change changed no record

    # the old value restored: its record is in place, the job complete, nothing submitted
    assert Path(layout.train_keys("final", train.keys_digest(before, final=True))).is_file()
    assert _records(layout) == records

    # a job that trained under the new value: the old record goes, returning re-runs
    train.record_keys(layout, "final", record_b, changed)
    assert record_b.is_file() and not record_a.exists()
    # a segment's record is named by the segments' common keys and its own end
    assert train.keys_digest(before, final=False) == train.keys_digest(
        deep_merge(before, {"train": {"total_training_steps": 40}}), final=False)


def _older_values(config: dict) -> list[str]:
    """The training keys as code before this change wrote them: no file contents, and
    train.on_config_change counted."""
    content = identity.content_stats(config)
    return sorted([v for v in identity.train_keys_params(config, "final").splitlines()
                   if v.partition("=")[0] not in content]
                  + [f"train.on_config_change={json.dumps(config['train']['on_config_change'])}"])


def _aged(path: Path, than: Path, by_ns: int) -> None:
    """``path``'s mtime set ``by_ns`` from ``than``'s (negative: older)."""
    t = than.stat().st_mtime_ns + by_ns
    os.utime(path, ns=(t, t))


def test_a_run_finished_by_older_code_is_adopted_not_trained(tmp_path: Path) -> None:
    """Issue 27: the first invocation after the training keys changed form (the older rule
    train_keys' file, or a record named by an older set of keys) finds no record of the
    current keys; with the same values, the finished job is adopted on the submit host (a
    record saying `origin: adopted`, nothing trained, nothing else changed) instead of
    submitting a job that trains nothing. A changed value, a file changed after the
    sentinel, a keys file newer than the sentinel or preflight's decision other than `same`
    at the job's end: not adopted (the job runs)."""
    from hy3rl.config import deep_merge

    cfg, layout, paths = _setup(tmp_path)
    config = deep_merge(cfg.raw, {"cluster": {"gpu": True},
                                  "train": {"total_training_steps": 4,
                                            "cpu": {"enable": False}}})
    done = train.write_done(layout, 4, 4, paths["sentinel"], paths["metrics"])  # finished
    current = train.keys_record(layout, "final", config)
    assert not current.exists()  # the job is in the DAG, as before this change
    assert train.adoption(layout, "final", config) is None  # no older record: it runs

    # the older rule train_keys' file, written before the job that wrote done.json
    legacy = Path(layout.train_keys_legacy("final"))
    legacy.parent.mkdir(parents=True, exist_ok=True)
    legacy.write_text(json.dumps({"rule": "train_keys", "wildcards": {"stretch": "final"},
                                  "values": _older_values(config)}))
    _aged(legacy, done, -10**9)
    found = train.adoption(layout, "final", config)
    assert found is not None and found.vouching == legacy and found.sentinel == done
    assert found.unseen == ("reward_function.sha256",)  # the older code counted no content

    # not adopted: a changed value; the keys file newer than the sentinel (the job that
    # followed it never finished); a file counted by content changed after the sentinel
    lr = deep_merge(config, {"train": {"env": {"ACTOR_LR": 5e-6}}})
    assert train.adoption(layout, "final", lr) is None
    _aged(legacy, done, 10**9)
    assert train.adoption(layout, "final", config) is None
    _aged(legacy, done, -10**9)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(*a, **k):\n    return 1.0\n")
    with_reward = deep_merge(config, {"train": {"reward_function": {"path": str(reward)}}})
    legacy.write_text(json.dumps({"values": _older_values(with_reward)}))
    _aged(legacy, done, -10**9)
    _aged(reward, done, -10**9)
    assert train.adoption(layout, "final", with_reward) is not None
    _aged(reward, done, 10**9)
    assert train.adoption(layout, "final", with_reward) is None
    legacy.write_text(json.dumps({"values": _older_values(config)}))
    _aged(legacy, done, -10**9)

    # preflight's decision must say the checkpoints are this trajectory's, at the total
    plan = Path(layout.train_plan)
    plan.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(Path(layout.preflight_plan).read_text())
    doc["identity"]["decision"] = {"action": "fresh", "newest_step": 4}
    plan.write_text(json.dumps(doc))
    records = _records(layout)
    with pytest.raises(train.TrainError, match=r"not adopted: .* 'fresh' .* remove "):
        train.adopt(layout, "final", current, config, plan)
    assert _records(layout) == records  # nothing written
    doc["identity"]["decision"] = {"action": "same", "newest_step": 4}  # as preflight says
    plan.write_text(json.dumps(doc))
    records = _records(layout)
    train.adopt(layout, "final", current, config, plan)
    rec = json.loads(current.read_text())
    assert rec["origin"] == "adopted" and rec["adopted"]["vouching_record"] == str(legacy)
    assert rec["adopted"]["identity_decision"] == {"action": "same", "newest_step": 4}
    assert "no training job ran" in rec["adopted"]["note"]
    assert rec["values"] == identity.train_keys_params(config, "final").splitlines()
    assert {p: v for p, v in _records(layout).items() if p != current} == records
    assert train.adoption(layout, "final", config) is None  # done: the record is in place
    # a job that trained says so
    trained = Path(layout.train_keys("final", "0" * 16))
    train.record_keys(layout, "final", trained, config)
    assert json.loads(trained.read_text())["origin"] == "trained" and not current.exists()
    trained.unlink()

    # a record named by an older set of keys (written after done.json by the job) vouches
    # too, and is replaced by the adopted one
    older = Path(layout.train_keys("final", "f" * 16))
    older.write_text(json.dumps({"stretch": "final", "values": _older_values(config)}))
    _aged(older, done, 10**9)
    found = train.adoption(layout, "final", config)
    assert found is not None and found.vouching == older
    train.adopt(layout, "final", current, config, plan)
    assert current.is_file() and not older.exists()

    # the older rule's file stays an input while Snakemake's record of done.json lists it
    assert train.legacy_keys_input(layout, "final", [layout.train_plan, str(legacy)]) == {
        "legacy_keys": str(legacy)}
    assert train.legacy_keys_input(layout, "final", [layout.train_plan]) == {}
    assert train.legacy_keys_input(layout, "final", None) == {}


# ---------------------------------------------------------------- launcher pieces


SCONTROL_JOB = """JobId=12 JobName=x
   NumNodes=2 NumCPUs=4 NumTasks=2 CPUs/Task=2 ReqB:S:C:T=0:0:*:*
   TRES=cpu=4,mem=2000M,node=2,billing=4,gres/gpu=4
     Nodes=n[1-2] CPU_IDs=0-1 Mem=1000 GRES=gpu:2(IDX:0-1)
   MinCPUsNode=2 MinMemoryNode=1000M MinTmpDiskNode=0
"""


def test_parse_job_detail_and_allocation_check() -> None:
    assert launch.parse_job_detail(SCONTROL_JOB) == {"n[1-2]": (2, 2)}
    assert launch.parse_job_detail("  Nodes=a1 CPU_IDs=0-3,8 Mem=0 GRES=gpu:h20:8(IDX:0-7)") \
        == {"a1": (5, 8)}
    nodes = [launch.Node("n1", "h", 2, 2), launch.Node("n2", "h", 2, 2)]
    spec = launch.LaunchSpec("s", Path("l"), Path("e"), Path("d"), nodes=2, gpus_per_node=2,
                             cpus_per_node=2)
    launch.check_allocation(nodes, spec)
    spec.cpus_per_node = 3
    with pytest.raises(launch.LaunchError, match="node n1: cluster.cpus_per_node=3"):
        launch.check_allocation(nodes, spec)
    spec.cpus_per_node, spec.gpus_per_node = 2, 8
    with pytest.raises(launch.LaunchError, match="gives 2 GPUs"):
        launch.check_allocation(nodes, spec)
    spec.nodes = 3
    with pytest.raises(launch.LaunchError, match="2 node"):
        launch.check_allocation(nodes, spec)


def test_port_plan_disjoint_for_cohosted_nodes() -> None:
    ray = make_config().train.ray
    nodes = [launch.Node("n1", "host"), launch.Node("n2", "host"), launch.Node("n3", "other")]
    plan = launch.port_plan(1234, nodes, ray)

    def ports(p: launch.Ports) -> set[int]:
        vals = set(vars(p).values()) - {p.min_worker, p.max_worker}
        return vals | set(range(p.min_worker, p.max_worker + 1))

    assert not ports(plan["n1"]) & ports(plan["n2"])  # same host: disjoint
    assert plan["n3"] == plan["n1"]  # another host may reuse the numbers
    for p in plan.values():
        assert ray.port_base <= min(ports(p)) and max(ports(p)) < 32768
    assert launch.port_plan(1235, nodes, ray)["n1"].gcs != plan["n1"].gcs


def test_scope_kill_stops_only_its_processes() -> None:
    env = {**os.environ, raynode.SCOPE_VAR: "scope-a"}
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, raynode.SCOPE_VAR: "scope-b"})
    try:
        import time

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not raynode.scope_processes("scope-a"):
            time.sleep(0.2)
        assert raynode.kill_scope("scope-a", grace=5) == 1
        assert mine.wait(10) is not None
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_segment_steps_chain_in_the_dag(tmp_path: Path, monkeypatch) -> None:
    from fixtures.common import run_snakemake

    override = tmp_path / "seg.yaml"
    override.write_text(json.dumps({"cluster": {"gpu": True, "nodes": 2, "gpus_per_node": 2},
                                    "train": {"checkpoint_root": str(tmp_path / "ckpt"),
                                              "cpu": {"enable": False},
                                              "segment_steps": 2,
                                              "total_training_steps": 6}}))
    root = Path(__file__).resolve().parents[1]
    proc = run_snakemake(["-n", "-p", "--configfile", str(root / "config" / "config.yaml"),
                          str(override), "--", "results/tiny-default/train/done.json"],
                         tmp_path)
    out = proc.stdout
    assert re.search(r"^train_segment\s+2$", out, re.M), out[-3000:]
    for end in (2, 4):
        assert re.search(rf"rule train_segment:\n(?:    .*\n)*?    output: results/tiny-default/"
                         rf"train/segments/step{end}\.json, results/tiny-default/train/keys/"
                         rf"step{end}\.[0-9a-f]{{16}}\.json\n(?:    .*\n)*?    wildcards: "
                         rf"end={end}\n", out), out[-3000:]
    assert "results/tiny-default/train/segments/step4.json" in out.split("rule train:")[1]
    # the keys records: outputs named by the digest of the configured training keys
    from hy3rl.config import load

    config = load(root / "config" / "config.yaml", override)
    monkeypatch.chdir(tmp_path)  # the keys count local paths resolved in the working dir
    final = f"results/tiny-default/train/keys/final.{train.keys_digest(config, True)}.json"
    assert f"output: results/tiny-default/train/done.json, " \
           f"results/tiny-default/train/metrics.jsonl, {final}" in out, out[-3000:]
    segment = train.keys_digest(config, False)
    assert f"results/tiny-default/train/keys/step4.{segment}.json" in out, out[-3000:]
    assert "--config-json" not in out


def _launcher(tmp_path: Path, runtime: Runtime | None, job_id: str | None):
    spec = launch.LaunchSpec("s1", tmp_path / "launch.sh", tmp_path / "re.yaml", tmp_path,
                             nodes=2, gpus_per_node=8, cpus_per_node=4, runtime=runtime)
    lr = launch.Launcher(spec)
    lr.job_id = job_id
    ports = launch.port_plan(7, [launch.Node("n1", "n1"), launch.Node("n2", "n2")], lr.ray)
    return lr, ports


def test_node_cmd_slurm_with_runtime_prefix(tmp_path: Path) -> None:
    prefix = "apptainer exec --nv --bind '/sh ared' docker://verlai/verl:vllm023.dev1"
    lr, ports = _launcher(tmp_path, Runtime(prefix=prefix, python=""), "77")
    cmd = lr.node_cmd(launch.Node("n2", "n2"), "worker", ports["n2"], "10.0.0.1:20000")
    assert cmd[:8] == ["srun", "--overlap", "--jobid=77", "--nodes=1", "--ntasks=1",
                       "--nodelist=n2", "--kill-on-bad-exit=1", "--export=ALL"]
    assert cmd[8:18] == ["apptainer", "exec", "--nv", "--bind", "/sh ared",
                         "docker://verlai/verl:vllm023.dev1", "env",
                         f"PYTHONPATH={launch.SCRIPTS_DIR}", "python3", "-m"]
    assert (launch.SCRIPTS_DIR / "hy3rl" / "raynode.py").is_file()
    assert cmd[18:20] == ["hy3rl.raynode", "node"]
    assert cmd[cmd.index("--ray-cli") + 1] == "ray"
    assert cmd[cmd.index("--head-address") + 1] == "10.0.0.1:20000"
    assert sys.executable not in cmd


def test_node_cmd_local_default_and_python(tmp_path: Path) -> None:
    lr, ports = _launcher(tmp_path, None, None)
    cmd = lr.node_cmd(launch.Node("n1", "n1"), "head", ports["n1"], None)
    assert cmd[:4] == [sys.executable, "-m", "hy3rl.raynode", "node"]
    assert "--ray-cli" not in cmd and "srun" not in cmd
    assert cmd[cmd.index("--publish") + 1] == str(tmp_path / "head.json")

    lr, ports = _launcher(tmp_path, Runtime(prefix="conda run -n verl",
                                            python="/opt/py/bin/python"), None)
    cmd = lr.node_cmd(launch.Node("n1", "n1"), "head", ports["n1"], None)
    assert cmd[:7] == ["conda", "run", "-n", "verl", "env",
                       f"PYTHONPATH={launch.SCRIPTS_DIR}", "/opt/py/bin/python"]
    assert "--ray-cli" in cmd


def test_resolve_runtime_defaults_and_errors() -> None:
    assert launch.resolve_runtime(None) == {"prefix": "", "python": sys.executable}
    assert launch.resolve_runtime(make_config().train.runtime) == \
        {"prefix": "", "python": sys.executable}
    assert launch.resolve_runtime(Runtime(prefix=" wrap ", python="")) == \
        {"prefix": "wrap", "python": "python3"}
    with pytest.raises(launch.LaunchError, match="train.runtime.prefix"):
        launch.resolve_runtime(Runtime(prefix="apptainer exec 'unclosed", python=""))
    assert issubclass(launch.LaunchError, StageError)
    from hy3rl.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key train.runtime.image"):
        make_config(train={"runtime": {"image": "x"}})


def test_launcher_defaults_come_from_the_schema(tmp_path: Path) -> None:
    """A launch given no Ray settings (evaluation's) gets train.ray's schema defaults."""
    lr, _ = _launcher(tmp_path, None, None)
    assert lr.ray == make_config().train.ray


def test_runtime_env_secrets_redacted_in_logs(tmp_path: Path, monkeypatch, caplog) -> None:
    """The merged runtime env keeps the passed-through values but the secrets, which go
    through the launch's .job-env (hy3rl.jobenv; tests/test_jobenv.py); the launcher's log
    and the streamed driver output show them as hy3rl.redact's [REDACTED]."""
    import yaml

    token = "hf_" + "a1B2" * 8
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "re.yaml").write_text("working_dir: /x\nenv_vars: {A: '1'}\n")
    spec = launch.LaunchSpec("s1", tmp_path / "launch.sh", tmp_path / "re.yaml", tmp_path,
                             env_vars={"VERL_FILE_LOGGER_PATH": "/m.jsonl"},
                             passthrough_env=["HF_TOKEN", "WANDB_MODE", "UNSET_VAR"])
    caplog.set_level(logging.INFO, "hy3rl.launch")
    lr = launch.Launcher(spec)
    path = lr.merged_runtime_env()
    merged = yaml.safe_load(path.read_text())
    assert merged["env_vars"] == {"A": "1", "VERL_FILE_LOGGER_PATH": "/m.jsonl",
                                  "WANDB_MODE": "offline",
                                  "HY3RL_JOB_ENV": str(tmp_path / ".job-env"),
                                  # Megatron-Bridge's loading bar drawn as it advances
                                  "TTY_COMPATIBLE": "1", "COLUMNS": "400"}
    assert path.stat().st_mode & 0o777 == 0o600 and not path.is_relative_to(tmp_path)
    kept = yaml.safe_load((tmp_path / "runtime_env.yaml").read_text())  # the attempt's copy
    assert kept == merged
    lr.teardown()
    assert not path.exists() and not (tmp_path / ".job-env").exists()
    assert token not in caplog.text and "secrets ['HF_TOKEN'] through" in caplog.text
    assert "'WANDB_MODE': 'offline'" in caplog.text
    assert lr.redactor.text(f"login with {token} ok\n") == "login with [REDACTED] ok\n"


# ---------------------------------------------------------------- runtime identity


def test_runtime_identity_of_registry_images() -> None:
    pinned = "docker://verlai/verl@sha256:" + "4f" * 32
    ident = runtime_id.identify(f"apptainer exec --nv --bind /shared {pinned}", "python3")
    assert ident == {"kind": "image", "id": pinned, "image": pinned,
                     "digest": "sha256:" + "4f" * 32, "pinned": True}
    ident = runtime_id.identify("singularity exec --nv -B /a:/b "
                                "docker://verlai/verl:vllm023.dev1", "python3")
    assert (ident["kind"], ident["tag"], ident["pinned"]) == ("image", "vllm023.dev1", False)
    assert "a tag can move" in ident["note"] and "runtime_tag" in ident["note"]
    ident = runtime_id.identify("/opt/bin/apptainer exec docker://reg.io:5000/verl", "python3")
    assert ident["tag"] == "latest (implicit)" and ident["image"] == "docker://reg.io:5000/verl"


def test_runtime_identity_of_a_sif_is_hashed_once(tmp_path: Path, monkeypatch) -> None:
    import hashlib

    sif = tmp_path / "images" / "verl.sif"
    sif.parent.mkdir()
    sif.write_bytes(os.urandom(3 * runtime_id.CHUNK // 2))  # more than one streamed chunk
    cache = tmp_path / "train" / "runtime_id_cache.json"
    prefix = f"apptainer exec --nv --bind /shared {sif}"
    first = runtime_id.identify(prefix, "python3", cache=cache)
    digest = hashlib.sha256(sif.read_bytes()).hexdigest()
    assert (first["kind"], first["sha256"], first["sha256_from"]) == ("sif", digest, "hashed")
    assert first["image"] == str(sif) and first["id"] == f"{sif} sha256:{digest}"
    assert json.loads(cache.read_text())[str(sif)]["sha256"] == digest
    calls = []
    real = runtime_id.sha256_file
    monkeypatch.setattr(runtime_id, "sha256_file", lambda p: calls.append(p) or real(p))
    again = runtime_id.identify(prefix, "python3", cache=cache)
    assert again["sha256"] == digest and again["sha256_from"] == "cache" and calls == []
    with open(sif, "ab") as fh:  # another image at the same path: size and mtime change
        fh.write(b"x")
    changed = runtime_id.identify(prefix, "python3", cache=cache)
    assert changed["sha256_from"] == "hashed" and calls == [sif]
    assert changed["sha256"] == hashlib.sha256(sif.read_bytes()).hexdigest() != digest


def test_runtime_identity_of_an_interpreter_through_its_prefix(tmp_path: Path) -> None:
    """No image: the runtime's python, its version and `pip freeze`, run through the prefix
    (a wrapper printing a banner of its own, as `conda run` may)."""
    import hashlib
    import platform

    wrap = tmp_path / "wrap.sh"
    wrap.write_text('#!/bin/bash\necho "banner: entering the runtime"\nexec "$@"\n')
    wrap.chmod(0o755)
    ident = runtime_id.identify(str(wrap), sys.executable)
    assert ident["kind"] == "interpreter", ident
    assert ident["python"] == sys.executable
    assert ident["python_version"] == platform.python_version()
    assert ident["freeze_method"] == "pip freeze --all"
    from importlib import metadata

    assert f"ray=={metadata.version('ray')}" in ident["freeze"]
    assert ident["freeze_sha256"] == hashlib.sha256(
        ("\n".join(ident["freeze"]) + "\n").encode()).hexdigest()
    assert ident["id"].startswith(f"python {platform.python_version()} {sys.executable}, "
                                  f"freeze sha256:{ident['freeze_sha256']}")


def test_runtime_identity_failures_are_recorded_not_fatal(tmp_path: Path) -> None:
    gone = runtime_id.identify(f"apptainer exec {tmp_path / 'missing.sif'}", "python3")
    assert gone["kind"] == "unknown" and "not found on this host" in gone["reason"]
    assert gone["id"] == f"unknown: {gone['reason']}"
    assert "not found on PATH" in runtime_id.identify("no-such-runtime-cmd", "python3")["reason"]
    assert runtime_id.identify("apptainer exec 'unclosed", "python3")["kind"] == "unknown"
    broken = tmp_path / "broken.sh"
    broken.write_text("#!/bin/bash\necho 'no such env' >&2\nexit 3\n")
    broken.chmod(0o755)
    ident = runtime_id.identify(str(broken), "python3")
    assert ident["kind"] == "unknown" and "exited 3: no such env" in ident["reason"]


# ---------------------------------------------------------------- one Ray on both sides


def _stub_ray_runtime(tmp_path: Path, version: str) -> Runtime:
    """A runtime prefix whose python imports a stub `ray` reporting ``version``."""
    stub = tmp_path / "stub"
    (stub / "ray").mkdir(parents=True)
    (stub / "ray" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    wrap = tmp_path / "stub-runtime.sh"
    wrap.write_text(f'#!/bin/bash\nexport PYTHONPATH={stub}\nexec "$@"\n')
    wrap.chmod(0o755)
    return Runtime(prefix=str(wrap), python=sys.executable)


def test_ray_versions_mismatch_refuses_naming_both(tmp_path: Path) -> None:
    from importlib import metadata

    client = launch.client_ray_version()
    assert client == metadata.version("ray")
    runtime = _stub_ray_runtime(tmp_path, "2.9.3")
    assert launch.runtime_ray_version(runtime) == "2.9.3"
    versions = launch.ray_versions(client, "2.9.3")
    assert versions == {"client": client, "cluster": "2.9.3", "match": False}
    with pytest.raises(launch.LaunchError) as exc:
        launch.refuse_mismatch(versions, runtime)
    msg = str(exc.value)
    assert f"has Ray {client}" in msg and "runs Ray 2.9.3" in msg
    assert str(runtime.prefix) in msg and "ray[default]==2.9.3" in msg
    assert f"whose Ray is {client}" in msg
    assert exc.value.reason == f"ray version mismatch (client {client}, cluster 2.9.3)"
    launch.refuse_mismatch(launch.ray_versions(client, client), runtime)  # equal: submits
    launch.refuse_mismatch(launch.ray_versions(client, None), runtime)  # unknown: submits
    with pytest.raises(launch.LaunchError, match="without a Ray version"):
        launch.runtime_ray_version(Runtime(prefix="env", python="/bin/true"))


def test_launcher_checks_ray_before_workers_and_records_both(tmp_path: Path) -> None:
    """The head's published version is used; without one, the runtime is probed. Both
    versions reach ``on_ray`` before a mismatch refuses."""
    client = launch.client_ray_version()
    lr, _ = _launcher(tmp_path, _stub_ray_runtime(tmp_path, "2.9.3"), None)
    seen: list[dict] = []
    lr.on_ray = seen.append
    lr.check_ray({"ray_version": client})
    assert seen[-1]["match"] is True and seen[-1]["cluster_from"] == "head.json"
    with pytest.raises(launch.LaunchError, match="Ray version mismatch") as exc:
        lr.check_ray({})  # no version published: `<prefix> <python> -c "import ray..."`
    assert seen[-1] == {"client": client, "cluster": "2.9.3", "match": False,
                        "client_cli": launch.RAY, "cluster_from": "runtime probe"}
    assert "cluster 2.9.3" in exc.value.reason


def test_attempt_record_names_runtime_and_ray(tmp_path: Path, monkeypatch) -> None:
    """train.run records the runtime's identity (a local SIF: hashed into the layout's
    cache) and both Ray versions; a mismatch ends the attempt with its reason."""
    sif = tmp_path / "verl.sif"
    sif.write_bytes(b"SIF image bytes")
    cfg, layout, paths = _setup(tmp_path)
    cfg = make_config(run={"name": "run"},
                      cluster={"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1},
                      train={"checkpoint_root": str(tmp_path / "ckpt"),
                             "runtime": {"prefix": f"apptainer exec {sif}"}})
    versions = {"client": "2.60.0", "cluster": "2.9.3", "match": False,
                "client_cli": "ray", "cluster_from": "head.json"}

    def fake_launch(spec, on_nodes=None, on_stop=None, on_ray=None):
        on_nodes(["n1"])
        rec = json.loads(Path(layout.attempt_record(1)).read_text())
        assert rec["runtime"]["identity"]["kind"] == "sif" and rec["runtime"]["ray"] is None
        on_ray(versions)
        return launch.LaunchResult(1, "ray version mismatch (client 2.60.0, cluster 2.9.3)",
                                   ["n1"], None, dict(versions), "refused")

    monkeypatch.setattr(launch, "launch", fake_launch)
    with pytest.raises(train.TrainFailed, match="^ray version mismatch .*; not resubmitted"):
        _run(cfg, layout, paths)
    assert train.attempt_numbers(layout) == [1]  # a refusal is never restarted
    rec = json.loads(Path(layout.attempt_record(1)).read_text())
    assert rec["exit_reason"] == "ray version mismatch (client 2.60.0, cluster 2.9.3)"
    assert rec["outcome"] == "refused"
    exit_doc = json.loads(Path(layout.train_job_exit).read_text())
    assert exit_doc["retry"] is False and exit_doc["attempts"] == [1]
    rt = rec["runtime"]
    assert (rt["prefix"], rt["python"]) == (f"apptainer exec {sif}", "python3")
    assert rt["identity"]["kind"] == "sif" and rt["identity"]["image"] == str(sif)
    assert rt["ray"] == versions
    assert str(sif) in json.loads(Path(layout.runtime_id_cache).read_text())


def test_trainer_double_logs_verls_memory_key() -> None:
    """verl@220e903 (engine_workers.py + ray_trainer.py's "actor/" prefix) logs
    actor/perf/max_memory_allocated_gb; the double logs the same key, not a bare perf/ one."""
    from fixtures.trainer_double import double_module

    data = double_module().metrics(1, 2)
    assert data["actor/perf/max_memory_allocated_gb"] > 0
    assert "actor/perf/max_memory_reserved_gb" in data
    assert "perf/max_memory_allocated_gb" not in data


def test_copied_logs_are_redacted_with_the_one_policy(tmp_path: Path) -> None:
    """Ray's runtime_env_agent.log holds the job's env vars: the node's copies of its logs
    (and the hang diagnostics) are rewritten with the passed-through keys [REDACTED]."""
    from hy3rl.redact import make_redactor

    key = "wandb-key-0123456789abcdef0123456789"
    agent = tmp_path / "runtime_env_agent.log"
    agent.write_text(f'env_vars: {{"WANDB_API_KEY": "{key}", "WANDB_MODE": "offline"}}\n')
    plain = tmp_path / "raylet.out"
    plain.write_text("nothing secret\n")
    redactor = make_redactor({"WANDB_API_KEY": key, "WANDB_MODE": "offline"}, [])
    assert raynode.redact_files(redactor, [agent, plain, tmp_path / "gone.log"]) == 1
    assert key not in agent.read_text() and "[REDACTED]" in agent.read_text()
    assert "offline" in agent.read_text() and plain.read_text() == "nothing secret\n"


def _rec(k: int, outcome: str, start: int, end: int, failed_at: int | None = None,
         lost: list[str] | None = None) -> dict:
    return {"attempt": k, "outcome": outcome, "exit_reason": f"{outcome} reason",
            "start_step": start, "end_step": end, "last_logged_step": end,
            "failed_at_step": failed_at, "lost_nodes": lost or [], "log_dir": f"attempt-{k}",
            "error": None}


def test_after_attempt_restarts_ends_or_stops() -> None:
    """The job's decision after an attempt: restart in the allocation while restarts and one
    save interval of time are left; end for a resubmission otherwise; never restart a
    refusal; stop (no retry) on a crash loop; a lost node only when the layout fits."""
    def decide(rec, records=None, **kw):
        args = {"restarts_left": 2, "lost": rec["lost_nodes"], "allocation": ["n1", "n2"],
                "nodes_needed": 2, "time_left": 3600.0, "interval": 600.0}
        args.update(kw)
        return train.after_attempt(rec, records or [rec], **args)

    crash = _rec(1, "failed", 0, 20, failed_at=27)
    assert decide(crash).restart
    no_time = decide(crash, time_left=500.0)
    assert (no_time.restart, no_time.retry) == (False, True)
    assert "500s left, a restart needs 600s until its first save" in no_time.reason
    assert not decide(crash, restarts_left=0).restart
    assert decide(crash, time_left=None, interval=None).restart  # unknown: allowed
    for outcome in ("stopped_for_time_limit", "time_limit", "preempted"):
        step = decide(_rec(1, outcome, 0, 20))
        assert (step.restart, step.retry) == (False, True), outcome
    for outcome in ("refused", "cancelled"):
        step = decide(_rec(1, outcome, 0, 20))
        assert (step.restart, step.retry) == (False, False), outcome
    again = _rec(2, "failed", 20, 20, failed_at=27)
    loop = decide(again, [crash, again])
    assert (loop.restart, loop.retry) == (False, False)
    assert loop.reason.startswith("crash loop at step 27: attempts 1 and 2 failed there")
    lost = _rec(1, "node_lost", 0, 20, lost=["n2"])
    step = decide(lost)
    assert (step.restart, step.retry, step.exclude) == (False, True, ["n2"])
    assert "the layout needs 2 node(s) without n2" in step.reason
    assert decide(lost, allocation=["n1", "n2", "n3"]).restart  # a spare node: it fits


@pytest.mark.parametrize(("reason", "job", "left", "outcome"), [
    ("signal SIGTERM", "42", 30.0, "time_limit"),
    ("signal SIGTERM", "42", 0.0, "time_limit"),  # squeue's INVALID: negative time left
    ("signal SIGTERM", "42", 3600.0, "preempted"),
    ("signal SIGUSR1", "42", None, "preempted"),
    ("signal SIGINT", "42", 30.0, "cancelled"),
    ("signal SIGTERM", None, None, "cancelled")])
def test_classify_signal(reason: str, job: str | None, left: float | None, outcome: str) -> None:
    assert train.classify_signal(reason, job, left) == outcome


def test_last_error_line(tmp_path: Path) -> None:
    log = tmp_path / "driver.log"
    log.write_text("step:4\nTraceback (most recent call last):\n  File x\n"
                   "\x1b[31mRuntimeError: CUDA error: an illegal memory access\x1b[0m\n"
                   "(TaskRunner pid=1) ValueError: bad batch\nwandb: finished\n")
    assert train.last_error(log) == "ValueError: bad batch"
    assert train.last_error(tmp_path / "none.log") is None


def test_resume_keeps_only_the_newest_incomplete_save(ckpt: Path) -> None:
    """Issue 19, 9: multi-TB leftovers of saves that never completed are removed at the
    next start, all but the newest (kept for inspection)."""
    partial_checkpoint(ckpt, 6)
    ckptdir.prepare_resume(ckpt, attempt=2)
    partial_checkpoint(ckpt, 6)
    ckptdir.prepare_resume(ckpt, attempt=10)
    partial_checkpoint(ckpt, 6)
    start, actions = ckptdir.prepare_resume(ckpt, attempt=11)
    assert start == 4
    assert sorted(p.name for p in ckpt.iterdir() if "incomplete" in p.name or
                  p.name.startswith(".pruning")) == ["global_step_6.incomplete-11"]
    assert "removed global_step_6.incomplete-10 (an older incomplete save; the newest is " \
        "kept)" in actions


def test_a_full_disk_is_not_retried_as_a_crash(tmp_path: Path) -> None:
    """Issue 19, 9: a save that fails for lack of space says so; neither restarted nor
    resubmitted (every attempt would fail at the same save)."""
    driver = tmp_path / "driver.log"
    driver.write_text("step:19 - ok\nTraceback (most recent call last):\n"
                      "OSError: [Errno 28] No space left on device: '/ckpt/global_step_20'\n")
    why = train.disk_full(driver, tmp_path)
    assert why and why.startswith(f"the trainer ran out of disk space (No space left on device)"
                                  f" on {tmp_path} (")
    assert train.disk_full(tmp_path / "missing.log", tmp_path) is None
    (tmp_path / "ok.log").write_text("RuntimeError: CUDA error\n")
    assert train.disk_full(tmp_path / "ok.log", tmp_path) is None
    rec = {**_rec(1, "failed", 0, 0, failed_at=20), "disk_full": why}
    step = train.after_attempt(rec, [rec], restarts_left=3, lost=[], allocation=["n1"],
                               nodes_needed=1, time_left=None, interval=None)
    assert (step.restart, step.retry) == (False, False) and why in step.reason


def test_a_start_that_hangs_ends_for_a_new_allocation() -> None:
    rec = {**_rec(1, "hung", 0, 0), "last_logged_step": None}
    step = train.after_attempt(rec, [rec], restarts_left=3, lost=[], allocation=["n1"],
                               nodes_needed=1, time_left=None, interval=None)
    assert (step.restart, step.retry) == (False, True)
    assert step.reason.endswith("a start that hangs is retried in a new allocation (no node "
                                "stopped before the others: none excluded): ends for a "
                                "resubmission")
