"""Benchmark of the train stage's launcher (prints figures; no pass/fail).

1. Overhead from `snakemake` start to the trainer's first line: Snakemake (+ SLURM
   submission and scheduling), the node discovery, Ray head, workers and registration,
   `ray job submit` and the runtime env, until the trainer double prints its first line.
   Broken down by the launcher's timestamped phases.
2. Time to detect a dead Ray node: while the trainer runs, the raylet of one node is
   SIGKILLed; measured until the launcher reports that node dead (and until the rule ends).

    .venv/bin/python benchmarks/bench_train.py [--executor slurm|local|both]

`slurm` uses the 2-node test cluster (tests/slurm_cluster.py: joined, or started and
stopped again); the trainer is the test double (tests/fixtures/trainer_double.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test fixtures (hy3rl itself is installed)

import psutil  # noqa: E402
import yaml  # noqa: E402
from fixtures.common import SNAKEMAKE, make_git_repo  # noqa: E402
from fixtures.trainer_double import MAIN_PPO_DOUBLE, TrainSetup  # noqa: E402
from fixtures.verl import fake_verl_files  # noqa: E402

RUN = "tiny-default"
PHASE = re.compile(r"^(\S+ \S+) hy3rl\.launch INFO: \[\+\s*([\d.]+)s\] (.*)$")


def make_setup(root: Path, total: int, step_s: float) -> TrainSetup:
    files = dict(fake_verl_files())
    files["verl/trainer/main_ppo.py"] = MAIN_PPO_DOUBLE
    verl = root / "deps" / "verl"
    make_git_repo(verl, files)
    return TrainSetup(root, verl, run=RUN, total=total, save_freq=5, step_s=step_s)


def snakemake_cmd(setup: TrainSetup, executor: str) -> list[str]:
    override = setup.root / "override.yaml"
    doc = {"train": setup.config["train"]}
    if executor == "local":
        doc["cluster"] = setup.config["cluster"]
    override.write_text(yaml.safe_dump(doc))
    cmd = [*SNAKEMAKE, f"results/{RUN}/train/done.json", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(setup.root), "--allowed-rules", "train"]
    if executor == "slurm":
        cmd += ["--profile", str(REPO / "profiles" / "slurm"),
                "--profile", str(REPO / "tests" / "slurm" / "profile"),
                "--configfile", str(REPO / "config" / "config.yaml"),
                str(REPO / "tests" / "slurm" / "config.yaml"), str(override)]
    else:
        cmd += ["--profile", str(REPO / "profiles" / "local"),
                "--configfile", str(REPO / "config" / "config.yaml"), str(override)]
    return cmd


def wait_until(cond, timeout: float, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    return None


def phases(setup: TrainSetup) -> list[tuple[float, str]]:
    log = setup.results / "train" / "attempts" / "attempt-1" / "launcher.log"
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        m = PHASE.match(line)
        if m:
            out.append((float(m.group(2)), m.group(3)[:70]))
    return out


def raylet_of(scope_part: str, node: str) -> psutil.Process | None:
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.info["name"] == "raylet" and scope_part in p.environ().get(
                    "HY3RL_RAY_SCOPE", "") and f"-{node}-" in p.environ()["HY3RL_RAY_SCOPE"]:
                return p
        except (psutil.Error, OSError, KeyError):
            continue
    return None


def bench(executor: str, victim: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        setup = make_setup(Path(tmp), total=400, step_s=0.5)
        if executor == "local":
            setup.config["cluster"] = {"gpu": True, "nodes": 1, "gpus_per_node": 0,
                                       "cpus_per_node": 1}
        env = {**os.environ, **setup.env(),
               "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
        env.pop("SLURM_JOB_ID", None)
        driver = setup.results / "train" / "attempts" / "attempt-1" / "driver.log"
        t0 = time.monotonic()
        proc = subprocess.Popen(snakemake_cmd(setup, executor), env=env, cwd=tmp,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        first = wait_until(lambda: driver.exists() and "main_ppo double" in driver.read_text(),
                           600)
        t_first = time.monotonic() - t0
        print(f"\n[{executor}] snakemake start -> trainer's first line: "
              f"{t_first:.1f} s" if first else f"[{executor}] trainer never started")
        for t, what in phases(setup):
            print(f"    launcher +{t:7.1f} s  {what}")
        if not first:
            proc.kill()
            return
        rec = json.loads((setup.results / "train" / "attempts" / "attempt-1.json").read_text())
        scope = f"{RUN}-{rec['slurm_job_id'] or 'local'}-1"
        node = victim if executor == "slurm" else rec["nodes"][0]
        raylet = raylet_of(scope, node)
        if raylet is None:
            print(f"    no raylet found for node {node}")
            proc.kill()
            return
        log = setup.results / "logs" / "train.log"
        t_kill = time.monotonic()
        raylet.send_signal(signal.SIGKILL)
        seen = wait_until(lambda: log.exists() and re.search(
            rf"Ray on node {node} \(\w+\) died", log.read_text()), 300)
        t_detect = time.monotonic() - t_kill
        proc.wait(timeout=600)
        t_end = time.monotonic() - t_kill
        print(f"[{executor}] raylet of {node} killed -> launcher reports it dead: "
              f"{t_detect:.1f} s" if seen else f"[{executor}] death not reported")
        print(f"[{executor}] raylet killed -> snakemake exits ({proc.returncode}): {t_end:.1f} s")
        final = json.loads((setup.results / "train" / "attempts" / "attempt-1.json")
                           .read_text())
        print(f"    attempt exit reason: {final['exit_reason']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--executor", choices=["slurm", "local", "both"], default="both")
    ap.add_argument("--victim", default="n2", help="SLURM node whose raylet is killed")
    args = ap.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    if args.executor in ("local", "both"):
        bench("local", args.victim)
    if args.executor in ("slurm", "both"):
        import slurm_cluster

        with slurm_cluster.session():
            bench("slurm", args.victim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
