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
   ``VERL_FILE_LOGGER_PATH``; meanwhile the watchdog (``hy3rl.watchdog``) and the
   training-health guard (``hy3rl.health.Guard``: a ``stop`` rule ends the attempt
   ``unhealthy``, naming the last healthy checkpoint, which retention keeps) watch it, and
   old complete checkpoints are pruned (retention);
5. record the attempt, merge every attempt's metrics log (``hy3rl.verl_log``), and, when
   training reached its last step, write the sentinel ``done.json`` last.

Every path comes from :class:`hy3rl.layout.Layout`: the checkpoint directory
(``Layout.checkpoint_dir``, never a Snakemake output: Snakemake deletes outputs before a
job and after a failure) and the attempt files. Formats: docs/formats/train.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hy3rl.atomic import remove_siblings, write_json_atomic, write_jsonl_atomic
from hy3rl.ckptdir import (
    LockHeld,
    LockInfo,
    Protected,
    Pruner,
    acquire_lock,
    apply_identity,
    check_complete,
    decide_identity,
    lineage_cuts,
    lineage_first_attempt,
    my_lock_info,
    newest_complete,
    prepare_resume,
    prune,
    release_lock,
    scan,
)
from hy3rl.errors import StageError
from hy3rl.health import (
    UNHEALTHY,
    Event,
    Guard,
    Watcher,
    describes_checkpoint,
    last_healthy,
    response_cap,
    stop_when,
    stopped_when,
)
from hy3rl.layout import ATTEMPT_RE, Layout
from hy3rl.loadwatch import PROGRESS_DIR
from hy3rl.timefmt import parse, utc_now
from hy3rl.verl_log import merged_attempts, read_metrics

if TYPE_CHECKING:
    from hy3rl.settings import Cluster, Train
    from hy3rl.watchdog import Allowances, Schedule, TimeModel

log = logging.getLogger("hy3rl.train")


class TrainError(StageError):
    """A condition that stops the attempt; the message says what and where."""


class TrainFailed(TrainError):
    """The attempt ran and ended without reaching its last step (recorded in its record)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- metrics


def write_merged(attempts_dir: Path, out: Path, since: int = 1,
                 cuts: Sequence[tuple[int, int]] = ()) -> int:
    """``out`` (train/metrics.jsonl): the merge of the logs under ``attempts_dir`` of the
    attempts ``since`` and later (the checkpoint directory's lineage,
    ``hy3rl.ckptdir.lineage_first_attempt``, with its rewinds' ``cuts``,
    ``hy3rl.ckptdir.lineage_cuts``; ``hy3rl.verl_log.merged_attempts``); returns its
    number of lines."""
    merged = merged_attempts(Path(attempts_dir), since, cuts)
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
    # What ended it (docs/formats/train.md "Outcomes"), for people and for the controller's
    # resubmission guard (hy3rl.resubmit).
    outcome: str = "running"
    failed_at_step: int | None = None
    error: str | None = None
    lost_nodes: list[str] = field(default_factory=list)
    excluded_nodes: list[str] = field(default_factory=list)
    job_attempt: int = 1
    node_logs: dict[str, list[str]] = field(default_factory=dict)
    diagnostics: dict[str, Any] | None = None
    wandb: dict[str, Any] | None = None
    crash_loop: str | None = None
    # The run identity it trained under (hy3rl.identity; plan.json identity) and what the
    # checkpoint directory's identity check decided before it (hy3rl.ckptdir).
    trajectory_id: str | None = None
    total_training_steps: int | None = None
    identity_action: str | None = None
    # The checkpoint selection rule of the plan it ran with (plan.json selection): the first
    # attempt's is the rule fixed before training; the report shows a later change.
    selection: dict[str, Any] | None = None
    # The training-health guard (hy3rl.health): every event of this attempt's steps, as it
    # arrived ({rule, step, first_step, action, metric, values, message}), and, when a stop
    # rule ended it, the stop with the last healthy checkpoint (docs/formats/train.md).
    health: list[dict[str, Any]] = field(default_factory=list)
    health_stop: dict[str, Any] | None = None


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


def health_stop_at(layout: Layout) -> int | None:
    """The first checkpoint that a ``stop`` rule that fired in the checkpoint directory's
    lineage calls sick (the ``health`` events of its attempt records, a rewind dropping the
    events past its step; their first step, or the step before for a rollout-side metric:
    hy3rl.health.describes_checkpoint): a checkpoint at or past it is unhealthy (the
    selection never picks one, hy3rl.selection). None when none fired, or unreadable
    records."""
    ckpt = layout.checkpoint_dir
    try:
        since, cuts = lineage_first_attempt(ckpt), lineage_cuts(ckpt)
        records = [load_attempt(layout, k) for k in attempt_numbers(layout) if k >= since]
    except StageError as exc:
        log.warning("health stops unknown: %s", exc)
        return None
    firsts = []
    for rec in records:
        k = int(rec.get("attempt") or 0)
        bound = min((n for at, n in cuts if k < at), default=None)
        for e in rec.get("health") or []:
            if isinstance(e, dict) and e.get("action") == "stop" and isinstance(
                    e.get("first_step"), int) and (bound is None or e["first_step"] <= bound):
                firsts.append(describes_checkpoint(str(e.get("metric") or ""),
                                                   e["first_step"]))
    return min(firsts, default=None)


# Preflight's identity decisions under which the launch resumes from the directory's newest
# complete checkpoint (fresh, restart_changed and new start from step 0).
RESUMES = ("same", "extend", "resume_changed", "adopt")


def how_to_go_on(best: int | None) -> str:
    """The way on after a health stop, from the last healthy checkpoint ``best`` (None:
    there is none)."""
    if best is None:
        return ("start afresh under a changed configuration: train.on_config_change: fresh "
                "(moves the checkpoints aside, nothing deleted)")
    return (f"to go on from step {best} in a new lineage: `hy3rl rewind --step {best} "
            "--configfile <the run's config files>` (the checkpoints after it move aside to "
            "superseded-<time>/, nothing deleted), then change the configuration (what the "
            "rule points at: e.g. a lower learning rate, a larger KL coefficient) with "
            "train.on_config_change: resume, and run the workflow again")


def sick_resume(layout: Layout, plan: Path | None = None) -> str | None:
    """Why the training job would be refused (the message) when the records already decide
    it, on the submit host before any job is submitted: the plan the job runs (``plan``,
    default ``Layout.train_plan``) resumes (:data:`RESUMES`) from the newest complete
    checkpoint, and a ``stop`` rule of the lineage calls it sick (:func:`health_stop_at`: a
    rerun after an ``unhealthy`` stop without ``hy3rl rewind``). The job's own
    ``Job.check_healthy_start`` would refuse the same after its allocation started. None:
    submit."""
    sick = health_stop_at(layout)
    if sick is None:
        return None
    try:
        doc = read_plan(Path(plan or layout.train_plan))
    except TrainError:
        return None  # the job names it
    decision = ((doc.get("identity") or {}).get("decision") or {})
    newest = decision.get("newest_step")
    if decision.get("action") not in RESUMES or not isinstance(newest, int) or newest < sick:
        return None
    ckpt = layout.checkpoint_dir
    best = last_healthy([c.step for c in scan(ckpt) if c.complete], [], sick)
    return (f"the launch would resume from step {newest} in {ckpt}, which a health stop "
            f"rule of this lineage calls sick (from checkpoint {sick}; the rule and its "
            f"values are in {layout.train_attempts}/attempt-*.json `health_stop`): "
            f"{how_to_go_on(best)}; not submitted")


def last_step(lines: list[dict[str, Any]]) -> int | None:
    return max((r["step"] for r in lines), default=None)


def _last_logged(layout: Layout, k: int) -> int | None:
    """The last step attempt ``k``'s metrics log holds (None: none, or unreadable)."""
    try:
        return last_step(read_metrics(Path(layout.attempt_metrics(k))))
    except (OSError, StageError):
        return None


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
            rec["outcome"] = "killed"
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


@dataclass
class JobStep:
    """What the job does after an attempt that did not finish: ``restart`` in this
    allocation, or end with ``retry`` (whether a resubmission may help), ``reason`` (for
    job-exit.json and the error) and the nodes a resubmission must ``exclude``."""

    restart: bool
    retry: bool
    reason: str
    exclude: list[str] = field(default_factory=list)


def after_attempt(rec: Mapping[str, Any], records: Sequence[Mapping[str, Any]], *,
                  restarts_left: int, lost: Sequence[str], allocation: Sequence[str],
                  nodes_needed: int, time_left: float | None,
                  interval: float | None, attempts_dir: str | None = None) -> JobStep:
    """The decision after attempt ``rec`` (``records``: every attempt of the run so far,
    ``rec`` last; ``lost``: nodes lost in this job, ``rec``'s included). A failure restarts
    in the allocation while restarts are left and the time left holds ``interval`` (a
    startup and the work until the next save; unknown times do not prevent it); a crash
    loop (hy3rl.resubmit.crash_loop) never restarts nor resubmits; a lost node restarts
    only if the layout still fits without it."""
    from hy3rl.resubmit import crash_loop

    outcome, reason = rec.get("outcome"), str(rec.get("exit_reason"))
    exclude = sorted(set(lost))
    if outcome == "planned_kill":  # the rehearsal's planned kill: its resume is the point
        return JobStep(True, True, reason, exclude)
    if rec.get("disk_full"):
        return JobStep(False, False, f"{reason}: {rec['disk_full']}", exclude)
    if outcome in ("stopped_for_time_limit", "time_limit", "preempted"):
        return JobStep(False, True, reason, exclude)
    if outcome in ("refused", "cancelled"):
        return JobStep(False, False, reason, exclude)
    if outcome == UNHEALTHY:  # the same trainer would only break again: never retried
        return JobStep(False, False, str((rec.get("health_stop") or {}).get("message")
                                         or reason), exclude)
    loop = crash_loop(list(records), attempts_dir)
    if loop:
        return JobStep(False, False, loop, exclude)
    if outcome == "hung" and rec.get("last_logged_step") is None:
        # A start that hangs (NCCL initialisation, a node that never loads) is retried in a
        # new allocation, before it can be a crash loop. The nodes excluded are those the
        # node agents' reports show stopped first (stalled_nodes), never the allocation.
        from hy3rl.resubmit import node_quiet, stalled_nodes

        stalled = stalled_nodes(rec)
        if stalled:
            quiet = node_quiet(rec)
            ago = ", ".join(f"{n} {quiet[n] / 60:.0f} min ago" for n in stalled)
            return JobStep(False, True, f"{reason}; {', '.join(stalled)} stopped progressing "
                           f"first ({ago}, the other nodes {min(quiet.values()) / 60:.0f} min "
                           "ago: the node agents' reports): excluded from the resubmission",
                           sorted(set(exclude) | set(stalled)))
        return JobStep(False, True, f"{reason}; a start that hangs is retried in a new "
                       "allocation (no node stopped before the others: none excluded): ends "
                       "for a resubmission", exclude)
    fits = len([n for n in allocation if n not in set(lost)]) >= nodes_needed
    has_time = time_left is None or interval is None or time_left >= interval
    if restarts_left > 0 and has_time and fits:
        return JobStep(True, True, reason, exclude)
    why = ("no restart left in this job" if restarts_left <= 0 else
           f"{time_left:.0f}s left, a restart needs {interval:.0f}s until its first save"
           if not has_time
           else f"the layout needs {nodes_needed} node(s) without {', '.join(exclude)}")
    return JobStep(False, True, f"{reason}; {why}: ends for a resubmission", exclude)


def classify_signal(reason: str, job_id: str | None, time_left: float | None) -> str:
    """The outcome of an attempt stopped by a signal: SLURM's SIGTERM (or SIGUSR1) within
    two minutes of the job's end is its time limit, earlier it is a preemption (or a
    scancel: the same to the workflow, which resubmits); SIGINT, or any signal outside
    SLURM, is a cancellation."""
    if not job_id or "SIGINT" in reason:
        return "cancelled"
    if time_left is not None and time_left <= 120:
        return "time_limit"
    return "preempted"


ERROR_LINE = re.compile(r"^\s*(?:\([^)]*\)\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)"
                        r"\b:?.*)$")


DISK_FULL = re.compile(r"No space left on device|\[Errno 28\]|ENOSPC")
LOAD_TENSOR_SLACK = 10.0  # the model load's quiet limit: at least 10 x the largest tensor's read


def output_tail(driver_log: Path) -> str | None:
    """The last 256 KiB of the trainer's output; None when it cannot be read."""
    try:
        with open(driver_log, "rb") as fh:
            fh.seek(max(0, os.path.getsize(driver_log) - 256 * 1024))
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def disk_full(driver_log: Path, ckpt_dir: Path) -> str | None:
    """When the trainer's output says the storage is full (ENOSPC, as a failing save
    prints): what to do, for the record and job-exit.json; else None. Not retried as a
    crash: every attempt would fail at the same save."""
    text = output_tail(driver_log)
    if text is None:
        return None
    if not DISK_FULL.search(text):
        return None
    try:
        free = f"{shutil.disk_usage(ckpt_dir).free / 1e9:.1f} GB free now"
    except OSError:
        free = "free space unknown"
    return (f"the trainer ran out of disk space (No space left on device) on {ckpt_dir} "
            f"({free}): free space there or lower train.checkpoint_keep, then rerun; not "
            "retried as a crash")


def last_error(driver_log: Path) -> str | None:
    """The trainer's last error line (``SomeError: message``) in its output, for the record
    and the crash-loop message; None when there is none."""
    text = output_tail(driver_log)
    if text is None:
        return None
    found = None
    for line in text.splitlines():
        m = ERROR_LINE.match(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            found = m.group(1).strip()
    return found[:300] if found else None


def sbatch_excluded(job_id: str | None) -> list[str]:
    """The nodes the job's sbatch excluded (``scontrol show job``'s ExcNodeList)."""
    from hy3rl.resubmit import hostnames, slurm_output

    text = slurm_output(["scontrol", "show", "job", str(job_id)]) if job_id else None
    m = re.search(r"\bExcNodeList=(\S+)", text or "")
    return hostnames(m.group(1)) if m else []


def allowances(wd: Any, plan: Mapping[str, Any]) -> Allowances:
    """What ``train.watchdog`` allows phases never seen (hy3rl.watchdog.Allowances); a
    first save: ``save_min``, else the checkpoint's size from preflight's disk estimate
    (plan.json ``checkpoint.bytes_per_checkpoint``) over ``storage_mb_s``; a first save's
    first byte ``first_byte_min``; the storage's rate ``storage_mb_s`` (with ``save_min``
    and a known size: the size over ``save_min``); the model load's ``load_quiet_s``
    (:func:`load_quiet`)."""
    from hy3rl.watchdog import Allowances

    per = (plan.get("checkpoint") or {}).get("bytes_per_checkpoint")
    rate = wd.storage_mb_s * 1e6
    if wd.save_min is not None:
        save_s = wd.save_min * 60
        if isinstance(per, (int, float)) and per > 0:
            rate = per / save_s
    elif isinstance(per, (int, float)) and per > 0:
        save_s = per / rate
    else:
        save_s = None
    return Allowances(startup_s=wd.startup_min * 60, step_s=wd.first_step_min * 60,
                      validation_s=None if wd.validation_min is None else wd.validation_min * 60,
                      save_s=save_s, shutdown_s=wd.shutdown_min * 60,
                      startup_floor_s=wd.startup_floor_min * 60,
                      startup_cap_s=wd.stall_cap_min * 60,
                      stall_floor_s=wd.stall_floor_min * 60,
                      first_byte_s=wd.first_byte_min * 60, save_rate_b_s=rate,
                      load_quiet_s=load_quiet(wd, plan))


def load_quiet(wd: Any, plan: Mapping[str, Any]) -> float:
    """The model load's limit without progress on any node (hy3rl.watchdog.load_stuck):
    ``load_quiet_min``, or longer when the largest tensor of the model (its safetensors
    headers, ``plan.json`` ``verl_checks.model_dir``) read at ``storage_mb_s`` takes more
    than a tenth of it (one tensor is the longest a load goes without a new page)."""
    floor = wd.load_quiet_min * 60
    if floor <= 0:
        return 0.0  # disabled
    model = (plan.get("verl_checks") or {}).get("model_dir")
    largest = _largest_tensor(str(model)) if model else 0
    return max(floor, LOAD_TENSOR_SLACK * largest / (wd.storage_mb_s * 1e6))


@functools.cache
def _largest_tensor(model_dir: str) -> int:
    """Bytes of the largest tensor of a model directory (its safetensors headers), read
    once per directory: the time model is rebuilt at every attempt of a job."""
    from hy3rl.checkpoint import read_header

    shards = sorted(Path(model_dir).glob("*.safetensors"))
    return max((t.nbytes for sh in map(read_header, shards) for t in sh.tensors.values()),
               default=0)


def time_left(job_id: str | None) -> float | None:
    """Seconds until SLURM ends this job (``inf``: no limit); None without SLURM or when
    squeue cannot tell."""
    from hy3rl.watchdog import slurm_time_left

    return slurm_time_left(job_id) if job_id else None


def run_metrics(layout: Layout) -> list[dict[str, Any]]:
    """This run's metrics so far, merged (their measured times feed the watchdog); none
    when a log cannot be read (the merge after the attempt names the line)."""
    try:
        return merged_attempts(Path(layout.train_attempts),
                               lineage_first_attempt(layout.checkpoint_dir),
                               lineage_cuts(layout.checkpoint_dir))
    except StageError as exc:
        log.warning("measured times unavailable: %s", exc)
        return []


def job_name() -> str:
    """This job in job-exit.json: the SLURM job id, ``local-<pid>`` on one machine."""
    return os.environ.get("SLURM_JOB_ID") or f"local-{os.getpid()}"


def write_job_exit(layout: Layout, job: str, attempts: list[int], step: JobStep | None,
                   reason: str, nodes_needed: int | None = None) -> None:
    """``train/attempts/job-exit.json`` (docs/formats/train.md): read by the controller
    before it resubmits (hy3rl.resubmit)."""
    write_json_atomic(Path(layout.train_job_exit), {
        "job": job, "ended_at": utc_now(), "attempts": attempts,
        "retry": bool(step and step.retry), "reason": step.reason if step else reason,
        "exclude": list(step.exclude) if step else [],
        # what the controller needs to tell whether enough nodes are left to exclude from
        "partition": os.environ.get("SLURM_JOB_PARTITION"), "nodes_needed": nodes_needed})


def keys_digest(config: Mapping[str, Any], final: bool,
                content: Mapping[str, str] | None = None) -> str:
    """The first 16 hex digits of the sha256 of the training keys
    (:func:`hy3rl.identity.train_keys_params`) of rule train (``final``) or of every segment
    (their common keys: a segment's end is in its record's name, Layout.train_keys). Pure
    and cheap: computed while the DAG is built, it names the record a training job writes
    when it succeeded, a target of ``all``. ``content``: the file contents' part of the keys
    (:func:`hy3rl.identity.content_triggers`), computed here when None."""
    from hy3rl.identity import train_keys_params

    text = train_keys_params(config, "final" if final else "segment", content)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def keys_record(layout: Layout, stretch: str, config: Mapping[str, Any],
                content: Mapping[str, str] | None = None) -> Path:
    """The keys record of job ``stretch`` under the current training keys."""
    return Path(layout.train_keys(stretch, keys_digest(config, stretch == "final", content)))


def record_keys(layout: Layout, stretch: str, path: Path, config: Mapping[str, Any], *,
                adopted: Mapping[str, Any] | None = None) -> None:
    """Training job ``stretch`` (``final`` or ``step<N>``) succeeded: write its keys record
    ``path`` (``Layout.train_keys(stretch, keys_digest(...))``: the training keys it trained
    under, one ``key=value`` a line; ``origin: trained``), and remove the records of the
    stretch's other keys, which no longer describe its sentinel, so returning to those
    values runs the job again. Only a training job that ran changes these records: a change
    refused by preflight changes none, and restoring the values it changed finds the record
    still there and submits nothing (docs/formats/train.md). With ``adopted`` (rule
    train_adopt, :func:`adopt`: :meth:`Adoption.record`) nothing was trained: the record
    says ``origin: adopted`` and, under ``adopted``, what vouched for the sentinel."""
    from hy3rl.identity import train_keys_params

    path = Path(path)
    for old in remove_siblings(path, Path(layout.train_keys(stretch, "*")).name):
        log.info("training keys record %s removed: job %s trained under other keys",
                 old.name, stretch)
    doc: dict[str, Any] = {"stretch": stretch, "written_at": utc_now(),
                           "origin": "adopted" if adopted else "trained",
                           "values": train_keys_params(config, stretch).splitlines()}
    if adopted:
        doc["adopted"] = dict(adopted)
    write_json_atomic(path, doc)


@dataclass(frozen=True)
class Adoption:
    """Job ``stretch``'s sentinel was written under the current training keys before a keys
    record of them existed: ``vouching``, an older record of the stretch (the keys file of
    the older rule train_keys, written before the job; or a record named by the digest of
    an older set of training keys, written after it) holds every current training key
    with its current value, except ``unseen``: file contents (``hy3rl.identity.content_stats``)
    the older record did not count, none of whose files changed after the sentinel was
    written."""

    stretch: str
    sentinel: Path
    vouching: Path
    unseen: tuple[str, ...]
    # set when the run identity vouched (the checkpoint directory's identity file): the
    # trajectory computed on the submit host
    trajectory_id: str | None = None

    def record(self, decision: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The keys record's ``adopted`` entry."""
        note = ("no training job ran: the launch's trajectory, computed on the submit host, "
                f"is the checkpoint directory's ({self.trajectory_id}) and its steps are "
                "reached; the training keys changed only in how the configuration spells it"
                if self.trajectory_id else
                "no training job ran: the sentinel was written under these training keys, by "
                "a job that wrote no record of them")
        return {"sentinel": str(self.sentinel), "vouching_record": str(self.vouching),
                "unseen_keys": list(self.unseen), "identity_decision": dict(decision or {}),
                "trajectory_id": self.trajectory_id, "note": note}


def _older_record(layout: Layout, stretch: str, current: Path,
                  sentinel: Path) -> tuple[Path, list[str]] | None:
    """The newest older record of job ``stretch`` that vouches for ``sentinel`` and its
    values: the older rule train_keys' file only when written before the sentinel (the job
    ran after it), a digest-named one only when written after it (the job writes it last);
    None when there is none or it does not parse."""
    pattern = Path(layout.train_keys(stretch, "*"))
    legacy = Path(layout.train_keys_legacy(stretch))
    found = [p for p in pattern.parent.glob(pattern.name) if p != current]
    found += [legacy] if legacy.is_file() else []
    if not found:
        return None
    newest = max(found, key=lambda p: p.stat().st_mtime_ns)
    made = sentinel.stat().st_mtime_ns
    if (newest == legacy) != (newest.stat().st_mtime_ns <= made):
        return None
    try:
        values = json.loads(newest.read_text())["values"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(values, list) and all(isinstance(v, str) for v in values)):
        return None
    return newest, values


def launch_of(layout: Layout, config: Mapping[str, Any]) -> Callable[[], Any]:
    """``config`` typed with the trajectory preflight would give its launch now
    (``hy3rl.preflight.launch_trajectory``: a composition of the pinned verl's config),
    computed at the first call and kept: one composition for every stretch whose adoption
    asks (:func:`adoption`). ``(Config, trajectory)``, or None when the config does not
    validate (Snakemake's own validation names it) or the launch gives no trajectory."""
    import functools

    from hy3rl.preflight import launch_trajectory
    from hy3rl.settings import Config

    @functools.cache
    def launch() -> tuple[Config, dict] | None:
        try:
            cfg = Config.from_dict(config)
        except Exception:
            return None
        trajectory = launch_trajectory(cfg, layout)
        return None if trajectory is None else (cfg, trajectory)

    return launch


def adoption(layout: Layout, stretch: str, config: Mapping[str, Any],
             content: Mapping[str, str] | None = None,
             launch: Callable[[], Any] | None = None) -> Adoption | None:
    """Whether job ``stretch`` (``final`` or ``step<N>``) is done under the current training
    keys although their record is missing (:class:`Adoption`), read from files while the DAG
    is built, nothing written. Its sentinel exists, and either the newest older record of the
    stretch vouches for it (:func:`_older_record`) and holds each current training key
    (``hy3rl.identity.train_keys_params``) with its current value (a key it does not hold at
    all is accepted only for a file content, code that did not count contents, when no file
    of it was modified after the sentinel; a key it holds that is no longer a training key,
    ``train.on_config_change`` or an operational knob, is ignored), or the launch's trajectory
    computed now on the submit host (:func:`_same_launch`) is the checkpoint directory's with
    the job's steps reached: keys that changed only in how they are spelled (a knob set to
    the value verl already reads, a value moved between a knob and an override, an
    interpolation, ``train.segment_steps``). None: the job runs, as for any missing record.
    ``content`` as for :func:`keys_digest`; ``launch``: :func:`launch_of` (made here when
    None; one shared by the stretches of a DAG build composes once)."""
    current = keys_record(layout, stretch, config, content)
    sentinel = Path(layout.stretch_sentinel(stretch))
    if current.exists() or not sentinel.is_file():
        return None
    return (_vouched(layout, stretch, config, content, current, sentinel)
            or _same_launch(layout, stretch, sentinel, launch or launch_of(layout, config)))


def _vouched(layout: Layout, stretch: str, config: Mapping[str, Any],
             content: Mapping[str, str] | None, current: Path,
             sentinel: Path) -> Adoption | None:
    """:func:`adoption` by an older record holding the current values."""
    from hy3rl.identity import content_stats, train_keys_params

    older = _older_record(layout, stretch, current, sentinel)
    if older is None:
        return None
    vouching, values = older
    held = {v.partition("=")[0]: v for v in values}
    unseen = []
    files: dict[str, tuple[Path, ...]] | None = None
    for line in train_keys_params(config, stretch, content).splitlines():
        key = line.partition("=")[0]
        if held.get(key) == line:
            continue
        if key in held:
            return None
        if files is None:
            files = {k: f for k, (_, f) in content_stats(config).items()}
        if key not in files:
            return None
        made = sentinel.stat().st_mtime_ns
        if any(not f.exists() or f.stat().st_mtime_ns > made for f in files[key]):
            return None
        unseen.append(key)
    return Adoption(stretch, sentinel, vouching, tuple(unseen))


# Preflight's decisions under which a finished stretch has nothing to train: the same
# trajectory, under the same or (a segment of a run since extended) a larger total.
NOTHING_TO_TRAIN = ("same", "extend")


def stretch_end(stretch: str, total: int) -> int:
    """The last step of job ``stretch``: the total for ``final``, else N of ``step<N>``."""
    return int(total) if stretch == "final" else int(stretch.removeprefix("step"))


def _same_launch(layout: Layout, stretch: str, sentinel: Path,
                 launch: Callable[[], Any]) -> Adoption | None:
    """:func:`adoption` by the run identity: the trajectory preflight would give the launch
    now (``launch``, :func:`launch_of`: composed on the submit host only in this case, a
    finished stretch whose keys changed) against the checkpoint directory's identity
    (``hy3rl.ckptdir.decide_identity``): ``same`` (or ``extend``) with the newest complete
    checkpoint at or past the stretch's end. Rule train_adopt checks preflight's own
    decision again once preflight ran."""
    from hy3rl.ckptdir import CheckpointDirError, decide_identity, identity_path

    ckpt_dir = layout.checkpoint_dir
    if not identity_path(ckpt_dir).is_file():
        return None
    got = launch()
    if got is None:
        return None
    cfg, trajectory = got
    total = cfg.train.total_training_steps
    try:
        decision = decide_identity(ckpt_dir, trajectory, total, cfg.train.on_config_change)
    except CheckpointDirError:
        return None
    end = stretch_end(stretch, total)
    if decision.action not in NOTHING_TO_TRAIN or decision.newest_step < end:
        return None
    return Adoption(stretch, sentinel, identity_path(ckpt_dir), ("trajectory",),
                    trajectory_id=str(trajectory.get("id")))


def adopt(layout: Layout, stretch: str, path: Path, config: Mapping[str, Any],
          plan: Path) -> Adoption:
    """Rule train_adopt: job ``stretch``'s keys record ``path`` for a sentinel written under
    the current training keys before their record existed (:func:`adoption`, asked again
    now), written with ``origin: adopted`` in place of running the job. Preflight's run
    identity decision in ``plan`` (the plan the job would run) must be ``same`` with the
    newest complete checkpoint at the job's end: the checkpoints were made under this
    trajectory and nothing is left to train. Raises :class:`TrainError` otherwise, naming
    why and the older record to remove so that the job runs; nothing is written then."""
    path = Path(path)
    found = adoption(layout, stretch, config)
    if found is None or keys_record(layout, stretch, config) != path:
        raise TrainError(f"{path}: not adopted: the training keys or the files they count "
                         "changed since the DAG was built; run again")
    doc = read_plan(Path(plan))
    identity = doc.get("identity") or {}
    decision = identity.get("decision") or {}
    end = stretch_end(stretch, int(identity.get("total_training_steps") or 0))
    newest = decision.get("newest_step")
    action = decision.get("action")
    if action not in NOTHING_TO_TRAIN or not isinstance(newest, int) or newest < end:
        undo = ("run again: the configuration or a file upstream of preflight changed "
                "during this invocation, and the job is then planned"
                if found.trajectory_id else
                f"remove {found.vouching} to let the training job run")
        raise TrainError(
            f"{path}: not adopted: preflight's run identity decision in {plan} is "
            f"{action!r} with the newest complete checkpoint at {newest}, not 'same' (or "
            f"'extend') at step {end}, so {found.sentinel} does not describe what the job "
            "would do; " + undo)
    record_keys(layout, stretch, path, config,
                adopted=found.record({"action": action, "newest_step": newest}))
    log.info("training keys record %s adopted: %s was written under these keys", path.name,
             found.sentinel)
    return found


def legacy_keys_input(layout: Layout, stretch: str,
                      recorded: Sequence[str] | None) -> dict[str, str]:
    """``{"legacy_keys": <train/keys/<stretch>.json>}`` when Snakemake's record of the job's
    sentinel lists that file, the older rule train_keys' output, among the job's inputs
    (``recorded``), else nothing. Kept as an (ancient) input while the record lists it, so
    that the job's input set is the one recorded and Snakemake's ``input`` rerun trigger does
    not re-run a finished training job after the rule went away."""
    legacy = layout.train_keys_legacy(stretch)
    return {"legacy_keys": legacy} if legacy in (recorded or ()) else {}


def stage_launch(plan: Path, launch: Path, out_plan: Path, out_launch: Path) -> None:
    """Rule train_launch: copy preflight's plan and launch to where the training jobs read
    them (``Layout.train_plan``, ``Layout.train_launch``). A failed preflight's outputs are
    deleted by Snakemake; these copies are not, so a training job's (ancient) inputs still
    exist after a refusal and the next invocation re-runs training only when its keys
    changed (its keys record is missing: :func:`record_keys`), not because preflight failed
    once."""
    for src, dest in ((Path(plan), Path(out_plan)), (Path(launch), Path(out_launch))):
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, dest)


def run(train: Train, cluster: Cluster, layout: Layout, *, keep_steps: Protected,
        plan: Path, launch_script: Path, runtime_env: Path, sentinel: Path,
        metrics: Path, until: int | None = None, kill_after: int | None = None,
        rehearsed: Mapping[str, Any] | None = None) -> None:
    """The training job (see the module doc) of run ``layout.run`` on the checkpoint
    directory ``layout.checkpoint_dir``, its records under ``layout.train_attempts``: one
    attempt, then restarts in this allocation after a failure (``train.restarts_per_job``;
    :func:`after_attempt`), each a new attempt record.

    Inputs: ``plan`` (preflight/plan.json), ``launch_script`` (preflight/launch.sh),
    ``runtime_env`` (deps/runtime_env.yaml). Outputs: ``metrics`` (train/metrics.jsonl, the
    merge of every attempt's log, rewritten after every attempt) and, written last once the
    newest complete checkpoint is the attempt's last step, ``sentinel`` (done.json, or a
    segment's ``segments/step<N>.json``). ``until``: a segment's last step (the launch gets
    ``trainer.total_training_steps=<until>`` appended); None runs to the plan's total.
    ``keep_steps``: the steps retention never prunes, or a callable asked at every pass
    (``hy3rl.evalckpt.protector``: what evaluation has not finished reading).
    Before each attempt starts the trainer, the checkpoint directory's run identity is
    checked against the plan's (``hy3rl.ckptdir.decide_identity``) and written: another
    trajectory is refused unless ``train.on_config_change`` chose otherwise. With W&B on,
    every attempt logs into the one run ``<run.name>-<trajectory id[:8]>``
    (``WANDB_RUN_ID``, ``WANDB_RESUME=allow``; files under ``train/wandb``). As the job ends
    it writes ``job-exit.json`` (whether a resubmission may help, nodes to exclude).

    Raises :class:`LockHeld` while another live trainer holds the checkpoint directory,
    :class:`TrainFailed` when the job ended early (the records say why), and
    :class:`TrainError` for a bad input.

    ``kill_after`` (the rehearsal, hy3rl.rehearsal): the first attempt's trainer is launched
    to end at step ``kill_after`` (``trainer.total_training_steps``, verl saving its last
    step), killed once that step's line is logged and its checkpoint complete, or recorded
    the same way (``planned_kill``) when it exits first with that checkpoint its newest;
    the next attempt resumes from it. The step is the product's, whatever the timing.
    ``rehearsed``: the runtime identity the rehearsal passed in (rehearsal.json); a job
    whose runtime identity differs refuses to start the trainer (TrainError)."""
    # Absolute paths: the Ray job runs in the verl clone, the node steps wherever srun puts
    # them.
    layout = dataclasses.replace(layout, results_root=os.path.abspath(layout.results_root))
    Path(layout.train_attempts).mkdir(parents=True, exist_ok=True)
    metrics = Path(os.path.abspath(metrics))
    plan_path = Path(plan).resolve()
    ckpt = layout.checkpoint_dir
    try:
        plan_doc = read_plan(plan_path)
        total = total_steps_from_plan(plan_doc, plan_path)
        if not (plan_doc.get("identity") or {}).get("trajectory"):
            raise TrainError(f"{plan_path}: no run identity (identity.trajectory): the plan "
                             "was made by an older preflight; rerun preflight")
        planned = (plan_doc.get("checkpoint") or {}).get("dir")
        if planned and os.path.abspath(planned) != str(ckpt):
            raise TrainError(f"{plan_path}: checkpoint.dir {planned} differs from the run's "
                             f"checkpoint directory {ckpt} (train.checkpoint_root/run.name); "
                             "rerun preflight")
    except TrainError as exc:  # a resubmission cannot fix a bad input
        write_job_exit(layout, job_name(), [], None, f"{exc}")
        raise
    job = Job(train, cluster, layout, plan_doc, target=total if until is None
              else min(int(until), total), total=total, keep_steps=keep_steps,
              launch_script=Path(launch_script).resolve(),
              runtime_env=Path(runtime_env).resolve(), metrics=metrics,
              kill_after=kill_after, rehearsed=rehearsed)
    k = (attempt_numbers(layout) or [0])[-1] + 1
    me = my_lock_info(k)
    job.lock_actions = acquire_lock(ckpt, me)
    step: JobStep | None = None
    try:
        best = newest_complete(scan(ckpt))
        finalise_stale(layout, best.step if best else None)
        while True:
            rec = job.attempt(k, me)
            if rec is None or rec["outcome"] == "succeeded":
                job.finish(sentinel)
                write_job_exit(layout, job_name(), job.attempts, None, "finished")
                return
            records = [load_attempt(layout, i) for i in attempt_numbers(layout)]
            job.lost += [n for n in rec.get("lost_nodes") or [] if n not in job.lost]
            step = after_attempt(
                rec, records, restarts_left=train.restarts_per_job - (len(job.attempts) - 1),
                lost=job.lost, allocation=job.allocation or rec.get("nodes") or [],
                nodes_needed=cluster.nodes, time_left=time_left(me.job_id),
                interval=job.restart_need(), attempts_dir=layout.train_attempts)
            if not step.retry and rec["outcome"] not in ("refused", "cancelled", UNHEALTHY) \
                    and not rec.get("disk_full"):
                rec["crash_loop"] = step.reason
                write_json_atomic(Path(layout.attempt_record(k)), rec)
            if not step.restart:
                break
            if rec["outcome"] == "planned_kill":
                log.info("attempt %d: %s; resuming in this allocation", k, rec["exit_reason"])
            else:
                log.info("attempt %d: %s; restarting in this allocation (restart %d of %d)",
                         k, rec["exit_reason"], len(job.attempts), train.restarts_per_job)
            k += 1
        write_job_exit(layout, job_name(), job.attempts, step, "", cluster.nodes)
        raise TrainFailed(f"{step.reason}; newest complete checkpoint "
                          f"{job.end_step}; logs in {layout.attempt_logs(k)}"
                          + ("" if step.retry else "; not resubmitted"), 1)
    except TrainFailed:
        raise
    except BaseException as exc:
        job.close_running(exc)
        with contextlib.suppress(Exception):
            if not isinstance(exc, LockHeld):
                write_job_exit(layout, job_name(), job.attempts, None,
                               f"the job ended on an error: {exc}")
        raise
    finally:
        release_lock(ckpt, me)


@dataclass
class Job:
    """One training job (SLURM allocation or local run) and its attempts."""

    train: Train
    cluster: Cluster
    layout: Layout
    plan: Mapping[str, Any]
    target: int
    total: int
    keep_steps: Protected
    launch_script: Path
    runtime_env: Path
    metrics: Path
    lock_actions: list[str] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    allocation: list[str] = field(default_factory=list)
    excluded: list[str] | None = None
    runtime: dict[str, Any] | None = None
    rec: dict[str, Any] = field(default_factory=dict)  # the attempt running now
    end_step: int | None = None
    identity_action: str | None = None  # the last attempt's hy3rl.ckptdir decision
    kill_after: int | None = None  # the rehearsal's planned kill (first attempt only)
    rehearsed: Mapping[str, Any] | None = None  # the runtime identity the rehearsal passed in
    watcher: Watcher | None = None  # the health guard's, of the attempt running now
    hooks: list[threading.Thread] = field(default_factory=list)  # warn notifications

    @property
    def identity(self) -> dict[str, Any]:
        """plan.json ``identity`` (hy3rl.preflight.run_identity)."""
        return self.plan["identity"]

    @property
    def trajectory_id(self) -> str:
        return str(self.identity["trajectory"]["id"])

    def since(self) -> int:
        """The first attempt of the checkpoint directory's lineage (metrics merge)."""
        return lineage_first_attempt(self.layout.checkpoint_dir)

    def cuts(self) -> list[tuple[int, int]]:
        """The lineage's rewinds (metrics merge: hy3rl.ckptdir.lineage_cuts)."""
        return lineage_cuts(self.layout.checkpoint_dir)

    # ---------------------------------------------------------------- the health guard

    def lineage_watcher(self) -> Watcher:
        """``train.health``'s watcher fed the lineage's merged logs so far (baselines, the
        best so far; their events are history: nothing acts on them)."""
        watcher = Watcher(self.train.health, response_cap(self.plan))
        for line in run_metrics(self.layout):
            watcher.feed(line)
        return watcher

    def last_healthy(self) -> int | None:
        """The newest complete checkpoint whose steps passed every stop rule
        (hy3rl.health.last_healthy over the watcher's events); None without a watcher."""
        if self.watcher is None:
            return None
        steps = [c.step for c in scan(self.layout.checkpoint_dir) if c.complete]
        return last_healthy(steps, list(self.watcher.events))

    def protected(self) -> list[int]:
        """What retention keeps besides the newest: ``keep_steps`` (evaluation's) and the
        last healthy checkpoint once a stop rule fired in this lineage (kept until a later
        checkpoint is healthy: the rule's steps leave the lineage by a rewind), or while one
        may still fire over steps already logged (a run of crossed values under way: it may
        fire after the next save, its first step before it)."""
        keep = set(self.keep_steps() if callable(self.keep_steps) else self.keep_steps)
        w = self.watcher
        if w is None:
            return sorted(keep)
        events, opened = list(w.events), w.open_from()
        steps = [c.step for c in scan(self.layout.checkpoint_dir) if c.complete]
        try:  # the guard's thread adds records meanwhile
            seen = max(list(w.records), default=None)
        except RuntimeError:  # changed while read: prune nothing this pass
            return sorted(keep | set(steps))
        # verl logs a step's metrics after its save: a checkpoint whose step the guard has
        # not judged yet is not known healthy, so the newest judged healthy one stays until
        # it is (else a drift starting at a save could leave no healthy checkpoint)
        judged = [s for s in steps if seen is not None and s <= seen]
        best = last_healthy(judged, events, opened)
        if best is not None:
            keep.add(best)
        return sorted(keep)

    def on_health(self, record: Path, event: Event) -> None:
        """An event of this attempt: in its record at once; a ``warn`` logged and passed to
        ``train.notify_command`` (the record's path appended, as hy3rl.notify runs it)."""
        self.rec.setdefault("health", []).append(dataclasses.asdict(event))
        write_json_atomic(record, self.rec)
        (log.warning if event.action == "warn" else log.error)("%s", event.message)
        if event.action == "warn" and self.train.notify_command:
            from hy3rl.notify import run_hook

            hook = threading.Thread(target=run_hook, daemon=True, name="health-notify",
                                    args=(self.train.notify_command, record.resolve(),
                                          Path(self.layout.log("notify"))))
            hook.start()
            self.hooks.append(hook)

    def health_stop(self, event: Event, after_save: int | None,
                    ended: str | None = None) -> dict[str, Any]:
        """The record's ``health_stop``: the event, the last healthy checkpoint and how to go
        on from it (docs/formats/train.md "Training health"). ``ended``: how the trainer
        ended, when not by the guard's stop."""
        ckpt = self.layout.checkpoint_dir
        best = self.last_healthy()
        when = stopped_when(event.rule, after_save, stop_when(self.train.health, event.rule))
        stopped = ended or f"the trainer was stopped {when}"
        if best is None:
            where = ("none (no complete checkpoint was saved before the one the rule's first "
                     "step describes)")
        else:
            where = f"step {best} ({ckpt / f'global_step_{best}'})"
        how = how_to_go_on(best)
        values = ", ".join(f"{v}@{s}" for s, v in event.values)
        message = (f"unhealthy: health rule {event.rule} ({event.metric}) fired at step "
                   f"{event.step} (from step {event.first_step}; values {values}); "
                   f"{stopped}; last healthy checkpoint: {where}; {how}")
        return {**dataclasses.asdict(event), "stopped_after_save": after_save,
                "last_healthy_step": best,
                "last_healthy_checkpoint": None if best is None
                else str(ckpt / f"global_step_{best}"),
                "how_to_go_on": how, "message": message, "event_message": event.message}

    def check_healthy_start(self, start: int) -> None:
        """Refuse to resume from a checkpoint that a stop rule calls sick (a rerun after an
        ``unhealthy`` stop, without a rewind; hy3rl.health.describes_checkpoint), naming the
        way on."""
        assert self.watcher is not None
        broken = [e for e in self.watcher.events if e.action == "stop"
                  and describes_checkpoint(e.metric, e.first_step) <= start]
        if broken:
            stop = self.health_stop(broken[0], None)
            raise TrainError(f"the newest complete checkpoint, step {start}, was trained "
                             f"through steps where {broken[0].message}; last healthy "
                             f"checkpoint: step {stop['last_healthy_step']}; "
                             f"{stop['how_to_go_on']}")

    def check_clones(self) -> None:
        """Each pinned clone is as preflight saw it (plan.json ``pins``: HEAD and the sha256
        of its local changes, which the run identity counts): a clone edited since (a patched
        file, an added one) would run code no record names. A difference raises TrainError
        (a bad input: not resubmitted) naming the clone and its files."""
        from hy3rl.deps import tree_state

        for name, seen in sorted((self.plan.get("pins") or {}).items()):
            now = tree_state(Path(seen["path"]))
            if (now["head"], now["diff_sha256"]) != (seen.get("head"), seen.get("diff_sha256")):
                shown = ", ".join(now["changes"][:10]) or "no local changes now"
                raise TrainError(
                    f"pinned clone {name} ({seen['path']}) changed since preflight: HEAD "
                    f"{now['head']} (preflight saw {seen.get('head')}), local changes "
                    f"{now['diff_sha256'] or 'none'} (preflight saw "
                    f"{seen.get('diff_sha256') or 'none'}): {shown}. Restore it, or run "
                    f"preflight again (snakemake reruns it when the config changes; "
                    f"`-R preflight` otherwise)")

    def check_identity(self, k: int) -> list[str]:
        """Before attempt ``k`` starts the trainer: the checkpoint directory's identity
        against the plan's; a refusal raises TrainError (a bad input: not resubmitted),
        anything else is carried out and written (hy3rl.ckptdir.apply_identity)."""
        self.check_clones()
        ckpt = self.layout.checkpoint_dir
        d = decide_identity(ckpt, self.identity["trajectory"], self.total,
                            self.train.on_config_change)
        if d.error:
            raise TrainError(f"run identity: {d.error}")
        self.identity_action = d.action
        return apply_identity(ckpt, d, self.identity["trajectory"], self.total,
                              self.train.segment_steps, attempt=k)

    def plan_int(self, key: str) -> int:
        try:
            return int(plan_value(self.plan, key) or -1)
        except (TypeError, ValueError):
            return -1

    @property
    def save_freq(self) -> int:
        return self.plan_int("trainer.save_freq")

    def schedule(self, last: int | None = None) -> Schedule:
        """verl's schedule of a trainer run ending at ``last`` (default: this job's last
        step)."""
        from hy3rl.watchdog import Schedule

        return Schedule(self.save_freq, self.plan_int("trainer.test_freq"),
                        self.target if last is None else last)

    def time_model(self) -> TimeModel:
        """The run's time model (hy3rl.watchdog) from its records so far: the metrics lines,
        the startups and the saves seen writing of every attempt of the lineage (a hung
        attempt's complete saves too)."""
        from hy3rl.watchdog import TimeModel

        records = [load_attempt(self.layout, k) for k in attempt_numbers(self.layout)
                   if k >= self.since()]
        timings = [r.get("timing") or {} for r in records]
        ok = [t for t in timings if isinstance(t.get("startup_s"), (int, float))]
        return TimeModel.learn(
            allowances(self.train.watchdog, self.plan), run_metrics(self.layout),
            [t["startup_s"] for t in ok],
            startup_marks=[t["startup_marks"] for t in ok
                           if isinstance(t.get("startup_marks"), dict)],
            save_marks=[m for t in timings if isinstance(t.get("saves"), list)
                        for m in t["saves"] if isinstance(m, dict)])

    def restart_need(self) -> float | None:
        """Seconds a restart in this allocation needs before its first save: a startup,
        then the work until the next save after the newest complete checkpoint, plus the
        margin; None when it cannot be told (no save schedule)."""
        model = self.time_model()
        best = newest_complete(scan(self.layout.checkpoint_dir))
        need = model.until_save(best.step if best else 0, self.schedule())
        if need is None:
            return None
        return model.startup()[0] + need + self.train.time_limit_margin_min * 60

    def attempt(self, k: int, me: LockInfo) -> dict[str, Any] | None:
        """Run attempt ``k``; its closed record, or None when training is already done."""
        from hy3rl import launch, runtime_id
        from hy3rl.watchdog import Deadline, Monitor, StallPolicy

        layout, ckpt, train, cluster = self.layout, self.layout.checkpoint_dir, self.train, \
            self.cluster
        identity_actions = self.check_identity(k)
        start, resume_actions = prepare_resume(ckpt, k)
        resume_actions = identity_actions + resume_actions
        if start >= self.target:
            log.info("training already reached step %d (this job's last step %d, total %d): "
                     "nothing to launch", start, self.target, self.total)
            return None
        self.watcher = self.lineage_watcher()
        self.check_healthy_start(start)
        if self.runtime is None:
            runtime: dict[str, Any] = dict(launch.resolve_runtime(train.runtime))
            runtime["identity"] = runtime_id.identify(runtime["prefix"], runtime["python"],
                                                      cache=Path(layout.runtime_id_cache))
            runtime["ray"] = None  # filled once the Ray head runs (launch.Launcher.check_ray)
            self.runtime = runtime
            self.check_rehearsed(runtime["identity"])
            self.excluded = sbatch_excluded(me.job_id)
            restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
            if restarts not in ("", "0"):
                resume_actions.append(f"SLURM requeued job {me.job_id} ({restarts} time(s): "
                                      "preempted, or a node failed) and it resumes here")
        runtime = json.loads(json.dumps(self.runtime))
        log.info("attempt %d: runtime %s", k, runtime["identity"]["id"])
        sub_id = f"{layout.run}-{me.job_id or 'local'}-{k}"
        attempt_metrics = Path(layout.attempt_metrics(k))
        log_dir = Path(layout.attempt_logs(k))
        record = Path(layout.attempt_record(k))
        attempt = AttemptRecord(
            attempt=k, run=layout.run, executor=me.executor, slurm_job_id=me.job_id,
            host=me.host, nodes=[], num_nodes=cluster.nodes,
            gpus_per_node=cluster.gpus_per_node, cpus_per_node=cluster.cpus_per_node,
            submission_id=sub_id, checkpoint_dir=str(ckpt), start_step=start,
            resume_actions=(self.lock_actions if not self.attempts else []) + resume_actions,
            metrics_log=attempt_metrics.name, log_dir=log_dir.name, runtime=runtime,
            job_attempt=len(self.attempts) + 1, trajectory_id=self.trajectory_id,
            total_training_steps=self.total, identity_action=self.identity_action,
            selection=self.plan.get("selection"),
            excluded_nodes=sorted(set(self.excluded or []) | set(self.lost)))
        rec = self.rec = dataclasses.asdict(attempt)
        self.attempts.append(k)
        write_json_atomic(record, rec)
        # The rehearsal's planned kill (first attempt only): the attempt's trainer ends at
        # step kill_after by verl's own schedule (trainer.total_training_steps, saved at its
        # last step), so no timing lets it train past the step the kill is planned after.
        kill_at = self.kill_after if (self.kill_after is not None
                                      and start < self.kill_after < self.target) else None
        self.kill_after = None  # planned for the first attempt only
        last = self.target if kill_at is None else kill_at
        log.info("attempt %d: submission %s, checkpoint dir %s, start step %d, until step "
                 "%d of %d%s", k, sub_id, ckpt, start, last, self.total,
                 "" if kill_at is None else " (the planned kill after its save)")

        wd = train.watchdog
        monitor = Monitor(
            metrics=attempt_metrics, schedule=self.schedule(last), model=self.time_model(),
            stall=StallPolicy(None if wd.stall_min is None else wd.stall_min * 60,
                              wd.stall_factor, wd.stall_floor_min * 60, wd.stall_cap_min * 60),
            margin_s=train.time_limit_margin_min * 60,
            is_saved=lambda s: check_complete(ckpt / f"global_step_{s}", s)[0],
            deadline=Deadline(lambda: time_left(me.job_id)), ckpt_dir=ckpt, start_step=start,
            kill_after=kill_at, logs=[log_dir / "driver.log"],
            silence_s=wd.silence_min * 60 or None, progress_dir=log_dir / PROGRESS_DIR)
        guard = Guard(self.watcher, monitor,
                      on_event=lambda event: self.on_health(record, event),
                      next_save=lambda s: self.schedule(last).next_save(s - 1),
                      is_saved=monitor.is_saved)
        cpu_path = self.plan.get("cpu_path")  # hy3rl.verl_cpu: one host, logical GPUs
        spec = launch.LaunchSpec(
            submission_id=sub_id, launch_script=self.launch_script,
            runtime_env=self.runtime_env, log_dir=log_dir,
            launch_args=[] if last == self.total
            else [f"trainer.total_training_steps={last}"],
            env_vars={"VERL_FILE_LOGGER_PATH": str(attempt_metrics),
                      **(cpu_path or {}).get("env", {})},
            passthrough_env=sorted(set(logger_env_names(self.plan))
                                   | set(train.ray_env_passthrough)),
            nodes=1 if cpu_path else cluster.nodes,
            gpus_per_node=int(cpu_path["ranks"]) if cpu_path else cluster.gpus_per_node,
            cpus_per_node=cluster.cpus_per_node, ray=train.ray, runtime=train.runtime,
            exclude=list(self.lost), monitor=guard, poll_s=wd.poll_s,
            progress_every_s=wd.node_report_s,
            node_logs_mb=train.node_logs_mb,
            ray_cpus=int(cpu_path["ray_cpus"]) if cpu_path else None)
        spec.env_vars.update(self.wandb_env())
        pruner = Pruner(ckpt, train.checkpoint_keep, self.protected, train.prune_interval_s)
        pruner.start()
        signal_outcome: list[str] = []
        try:
            result = launch.launch(
                spec, on_nodes=lambda nodes: self.on_nodes(record, nodes),
                on_stop=lambda reason: signal_outcome.append(
                    self.on_signal(record, reason, me.job_id)),
                on_ray=lambda versions: _record_ray(record, rec, versions))
        finally:
            pruner.stop.set()
            pruner.join(timeout=30)
        if result.ray_versions:
            rec["runtime"]["ray"] = result.ray_versions
        # the lines the last poll did not see: a stop rule that fired as the trainer ended
        stopped = guard.finish()
        removed = prune(ckpt, train.checkpoint_keep, self.protected)
        best = newest_complete(scan(ckpt))
        self.end_step = best.step if best else None
        outcome = signal_outcome[0] if result.outcome == "signal" and signal_outcome \
            else result.outcome
        reason = result.reason
        if kill_at is not None and outcome in ("succeeded", "failed") \
                and self.end_step == kill_at and _last_logged(layout, k) == kill_at:
            # the trainer ended at its planned last step before the watchdog's stop landed:
            # the same planned end, the same checkpoint to resume from. One that then exited
            # with an error (its teardown: Ray actors, TransferQueue) is that too, the error
            # kept in the record (trainer_exit)
            if outcome == "failed":
                rec["trainer_exit"] = {"exit_code": result.exit_code, "reason": result.reason}
            outcome = "planned_kill"
            reason = (f"ended at step {kill_at}, its planned last step, with global_step_"
                      f"{kill_at} complete, before the watchdog stopped it (the rehearsal's "
                      "planned kill)" + ("" if "trainer_exit" not in rec else
                                         f"; the trainer then exited with an error "
                                         f"({result.reason})"))
        sick = stopped and outcome != "planned_kill"
        close_record(rec, layout, self.end_step, reason, result.exit_code)
        rec["timing"] = monitor.timing()
        self.describe(rec, outcome, result, log_dir)
        if sick and guard.stop is not None:
            ended = None if outcome == UNHEALTHY else (
                f"the trainer ended ({outcome}: {result.reason}) before the guard stopped it")
            rec["outcome"] = rec["exit_reason"] = outcome = UNHEALTHY
            rec["health_stop"] = self.health_stop(guard.stop, guard.stopped_after_save, ended)
            log.error("attempt %d: %s", k, rec["health_stop"]["message"])
        for hook in self.hooks:
            hook.join(timeout=1)
        self.hooks = [h for h in self.hooks if h.is_alive()]
        rec["wandb"] = self.wandb_record(spec.env_vars, log_dir / "driver.log")
        write_json_atomic(record, rec)
        n = write_merged(Path(layout.train_attempts), self.metrics, self.since(),
                         self.cuts())
        log.info("attempt %d: %s (%s, exit %s); newest complete checkpoint %s; %s steps lost; "
                 "%d merged metric lines; pruned %s", k, rec["exit_reason"], outcome,
                 result.exit_code, self.end_step, rec["steps_lost"], n,
                 sorted(pruner.removed + removed))
        if outcome == "succeeded" and (self.end_step is None or self.end_step < last):
            raise TrainError(f"the trainer exited 0 but the newest complete checkpoint is "
                             f"{self.end_step}, not step {last}")
        return rec

    def check_rehearsed(self, identity: Mapping[str, Any]) -> None:
        """The gate's last word, on the job's own host before the trainer starts: the runtime
        this job runs in is the one the rehearsal passed in (rehearsal.json)."""
        if self.rehearsed is None:
            return
        if identity.get("id") != self.rehearsed.get("id"):
            raise TrainError(
                f"runtime identity {identity.get('id')!r} differs from the one the rehearsal "
                f"passed in ({self.rehearsed.get('id')!r}, {self.layout.rehearsal_record}): "
                "the runtime changed since; rerun the rehearsal (snakemake --forcerun "
                "rehearsal) or set preflight.waive: [rehearsal]")

    def describe(self, rec: dict[str, Any], outcome: str, result: Any, log_dir: Path) -> None:
        """The record's outcome fields (docs/formats/train.md)."""
        rec["outcome"] = outcome
        rec["lost_nodes"] = list(result.lost_nodes)
        if outcome in ("failed", "hung", "launcher_error"):
            last = rec.get("last_logged_step")
            rec["failed_at_step"] = (last if last is not None else rec["start_step"]) + 1
            rec["error"] = last_error(log_dir / "driver.log")
            rec["disk_full"] = disk_full(log_dir / "driver.log", self.layout.checkpoint_dir)
        if outcome == "stopped_for_time_limit" and (rec.get("steps_lost") or
                                                    rec.get("end_step") != result.stop_step):
            # The trainer went on while it was being stopped: say what really happened.
            lost = rec.get("steps_lost") or 0
            rec["exit_reason"] = (f"stopped after the save of step {rec.get('end_step')} "
                                  f"before the time limit: {lost} steps lost (asked to stop "
                                  f"after the save of step {result.stop_step})")
        if outcome in ("time_limit", "preempted"):
            rec["exit_reason"] = f"{outcome.replace('_', ' ')} ({result.reason})"
        rec["diagnostics"] = result.diagnostics
        nodes_dir = log_dir / "nodes"
        root = Path(self.layout.train_attempts)
        rec["node_logs"] = {
            d.name: sorted(str(f.relative_to(root)) for f in d.rglob("*") if f.is_file())
            for d in sorted(nodes_dir.iterdir()) if d.is_dir()} if nodes_dir.is_dir() else {}

    def wandb_env(self) -> dict[str, str]:
        """W&B on (the plan's effective loggers): one run id for every attempt, and its files
        under train/wandb (the Ray job's working dir is removed with its session; a
        WANDB_DIR in train.ray_env_passthrough wins)."""
        from hy3rl import wandb_run

        env = wandb_run.env(self.layout.run, self.trajectory_id,
                            (self.plan.get("loggers") or {}).get("list") or [])
        if env:
            wandb_dir = Path(self.layout.train_dir) / "wandb"
            wandb_dir.mkdir(parents=True, exist_ok=True)
            env["WANDB_DIR"] = str(wandb_dir)
        return env

    def wandb_record(self, job_env: Mapping[str, str], driver_log: Path) -> dict | None:
        from hy3rl import wandb_run

        try:
            output = driver_log.read_text(errors="replace")[-2**20:]
        except OSError:
            output = ""
        project = plan_value(self.plan, "trainer.project_name")
        return wandb_run.record(job_env, str(project) if project else None, output)

    def on_nodes(self, record: Path, nodes: list[str]) -> None:
        if not self.allocation:
            self.allocation = list(nodes)
        _record_nodes(record, self.rec, nodes)

    def on_signal(self, record: Path, reason: str, job_id: str | None) -> str:
        """At a signal, record the attempt at once (SLURM kills KillWait seconds later)."""
        outcome = classify_signal(reason, job_id, time_left(job_id))
        best = newest_complete(scan(self.layout.checkpoint_dir))
        snapshot = close_record(dict(self.rec), self.layout, best.step if best else None,
                                reason, None)
        snapshot["outcome"] = outcome
        write_json_atomic(record, snapshot)
        return outcome

    def close_running(self, exc: BaseException) -> None:
        """The job is ending on an exception while an attempt is still recorded running."""
        rec = self.rec
        if not rec or rec.get("exit_reason") != "running":
            return
        reason = (f"launcher error: {exc}" if not isinstance(exc, KeyboardInterrupt)
                  else "signal SIGINT")
        best = newest_complete(scan(self.layout.checkpoint_dir))
        close_record(rec, self.layout, best.step if best else None, reason, 1)
        rec["outcome"] = "cancelled" if isinstance(exc, KeyboardInterrupt) else "launcher_error"
        write_json_atomic(Path(self.layout.attempt_record(rec["attempt"])), rec)
        with contextlib.suppress(Exception):
            write_merged(Path(self.layout.train_attempts), self.metrics, self.since(),
                         self.cuts())

    def finish(self, sentinel: Path) -> None:
        """Training reached this job's last step: merge, then the sentinel, written last."""
        best = newest_complete(scan(self.layout.checkpoint_dir))
        write_merged(Path(self.layout.train_attempts), self.metrics, self.since(),
                         self.cuts())
        write_done(self.layout, best.step if best else 0, self.total, sentinel, self.metrics,
                   trajectory_id=self.trajectory_id, this_job=self.attempts,
                   since=self.since())


def _record_ray(record: Path, rec: dict[str, Any], versions: dict[str, Any]) -> None:
    rec["runtime"]["ray"] = dict(versions)
    write_json_atomic(record, rec)


def _record_nodes(record: Path, rec: dict[str, Any], nodes: list[str]) -> None:
    rec["nodes"] = list(nodes)
    rec["num_nodes"] = len(nodes)
    write_json_atomic(record, rec)


def write_done(layout: Layout, final: int, total: int, path: Path, metrics: Path, *,
               trajectory_id: str | None = None, this_job: Sequence[int] = (),
               since: int = 1) -> Path:
    """The sentinel ``path``, written last: done.json, or a segment's
    ``segments/step<N>.json`` (same keys). ``this_job``: the attempts this job ran (none:
    the checkpoint directory already held the final step, and the record says that nothing
    was trained); ``since``: the lineage's first attempt (earlier ones trained checkpoints
    that a ``fresh`` start moved aside: listed apart)."""
    every = [load_attempt(layout, k) for k in attempt_numbers(layout)]
    attempts = [a for a in every if int(a.get("attempt") or 0) >= since]
    superseded = [a.get("attempt") for a in every if int(a.get("attempt") or 0) < since]
    ran = [a for a in attempts if a.get("attempt") in set(this_job)]
    trained = sorted({s for a in ran for s in range(int(a.get("start_step") or 0) + 1,
                                                      int(a.get("end_step") or 0) + 1)})
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
                       "steps_lost", "outcome", "exit_reason", "started_at", "ended_at",
                       "wall_s", "trajectory_id", "total_training_steps")}
                     for a in attempts],
        "steps_lost_total": sum(a.get("steps_lost") or 0 for a in attempts),
        "trajectory_id": trajectory_id,
        "trajectory_ids": sorted({a["trajectory_id"] for a in attempts
                                  if a.get("trajectory_id")}),
        "superseded_attempts": superseded,
        "this_job": {"attempts": list(this_job), "steps_trained": len(trained),
                     "note": (f"trained steps {trained[0]}-{trained[-1]}" if trained else
                              f"nothing trained: the checkpoint directory already held "
                              f"step {final}")},
        "metrics": str(Path(os.path.abspath(metrics))),
        "written_at": utc_now(),
    }
    path = Path(path)
    write_json_atomic(path, done)
    log.info("done: final step %d, %s", final, path)
    return path
