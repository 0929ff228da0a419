"""Stage `train`: one GRPO training attempt that resumes from verl's own checkpoints.

:func:`run` (rule ``train``, ``train_segment``; ``hy3rl train``) does, in order:

1. take the lock in the checkpoint directory (refuse while another live job holds it; take
   over a stale one with a log line);
2. finalise the records of earlier attempts that died without writing one;
3. prepare resume: find the newest *complete* checkpoint (``ckpt_contents.json`` written
   last by verl's rank 0 plus a whole ``data.pt``), point verl's tracker
   ``latest_checkpointed_iteration.txt`` at it and move newer incomplete saves aside
   (never deleting them);
4. name the runtime (``hy3rl.runtime_id``: image digest, SIF sha256, or interpreter and
   ``pip freeze``) in the attempt record, then run the launcher (``hy3rl.launch``): Ray over
   the job's nodes, one Ray version on the job client and the cluster (recorded; a mismatch
   refuses), ``ray job submit`` of the rendered ``launch.sh`` with this attempt's
   ``VERL_FILE_LOGGER_PATH``; meanwhile prune old complete checkpoints (retention);
5. record the attempt, merge every attempt's metrics log (``hy3rl.verl_log``), and, when
   training reached its last step, write the sentinel ``done.json`` last.

Every path comes from :class:`hy3rl.layout.Layout`: the checkpoint directory
(``Layout.checkpoint_dir``, never a Snakemake output: Snakemake deletes outputs before a
job and after a failure) and the attempt files. Formats: docs/formats/train.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hy3rl.atomic import write_json_atomic, write_jsonl_atomic, write_text_atomic
from hy3rl.errors import StageError
from hy3rl.layout import ATTEMPT_RE, Layout
from hy3rl.timefmt import parse, utc_now
from hy3rl.verl_log import merged_attempts, read_metrics

if TYPE_CHECKING:
    from hy3rl.settings import Cluster, Train

log = logging.getLogger("hy3rl.train")

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "ckpt_contents.json"
LOCK_NAME = ".hy3rl-train.lock"
STEP_DIR = re.compile(r"^global_step_(\d+)$")

# squeue states of a job that is gone (anything else, including COMPLETING, counts as alive).
DEAD_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "REVOKED", "SPECIAL_EXIT",
}


class TrainError(StageError):
    """A condition that stops the attempt; the message says what and where."""


class LockHeld(TrainError):
    """Another live trainer holds the checkpoint directory."""


class TrainFailed(TrainError):
    """The attempt ran and ended without reaching its last step (recorded in its record)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- checkpoints


@dataclass
class Checkpoint:
    step: int
    path: Path
    complete: bool
    reason: str = ""  # why it is not complete


def read_tracker(ckpt_dir: Path) -> int | None:
    """The step in verl's tracker file, None when there is none. A tracker that is not an
    integer is an error naming the file (verl itself would crash on it)."""
    path = ckpt_dir / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise TrainError(f"{path}: not an integer step ({text[:40]!r})") from None


def write_tracker(ckpt_dir: Path, step: int) -> None:
    write_text_atomic(ckpt_dir / TRACKER, str(step))


def check_complete(step_dir: Path, step: int) -> tuple[bool, str]:
    """Whether ``global_step_<step>`` holds a finished verl save, and why not.

    verl (220e903) saves the actor (rank 0 writes ``actor/ckpt_contents.json`` last, via a
    temp file and a rename), then ``data.pt`` (``torch.save``: a zip archive), then the
    tracker. A save interrupted anywhere leaves one of these missing or partial."""
    manifest = step_dir / "actor" / MANIFEST
    if not manifest.is_file():
        return False, f"no actor/{MANIFEST} (actor save did not finish)"
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        return False, f"actor/{MANIFEST} unreadable: {exc}"
    if not isinstance(data, dict) or data.get("global_step") != step:
        return False, f"actor/{MANIFEST} global_step {data.get('global_step')!r} != {step}" \
            if isinstance(data, dict) else f"actor/{MANIFEST} is not an object"
    dataloader = step_dir / "data.pt"
    if not dataloader.is_file():
        return False, "no data.pt (dataloader state not saved)"
    if not zipfile.is_zipfile(dataloader):
        return False, "data.pt is not a whole torch archive (save interrupted)"
    return True, ""


def scan(ckpt_dir: Path) -> list[Checkpoint]:
    """Every ``global_step_N`` directory, ascending by N, with its completeness."""
    out = []
    if not ckpt_dir.is_dir():
        return out
    for entry in ckpt_dir.iterdir():
        m = STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            step = int(m.group(1))
            ok, why = check_complete(entry, step)
            out.append(Checkpoint(step, entry, ok, why))
    return sorted(out, key=lambda c: c.step)


def newest_complete(ckpts: Iterable[Checkpoint]) -> Checkpoint | None:
    done = [c for c in ckpts if c.complete]
    return done[-1] if done else None


def prepare_resume(ckpt_dir: Path, attempt: int) -> tuple[int, list[str]]:
    """Make verl's ``resume_mode=auto`` continue from the newest complete checkpoint.

    Returns (start step, actions taken). Newer incomplete ``global_step_N`` directories are
    renamed to ``global_step_N.incomplete-<attempt>`` (verl would otherwise save into a
    half-written directory); the tracker is (re)written when it names another step."""
    actions: list[str] = []
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpts = scan(ckpt_dir)
    best = newest_complete(ckpts)
    start = best.step if best else 0
    for c in ckpts:
        if c.step > start and not c.complete:
            aside = c.path.with_name(f"{c.path.name}.incomplete-{attempt}")
            n = 1
            while aside.exists():
                n += 1
                aside = c.path.with_name(f"{c.path.name}.incomplete-{attempt}.{n}")
            os.rename(c.path, aside)
            actions.append(f"moved incomplete checkpoint {c.path.name} aside to {aside.name} "
                           f"({c.reason})")
    tracker = read_tracker(ckpt_dir)
    if best is None:
        if tracker is not None:
            # verl would try global_step_<tracker>, which is missing or incomplete.
            aside = ckpt_dir / f"{TRACKER}.invalid-{attempt}"
            os.rename(ckpt_dir / TRACKER, aside)
            actions.append(f"tracker named step {tracker} but no complete checkpoint exists: "
                           f"moved it to {aside.name}; training starts from scratch")
    elif tracker != best.step:
        write_tracker(ckpt_dir, best.step)
        actions.append(f"tracker named step {tracker}; newest complete checkpoint is "
                       f"{best.step}: tracker rewritten to {best.step}")
    for a in actions:
        log.info("resume: %s", a)
    log.info("resume: starting from step %d (%s)", start,
             best.path if best else "no complete checkpoint: from scratch")
    return start, actions


# --------------------------------------------------------------------------- retention


def retention_victims(ckpts: list[Checkpoint], keep: int, protected: Iterable[int]) -> list[int]:
    """Steps of complete checkpoints to remove: all but the newest ``keep`` complete ones and
    the ``protected`` steps. ``keep`` < 1 keeps everything. Incomplete checkpoints are never
    victims, and nothing is removed unless a newer complete checkpoint exists."""
    if keep < 1:
        return []
    complete = [c.step for c in ckpts if c.complete]
    keep_set = set(complete[-keep:]) | set(protected)
    return [s for s in complete[:-keep] if s not in keep_set]


def prune(ckpt_dir: Path, keep: int, protected: Iterable[int]) -> list[int]:
    """Remove old complete checkpoints (retention); returns the removed steps. A victim is
    first renamed out of ``global_step_*`` so a reader never sees it half-deleted."""
    protected = list(protected)
    ckpts = scan(ckpt_dir)
    tracker = read_tracker(ckpt_dir)
    removed = []
    for step in retention_victims(ckpts, keep, protected):
        if tracker is not None and step >= tracker:
            continue  # never prune what verl would resume from (or anything newer)
        src = ckpt_dir / f"global_step_{step}"
        trash = ckpt_dir / f".pruning-global_step_{step}"
        os.rename(src, trash)
        shutil.rmtree(trash)
        removed.append(step)
        log.info("retention: removed checkpoint step %d (keeping the newest %d complete and "
                 "eval steps %s)", step, keep, sorted(protected))
    return removed


class Pruner(threading.Thread):
    """Runs retention every ``interval`` seconds while the trainer runs."""

    def __init__(self, ckpt_dir: Path, keep: int, protected: list[int], interval: float):
        super().__init__(daemon=True, name="retention")
        self.args = (ckpt_dir, keep, protected)
        self.interval = interval
        self.stop = threading.Event()
        self.removed: list[int] = []

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.removed += prune(*self.args)
            except Exception as exc:  # a failed prune must not kill the attempt
                log.warning("retention: %s", exc)


# --------------------------------------------------------------------------- lock


@dataclass
class LockInfo:
    job_id: str | None
    executor: str  # "slurm" | "local"
    host: str
    pid: int
    pid_create_time: float | None
    attempt: int | None
    acquired_at: str

    def describe(self) -> str:
        if self.job_id:
            return f"SLURM job {self.job_id} (host {self.host}, pid {self.pid})"
        return f"local process {self.pid} on {self.host}"


def _pid_create_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def slurm_job_state(job_id: str) -> str | None:
    """The job's state from squeue, None when SLURM no longer knows it."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"],
                              capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise TrainError(f"lock names SLURM job {job_id} but squeue is not available here "
                         "to check it") from None
    out = proc.stdout.strip()
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise TrainError(f"squeue -j {job_id} failed ({proc.returncode}): "
                         f"{proc.stderr.strip()}")
    return out.splitlines()[0].strip() if out else None


def lock_holder_alive(info: LockInfo) -> bool:
    if info.job_id:
        state = slurm_job_state(info.job_id)
        return state is not None and state not in DEAD_STATES
    if info.host != socket.gethostname():
        raise LockHeld(f"lock held by {info.describe()}: cannot check a process on another "
                       "host; if that run is dead, remove the lock file")
    created = _pid_create_time(info.pid)
    if created is None:
        return False
    return info.pid_create_time is None or abs(created - info.pid_create_time) < 1.0


def read_lock(path: Path) -> LockInfo | None:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise TrainError(f"{path}: unreadable lock file ({exc}); check no trainer runs on this "
                         "checkpoint directory, then remove it") from None
    fields = {f.name for f in dataclasses.fields(LockInfo)}
    return LockInfo(**{k: raw.get(k) for k in fields})


def my_lock_info(attempt: int | None) -> LockInfo:
    job = os.environ.get("SLURM_JOB_ID") or None
    return LockInfo(job_id=job, executor="slurm" if job else "local",
                    host=socket.gethostname(), pid=os.getpid(),
                    pid_create_time=_pid_create_time(os.getpid()), attempt=attempt,
                    acquired_at=utc_now())


def held_message(ckpt_dir: Path, holder: LockInfo) -> str:
    hint = (f"; wait for it to end or cancel it (scancel {holder.job_id})"
            if holder.job_id else "")
    return (f"checkpoint directory {ckpt_dir} is in use by {holder.describe()}, attempt "
            f"{holder.attempt}, since {holder.acquired_at}: a second trainer must not run "
            f"on it{hint}")


def check_lock_free(ckpt_dir: Path) -> None:
    """Raise LockHeld when a live trainer other than this SLURM job holds the checkpoint
    directory (called by the workflow's ``onstart:`` in rules/common.smk, before anything is
    submitted, so that a relaunched controller refuses instead of starting a second job)."""
    holder = read_lock(ckpt_dir / LOCK_NAME)
    if holder is None:
        return
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.job_id == job:
        return
    if lock_holder_alive(holder):
        raise LockHeld(held_message(ckpt_dir, holder))


def acquire_lock(ckpt_dir: Path, me: LockInfo,
                 alive: Callable[[LockInfo], bool] = lock_holder_alive) -> list[str]:
    """Create the lock (O_EXCL). An existing lock of a live job raises LockHeld naming it;
    a stale one (dead job or process) is renamed aside and taken over."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / LOCK_NAME
    actions = []
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = read_lock(path)
            if holder is None:
                continue
            same = (me.job_id and holder.job_id == me.job_id) or (
                not me.job_id and not holder.job_id and holder.host == me.host
                and holder.pid == me.pid)
            if not same and alive(holder):
                raise LockHeld(held_message(ckpt_dir, holder)) from None
            stale = path.with_name(f"{LOCK_NAME}.stale-{int(time.time() * 1000)}")
            try:
                os.rename(path, stale)
            except FileNotFoundError:
                continue  # someone else took it over first; try again
            os.unlink(stale)
            msg = f"took over the stale lock of {holder.describe()} (no longer running)"
            log.info("lock: %s", msg)
            actions.append(msg)
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(dataclasses.asdict(me), fh)
        log.info("lock: %s holds %s", me.describe(), path)
        return actions
    raise TrainError(f"{path}: could not take the lock (contended)")


def release_lock(ckpt_dir: Path, me: LockInfo) -> None:
    path = ckpt_dir / LOCK_NAME
    with contextlib.suppress(TrainError):
        holder = read_lock(path)
        if holder and holder.pid == me.pid and holder.host == me.host \
                and holder.job_id == me.job_id:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- metrics


def write_merged(attempts_dir: Path, out: Path) -> int:
    """``out`` (train/metrics.jsonl): the merge of every attempt's log under
    ``attempts_dir`` (``hy3rl.verl_log.merged_attempts``); returns its number of lines."""
    merged = merged_attempts(Path(attempts_dir))
    write_jsonl_atomic(Path(out), merged)
    return len(merged)


# --------------------------------------------------------------------------- attempts


@dataclass
class AttemptRecord:
    """``train/attempts/attempt-<k>.json`` (docs/formats/train.md)."""

    attempt: int
    run: str
    executor: str
    slurm_job_id: str | None
    host: str
    nodes: list[str]
    num_nodes: int
    gpus_per_node: int
    cpus_per_node: int
    submission_id: str
    checkpoint_dir: str
    start_step: int
    end_step: int | None = None
    last_logged_step: int | None = None
    steps_lost: int | None = None
    exit_reason: str = "running"
    exit_code: int | None = None
    resume_actions: list[str] = field(default_factory=list)
    started_at: str = field(default_factory=utc_now)
    ended_at: str | None = None
    wall_s: float | None = None
    metrics_log: str = ""
    log_dir: str = ""
    # train.runtime with defaults filled, its identity (hy3rl.runtime_id) and both sides' Ray
    runtime: dict[str, Any] = field(default_factory=dict)


def attempt_numbers(layout: Layout) -> list[int]:
    """The attempts recorded so far (``attempt-<k>.json``), ascending."""
    folder = Path(layout.train_attempts)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := ATTEMPT_RE.match(p.name)))


def load_attempt(layout: Layout, k: int) -> dict[str, Any]:
    path = Path(layout.attempt_record(k))
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise TrainError(f"{path}: not valid JSON ({exc})") from None


def last_step(lines: list[dict[str, Any]]) -> int | None:
    return max((r["step"] for r in lines), default=None)


def close_record(rec: dict[str, Any], layout: Layout, end_step: int | None,
                 reason: str, code: int | None) -> dict[str, Any]:
    """Fill the end of an attempt record from the checkpoint state and its metrics log."""
    lines = read_metrics(Path(layout.attempt_metrics(rec["attempt"]))) \
        if rec.get("metrics_log") else []
    last = last_step(lines)
    rec["end_step"] = end_step
    rec["last_logged_step"] = last
    rec["steps_lost"] = max(0, last - (end_step or 0)) if last is not None else 0
    rec["exit_reason"] = reason
    rec["exit_code"] = code
    rec["ended_at"] = utc_now()
    start, end = parse(rec.get("started_at")), parse(rec["ended_at"])
    if start is not None and end is not None:
        rec["wall_s"] = round((end - start).total_seconds(), 1)
    return rec


def finalise_stale(layout: Layout, end_step: int | None) -> list[int]:
    """Records still ``running`` belong to attempts killed without a chance to write (the
    lock is ours now, so none of them is alive): close them with the current state."""
    fixed = []
    for k in attempt_numbers(layout):
        rec = load_attempt(layout, k)
        if rec.get("exit_reason") == "running":
            close_record(rec, layout, end_step,
                         "killed (no record written: job or controller killed)", None)
            rec["ended_at"] = None
            rec["wall_s"] = None
            write_json_atomic(Path(layout.attempt_record(k)), rec)
            fixed.append(k)
            log.info("attempt %d: was still marked running; closed (end step %s)", k, end_step)
    return fixed


# --------------------------------------------------------------------------- plan


def read_plan(path: Path) -> dict[str, Any]:
    """preflight/plan.json, refused unless preflight planned a launch."""
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainError(f"{path}: cannot read the preflight plan: {exc}") from None
    if plan.get("ok") is False:
        raise TrainError(f"{path}: preflight reported errors: {plan.get('errors')}")
    if plan.get("launched") is False:
        raise TrainError(f"{path}: preflight did not plan a launch: "
                         f"{plan.get('not_launched_reason')}")
    return plan


def plan_value(plan: Mapping[str, Any], key: str) -> Any:
    """A resolved override value from preflight's plan.json (docs/formats/preflight.md)."""
    res = plan.get("resolved", {}).get(key)
    if isinstance(res, dict) and "value" in res:
        return res["value"]
    return plan.get("effective", {}).get(key)


def total_steps_from_plan(plan: Mapping[str, Any], path: Path) -> int:
    value = plan_value(plan, "trainer.total_training_steps")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TrainError(f"{path}: no integer trainer.total_training_steps in 'resolved' "
                         f"(got {value!r}); rerun preflight") from None


def logger_env_names(plan: Mapping[str, Any]) -> list[str]:
    env = plan.get("loggers", {}).get("env", {}) or {}
    names: list[str] = []
    for v in env.values():
        names += list(v) if isinstance(v, list) else list(v or {})
    return names


# --------------------------------------------------------------------------- the stage


def run(train: Train, cluster: Cluster, layout: Layout, *, keep_steps: Sequence[int],
        plan: Path, launch_script: Path, runtime_env: Path, sentinel: Path, metrics: Path,
        until: int | None = None) -> None:
    """One training attempt (see the module doc) of run ``layout.run`` on the checkpoint
    directory ``layout.checkpoint_dir``, its records under ``layout.train_attempts``.

    Inputs: ``plan`` (preflight/plan.json), ``launch_script`` (preflight/launch.sh),
    ``runtime_env`` (deps/runtime_env.yaml). Outputs: ``metrics`` (train/metrics.jsonl, the
    merge of every attempt's log, rewritten after every attempt) and, written last once the
    newest complete checkpoint is the attempt's last step, ``sentinel`` (done.json, or a
    segment's ``segments/step<N>.json``). ``until``: a segment's last step (the launch gets
    ``trainer.total_training_steps=<until>`` appended); None runs to the plan's total.
    ``keep_steps``: the steps retention never prunes (``Config.eval_keep_steps``).

    Raises :class:`LockHeld` while another live trainer holds the checkpoint directory,
    :class:`TrainFailed` when the attempt ended early (its record says why), and
    :class:`TrainError` for a bad input."""
    from hy3rl import launch, runtime_id

    # Absolute paths: the Ray job runs in the verl clone, the node steps wherever srun puts
    # them.
    layout = dataclasses.replace(layout, results_root=os.path.abspath(layout.results_root))
    attempts_dir = Path(layout.train_attempts)
    attempts_dir.mkdir(parents=True, exist_ok=True)
    metrics = Path(os.path.abspath(metrics))
    plan_path = Path(plan).resolve()
    plan_doc = read_plan(plan_path)
    total = total_steps_from_plan(plan_doc, plan_path)
    ckpt = layout.checkpoint_dir
    planned = (plan_doc.get("checkpoint") or {}).get("dir")
    if planned and os.path.abspath(planned) != str(ckpt):
        raise TrainError(f"{plan_path}: checkpoint.dir {planned} differs from the run's "
                         f"checkpoint directory {ckpt} (train.checkpoint_root/run.name); "
                         "rerun preflight")
    target = total if until is None else min(int(until), total)
    keep = train.checkpoint_keep
    protected = [int(s) for s in keep_steps]

    k = (attempt_numbers(layout) or [0])[-1] + 1
    me = my_lock_info(k)
    lock_actions = acquire_lock(ckpt, me)
    rec: dict[str, Any] = {}
    record = Path(layout.attempt_record(k))
    try:
        best = newest_complete(scan(ckpt))
        finalise_stale(layout, best.step if best else None)
        start, resume_actions = prepare_resume(ckpt, k)
        if start >= target:
            log.info("training already reached step %d (this job's last step %d, total %d): "
                     "nothing to launch", start, target, total)
            write_merged(attempts_dir, metrics)
            write_done(layout, start, total, sentinel, metrics)
            return
        runtime: dict[str, Any] = dict(launch.resolve_runtime(train.runtime))
        runtime["identity"] = runtime_id.identify(runtime["prefix"], runtime["python"],
                                                  cache=Path(layout.runtime_id_cache))
        runtime["ray"] = None  # filled once the Ray head runs (launch.Launcher.check_ray)
        log.info("attempt %d: runtime %s", k, runtime["identity"]["id"])
        sub_id = f"{layout.run}-{me.job_id or 'local'}-{k}"
        attempt_metrics = Path(layout.attempt_metrics(k))
        log_dir = Path(layout.attempt_logs(k))
        attempt = AttemptRecord(
            attempt=k, run=layout.run, executor=me.executor, slurm_job_id=me.job_id,
            host=me.host, nodes=[], num_nodes=cluster.nodes,
            gpus_per_node=cluster.gpus_per_node, cpus_per_node=cluster.cpus_per_node,
            submission_id=sub_id, checkpoint_dir=str(ckpt), start_step=start,
            resume_actions=lock_actions + resume_actions, metrics_log=attempt_metrics.name,
            log_dir=log_dir.name, runtime=runtime)
        rec = dataclasses.asdict(attempt)
        write_json_atomic(record, rec)
        log.info("attempt %d: submission %s, checkpoint dir %s, start step %d, until step "
                 "%d of %d", k, sub_id, ckpt, start, target, total)

        spec = launch.LaunchSpec(
            submission_id=sub_id, launch_script=Path(launch_script).resolve(),
            runtime_env=Path(runtime_env).resolve(), log_dir=log_dir,
            launch_args=[] if target == total else [f"trainer.total_training_steps={target}"],
            env_vars={"VERL_FILE_LOGGER_PATH": str(attempt_metrics)},
            passthrough_env=sorted(set(logger_env_names(plan_doc))
                                   | set(train.ray_env_passthrough)),
            nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
            cpus_per_node=cluster.cpus_per_node, ray=train.ray, runtime=train.runtime,
        )
        pruner = Pruner(ckpt, keep, protected, train.prune_interval_s)
        pruner.start()
        try:
            result = launch.launch(
                spec, on_nodes=lambda nodes: _record_nodes(record, rec, nodes),
                on_stop=lambda reason: _record_stop(layout, record, rec, ckpt, reason),
                on_ray=lambda versions: _record_ray(record, rec, versions))
        finally:
            pruner.stop.set()
            pruner.join(timeout=30)
        if result.ray_versions:
            rec["runtime"]["ray"] = result.ray_versions
        removed = prune(ckpt, keep, protected)
        best = newest_complete(scan(ckpt))
        end = best.step if best else None
        close_record(rec, layout, end, result.reason, result.exit_code)
        write_json_atomic(record, rec)
        n = write_merged(attempts_dir, metrics)
        log.info("attempt %d: %s (exit %s); newest complete checkpoint %s; %s steps lost; "
                 "%d merged metric lines; pruned %s", k, result.reason, result.exit_code,
                 end, rec["steps_lost"], n, sorted(pruner.removed + removed))
        if result.exit_code != 0:
            raise TrainFailed(f"attempt {k}: {result.reason} (exit {result.exit_code}); "
                              f"newest complete checkpoint {end}; logs in {log_dir}",
                              result.exit_code or 1)
        if end is None or end < target:
            raise TrainError(f"the trainer exited 0 but the newest complete checkpoint is "
                             f"{end}, not step {target}")
        write_done(layout, end, total, sentinel, metrics)
    except BaseException as exc:
        if rec and rec.get("exit_reason") == "running":
            reason = (f"launcher error: {exc}" if not isinstance(exc, KeyboardInterrupt)
                      else "signal SIGINT")
            best = newest_complete(scan(ckpt))
            close_record(rec, layout, best.step if best else None, reason, 1)
            write_json_atomic(record, rec)
            with contextlib.suppress(Exception):
                write_merged(attempts_dir, metrics)
        raise
    finally:
        release_lock(ckpt, me)


def _record_stop(layout: Layout, record: Path, rec: dict[str, Any], ckpt: Path,
                 reason: str) -> None:
    """At a signal, record the attempt at once (SLURM kills KillWait seconds later)."""
    best = newest_complete(scan(ckpt))
    snapshot = close_record(dict(rec), layout, best.step if best else None, reason, None)
    write_json_atomic(record, snapshot)


def _record_ray(record: Path, rec: dict[str, Any], versions: dict[str, Any]) -> None:
    rec["runtime"]["ray"] = dict(versions)
    write_json_atomic(record, rec)


def _record_nodes(record: Path, rec: dict[str, Any], nodes: list[str]) -> None:
    rec["nodes"] = list(nodes)
    rec["num_nodes"] = len(nodes)
    write_json_atomic(record, rec)


def write_done(layout: Layout, final: int, total: int, path: Path, metrics: Path) -> Path:
    """The sentinel ``path``, written last: done.json, or a segment's
    ``segments/step<N>.json`` (same keys)."""
    attempts = [load_attempt(layout, k) for k in attempt_numbers(layout)]
    ckpt = layout.checkpoint_dir
    done = {
        "run": layout.run,
        "final_step": final,
        "total_training_steps": total,
        "checkpoint_dir": str(ckpt),
        "checkpoint": str(ckpt / f"global_step_{final}"),
        "hf_model": str(layout.checkpoint_hf_model(final)),
        "kept_checkpoints": [c.step for c in scan(ckpt) if c.complete],
        "incomplete_moved_aside": sorted(p.name for p in ckpt.glob("global_step_*.incomplete-*")),
        "attempts": [{key: a.get(key) for key in
                      ("attempt", "slurm_job_id", "nodes", "start_step", "end_step",
                       "steps_lost", "exit_reason", "started_at", "ended_at", "wall_s")}
                     for a in attempts],
        "steps_lost_total": sum(a.get("steps_lost") or 0 for a in attempts),
        "metrics": str(Path(os.path.abspath(metrics))),
        "written_at": utc_now(),
    }
    path = Path(path)
    write_json_atomic(path, done)
    log.info("done: final step %d, %s", final, path)
    return path
