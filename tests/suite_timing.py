"""The suite's own timing, for every run (a pytest plugin loaded by tests/conftest.py).

At the end of a run it prints the seconds spent per mark (``slurm``, ``ray``, ``slow``, and
the unmarked unit tier), each test's setup + call + teardown summed, beside the wall time,
and per cluster scope (``slurm``, ``slurm-b``, ``ray``: each runs on one worker, its tests
one after another, so the longest is a floor of the wall time and the lanes should stay
about even; tests/conftest.py says which test runs where);
pytest's own ``--durations`` (set in .ci/run) lists the slowest. With
``HY3RL_SUITE_TIMING=<file>`` it also writes every test's seconds and marks there as JSON,
which ``benchmarks/bench_suite.py`` reads. Nothing here times a test against a target.
Under pytest-xdist the figures are the controller's, from the workers' reports.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

MARKS = ("slurm", "ray", "slow")


class SuiteTiming:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.tests: dict[str, dict] = {}

    def add(self, report: pytest.TestReport) -> None:
        row = self.tests.setdefault(report.nodeid, {
            "seconds": 0.0, "outcome": "passed",
            "marks": sorted(m for m in MARKS if m in report.keywords)})
        row["seconds"] += report.duration
        if report.failed:
            row["outcome"] = "failed"
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"

    def _tally(self, groups) -> dict[str, dict[str, float]]:
        """group -> {"tests", "seconds"}; ``groups(nodeid, row)`` names each test's groups."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"tests": 0, "seconds": 0.0})
        for nodeid, row in self.tests.items():
            for group in groups(nodeid, row):
                out[group]["tests"] += 1
                out[group]["seconds"] += row["seconds"]
        return dict(out)

    def per_mark(self) -> dict[str, dict[str, float]]:
        """mark -> {"tests", "seconds"}; ``unit`` for the tests without any of MARKS."""
        return self._tally(lambda _nodeid, row: row["marks"] or ["unit"])

    def per_scope(self) -> dict[str, dict[str, float]]:
        """cluster scope -> {"tests", "seconds"}; ``other`` for the tests of no scope."""
        from conftest import cluster_scope

        return self._tally(lambda nodeid, _row: [cluster_scope(nodeid) or "other"])

def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(_Plugin(), "hy3rl-suite-timing")


class _Plugin:
    def __init__(self) -> None:
        self.timing = SuiteTiming()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.timing.add(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        wall = time.monotonic() - self.timing.started
        marks = self.timing.per_mark()
        tr = terminalreporter
        tr.section("time per mark (setup + call + teardown; a test counts under each mark)")
        for mark in (*MARKS, "unit"):
            if mark in marks:
                tr.write_line(f"{mark:>6}: {marks[mark]['seconds']:8.1f} s in "
                              f"{marks[mark]['tests']:4d} tests")
        total = sum(r["seconds"] for r in self.timing.tests.values())
        tr.write_line(f"{'all':>6}: {total:8.1f} s in {len(self.timing.tests):4d} tests; "
                      f"wall {wall:.1f} s")
        scopes = self.timing.per_scope()
        if scopes:
            tr.write_line("per cluster scope (each on one worker, in order): " + ", ".join(
                f"{name} {row['seconds']:.1f} s in {row['tests']} tests"
                for name, row in sorted(scopes.items())))
        out = os.environ.get("HY3RL_SUITE_TIMING")
        if out:
            Path(out).write_text(json.dumps({"wall_s": round(wall, 1), "per_mark": marks,
                                             "per_scope": scopes,
                                             "tests": self.timing.tests}, indent=1) + "\n")
