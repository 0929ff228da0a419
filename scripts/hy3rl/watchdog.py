"""The launcher's eyes on a running attempt: progress, hangs and the time limit.

:class:`Monitor` is polled by the launcher (``hy3rl.launch``) every ``train.watchdog.poll_s``
seconds while the Ray job runs. It re-reads the attempt's metrics log (verl's ``file``
logger, one line per step, written after the step's save) and answers with a
:class:`StopRequest` when the attempt must end:

- **hung**: no new metrics line for the stall limit (``train.watchdog.stall_min``; null
  derives it from this run's measured times: the larger of 30 minutes and three times the
  slowest step plus the slowest save, ``stall_limit_s``), or no first line within
  ``train.watchdog.startup_min`` of the submission. The launcher collects ``ray stack``, the
  driver's stack, the GPU/process lists and the node logs, then stops the Ray job and Ray
  on every node.
- **stopped_for_time_limit**: a complete save of step N whose metrics line is written (verl
  logs a step after saving it), and less time left before the job's end (SLURM's, from
  ``squeue -o %L``; none on one machine) than one more save interval: ``save_freq`` x the
  p95 step time + the slowest save + ``train.time_limit_margin_min`` (``save_interval_s``,
  measured from this run's attempts). The trainer is stopped right there: 0 steps lost.

Times come from verl's own metrics: ``timing_s/step`` (verl's ``marked_timer("step")``
wraps the save) plus ``timing_s/testing`` (validation runs between steps), and
``timing_s/save_checkpoint``. Standard library only (it runs in the launcher's process).
"""

from __future__ import annotations

import logging
import math
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hy3rl.verl_log import read_metrics

log = logging.getLogger("hy3rl.watchdog")

MIN_STALL_S = 30 * 60.0
STALL_FACTOR = 3.0
STEP_KEYS = ("timing_s/step", "timing_s/testing")
SAVE_KEY = "timing_s/save_checkpoint"


@dataclass(frozen=True)
class StopRequest:
    """Why the watchdog ends the attempt: ``outcome`` (an attempt record outcome),
    ``message`` (its exit reason), ``step`` (the last logged step), ``diagnose`` (collect
    stacks and process lists before the teardown)."""

    outcome: str
    message: str
    step: int | None
    diagnose: bool = False


# --------------------------------------------------------------------------- measured times


def step_seconds(lines: Iterable[Mapping[str, Any]]) -> list[float]:
    """Per logged training step: ``timing_s/step`` + ``timing_s/testing`` (lines without a
    step time, e.g. the validation before training, are left out)."""
    out = []
    for rec in lines:
        data = rec.get("data") or {}
        step = data.get("timing_s/step")
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            testing = data.get("timing_s/testing")
            out.append(float(step) + (float(testing) if isinstance(testing, (int, float))
                                      else 0.0))
    return out


def save_seconds(lines: Iterable[Mapping[str, Any]]) -> list[float]:
    """``timing_s/save_checkpoint`` of every step that saved."""
    out = []
    for rec in lines:
        value = (rec.get("data") or {}).get(SAVE_KEY)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(float(value))
    return out


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def stall_limit_s(stall_min: float | None, steps: list[float], saves: list[float]) -> float | None:
    """Seconds without progress that make a hang. ``stall_min`` 0: never (None); a number:
    that; None: max(30 min, 3 x (slowest step + slowest save)) of what this run measured."""
    if stall_min == 0:
        return None
    if stall_min is not None:
        return float(stall_min) * 60.0
    slowest = (max(steps) if steps else 0.0) + (max(saves) if saves else 0.0)
    return max(MIN_STALL_S, STALL_FACTOR * slowest)


def save_interval_s(save_freq: int, steps: list[float], saves: list[float],
                    margin_s: float) -> float | None:
    """Time one more save needs: ``save_freq`` x p95 step + slowest save + margin. None
    when nothing is measured yet or the run does not save."""
    if save_freq <= 0 or not steps:
        return None
    return save_freq * p95(steps) + (max(saves) if saves else 0.0) + margin_s


# --------------------------------------------------------------------------- the job's end


def parse_time_left(text: str) -> float | None:
    """squeue's ``%L`` (``[D-]HH:MM:SS``, ``MM:SS``, ``UNLIMITED``, ``NOT_SET``,
    ``INVALID``) in seconds; None for no limit or an unknown form. ``INVALID`` is what squeue
    prints when the time left is negative, the normal case at the time limit's SIGTERM:
    0 (no time left), so that the signal is classified as the time limit, never as a
    preemption."""
    text = text.strip()
    if text == "INVALID":
        return 0.0
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def slurm_time_left(job_id: str) -> float | None:
    """Seconds until SLURM ends the job (its time limit; follows ``scontrol update``), None
    when it cannot be told (logged)."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%L"],
                              capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("squeue -j %s -o %%L: %s (time left unknown)", job_id, exc)
        return None
    if proc.returncode != 0:
        log.warning("squeue -j %s -o %%L exited %d: %s (time left unknown)", job_id,
                    proc.returncode, proc.stderr.strip())
        return None
    return parse_time_left(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "")


# --------------------------------------------------------------------------- the monitor


@dataclass
class Monitor:
    """Polled by the launcher while the Ray job runs (see the module docstring).

    ``metrics``: the attempt's metrics log. ``history``: metrics lines of this run's earlier
    attempts (their times count). ``is_saved(step)``: whether ``global_step_<step>`` is a
    complete checkpoint. ``time_left()``: seconds until the job's end, None for none.
    ``clock``: monotonic seconds (tests pass their own)."""

    metrics: Path
    save_freq: int
    total_steps: int
    stall_min: float | None
    startup_min: float
    margin_s: float
    is_saved: Callable[[int], bool]
    time_left: Callable[[], float | None]
    history: list[dict[str, Any]] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    started: float | None = None
    last_progress: float | None = None
    seen: int = 0
    last_step: int | None = None
    lines: list[dict[str, Any]] = field(default_factory=list)
    checked_saves: set[int] = field(default_factory=set)

    def start(self) -> None:
        """The Ray job was submitted: the startup clock runs from now."""
        self.started = self.clock()

    def measured(self) -> tuple[list[float], list[float]]:
        every = [*self.history, *self.lines]
        return step_seconds(every), save_seconds(every)

    def stall_limit(self) -> float | None:
        return stall_limit_s(self.stall_min, *self.measured())

    def poll(self) -> StopRequest | None:
        """Look at the metrics log once; a StopRequest when the attempt must end."""
        now = self.clock()
        if self.started is None:
            self.started = now
        try:
            self.lines = read_metrics(self.metrics)
        except Exception as exc:  # a bad line must not stop the watch; verl_log names it
            log.warning("watchdog: %s", exc)
        if len(self.lines) > self.seen:
            self.seen = len(self.lines)
            self.last_step = self.lines[-1]["step"]
            self.last_progress = now
        saved = self.after_save()
        if saved is not None:
            return saved
        return self.hang(now)

    def hang(self, now: float) -> StopRequest | None:
        if self.last_progress is None:
            if self.startup_min <= 0:
                return None
            waited, limit = now - self.started, self.startup_min * 60.0
            if waited < limit:
                return None
            return StopRequest("hung", f"hung before its first step (no metrics line "
                               f"{_minutes(waited)} after the submission; "
                               f"train.watchdog.startup_min={self.startup_min:g})", None, True)
        limit = self.stall_limit()
        waited = now - self.last_progress
        if limit is None or waited < limit:
            return None
        step = self.last_step
        return StopRequest("hung", f"hung at step {(step or 0) + 1} (no progress for "
                           f"{_minutes(waited)}; last logged step {step}; stall limit "
                           f"{_minutes(limit)})", step, True)

    def after_save(self) -> StopRequest | None:
        """After the newest logged save step: stop when one more interval does not fit."""
        if self.save_freq <= 0 or not self.lines:
            return None
        step = self.lines[-1]["step"]
        if step >= self.total_steps or step % self.save_freq or step in self.checked_saves:
            return None
        if not self.is_saved(step):
            return None  # async save still finishing: look again at the next poll
        self.checked_saves.add(step)
        need = save_interval_s(self.save_freq, *self.measured(), self.margin_s)
        left = self.time_left()
        if need is None or left is None:
            return None
        log.info("watchdog: step %d saved; %.0fs left before the time limit, one more save "
                 "interval needs %.0fs", step, left, need)
        if left >= need:
            return None
        return StopRequest(
            "stopped_for_time_limit",
            f"stopped after the save of step {step} before the time limit: 0 steps lost "
            f"({left:.0f}s left, one more save interval needs {need:.0f}s)", step)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.3g} min"
