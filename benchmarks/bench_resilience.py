"""Benchmark of unattended training (issue 10): prints figures, no pass/fail.

Each scenario is ONE `snakemake` invocation of the train rule through
`--profile profiles/slurm --profile tests/slurm/profile` on the 2-node SLURM test cluster
(tests/slurm_cluster.py: joined, or started and stopped again), the trainer being the test
double (tests/fixtures/trainer_double.py) in a fake verl clone:

1. hang: the double hangs at step 5 (``hang_at``), ``train.watchdog.stall_min`` 0.25,
   ``poll_s`` 0.5. Figure: seconds from the start of the hang to the Ray job being
   stopped, with the stall limit it ran under. The hang starts when the double enters
   step 5: step 4's metrics line is the last write of ``attempt-1.metrics.jsonl`` (its
   mtime), then the double sleeps ``HY3RL_DOUBLE_STEP_S`` and hangs. The stop is the time
   of the ``ray job stop <id>`` line of ``attempt-1/launcher.log`` (logged once that
   command has returned); the ``watchdog: hung ...`` line's time is printed too (between
   the two: the hang diagnostics). Log times are the launcher's local time, compared with
   the mtime in local time (the test cluster's jobs run on this host).
2. time_limit: ``cluster.train_time_min`` 1, steps of 1 s, ``save_freq`` 4,
   ``time_limit_margin_min`` 0.25, ``restarts_per_job`` 0, ``max_submissions`` 5.
   Figures: the number of jobs (distinct SLURM job ids of the attempt records) and
   ``steps_lost`` of every attempt record whose outcome is ``stopped_for_time_limit`` or
   ``time_limit`` (target 0).
3. crash: ``crash_at`` 7 with ``save_freq`` 4 (a step between saves). Figure: the failed
   attempt's ``steps_lost`` (target <= save_freq).
4. combined: two crashes and a time limit, ``restarts_per_job`` 2, ``max_submissions`` 4,
   ``cluster.train_time_min`` 2 with 100 steps of 1 s (cannot fit in one job). The double's
   ``crash_at`` is one-shot and one key, so the second crash is written into the faults
   file by this script once the first has fired, for the attempt then running, at a step
   between saves it has not reached (``CrashInjector``). Figures: snakemake invocations
   needed (1 when this one invocation exits 0 with ``done.json``; target 1), the attempts
   with their outcomes, and the steps lost in total (sum of the records' ``steps_lost``).

    .venv/bin/python benchmarks/bench_resilience.py [--scenario hang|time_limit|crash|combined|all]
                                                    [--keep DIR]

Every scenario cleans up after itself: its SLURM jobs ended (scancel by id only if the
invocation was cut short), no Ray process of its jobs left (``leftover_ray``; any still
there after a grace period are killed by pid and reported), no node temp dir left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test fixtures (hy3rl itself is installed)

import yaml  # noqa: E402
from fixtures.common import SNAKEMAKE, make_git_repo  # noqa: E402
from fixtures.trainer_double import MAIN_PPO_DOUBLE, TrainSetup, leftover_ray  # noqa: E402
from fixtures.verl import fake_verl_files  # noqa: E402
from hy3rl.atomic import write_json_atomic  # noqa: E402
from hy3rl.layout import Layout  # noqa: E402
from hy3rl.verl_log import read_metrics  # noqa: E402

RUN = "tiny-default"  # run.name of config/config.yaml
TARGET = f"results/{RUN}/train/done.json"
TEST_PROFILE = REPO / "tests" / "slurm" / "profile"
TEST_CONFIG = REPO / "tests" / "slurm" / "config.yaml"
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"  # logging's asctime
TIME_LIMIT_OUTCOMES = ("stopped_for_time_limit", "time_limit")
POLL_S = 0.2  # how often this script looks at a running invocation
LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED")


@dataclass(frozen=True)
class Scenario:
    """One snakemake invocation: the run's shape, the config over the setup's and the test
    cluster's (``train``, ``cluster``: partial sections, deep-merged by Snakemake), the
    faults the double starts with, and how long the invocation may take."""

    name: str
    total: int
    save_freq: int
    step_s: float
    train: dict[str, Any]
    cluster: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    timeout_s: int = 900


HANG_AT, CRASH_AT = 5, 7
# time_limit_margin_min: the default (10 min) would not fit the test cluster's 10-minute
# jobs, so that every job would stop at its first save; the scenarios that do not measure
# the time limit use 0.5 min, as tests/test_train_slurm.py does.
SCENARIOS = {
    "hang": Scenario("hang", total=8, save_freq=2, step_s=0.5, faults={"hang_at": HANG_AT},
                     train={"max_submissions": 1, "time_limit_margin_min": 0.5,
                            "watchdog": {"stall_min": 0.25, "poll_s": 0.5}}),
    "time_limit": Scenario("time_limit", total=24, save_freq=4, step_s=1.0,
                           train={"max_submissions": 5, "restarts_per_job": 0,
                                  "time_limit_margin_min": 0.25, "watchdog": {"poll_s": 0.2}},
                           cluster={"train_time_min": 1}, timeout_s=1200),
    "crash": Scenario("crash", total=12, save_freq=4, step_s=0.3, faults={"crash_at": CRASH_AT},
                      train={"max_submissions": 1, "time_limit_margin_min": 0.5}),
    # 100 steps of 1 s cannot fit in one 2-minute job (less its 15 s margin): >= 1 time limit.
    "combined": Scenario("combined", total=100, save_freq=4, step_s=1.0,
                         faults={"crash_at": CRASH_AT},
                         train={"max_submissions": 4, "restarts_per_job": 2,
                                "time_limit_margin_min": 0.25, "watchdog": {"poll_s": 0.2}},
                         cluster={"train_time_min": 2}, timeout_s=1500),
}
COMBINED_CRASHES = 2


# --------------------------------------------------------------------------- the run


def make_setup(root: Path, sc: Scenario) -> TrainSetup:
    """A fake verl clone with the double, the preflight outputs and the faults file."""
    files = dict(fake_verl_files())
    files["verl/trainer/main_ppo.py"] = MAIN_PPO_DOUBLE
    verl = root / "deps" / "verl"
    make_git_repo(verl, files)
    setup = TrainSetup(root, verl, run=RUN, total=sc.total, save_freq=sc.save_freq,
                       step_s=sc.step_s)
    setup.set_faults(**sc.faults)
    return setup


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` deep-merged into a copy of ``base`` (as Snakemake merges config files)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and \
            isinstance(out.get(key), dict) else value
    return out


def snakemake_cmd(setup: TrainSetup, sc: Scenario) -> list[str]:
    """The train rule through the shipped SLURM profile plus the test cluster's override;
    the scenario's config last (over config/config.yaml and tests/slurm/config.yaml)."""
    override = setup.root / "bench-config.yaml"
    doc: dict[str, Any] = {"train": merged(setup.config["train"], sc.train)}
    if sc.cluster:
        doc["cluster"] = sc.cluster
    override.write_text(yaml.safe_dump(doc))
    return [*SNAKEMAKE, TARGET, "--snakefile", str(REPO / "Snakefile"),
            "--directory", str(setup.root), "--allowed-rules", "train",
            "--profile", str(REPO / "profiles" / "slurm"), "--profile", str(TEST_PROFILE),
            "--configfile", str(REPO / "config" / "config.yaml"), str(TEST_CONFIG),
            str(override)]


@dataclass
class Invocation:
    """How the one snakemake invocation ended: ``rc`` (None: killed at the timeout), its
    wall time, and the file holding its output."""

    rc: int | None
    wall_s: float
    output: Path


def invoke(setup: TrainSetup, sc: Scenario,
           on_poll: Callable[[], None] | None = None) -> Invocation:
    """Run the scenario's snakemake command (its own session, output to a file), calling
    ``on_poll`` every POLL_S while it runs; at the timeout, SIGINT (Snakemake cancels its
    SLURM jobs), then SIGKILL."""
    env = {**os.environ, **setup.env(),
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    env.pop("SLURM_JOB_ID", None)
    output = setup.root / "snakemake.out"
    t0 = time.monotonic()
    with open(output, "wb") as out:
        proc = subprocess.Popen(snakemake_cmd(setup, sc), env=env, cwd=setup.root,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None and time.monotonic() - t0 < sc.timeout_s:
                if on_poll is not None:
                    on_poll()
                time.sleep(POLL_S)
        except BaseException:  # e.g. Ctrl-C: it does not reach the invocation's session
            stop_group(proc)
            raise
        if proc.poll() is None:
            print(f"  snakemake still running after {sc.timeout_s} s: interrupting it")
            stop_group(proc)
            return Invocation(None, time.monotonic() - t0, output)
    return Invocation(proc.returncode, time.monotonic() - t0, output)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the invocation's process group, SIGKILL if it is still there after 60 s."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


# --------------------------------------------------------------------------- what it left


def records(layout: Layout) -> list[dict[str, Any]]:
    """The attempt records (``attempt-<k>.json``), by attempt number."""
    found = sorted(Path(layout.train_attempts).glob("attempt-*.json"),
                   key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in found]


def logged_steps(layout: Layout, k: int) -> list[int]:
    """The steps of attempt ``k``'s metrics log so far (verl's file logger; a partial last
    line is skipped, a missing file is no steps)."""
    return [r["step"] for r in read_metrics(Path(layout.attempt_metrics(k)))]


def submitted_jobs(work: Path) -> list[str]:
    """The train jobs the invocation submitted (one SLURM log each, named by job id)."""
    logs = work / ".snakemake" / "slurm_logs" / "rule_train"
    return sorted({p.stem for p in logs.rglob("*.log")}, key=int) if logs.is_dir() else []


def job_ids(layout: Layout, work: Path) -> list[str]:
    """Every SLURM job of this scenario known from its records and SLURM logs."""
    ids = {str(r["slurm_job_id"]) for r in records(layout) if r.get("slurm_job_id")}
    return sorted(ids | set(submitted_jobs(work)), key=int)


def queued_in(work: Path) -> list[str]:
    """Jobs alive in SLURM whose working directory is ``work`` (pending ones included,
    which have no log yet; finished ones stay listed for MinJobAge and are left out)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %T %Z"], capture_output=True, text=True,
                         timeout=60).stdout
    found = []
    for line in out.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[1] in LIVE_STATES and \
                Path(parts[2]).resolve() == work.resolve():
            found.append(parts[0])
    return found


def ray_left(jobs: list[str]) -> list[int]:
    """Pids still carrying the Ray scope of one of ``jobs``."""
    return sorted({pid for job in jobs for pid in leftover_ray(f"{RUN}-{job}-")})


def cleanup(setup: TrainSetup, temp_root: Path) -> list[str]:
    """End what the scenario left (the invocation is over): its SLURM jobs (scancel by id,
    only when the invocation was cut short), then Ray processes of its jobs (a grace period
    for their teardown, then SIGKILL by pid) and node temp dirs. Returns what it found."""
    notes = []
    queued = queued_in(setup.root)
    if queued:
        notes.append(f"SLURM jobs still queued, cancelled: {' '.join(queued)}")
        subprocess.run(["scancel", *queued], capture_output=True, timeout=60)
        deadline = time.monotonic() + 120
        while queued_in(setup.root) and time.monotonic() < deadline:
            time.sleep(1)
    jobs = job_ids(setup.layout(), setup.root)
    deadline = time.monotonic() + 60
    while ray_left(jobs) and time.monotonic() < deadline:
        time.sleep(1)
    pids = ray_left(jobs)
    if pids:
        notes.append(f"Ray processes left after the run, killed: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    dirs = [p for job in jobs for p in temp_root.glob(f"hy3rl-ray-{job}-*")]
    if dirs:
        notes.append(f"node temp dirs left, removed: {[str(p) for p in dirs]}")
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)
    return notes


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class LogLine:
    """One timestamped line of a launcher log: epoch seconds (from its local asctime),
    the logger name and the message (the ``[+ N s]`` phase prefix removed)."""

    t: float
    logger: str
    message: str


def parse_log_time(stamp: str) -> float:
    """Epoch seconds of a logging asctime (``2026-12-03 12:00:01,234``, local time)."""
    return datetime.strptime(stamp, LOG_TIME).timestamp()


def launcher_lines(path: Path) -> list[LogLine]:
    """The launcher log's lines that start with a timestamp (others, e.g. continuation
    lines of a traceback, are left out)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        parts = line.split(" ", 3)
        if len(parts) < 4:
            continue
        try:
            t = parse_log_time(f"{parts[0]} {parts[1]}")
        except ValueError:
            continue
        message = parts[3].split(": ", 1)[1] if ": " in parts[3] else parts[3]
        if message.startswith("[+") and "s] " in message:
            message = message.split("s] ", 1)[1]
        out.append(LogLine(t, parts[2], message))
    return out


def first_line(lines: list[LogLine], prefix: str, after: float | None = None) -> LogLine | None:
    """The first line whose message starts with ``prefix`` (at or after ``after``)."""
    return next((ln for ln in lines if ln.message.startswith(prefix)
                 and (after is None or ln.t >= after)), None)


def local(t: float) -> str:
    """Epoch seconds as local wall-clock time to the millisecond (for the printout)."""
    return datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def hang_figures(layout: Layout, hang_at: int, step_s: float) -> dict[str, Any]:
    """Times of the hang of attempt 1: its start (the metrics log's mtime + one step of
    ``step_s``), the watchdog's line and the ``ray job stop`` line of its launcher log; an
    ``error`` naming the file when one of them cannot be found."""
    metrics = Path(layout.attempt_metrics(1))
    log = Path(layout.attempt_logs(1)) / "launcher.log"
    if not metrics.exists():
        return {"error": f"{metrics} missing"}
    steps = logged_steps(layout, 1)
    lines = launcher_lines(log)
    watchdog = first_line(lines, "watchdog: hung")
    stop = first_line(lines, "ray job stop ", after=watchdog.t if watchdog else None)
    fig: dict[str, Any] = {"hang_start": metrics.stat().st_mtime + step_s,
                           "last_logged_step": steps[-1] if steps else None,
                           "watchdog": watchdog, "stop": stop}
    if not steps or steps[-1] != hang_at - 1:
        fig["error"] = (f"{metrics}: last line is step {fig['last_logged_step']}, not "
                        f"{hang_at - 1}: its mtime is not the end of the step before the hang")
    elif watchdog is None or stop is None:
        fig["error"] = f"{log}: no " + ("'watchdog: hung' line" if watchdog is None
                                       else "'ray job stop' line after the watchdog's")
    return fig


def time_limit_figures(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Jobs (distinct SLURM job ids) and ``steps_lost`` of each time-limit attempt."""
    limited = [r for r in recs if r.get("outcome") in TIME_LIMIT_OUTCOMES]
    return {"jobs": len({r.get("slurm_job_id") for r in recs}),
            "lost": [(r["attempt"], r["outcome"], r.get("steps_lost")) for r in limited]}


def crash_figures(recs: list[dict[str, Any]]) -> list[tuple[int, int | None, int | None]]:
    """(attempt, failed_at_step, steps_lost) of each failed attempt."""
    return [(r["attempt"], r.get("failed_at_step"), r.get("steps_lost"))
            for r in recs if r.get("outcome") == "failed"]


def combined_figures(recs: list[dict[str, Any]], inv: Invocation,
                     layout: Layout) -> dict[str, Any]:
    """Invocations needed (1 when this one finished the run), crashes, time limits, steps
    lost in total."""
    done = Path(layout.train_done)
    finished = inv.rc == 0 and done.exists()
    return {"invocations": 1 if finished else None, "rc": inv.rc, "done": done.exists(),
            "crashes": len(crash_figures(recs)),
            "time_limits": sum(r.get("outcome") in TIME_LIMIT_OUTCOMES for r in recs),
            "jobs": len({r.get("slurm_job_id") for r in recs}),
            "steps_lost_total": sum(r.get("steps_lost") or 0 for r in recs)}


# --------------------------------------------------------------------------- faults


def next_crash_step(start: int, save_freq: int, offset: int) -> int:
    """The first step after one full save interval past ``start`` that lies ``offset``
    steps into a save interval (between saves, as crash_at 7 with save_freq 4)."""
    step = start + save_freq + 1
    while step % save_freq != offset % save_freq:
        step += 1
    return step


class CrashInjector:
    """``crashes`` crashes in one run from the double's one-shot ``crash_at`` (one key):
    the first is in the faults file from the start; once it has fired (the double removed
    it), the next is written for the attempt then running, at ``next_crash_step`` of the
    furthest of its start step and its last logged step. A pending crash the running
    attempt cannot reach (it resumed past it, e.g. after a time limit) is moved for it."""

    def __init__(self, setup: TrainSetup, crashes: int, first: int):
        self.setup, self.layout, self.crashes = setup, setup.layout(), crashes
        self.offset = first % setup.save_freq
        self.pending: int | None = first
        self.fired = 0
        self.written = [first]

    def faults(self) -> dict[str, Any] | None:
        """The faults file now; None when it cannot be read (look again at the next poll)."""
        try:
            return json.loads(self.setup.faults.read_text())
        except (OSError, ValueError):
            return None

    def poll(self) -> None:
        """Called every POLL_S while the invocation runs: notice a fired crash, arm the
        next one (or move an unreachable one) for the attempt running now."""
        faults = self.faults()
        if faults is None:
            return
        if self.pending is not None and "crash_at" not in faults:
            self.fired += 1
            self.pending = None
        recs = records(self.layout)
        if not recs or recs[-1].get("outcome") != "running":
            return
        reached = max([recs[-1]["start_step"], *logged_steps(self.layout, recs[-1]["attempt"])])
        if self.pending is not None and self.pending <= reached:
            self.arm(faults, reached, replace=True)
        elif self.pending is None and self.fired < self.crashes:
            self.arm(faults, reached, replace=False)

    def arm(self, faults: dict[str, Any], reached: int, replace: bool) -> None:
        """Write ``crash_at`` for the first step between saves one interval past
        ``reached`` (atomically: the double reads the file at every step)."""
        step = next_crash_step(reached, self.setup.save_freq, self.offset)
        write_json_atomic(self.setup.faults, {**faults, "crash_at": step})
        if replace:
            self.written[-1] = step
        else:
            self.written.append(step)
        self.pending = step


# --------------------------------------------------------------------------- printing


def print_attempts(recs: list[dict[str, Any]]) -> None:
    """One line per attempt record: job, attempt in its job, outcome, steps, loss, reason."""
    print(f"    {'k':>2} {'job':>6} {'#':>2} {'outcome':<23} {'steps':>9} {'logged':>6} "
          f"{'lost':>4}  exit reason")
    for r in recs:
        steps = f"{r.get('start_step')}->{r.get('end_step')}"
        print(f"    {r['attempt']:>2} {str(r.get('slurm_job_id')):>6} "
              f"{str(r.get('job_attempt')):>2} {str(r.get('outcome')):<23} {steps:>9} "
              f"{str(r.get('last_logged_step')):>6} {str(r.get('steps_lost')):>4}  "
              f"{str(r.get('exit_reason'))[:90]}")


def print_tail(inv: Invocation, n: int = 30) -> None:
    """The end of a failed invocation's output (Snakemake names the failing job's log)."""
    lines = inv.output.read_text(errors="replace").splitlines()[-n:]
    print(f"  last {len(lines)} lines of {inv.output}:")
    for line in lines:
        print(f"    | {line}")


@dataclass
class Row:
    """One line of the summary table."""

    scenario: str
    figure: str
    value: str
    target: str
    rc: int | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def report_hang(sc: Scenario, setup: TrainSetup, recs: list[dict[str, Any]]) -> Row:
    """Print and return the hang figure: hang start -> Ray job stopped, under its limit."""
    wd = sc.train["watchdog"]
    limit = f"{wd['stall_min'] * 60:g} s stall limit"
    print(f"  ran under: {limit} (train.watchdog.stall_min {wd['stall_min']:g}, "
          f"poll_s {wd['poll_s']:g})")
    fig = hang_figures(setup.layout(), HANG_AT, sc.step_s)
    if "hang_start" in fig:
        print(f"  hang start (mtime of attempt-1.metrics.jsonl + {sc.step_s:g} s): "
              f"{local(fig['hang_start'])}")
    for key, label in (("watchdog", "watchdog line"), ("stop", "ray job stop line")):
        ln = fig.get(key)
        if ln is not None:
            print(f"  {label}: {local(ln.t)}  (+{ln.t - fig['hang_start']:.2f} s)  "
                  f"{ln.message[:100]}")
    figure = "hang start -> Ray job stopped"
    if "error" in fig:
        print(f"  not measured: {fig['error']}")
        return Row(sc.name, figure, f"not measured ({limit})", "-")
    secs = fig["stop"].t - fig["hang_start"]
    detect = fig["watchdog"].t - fig["hang_start"]
    print(f"  hang start -> Ray job stopped: {secs:.1f} s (to the watchdog's line "
          f"{detect:.1f} s, then diagnostics and stop {fig['stop'].t - fig['watchdog'].t:.1f} s)")
    return Row(sc.name, figure, f"{secs:.1f} s under a {limit}", "-")


def report_time_limit(sc: Scenario, setup: TrainSetup, recs: list[dict[str, Any]]) -> Row:
    """Print and return the jobs and the steps lost at each time limit."""
    fig = time_limit_figures(recs)
    print(f"  jobs: {fig['jobs']} (SLURM logs: {len(submitted_jobs(setup.root))})")
    for k, outcome, lost in fig["lost"]:
        print(f"  attempt {k} ({outcome}): {lost} step(s) lost")
    if not fig["lost"]:
        return Row(sc.name, "steps lost per time limit", "no time limit met", "0")
    lost = [x[2] for x in fig["lost"]]
    return Row(sc.name, "steps lost per time limit",
               f"{lost} over {len(lost)} time limit(s), {fig['jobs']} jobs", "0")


def report_crash(sc: Scenario, setup: TrainSetup, recs: list[dict[str, Any]]) -> Row:
    """Print and return the steps lost at each crash (failed attempt)."""
    crashes = crash_figures(recs)
    for k, at, lost in crashes:
        print(f"  attempt {k} failed at step {at}: {lost} step(s) lost "
              f"(save_freq {sc.save_freq})")
    if not crashes:
        return Row(sc.name, "steps lost per crash", "no crash met", f"<= {sc.save_freq}")
    return Row(sc.name, "steps lost per crash", str([c[2] for c in crashes]),
               f"<= {sc.save_freq}")


def report_combined(sc: Scenario, setup: TrainSetup, recs: list[dict[str, Any]],
                    inv: Invocation, injector: CrashInjector) -> Row:
    """Print and return the invocations needed; flag a run that did not have the two
    crashes and the time limit it was meant to have."""
    fig = combined_figures(recs, inv, setup.layout())
    print(f"  crash_at written: {injector.written} (fired {injector.fired})")
    print(f"  crashes {fig['crashes']}, time limits {fig['time_limits']}, jobs {fig['jobs']}, "
          f"steps lost in total {fig['steps_lost_total']}")
    notes = []
    if fig["crashes"] != COMBINED_CRASHES or fig["time_limits"] < 1:
        notes.append(f"not the intended run: {fig['crashes']} crash(es), "
                     f"{fig['time_limits']} time limit(s)")
    value = "1" if fig["invocations"] == 1 else \
        f"> 1 (exit {fig['rc']}, done.json {'there' if fig['done'] else 'missing'})"
    print(f"  snakemake invocations needed: {value}")
    return Row(sc.name, "snakemake invocations needed",
               f"{value}; {fig['steps_lost_total']} steps lost", "1", notes=notes)


# --------------------------------------------------------------------------- scenarios


def run_scenario(name: str, keep: Path | None) -> Row:
    """One scenario in a fresh work dir: the invocation, the records, the figures, the
    cleanup. The work dir is removed unless ``keep``."""
    sc = SCENARIOS[name]
    if keep is not None:
        work = keep / name
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix=f"bench-resilience-{name}-"))
    print(f"\n[{name}] {sc.total} steps of {sc.step_s:g} s, save_freq {sc.save_freq}, "
          f"faults {sc.faults or '-'}, train {sc.train}, cluster {sc.cluster or '-'}; "
          f"work dir {work}")
    try:
        setup = make_setup(work, sc)
        injector = CrashInjector(setup, COMBINED_CRASHES, CRASH_AT) \
            if name == "combined" else None
        try:
            inv = invoke(setup, sc, injector.poll if injector else None)
        finally:
            notes = cleanup(setup, Path(setup.cfg().train.ray.temp_root))
        recs = records(setup.layout())
        print(f"  snakemake exit {inv.rc} after {inv.wall_s:.1f} s; done.json "
              f"{'written' if Path(setup.layout().train_done).exists() else 'missing'}")
        print_attempts(recs)
        if inv.rc != 0:
            print_tail(inv)
        if name == "hang":
            row = report_hang(sc, setup, recs)
        elif name == "time_limit":
            row = report_time_limit(sc, setup, recs)
        elif name == "crash":
            row = report_crash(sc, setup, recs)
        else:
            row = report_combined(sc, setup, recs, inv, injector)
        row.rc, row.wall_s, row.notes = inv.rc, inv.wall_s, row.notes + notes
        for note in row.notes:
            print(f"  NOTE: {note}")
        return row
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def print_summary(rows: list[Row]) -> None:
    """The figures of every scenario run, one line each."""
    print("\nsummary")
    print(f"  {'scenario':<11} {'figure':<30} {'value':<50} {'target':<6} {'exit':>4} "
          f"{'wall s':>7}  notes")
    for r in rows:
        print(f"  {r.scenario:<11} {r.figure:<30} {r.value:<50} {r.target:<6} "
              f"{str(r.rc):>4} {r.wall_s:>7.1f}  {'; '.join(r.notes) or '-'}")


def check_profile(info: Any) -> None:
    """The test profile must name the running cluster's partition and account."""
    res = yaml.safe_load((TEST_PROFILE / "config.yaml").read_text())["default-resources"]
    if (res["slurm_partition"], res["slurm_account"]) != (info.partition, info.account):
        raise SystemExit(f"{TEST_PROFILE / 'config.yaml'}: partition/account "
                         f"{res['slurm_partition']}/{res['slurm_account']} differ from the "
                         f"test cluster's {info.partition}/{info.account}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep each scenario's work dir as DIR/<scenario>")
    args = ap.parse_args(argv)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    keep = args.keep.resolve() if args.keep else None
    for name in names if keep is not None else []:
        if (keep / name).exists() and any((keep / name).iterdir()):
            ap.error(f"--keep: {keep / name} exists and is not empty")
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    import slurm_cluster

    rows = []
    with slurm_cluster.session() as info:
        check_profile(info)
        for name in names:
            rows.append(run_scenario(name, keep))
    print_summary(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
