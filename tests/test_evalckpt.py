"""Evaluation beside training (hy3rl.evalckpt): the wait for an evaluation step's checkpoint
on real checkpoint directories written by the trainer double's own writer, the training
state the controller records, and retention keeping what an evaluation has not read."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.common import make_config
from fixtures.trainer_double import partial_checkpoint
from hy3rl import ckptdir, evalckpt
from hy3rl.identity import eval_request_digest
from hy3rl.layout import Layout, heldout_tag

TRAJ = {"id": "a" * 64, "values": {"k": 1}, "origins": {}}


def plan(total: int = 6) -> dict:
    return {"identity": {"trajectory": TRAJ, "total_training_steps": total}}


def own(ckpt: Path, traj: dict = TRAJ) -> None:
    """The checkpoint directory's identity, as a training attempt writes it."""
    d = ckptdir.decide_identity(ckpt, traj, 6, "refuse")
    ckptdir.apply_identity(ckpt, d, traj, 6, 0, attempt=1)


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(str(tmp_path / "results"), "run", str(tmp_path / "ckpt"))


class Clock:
    """A simulated clock: sleep advances it and lets ``on_sleep`` act (the trainer)."""

    def __init__(self, on_sleep=None):
        self.t, self.on_sleep, self.sleeps = 0.0, on_sleep, 0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        self.sleeps += 1
        if self.on_sleep:
            self.on_sleep(self)


def test_wait_ends_when_the_step_is_complete_under_this_identity(layout, ckpt_writer,
                                                                 tmp_path) -> None:
    ckpt = layout.checkpoint_dir
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan()))
    out = tmp_path / "eval" / "step4" / "checkpoint.json"

    def trainer(clock: Clock) -> None:  # saves step 2 at t=60 s, step 4 at t=3 h (paper pace)
        if clock.t >= 60 and not (ckpt / "global_step_2").exists():
            own(ckpt)
            ckpt_writer(ckpt, 2)
        if clock.t >= 3 * 3600 and not (ckpt / "global_step_4").exists():
            partial_checkpoint(ckpt, 4)  # a multi-TB save under way: not complete yet
        if clock.t >= 3 * 3600 + 50 * 60:
            ckpt_writer(ckpt, 4)

    clock = Clock(trainer)
    rec = evalckpt.wait(layout, plan_path, 4, out, 30, unproven_polls=3, sleep=clock.sleep,
                        clock=clock)
    assert rec["step"] == 4 and rec["trajectory_id"] == TRAJ["id"]
    assert rec["waited_s"] >= 3 * 3600 + 50 * 60
    assert json.loads(out.read_text())["hf_model"].endswith(
        "global_step_4/actor/model/huggingface")


def test_a_checkpoint_of_another_configuration_is_not_taken(layout, ckpt_writer) -> None:
    """Before a `fresh` start moves them aside, the old run's checkpoints are there: the
    wait keeps waiting for this run's."""
    ckpt = layout.checkpoint_dir
    own(ckpt, {"id": "b" * 64, "values": {"k": 2}, "origins": {}})
    ckpt_writer(ckpt, 2)
    seen = evalckpt.look(layout, plan(), 2)
    assert seen.state == "wait" and "trajectory bbbbbbbbbbbb" in seen.message


def test_training_that_ended_before_the_step_fails_the_wait(layout, ckpt_writer,
                                                             tmp_path) -> None:
    ckpt = layout.checkpoint_dir
    own(ckpt)
    ckpt_writer(ckpt, 2)
    done = Path(layout.train_done)
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"final_step": 2, "trajectory_id": TRAJ["id"],
                                "total_training_steps": 6}))
    seen = evalckpt.look(layout, plan(), 4)
    assert seen.state == "failed"
    assert "step 4: training ended at step 2 before step 4" in seen.message
    # a done.json of a shorter total is an old one: this invocation extends, so wait
    assert evalckpt.look(layout, plan(total=8), 4).state == "wait"
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan()))
    with pytest.raises(evalckpt.WaitFailed, match="step 4: training ended at step 2"):
        evalckpt.wait(layout, plan_path, 4, tmp_path / "out.json", 1, unproven_polls=3,
                      sleep=lambda s: None)
    assert not (tmp_path / "out.json").exists()


def test_a_stop_by_this_controller_fails_the_wait_an_old_one_does_not(layout, ckpt_writer
                                                                      ) -> None:
    ckpt = layout.checkpoint_dir
    own(ckpt)
    ckpt_writer(ckpt, 2)
    # written by this process: an ancestor of the look (as the controller of its wait)
    evalckpt.write_train_state(layout, "stopped", "a crash loop; not resubmitted")
    seen = evalckpt.look(layout, plan(), 4)
    assert seen.state == "failed", seen
    assert seen.message.startswith("step 4: training stopped before step 4: a crash loop")
    assert "newest complete checkpoint step 2" in seen.message
    # the same record from a controller that is not an ancestor (an earlier invocation)
    doc = json.loads(Path(layout.train_state).read_text())
    other = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True).stdout.strip()
    Path(layout.train_state).write_text(json.dumps({**doc, "controller_pid": int(other)}))
    assert evalckpt.look(layout, plan(), 4).state == "wait"
    Path(layout.train_state).write_text(json.dumps({**doc, "host": "elsewhere"}))
    assert evalckpt.look(layout, plan(), 4).state == "wait"
    assert doc["host"] == socket.gethostname() and doc["controller_pid"] == os.getpid()


def _cfg(keep_eval: str, steps=(2, 4)):
    return make_config(cluster={"gpu": True}, eval={"steps": list(steps)},
                       train={"keep_eval_checkpoints": keep_eval, "checkpoint_keep": 1})


def _request(layout: Layout, cfg, tag: str, text: str = "r1", digest: str | None = None
             ) -> Path:
    """Tag ``tag``'s request under ``cfg`` (or of another ``digest``)."""
    p = Path(layout.eval_request(tag, digest or eval_request_digest(cfg.raw, tag)))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_retention_keeps_a_checkpoint_until_every_evaluation_read_it(layout, ckpt_writer
                                                                      ) -> None:
    """checkpoint_keep 1 and keep_eval_checkpoints selected: step 2 stays while its
    evaluations (test set and held-out set) have not read it, also for a pruner started
    afresh (a restarted training job), and goes once both read it."""
    cfg = _cfg("selected")
    assert cfg.data.heldout is not None  # the embedded default's held-out set
    ckpt = layout.checkpoint_dir
    for step in (2, 4, 6):
        ckpt_writer(ckpt, step)
    tags = ["step2", heldout_tag("step2")]
    reqs = {t: _request(layout, cfg, t) for t in tags}
    protect = evalckpt.protector(cfg, layout)
    assert ckptdir.prune(ckpt, 1, protect) == []  # 2 and 4 unread: kept, nothing else old
    assert sorted(c.step for c in ckptdir.scan(ckpt)) == [2, 4, 6]
    evalckpt.mark_read(ckpt / "global_step_2", tags[0], reqs[tags[0]])
    # one of its two evaluations is still reading: a fresh pruner (restart) keeps it too
    assert ckptdir.prune(ckpt, 1, evalckpt.protector(cfg, layout)) == []
    # a read under other values (a request of another digest: a re-evaluation is coming)
    # does not count
    old = _request(layout, cfg, tags[1], "r0", digest="0" * 16)
    evalckpt.mark_read(ckpt / "global_step_2", tags[1], old)
    assert evalckpt.protected_steps(cfg, layout) == [2, 4]
    evalckpt.mark_read(ckpt / "global_step_2", tags[1], reqs[tags[1]])
    assert evalckpt.protected_steps(cfg, layout) == [4]
    assert ckptdir.prune(ckpt, 1, protect) == [2]
    assert sorted(c.step for c in ckptdir.scan(ckpt)) == [4, 6]


def test_retention_all_keeps_every_evaluation_step(layout, ckpt_writer) -> None:
    cfg = _cfg("all")
    ckpt = layout.checkpoint_dir
    for step in (2, 4, 6):
        ckpt_writer(ckpt, step)
    for tag in ("step2", heldout_tag("step2")):
        evalckpt.mark_read(ckpt / "global_step_2", tag, _request(layout, cfg, tag))
    assert evalckpt.protected_steps(cfg, layout) == [2, 4]
    assert ckptdir.prune(ckpt, 1, evalckpt.protector(cfg, layout)) == []


def test_no_training_in_this_invocation_fails_the_wait_unless_a_trainer_lives(
        layout, ckpt_writer) -> None:
    """An invocation without a training job (e.g. only an evaluation target asked for)
    must not wait forever for a step nobody trains; another invocation's live trainer
    (the directory's lock held by a live process) is waited for."""
    ckpt = layout.checkpoint_dir
    own(ckpt)
    ckpt_writer(ckpt, 2)
    evalckpt.write_train_state(layout, "not_scheduled", "no training job in this invocation")
    seen = evalckpt.look(layout, plan(), 4)
    assert seen.state == "failed", seen
    assert seen.message.startswith("step 4: no training job is part of this invocation")
    me = ckptdir.my_lock_info(attempt=1)
    ckptdir.acquire_lock(ckpt, me)
    try:
        assert evalckpt.look(layout, plan(), 4).state == "wait"
    finally:
        ckptdir.release_lock(ckpt, me)
    evalckpt.write_train_state(layout, "scheduled", "a training job is part of this invocation")
    assert evalckpt.look(layout, plan(), 4).state == "wait"
    assert evalckpt.look(layout, plan(), 2).state == "ready"


def _lock(ckpt: Path, **fields) -> Path:
    """A lock file as hy3rl.ckptdir writes it, with ``fields`` over this process's."""
    info = {**dataclasses.asdict(ckptdir.my_lock_info(attempt=1)), "job_id": None,
            "executor": "local", **fields}
    path = ckpt / ckptdir.LOCK_NAME
    path.write_text(json.dumps(info))
    return path


def test_a_wait_without_training_fails_on_a_trainer_it_cannot_prove(layout, ckpt_writer,
                                                                    tmp_path) -> None:
    """An invocation without a training job: a lock that is empty or names a process on
    another host (and no SLURM job) is waited on for eval.wait_unproven_polls looks, then
    the wait fails naming why; a lock of a dead pid fails at once; a live pid on this host
    is waited for past that bound, until its checkpoint comes."""
    ckpt = layout.checkpoint_dir
    own(ckpt)
    ckpt_writer(ckpt, 2)
    evalckpt.write_train_state(layout, "not_scheduled", "no training job in this invocation")
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan()))
    out = tmp_path / "eval" / "step4" / "checkpoint.json"
    looks = []

    def sleep(s: float) -> None:
        looks.append(s)
        time.sleep(s)

    def wait():
        looks.clear()
        return evalckpt.wait(layout, plan_path, 4, out, 0.01, unproven_polls=3, sleep=sleep)

    lock = ckpt / ckptdir.LOCK_NAME
    lock.write_text("")
    with pytest.raises(evalckpt.WaitFailed, match=rf"step 4: no training job is part of this "
                       rf"invocation and no live trainer can be proven to hold .*the lock file "
                       rf"{re.escape(str(lock))} is empty.*gave up after 3 looks 0.01 s apart"):
        wait()
    assert len(looks) == 3 and not out.exists()

    _lock(ckpt, host="node-elsewhere", pid=4242)
    with pytest.raises(evalckpt.WaitFailed, match=r"names local process 4242 on "
                       r"node-elsewhere: a process on another host .* and no SLURM job"):
        wait()
    assert len(looks) == 3

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock(ckpt, pid=dead.pid)
    with pytest.raises(evalckpt.WaitFailed, match=rf"step 4: no training job is part of this "
                       rf"invocation and none holds .*local process {dead.pid} on "
                       rf"{re.escape(socket.gethostname())}, which is not running"):
        wait()
    assert looks == []  # a dead holder: at once

    _lock(ckpt)  # this process: a live pid on this host

    def trainer(s: float) -> None:
        sleep(s)
        if len(looks) == 10:  # well past the bound of 3
            ckpt_writer(ckpt, 4)

    looks.clear()
    rec = evalckpt.wait(layout, plan_path, 4, out, 0.01, unproven_polls=3, sleep=trainer)
    assert rec["step"] == 4 and len(looks) == 10 and out.exists()


def test_a_wait_whose_workflow_ended_writes_nothing(layout, ckpt_writer, tmp_path,
                                                    monkeypatch) -> None:
    """The controller that started the wait has exited (interrupted, or stopped at once by an
    error): a wait that kept going would write an output Snakemake never records (read as
    incomplete by the next invocation) or wait forever. It ends without writing."""
    ckpt = layout.checkpoint_dir
    own(ckpt)
    ckpt_writer(ckpt, 2)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan()))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    start = evalckpt._stat(child.pid)[1]
    child.wait()
    assert evalckpt.gone({child.pid: start}) == [child.pid]
    assert evalckpt.gone(evalckpt.lineage()) == []
    real = evalckpt.lineage()
    monkeypatch.setattr(evalckpt, "lineage", lambda: {**real, child.pid: start})
    out = tmp_path / "eval" / "step2" / "checkpoint.json"
    with pytest.raises(evalckpt.WaitFailed, match=rf"step 2: the workflow that started this "
                       rf"wait has ended \(process {child.pid} is gone"):
        evalckpt.wait(layout, plan_path, 2, out, 1, unproven_polls=3, sleep=lambda s: None)
    assert not out.exists()
    # the controller's own stop record still names the cause after it has exited
    evalckpt.write_train_state(layout, "stopped", "a crash loop; not resubmitted")
    doc = json.loads(Path(layout.train_state).read_text())
    Path(layout.train_state).write_text(json.dumps({**doc, "controller_pid": child.pid}))
    with pytest.raises(evalckpt.WaitFailed, match="step 4: training stopped before step 4: "
                       "a crash loop"):
        evalckpt.wait(layout, plan_path, 4, out, 1, unproven_polls=3, sleep=lambda s: None)


# --------------------------------------------------------------------------- preflight's rule


def _kept_cfg(tmp_path: Path):
    return make_config(
        run={"results_root": str(tmp_path / "results"), "name": "run"},
        cluster={"gpu": True}, eval={"steps": [2, 4]},
        train={"checkpoint_root": str(tmp_path / "ckpt"), "total_training_steps": 6,
               "keep_eval_checkpoints": "selected", "checkpoint_keep": 1})


def _changed(cfg, steps=None, **train):
    """``cfg`` with eval.steps and train keys changed (the typed sections, as a new run of
    the workflow would build them)."""
    ev = cfg.eval if steps is None else dataclasses.replace(cfg.eval, steps=list(steps))
    return dataclasses.replace(cfg, eval=ev, train=dataclasses.replace(cfg.train, **train))


def _evaluate_step(cfg, layout: Layout, step: int, tmp_path: Path) -> None:
    """Step ``step`` evaluated as the workflow does it: the wait's record (evalckpt.wait on
    the real checkpoint), each generation's samples and complete meta, and its read mark."""
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan()))
    evalckpt.wait(layout, plan_path, step, Path(layout.eval_ready(f"step{step}")), 1,
                  unproven_polls=3, sleep=lambda s: None)
    for tag in evalckpt.step_tags(cfg, step):
        Path(layout.eval_samples(tag)).parent.mkdir(parents=True, exist_ok=True)
        Path(layout.eval_samples(tag)).write_text('{"problem_id": "0"}\n')
        Path(layout.eval_samples_meta(tag)).write_text(json.dumps(
            {"tag": tag, "status": "complete", "step": step}))
        evalckpt.mark_read(layout.checkpoint_dir / f"global_step_{step}", tag,
                           _request(layout, cfg, tag))


def _kept(cfg, identity) -> list[str]:
    from hy3rl.preflight.rules import _eval_steps_kept, _Rules

    r = _Rules()
    _eval_steps_kept(r, cfg, Layout.from_config(cfg).checkpoint_dir, cfg.eval_keep_steps,
                     identity)
    res = r.results.get("eval_steps_kept")
    return [] if res is None else [res.status, *res.messages]


def test_an_evaluated_and_pruned_step_never_blocks_a_rerun(tmp_path, ckpt_writer) -> None:
    """keep_eval_checkpoints selected: step 2 is evaluated, then retention prunes it. The
    unchanged config, an operational change and an extension pass eval_steps_kept; a step
    never evaluated whose checkpoint is gone, one evaluated under another trajectory and
    one whose generation did not finish are refused by name."""
    cfg = _kept_cfg(tmp_path)
    layout = Layout.from_config(cfg)
    ckpt = layout.checkpoint_dir
    own(ckpt)
    for step in (2, 4, 6):
        ckpt_writer(ckpt, step)
    _evaluate_step(cfg, layout, 2, tmp_path)
    assert ckptdir.prune(ckpt, 1, evalckpt.protector(cfg, layout)) == [2]
    assert not (ckpt / "global_step_2").exists()
    ident = plan()["identity"]
    assert evalckpt.evaluated_steps(cfg, layout, TRAJ["id"]) == [2]

    assert _kept(cfg, ident) == []  # unchanged
    operational = _changed(cfg, checkpoint_keep=3, prune_interval_s=7)
    assert _kept(operational, ident) == []
    extended = _changed(cfg, steps=(2, 4, 8), total_training_steps=8)
    assert _kept(extended, {**ident, "total_training_steps": 8}) == []

    # step 2 was evaluated under another trajectory: it needs a new evaluation
    other = {**ident, "trajectory": {**TRAJ, "id": "c" * 64}}
    status, msg = _kept(cfg, other)
    assert status == "error" and msg.startswith("eval.steps [2]: no complete checkpoint")
    # its held-out generation did not finish
    Path(layout.eval_samples_meta(heldout_tag("step2"))).write_text(json.dumps(
        {"tag": heldout_tag("step2"), "status": "running"}))
    assert _kept(cfg, ident)[0] == "error"
    # step 1: never an evaluation step, pruned long ago; added now, it cannot be evaluated
    status, msg = _kept(_changed(cfg, steps=(1, 4)), ident)
    assert status == "error" and "eval.steps [1]: no complete checkpoint" in msg
    assert "no finished evaluation of it under this run identity" in msg


def test_a_generation_keeps_only_its_own_request(layout) -> None:
    """Issue 27: the request a generation ran under stays, the tag's requests of other
    values go (returning to those values must evaluate again), other tags' stay."""
    cfg = _cfg("selected")
    mine = _request(layout, cfg, "step2")
    other = _request(layout, cfg, "step2", "r0", digest="0" * 16)
    heldout = _request(layout, cfg, heldout_tag("step2"), "r0", digest="0" * 16)
    step4 = _request(layout, cfg, "step4", "r0", digest="0" * 16)
    assert evalckpt.keep_only_request(layout, "step2", mine) == [other]
    assert mine.is_file() and not other.exists()
    assert heldout.is_file() and step4.is_file()
    assert evalckpt.keep_only_request(layout, "step2", mine) == []
