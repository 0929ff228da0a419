"""hy3rl.watchdog: measured times, the stall limit, the save interval, SLURM's time left, and
the monitor over a real metrics log written line by line (a clock the test moves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hy3rl import watchdog as wd


def line(step: int, step_s: float | None = None, save_s: float | None = None,
         testing_s: float | None = None) -> dict:
    data: dict = {"critic/score/mean": 0.5}
    if step_s is not None:
        data["timing_s/step"] = step_s
    if save_s is not None:
        data["timing_s/save_checkpoint"] = save_s
    if testing_s is not None:
        data["timing_s/testing"] = testing_s
    return {"step": step, "data": data}


def test_measured_times_and_limits() -> None:
    lines = [{"step": 0, "data": {"val-core/x": 1.0}}, line(1, 100.0), line(2, 120.0, save_s=30.0),
             line(3, 90.0, testing_s=60.0)]
    steps, saves = wd.step_seconds(lines), wd.save_seconds(lines)
    assert steps == [100.0, 120.0, 150.0] and saves == [30.0]
    # null: max(30 min, 3 x (slowest step + slowest save))
    assert wd.stall_limit_s(None, steps, saves) == 1800.0
    assert wd.stall_limit_s(None, [1000.0], [200.0]) == 3600.0
    assert wd.stall_limit_s(None, [], []) == 1800.0
    assert wd.stall_limit_s(0, steps, saves) is None
    assert wd.stall_limit_s(0.5, steps, saves) == 30.0
    assert wd.p95([float(i) for i in range(1, 101)]) == 95.0
    assert wd.save_interval_s(20, [100.0] * 19 + [1000.0], [30.0], 600.0) == 20 * 100 + 30 + 600
    assert wd.save_interval_s(20, [], [30.0], 600.0) is None
    assert wd.save_interval_s(-1, [1.0], [], 0.0) is None


@pytest.mark.parametrize(("text", "seconds"), [
    ("1:02:03", 3723.0), ("2-00:00:10", 172810.0), ("4:05", 245.0), ("0:00", 0.0),
    ("UNLIMITED", None), ("NOT_SET", None), ("INVALID", 0.0), ("", None)])
def test_parse_time_left(text: str, seconds: float | None) -> None:
    assert wd.parse_time_left(text) == seconds


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, *lines: dict) -> None:
    with open(path, "a") as fh:
        for rec in lines:
            fh.write(json.dumps(rec) + "\n")


def monitor(tmp_path: Path, clock: Clock, **kw) -> wd.Monitor:
    saved = kw.pop("saved", set())
    left = kw.pop("left", [None])
    args = {"metrics": tmp_path / "attempt-1.metrics.jsonl", "save_freq": 2, "total_steps": 10,
            "stall_min": 1.0, "startup_min": 5.0, "margin_s": 10.0,
            "is_saved": lambda s: s in saved, "time_left": lambda: left[0], "clock": clock}
    args.update(kw)
    return wd.Monitor(**args)


def test_hang_after_progress_and_at_startup(tmp_path: Path) -> None:
    clock = Clock()
    m = monitor(tmp_path, clock)
    m.start()
    clock.now += 299
    assert m.poll() is None  # startup: 5 min
    write(m.metrics, line(0), line(1, 1.0))
    assert m.poll() is None and m.last_step == 1
    clock.now += 59
    assert m.poll() is None
    clock.now += 2
    req = m.poll()
    assert req and req.outcome == "hung" and req.diagnose and req.step == 1
    assert req.message.startswith("hung at step 2 (no progress for 1.02 min")

    m2 = monitor(tmp_path / "x", clock, metrics=tmp_path / "none.jsonl")
    m2.start()
    clock.now += 301
    req = m2.poll()
    assert req and req.outcome == "hung" and "before its first step" in req.message

    m3 = monitor(tmp_path, clock, stall_min=0, startup_min=0, metrics=tmp_path / "n.jsonl")
    m3.start()
    clock.now += 10 ** 6
    assert m3.poll() is None  # both disabled


def test_derived_stall_limit_uses_history(tmp_path: Path) -> None:
    clock = Clock()
    history = [line(1, 1200.0, save_s=100.0)]  # 3 x 1300 s = 65 min > 30 min
    m = monitor(tmp_path, clock, stall_min=None, history=history)
    write(m.metrics, line(2, 10.0))
    m.start()
    assert m.poll() is None
    clock.now += 64 * 60
    assert m.poll() is None
    clock.now += 2 * 60
    assert m.poll().outcome == "hung"


def test_stops_after_a_save_when_the_next_does_not_fit(tmp_path: Path) -> None:
    clock = Clock()
    saved: set[int] = set()
    left = [1000.0]
    m = monitor(tmp_path, clock, saved=saved, left=left)
    m.start()
    write(m.metrics, line(1, 5.0), line(2, 5.0, save_s=2.0))
    assert m.poll() is None  # the line is there, the save not yet complete (async)
    saved.add(2)
    assert m.poll() is None  # 1000 s left >= 2 x 5 + 2 + 10
    assert m.poll() is None  # each save is looked at once
    write(m.metrics, line(3, 5.0), line(4, 5.0, save_s=2.0))
    saved.add(4)
    left[0] = 21.0
    req = m.poll()
    assert req and req.outcome == "stopped_for_time_limit" and req.step == 4
    assert req.message.startswith("stopped after the save of step 4 before the time limit: "
                                  "0 steps lost")
    # the last step is never stopped for (the job is done), nor steps that do not save
    m2 = monitor(tmp_path, clock, metrics=tmp_path / "b.jsonl", total_steps=4, saved={4},
                 left=[0.0])
    write(m2.metrics, line(3, 5.0), line(4, 5.0))
    assert m2.poll() is None
    m3 = monitor(tmp_path, clock, metrics=tmp_path / "c.jsonl", saved={2}, left=[None])
    write(m3.metrics, line(1, 5.0), line(2, 5.0))
    assert m3.poll() is None  # no time limit (profiles/local)
