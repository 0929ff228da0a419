"""Evaluation beside training: the wait for an evaluation step's checkpoint, the records of
what an evaluation has read, and what retention must keep for evaluation.

- :func:`wait` (rule ``eval_checkpoint``, one local job per evaluation step): looks at the
  checkpoint directory every ``eval.wait_poll_s`` until ``global_step_N`` is complete (verl's
  manifest written last, :func:`hy3rl.ckptdir.check_complete`) under the run identity of the
  plan, then writes ``eval/step<N>/checkpoint.json`` and ends, so that the step's
  generations start while training goes on. It fails, naming the step and the training
  state, when training ended before step N (``train/done.json`` of this trajectory and
  total) or when this workflow's controller stopped resubmitting the training job
  (``train/state.json``, written by ``rules/common.smk``'s ``train_slurm_extra``). In an
  invocation without a training job it waits only for a trainer it can prove alive
  (:func:`lock_holder`): none, or a dead one, fails at once; one it cannot check (an empty
  lock, a process on another host and no SLURM job) fails after
  ``eval.wait_unproven_polls`` looks.
- :func:`mark_read`: written into ``global_step_N/.hy3rl-eval/`` by a generation once it has
  read the weights, with the sha256 of the request it served.
- :func:`protected_steps`: what retention (hy3rl.ckptdir.prune) keeps for evaluation, read
  from the files each time (so a restarted training job sees the same): with
  ``train.keep_eval_checkpoints: all`` every ``eval.steps`` step; with ``selected`` an
  evaluation step until every evaluation of it has read it under the current request, and
  the selection so far (hy3rl.selection.so_far).
- :func:`evaluated_steps`: the evaluation steps done under a run identity, which no longer
  need their checkpoints (preflight's ``eval_steps_kept`` does not ask for them).

Formats: docs/formats/eval.md. Standard library only, but for the selection.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hy3rl.atomic import remove_siblings, write_json_atomic
from hy3rl.ckptdir import (
    DEAD_STATES,
    LOCK_NAME,
    CheckpointDirError,
    check_complete,
    lock_holder_alive,
    read_identity,
    read_lock,
    read_tracker,
    scan,
    slurm_job_state,
)
from hy3rl.errors import StageError
from hy3rl.identity import eval_request_digest
from hy3rl.layout import Layout, heldout_tag
from hy3rl.timefmt import utc_now

log = logging.getLogger("hy3rl.evalckpt")

READ_DIR = ".hy3rl-eval"


class WaitFailed(StageError):
    """Training ended, or was given up, without the step's checkpoint."""


# --------------------------------------------------------------------------- the training state


def write_train_state(layout: Layout, state: str, reason: str) -> None:
    """``train/state.json``, written by the controller (this process): at its start,
    ``scheduled`` or ``not_scheduled`` (whether a training job is part of this invocation);
    ``stopped`` when it stops resubmitting a training job. Waits of this controller's
    evaluation steps fail on ``stopped``, and on ``not_scheduled`` unless a live trainer of
    another invocation holds the checkpoint directory."""
    write_json_atomic(Path(layout.train_state), {
        "state": state, "reason": reason, "at": utc_now(), "host": socket.gethostname(),
        "controller_pid": os.getpid()})


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of ``pid`` from /proc, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19]


def lineage() -> dict[int, str]:
    """This process and its ancestors: pid -> start time (a recycled pid is another
    process)."""
    out: dict[int, str] = {}
    pid = os.getpid()
    while pid and pid not in out and (st := _stat(pid)) is not None:
        out[pid] = st[1]
        pid = st[0]
    return out


def gone(ancestors: dict[int, str]) -> list[int]:
    """The pids of ``ancestors`` (from :func:`lineage`) no longer alive as themselves."""
    return [pid for pid, start in ancestors.items()
            if pid > 1 and ((st := _stat(pid)) is None or st[1] != start)]


def my_controller_state(layout: Layout, ancestors: dict[int, str] | None = None
                        ) -> dict[str, Any] | None:
    """``train/state.json`` when the Snakemake controller that wrote it is one of this
    process's ancestors (the wait runs as its local job; ``ancestors``: as recorded when
    the wait started, so a controller that has exited since still counts); one from an
    earlier invocation is history and None."""
    try:
        doc = json.loads(Path(layout.train_state).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("host") != socket.gethostname():
        return None
    return doc if doc.get("controller_pid") in (ancestors or lineage()) else None


# --------------------------------------------------------------------------- the wait


@dataclass
class Look:
    state: str  # ready | wait | failed
    message: str
    record: dict[str, Any] | None = None
    # A wait of an invocation without a training job on a lock whose holder cannot be
    # proven alive: why (wait() fails after eval.wait_unproven_polls such looks).
    unproven: str | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _training_state(layout: Layout) -> str:
    ckpt = layout.checkpoint_dir
    try:
        tracker = read_tracker(ckpt)
    except CheckpointDirError as exc:
        return str(exc)
    done = [c.step for c in scan(ckpt) if c.complete]
    return (f"verl's tracker at step {tracker if tracker is not None else 'none'}, newest "
            f"complete checkpoint {f'step {done[-1]}' if done else 'none'}")


@dataclass
class Holder:
    """Who holds the checkpoint directory's lock, as far as this host can prove it:
    ``alive`` (a live pid on this host, a SLURM job squeue knows and that has not ended),
    ``none`` (no lock, or its holder has ended) or ``unproven`` (``why`` says what cannot be
    checked)."""

    state: str  # alive | none | unproven
    why: str


def lock_holder(ckpt: Path) -> Holder:
    """:class:`Holder` of ``ckpt``'s training lock (hy3rl.ckptdir)."""
    path = Path(ckpt) / LOCK_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Holder("none", f"no lock file {path}")
    except OSError as exc:
        return Holder("unproven", f"the lock file {path} cannot be read ({exc})")
    if not text.strip():
        return Holder("unproven", f"the lock file {path} is empty (a trainer writing it, or "
                      "one killed while writing it)")
    try:
        holder = read_lock(path)
    except CheckpointDirError as exc:
        return Holder("unproven", str(exc))
    if holder is None:
        return Holder("none", f"no lock file {path}")
    if holder.job_id:
        try:
            state = slurm_job_state(holder.job_id)
        except CheckpointDirError as exc:
            return Holder("unproven", f"{path} names {holder.describe()}, whose state cannot "
                          f"be read here: {exc}")
        if state is None or state in DEAD_STATES:
            return Holder("none", f"{path} names {holder.describe()}, which has ended "
                          f"({state or 'unknown to squeue'})")
        return Holder("alive", f"{path} is held by {holder.describe()} ({state})")
    if holder.host != socket.gethostname():
        return Holder("unproven", f"{path} names {holder.describe()}: a process on another "
                      f"host ({socket.gethostname()} is this one) and no SLURM job, so "
                      "nothing here can check that it is alive")
    if lock_holder_alive(holder):
        return Holder("alive", f"{path} is held by {holder.describe()} (alive)")
    return Holder("none", f"{path} names {holder.describe()}, which is not running")


def look(layout: Layout, plan: dict[str, Any], step: int,
         ancestors: dict[int, str] | None = None) -> Look:
    """One look at step ``step``'s checkpoint and the training state (module doc);
    ``ancestors``: the waiting process's, recorded when it started (:func:`lineage`)."""
    traj = str(plan["identity"]["trajectory"]["id"])
    total = int(plan["identity"].get("total_training_steps") or 0) or None
    ckpt = layout.checkpoint_dir
    try:
        ident = read_identity(ckpt)
    except CheckpointDirError as exc:
        return Look("failed", f"step {step}: {exc}")
    ours = ident is not None and str(ident["trajectory"].get("id")) == traj
    step_dir = ckpt / f"global_step_{step}"
    ok, why = check_complete(step_dir, step)
    if ours and ok:
        last = step_dir / "data.pt"  # written after the actor save, in both layouts
        return Look("ready", f"step {step}: checkpoint complete", {
            "step": step, "checkpoint": str(step_dir),
            "hf_model": str(layout.checkpoint_hf_model(step)),
            "trajectory_id": traj, "lineage": ident.get("lineage"),
            "complete_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00",
                                         time.gmtime(last.stat().st_mtime)),
            "seen_at": utc_now()})
    done = _read_json(Path(layout.train_done))
    if isinstance(done, dict) and str(done.get("trajectory_id")) == traj and (
            total is None or done.get("total_training_steps") == total):
        final = int(done.get("final_step") or 0)
        if final < step:
            return Look("failed", f"step {step}: training ended at step {final} before "
                        f"step {step} ({layout.train_done}); raise train.total_training_steps "
                        "or drop the step from eval.steps")
        return Look("failed", f"step {step}: training finished (step {final}) but "
                    f"{step_dir} is not a complete checkpoint of this run ("
                    f"{why or 'made by another configuration'}): it was not saved, or "
                    "retention removed it before it was an evaluation step")
    state = my_controller_state(layout, ancestors)
    if state is not None and state.get("state") == "stopped":
        return Look("failed", f"step {step}: training stopped before step {step}: "
                    f"{state.get('reason')} ({_training_state(layout)}); a later invocation "
                    "that resumes training waits again")
    unproven = None
    if state is not None and state.get("state") == "not_scheduled":
        holder = lock_holder(ckpt)
        if holder.state == "none":
            return Look("failed", f"step {step}: no training job is part of this invocation "
                        f"and none holds {ckpt} ({holder.why}; {_training_state(layout)}): run "
                        f"the workflow with its training (the default target) to reach step "
                        f"{step}")
        if holder.state == "unproven":
            unproven = holder.why
    if not ours:
        where = ("no run identity yet" if ident is None
                 else f"made by trajectory {str(ident['trajectory'].get('id'))[:12]}")
        return Look("wait", f"step {step}: waiting for training to start on {ckpt} ({where})",
                    unproven=unproven)
    return Look("wait", f"step {step}: waiting ({_training_state(layout)}; step {step}: {why})",
                unproven=unproven)


def wait(layout: Layout, plan_path: Path, step: int, out: Path, poll_s: float, *,
         unproven_polls: int, sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Rule eval_checkpoint: wait for step ``step`` (module doc), then write ``out``
    (eval/step<N>/checkpoint.json). Raises :class:`WaitFailed` naming the step and the
    training state; also after ``unproven_polls`` (eval.wait_unproven_polls) looks in a row
    whose only trainer is one it cannot prove alive (:attr:`Look.unproven`)."""
    plan = _read_json(Path(plan_path))
    if not isinstance(plan, dict) or not (plan.get("identity") or {}).get("trajectory"):
        raise StageError(f"{plan_path}: no run identity (identity.trajectory)")
    t0, last, unproven = clock(), None, 0
    ancestors = lineage()
    while True:
        seen = look(layout, plan, step, ancestors)
        unproven = unproven + 1 if seen.unproven else 0
        if unproven > unproven_polls:
            raise WaitFailed(
                f"step {step}: no training job is part of this invocation and no live trainer "
                f"can be proven to hold {layout.checkpoint_dir}: {seen.unproven}; gave up after "
                f"{unproven_polls} looks {poll_s:g} s apart (eval.wait_unproven_polls x "
                "eval.wait_poll_s). Run the workflow with its training (the default target), "
                "or remove the lock file if no trainer runs")
        dead = gone(ancestors)
        if dead and seen.state != "failed":
            # The workflow that started this wait has ended (interrupted, or stopped at
            # once by an error): it would never record this output, which would then read
            # as incomplete. End without writing it; the next invocation waits again.
            raise WaitFailed(f"step {step}: the workflow that started this wait has ended "
                             f"(process {dead[-1]} is gone; last look: {seen.message}): "
                             "nothing written, a later invocation waits again")
        if seen.state == "ready":
            rec = {**(seen.record or {}), "waited_s": round(clock() - t0, 1)}
            write_json_atomic(Path(out), rec, indent=1)
            log.info("%s after %.0f s -> %s", seen.message, clock() - t0, out)
            return rec
        if seen.state == "failed":
            raise WaitFailed(seen.message)
        if seen.message != last:
            log.info("%s", seen.message)
            last = seen.message
        sleep(poll_s)


# --------------------------------------------------------------------------- read records


def file_sha256(path: Path) -> str | None:
    """hy3rl.runtime_id.sha256_file, None for a file that cannot be read."""
    from hy3rl.runtime_id import sha256_file

    try:
        return sha256_file(Path(path))
    except OSError:
        return None


def _read_name(tag: str) -> str:
    return tag.replace("/", "-") + ".json"


def mark_read(step_dir: Path, tag: str, request: Path) -> None:
    """Record in ``step_dir``/.hy3rl-eval/ that evaluation ``tag`` has read the weights
    under ``request`` (its sha256): retention may then let the checkpoint go."""
    write_json_atomic(Path(step_dir) / READ_DIR / _read_name(tag), {
        "tag": tag, "request_sha256": file_sha256(request), "read_at": utc_now()})


def keep_only_request(layout: Layout, tag: str, request: Path) -> list[Path]:
    """Tag ``tag`` was evaluated under ``request`` (``Layout.eval_request``): remove the tag's
    requests of other values, which no longer describe its samples, so that returning to
    those values evaluates again. Returns what was removed."""
    return remove_siblings(Path(request), Path(layout.eval_request(tag, "*")).name)


def has_read(step_dir: Path, tag: str, request: Path) -> bool:
    """Whether evaluation ``tag`` read ``step_dir`` under the current ``request``."""
    doc = _read_json(Path(step_dir) / READ_DIR / _read_name(tag))
    want = file_sha256(request)
    return isinstance(doc, dict) and want is not None and doc.get("request_sha256") == want


# --------------------------------------------------------------------------- retention


def step_tags(cfg: Any, step: int) -> list[str]:
    """The evaluations of step ``step``: ``step<N>`` (the test set) and, with data.heldout,
    ``heldout/step<N>``."""
    tag = f"step{step}"
    return [tag] + ([heldout_tag(tag)] if cfg.data.heldout else [])


def evaluated_steps(cfg: Any, layout: Layout, trajectory_id: str) -> list[int]:
    """The ``eval.steps`` steps whose evaluations are done under run identity
    ``trajectory_id``: the wait's record (``eval/step<N>/checkpoint.json``) names that
    trajectory and every generation of the step (:func:`step_tags`) is complete (its
    ``samples.meta.json`` has status ``complete`` and its ``samples.jsonl`` exists). Such a
    step no longer needs its checkpoint: retention (``keep_eval_checkpoints: selected``)
    lets it go by design, and preflight's ``eval_steps_kept`` does not ask for it."""
    done = []
    for step in sorted(cfg.eval.steps):
        ready = _read_json(Path(layout.eval_ready(f"step{step}")))
        if not isinstance(ready, dict) or str(ready.get("trajectory_id")) != str(trajectory_id):
            continue
        metas = [_read_json(Path(layout.eval_samples_meta(t))) for t in step_tags(cfg, step)]
        if all(isinstance(m, dict) and m.get("status") == "complete" for m in metas) and all(
                Path(layout.eval_samples(t)).is_file() for t in step_tags(cfg, step)):
            done.append(step)
    return done


def protected_steps(cfg: Any, layout: Layout) -> list[int]:
    """The steps retention keeps for evaluation now (module doc)."""
    steps = sorted(cfg.eval.steps) if cfg.trains else []
    if cfg.train.keep_eval_checkpoints == "all":
        return steps
    keep = set()
    for step in steps:
        step_dir = layout.checkpoint_dir / f"global_step_{step}"
        if not all(has_read(step_dir, t, Path(layout.eval_request(
                t, eval_request_digest(cfg.raw, t)))) for t in step_tags(cfg, step)):
            keep.add(step)
    if cfg.eval.select is not None:
        from hy3rl import selection

        plan = _read_json(Path(layout.train_plan))
        rule = (plan or {}).get("selection") if isinstance(plan, dict) else None
        sofar = selection.so_far(layout, cfg, rule) if rule else None
        if sofar and isinstance(sofar.get("step"), int):
            keep.add(sofar["step"])
    return sorted(keep)


def protector(cfg: Any, layout: Layout) -> Callable[[], Iterable[int]]:
    """:func:`protected_steps` as retention's callable (evaluated at every pass)."""
    return lambda: protected_steps(cfg, layout)
