"""The checkpoint directory of a run (``Layout.checkpoint_dir``): verl's layout, which
checkpoint is complete, resume preparation, retention, the lock, and the run identity.

Written by verl@220e903: ``global_step_N/`` (the actor saved first, ``actor/ckpt_contents.json``
written last by rank 0, then ``data.pt``), then the tracker ``latest_checkpointed_iteration.txt``.
Written by this workflow: the lock ``.hy3rl-train.lock`` (one live trainer per directory) and
the identity ``hy3rl-run-identity.json`` (which configuration made the checkpoints; written
before the first launch, checked by preflight and by every attempt). Checkpoints are never
Snakemake outputs and nothing here deletes one, except retention of complete checkpoints
older than the newest. Formats: docs/formats/train.md.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hy3rl.atomic import write_text_atomic
from hy3rl.errors import StageError
from hy3rl.timefmt import utc_now

log = logging.getLogger("hy3rl.ckptdir")

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "ckpt_contents.json"
LOCK_NAME = ".hy3rl-train.lock"
STEP_DIR = re.compile(r"^global_step_(\d+)$")

# squeue states of a job that is gone (anything else, including COMPLETING, counts as alive).
DEAD_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "REVOKED", "SPECIAL_EXIT",
}



class CheckpointDirError(StageError):
    """A checkpoint directory that cannot be used as it is; the message names the file."""


class LockHeld(CheckpointDirError):
    """Another live trainer holds the checkpoint directory."""


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
        raise CheckpointDirError(f"{path}: not an integer step ({text[:40]!r})") from None


def write_tracker(ckpt_dir: Path, step: int) -> None:
    write_text_atomic(ckpt_dir / TRACKER, str(step))


FSDP_CONFIG = "fsdp_config.json"
FSDP_SHARD = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")


def is_fsdp(step_dir: Path) -> bool:
    """Whether ``global_step_<N>`` is in verl's FSDP layout (the CPU path's engine):
    ``actor/{model,optim,extra_state}_world_size_W_rank_R.pt``, ``actor/fsdp_config.json``,
    ``actor/huggingface/``; else Megatron's (``actor/ckpt_contents.json``, ``dist_ckpt``)."""
    actor = step_dir / "actor"
    if (actor / MANIFEST).exists():
        return False
    return (actor / FSDP_CONFIG).exists() or (
        actor.is_dir() and any(FSDP_SHARD.match(p.name) for p in actor.iterdir()))


def _check_fsdp(step_dir: Path) -> tuple[bool, str]:
    """verl's FSDP checkpoint manager (verl/utils/checkpoint/fsdp_checkpoint_manager.py at
    the pin) writes no manifest: each rank its shards (``torch.save``), rank 0 the HF config
    and ``fsdp_config.json``, then (with hf_model) the HF weights; the trainer writes
    ``data.pt`` after the whole actor save returned. Complete: every rank's shards of the
    world size their names give, each a whole torch archive, and ``fsdp_config.json``."""
    actor = step_dir / "actor"
    shards: dict[str, dict[int, Path]] = {}
    sizes = set()
    for p in actor.iterdir() if actor.is_dir() else []:
        m = FSDP_SHARD.match(p.name)
        if m:
            shards.setdefault(m.group(1), {})[int(m.group(3))] = p
            sizes.add(int(m.group(2)))
    if not shards.get("model"):
        return False, "no actor/model_world_size_*_rank_*.pt (actor save did not finish)"
    if len(sizes) != 1:
        return False, f"actor shards of several world sizes {sorted(sizes)}"
    world = sizes.pop()
    for kind, ranks in sorted(shards.items()):
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            return False, f"no actor/{kind}_world_size_{world}_rank_{missing[0]}.pt"
        for _rank, path in sorted(ranks.items()):
            if not zipfile.is_zipfile(path):
                return False, f"actor/{path.name} is not a whole torch archive"
    try:
        json.loads((actor / FSDP_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        return False, f"actor/{FSDP_CONFIG} missing or unreadable: {exc}"
    return True, ""


def check_complete(step_dir: Path, step: int) -> tuple[bool, str]:
    """Whether ``global_step_<step>`` holds a finished verl save, and why not.

    verl (220e903) saves the actor (Megatron: rank 0 writes ``actor/ckpt_contents.json``
    last, via a temp file and a rename; FSDP, the CPU path: :func:`_check_fsdp`), then
    ``data.pt`` (``torch.save``: a zip archive), then the tracker. A save interrupted
    anywhere leaves one of these missing or partial."""
    if is_fsdp(step_dir):
        ok, why = _check_fsdp(step_dir)
        if not ok:
            return ok, why
        return _check_data(step_dir)
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
    return _check_data(step_dir)


def _check_data(step_dir: Path) -> tuple[bool, str]:
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


def free_name(path: Path) -> Path:
    """``path``, or ``path.2``, ``path.3``, ... : the first that does not exist (where
    something is moved aside, never over an earlier one)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def prepare_resume(ckpt_dir: Path, attempt: int) -> tuple[int, list[str]]:
    """Make verl's ``resume_mode=auto`` continue from the newest complete checkpoint.

    Returns (start step, actions taken). Newer incomplete ``global_step_N`` directories are
    renamed to ``global_step_N.incomplete-<attempt>`` (verl would otherwise save into a
    half-written directory); only the newest such leftover is kept (for inspection): older
    ones are removed, as is a ``.pruning-*`` directory of an interrupted retention, so that
    multi-TB leftovers never fill the disk. The tracker is (re)written when it names
    another step."""
    actions: list[str] = []
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for left in sorted(ckpt_dir.glob(".pruning-global_step_*")):
        # retention renamed it out of global_step_* (decided, never read again) and the
        # process ended before the removal finished: finish it, or it fills the disk
        shutil.rmtree(left)
        actions.append(f"finished removing {left.name} (retention was interrupted)")
    ckpts = scan(ckpt_dir)
    best = newest_complete(ckpts)
    start = best.step if best else 0
    for c in ckpts:
        if c.step > start and not c.complete:
            aside = free_name(c.path.with_name(f"{c.path.name}.incomplete-{attempt}"))
            os.rename(c.path, aside)
            actions.append(f"moved incomplete checkpoint {c.path.name} aside to {aside.name} "
                           f"({c.reason})")
    actions += remove_old_incomplete(ckpt_dir)
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


def _aside_order(p: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", p.name.split(".incomplete-")[1]))


def old_incomplete(ckpt_dir: Path) -> list[Path]:
    """Every ``global_step_N.incomplete-<k>[.n]`` but the newest (the highest attempt
    ``k``, then ``n``)."""
    return sorted(ckpt_dir.glob("global_step_*.incomplete-*"), key=_aside_order)[:-1]


def leftovers(ckpt_dir: Path) -> list[Path]:
    """What the next start removes (:func:`prepare_resume`): the ``.pruning-*`` directories
    of an interrupted retention and every incomplete save but the newest."""
    return sorted(ckpt_dir.glob(".pruning-global_step_*")) + old_incomplete(ckpt_dir)


def remove_old_incomplete(ckpt_dir: Path) -> list[str]:
    """Remove every incomplete save moved aside but the newest (:func:`old_incomplete`):
    each is renamed out of the pattern first (``.pruning-*``, finished at the next start if
    this process ends mid-removal). Returns the actions taken."""
    actions = []
    for old in old_incomplete(ckpt_dir):
        doomed = free_name(ckpt_dir / f".pruning-{old.name}")
        os.rename(old, doomed)
        shutil.rmtree(doomed)
        actions.append(f"removed {old.name} (an older incomplete save; the newest is kept)")
    return actions


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


Protected = Iterable[int] | Callable[[], Iterable[int]]


def prune(ckpt_dir: Path, keep: int, protected: Protected) -> list[int]:
    """Remove old complete checkpoints (retention); returns the removed steps. A victim is
    first renamed out of ``global_step_*`` so a reader never sees it half-deleted.
    ``protected``: the steps never removed, or a callable giving them, asked at every pass
    (evaluation's, hy3rl.evalckpt.protected_steps: read from files, so a restarted job
    keeps what an evaluation has not finished reading)."""
    protected = list(protected() if callable(protected) else protected)
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
                 "for evaluation steps %s)", step, keep, sorted(protected))
    return removed


class Pruner(threading.Thread):
    """Runs retention every ``interval`` seconds while the trainer runs."""

    def __init__(self, ckpt_dir: Path, keep: int, protected: Protected, interval: float):
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
        raise CheckpointDirError(f"lock names SLURM job {job_id} but squeue is not available "
                                 "here to check it") from None
    except subprocess.TimeoutExpired:
        raise CheckpointDirError(f"lock names SLURM job {job_id} but squeue did not answer "
                                 "within 60s: whether it still runs cannot be told") from None
    out = proc.stdout.strip()
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise CheckpointDirError(f"squeue -j {job_id} failed ({proc.returncode}): "
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
        raise CheckpointDirError(f"{path}: unreadable lock file ({exc}); check no trainer "
                                 "runs on this checkpoint directory, then remove it") from None
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
    raise CheckpointDirError(f"{path}: could not take the lock (contended)")


def release_lock(ckpt_dir: Path, me: LockInfo) -> None:
    path = ckpt_dir / LOCK_NAME
    with contextlib.suppress(CheckpointDirError):
        holder = read_lock(path)
        if holder and holder.pid == me.pid and holder.host == me.host \
                and holder.job_id == me.job_id:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- identity

IDENTITY_NAME = "hy3rl-run-identity.json"
IDENTITY_SCHEMA = 1


@dataclass
class IdentityDecision:
    """What a launch on this checkpoint directory means (``action``) and whether it may
    go ahead (``error`` None). Actions: ``new`` (no checkpoint yet), ``adopt`` (checkpoints
    from before identity files), ``same``, ``extend`` (a larger total), ``fresh`` (another
    trajectory, old checkpoints moved aside), ``resume_changed`` (another trajectory,
    continued on purpose), ``restart_changed`` (another trajectory before any complete
    checkpoint)."""

    action: str
    newest_step: int
    changes: list[dict] = dataclasses.field(default_factory=list)
    message: str = ""
    error: str | None = None


def lineage_first_attempt(ckpt_dir: Path) -> int:
    """The first attempt that trained the directory's current checkpoints (1 without an
    identity file): metrics merges and the report start there."""
    doc = read_identity(ckpt_dir)
    return int((doc or {}).get("first_attempt") or 1)


def identity_path(ckpt_dir: Path) -> Path:
    return Path(ckpt_dir) / IDENTITY_NAME


def read_identity(ckpt_dir: Path) -> dict | None:
    """The directory's identity file, None when there is none; one that does not parse (or
    lacks its keys) is an error naming the file."""
    path = identity_path(ckpt_dir)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointDirError(f"{path}: the run identity file does not parse ({exc}); "
                                 "restore it, or move it aside to adopt the checkpoints "
                                 "as made by the current configuration") from None
    traj = doc.get("trajectory") if isinstance(doc, dict) else None
    if not isinstance(traj, dict) or not isinstance(traj.get("values"), dict) \
            or not isinstance(doc.get("extents"), list) or not doc["extents"]:
        raise CheckpointDirError(f"{path}: not a run identity file (no trajectory.values or "
                                 "extents)")
    return doc


def decide_identity(ckpt_dir: Path, trajectory: dict, total: int,
                    on_change: str) -> IdentityDecision:
    """Compare the configuration about to launch (``trajectory`` from preflight's plan:
    ``{"id", "values", "origins"}``; ``total``: its total_training_steps) with the
    directory's identity and its newest complete checkpoint. Pure: nothing is written."""
    from hy3rl.identity import describe_changes, trajectory_changes

    ckpt_dir = Path(ckpt_dir)
    doc = read_identity(ckpt_dir)
    ckpts = scan(ckpt_dir)
    best = newest_complete(ckpts)
    newest = best.step if best else 0
    # by type and value (1e-6 == 1.0e-6); a file written before typed values is parsed, one
    # written before the composed form compared on the keys it names
    diff = trajectory_changes(doc["trajectory"], trajectory) if doc else []
    fresh = bool(diff) and on_change == "fresh" and best is not None
    if best is not None and total < newest and not fresh:
        return IdentityDecision(
            "refuse", newest, error=f"train.total_training_steps = {total} is below the "
            f"newest complete checkpoint, step {newest}, in {ckpt_dir}: a run cannot be "
            f"shortened; set it to {newest} or more (or start afresh with another run.name)")
    if doc is None:
        if best is None:
            return IdentityDecision("new", 0, message="no checkpoint yet: a new run")
        return IdentityDecision("adopt", newest, message=(
            f"WARNING: {ckpt_dir} holds checkpoints (newest complete: step {newest}) but no "
            f"{IDENTITY_NAME} (made before run identities): adopted as made by this "
            "configuration, which nothing can verify"))
    last_total = int(doc["extents"][-1].get("total_training_steps") or 0)
    if not diff:
        if total > last_total:
            return IdentityDecision("extend", newest, message=(
                f"extension: total_training_steps {last_total} -> {total}, resuming from "
                f"step {newest}"))
        return IdentityDecision("same", newest, message="same trajectory: resume")
    what = describe_changes(diff, {**doc["trajectory"].get("origins", {}),
                                   **trajectory.get("origins", {})})
    if best is None:
        return IdentityDecision("restart_changed", 0, diff, message=(
            f"the configuration changed before any complete checkpoint ({what}): the run "
            "starts from step 0 under the new one"))
    if on_change == "fresh":
        return IdentityDecision("fresh", newest, diff, message=(
            f"train.on_config_change = fresh: the checkpoints up to step {newest} were made "
            f"by another configuration ({what}); they are moved aside and training starts "
            "from step 0"))
    if on_change == "resume":
        return IdentityDecision("resume_changed", newest, diff, message=(
            f"train.on_config_change = resume: continuing from step {newest} under a changed "
            f"configuration ({what}); recorded in {IDENTITY_NAME}"))
    return IdentityDecision("refuse", newest, diff, error=(
        f"the checkpoints in {ckpt_dir} (newest complete: step {newest}) were made by "
        f"another configuration: {what}. Set train.on_config_change: fresh (move them aside, "
        "train from step 0) or resume (continue from them under the new values, recorded), "
        "or restore the old values"))


def move_aside(ckpt_dir: Path, now: str,
               chosen: Callable[[str], bool]) -> tuple[Path, list[str]]:
    """Move the entries of ``ckpt_dir`` whose name is ``chosen`` into a new
    ``superseded-<time>/`` (nothing deleted); returns it and the names moved."""
    stamp = now.replace(":", "").replace("+0000", "Z")
    aside = free_name(ckpt_dir / f"superseded-{stamp}")
    aside.mkdir()
    moved = []
    for entry in sorted(ckpt_dir.iterdir()):
        if chosen(entry.name):
            os.rename(entry, aside / entry.name)
            moved.append(entry.name)
    return aside, moved


def lineage_cuts(ckpt_dir: Path) -> list[tuple[int, int]]:
    """The rewinds of the directory's lineage as ``(attempt, step)``: the attempts before
    ``attempt`` count up to ``step`` only (hy3rl.verl_log.merged_attempts)."""
    doc = read_identity(ckpt_dir) or {}
    return [(int(r["attempt"]), int(r["step"])) for r in doc.get("rewinds") or []]


def rewind(ckpt_dir: Path, step: int, attempt: int) -> list[str]:
    """Go on from the complete checkpoint ``step`` in a new lineage (``hy3rl rewind``; the
    way on after the health guard stopped a run: docs/formats/train.md): every
    ``global_step_M`` with M > ``step`` (complete or not, and leftovers of incomplete saves)
    moves into ``superseded-<time>/`` (nothing deleted), the tracker names ``step``, and
    the identity file records it (``lineage`` + 1, a ``rewind`` history event, and in
    ``rewinds`` the next ``attempt`` and ``step``: the metrics of earlier attempts count up
    to ``step`` only). Refused while a trainer holds the directory, for a step that is not
    a complete checkpoint, or for a directory without a run identity. Returns the actions
    taken."""
    from hy3rl.atomic import write_json_atomic

    ckpt_dir = Path(ckpt_dir)
    check_lock_free(ckpt_dir)
    doc = read_identity(ckpt_dir)
    if doc is None:
        raise CheckpointDirError(f"{identity_path(ckpt_dir)}: no run identity file: nothing "
                                 "to rewind (no run has trained here under this workflow)")
    ok, why = check_complete(ckpt_dir / f"global_step_{step}", step)
    if not ok:
        complete = [c.step for c in scan(ckpt_dir) if c.complete]
        raise CheckpointDirError(f"{ckpt_dir / f'global_step_{step}'}: not a complete "
                                 f"checkpoint ({why}); the complete ones are steps {complete}")

    def later(name: str) -> bool:
        m = re.match(r"^global_step_(\d+)", name)
        return m is not None and int(m.group(1)) > step

    now = utc_now()
    aside, moved = move_aside(ckpt_dir, now, later)
    write_tracker(ckpt_dir, step)
    doc = dict(doc)
    doc["lineage"] = int(doc.get("lineage") or 1) + 1
    doc["rewinds"] = [*(doc.get("rewinds") or []), {"at": now, "attempt": attempt,
                                                    "step": step, "moved_to": aside.name}]
    doc["history"] = [*doc.get("history", []), {
        "at": now, "attempt": attempt, "action": "rewind", "at_step": step,
        "trajectory_id": doc["trajectory"].get("id"), "moved": moved}]
    doc["updated"] = now
    write_json_atomic(identity_path(ckpt_dir), doc)
    actions = [f"rewound to step {step} (lineage {doc['lineage']}): moved {len(moved)} "
               f"entries after it aside to {aside.name}/ (nothing deleted): "
               f"{', '.join(moved) or 'none'}; tracker -> {step}"]
    for a in actions:
        log.info("identity: %s", a)
    return actions


def apply_identity(ckpt_dir: Path, decision: IdentityDecision, trajectory: dict, total: int,
                   segment_steps: int, *, attempt: int | None = None) -> list[str]:
    """Carry out ``decision`` (never a refusal) and write the identity file atomically:
    with ``fresh``, every ``global_step_*``, the tracker and the old identity file move into
    ``superseded-<time>/`` (nothing is deleted). Returns the actions taken, for the
    attempt record."""
    from hy3rl.atomic import write_json_atomic

    if decision.error:
        raise CheckpointDirError(decision.error)
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    old = read_identity(ckpt_dir)
    now = utc_now()
    actions: list[str] = []
    lineage = int((old or {}).get("lineage") or 1)
    if decision.action == "fresh":
        aside, moved = move_aside(ckpt_dir, now, lambda name: name.startswith(
            "global_step_") or name in (TRACKER, IDENTITY_NAME))
        actions.append(f"moved {len(moved)} entries made by the old configuration aside to "
                       f"{aside.name}/ (nothing deleted): {', '.join(moved)}")
        lineage += 1
        old = None
    event = {"at": now, "attempt": attempt, "action": decision.action,
             "at_step": decision.newest_step, "trajectory_id": trajectory["id"],
             "total_training_steps": total, "segment_steps": segment_steps}
    if decision.changes:
        event["changes"] = decision.changes
    if old is None:
        doc = {"schema_version": IDENTITY_SCHEMA, "lineage": lineage, "created": now,
               "first_attempt": attempt if decision.action in ("new", "fresh") and attempt
               else 1, "trajectory": trajectory, "extents": [], "history": []}
    else:
        doc = dict(old)
        doc["trajectory"] = trajectory
    last = doc["extents"][-1] if doc["extents"] else None
    if last is None or (last.get("total_training_steps"), last.get("segment_steps")) \
            != (total, segment_steps):
        doc["extents"].append({"at": now, "at_step": decision.newest_step,
                               "total_training_steps": total, "segment_steps": segment_steps})
    if decision.action != "same" or old is None:
        doc["history"].append(event)
    doc["updated"] = now
    write_json_atomic(identity_path(ckpt_dir), doc)
    if decision.message:
        actions.append(decision.message)
    for a in actions:
        log.info("identity: %s", a)
    return actions
