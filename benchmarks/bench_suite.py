"""Benchmark: the test suite's own time, total and per mark, so that its cost is tracked
like the workflow's (issue 26: the full suite within 20 minutes on the 2-core CI machine,
the quick loop within 3).

Runs pytest as CI does (``.venv/bin/pytest`` from the repository root, plus ``ARGS``) with
``HY3RL_SUITE_TIMING`` set, so that tests/suite_timing.py writes every test's seconds and
marks; then prints the wall time, the seconds per mark (``slurm``, ``ray``, ``slow``, the
unmarked ``unit`` tier) and per cluster scope (tests/conftest.py), the count of tests by
outcome and the slowest tests, each against its target. ``--from FILE`` reads such a file
instead of running the suite.

``--cpu`` also samples every process on the machine while the suite runs (psutil, every
0.5 s) and prints the CPU-seconds by kind of process (Ray's daemons, Snakemake, each rule's
script, the trainer double, pytest itself, SLURM ...) and how busy the machine was: where
the suite's CPU goes, the figure to cut while it is CPU-bound. A process that lives less
than one sampling interval is missed, and one that ends loses its last interval: the figures
are a floor. Other work on the machine is counted too: run it on an otherwise idle machine.

Run: ``.venv/bin/python benchmarks/bench_suite.py [--top 25] [--cpu] [--from FILE]
[-- ARGS...]``, e.g. ``-- -m "not slurm and not ray and not slow"`` for the quick loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FULL_TARGET_S = 20 * 60
QUICK_TARGET_S = 3 * 60


# Kinds of process by command line, the first that matches; a rule's script (Snakemake
# copies it to .snakemake/scripts/tmpXXXX.<rule>.py) is counted under its rule.
KINDS = (
    ("Ray daemons", r"ray/(dashboard|_private|autoscaler)/|ray::|ray\.util\.client|"
                    r"ray-dashboard|/raylet |/gcs_server |multiprocessing\.forkserver"),
    ("Ray CLI (ray start, job submit, health-check ...)", r"bin/ray "),
    ("Snakemake, the tests' own invocations", r"snakemake_cli\.py"),
    ("Snakemake inside cluster jobs", r"-m snakemake .*--target-jobs"),
    ("trainer double", r"verl\.trainer\.main_ppo"),
    ("graders' worker processes", r"multiprocessing\.spawn"),
    ("python -m hy3rl.*", r"-m hy3rl\."),
    ("pytest and its workers", r"pytest|execnet|exec\(eval"),
    ("SLURM and munge", r"slurm|munged|\bsrun\b|sbatch|squeue|scontrol|sacct"),
    ("pip", r"-m pip"),
)
RULE_SCRIPT = re.compile(r"\.snakemake/scripts/tmp\w+\.(\w+)\.py")


def kind(cmdline: str) -> str:
    rule = RULE_SCRIPT.search(cmdline)
    if rule:
        return f"rule {rule.group(1)} (its script)"
    for name, pattern in KINDS:
        if re.search(pattern, cmdline):
            return name
    return "other: " + (cmdline.split(" ")[0].rsplit("/", 1)[-1] or "?")


class CpuSampler(threading.Thread):
    """Every process's CPU time (user + system), read every ``every`` s until stopped;
    per process the CPU it used while sampled (a process there at the start counts from
    then), and the machine's busy share every 10 s."""

    def __init__(self, every: float = 0.5):
        super().__init__(daemon=True)
        self.every, self.stopping = every, threading.Event()
        self.procs: dict[tuple[int, float], list] = {}  # (pid, created): [cmd, first, last]
        self.busy: list[float] = []

    def run(self) -> None:
        import psutil

        me, first, last_busy = os.getpid(), True, time.monotonic()
        psutil.cpu_percent()
        while not self.stopping.is_set():
            for p in psutil.process_iter(["pid", "create_time", "cmdline", "cpu_times"]):
                info = p.info
                if info["pid"] == me or info["cpu_times"] is None:
                    continue
                cpu = info["cpu_times"].user + info["cpu_times"].system
                key = (info["pid"], info["create_time"])
                if key in self.procs:
                    self.procs[key][2] = cpu
                else:
                    cmd = " ".join(info["cmdline"] or [])
                    self.procs[key] = [cmd, cpu if first else 0.0, cpu]
            first = False
            if time.monotonic() - last_busy >= 10:
                self.busy.append(psutil.cpu_percent())
                last_busy = time.monotonic()
            self.stopping.wait(self.every)

    def by_kind(self) -> dict[str, tuple[int, float]]:
        out: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for cmd, first, last in self.procs.values():
            if last - first > 0:
                row = out[kind(cmd)]
                row[0] += 1
                row[1] += last - first
        return {k: (n, s) for k, (n, s) in out.items()}


def print_cpu(sampler: CpuSampler, wall: float, top: int) -> None:
    rows = sampler.by_kind()
    total = sum(s for _, s in rows.values())
    busy = sum(sampler.busy) / len(sampler.busy) if sampler.busy else float("nan")
    print(f"CPU: {total:.0f} CPU-seconds sampled in {wall:.0f} s on {os.cpu_count()} cores "
          f"(machine busy {busy:.0f} % on average, every 10 s); a floor: a process shorter "
          f"than {sampler.every:g} s is missed, one that ends loses its last interval")
    for name, (n, s) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {s:8.0f} s {100 * s / max(total, 1e-9):5.1f} %  {n:5d} processes  {name}")


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
    ap.add_argument("--cpu", action="store_true",
                    help="sample every process's CPU while the suite runs; print it by kind")
    ap.add_argument("--from", dest="source", type=Path,
                    help="a HY3RL_SUITE_TIMING file to summarize instead of running the suite")
    ap.add_argument("args", nargs=argparse.REMAINDER,
                    help="pytest arguments after --")
    ns = ap.parse_args(argv)
    args = [a for a in ns.args if a != "--"]
    sampler = None
    if ns.source:
        if ns.cpu:
            ap.error("--cpu samples a run of the suite: not with --from")
        doc, wall, rc = json.loads(ns.source.read_text()), None, 0
    else:
        if ns.cpu:
            sampler = CpuSampler()
            sampler.start()
        try:
            doc, wall, rc = run_suite(args)
        finally:
            if sampler is not None:
                sampler.stopping.set()
                sampler.join()
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
    if doc.get("per_scope"):
        print("seconds per cluster scope (each on one worker, its tests in order; the lanes "
              "should stay about even):")
        for scope, row in sorted(doc["per_scope"].items()):
            print(f"  {scope:>7}: {row['seconds']:8.1f} s in {row['tests']:4d} tests")
    print(f"slowest {ns.top}:")
    for nodeid, row in sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:ns.top]:
        print(f"  {row['seconds']:7.1f} s  {nodeid}  [{','.join(row['marks']) or 'unit'}]")
    if sampler is not None:
        print_cpu(sampler, wall, ns.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
