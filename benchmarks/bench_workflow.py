"""Figures of the workflow itself on the embedded default, offline (parquet made like the
tests make them; the pinned verl and TransferQueue from local mirrors, as the real-trainer
tests take them: fixtures.deps.real_upstreams): the wall time of the whole default DAG
(target: under 5 minutes on 2 cores), of its training job (the pinned verl on the CPU path:
its startup and steps, from the attempt record), bytes that `snakemake -p` prints, and the
wall time of a no-op rerun (`snakemake` again with nothing to do).

    .venv/bin/python benchmarks/bench_workflow.py [--repo DIR]

``--repo`` measures another checkout of this workflow (e.g. an older commit) the same way.
``--stand-in`` clones our stand-in repositories instead of the mirrors (no training: the
default's train job then fails, so only with a checkout whose default does not train).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tests"))  # the test fixtures (local repos, parquet)

from fixtures.data import aime_rows, dapo_rows, write_parquet  # noqa: E402
from fixtures.deps import MIRRORS, make_upstreams, mirror, real_upstreams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=HERE, help="workflow checkout to measure")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--stand-in", action="store_true", help="our stand-in upstreams")
    args = ap.parse_args()
    repo = args.repo.resolve()
    missing = [MIRRORS[n][0] for n in MIRRORS if mirror(n) is None]
    if missing and not args.stand_in:
        print(f"no mirror of the pinned upstreams: set {', '.join(missing)}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-workflow-"))
    ups = (make_upstreams if args.stand_in else real_upstreams)(tmp / "upstream")
    train = write_parquet(tmp / "src" / "dapo.parquet", dapo_rows(40, repeats=3))
    val = write_parquet(tmp / "src" / "aime.parquet", aime_rows(repeats=2), pandas_index=True)
    override = tmp / "offline.yaml"
    override.write_text(yaml.safe_dump({
        "deps": ups.section(tmp / "work" / "deps"),
        "data": {"train": {"source": str(train)}, "val": {"source": str(val)}},
    }))
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(repo / "Snakefile"),
           "--directory", str(work), "--profile", str(repo / "profiles/local"), "-p",
           "--configfile", str(repo / "config/config.yaml"), str(override)]
    env = dict(os.environ)
    if repo != HERE:  # an older checkout imports its own package
        env["PYTHONPATH"] = str(repo / "scripts")
    t0 = time.monotonic()
    first = subprocess.run(cmd, capture_output=True, env=env)
    t_full = time.monotonic() - t0
    if first.returncode != 0:
        sys.stderr.buffer.write(first.stdout[-4000:] + first.stderr[-4000:])
        return 1
    printed = len(first.stdout) + len(first.stderr)
    attempts = sorted((work / "results/tiny-default/train/attempts").glob("attempt-*.json"))
    noops = []
    for _ in range(3):
        t0 = time.monotonic()
        again = subprocess.run(cmd, capture_output=True, env=env)
        noops.append(time.monotonic() - t0)
    t_noop = sorted(noops)[1]  # the median of three
    nothing = b"Nothing to be done" in again.stdout + again.stderr
    print(f"repo: {repo}")
    print(f"full default DAG: {t_full:.1f} s (target 300 s), snakemake -p printed {printed} "
          "bytes")
    for path in attempts:
        import json

        rec = json.loads(path.read_text())
        timing = rec.get("timing") or {}
        print(f"train {path.stem}: {rec.get('outcome')}, {rec.get('wall_s')} s in all, "
              f"startup {timing.get('startup_s')} s, steps {rec.get('start_step')}-"
              f"{rec.get('end_step')}")
    print(f"no-op rerun: {t_noop:.2f} s, median of 3 "
          f"({'nothing to be done' if nothing else 'NOT a no-op'})")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(tmp)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
