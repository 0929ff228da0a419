"""Benchmark: the test suite's own time, total and per mark, so that its cost is tracked
like the workflow's (issue 26: the full suite within 20 minutes on the 2-core CI machine,
the quick loop within 3).

Runs pytest as CI does (``.venv/bin/pytest`` from the repository root, plus ``ARGS``) with
``HY3RL_SUITE_TIMING`` set, so that tests/suite_timing.py writes every test's seconds and
marks; then prints the wall time, the seconds per mark (``slurm``, ``ray``, ``slow``, the
unmarked ``unit`` tier), the count of tests by outcome and the slowest tests, each against
its target. ``--from FILE`` reads such a file instead of running the suite.

Run: ``.venv/bin/python benchmarks/bench_suite.py [--top 25] [--from FILE] [-- ARGS...]``,
e.g. ``-- -m "not slurm and not ray and not slow"`` for the quick loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FULL_TARGET_S = 20 * 60
QUICK_TARGET_S = 3 * 60


def run_suite(args: list[str]) -> tuple[dict, float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timing.json"
        t0 = time.monotonic()
        proc = subprocess.run([str(REPO / ".venv" / "bin" / "pytest"), *args], cwd=REPO,
                              env={**os.environ, "HY3RL_SUITE_TIMING": str(out)})
        wall = time.monotonic() - t0
        if not out.is_file():
            raise SystemExit(f"pytest ({proc.returncode}) wrote no timing file")
        return json.loads(out.read_text()), wall, proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--from", dest="source", type=Path,
                    help="a HY3RL_SUITE_TIMING file to summarize instead of running the suite")
    ap.add_argument("args", nargs=argparse.REMAINDER,
                    help="pytest arguments after --")
    ns = ap.parse_args(argv)
    args = [a for a in ns.args if a != "--"]
    if ns.source:
        doc, wall, rc = json.loads(ns.source.read_text()), None, 0
    else:
        doc, wall, rc = run_suite(args)
    wall = wall if wall is not None else doc["wall_s"]
    quick = any("not slurm" in a for a in args)
    target = QUICK_TARGET_S if quick else FULL_TARGET_S
    tests = doc["tests"]
    print(f"suite: {'quick loop' if quick else 'full'} ({' '.join(args) or 'no arguments'})")
    print(f"wall: {wall:.0f} s ({wall / 60:.1f} min); target <= {target / 60:.0f} min: "
          f"{'met' if wall <= target else 'NOT met'}; pytest exit {rc}")
    outcomes = Counter(t["outcome"] for t in tests.values())
    print("tests: " + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())))
    print("seconds per mark (setup + call + teardown; a test counts under each of its marks):")
    for mark, row in sorted(doc["per_mark"].items()):
        print(f"  {mark:>6}: {row['seconds']:8.1f} s in {row['tests']:4d} tests")
    print(f"slowest {ns.top}:")
    for nodeid, row in sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:ns.top]:
        print(f"  {row['seconds']:7.1f} s  {nodeid}  [{','.join(row['marks']) or 'unit'}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
