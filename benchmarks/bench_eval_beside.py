"""Benchmark of evaluation while training goes on (issue 20): prints figures, no pass/fail.

Two `snakemake` invocations of the GPU DAG through `--profile profiles/slurm --profile
tests/slurm/profile` on the 2-node SLURM test cluster (tests/slurm_cluster.py: joined, or
started and stopped again), each in a fresh temp dir, with the trainer double
(tests/fixtures/trainer_double.py) as verl's trainer in local upstream repos that rule deps
clones for real (``fixtures.gpu_dag.double_sources``, as tests/test_eval_slurm.py does), no
faults, ``--steps`` steps of ``--step-s`` seconds (``$HY3RL_DOUBLE_STEP_S``), a save every
2 steps, ``cluster.nodes: 1``: training holds one node, the evaluations run on the other.

A. beside: ``eval.steps`` every save step before the last (``[2, 4, 6]`` for 8 steps),
   ``eval.final: false``, both sets (the AIME-like test set and ``data.heldout``); the
   default target (the whole DAG: evaluations, selection, report).
B. alone: the same configuration with ``eval.steps: []`` and ``eval.final: false``;
   target ``results/<run>/train/done.json`` only, so that not even the base model's
   evaluation (``base`` is always a tag) runs beside training.

Figures:

- per evaluation step of A, per set: seconds from the checkpoint being complete to its
  ``metrics.json`` being written (the file's mtime): ``eval/step<N>/metrics.json`` (test
  set) and ``eval/heldout/step<N>/metrics.json`` (held-out set). The checkpoint's time is
  the mtime of its ``actor/ckpt_contents.json`` (the manifest verl writes last) while the
  checkpoint is still there, otherwise ``complete_at`` of ``eval/step<N>/checkpoint.json``
  (the same instant, to the second). Beside it: when the evaluation wait saw the
  checkpoint (``seen_at``) and when generation started (``samples.meta.json``
  ``started``), both to the second, and whether the metrics were written before training
  ended (``train/done.json``'s mtime);
- the mean of the trainer's ``timing_s/step`` over the steps of ``train/metrics.jsonl``
  (verl's file-logger lines ``{"step": N, "data": {...}}``) in A over that in B (a ratio;
  1.0: evaluation beside training costs the steps nothing), the per-step times of both;
- each invocation's wall time and its training attempts' ``wall_s``.

The test cluster's two "nodes" share this one host and the double's step is a sleep plus a
save (a copy of the tiny model), so the ratio shows the contention of the evaluations'
CPU and I/O on the host with the saves and the controller, not a GPU's.

    .venv/bin/python benchmarks/bench_eval_beside.py [--step-s S] [--steps N] [--keep]
                                                     [--timeout S]

Each run cleans up after itself: its SLURM jobs ended (scancel by id only if the
invocation was cut short), no Ray process of its training jobs left (killed by pid after a
grace period, and reported), its temp dir removed unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test fixtures (hy3rl itself is installed)

import yaml  # noqa: E402
from fixtures.common import SNAKEMAKE  # noqa: E402
from fixtures.gpu_dag import double_sources  # noqa: E402
from fixtures.trainer_double import leftover_ray  # noqa: E402
from hy3rl.layout import Layout, heldout_tag  # noqa: E402
from hy3rl.verl_log import read_metrics  # noqa: E402

RUNS = {"A": "bench-eval-beside", "B": "bench-train-alone"}  # run.name of each invocation
SAVE_FREQ = 2
TEST_PROFILE = REPO / "tests" / "slurm" / "profile"
TEST_CONFIG = REPO / "tests" / "slurm" / "config.yaml"
VENV_BIN = str(Path(sys.executable).parent)
POLL_S = 1.0  # how often this script looks at a running invocation
LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED")


# --------------------------------------------------------------------------- the runs


@dataclass
class Run:
    """One invocation: its label (A/B), run name, temp dir, evaluation steps and target
    (None: the default target); after it ran, its exit status (None: cut short at the
    timeout), wall time and output file."""

    label: str
    name: str
    tmp: Path
    eval_steps: list[int]
    target: str | None
    rc: int | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def work(self) -> Path:
        return self.tmp / "work"  # double_sources puts the deps clones under tmp/work

    @property
    def layout(self) -> Layout:
        return Layout.of_results(self.work / "results" / self.name, str(self.tmp / "ckpt"))

    @property
    def output(self) -> Path:
        return self.tmp / "snakemake.out"


def write_override(run: Run, steps: int) -> Path:
    """The config over config/config.yaml and tests/slurm/config.yaml (tests/test_eval_slurm.py's,
    without faults and retention pressure)."""
    override: dict[str, Any] = {
        "run": {"name": run.name},
        **double_sources(run.tmp),
        # training takes one node (exclusive); the evaluations run on the other one
        "cluster": {"nodes": 1},
        "train": {
            "checkpoint_root": str(run.tmp / "ckpt"), "total_training_steps": steps,
            "env": {"SAVE_FREQ": SAVE_FREQ, "TEST_FREQ": -1},
            "restarts_per_job": 0, "max_submissions": 1, "time_limit_margin_min": 0.5,
            "ray": {"register_timeout_s": 120, "head_timeout_s": 120},
        },
        "eval": {"n_samples": 2, "max_tokens": 4, "num_problems": 3,
                 "steps": run.eval_steps, "final": False, "wait_poll_s": 1,
                 "bootstrap": {"resamples": 200}},
        # the bridge check (not run without a GPU) as a job the test cluster can hold
        "checks": {"bridge": {"cpus": 1, "mem_mb": 1000, "runtime_min": 10}},
        "preflight": {"waive": ["bridge", "rehearsal"]},
        "report": {"dpi": 50},
    }
    override["data"]["heldout"] = {"limit": 6}
    path = run.tmp / "override.yaml"
    path.write_text(yaml.safe_dump(override))
    return path


def invoke(run: Run, steps: int, step_s: float, timeout_s: float) -> None:
    """Run the invocation (its own session, output to a file); at the timeout, SIGINT
    (Snakemake cancels its SLURM jobs), then SIGKILL."""
    run.work.mkdir(parents=True, exist_ok=True)
    override = write_override(run, steps)
    cmd = [*SNAKEMAKE, *([run.target] if run.target else []),
           "--snakefile", str(REPO / "Snakefile"), "--directory", str(run.work),
           "--profile", str(REPO / "profiles" / "slurm"), "--profile", str(TEST_PROFILE),
           "--configfile", str(REPO / "config" / "config.yaml"), str(TEST_CONFIG),
           str(override)]
    env = {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ["PATH"],
           "HY3RL_DOUBLE_STEP_S": f"{step_s:g}",
           "HY3RL_DOUBLE_HF_SOURCE": str(run.work / "resources" / "tiny-hy3"),
           "WANDB_MODE": "offline", "PYTHONPATH": str(REPO / "scripts")}
    for name in ("SLURM_JOB_ID", "HY3RL_DOUBLE_FAULTS", "HY3RL_DOUBLE_RELEASE"):
        env.pop(name, None)
    t0 = time.monotonic()
    with open(run.output, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=run.work, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None and time.monotonic() - t0 < timeout_s:
                time.sleep(POLL_S)
        except BaseException:  # e.g. Ctrl-C: it does not reach the invocation's session
            stop_group(proc)
            raise
        if proc.poll() is None:
            print(f"  snakemake still running after {timeout_s:g} s: interrupting it")
            stop_group(proc)
            run.rc = None
        else:
            run.rc = proc.returncode
    run.wall_s = time.monotonic() - t0


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the invocation's process group, SIGKILL if it is still there after 60 s."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


# --------------------------------------------------------------------------- cleanup


def records(layout: Layout) -> list[dict[str, Any]]:
    """The training attempt records (``attempt-<k>.json``), by attempt number."""
    found = sorted(Path(layout.train_attempts).glob("attempt-*.json"),
                   key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in found]


def queued_in(work: Path) -> list[str]:
    """Jobs alive in SLURM whose working directory is ``work``."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %T %Z"], capture_output=True, text=True,
                         timeout=60).stdout
    found = []
    for line in out.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[1] in LIVE_STATES and \
                Path(parts[2]).resolve() == work.resolve():
            found.append(parts[0])
    return found


def train_jobs(run: Run) -> list[str]:
    """The training jobs of the run: from its attempt records and its SLURM logs."""
    ids = {str(r["slurm_job_id"]) for r in records(run.layout) if r.get("slurm_job_id")}
    logs = run.work / ".snakemake" / "slurm_logs" / "rule_train"
    if logs.is_dir():
        ids |= {p.stem for p in logs.rglob("*.log") if p.stem.isdigit()}
    return sorted(ids, key=int)


def cleanup(run: Run) -> None:
    """End what the invocation left: its SLURM jobs (scancel by id), then the Ray
    processes of its training jobs (a grace period for their teardown, then SIGKILL by
    pid). What it found goes into ``run.notes``."""
    queued = queued_in(run.work)
    if queued:
        run.notes.append(f"SLURM jobs still queued, cancelled: {' '.join(queued)}")
        subprocess.run(["scancel", *queued], capture_output=True, timeout=60)
        deadline = time.monotonic() + 120
        while queued_in(run.work) and time.monotonic() < deadline:
            time.sleep(1)
    jobs = train_jobs(run)

    def left() -> list[int]:
        return sorted({pid for job in jobs for pid in leftover_ray(f"{run.name}-{job}-")})

    deadline = time.monotonic() + 60
    while left() and time.monotonic() < deadline:
        time.sleep(1)
    pids = left()
    if pids:
        run.notes.append(f"Ray processes left after the run, killed: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- figures


def epoch(stamp: str | None) -> float | None:
    """Epoch seconds of a record's ISO timestamp (``2026-01-02T03:04:05+00:00``)."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass
class Latency:
    """One evaluation of run A: checkpoint complete -> metrics.json written."""

    step: int
    set: str
    complete: float | None = None
    complete_src: str = ""
    seen: float | None = None
    started: float | None = None
    metrics: float | None = None
    during_training: bool | None = None

    @property
    def seconds(self) -> float | None:
        if self.complete is None or self.metrics is None:
            return None
        return self.metrics - self.complete


def latencies(run: Run) -> list[Latency]:
    """Per evaluation step, per set: the times of its checkpoint and its metrics."""
    layout = run.layout
    done = Path(layout.train_done)
    trained_until = done.stat().st_mtime if done.exists() else None
    out = []
    for step in run.eval_steps:
        tag = f"step{step}"
        ready = read_json(Path(layout.eval_ready(tag))) or {}
        complete, src = None, "missing"
        manifest = Path(str(ready.get("checkpoint", ""))) / "actor" / "ckpt_contents.json"
        if ready.get("checkpoint") and manifest.exists():
            complete, src = manifest.stat().st_mtime, "manifest mtime"
        elif ready.get("complete_at"):
            complete, src = epoch(ready["complete_at"]), "complete_at"
        for set_name, t in (("test", tag), ("heldout", heldout_tag(tag))):
            lat = Latency(step, set_name, complete, src, seen=epoch(ready.get("seen_at")))
            meta = read_json(Path(layout.eval_samples_meta(t))) or {}
            lat.started = epoch(meta.get("started"))
            metrics = Path(layout.eval_metrics(t))
            if metrics.exists():
                lat.metrics = metrics.stat().st_mtime
                if trained_until is not None:
                    lat.during_training = lat.metrics < trained_until
            out.append(lat)
    return out


def step_times(run: Run) -> dict[int, float]:
    """``timing_s/step`` per step of the run's train/metrics.jsonl."""
    times = {}
    for rec in read_metrics(Path(run.layout.train_metrics)):
        value = rec.get("data", {}).get("timing_s/step", rec.get("timing_s/step"))
        if isinstance(value, (int, float)):
            times[rec["step"]] = float(value)
    return times


# --------------------------------------------------------------------------- printing


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def since(t: float | None, t0: float | None) -> str:
    return "-" if t is None or t0 is None else f"{t - t0:+.0f}"


def print_run(run: Run, steps: int) -> None:
    """The invocation's outcome, its attempts, and its end if it failed."""
    done = Path(run.layout.train_done).exists()
    print(f"  snakemake exit {run.rc} after {run.wall_s:.1f} s; train/done.json "
          f"{'written' if done else 'missing'}")
    for r in records(run.layout):
        print(f"    attempt {r['attempt']}: job {r.get('slurm_job_id')} on {r.get('nodes')}, "
              f"steps {r.get('start_step')}->{r.get('end_step')}, {r.get('outcome')}, "
              f"wall_s {r.get('wall_s')}")
    times = step_times(run)
    if len(times) != steps:
        run.notes.append(f"train/metrics.jsonl has {len(times)} of {steps} steps")
    if run.rc != 0:
        lines = run.output.read_text(errors="replace").splitlines()[-30:]
        print(f"  last {len(lines)} lines of {run.output}:")
        for line in lines:
            print(f"    | {line}")
    for note in run.notes:
        print(f"  NOTE: {note}")


def print_latencies(lats: list[Latency]) -> None:
    print("\nA: checkpoint complete -> metrics.json written (s)")
    print(f"  {'step':>4} {'set':<8} {'latency':>8}  {'seen':>5} {'started':>7}  "
          f"{'before training ended':<22} checkpoint time from")
    for lat in lats:
        during = "-" if lat.during_training is None else ("yes" if lat.during_training
                                                          else "no")
        print(f"  {lat.step:>4} {lat.set:<8} {fmt(lat.seconds):>8}  "
              f"{since(lat.seen, lat.complete):>5} {since(lat.started, lat.complete):>7}  "
              f"{during:<22} {lat.complete_src}")
    for set_name in ("test", "heldout"):
        secs = [x.seconds for x in lats if x.set == set_name and x.seconds is not None]
        if secs:
            print(f"  {set_name}: mean {statistics.fmean(secs):.1f} s, max {max(secs):.1f} s "
                  f"over {len(secs)} step(s)")
    print("  (seen, started: seconds after the checkpoint was complete, to the second)")


def print_steps(a: Run, b: Run) -> None:
    ta, tb = step_times(a), step_times(b)
    print("\ntiming_s/step (the trainer's, train/metrics.jsonl)")
    for run, times in ((a, ta), (b, tb)):
        listed = " ".join(f"{s}:{t:.2f}" for s, t in sorted(times.items())) or "-"
        mean = fmt(statistics.fmean(times.values()), ".3f") if times else "-"
        print(f"  {run.label} ({'beside' if run.eval_steps else 'alone'}): mean {mean} s  "
              f"[{listed}]")
    if ta and tb:
        ratio = statistics.fmean(ta.values()) / statistics.fmean(tb.values())
        print(f"  A / B (mean step with evaluations beside / alone): {ratio:.3f}")
        saves = [s for s in ta if s % SAVE_FREQ == 0 and s in tb]
        others = [s for s in ta if s % SAVE_FREQ and s in tb]
        for what, sel in (("save steps", saves), ("other steps", others)):
            if sel:
                ra = statistics.fmean(ta[s] for s in sel)
                rb = statistics.fmean(tb[s] for s in sel)
                print(f"    {what}: {ra:.3f} / {rb:.3f} = {ra / rb:.3f}")
    else:
        print("  A / B: not measured (a run has no metrics lines)")


# --------------------------------------------------------------------------- main


def check_profile(info: Any) -> None:
    """The test profile must name the running cluster's partition and account."""
    res = yaml.safe_load((TEST_PROFILE / "config.yaml").read_text())["default-resources"]
    if (res["slurm_partition"], res["slurm_account"]) != (info.partition, info.account):
        raise SystemExit(f"{TEST_PROFILE / 'config.yaml'}: partition/account "
                         f"{res['slurm_partition']}/{res['slurm_account']} differ from the "
                         f"test cluster's {info.partition}/{info.account}")


def run_one(run: Run, steps: int, step_s: float, timeout_s: float) -> None:
    what = f"eval.steps {run.eval_steps}" if run.eval_steps else "eval.steps []"
    print(f"\n[{run.label}] {steps} steps of {step_s:g} s, save every {SAVE_FREQ}, {what}, "
          f"eval.final false, target {run.target or 'all'}; dir {run.tmp}")
    try:
        invoke(run, steps, step_s, timeout_s)
    finally:
        cleanup(run)
    print_run(run, steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step-s", type=float, default=3.0,
                    help="seconds one training step takes ($HY3RL_DOUBLE_STEP_S; default 3)")
    ap.add_argument("--steps", type=int, default=8,
                    help="training steps (default 8); evaluated in A: every save step "
                         f"(every {SAVE_FREQ}) before the last")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds each invocation may take (default 1800)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs of both runs")
    args = ap.parse_args(argv)
    eval_steps = list(range(SAVE_FREQ, args.steps, SAVE_FREQ))
    if not eval_steps:
        ap.error(f"--steps {args.steps}: no save step before the last to evaluate "
                 f"(saves every {SAVE_FREQ})")
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    import slurm_cluster

    runs = [Run("A", RUNS["A"], Path(tempfile.mkdtemp(prefix="bench-eval-beside-A-")),
                eval_steps, None)]
    b_tmp = Path(tempfile.mkdtemp(prefix="bench-eval-beside-B-"))
    runs.append(Run("B", RUNS["B"], b_tmp, [],
                    f"results/{RUNS['B']}/train/done.json"))
    try:
        with slurm_cluster.session() as info:
            check_profile(info)
            for run in runs:
                run_one(run, args.steps, args.step_s, args.timeout)
        a, b = runs
        print_latencies(latencies(a))
        print_steps(a, b)
        print("\nwall time per invocation")
        for run in runs:
            attempts = [r.get("wall_s") for r in records(run.layout)]
            print(f"  {run.label}: {run.wall_s:.1f} s (exit {run.rc}); training attempts' "
                  f"wall_s {attempts}")
    finally:
        for run in runs:
            if args.keep:
                print(f"kept {run.label}: {run.tmp}")
            else:
                shutil.rmtree(run.tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
