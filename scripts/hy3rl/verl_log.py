"""verl's ``file`` logger output: the one reader and the one merge of attempt logs
(docs/formats/train.md). The train stage writes ``train/metrics.jsonl`` with it; the report
reads the attempt logs with it. Standard library only."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hy3rl.errors import StageError
from hy3rl.layout import ATTEMPT_METRICS_RE

log = logging.getLogger(__name__)


# verl's FileLogger (verl/utils/tracking.py at the pin) writes with orjson, which writes NaN,
# inf and -inf as ``null``: a metric logged as null was logged, and was not a finite number.
NONFINITE: float = float("nan")


def metric_value(data: dict[str, Any], key: str) -> Any:
    """``data[key]`` as verl logged it: None when the key is absent, :data:`NONFINITE`
    when it was logged as ``null`` (NaN or ±inf, written by orjson), else the value."""
    if key not in data:
        return None
    value = data[key]
    return NONFINITE if value is None else value


def finite_number(value: Any) -> float | None:
    """A metric value (a verl log line's, an evaluation metric's) as a float when it is a
    finite number (not a bool, NaN or inf), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


class VerlLogError(StageError):
    """A metrics log line that is not verl's ``{"step": N, "data": {...}}``."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """verl file-logger lines ``{"step": N, "data": {...}}``. A partial last line (the
    trainer died mid-write) is skipped; any other bad line is an error naming file and
    line. A missing file reads as no lines."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) \
                    or isinstance(rec.get("step"), bool):
                raise ValueError('expected {"step": N, "data": {...}} with an integer step')
            if not isinstance(rec.get("data", {}), dict):
                raise ValueError("'data' is not an object")
        except ValueError as exc:
            if i == len(lines):  # last line cut off by a crash mid-write
                log.warning("%s:%d: partial last line skipped", path, i)
                continue
            raise VerlLogError(f"{path}:{i}: not a verl metrics line ({exc})") from None
        out.append(rec)
    return out


def validation_only(data: Any) -> bool:
    """A line's ``data`` holds validation metrics only (every key ``val-*``): what verl logs
    at the resumed step before training (``val_before_train``)."""
    return isinstance(data, dict) and bool(data) and all(str(k).startswith("val-") for k in data)


def _validation_only(rec: dict[str, Any]) -> bool:
    return validation_only(rec.get("data"))


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


def attempt_logs(attempts_dir: Path) -> list[Path]:
    """The attempts' metrics logs (``attempt-<k>.metrics.jsonl``) in attempt order."""
    attempts_dir = Path(attempts_dir)
    if not attempts_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in attempts_dir.iterdir()
             if (m := ATTEMPT_METRICS_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def merged_attempts(attempts_dir: Path, since: int = 1,
                    cuts: Iterable[tuple[int, int]] = ()) -> list[dict[str, Any]]:
    """The logs of attempts ``since`` and later under ``attempts_dir``, merged (``since``:
    the first attempt of the checkpoint directory's lineage, ``hy3rl.ckptdir``: the attempts
    before a ``fresh`` start trained other checkpoints). ``cuts``: ``(attempt k, step N)``
    pairs (``hy3rl.ckptdir.lineage_cuts``: a rewind to step N before attempt k): the logs of
    attempts before k keep their steps up to N only."""
    cuts = list(cuts)
    out = []
    for p in attempt_logs(attempts_dir):
        k = int(ATTEMPT_METRICS_RE.match(p.name).group(1))
        if k < since:
            continue
        bound = min((n for at, n in cuts if k < at), default=None)
        lines = read_metrics(p)
        out.append(lines if bound is None else [r for r in lines if r["step"] <= bound])
    return merge_metrics(out)
