"""The training-health guard: ``train.health``'s rules over verl's per-step metrics.

A pure, incremental watcher. It is fed the records verl's ``file`` logger writes, in the form
:func:`hy3rl.verl_log.read_metrics` returns them (``{"step": N, "data": {key: value}}``), in
the order they arrive, and returns :class:`Event` s: the rule, the step, the action (``warn``
or ``stop``), the values that crossed the threshold and a one-line message naming all three.
:func:`last_healthy` names the newest complete checkpoint whose steps passed every ``stop``
rule. Format and thresholds: docs/formats/train.md "Training health".

How the launcher (hy3rl.train) calls it: one :class:`Watcher` per attempt, fed the merged
logs of the lineage so far (baselines, the best so far; their events are history, acted on
by no one), then wrapped with the watchdog's monitor in a :class:`Guard`, which the launcher
polls in the monitor's place. The guard feeds the watcher the lines the monitor read, hands
each new event to the launcher (``warn``: logged, recorded, notified) and ends the attempt
with outcome ``unhealthy`` on a ``stop`` event: at once for a rule whose ``when`` is
``at_once`` (the default but for ``validation``: the save after the step a stop fires is
never the last healthy checkpoint), else right after the next complete save (the first
save step at or after the step where the rule fired); an ``at_once`` stop while another
waits for its save stops at once.

Semantics:

- A value is a number, or a string that reads as one ("nan", "NaN", "inf", "-Infinity"):
  verl's file logger writes JSON's ``NaN``/``Infinity`` (Python's ``json`` reads them as
  floats) and other writers quote them. A bool or any other string counts as absent.
- A rule whose metric is absent at a step (or, for every rule but ``nonfinite``, not
  finite) ignores that step: it neither counts towards the rule's run of consecutive steps
  nor breaks it. verl logs some metrics only on some steps (validation every test_freq
  steps; training/rollout_probs_diff_* is NaN when a batch has no response token), and a
  missing value is not evidence of health. "Consecutive" counts logged steps that carry the
  metric, so a gap in the steps (steps lost to a crash) does not break a run either.
- A run fires once, at the step where it reaches the rule's length; it fires again only
  after a value on the healthy side ended it. An event's ``first_step`` is the first step of
  the run (or window) that fired: the trainer was already unhealthy there.
- A step at or before the last one fed is a resume (verl restarts from a checkpoint and logs
  its steps again): the steps after it are dropped, as the merged log drops them, and the
  rules' states are rebuilt from the steps kept; the events of dropped steps leave
  :attr:`Watcher.events`. A validation-only line (every key ``val-*``) at an earlier step
  joins that step's line (verl validates the resumed step before training), as
  :func:`hy3rl.verl_log.merge_metrics` merges it. A step fed a second time returns only the
  events not returned before.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hy3rl.settings import (
    Health,
    HealthAbove,
    HealthEntropy,
    HealthLength,
    HealthNonfinite,
    HealthRewardFall,
    HealthRewardFloor,
    HealthValidation,
)
from hy3rl.verl_log import NONFINITE, validation_only
from hy3rl.verl_log import metric_value as logged_value


def metric_value(raw: Any) -> float | None:
    """A logged metric value as a float (NaN and inf kept); None when absent or not a
    number (a bool, a string that does not read as a number, a list...)."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            return None
    return None


def _shown(v: float) -> float | str:
    """A value as an event holds it: finite as a float, else its name (JSON has no NaN)."""
    return v if math.isfinite(v) else str(v)


@dataclass(frozen=True)
class Event:
    """A rule that fired: ``values`` are the (step, value) pairs that crossed its threshold
    (the run, the window, or the one step), ``reference`` the value they were compared to
    (the threshold, the baseline, the best so far)."""

    rule: str
    action: str  # warn | stop
    step: int
    first_step: int
    metric: str
    values: tuple[tuple[int, float | str], ...]
    reference: float | None
    message: str
    # "fired": the rule's metric crossed its threshold; "blind": the metric did not come
    # (absent or null) in train.health.blind_lines logged lines in a row (always a warn)
    kind: str = "fired"


def _fmt(v: float | str) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _steps(pairs: Iterable[tuple[int, Any]]) -> str:
    pairs = list(pairs)
    if len(pairs) > 6:
        pairs = pairs[:3] + [(None, "...")] + pairs[-2:]
    return ", ".join(str(v) if s is None else f"{_fmt(v)}@{s}" for s, v in pairs)


class _Rule:
    """One rule's state over the steps fed so far."""

    def __init__(self, name: str, section: Any) -> None:
        self.name = name
        self.action = section.action
        self.section = section
        # the key it watches (the first, for a rule over several): what describes_checkpoint
        # maps to the checkpoint a run under way may call sick
        self.metric: str = getattr(section, "metric", None) or next(
            iter(getattr(section, "metrics", None) or []), "")

    def feed(self, step: int, data: Mapping[str, Any]) -> list[Event]:
        raise NotImplementedError

    def open_from(self) -> int | None:
        """The earliest ``first_step`` an event of this rule not raised yet could have among
        the steps fed (a run of crossed values under way, a window that may fall); None
        when a future event can only start at a step not fed yet."""
        return None

    def _event(self, step: int, metric: str, values: list[tuple[int, float]],
               reference: float | None, what: str) -> Event:
        shown = tuple((s, _shown(v)) for s, v in values)
        first = values[0][0] if values else step
        msg = (f"health rule {self.name} ({self.action}) fired at step {step}: {metric} "
               f"{what}: {_steps(shown)}")
        return Event(self.name, self.action, step, first, metric, shown, reference, msg)


class _Nonfinite(_Rule):
    section: HealthNonfinite

    def feed(self, step: int, data: Mapping[str, Any]) -> list[Event]:
        out = []
        for key in self.section.metrics:
            raw = logged_value(data, key)
            v = metric_value(raw)
            if v is not None and not math.isfinite(v):
                what = ("is not finite (logged as null: verl's file logger writes NaN and "
                        "±inf as null)" if raw is NONFINITE else "is not finite")
                out.append(self._event(step, key, [(step, v)], None, what))
        return out


class _Consecutive(_Rule):
    """A run of ``steps`` consecutive logged values on the unhealthy side (``crossed``) of
    ``reference``."""

    def __init__(self, name: str, section: Any, steps: int,
                 crossed: Callable[[float], bool] | None = None,
                 reference: float | None = None, what: str = "") -> None:
        super().__init__(name, section)
        self.steps = steps
        self._crossed, self._reference, self._what = crossed, reference, what
        self.run: list[tuple[int, float]] = []

    def crossed(self, v: float) -> bool:
        assert self._crossed is not None
        return self._crossed(v)

    def what(self) -> str:
        return self._what

    def reference(self) -> float | None:
        return self._reference

    def finite(self, data: Mapping[str, Any]) -> float | None:
        v = metric_value(data.get(self.metric))
        return v if v is not None and math.isfinite(v) else None

    def open_from(self) -> int | None:
        return self.run[0][0] if self.run else None

    def feed(self, step: int, data: Mapping[str, Any]) -> list[Event]:
        v = self.finite(data)
        if v is None:
            return []
        if not self.crossed(v):
            self.run = []
            return []
        self.run.append((step, v))
        if len(self.run) == self.steps:
            return [self._event(step, self.metric, self.run, self.reference(),
                                f"{self.what()} for {self.steps} logged steps")]
        return []


def _above(name: str, s: HealthAbove) -> _Consecutive:
    """Drift, clip ratio: above ``max``."""
    return _Consecutive(name, s, s.steps, lambda v: v > s.max, s.max, f"above {s.max:g}")


def _at_most(name: str, s: HealthRewardFloor) -> _Consecutive:
    """The reward at or below its minimum."""
    return _Consecutive(name, s, s.steps, lambda v: v <= s.minimum, s.minimum,
                        f"at or below its minimum {s.minimum:g}")


def _below(name: str, s: HealthEntropy) -> _Consecutive:
    """The entropy floor (never crossed without one)."""
    return _Consecutive(name, s, s.steps, lambda v: s.floor is not None and v < s.floor,
                        s.floor, f"below the floor {s.floor:g}" if s.floor is not None else "")


class _Fall(_Rule):
    """The mean of the latest ``window`` values below (1 - max_fall) x the mean of the
    ``window`` values before them; with ``rise``, above (1 + max_rise) x it."""

    section: HealthEntropy

    def __init__(self, name: str, section: HealthEntropy, rise: bool = False) -> None:
        super().__init__(name, section)
        self.rise = rise
        self.limit = section.max_rise if rise else section.max_fall
        self.values: deque[tuple[int, float]] = deque(maxlen=2 * section.window)
        self.firing = False

    def open_from(self) -> int | None:
        """A later window holds the latest ``window - 1`` values fed."""
        k = self.section.window - 1
        if self.limit is None or k == 0 or not self.values:
            return None
        return self.values[-min(k, len(self.values))][0]

    def feed(self, step: int, data: Mapping[str, Any]) -> list[Event]:
        v = metric_value(data.get(self.section.metric))
        if v is None or not math.isfinite(v) or self.limit is None:
            return []
        self.values.append((step, v))
        w = self.section.window
        if len(self.values) < 2 * w:
            return []
        before = sum(x for _, x in list(self.values)[:w]) / w
        latest = list(self.values)[w:]
        now = sum(x for _, x in latest) / w
        if self.rise:
            moved = before > 0 and now > (1 + self.limit) * before
            word, way = "rose", "above"
        else:
            moved = before > 0 and now < (1 - self.limit) * before
            word, way = "fell", "below"
        fired = moved and not self.firing
        self.firing = moved
        if not fired:
            return []
        return [self._event(step, self.section.metric, latest, before,
                            f"mean {now:.4g} of the latest {w} logged steps {word} more than "
                            f"{self.limit:g} {way} the mean {before:.4g} of the {w} before")]


class _RewardFall(_Rule):
    """The mean of the latest ``window`` values more than ``max_drop`` below the best mean of
    ``window`` consecutive values so far (HealthRewardFall)."""

    section: HealthRewardFall

    def __init__(self, name: str, section: HealthRewardFall) -> None:
        super().__init__(name, section)
        self.values: deque[tuple[int, float]] = deque(maxlen=section.window)
        self.best: tuple[int, float] | None = None  # (last step of the window, its mean)
        self.firing = False

    def below(self) -> list[tuple[int, float]]:
        """The values of the latest window more than ``max_drop`` below the best mean so far:
        the steps that fell (an event's values; its first step, the first sick one)."""
        if self.best is None:
            return []
        return [(s, x) for s, x in self.values if x < self.best[1] - self.section.max_drop]

    def open_from(self) -> int | None:
        """A later window holds the latest ``window - 1`` values fed: the first of them that
        already fell (against the best so far) may be a later event's first step."""
        k = self.section.window - 1
        if k == 0:
            return None
        kept = {s for s, _ in list(self.values)[-k:]}
        return next((s for s, _ in self.below() if s in kept), None)

    def feed(self, step: int, data: Mapping[str, Any]) -> list[Event]:
        v = metric_value(data.get(self.section.metric))
        if v is None or not math.isfinite(v):
            return []
        self.values.append((step, v))
        w = self.section.window
        if len(self.values) < w:
            return []
        now = sum(x for _, x in self.values) / w
        if self.best is None or now > self.best[1]:
            self.best = (step, now)
        fell = self.best[1] - now > self.section.max_drop
        fired = fell and not self.firing
        self.firing = fell
        if not fired:
            return []
        return [self._event(step, self.section.metric, self.below(), self.best[1],
                            f"mean {now:.4g} of the latest {w} logged steps more than "
                            f"{self.section.max_drop:g} below the run's best mean "
                            f"{self.best[1]:.4g} of {w} (to step {self.best[0]}); the steps "
                            "that fell")]


class _Length(_Consecutive):
    section: HealthLength

    def __init__(self, name: str, section: HealthLength, cap: float | None = None) -> None:
        super().__init__(name, section, section.steps)
        self.early: list[float] = []
        self.baseline: float | None = None
        # the composed data.max_response_length: a mean near it is an explosion whatever
        # the baseline (max_ratio x a large baseline is the cap itself)
        self.cap_limit = (section.max_cap_fraction * cap
                          if cap and section.max_cap_fraction is not None else None)

    def feed(self, step: int, data: Mapping[str, Any]) -> list[Event]:
        if self.baseline is None:
            v = self.finite(data)
            if v is not None:
                self.early.append(v)
                if len(self.early) == self.section.baseline_steps:
                    self.baseline = sum(self.early) / len(self.early)
            return []
        return super().feed(step, data)

    def crossed(self, v: float) -> bool:
        assert self.baseline is not None
        if self.cap_limit is not None and v > self.cap_limit:
            return True
        if self.baseline <= 0:
            return False
        ratio = v / self.baseline
        return ratio < self.section.min_ratio or ratio > self.section.max_ratio

    def what(self) -> str:
        cap = (f", or above {self.cap_limit:.4g} ({self.section.max_cap_fraction:g} x "
               "data.max_response_length)" if self.cap_limit is not None else "")
        return (f"outside {self.section.min_ratio:g}-{self.section.max_ratio:g} x its baseline "
                f"{self.baseline:.4g} (the mean of its first {self.section.baseline_steps} "
                f"logged steps){cap}")

    def reference(self) -> float | None:
        return self.baseline


class _Validation(_Rule):
    """A validation more than ``k`` standard errors below the run's best so far, in
    ``validations`` validations in a row; fires once an episode: again only after a
    validation came back within the line. The defaults come from
    benchmarks/bench_health.py (noisy copies of the published curve, whose own dips of 2-3
    points and the best of noisy values, biased up, make k = 3 warn on 19 % of healthy
    200-step runs and 44 % of 300-step runs)."""

    section: HealthValidation

    def __init__(self, name: str, section: HealthValidation) -> None:
        super().__init__(name, section)
        self.best: tuple[int, float] | None = None
        self.run: list[tuple[int, float]] = []
        self.firing = False

    def open_from(self) -> int | None:
        return self.run[0][0] if self.run else None

    def feed(self, step: int, data: Mapping[str, Any]) -> list[Event]:
        v = metric_value(data.get(self.section.metric))
        if v is None or not math.isfinite(v):
            return []
        out = []
        below = False
        if self.best is not None:
            b = self.best[1]
            se = validation_se(b, v, self.section.responses)
            below = b - v > self.section.k * se
        if not below:
            self.run, self.firing = [], False
        else:
            self.run.append((step, v))
            if len(self.run) >= self.section.validations and not self.firing:
                self.firing = True
                n = len(self.run)
                out.append(self._event(
                    step, self.section.metric, list(self.run), b,
                    f"{b - v:.4g} below the run's best {b:.4g} (step {self.best[0]}), more than "
                    f"{self.section.k:g} standard errors ({se:.4g} each, "
                    f"{self.section.responses} responses)"
                    + (f" in {n} validations in a row" if n > 1 else "")))
        if self.best is None or v > self.best[1]:
            self.best = (step, v)
        return out


def validation_se(best: float, acc: float, responses: int) -> float:
    """The standard error of the difference of two accuracies over ``responses`` scored
    responses each (binomial; for a fixed problem set sampled several times an upper bound
    of the sampling error)."""
    var = max(best * (1 - best), 0.0) + max(acc * (1 - acc), 0.0)
    return math.sqrt(var / responses)


# Validation lines in a row without the validation rule's key before it is blind (verl
# validates every test_freq steps: each such line is one chance to judge).
BLIND_VALIDATIONS = 2


class _Coverage:
    """What one rule could judge of one watched key: the logged lines where the key had a
    value the rule reads (``judged``: any value, null included, for ``nonfinite``; a finite
    one for the threshold rules, where null is the ``nonfinite`` rule's), and the run of
    lines in a row without one (for the validation rule, of lines holding any ``val-*`` key:
    verl validates every test_freq steps). A run of ``lines`` raises a ``blind`` warn naming
    the key, once until the key comes again."""

    def __init__(self, rule: str, key: str, lines: int, *, nonfinite: bool,
                 validation: bool) -> None:
        self.rule, self.key = rule, key
        self.nonfinite, self.validation = nonfinite, validation
        self.lines = BLIND_VALIDATIONS if validation else lines
        self.judged = 0
        self.run: list[int] = []
        self.warned = False

    def feed(self, step: int, data: Mapping[str, Any]) -> Event | None:
        if self.validation and not any(str(k).startswith("val-") for k in data):
            return None  # no validation at this step: nothing to judge
        raw = logged_value(dict(data), self.key)
        v = metric_value(raw)
        if v is not None and (self.nonfinite or math.isfinite(v)):
            self.judged += 1
            self.run, self.warned = [], False
            return None
        self.run.append(step)
        if len(self.run) < self.lines or self.warned:
            return None
        self.warned = True
        what = "validation lines" if self.validation else "logged lines"
        how = "absent" if self.nonfinite else "absent or null"
        msg = (f"health rule {self.rule} is blind: {self.key} {how} in the last "
               f"{len(self.run)} {what} (steps {self.run[0]}-{self.run[-1]}); it judged "
               f"{self.judged} step(s) so far and cannot fire while its metric does not come "
               "(a renamed key, a metric the configuration switched off)")
        return Event(self.rule, "warn", step, self.run[0], self.key, (), None, msg, "blind")


def build_rules(health: Health, response_cap: float | None = None) -> list[_Rule]:
    """The rules of ``train.health`` that are not ``ignore``, in the schema's order
    (``response_cap``: the composed data.max_response_length, for response_length)."""
    out: list[_Rule] = []
    for name, section in health.rules():
        if isinstance(section, HealthNonfinite):
            out.append(_Nonfinite(name, section))
        elif isinstance(section, HealthAbove):
            out.append(_above(name, section))
        elif isinstance(section, HealthEntropy):
            out += [_below(name, section), _Fall(name, section),
                    _Fall(name, section, rise=True)]
        elif isinstance(section, HealthLength):
            out.append(_Length(name, section, response_cap))
        elif isinstance(section, HealthRewardFloor):
            out.append(_at_most(name, section))
        elif isinstance(section, HealthRewardFall):
            out.append(_RewardFall(name, section))
        elif isinstance(section, HealthValidation):
            out.append(_Validation(name, section))
        else:  # a new section in settings.Health without a rule here
            raise TypeError(f"train.health.{name}: no rule implements {type(section).__name__}")
    return out


class Watcher:
    """The guard over one run lineage (see the module docstring): :meth:`feed` records in
    arrival order; :attr:`events` is every event of the steps kept, in step order."""

    def __init__(self, health: Health, response_cap: float | None = None) -> None:
        self.health = health
        self.response_cap = response_cap
        self.records: dict[int, dict[str, Any]] = {}
        self.events: list[Event] = []
        self._rules = build_rules(health, response_cap)
        self._coverage = [
            _Coverage(name, key, health.blind_lines, nonfinite=name == "nonfinite",
                      validation=isinstance(getattr(health, name), HealthValidation))
            for name, key in health.watched()]

    def judged(self) -> dict[str, int]:
        """Rule name -> the logged lines it judged (for a rule over several keys, the fewest
        of any of them): the report's coverage column."""
        out: dict[str, int] = {}
        for c in self._coverage:
            out[c.rule] = min(out.get(c.rule, c.judged), c.judged)
        return out

    def feed(self, record: Mapping[str, Any]) -> list[Event]:
        """Feed one ``{"step": N, "data": {...}}`` record; the events it raises."""
        step, data = record["step"], dict(record.get("data") or {})
        if not self.records or step > max(self.records):
            self.records[step] = data
            new = [e for rule in self._rules for e in rule.feed(step, data)]
            new += [e for c in self._coverage if (e := c.feed(step, data)) is not None]
            self.events += new
            return new
        old = self.records.get(step)
        if old is not None and validation_only(data) and not validation_only(old):
            data = {**old, **data}
        kept = {s: d for s, d in self.records.items() if s < step}
        kept[step] = data
        before = self.events
        self._replay(kept)
        return [e for e in self.events if e.step == step and e not in before]

    def _replay(self, records: dict[int, dict[str, Any]]) -> None:
        # built apart, then swapped: a reader in another thread (retention asks for the
        # last healthy checkpoint) never sees the events half rebuilt
        fresh = Watcher(self.health, self.response_cap)
        for step in sorted(records):
            fresh.feed({"step": step, "data": records[step]})
        self.records, self._rules, self.events = fresh.records, fresh._rules, fresh.events
        self._coverage = fresh._coverage

    def open_from(self) -> int | None:
        """The earliest checkpoint a ``stop`` rule may still call sick over the steps fed
        (``_Rule.open_from``, the first step of a run under way, as
        :func:`describes_checkpoint` maps it); None when none can. Retention keeps the
        checkpoint before it: a run of drift that began before a save may fire after it."""
        return min((describes_checkpoint(r.metric, s) for r in list(self._rules)
                    if r.action == "stop" if (s := r.open_from()) is not None), default=None)


RESPONSE_CAP = "data.max_response_length"


def response_cap(plan: Mapping[str, Any] | None) -> float | None:
    """The composed data.max_response_length of preflight's plan (its ``effective`` values),
    the cap the response_length rule's ``max_cap_fraction`` is a fraction of; None when the
    plan has none."""
    value = ((plan or {}).get("effective") or {}).get(RESPONSE_CAP)
    if isinstance(value, bool):
        return None
    try:
        return float(value) if value is not None and float(value) > 0 else None
    except (TypeError, ValueError):
        return None


def watch(health: Health, records: Iterable[Mapping[str, Any]],
          response_cap: float | None = None) -> list[Event]:
    """Every event of ``records`` fed in order (the events of steps kept)."""
    w = Watcher(health, response_cap)
    for rec in records:
        w.feed(rec)
    return w.events


UNHEALTHY = "unhealthy"  # the attempt record's outcome (and exit_reason) of a stop


def stopped_when(rule: str, after_save: int | None, when: str = "next_save") -> str:
    """When the guard stopped the trainer, in words (``when``: the rule's
    ``train.health.<rule>.when``)."""
    if after_save is not None:
        return f"right after the complete save of step {after_save}"
    if rule == "nonfinite":
        return "at once (a non-finite value)"
    if when == "at_once":
        return f"at once (train.health.{rule}.when: at_once)"
    return "at once (the run saves no checkpoint to wait for)"


def stop_when(health: Health, rule: str) -> str:
    """``train.health.<rule>.when`` (``at_once`` for a rule without one)."""
    return getattr(getattr(health, rule, None), "when", "at_once")


class Guard:
    """The watcher beside the watchdog (module doc). ``monitor``: the watchdog's
    :class:`hy3rl.watchdog.Monitor` (polled first; its ``lines`` are what this feeds);
    ``on_event(event)``: each new event, as it arrives; ``next_save(step)``: the first save
    step at or after ``step`` (None: the run does not save); ``is_saved(step)``: whether that
    checkpoint is complete. After the stop, :attr:`stop` is the event and
    :attr:`stopped_after_save` the save it waited for (None: stopped at once)."""

    def __init__(self, watcher: Watcher, monitor: Any, *,
                 on_event: Callable[[Event], None],
                 next_save: Callable[[int], int | None],
                 is_saved: Callable[[int], bool]) -> None:
        self.watcher, self.monitor = watcher, monitor
        self.on_event, self.next_save, self.is_saved = on_event, next_save, is_saved
        self.fed = 0
        self.pending: Event | None = None
        self.save_step: int | None = None
        self.stop: Event | None = None
        self.stopped_after_save: int | None = None

    def start(self) -> None:
        self.monitor.start()

    def blind(self) -> None:
        """The launcher cannot see the trainer's output (the dashboard is silent): the
        monitor's :meth:`hy3rl.watchdog.Monitor.blind`. The guard judges only the lines the
        monitor read, so it has nothing of its own to suspend."""
        self.monitor.blind()

    def poll(self) -> Any:
        """The monitor's poll, then the guard's: a ``StopRequest`` (hy3rl.watchdog) with
        outcome ``unhealthy`` wins over the monitor's own."""
        from hy3rl.watchdog import StopRequest

        request = self.monitor.poll()
        self._feed(self.monitor.lines)
        e = self.pending
        if e is None or (self.save_step is not None and not self.is_saved(self.save_step)):
            return request
        self.stop, self.stopped_after_save = e, self.save_step
        when = stopped_when(e.rule, self.save_step, stop_when(self.watcher.health, e.rule))
        return StopRequest(UNHEALTHY, f"{e.message}; the trainer was stopped {when}",
                           self.monitor.last_step)

    def _feed(self, lines: list[dict[str, Any]]) -> None:
        for rec in lines[self.fed:]:
            for event in self.watcher.feed(rec):
                self.on_event(event)
                # A stop whose rule says at_once (a non-finite value by default) stops at
                # once, also while another stop waits for its save: every update until then
                # trains on what it found (that stop's event stays in the record, and
                # last_healthy counts from the first sick step)
                at_once = stop_when(self.watcher.health, event.rule) == "at_once"
                waiting = self.pending is not None and self.save_step is not None
                if event.action == "stop" and (self.pending is None or (waiting and at_once)):
                    self.pending = event
                    self.save_step = None if at_once else self.next_save(event.step)
        self.fed = max(self.fed, len(lines))

    def finish(self) -> bool:
        """After the trainer ended (whatever ended it): feed the lines the last poll did not
        see; True when a stop rule fired in this attempt (it is unhealthy, also when the
        trainer ended before the guard could stop it: then :attr:`stopped_after_save` is
        the awaited save if it is complete, else None)."""
        from hy3rl.verl_log import read_metrics

        try:
            lines = read_metrics(self.monitor.metrics)
        except Exception:  # a bad line: verl_log names it when the logs are merged
            lines = self.monitor.lines
        self._feed(lines)
        if self.pending is not None and self.stop is None:
            self.stop = self.pending
            s = self.save_step
            self.stopped_after_save = s if s is not None and self.is_saved(s) else None
        return self.stop is not None


# Which weights a metric of step s describes. In verl's v1 trainer (verl@220e903,
# verl/trainer/ppo/v1/trainer_base.py: generate, update, save, validate, log) step s
# generates with the weights of checkpoint s-1: the rollout-side metrics (the reward,
# entropy, response lengths and clip ratio, the rollout/training drift) describe checkpoint
# s-1; the update's loss and gradient norm, and the validation after the save, describe
# checkpoint s. A key not named here counts as rollout-side: naming a checkpoint one step
# too early costs a few steps, one too late is a sick checkpoint whose rewind collapses
# again at the same step (issue 41's loop).
AFTER_UPDATE = ("actor/pg_loss", "actor/grad_norm")


def describes_checkpoint(metric: str, step: int) -> int:
    """The checkpoint step whose weights ``metric`` logged at ``step`` describes."""
    after = metric in AFTER_UPDATE or metric.startswith("val-")
    return step if after else step - 1


def last_healthy(checkpoint_steps: Iterable[int], events: Iterable[Event],
                 open_from: int | None = None) -> int | None:
    """The newest of ``checkpoint_steps`` (the complete checkpoints) before the first
    checkpoint every ``stop`` event's run or window describes (its first step, or the step
    before for a rollout-side metric: :func:`describes_checkpoint`), i.e. whose weights
    passed every stop rule; None when there is none. ``warn`` events do not count.
    ``open_from`` (:meth:`Watcher.open_from`, already a checkpoint step): also before it
    (the checkpoint retention must keep while a stop rule may still fire over steps already
    logged)."""
    firsts = [describes_checkpoint(e.metric, e.first_step) for e in events
              if e.action == "stop"]
    bound = min(firsts + ([open_from] if open_from is not None else []), default=None)
    ok = [s for s in checkpoint_steps if bound is None or s < bound]
    return max(ok) if ok else None


# --------------------------------------------------------------------------- verl's metric keys


@dataclass(frozen=True)
class VerlMetric:
    """A metric key verl logs (``<name>`` marks a part verl fills in), with where verl@220e903
    writes it: (file in the verl checkout, a text that file holds). Preflight reads the
    pinned checkout for each text, so a verl that stopped logging a key is caught."""

    key: str
    sources: tuple[tuple[str, str], ...]
    needs_rollout_log_probs: bool = False
    # not logged under algorithm.rollout_correction.bypass_mode (the v1 trainer's
    # _compute_old_log_prob takes the rollout's log-probs and returns before computing it)
    not_in_bypass_mode: bool = False

    def matches(self, key: str) -> bool:
        parts = re.split(r"(<[a-z_]+>)", self.key)
        pattern = "".join(r"[^/]+" if p.startswith("<") else re.escape(p) for p in parts)
        return re.fullmatch(pattern, key) is not None


_LOSSES = "verl/workers/utils/losses.py"
# the v1 trainer: what main_ppo runs at the pin (trainer.use_v1; the legacy ray_trainer.py is
# main_ppo_v0's)
_TRAINER = "verl/trainer/ppo/v1/trainer_base.py"
_ALGOS = "verl/trainer/ppo/core_algos.py"
_METRICS = "verl/trainer/ppo/metric_utils.py"
_DEBUG = "verl/utils/debug/metrics.py"
_CORR = "verl/trainer/ppo/rollout_corr_helper.py"
_CORR_PREFIX = (_CORR, 'f"rollout_corr/{key}"')

# Read at verl@220e903 (the pinned commit); the texts are what these files hold there.
VERL_METRICS: tuple[VerlMetric, ...] = (
    # the engine workers' loss (Metric aggregation), renamed "actor/..." by the trainer
    VerlMetric("actor/pg_loss", ((_LOSSES, 'metrics["actor/pg_loss"]'),)),
    # compute_variance_proxy_metrics reads it from the actor's output
    VerlMetric("actor/grad_norm", ((_TRAINER, 'metrics.get("actor/grad_norm"'),)),
    # _compute_old_log_prob, after the bypass-mode return
    VerlMetric("actor/entropy", ((_TRAINER, '"actor/entropy": entropy_agg'),
                                 (_TRAINER, "if bypass_recomputing_logprobs:")), False, True),
    VerlMetric("actor/pg_clipfrac", ((_ALGOS, '"actor/pg_clipfrac":'),)),
    # compute_data_metrics
    *(VerlMetric(f"critic/{k}", ((_METRICS, f'"critic/{k}":'),)) for k in (
        "score/mean", "score/max", "score/min", "rewards/mean", "rewards/max", "rewards/min")),
    *(VerlMetric(f"response_length/{k}", ((_METRICS, f'"response_length/{k}":'),))
      for k in ("mean", "max", "min", "clip_ratio")),
    # calculate_debug_metrics, called by _compute_old_log_prob with calculate_log_probs (not
    # in bypass mode, which returns before it, as before actor/entropy)
    *(VerlMetric(f"training/rollout_probs_diff_{k}",
                 ((_DEBUG, f'"training/rollout_probs_diff_{k}":'),
                  (_TRAINER, "metrics.update(calculate_debug_metrics(data))")), True, True)
      for k in ("mean", "max", "std")),
    # compute_rollout_corr_metrics_from_logprobs / the IS weights, prefixed rollout_corr/
    *(VerlMetric(f"rollout_corr/{k}", ((_CORR, f'metrics["{k}"]'), _CORR_PREFIX), True)
      for k in ("kl", "k3_kl", "training_ppl", "rollout_ppl", "rollout_is_mean",
                "rollout_is_max", "rollout_is_eff_sample_size")),
    # _validate: val-core/<data_source>/<variable>/mean@<n> (process_validation_metrics)
    VerlMetric("val-core/<data_source>/<variable>/mean@<n>",
               ((_TRAINER, 'metric_sec = "val-core"'), (_METRICS, 'f"mean@{n_resps}"'))),
)

# The verl key that, composed, makes the rollout return its log-probs.
ROLLOUT_LOG_PROBS = "actor_rollout_ref.rollout.calculate_log_probs"


def verl_metric(key: str) -> VerlMetric | None:
    return next((m for m in VERL_METRICS if m.matches(key)), None)


# The composed key under which verl's v1 trainer takes the rollout's log-probs as the old
# ones and logs neither actor/entropy nor training/rollout_probs_diff_*.
BYPASS_MODE = "algorithm.rollout_correction.bypass_mode"
VAL_N = "actor_rollout_ref.rollout.val_kwargs.n"
_VAL_KEY = re.compile(r"val-core/(?P<source>[^/]+)/(?P<variable>[^/]+)/mean@(?P<n>\d+)")


def metric_problems(health: Health, verl_dir: Path, calculate_log_probs: Any, *,
                    bypass_mode: Any = False, val_sources: Iterable[str] | None = None,
                    val_n: Any = None) -> list[str]:
    """What makes a watched metric one the pinned verl at ``verl_dir`` does not log: a key
    not in :data:`VERL_METRICS`, a key whose source text the checkout lacks, a rollout
    log-prob metric while ``calculate_log_probs`` (the composed value, read as a flag) is
    false, a metric the v1 trainer skips under ``bypass_mode`` (the composed
    :data:`BYPASS_MODE`) while it is true, and a validation key
    ``val-core/<data_source>/<variable>/mean@<n>`` whose data source is not one of the
    validation set's (``val_sources``: the data summary's) or whose n is not the responses
    per prompt the validation generates (``val_n``: the composed :data:`VAL_N`; verl logs
    ``mean@<that n>`` only). Each message names the config key and the metric."""
    out: list[str] = []
    seen: dict[str, int] = {}
    sources = sorted(val_sources) if val_sources is not None else None
    for rule, key in health.watched():
        if rule == "nonfinite":
            i = seen[rule] = seen.get(rule, -1) + 1
            where = f"train.health.nonfinite.metrics[{i}]"
        else:
            where = f"train.health.{rule}.metric"
        found = verl_metric(key)
        if found is None:
            out.append(f"{where}: {key!r} is not a metric verl logs; verl logs "
                       + ", ".join(m.key for m in VERL_METRICS))
            continue
        for rel, text in found.sources:
            path = Path(verl_dir) / rel
            try:
                held = text in path.read_text(errors="replace")
            except OSError:
                held = False
            if not held:
                out.append(f"{where}: {key!r} is not logged by the pinned verl at {verl_dir}: "
                           f"{rel} does not hold {text!r} (where verl@220e903 logs it)")
                break
        if found.needs_rollout_log_probs and not calculate_log_probs:
            out.append(f"{where}: {key!r} is logged only with {ROLLOUT_LOG_PROBS}=True "
                       f"(composed: {calculate_log_probs!r})")
        if found.not_in_bypass_mode and bypass_mode:
            out.append(f"{where}: {key!r} is not logged with {BYPASS_MODE}=True (composed: "
                       f"{bypass_mode!r}): verl's v1 trainer then takes the rollout's "
                       "log-probs as the old ones and computes neither actor/entropy nor "
                       "training/rollout_probs_diff_*; the rule would judge nothing. Watch "
                       "another metric, or set its action to ignore")
        m = _VAL_KEY.fullmatch(key)
        if m is None:
            continue
        if sources is not None and m["source"] not in sources:
            out.append(f"{where}: {key!r} names data source {m['source']!r}, which the "
                       f"validation set does not hold (data summary: "
                       f"{', '.join(sources) or 'none'}): verl logs "
                       f"val-core/<data_source>/... per data source of the validation rows")
        n = _as_int(val_n)
        if n is not None and int(m["n"]) != n:
            out.append(f"{where}: {key!r} asks for mean@{m['n']}, but the validation "
                       f"generates {n} response(s) per prompt ({VAL_N} composed {n}): verl "
                       f"logs mean@{n} only; use val-core/{m['source']}/{m['variable']}/"
                       f"mean@{n}")
    return out


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
