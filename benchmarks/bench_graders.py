"""Benchmark: score 30 problems x 64 responses of realistic length with both graders.

Responses are synthetic but shaped like a reasoning model's AIME output under an 8192-token
budget: 1k-8k tokens (~4 characters a token) of prose mixed with inline and display LaTeX,
intermediate \\boxed{} values, and a final line in the formats seen in practice
(`Answer: N`, `Answer: N.`, `Answer: **N**`, zero-padded, boxed only, two answers, none:
truncated). The graders run exactly as rule eval_score (`hy3rl.graders.run`) runs them: a
pool of `--workers` processes with the per-task timeout. Target: under 30 s on 2 cores.

Run: .venv/bin/python benchmarks/bench_graders.py [--workers 2] [--problems 30] [--samples 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

from hy3rl.graders import GRADERS, DapoImpl, GraderPool, resolve_math_dapo

SENTENCES = [
    "Let $x$ be the number of ways to choose the vertices, so that $x = \\binom{{{a}}}{{3}}$.",
    "We have $a^2 + b^2 = {b}$ and $ab = {a}$, hence $(a+b)^2 = {c}$.",
    "Consider the polynomial $P(t) = t^3 - {a}t^2 + {b}t - {c}$ with roots $r, s, u$.",
    "By Vieta's formulas, $r + s + u = {a}$ and $rs + su + ur = {b}$.",
    "Then \\[ \\sum_{{k=1}}^{{{a}}} \\frac{{k}}{{k+1}} = {b} - H_{{{c}}} \\]",
    "So the probability is $\\frac{{{a}}}{{{b}}}$, which is already in lowest terms.",
    "Wait, that is not right. Let me recompute: $\\sqrt{{{a}}} \\cdot \\sqrt{{{b}}} = {c}$.",
    "Therefore the intermediate value is \\boxed{{{a}}}, but we still need the remainder mod 1000.",
    "Taking everything modulo $1000$, we get ${a} \\equiv {b} \\pmod{{1000}}$.",
    "The area of the triangle is $\\frac{{1}}{{2}} \\cdot {a} \\cdot {b} \\sin\\theta = {c}$.",
    "Hmm, let me double-check the case $n = {a}$ separately, since the argument above fails.",
    "Using the law of cosines, $c^2 = a^2 + b^2 - 2ab\\cos C$, so $c = {a}$.",
]


def final_line(rng: random.Random, gt: str) -> str:
    wrong = str((int(gt) + rng.randint(1, 50)) % 1000)
    ans = gt if rng.random() < 0.6 else wrong
    return rng.choices([
        f"Answer: {ans}", f"Answer: {ans}.", f"Answer: **{ans}**", f"Answer: {int(ans):03d}",
        f"The final answer is $\\boxed{{{ans}}}$.", f"\\boxed{{{gt}}}\n\nAnswer: {wrong}",
        "",  # truncated: no final answer
    ], weights=[50, 8, 8, 6, 10, 4, 14])[0]


def response(rng: random.Random, gt: str) -> str:
    tokens = rng.randint(1000, 8000)
    parts, length = [], 0
    while length < tokens * 4:
        s = rng.choice(SENTENCES).format(a=rng.randint(2, 999), b=rng.randint(2, 9999),
                                         c=rng.randint(2, 99999))
        parts.append(s)
        length += len(s) + 1
    return " ".join(parts) + "\n\n" + final_line(rng, gt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=30)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lock", default=None, help="deps/lock.json: use the pinned math_dapo.py")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    gts = [str(rng.randint(0, 999)) for _ in range(args.problems)]
    samples = [(gt, response(rng, gt)) for gt in gts for _ in range(args.samples)]
    chars = sum(len(r) for _, r in samples)
    impl = resolve_math_dapo(args.lock) if args.lock else DapoImpl("hy3rl reimplementation")
    print(f"{len(samples)} responses, mean {chars / len(samples):,.0f} characters "
          f"(~{chars / len(samples) / 4:,.0f} tokens); math_dapo: {impl.implementation}; "
          f"{args.workers} workers, timeout {args.timeout} s")
    t0 = time.perf_counter()
    with GraderPool(impl, workers=args.workers, timeout_s=args.timeout) as pool:
        t_start = time.perf_counter() - t0
        timings = {}
        results = {}
        for g in GRADERS:
            t = time.perf_counter()
            results[g] = pool.run([(g, r, gt) for gt, r in samples])
            timings[g] = time.perf_counter() - t
    total = time.perf_counter() - t0
    print(f"worker start-up        {t_start:7.2f} s")
    for g in GRADERS:
        acc = sum(r["acc"] for r in results[g]) / len(samples)
        fails = Counter(r["status"] for r in results[g] if r["status"] != "ok")
        print(f"{g:<22} {timings[g]:7.2f} s  ({1000 * timings[g] / len(samples):.2f} ms/sample, "
              f"accuracy {acc:.3f}, failures {dict(fails) or 0})")
    both = sum(timings.values())
    fmt = sum(v["acc"] and not d["acc"] for d, v in zip(results["math_dapo"],
                                                         results["math_verify"], strict=True))
    print(f"both graders           {both:7.2f} s  ({len(samples) / both:.0f} samples/s)")
    print(f"total incl. start-up   {total:7.2f} s  (target < 30 s on 2 cores: "
          f"{'met' if total < 30 else 'NOT met'})")
    print(f"format failures (math-verify right, math_dapo wrong): {fmt}/{len(samples)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
