"""The launcher's eyes on a running attempt: a time model of the run, hangs, the time limit.

:class:`Monitor` is polled by the launcher (``hy3rl.launch``) every ``train.watchdog.poll_s``
seconds while the Ray job runs. It re-reads the attempt's metrics log (verl's ``file``
logger, one line per step), looks at the checkpoint being written, and answers with a
:class:`StopRequest` when the attempt must end.

**The time model** (:class:`TimeModel`). verl@220e903's v1 loop runs, for step ``s``: the
step's work; the save when ``s`` is a save step (``save_freq``, and the last step), inside
the ``step`` timer; then validation when ``s`` is a test step (``test_freq``, and the last
step), timed apart (``testing``); then it logs the line of step ``s``. Before the first
line of an attempt lie the startup (Ray job start, model loads, optimizer state on resume,
the validation before training); after the line of the attempt's last step, the shutdown.
Each phase is learned from this run's records across attempts (the metrics lines of every
attempt of the lineage, the startups measured in the attempt records): a step is
``timing_s/step - timing_s/save_checkpoint`` (p95), a validation ``timing_s/testing``
(0.9 quantile), a save ``timing_s/save_checkpoint`` (median; the save right after a slower
one is given that save's time: a slow save raises the next save's limit only), a startup
the time from the submission to the attempt's first line, successful startups only (0.9
quantile). A phase never seen yet has an allowance instead (:class:`Allowances`): a first
save is the checkpoint's size (preflight's disk estimate) over
``train.watchdog.storage_mb_s``; a first validation one step; the first step, the first
startup and the shutdown their configured minutes.

**hung**: each phase has its own limit counted from its own start (issue 29), told from
signals finer than the metrics line: ``step`` from the previous line; ``save`` from verl's
``Saving checkpoint to <dir>/global_step_<N>`` line in the trainer's output or
``global_step_<N>/`` appearing; ``validation`` from the save's completion (verl prints
nothing as a validation starts: on a test step that does not save, the step's limit counts
its validation; :data:`SAVE_LINE` says what verl prints where). The limit is
``stall_factor`` x the phase's estimate (1.5 x the allowance for a phase never seen),
clamped to [``stall_floor_min``, ``stall_cap_min``]; a save still writing bytes is never
over its limit; ``stall_min`` set fixes it (0: never). A save's first byte has its own limit
from the save's start (:meth:`TimeModel.first_byte`), and once bytes come they must keep a
rate over a window (:meth:`TimeModel.write_rule`): a save that trickles is a hang. Before
the first line the startup limit, from the submission, which output does not reset: ``1.5 x
startup_min`` until a startup succeeded, then ``2 x the startup estimate`` between
``startup_floor_min`` and ``stall_cap_min`` (:meth:`TimeModel.startup_limit`); a hung
startup never raises it (the nodes its node agents show stopped first are excluded:
``hy3rl.train.after_attempt``); in the model load, no progress on any node for
``load_quiet_min`` (the node agents' reports, :meth:`Monitor.load_stuck`). In every phase,
``silence_min`` without any sign of the trainer (its output growing, a line, checkpoint
bytes) is a hang, and in a save that long without checkpoint bytes; silence is not counted
while the launcher cannot see the output (:meth:`Monitor.blind`). **After the last step**:
the shutdown allowance; when it passes and the last step's checkpoint is complete the
attempt is stopped as ``succeeded`` (the records say it was stopped after the final step),
else ``hung``.

**stopped_for_time_limit**: at a complete save of step N whose line is written, when the
time left before the job's end is less than the work until the next save (each step, the
validations where they happen, the save) plus ``train.time_limit_margin_min``, the
trainer is stopped right there: 0 steps lost. When the next save would be the job's last
(no save interval fits after it) or the run's, it must fit even when slow
(:meth:`TimeModel.slow_save`). The time left comes from the job's deadline
(:class:`Deadline`), read when the job starts and refreshed at each decision; a failed
query keeps the last deadline, and a save whose decision could not be made is looked at
again at the next poll. squeue's ``%L`` says ``INVALID`` both for a negative time left and
for more than 365 days: then the job's end is read from ``scontrol show job``
(:func:`slurm_time_left`); an answer that cannot be read is unknown, never "no time left".

Standard library only (it runs in the launcher's process).
"""

from __future__ import annotations

import logging
import math
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hy3rl.verl_log import finite_number, read_metrics

log = logging.getLogger("hy3rl.watchdog")

STEP_KEY = "timing_s/step"
TEST_KEY = "timing_s/testing"
SAVE_KEY = "timing_s/save_checkpoint"
QUANTILE = 0.9  # validations and startups: their estimate is this quantile of those seen
# Monitor.blind: the launcher calls it at each unanswered status (every 3 x the dashboard's
# timeout during an outage, 30 s by default); the output counts as unseen that long after
BLIND_HOLD_S = 120.0
SAVE_QUANTILE = 0.5  # saves: few per run (one slow save must not be the estimate)
STARTUP_FACTOR = 2.0  # a startup's limit over its estimate (startups vary: 75-200 min)
UNSEEN_FACTOR = 1.5  # a phase never seen: its limit over its allowance
# a startup sub-phase's floor: its largest share seen of startup_floor_s, x this (the share
# of each sub-phase varies between startups: +-20 % either way is 1.5 from one to another)
PART_SHARE_SLACK = 1.5
SLOW_SAVE_FACTOR = 3.0  # a save reserved for when the next save is the job's last
# What verl@220e903 prints at the phase boundaries (read from its source; main_ppo runs the
# v1 trainer, trainer.use_v1: true in verl/trainer/config/ppo_trainer.yaml):
# - a save starts: verl/trainer/ppo/v1/trainer_base.py:720, in _save_checkpoint:
#   logger.info(f"Saving checkpoint to {local_global_step_folder}"), the folder being
#   <trainer.default_local_dir>/global_step_<N>. The module logger is at INFO
#   (trainer_base.py:101, $VERL_LOGGING_LEVEL, default INFO) and `import verl` gives the root
#   logger a stderr handler formatted "%(levelname)s:%(asctime)s:%(message)s"
#   (verl/__init__.py:32 -> verl/utils/logging_utils.py:25), so the line reads
#   "INFO:<time>:Saving checkpoint to <dir>/global_step_<N>", and in driver.log Ray puts
#   "(TaskRunnerV1 pid=<pid>) " before it. VERL_LOGGING_LEVEL=WARNING silences it: the save
#   is then told by global_step_<N>/ appearing (the Megatron checkpoint manager creates it
#   first thing, verl/utils/checkpoint/megatron_checkpoint_manager.py:1198
#   `local_path = local_mkdir_safe(local_path)`) and by its bytes.
# - a save ends: no line before the step's metrics line; the checkpoint is complete when
#   actor/ckpt_contents.json (written last by rank 0) and the tracker are there (is_saved).
# - a validation starts or ends: the v1 trainer prints nothing (_validate,
#   trainer_base.py:777, has no print or log; PPOTrainerSync has no on_validate_begin). On a
#   save step it starts when the save is complete; on a test step that does not save it is
#   one span with the step until the step's metrics line (its limit counts both).
#   (The legacy trainer, trainer.use_v1=false, prints "local_global_step_folder: <dir>"
#   (ray_trainer.py:979) and "test_gen_batch meta info: {...}" (ray_trainer.py:635); the v1
#   trainer never does, and neither is read.)
# - a step ends: its metrics line in the file logger's jsonl (read here), and with the
#   console logger "step:<N> - <key>:<value> - ..." on stdout
#   (verl/utils/logger/aggregate_logger.py:27 and :51).
SAVE_LINE = re.compile(r"Saving checkpoint to \S*?global_step_(\d+)\b")
# The startup's boundaries as verl@220e903's v1 trainer logs them at INFO (trainer_base.py;
# the module logger as for SAVE_LINE), in order: each names the sub-phase it ends. The
# sub-phase after the last mark, the validation before training, ends at the attempt's first
# metrics line. A startup's sub-phases are learned from successful startups only
# (:meth:`TimeModel.startup_part_limit`), each with its own limit counted from the mark
# before it, so that a startup hung while Ray, vLLM or NCCL go on printing is caught within
# the sub-phase it hung in rather than by the whole startup's limit.
STARTUP_MARKS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # l.591, after the datasets (l.581 "train and validate dataloader initialized")
    ("datasets", re.compile(r"Total training steps: \d+")),
    # l.221, once per resource pool: the Ray worker actors spawned
    ("workers", re.compile(r"create worker group ")),
    # l.234: the actor (Megatron) model loaded on every rank
    ("actor_model", re.compile(r"actor and ref model engine initialized")),
    # l.283: after the reward loop (l.256) and the vLLM servers (LLMServerManager.create)
    ("rollout", re.compile(r"checkpoint engine manager initialized")),
    # l.289: after _load_checkpoint (l.676 "Training from scratch" / l.690 "Resuming from")
    ("checkpoint", re.compile(r"all initialize finished, ready to fit")),
)
FIRST_LINE_PART = "validation"  # from the last mark to the first metrics line
STARTUP_PARTS = (*(n for n, _ in STARTUP_MARKS), FIRST_LINE_PART)  # in the startup's order
POLL_KEY = "poll_s"  # in a startup's marks: the longest gap between two polls in it
LOG_READ_MAX = 1 << 20  # bytes of a log read per poll (the rest counts as activity unread)
BYTES_EVERY_S = 60.0  # a checkpoint being written is walked at most this often
# A save's writing (issue 44): once its first byte came, the bytes of the last window must
# keep a share of the slowest rate a healthy save of this run sustained over such a window
# (learned) or of the storage's assumed bandwidth (a save never seen, with a smaller share:
# the storage may be slower than assumed). The window is at least RATE_WINDOW_S and twice
# the longest pause between bytes of a healthy save, at most the silence limit (the window
# of a save never seen).
RATE_WINDOW_S = 15 * 60.0
# The model load (issue 44): the startup sub-phase in which Megatron-Bridge loads the HF
# weights, watched through the node agents' reports (hy3rl.loadwatch) when they come: a
# report not renewed for REPORT_STALE_S says nothing (the agent is gone or its file system
# lags); with none fresh the load has only its sub-phase limit.
LOAD_PART = "actor_model"
REPORT_STALE_S = 180.0
RATE_SHARE = 0.1
UNSEEN_RATE_SHARE = 0.02


@dataclass(frozen=True)
class StopRequest:
    """Why the watchdog ends the attempt: ``outcome`` (an attempt record outcome),
    ``message`` (its exit reason), ``step`` (the last logged step), ``diagnose`` (collect
    stacks and process lists before the teardown)."""

    outcome: str
    message: str
    step: int | None
    diagnose: bool = False


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Schedule:
    """verl's v1 schedule of one trainer run: it saves at multiples of ``save_freq`` (> 0)
    and at ``last``, validates at multiples of ``test_freq`` (> 0) and at ``last``."""

    save_freq: int
    test_freq: int
    last: int

    def saves(self, step: int) -> bool:
        return self.save_freq > 0 and (step % self.save_freq == 0 or step >= self.last)

    def validates(self, step: int) -> bool:
        return self.test_freq > 0 and (step % self.test_freq == 0 or step >= self.last)

    def next_save(self, after: int) -> int | None:
        """The first save step after ``after``; None when the run does not save."""
        if self.save_freq <= 0:
            return None
        return min(self.last, (after // self.save_freq + 1) * self.save_freq)


# --------------------------------------------------------------------------- the time model


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def upper_median(values: Sequence[float]) -> float:
    """The median of a non-empty list, the upper one of an even count (of two, the
    larger: one startup's figure stands until a third says which of the two is usual)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def p95(values: Sequence[float]) -> float:
    """The 95th percentile (nearest rank) of a non-empty list."""
    return quantile(values, 0.95)


@dataclass(frozen=True)
class Allowances:
    """Seconds allowed to a phase never seen yet in this run (module doc). ``validation_s``
    None: one step's estimate; ``save_s`` None: one step's estimate (no size known).
    ``first_byte_s``: the seconds from a save's start to its first checkpoint byte;
    ``save_rate_b_s``: the storage's write rate (None: no rate rule until a save was seen).
    ``load_quiet_s``: the model load's limit without progress on any node (the node
    agents' reports).
    ``startup_floor_s``, ``startup_cap_s``: the bounds of a startup's limit once startups
    were measured (:meth:`TimeModel.startup_limit`)."""

    startup_s: float
    step_s: float
    validation_s: float | None
    save_s: float | None
    shutdown_s: float
    startup_floor_s: float
    startup_cap_s: float
    stall_floor_s: float = 30 * 60.0  # a startup sub-phase's limit is never below it
    # a save's first byte, from its start, while no save of this run was seen writing
    first_byte_s: float = 15 * 60.0
    # the checkpoint storage's bandwidth (bytes/s) assumed for a save never seen
    save_rate_b_s: float | None = None
    # the model load: no progress on any node for this long is a hang (hy3rl.loadwatch)
    load_quiet_s: float = 15 * 60.0


@dataclass
class TimeModel:
    """What this run's records say each phase takes (seconds), and what is allowed to a
    phase never seen (module doc)."""

    allow: Allowances
    steps: list[float] = field(default_factory=list)
    validations: list[float] = field(default_factory=list)
    saves: list[float] = field(default_factory=list)
    startups: list[float] = field(default_factory=list)
    # seconds of each startup sub-phase (STARTUP_MARKS, FIRST_LINE_PART) in successful
    # startups
    startup_parts: dict[str, list[float]] = field(default_factory=dict)
    # and each one's share of its startup (the seconds to the first line)
    startup_shares: dict[str, list[float]] = field(default_factory=dict)
    # saves seen writing (Monitor.timing's "saves"): seconds from the start to the first
    # byte, the slowest rate sustained over a window (bytes/s) and the longest pause
    first_bytes: list[float] = field(default_factory=list)
    write_rates: list[float] = field(default_factory=list)
    write_gaps: list[float] = field(default_factory=list)

    @classmethod
    def learn(cls, allow: Allowances, lines: Iterable[Mapping[str, Any]],
              startups: Iterable[float] = (), *,
              startup_marks: Iterable[Mapping[str, float]] = (),
              save_marks: Iterable[Mapping[str, Any]] = ()) -> TimeModel:
        """``startups``: those that succeeded (their first line came), never a hung wait;
        ``startup_marks``: theirs, each the seconds from the submission to each mark seen
        and to the first line (:meth:`Monitor.timing`'s ``startup_marks``);
        ``save_marks``: the complete saves seen writing (:meth:`Monitor.timing`'s
        ``saves``)."""
        model = cls(allow, startups=[float(s) for s in startups])
        for marks in startup_marks:
            model.add_startup_marks(marks)
        for marks in save_marks:
            model.add_save_marks(marks)
        model.add_lines(lines)
        return model

    def add_startup_marks(self, marks: Mapping[str, float]) -> None:
        """One successful startup's marks: each sub-phase's seconds, from the mark before it
        (or the submission) to its own; a sub-phase whose mark is missing (another verl, a
        quieter log level) is not learned, and the next one is counted from the last mark
        seen. A mark is seen at the poll after it: ``marks["poll_s"]``, the longest gap
        between two polls in that startup, bounds the error, so each sub-phase's share is
        taken at its largest (its seconds + poll_s over the startup's - poll_s)."""
        before = 0.0
        total = marks.get(FIRST_LINE_PART)
        poll = marks.get(POLL_KEY)
        poll = float(poll) if isinstance(poll, (int, float)) and poll > 0 else 0.0
        for name in STARTUP_PARTS:
            at = marks.get(name)
            if not isinstance(at, (int, float)) or isinstance(at, bool) or at < before:
                continue
            seconds = float(at) - before
            self.startup_parts.setdefault(name, []).append(seconds)
            if isinstance(total, (int, float)) and total > 0:
                self.startup_shares.setdefault(name, []).append(
                    min(1.0, (seconds + poll) / max(total - poll, seconds + poll)))
            before = float(at)

    def add_save_marks(self, marks: Mapping[str, Any]) -> None:
        """One complete save seen writing: ``first_byte_s``, ``rate_b_s`` (the slowest
        rate it sustained over a window), ``gap_s`` (its longest pause between bytes); a
        value that is not a finite number >= 0 is not learned."""
        for key, into in (("first_byte_s", self.first_bytes), ("rate_b_s", self.write_rates),
                          ("gap_s", self.write_gaps)):
            value = marks.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value) and value >= 0:
                into.append(float(value))

    def first_byte(self) -> tuple[float, bool]:
        """Seconds from a save's start to its first byte: the upper median of the saves seen
        writing (the time a save spends before writing does not grow with its size), else
        the allowance."""
        if self.first_bytes:
            return upper_median(self.first_bytes), True
        return self.allow.first_byte_s, False

    def write_rule(self, silence_s: float | None) -> tuple[float, float, bool] | None:
        """A save's writing rule: (window seconds, bytes/s it must keep over the window,
        learned?). Learned: the window is :data:`RATE_WINDOW_S`, or twice the longest pause
        of a healthy save when longer, at most ``silence_s``; the rate :data:`RATE_SHARE`
        x the slowest rate a healthy save sustained over its window (the slowest save, so
        that a slow healthy part such as a single-writer export is no hang). Never seen:
        the silence limit's window (:data:`RATE_WINDOW_S` without one) and
        :data:`UNSEEN_RATE_SHARE` x the storage's assumed rate. None: no rule (no rate
        known)."""
        cap = silence_s or RATE_WINDOW_S
        if self.write_rates:
            window = min(cap, max(RATE_WINDOW_S, 2 * max(self.write_gaps, default=0.0)))
            rate = RATE_SHARE * min(self.write_rates)
            return (window, rate, True) if rate > 0 else None
        if self.allow.save_rate_b_s:
            return cap, UNSEEN_RATE_SHARE * self.allow.save_rate_b_s, False
        return None

    def startup_part_limit(self, name: str) -> float | None:
        """The limit of startup sub-phase ``name``, counted from its start:
        :data:`STARTUP_FACTOR` x the median of its successful durations, never below its
        share of the slowest healthy startup expected (:data:`PART_SHARE_SLACK` x its median
        share of the startups seen x ``startup_floor_s``: a resume slower than the startups
        seen is no hang, as for the whole startup) nor ``stall_floor_s``, nor above
        ``startup_cap_s``; None while it was never seen to succeed (the whole startup's
        limit still holds). Medians (:func:`upper_median`), not the largest: one disturbed
        startup (a slow file system during one model load) raised the limit for good (the
        model load's 105 -> 255 min); it now comes back down once the startups after it
        are usual again."""
        seen = self.startup_parts.get(name)
        if not seen:
            return None
        shares = self.startup_shares.get(name) or [1.0]
        floor = PART_SHARE_SLACK * upper_median(shares) * self.allow.startup_floor_s
        return min(self.allow.startup_cap_s,
                   max(self.allow.stall_floor_s, floor, STARTUP_FACTOR * upper_median(seen)))

    def add_lines(self, lines: Iterable[Mapping[str, Any]]) -> None:
        for rec in lines:
            data = rec.get("data") or {}
            step = finite_number(data.get(STEP_KEY))
            if step is None:
                continue  # the validation before training: part of the startup
            save = finite_number(data.get(SAVE_KEY))
            test = finite_number(data.get(TEST_KEY))
            self.steps.append(max(0.0, step - (save or 0.0)))
            if save is not None:
                self.saves.append(save)
            if test is not None:
                self.validations.append(test)

    # each phase: (seconds, learned?)
    def step(self) -> tuple[float, bool]:
        return (p95(self.steps), True) if self.steps else (self.allow.step_s, False)

    def validation(self) -> tuple[float, bool]:
        if self.validations:
            return quantile(self.validations, QUANTILE), True
        return (self.allow.validation_s if self.allow.validation_s is not None
                else self.step()[0]), False

    def save(self) -> tuple[float, bool]:
        """A save's estimate: the :data:`SAVE_QUANTILE` of the saves seen (one slow save among
        several does not move it; see :meth:`next_save` for the save right after it)."""
        if self.saves:
            return quantile(self.saves, SAVE_QUANTILE), True
        return (self.allow.save_s if self.allow.save_s is not None else self.step()[0]), False

    def next_save(self) -> float:
        """The estimate of the next save: the usual one, or the newest save when it was
        slower (a single slow save raises the next save's limit only)."""
        usual = self.save()[0]
        return max(usual, self.saves[-1]) if self.saves else usual

    def slow_save(self) -> float:
        """A slow save reserved for when the next save is the job's last:
        :data:`SLOW_SAVE_FACTOR` x the usual save, or the slowest save seen when slower.
        While fewer than three saves are known, the usual save is at most the allowance (a
        first save that was slow is not three times the usual)."""
        usual = self.save()[0]
        if len(self.saves) < 3 and self.allow.save_s is not None:
            usual = min(usual, self.allow.save_s)
        return max([SLOW_SAVE_FACTOR * usual] + self.saves)

    def startup(self) -> tuple[float, bool]:
        """From successful startups only (the time to an attempt's first line); a startup
        declared hung says nothing about how long a startup takes."""
        if self.startups:
            return quantile(self.startups, QUANTILE), True
        return self.allow.startup_s, False

    def startup_limit(self) -> float:
        """A startup's limit, counted from the submission; output does not reset it (a
        startup hung in a collective while Ray and vLLM go on printing is caught by it).
        While no startup of this run succeeded: :data:`UNSEEN_FACTOR` x the allowance.
        Then :data:`STARTUP_FACTOR` x the :data:`QUANTILE` of the successful startups,
        never below ``startup_floor_s`` (the slowest healthy startup expected: a resume
        loading optimizer state after a fast first start is no hang) nor above
        ``startup_cap_s``. Learned from successful startups only: a hung startup never
        raises it (the nodes its node agents show stopped first are excluded:
        hy3rl.train.after_attempt); a hang that goes quiet is caught earlier by the
        silence limit."""
        a = self.allow
        if not self.startups:
            return min(a.startup_cap_s, UNSEEN_FACTOR * a.startup_s)
        return min(a.startup_cap_s, max(a.startup_floor_s, STARTUP_FACTOR * self.startup()[0]))

    def work(self, step: int, schedule: Schedule, save: float | None = None) -> float:
        """Seconds from the line of ``step - 1`` to the line of ``step`` (``save``: the
        save's estimate, default the usual one)."""
        total = self.step()[0]
        if schedule.saves(step):
            total += self.save()[0] if save is None else save
        if schedule.validates(step):
            total += self.validation()[0]
        return total

    def until_save(self, after: int, schedule: Schedule,
                   save: float | None = None) -> float | None:
        """Seconds from the line of step ``after`` to the complete save of the next save
        step, following the schedule (the validation of that step comes after its save and
        is not needed; ``save``: that save's estimate, default the usual one); None when
        the run does not save."""
        nxt = schedule.next_save(after)
        if nxt is None:
            return None
        total = sum(self.work(s, schedule) - self.step()[0] for s in range(after + 1, nxt))
        return total + self.steps_sum(nxt - after) + (self.save()[0] if save is None else save)

    def steps_sum(self, n: int) -> float:
        """Seconds ``n`` steps take together: a sum varies less than its parts, so
        ``n x mean + 1.645 x sd x sqrt(n)`` (the sum's 95th percentile, by the central limit
        theorem) rather than ``n x`` the p95 of one step (which left an hour unused per
        interval on a +-20 % profile); ``n x`` the step's estimate while fewer than two steps
        are known."""
        if len(self.steps) < 2:
            return n * self.step()[0]
        return n * statistics.fmean(self.steps) + 1.645 * statistics.stdev(self.steps) * \
            math.sqrt(n)

    def snapshot(self) -> dict[str, Any]:
        """The estimates (seconds) and whether each was learned, for the attempt record."""
        out: dict[str, Any] = {}
        for name in ("startup", "step", "validation", "save"):
            seconds, learned = getattr(self, name)()
            out[name] = {"s": round(seconds, 1), "learned": learned,
                         "samples": len(getattr(self, f"{name}s"))}
        out["startup"]["limit_s"] = round(self.startup_limit(), 1)
        out["startup"]["parts"] = {
            name: {"s": round(quantile(seen, QUANTILE), 1), "samples": len(seen),
                   "limit_s": round(self.startup_part_limit(name) or 0.0, 1)}
            for name, seen in self.startup_parts.items()}
        out["shutdown"] = {"s": self.allow.shutdown_s, "learned": False, "samples": 0}
        seconds, learned = self.first_byte()
        out["save"]["first_byte"] = {"s": round(seconds, 1), "learned": learned,
                                     "samples": len(self.first_bytes)}
        rule = self.write_rule(None)
        if rule is not None:
            out["save"]["min_rate_b_s"] = round(rule[1], 1)
        return out


@dataclass(frozen=True)
class StallPolicy:
    """``fixed_s``: a fixed limit for a step (None: from the model; 0: never);
    ``factor``, ``floor_s``, ``cap_s``: the derived limit's factor and bounds."""

    fixed_s: float | None
    factor: float
    floor_s: float
    cap_s: float

    def limit(self, expected: float, learned: bool = True) -> float | None:
        """A phase's limit from its estimate; a phase never seen (``learned`` false, its
        estimate an allowance) gets :data:`UNSEEN_FACTOR` x its allowance instead."""
        if self.fixed_s == 0:
            return None
        if self.fixed_s is not None:
            return self.fixed_s
        factor = self.factor if learned else UNSEEN_FACTOR
        return min(self.cap_s, max(self.floor_s, factor * expected))


# --------------------------------------------------------------------------- the job's end


_DURATION = re.compile(r"(-)?(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)")
CLOCK_SKEW_S = 300.0  # the controller's and this host's view of the job's end may differ


def parse_duration(text: str) -> float | None:
    """SLURM's ``[-][D-]HH:MM:SS`` / ``MM:SS`` in seconds (a negative one is 0); None for
    any other form."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups()[1:])
    left = float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    return 0.0 if m.group(1) else left


def parse_time_left(text: str) -> float | None:
    """squeue's ``%L`` (``[D-]HH:MM:SS``, ``MM:SS``, ``UNLIMITED``, ``NOT_SET``,
    ``INVALID``) in seconds: ``inf`` for no limit, None when it tells nothing. ``INVALID``
    is what squeue prints both for a negative time left (the time limit's SIGTERM) and for
    more than 365 days left: None, so that the job's end is read instead
    (:func:`parse_job_time_left`)."""
    text = text.strip()
    if text in ("UNLIMITED", "NOT_SET"):
        return math.inf
    return parse_duration(text)


def _field(text: str, key: str) -> str | None:
    m = re.search(rf"(?:^|\s){re.escape(key)}=(\S*)", text)
    return m.group(1) if m else None


def parse_job_time_left(text: str, now: float) -> float | None:
    """Seconds left to the job that ``scontrol show job <id>`` describes (``Key=Value``
    pairs over several lines): ``TimeLimit`` - ``RunTime``, both the controller's (``inf``
    for ``TimeLimit=UNLIMITED``; 0 once the run time reaches the limit), else ``EndTime``
    (local time, as scontrol prints it) - ``now`` (this host's epoch seconds). When both
    can be read and differ by more than :data:`CLOCK_SKEW_S` (this host's clock jumped, or
    the job was suspended), the controller's own figure is taken and the difference logged.
    None when neither can be read (a garbage answer)."""
    limit_text = _field(text, "TimeLimit")
    if limit_text == "UNLIMITED":
        return math.inf
    limit = parse_duration(limit_text or "")
    run = parse_duration(_field(text, "RunTime") or "")
    by_limit = None if limit is None or run is None else max(0.0, limit - run)
    by_end = None
    end_text = _field(text, "EndTime")
    try:
        end = datetime.strptime(end_text or "", "%Y-%m-%dT%H:%M:%S").timestamp()
        by_end = max(0.0, end - now)
    except ValueError:
        pass
    if by_limit is not None:
        if by_end is not None and abs(by_end - by_limit) > CLOCK_SKEW_S:
            log.warning("scontrol: EndTime=%s is %.0fs from now here, TimeLimit=%s - RunTime=%s "
                        "is %.0fs: this host's clock disagrees with the controller's; "
                        "taking the controller's", end_text, by_end, limit_text,
                        _field(text, "RunTime"), by_limit)
        return by_limit
    return by_end


def slurm_output(cmd: list[str], timeout_s: float = 60, level: int = logging.DEBUG) -> str | None:
    """stdout of a SLURM command (bounded by ``timeout_s``); None when it is missing, fails
    or does not answer in time, logged at ``level`` with the reason."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.log(level, "%s: %s", " ".join(cmd), exc)
        return None
    if proc.returncode != 0:
        log.log(level, "%s exited %d: %s", " ".join(cmd), proc.returncode, proc.stderr.strip())
        return None
    return proc.stdout


def slurm_time_left(job_id: str) -> float | None:
    """Seconds until SLURM ends the job (its time limit; follows ``scontrol update``);
    ``inf`` for none; None when it cannot be told (logged), never 0 for an answer that
    cannot be read. squeue's ``%L`` first; when it prints ``INVALID`` or anything else
    unreadable, the job's end from ``scontrol show job`` (:func:`parse_job_time_left`)."""
    out = slurm_output(["squeue", "-h", "-j", str(job_id), "-o", "%L"], 30, logging.WARNING)
    if out is None:
        log.warning("time left of job %s unknown", job_id)
        return None
    text = out.strip().splitlines()[0].strip() if out.strip() else ""
    left = parse_time_left(text)
    if left is not None:
        return left
    detail = slurm_output(["scontrol", "show", "job", str(job_id)], 30, logging.WARNING)
    left = None if detail is None else parse_job_time_left(detail, time.time())
    if left is None:
        log.warning("squeue -j %s -o %%L printed %r and scontrol show job %s tells no end "
                    "time: time left unknown", job_id, text, job_id)
    else:
        log.info("squeue -j %s -o %%L printed %r: %.0fs left from scontrol show job",
                 job_id, text, left)
    return left


@dataclass
class Deadline:
    """The job's end on ``clock``: read by ``query`` (seconds left, ``inf`` for none, None
    when it cannot be told) at :meth:`refresh`; a failed query keeps the last deadline."""

    query: Callable[[], float | None]
    clock: Callable[[], float] = time.monotonic
    end: float | None = None

    def refresh(self) -> None:
        left = self.query()
        if left is not None:
            self.end = self.clock() + left

    def left(self, refresh: bool = True) -> float | None:
        """Seconds left (``inf``: no limit), None while it was never told."""
        if refresh:
            self.refresh()
        return None if self.end is None else max(0.0, self.end - self.clock())


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is not there); files that vanish while
    it is walked are skipped."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# --------------------------------------------------------------------------- the monitor


@dataclass
class Monitor:
    """Polled by the launcher while the Ray job runs (see the module docstring).

    ``metrics``: the attempt's metrics log. ``model``: the time model learned from this
    run's earlier records (the attempt's own lines are added as they come). ``schedule``:
    verl's schedule of this trainer run (``last``: the attempt's last step).
    ``is_saved(step)``: whether ``global_step_<step>`` is a complete checkpoint.
    ``ckpt_dir``: where ``global_step_<step>`` is written (bytes arriving are progress).
    ``logs``: the trainer's output (``driver.log``: Ray forwards every worker's output to
    it); growing is activity, verl's save and validation lines start those phases.
    ``silence_s``: no activity at all for this long is a hang (None: off).
    ``deadline``: the job's end. ``clock``: monotonic seconds (tests pass their own)."""

    metrics: Path
    schedule: Schedule
    model: TimeModel
    stall: StallPolicy
    margin_s: float
    is_saved: Callable[[int], bool]
    deadline: Deadline
    ckpt_dir: Path | None = None
    start_step: int = 0
    clock: Callable[[], float] = time.monotonic
    logs: Sequence[Path] = ()
    silence_s: float | None = None
    started: float | None = None
    first_line_at: float | None = None
    last_progress: float | None = None
    last_activity: float | None = None
    phase_started: float | None = None
    save_bytes_at: float | None = None
    seen: int = 0
    last_step: int | None = None
    lines: list[dict[str, Any]] = field(default_factory=list)
    decided_saves: set[int] = field(default_factory=set)
    bytes_seen: dict[int, int] = field(default_factory=dict)
    complete_seen: set[int] = field(default_factory=set)
    log_sizes: dict[Path, int] = field(default_factory=dict)
    metrics_size: int | None = None
    bytes_walked_at: float | None = None
    phase: str = "startup"
    startup_hung_s: float | None = None
    # seconds from the submission to each startup mark seen (STARTUP_MARKS) and, once it
    # came, to the first line (FIRST_LINE_PART)
    startup_marks: dict[str, float] = field(default_factory=dict)
    polled_at: float | None = None
    kill_after: int | None = None  # the rehearsal: stop once this step's save is complete
    # the output unseen (Monitor.blind): the last call, and the blind seconds in the
    # startup sub-phase in progress, which its limit does not count
    blind_at: float | None = None
    blind_in_part_s: float = 0.0
    # the save in progress: (seconds, bytes) at each walk from its first byte on
    save_samples: list[tuple[float, int]] = field(default_factory=list)
    # complete saves seen writing in this attempt (timing()["saves"], TimeModel.add_save_marks)
    saves_seen: list[dict[str, Any]] = field(default_factory=list)
    # the node agents' reports (hy3rl.loadwatch): their folder, and per node the report's
    # own time (its clock), when this monitor saw it change, and the report
    progress_dir: Path | None = None
    reports: dict[str, tuple[float, float, dict[str, Any]]] = field(default_factory=dict)
    quiet_at_stop: dict[str, float] | None = None  # node_quiet when the startup hung
    loading_at_stop: list[str] | None = None  # node_loading then


    def start(self) -> None:
        """The Ray job was submitted: the startup clock runs from now; the deadline is
        read."""
        self.started = self.last_activity = self.clock()
        self.phase, self.phase_started = "startup", self.started
        for path in self.logs:
            self.log_sizes[path] = _size(path)
        self.deadline.refresh()

    def blind(self) -> None:
        """The launcher cannot see the trainer's output now (Ray's dashboard does not
        answer, so the log stream is down): silence is not counted against the trainer,
        nor is the time in a startup sub-phase, whose end is a line of that output (its
        metrics lines, checkpoint bytes, the whole startup's and the other phases' limits
        are still watched). Called at each unanswered status: blind from one call to the
        next while they come at most :data:`BLIND_HOLD_S` apart, and until that long after
        the last."""
        now = self.clock()
        self.last_activity = now
        self.blind_in_part_s += self._blind_since(now)
        self.blind_at = now

    def _blind_since(self, now: float) -> float:
        """Blind seconds from the last :meth:`blind` (or the sub-phase's start, if later) to
        ``now``; 0 when that call is more than :data:`BLIND_HOLD_S` ago."""
        if self.blind_at is None or now - self.blind_at > BLIND_HOLD_S:
            return 0.0
        return max(0.0, now - max(self.blind_at, self.phase_started or self.blind_at))

    def blind_part_s(self, now: float) -> float:
        """Blind seconds in the startup sub-phase in progress, up to ``now``."""
        return self.blind_in_part_s + self._blind_since(now)

    @property
    def startup_s(self) -> float | None:
        """Seconds from the submission to the attempt's first line (None: not yet)."""
        if self.first_line_at is None or self.started is None:
            return None
        return self.first_line_at - self.started

    def enter(self, phase: str, now: float) -> None:
        if phase != self.phase:
            log.info("watchdog: step %d: %s", self.next_step(), phase)
            self.phase, self.phase_started = phase, now
            if phase == "save":
                self.save_samples = []

    def poll(self) -> StopRequest | None:
        """Look at the metrics log, the trainer's output and the checkpoint once; a
        StopRequest when the attempt must end."""
        now = self.clock()
        if self.started is None:
            self.start()
        if self.first_line_at is None and self.polled_at is not None:  # in the startup
            self.startup_marks[POLL_KEY] = round(max(
                self.startup_marks.get(POLL_KEY, 0.0), now - self.polled_at), 1)
        self.polled_at = now
        if self.last_progress is None:  # startup lines that came with the first metrics line
            self.watch_logs(now)        # end their sub-phases before it ends the startup
        size = _size(self.metrics)
        if size == self.metrics_size:
            lines = self.lines  # unchanged: not parsed again
        else:
            try:
                lines = read_metrics(self.metrics)
                self.metrics_size = size
            except Exception as exc:  # a bad line must not stop the watch; verl_log names it
                log.warning("watchdog: %s", exc)
                lines = self.lines
        if len(lines) > self.seen:
            self.model.add_lines(lines[self.seen:])
            self.lines, self.seen = lines, len(lines)
            self.last_step = lines[-1]["step"]
            self.last_progress = self.last_activity = now
            self.save_bytes_at = None
            if self.first_line_at is None:
                self.first_line_at = now
                self.startup_marks[FIRST_LINE_PART] = round(now - self.started, 1)
            self.phase = ""
            self.enter("shutdown" if self.last_step >= self.schedule.last else "step", now)
        self.watch_logs(now)
        self.watch_save(now)
        killed = self.planned_kill()
        if killed is not None:
            return killed
        saved = self.after_save()
        if saved is not None:
            return saved
        return self.hang(now)

    def next_step(self) -> int:
        return (self.last_step if self.last_step is not None else self.start_step) + 1

    def watch_logs(self, now: float) -> None:
        """The trainer's output growing is activity; verl's save line (:data:`SAVE_LINE`)
        of the next step starts its save."""
        for path in self.logs:
            size, seen = _size(path), self.log_sizes.get(path, 0)
            if size < seen:
                seen = 0  # rewritten
            if size == seen:
                continue
            self.log_sizes[path] = size
            self.last_activity = now
            if self.phase == "shutdown":
                continue
            try:
                with open(path, "rb") as fh:
                    fh.seek(max(seen, size - LOG_READ_MAX))
                    text = fh.read(size - fh.tell()).decode(errors="replace")
            except OSError:
                continue
            if self.last_progress is None:
                self.watch_startup(text, now)
                continue
            if any(n not in self.startup_marks for n in STARTUP_PARTS[:-1]):
                # the driver's log can lag the metrics file (Ray streams it): a startup line
                # that arrives after the first metrics line was printed before it (verl
                # prints each once, before fitting)
                self.watch_startup(text, self.first_line_at, late=True)
            nxt = self.next_step()
            if self.phase == "step" and self.schedule.saves(nxt) and any(
                    int(m.group(1)) == nxt for m in SAVE_LINE.finditer(text)):
                self.enter("save", now)

    def watch_startup(self, text: str, now: float, late: bool = False) -> None:
        """A startup mark (:data:`STARTUP_MARKS`) in new output ends its sub-phase: the
        seconds from the submission are recorded, the next sub-phase starts now. ``late``:
        the output came after the first metrics line (``now`` is that line's time, which the
        mark preceded); the startup is over, no sub-phase starts."""
        for name, pattern in STARTUP_MARKS:
            if name not in self.startup_marks and pattern.search(text):
                self.startup_marks[name] = round(now - self.started, 1)
                if not late:
                    self.phase_started = now
                    self.blind_in_part_s = 0.0
                log.info("watchdog: startup: %s after %s%s", name, _minutes(now - self.started),
                         " (its line came after the first metrics line)" if late else "")
        if late:  # in the startup's order (POLL_KEY last)
            self.startup_marks = {n: self.startup_marks[n] for n in (*STARTUP_PARTS, POLL_KEY)
                                  if n in self.startup_marks}

    def startup_part(self) -> str:
        """The startup sub-phase in progress: the one after the last mark seen."""
        done = [i for i, n in enumerate(STARTUP_PARTS[:-1]) if n in self.startup_marks]
        return STARTUP_PARTS[done[-1] + 1] if done else STARTUP_PARTS[0]

    def watch_save(self, now: float) -> None:
        """The next step's ``global_step_<N>/`` appearing starts its save, bytes arriving in
        it (walked at most every :data:`BYTES_EVERY_S`) carry it; its completion ends the
        save (the launcher moved incomplete newer saves aside before the attempt)."""
        if self.ckpt_dir is None or self.last_step is None:
            return
        step = self.next_step()
        if not self.schedule.saves(step) or step > self.schedule.last:
            return
        path = self.ckpt_dir / f"global_step_{step}"
        if step not in self.complete_seen and self.is_saved(step):
            self.complete_seen.add(step)
            if self.phase == "save":
                self.save_seen(step, tree_bytes(path), now)
            self.last_progress = self.last_activity = now
            self.enter("validation" if self.schedule.validates(step) else "saved", now)
            return
        if step in self.complete_seen:
            return
        if not path.is_dir():
            return
        if self.phase == "step":  # the checkpoint manager's first act (see SAVE_LINE)
            self.enter("save", now)
        if self.bytes_walked_at is not None and now - self.bytes_walked_at < BYTES_EVERY_S:
            return  # a multi-TB checkpoint of many files: walked once a minute at most
        self.bytes_walked_at = now
        self.bytes_arrived(step, tree_bytes(path), now)

    def bytes_arrived(self, step: int, size: int, now: float) -> None:
        """A walk of the save in progress found ``size`` bytes."""
        if size > self.bytes_seen.get(step, 0):
            self.bytes_seen[step] = size
            self.last_progress = self.last_activity = self.save_bytes_at = now
        if self.phase == "save" and self.bytes_seen.get(step):
            self.save_samples.append((now, self.bytes_seen[step]))

    def save_seen(self, step: int, size: int, now: float) -> None:
        """A save seen writing in this attempt is complete: what it took to its first byte,
        the slowest rate it sustained over a window and its longest pause go to the time
        model (:meth:`TimeModel.add_save_marks`) and to the attempt record (:meth:`timing`)
        for the attempts after it."""
        samples = [*self.save_samples, (now, max(size, self.bytes_seen.get(step, 0)))]
        self.save_samples = []
        if self.phase_started is None or len(samples) < 2:
            return
        first, gap, last_up = samples[0][0], 0.0, samples[0][0]
        for (_, before), (t, size_t) in zip(samples, samples[1:], strict=False):
            if size_t > before:
                gap, last_up = max(gap, t - last_up), t
        window = min(self.silence_s or RATE_WINDOW_S, max(RATE_WINDOW_S, 2 * gap))
        self.saves_seen.append({
            "step": step, "first_byte_s": round(first - self.phase_started, 1),
            "write_s": round(now - first, 1), "bytes": samples[-1][1],
            "rate_b_s": round(slowest_rate(samples, window), 3), "gap_s": round(gap, 1)})
        self.model.add_save_marks(self.saves_seen[-1])  # the attempt's later saves learn it

    def phase_limit(self) -> tuple[float | None, float]:
        """The limit of the phase the trainer is in (counted from its start) and the
        phase's estimate (seconds)."""
        nxt, m = self.next_step(), self.model
        if self.phase == "save":
            expected, learned = m.next_save(), m.save()[1]
        elif self.phase == "validation":
            expected, learned = m.validation()
        elif self.phase == "saved":
            expected, learned = 0.0, True  # the save is complete; the line is due
        else:  # the step: its rollout and update, and a validation that no line tells apart
            expected, learned = m.step()
            if self.schedule.validates(nxt) and not self.schedule.saves(nxt):
                expected += m.validation()[0]
                learned = learned and m.validation()[1]
            if self.schedule.saves(nxt) and self.ckpt_dir is None:
                expected, learned = m.work(nxt, self.schedule, m.next_save()), False
        return self.stall.limit(expected, learned), expected

    def hang(self, now: float) -> StopRequest | None:
        quiet = (None if not self.silence_s or self.last_activity is None
                 else now - self.last_activity)
        if self.last_progress is None:
            self.phase = "startup"
            limit, waited = self.model.startup_limit(), now - self.started
            if self.model.allow.startup_s <= 0:
                return None
            part = self.startup_part()
            part_limit = self.model.startup_part_limit(part)
            # from the last mark, or the submission, less the time its output was unseen
            in_part = now - self.phase_started - self.blind_part_s(now)
            if quiet is not None and quiet >= self.silence_s:
                why = (f"no output for {_minutes(quiet)}, silence limit "
                       f"{_minutes(self.silence_s)}; {_minutes(waited)} after the submission")
            elif waited >= limit:
                why = (f"no metrics line {_minutes(waited)} after the submission; startup "
                       f"limit {_minutes(limit)}")
            elif part_limit is not None and in_part >= part_limit:
                why = (f"startup sub-phase {part} for {_minutes(in_part)}, its limit "
                       f"{_minutes(part_limit)} (from its successful startups); "
                       f"{_minutes(waited)} after the submission")
            elif part == LOAD_PART and (stuck := self.load_stuck(now, in_part)) is not None:
                why = f"{stuck}; {_minutes(waited)} after the submission"
            else:
                return None
            self.startup_hung_s = waited
            self.quiet_at_stop = self.node_quiet(now)
            self.loading_at_stop = self.node_loading()
            return StopRequest("hung", f"hung before its first step ({why})", None, True)
        step = self.last_step
        if step is not None and step >= self.schedule.last:
            return self.shutdown(step, now - self.last_progress)
        nxt = self.next_step()
        limit, _ = self.phase_limit()
        elapsed = now - self.phase_started
        why = None
        if quiet is not None and quiet >= self.silence_s:
            why = (f"no output, line or checkpoint bytes for {_minutes(quiet)}; silence "
                   f"limit {_minutes(self.silence_s)}")
        elif (self.phase == "save" and self.silence_s and self.save_bytes_at is not None
              and now - self.save_bytes_at >= self.silence_s):
            why = (f"no checkpoint bytes for {_minutes(now - self.save_bytes_at)}; silence "
                   f"limit {_minutes(self.silence_s)}")
        elif self.phase == "save" and (stuck := self.save_stuck(nxt, now)) is not None:
            why = stuck
        elif limit is not None and elapsed >= limit:
            if self.phase == "save" and self.save_bytes_at is not None \
                    and now - self.save_bytes_at < min(limit, self.silence_s or limit):
                return None  # a slow save still writing is making progress
            why = f"{self.phase} for {_minutes(elapsed)}; its limit {_minutes(limit)}"
        if why is None:
            return None
        return StopRequest("hung", f"hung at step {nxt} ({why}; last logged step {step})",
                           step, True)

    def read_reports(self, now: float, stale: bool = False) -> dict[str, float]:
        """The node agents' reports: per node whose report is fresh (renewed within
        :data:`REPORT_STALE_S`; ``stale``: every node that reported), the seconds since it
        last progressed, up to ``now`` (a report not renewed counts as no progress)."""
        if self.progress_dir is None:
            return {}
        from hy3rl.loadwatch import read_reports

        for node, doc in read_reports(self.progress_dir).items():
            seen = self.reports.get(node)
            if seen is None or doc["t"] != seen[0]:
                self.reports[node] = (float(doc["t"]), now, doc)
        return {node: max(0.0, t - float(doc["last_progress"])) + (now - at)
                for node, (t, at, doc) in self.reports.items()
                if stale or now - at <= REPORT_STALE_S}

    def load_stuck(self, now: float, in_part: float) -> str | None:
        """Why the model load is hung, if it is: no node's processes progressed (page faults,
        mapped shards, Megatron-Bridge's loading bar: hy3rl.loadwatch) for
        ``load_quiet_s``, counted from the sub-phase's start at the earliest; None while no
        node's report is fresh (the sub-phase's own limit still holds)."""
        quiet = self.read_reports(now)
        if not quiet:
            return None
        limit = self.model.allow.load_quiet_s
        idle = min(min(quiet.values()), in_part)
        if limit <= 0 or idle < limit:
            return None
        first = max(quiet, key=lambda n: quiet[n])
        return (f"no model-load progress on any of {len(quiet)} node(s) for "
                f"{_minutes(idle)} (page faults, mapped shards, the loading bar), its limit "
                f"{_minutes(limit)}; {first} stopped first, {_minutes(quiet[first])} ago")

    def node_quiet(self, now: float) -> dict[str, float] | None:
        """Per node that reported, the seconds since its processes last progressed (the
        evidence for excluding a node after a hung startup: hy3rl.train.after_attempt);
        None without node agents."""
        if self.progress_dir is None:
            return None
        return {n: round(q, 1) for n, q in sorted(self.read_reports(now, True).items())}

    def node_loading(self) -> list[str] | None:
        """The nodes whose newest report has model shards mapped (a load in progress there);
        None without node agents or when no report says."""
        if self.progress_dir is None or not any(
                isinstance(doc.get("shards"), list) for _, _, doc in self.reports.values()):
            return None
        return sorted(n for n, (_, _, doc) in self.reports.items() if doc.get("shards"))

    def save_stuck(self, step: int, now: float) -> str | None:
        """Why the save of ``step`` in progress is hung, if it is: no first byte within its
        limit (:meth:`TimeModel.first_byte`, through the stall policy), or, once bytes came,
        fewer bytes over the last window than the write rule asks
        (:meth:`TimeModel.write_rule`): a save that trickles a write every few minutes is
        a hang, however long before its limit or the silence limit."""
        if self.ckpt_dir is None or self.phase_started is None:
            return None  # its bytes cannot be seen
        elapsed, m = now - self.phase_started, self.model
        if not self.bytes_seen.get(step):
            first, learned = m.first_byte()
            limit = self.stall.limit(first, learned)
            if limit is None or elapsed < limit:
                return None
            self.bytes_arrived(step, tree_bytes(self.ckpt_dir / f"global_step_{step}"), now)
            if self.bytes_seen.get(step):
                return None  # the walk is throttled: bytes had come since the last one
            source = (f"{len(m.first_bytes)} saves' first byte within {_minutes(first)}"
                      if learned else f"allowance {_minutes(first)}")
            return (f"save for {_minutes(elapsed)} without a checkpoint byte; first-byte "
                    f"limit {_minutes(limit)} ({source})")
        rule = m.write_rule(self.silence_s)
        if rule is None or not self.save_samples:
            return None
        window, rate, learned = rule
        if now - self.save_samples[0][0] < window:
            return None
        base = [b for t, b in self.save_samples if t <= now - window][-1]
        written = self.save_samples[-1][1] - base
        if written >= rate * window:
            return None
        source = (f"{RATE_SHARE:g} x the slowest rate of {len(m.write_rates)} healthy saves"
                  if learned else f"{UNSEEN_RATE_SHARE:g} x the storage's assumed "
                  f"{m.allow.save_rate_b_s / 1e6:g} MB/s")
        return (f"checkpoint bytes trickle: {written / 1e6:.6g} MB in the last "
                f"{_minutes(window)}, at least {rate * window / 1e6:.6g} MB expected "
                f"({source})")

    def shutdown(self, step: int, waited: float) -> StopRequest | None:
        """After the line of the last step: the trainer only has to exit."""
        allow = self.model.allow.shutdown_s
        if allow <= 0 or waited < allow:
            return None
        saved = self.schedule.save_freq <= 0 or self.is_saved(step)
        if saved:
            return StopRequest("succeeded", f"stopped {_minutes(waited)} after the line of "
                               f"the final step {step}, whose checkpoint is complete (the "
                               f"trainer did not exit within the shutdown allowance "
                               f"{_minutes(allow)})", step)
        return StopRequest("hung", f"hung after the final step {step} (no exit for "
                           f"{_minutes(waited)}; its checkpoint is not complete)", step, True)

    def planned_kill(self) -> StopRequest | None:
        """The rehearsal (hy3rl.rehearsal): once the line of step ``kill_after`` is logged and
        its checkpoint is complete, the trainer is killed (its Ray job stopped) wherever it
        is, so that the next attempt must resume from that checkpoint."""
        if self.kill_after is None or not self.lines:
            return None
        step = self.lines[-1]["step"]
        if step < self.kill_after or not self.is_saved(self.kill_after):
            return None
        return StopRequest("planned_kill", f"killed after the save of step {self.kill_after} (the "
                           f"rehearsal's planned kill; last logged step {step})", step)

    def after_save(self) -> StopRequest | None:
        """After the newest logged save step: stop when the work until the next save does
        not fit in the time left."""
        if self.schedule.save_freq <= 0 or not self.lines:
            return None
        step = self.lines[-1]["step"]
        if (step >= self.schedule.last or not self.schedule.saves(step)
                or step in self.decided_saves):
            return None
        if not self.is_saved(step):
            return None  # async save still finishing: look again at the next poll
        need = self.model.until_save(step, self.schedule)
        left = self.deadline.left()
        if left is None:
            log.warning("watchdog: step %d saved; the time left is unknown: looking again "
                        "at the next poll", step)
            return None
        self.decided_saves.add(step)
        if need is None or math.isinf(left):
            return None
        need += self.margin_s
        why = "the next save needs"
        nxt = self.schedule.next_save(step)
        after = None if nxt is None or nxt >= self.schedule.last \
            else self.model.until_save(nxt, self.schedule)
        if left >= need and (after is None or left - need + self.margin_s < after + self.margin_s):
            # The next save is this job's last: it must fit even when slow.
            # ... and its validation, after which its line lets the next decision be made
            need = self.model.until_save(step, self.schedule, self.model.slow_save()) \
                + self.margin_s + (self.model.validation()[0]
                                   if nxt is not None and self.schedule.validates(nxt) else 0.0)
            why = "the next save (the job's last), reserving for a slow save, needs"
        log.info("watchdog: step %d saved; %.0fs left before the time limit, %s %.0fs",
                 step, left, why, need)
        if left >= need:
            return None
        return StopRequest(
            "stopped_for_time_limit",
            f"stopped after the save of step {step} before the time limit: 0 steps lost "
            f"({left:.0f}s left, {why} {need:.0f}s)", step)

    def timing(self) -> dict[str, Any]:
        """For the attempt record: the startup measured, the model's estimates, the phase
        the attempt was in when it ended."""
        return {"startup_s": None if self.startup_s is None else round(self.startup_s, 1),
                "startup_limit_s": round(self.model.startup_limit(), 1),
                "startup_hung_s": (None if self.startup_hung_s is None
                                   else round(self.startup_hung_s, 1)),
                "startup_marks": dict(self.startup_marks),
                "saves": list(self.saves_seen),
                "node_quiet_s": self.quiet_at_stop, "node_loading": self.loading_at_stop,
                "phase": self.phase, "model": self.model.snapshot()}


def slowest_rate(samples: Sequence[tuple[float, int]], window: float) -> float:
    """The lowest rate (bytes/s) over the spans of ``samples`` ((seconds, bytes), in time
    order) at least ``window`` long, each from a sample to the first one ``window`` after
    it; the whole span's rate when it is shorter."""
    rates = []
    j = 0
    for i, (t, b) in enumerate(samples):
        j = max(j, i + 1)
        while j < len(samples) and samples[j][0] - t < window:
            j += 1
        if j == len(samples):
            break
        rates.append((samples[j][1] - b) / (samples[j][0] - t))
    if rates:
        return min(rates)
    span = samples[-1][0] - samples[0][0]
    return (samples[-1][1] - samples[0][1]) / span if span > 0 else 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.3g} min"
