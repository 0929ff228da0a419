"""Figures of the workflow itself on the embedded default, offline (local git repos and
parquet made like the tests make them): bytes that `snakemake -p` prints for the whole
default DAG, and the wall time of a no-op rerun (`snakemake` again with nothing to do).

    .venv/bin/python benchmarks/bench_workflow.py [--repo DIR]

``--repo`` measures another checkout of this workflow (e.g. an older commit) the same way.
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
from fixtures.deps import make_upstreams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=HERE, help="workflow checkout to measure")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    repo = args.repo.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="bench-workflow-"))
    ups = make_upstreams(tmp / "upstream")
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
    noops = []
    for _ in range(3):
        t0 = time.monotonic()
        again = subprocess.run(cmd, capture_output=True, env=env)
        noops.append(time.monotonic() - t0)
    t_noop = sorted(noops)[1]  # the median of three
    nothing = b"Nothing to be done" in again.stdout + again.stderr
    print(f"repo: {repo}")
    print(f"full default DAG: {t_full:.1f} s, snakemake -p printed {printed} bytes")
    print(f"no-op rerun: {t_noop:.2f} s, median of 3 "
          f"({'nothing to be done' if nothing else 'NOT a no-op'})")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(tmp)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
