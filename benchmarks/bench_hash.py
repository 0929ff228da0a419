"""Benchmark: the shard hash check (``hy3rl.hub.verify(..., sha256=True)``) against plain
``sha256sum`` of the same files.

Writes a few random files (default 4 x 200 MB) to a temporary directory, writes their
manifest (``hy3rl.hub.run`` on the local directory, which also brings them into the page
cache), then times, alternately and ``--repeat`` times each: ``sha256sum`` of all files
(one process, one file after another, as a user would run it) and ``verify`` with
``--threads`` threads (each file read once, one file a thread). Prints the best MB/s of
each and the ratio; the target is verify >= 90 % of sha256sum. Both read from the page
cache, so this measures hashing, not the disk.

Run: ``.venv/bin/python benchmarks/bench_hash.py [--files 4] [--size-mb 200] [--threads N]
[--repeat 3] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from hy3rl import hub  # noqa: E402

TARGET = 0.90


def write_files(root: Path, n: int, size: int) -> list[Path]:
    block = 8 << 20
    files = []
    for i in range(n):
        path = root / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        with open(path, "wb") as fh:
            left = size
            while left:
                k = min(block, left)
                fh.write(os.urandom(k))
                left -= k
        files.append(path)
    return files


def time_sha256sum(files: list[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def time_verify(manifest: Path, root: Path, threads: int) -> float:
    t0 = time.perf_counter()
    problems = hub.verify(manifest, root, sha256=True, threads=threads, progress=False)
    dt = time.perf_counter() - t0
    assert problems == [], problems
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the files (a temp dir)")
    args = ap.parse_args()
    if not shutil.which("sha256sum"):
        print("sha256sum not found", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench-hash-", dir=args.dir))
    try:
        files = write_files(root, args.files, args.size_mb * 1_000_000)
        total = sum(f.stat().st_size for f in files)
        manifest = root.parent / f"{root.name}.manifest.json"
        hub.run(str(root), None, root, manifest=manifest, threads=args.threads, progress=False)
        best: dict[str, float] = {}
        for _ in range(args.repeat):
            for name, fn in (("sha256sum", lambda: time_sha256sum(files)),
                             (f"verify x{args.threads}",
                              lambda: time_verify(manifest, root, args.threads)),
                             ("verify x1", lambda: time_verify(manifest, root, 1))):
                best[name] = min(best.get(name, float("inf")), fn())
        mbps = {k: total / 1e6 / v for k, v in best.items()}
        print(f"{args.files} files x {args.size_mb} MB = {total / 1e6:.0f} MB, page cache "
              f"warm, {os.cpu_count()} cores, best of {args.repeat}")
        for name, rate in mbps.items():
            print(f"  {name:<12} {rate:8.0f} MB/s  ({best[name]:.2f} s)")
        ratio = mbps[f"verify x{args.threads}"] / mbps["sha256sum"]
        verdict = "meets" if ratio >= TARGET else "MISSES"
        print(f"verify x{args.threads} / sha256sum = {ratio:.0%} ({verdict} the target "
              f"{TARGET:.0%})")
        return 0 if ratio >= TARGET else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
        (root.parent / f"{root.name}.manifest.json").unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
