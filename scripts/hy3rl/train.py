"""Stage `train`: one GRPO training attempt that resumes from verl's own checkpoints.

``python -m hy3rl.train`` (rule ``train``) does, in order:

1. take the lock in the checkpoint directory (refuse while another live job holds it; take
   over a stale one with a log line);
2. finalise the records of earlier attempts that died without writing one;
3. prepare resume: find the newest *complete* checkpoint (``ckpt_contents.json`` written
   last by verl's rank 0 plus a whole ``data.pt``), point verl's tracker
   ``latest_checkpointed_iteration.txt`` at it and move newer incomplete saves aside
   (never deleting them);
4. run the launcher (``hy3rl.launch``): Ray over the job's nodes, ``ray job submit`` of the
   rendered ``launch.sh`` with this attempt's ``VERL_FILE_LOGGER_PATH``; meanwhile prune old
   complete checkpoints (retention);
5. record the attempt, merge every attempt's metrics log, and, when training reached its
   last step, write the sentinel ``done.json`` last.

The checkpoint directory is never a Snakemake output: Snakemake deletes outputs before a
job and after a failure. Formats: docs/formats/train.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_json_atomic, write_text_atomic

log = logging.getLogger("hy3rl.train")

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "ckpt_contents.json"
LOCK_NAME = ".hy3rl-train.lock"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
ATTEMPT_JSON = re.compile(r"^attempt-(\d+)\.json$")

# squeue states of a job that is gone (anything else, including COMPLETING, counts as alive).
DEAD_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "REVOKED", "SPECIAL_EXIT",
}


class TrainError(RuntimeError):
    """A condition that stops the attempt; the message says what and where."""


class LockHeld(TrainError):
    """Another live trainer holds the checkpoint directory."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- config


def checkpoint_dir(config: Mapping[str, Any], workdir: Path | None = None) -> Path:
    """``<train.checkpoint_root>/<run.name>``, absolute (preflight renders the same path as
    ``trainer.default_local_dir``). An empty root means
    ``<run.results_root>/<run.name>/checkpoints`` under the working directory ``workdir``
    (default: the current directory)."""
    run = config["run"]
    root = str(config.get("train", {}).get("checkpoint_root", "") or "")
    path = Path(root) / run["name"] if root else \
        Path(run.get("results_root", "results")) / run["name"] / "checkpoints"
    if not path.is_absolute():
        path = (workdir or Path.cwd()) / path
    return Path(os.path.abspath(path))


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
                    acquired_at=now_iso())


def held_message(ckpt_dir: Path, holder: LockInfo) -> str:
    hint = (f"; wait for it to end or cancel it (scancel {holder.job_id})"
            if holder.job_id else "")
    return (f"checkpoint directory {ckpt_dir} is in use by {holder.describe()}, attempt "
            f"{holder.attempt}, since {holder.acquired_at}: a second trainer must not run "
            f"on it{hint}")


def check_lock_free(ckpt_dir: Path) -> None:
    """Raise LockHeld when a live trainer other than this SLURM job holds the checkpoint
    directory (called when Snakemake plans the train job, so that a relaunched controller
    refuses before submitting a second job)."""
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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """verl file-logger lines ``{"step": N, "data": {...}}``. A partial last line (the
    trainer died mid-write) is skipped; any other bad line is an error naming it."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as exc:
            if i == len(lines):  # last line without a newline: cut off by a crash
                log.warning("%s:%d: partial last line skipped", path, i)
                continue
            raise TrainError(f"{path}:{i}: not a verl metrics line ({exc})") from None
        out.append(rec)
    return out


def _validation_only(rec: dict[str, Any]) -> bool:
    data = rec.get("data")
    return isinstance(data, dict) and bool(data) and all(k.startswith("val-") for k in data)


def merge_metrics(logs: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Merge attempt logs given in attempt order: a step logged twice keeps the later
    attempt's line. Exception: a validation-only line (every key ``val-*``: verl validates
    at the resumed step before training, ``val_before_train``) adds its keys to the step's
    existing line instead of replacing the training metrics logged there."""
    by_step: dict[int, dict[str, Any]] = {}
    for lines in logs:
        for rec in lines:
            old = by_step.get(rec["step"])
            if old is not None and _validation_only(rec) and not _validation_only(old):
                rec = {**old, "data": {**old.get("data", {}), **rec["data"]}}
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def write_merged(attempts_dir: Path, out: Path) -> int:
    paths = sorted(attempts_dir.glob("attempt-*.metrics.jsonl"),
                   key=lambda p: int(re.search(r"attempt-(\d+)", p.name).group(1)))
    merged = merge_metrics(read_metrics(p) for p in paths)
    write_text_atomic(out, "".join(json.dumps(r) + "\n" for r in merged))
    return len(merged)


# --------------------------------------------------------------------------- attempts


@dataclass
class AttemptRecord:
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
    started_at: str = field(default_factory=now_iso)
    ended_at: str | None = None
    wall_s: float | None = None
    metrics_log: str = ""
    log_dir: str = ""
    runtime: dict[str, str] = field(default_factory=dict)  # train.runtime, defaults filled


def attempt_numbers(attempts_dir: Path) -> list[int]:
    if not attempts_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in attempts_dir.iterdir()
                  if (m := ATTEMPT_JSON.match(p.name)))


def load_attempt(attempts_dir: Path, k: int) -> dict[str, Any]:
    path = attempts_dir / f"attempt-{k}.json"
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise TrainError(f"{path}: not valid JSON ({exc})") from None


def last_step(lines: list[dict[str, Any]]) -> int | None:
    return max((r["step"] for r in lines), default=None)


def close_record(rec: dict[str, Any], attempts_dir: Path, end_step: int | None,
                 reason: str, code: int | None) -> dict[str, Any]:
    """Fill the end of an attempt record from the checkpoint state and its metrics log."""
    lines = read_metrics(attempts_dir / rec["metrics_log"]) if rec.get("metrics_log") else []
    last = last_step(lines)
    rec["end_step"] = end_step
    rec["last_logged_step"] = last
    rec["steps_lost"] = max(0, last - (end_step or 0)) if last is not None else 0
    rec["exit_reason"] = reason
    rec["exit_code"] = code
    rec["ended_at"] = now_iso()
    with contextlib.suppress(ValueError, TypeError):
        start = datetime.fromisoformat(rec["started_at"])
        rec["wall_s"] = round((datetime.fromisoformat(rec["ended_at"]) - start)
                              .total_seconds(), 1)
    return rec


def finalise_stale(attempts_dir: Path, end_step: int | None) -> list[int]:
    """Records still ``running`` belong to attempts killed without a chance to write (the
    lock is ours now, so none of them is alive): close them with the current state."""
    fixed = []
    for k in attempt_numbers(attempts_dir):
        rec = load_attempt(attempts_dir, k)
        if rec.get("exit_reason") == "running":
            close_record(rec, attempts_dir, end_step,
                         "killed (no record written: job or controller killed)", None)
            rec["ended_at"] = None
            rec["wall_s"] = None
            write_json_atomic(attempts_dir / f"attempt-{k}.json", rec)
            fixed.append(k)
            log.info("attempt %d: was still marked running; closed (end step %s)", k, end_step)
    return fixed


# --------------------------------------------------------------------------- plan


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


# --------------------------------------------------------------------------- main


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")


def run_attempt(args: argparse.Namespace, config: dict[str, Any]) -> int:
    from hy3rl import launch

    results = Path(args.results_dir).resolve()
    attempts_dir = results / "attempts"
    attempts_dir.mkdir(parents=True, exist_ok=True)
    plan_path = Path(args.plan).resolve()
    try:
        plan = json.loads(plan_path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainError(f"{plan_path}: cannot read the preflight plan: {exc}") from None
    if plan.get("ok") is False:
        raise TrainError(f"{plan_path}: preflight reported errors: {plan.get('errors')}")
    if plan.get("launched") is False:
        raise TrainError(f"{plan_path}: preflight did not plan a launch: "
                         f"{plan.get('not_launched_reason')}")
    total = total_steps_from_plan(plan, plan_path)
    ckpt = checkpoint_dir(config)
    if args.checkpoint_dir and os.path.abspath(args.checkpoint_dir) != str(ckpt):
        raise TrainError(f"--checkpoint-dir {args.checkpoint_dir} differs from "
                         f"train.checkpoint_root/run.name = {ckpt}")
    planned = (plan.get("checkpoint") or {}).get("dir")
    if planned and os.path.abspath(planned) != str(ckpt):
        raise TrainError(f"{plan_path}: checkpoint.dir {planned} differs from "
                         f"train.checkpoint_root/run.name = {ckpt}; rerun preflight")
    target = total if args.until is None else min(int(args.until), total)
    tcfg = config.get("train", {})
    ccfg = config["cluster"]
    keep = int(tcfg.get("checkpoint_keep", 2))
    protected = [int(s) for s in json.loads(args.keep_steps or "[]")]

    k = (attempt_numbers(attempts_dir) or [0])[-1] + 1
    me = my_lock_info(k)
    lock_actions = acquire_lock(ckpt, me)
    rec: dict[str, Any] = {}
    try:
        finalise_stale(attempts_dir, newest_complete(scan(ckpt)).step
                       if newest_complete(scan(ckpt)) else None)
        start, resume_actions = prepare_resume(ckpt, k)
        if start >= target:
            log.info("training already reached step %d (this job's last step %d, total %d): "
                     "nothing to launch", start, target, total)
            write_merged(attempts_dir, results / "metrics.jsonl")
            write_done(results, config, ckpt, start, total, attempts_dir, args.sentinel)
            return 0
        run = config["run"]["name"]
        try:
            runtime = launch.resolve_runtime(tcfg.get("runtime"))
        except launch.LaunchError as exc:
            raise TrainError(str(exc)) from None
        sub_id = f"{run}-{me.job_id or 'local'}-{k}"
        attempt = AttemptRecord(
            attempt=k, run=run, executor=me.executor, slurm_job_id=me.job_id, host=me.host,
            nodes=[], num_nodes=int(ccfg["nodes"]), gpus_per_node=int(ccfg["gpus_per_node"]),
            cpus_per_node=int(ccfg["cpus_per_node"]), submission_id=sub_id,
            checkpoint_dir=str(ckpt), start_step=start,
            resume_actions=lock_actions + resume_actions,
            metrics_log=f"attempt-{k}.metrics.jsonl", log_dir=f"attempt-{k}",
            runtime=runtime)
        rec = dataclasses.asdict(attempt)
        write_json_atomic(attempts_dir / f"attempt-{k}.json", rec)
        log.info("attempt %d: submission %s, checkpoint dir %s, start step %d, until step "
                 "%d of %d", k, sub_id, ckpt, start, target, total)

        spec = launch.LaunchSpec(
            submission_id=sub_id, launch_script=Path(args.launch).resolve(),
            runtime_env=Path(args.runtime_env).resolve(),
            log_dir=attempts_dir / f"attempt-{k}",
            launch_args=[] if target == total else [f"trainer.total_training_steps={target}"],
            env_vars={"VERL_FILE_LOGGER_PATH": str(attempts_dir / rec["metrics_log"])},
            passthrough_env=sorted(set(logger_env_names(plan))
                                   | set(tcfg.get("ray_env_passthrough", []))),
            nodes=int(ccfg["nodes"]), gpus_per_node=int(ccfg["gpus_per_node"]),
            cpus_per_node=int(ccfg["cpus_per_node"]), ray=dict(tcfg.get("ray", {})),
            runtime=runtime,
        )
        pruner = Pruner(ckpt, keep, protected, float(tcfg.get("prune_interval_s", 60)))
        pruner.start()
        try:
            result = launch.launch(
                spec, on_nodes=lambda nodes: _record_nodes(attempts_dir, k, rec, nodes),
                on_stop=lambda reason: _record_stop(attempts_dir, k, rec, ckpt, reason))
        finally:
            pruner.stop.set()
            pruner.join(timeout=30)
        removed = prune(ckpt, keep, protected)
        best = newest_complete(scan(ckpt))
        end = best.step if best else None
        close_record(rec, attempts_dir, end, result.reason, result.exit_code)
        write_json_atomic(attempts_dir / f"attempt-{k}.json", rec)
        n = write_merged(attempts_dir, results / "metrics.jsonl")
        log.info("attempt %d: %s (exit %s); newest complete checkpoint %s; %s steps lost; "
                 "%d merged metric lines; pruned %s", k, result.reason, result.exit_code,
                 end, rec["steps_lost"], n, sorted(pruner.removed + removed))
        if result.exit_code != 0:
            return result.exit_code or 1
        if end is None or end < target:
            raise TrainError(f"the trainer exited 0 but the newest complete checkpoint is "
                             f"{end}, not step {target}")
        write_done(results, config, ckpt, end, total, attempts_dir, args.sentinel)
        return 0
    except BaseException as exc:
        if rec and rec.get("exit_reason") == "running":
            reason = (f"launcher error: {exc}" if not isinstance(exc, KeyboardInterrupt)
                      else "signal SIGINT")
            best = newest_complete(scan(ckpt))
            close_record(rec, attempts_dir, best.step if best else None, reason, 1)
            write_json_atomic(attempts_dir / f"attempt-{k}.json", rec)
            with contextlib.suppress(Exception):
                write_merged(attempts_dir, results / "metrics.jsonl")
        raise
    finally:
        release_lock(ckpt, me)


def _record_stop(attempts_dir: Path, k: int, rec: dict[str, Any], ckpt: Path,
                 reason: str) -> None:
    """At a signal, record the attempt at once (SLURM kills KillWait seconds later)."""
    best = newest_complete(scan(ckpt))
    snapshot = close_record(dict(rec), attempts_dir, best.step if best else None, reason, None)
    write_json_atomic(attempts_dir / f"attempt-{k}.json", snapshot)


def _record_nodes(attempts_dir: Path, k: int, rec: dict[str, Any], nodes: list[str]) -> None:
    rec["nodes"] = list(nodes)
    rec["num_nodes"] = len(nodes)
    write_json_atomic(attempts_dir / f"attempt-{k}.json", rec)


def write_done(results: Path, config: Mapping[str, Any], ckpt: Path, final: int, total: int,
               attempts_dir: Path, path: str | Path | None = None) -> Path:
    """The sentinel, written last: done.json, or a segment's ``segments/step<N>.json``."""
    attempts = [load_attempt(attempts_dir, k) for k in attempt_numbers(attempts_dir)]
    step_dir = ckpt / f"global_step_{final}"
    done = {
        "run": config["run"]["name"],
        "final_step": final,
        "total_training_steps": total,
        "checkpoint_dir": str(ckpt),
        "checkpoint": str(step_dir),
        "hf_model": str(step_dir / "actor" / "model" / "huggingface"),
        "kept_checkpoints": [c.step for c in scan(ckpt) if c.complete],
        "incomplete_moved_aside": sorted(p.name for p in ckpt.glob("global_step_*.incomplete-*")),
        "attempts": [{key: a.get(key) for key in
                      ("attempt", "slurm_job_id", "nodes", "start_step", "end_step",
                       "steps_lost", "exit_reason", "started_at", "ended_at", "wall_s")}
                     for a in attempts],
        "steps_lost_total": sum(a.get("steps_lost") or 0 for a in attempts),
        "metrics": str(results / "metrics.jsonl"),
        "written_at": now_iso(),
    }
    path = Path(path) if path else results / "done.json"
    write_json_atomic(path, done)
    log.info("done: final step %d, %s", final, path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hy3rl.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config-json", required=True,
                    help="config sections run, cluster, train (JSON)")
    ap.add_argument("--plan", required=True, help="preflight/plan.json")
    ap.add_argument("--launch", required=True, help="preflight/launch.sh")
    ap.add_argument("--runtime-env", required=True, help="deps/runtime_env.yaml")
    ap.add_argument("--results-dir", required=True, help="results/<run>/train")
    ap.add_argument("--checkpoint-dir", help="the checkpoint directory (checked against the "
                    "config; default: <train.checkpoint_root>/<run.name>)")
    ap.add_argument("--until", type=int, default=None,
                    help="train.segment_steps: stop at this step (a segment's end) instead of "
                    "trainer.total_training_steps; the launch gets trainer.total_training_steps"
                    "=<until> appended (verl saves at its last step)")
    ap.add_argument("--sentinel", default=None,
                    help="with --until: the segment's sentinel to write (default done.json)")
    ap.add_argument("--keep-steps", default="[]",
                    help="JSON list of steps retention keeps (eval.steps)")
    args = ap.parse_args(argv)
    _setup_logging()
    try:
        config = json.loads(args.config_json)
        return run_attempt(args, config)
    except LockHeld as exc:
        log.error("%s", exc)
        return 3
    except TrainError as exc:
        log.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
