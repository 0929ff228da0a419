"""Benchmark of stage `data` (not a test): a 1.79M-row DAPO-Math-17k-shaped parquet
(17,917 prompts x 100, realistic prompt lengths) through the real CLI (`hy3rl data`).

    .venv/bin/python benchmarks/bench_data.py [--tokenizer MODEL_DIR] [--keep DIR]

Prints the wall time, CPU time and peak resident memory of the `hy3rl data` process
for the published setting (file as-is, 1,791,700 rows written) and with dedup.
Target on 2 cores: under 60 s and 4 GiB each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from hy3rl.data import DAPO_PREFIX, DAPO_SUFFIX
from hy3rl.layout import Layout

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test fixtures' data builders (not a package)

from fixtures.data import aime_rows, build_tiny_tokenizer, write_parquet  # noqa: E402

UNIQUE = 17_917
REPEATS = 100
TEXT_DUPLICATES = 519  # upstream: 17,917 uuids but ~17,398 distinct prompt texts
WORDS = (
    "let find the number of real integer positive sum product triangle circle radius "
    "area probability value function polynomial roots sequence digits remainder when "
    "divided by prime square cube angle points lines such that each and is are for with "
    "$x$ $y$ $n$ $a_n$ $\\frac{1}{2}$ $\\sqrt{3}$ = + - < > 0 1 2 3 4 5 6 7 8 9 10 100 2024"
).split()


def build_train(path: Path, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    # DAPO problem statements: median ~300 characters, a long tail to several thousand.
    n_chars = np.clip(rng.lognormal(np.log(300), 0.7, UNIQUE), 40, 8000).astype(int)
    words = np.array(WORDS)
    problems = []
    for i, n in enumerate(n_chars):
        chosen = words[rng.integers(0, len(words), max(4, n // 5))]
        problems.append(f"Problem {i}: " + " ".join(chosen)[:n])
    for j in range(TEXT_DUPLICATES):  # same text under another uuid
        problems[UNIQUE - 1 - j] = problems[j]
    content = [DAPO_PREFIX + p + DAPO_SUFFIX for p in problems]
    answers = [str(int(a)) for a in rng.integers(-1000, 100000, UNIQUE)]
    base = pa.table({
        "data_source": pa.array(["math_dapo"] * UNIQUE),
        "prompt": pa.array([[{"content": c, "role": "user"}] for c in content]),
        "ability": pa.array(["MATH"] * UNIQUE),
        "reward_model": pa.array(
            [{"ground_truth": a, "style": "rule-lighteval/MATH_v2"} for a in answers]),
        "extra_info": pa.array([{"index": str(uuid.UUID(int=int(rng.integers(0, 2**63))))}
                                for _ in range(UNIQUE)]),
    })
    table = base.take(np.tile(np.arange(UNIQUE), REPEATS))  # whole file repeated x100
    pq.write_table(table, path)
    chars = np.array([len(c) for c in content])
    return {"rows": table.num_rows, "mean_prompt_chars": float(chars.mean()),
            "max_prompt_chars": int(chars.max()), "bytes": path.stat().st_size,
            "corpus": content[:2000]}


def run_stage(tmp: Path, tokenizer: Path, train: Path, val: Path, dedup: bool) -> dict:
    name = "dedup" if dedup else "asis"
    layout = Layout(str(tmp / "results"), name)
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": {"name": name, "results_root": layout.results_root},
        "model": {"source": str(tokenizer)},
        "data": {"train": {"source": str(train), "dedup": dedup},
                 "val": {"source": str(val), "dedup": True}},
    }))
    log = tmp / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hy3rl.cli", "data", "--configfile", str(cfg)],
            stdout=fh, stderr=subprocess.STDOUT, cwd=tmp,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"hy3rl data failed:\n{log.read_text()}")
    summary = json.loads(Path(layout.data_summary).read_text())
    return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "train": summary["splits"]["train"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a model directory (default: a BPE tokenizer trained here)")
    ap.add_argument("--keep", type=Path, default=None, help="work here instead of a temp dir")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as td:
        tmp = args.keep or Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        train, val = tmp / "dapo-math-17k.parquet", tmp / "aime-2024.parquet"
        t0 = time.perf_counter()
        info = build_train(train)
        write_parquet(val, aime_rows(32), pandas_index=True)
        tokenizer = args.tokenizer or build_tiny_tokenizer(tmp / "tokenizer", info.pop("corpus"),
                                                           vocab_size=8000)
        info.pop("corpus", None)
        print(f"built {info['rows']:,} rows ({info['bytes'] / 2**20:.0f} MiB parquet, mean "
              f"prompt {info['mean_prompt_chars']:.0f} chars, max {info['max_prompt_chars']}) "
              f"in {time.perf_counter() - t0:.1f} s; cores available: {os.cpu_count()}")
        for dedup in (False, True):
            res = run_stage(tmp, tokenizer, train, val, dedup)
            rec = res["train"]
            print(f"dedup={dedup}: wall {res['wall_s']:.1f} s (cpu {res['cpu_s']:.1f} s; load "
                  f"{os.getloadavg()[0]:.1f}), peak RSS "
                  f"{res['peak_rss_gib']:.2f} GiB; train rows {rec['rows']:,} "
                  f"(input {rec['input']['rows']:,}, unique prompts "
                  f"{rec['input']['unique_prompts']:,}); prompt tokens "
                  f"{json.dumps(rec['prompt_tokens'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
