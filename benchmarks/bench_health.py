"""Benchmark: the training-health guard's rules (hy3rl.health) on noisy healthy runs shaped
like the published ones and on the collapse shapes they exist for (issue 41).

Healthy runs: the published curves the report draws (``hy3rl.report.figures.PUBLISHED``:
the reward 0.4 -> 0.8, the drift's bump, the AIME validation accuracy), interpolated per
step and held after step 190, with noise: the reward a batch mean's (sd ``--reward-sd``,
0.03: 2,048 responses of a -1/1 score give about 0.02), the drift, entropy, lengths and
clip ratio multiplicative (20 %, 10 %, 5 %, 20 %) around a normal trainer's levels, and each
validation (every 10 steps, as the paper's TEST_FREQ) sampled as the paper's is measured:
30 problems x 32 samples, each problem's own solve rate drawn once a run around the curve
(logit offsets sd 1.5: some always solved, some never), so the accuracy moves by its real
sampling error. Every rule of config/paper.yaml is fed through ``hy3rl.health.Watcher``
with the paper's composed response cap (8,192).

Prints, for ``--runs`` healthy runs of 200 and of 300 steps: the runs where each rule fired
(false warns and false stops); for the validation rule, a grid of ``k`` x validations in a
row (the runs with a false warn, the warns per run, and the validations until a 10-point fall
from step 100 is caught); and for each collapse shape (a NaN loss, a drift, a reward to -1,
to -0.6 and to -0.97, an entropy collapse, a slow one to 0.013, an entropy rise, lengths
collapsing and exploding from 2,048 toward the cap, a 10-point validation fall), the rule
that fired first, its step and the checkpoint named last healthy (saves every 20 steps, as
the paper's SAVE_FREQ) against the last one before the collapse.

Run: ``.venv/bin/python benchmarks/bench_health.py [--runs 1000] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from hy3rl import config as cfgmod  # noqa: E402
from hy3rl.health import Watcher, last_healthy  # noqa: E402
from hy3rl.report.figures import PUBLISHED  # noqa: E402
from hy3rl.settings import Config  # noqa: E402

VAL = "val-core/math_dapo/acc/mean@1"
CAP = 8192.0
SAVE_FREQ = 20
TEST_FREQ = 10
PROBLEMS, SAMPLES = 30, 32
COLLAPSE_AT = 101  # the first sick step of every collapse shape


def curve(key: str, step: int) -> float:
    xs, ys = zip(*PUBLISHED[key]["points"], strict=True)
    return float(np.interp(step, xs, ys))


def validation(rng: np.random.Generator, acc: float, offsets: np.ndarray) -> float:
    """One validation as the paper measures it: each problem's solve rate around ``acc``
    (its own logit offset), 32 samples each."""
    logit = math.log(acc / (1 - acc))
    p = 1 / (1 + np.exp(-(logit + offsets)))
    # recentre so that the expected accuracy is the curve's
    p = np.clip(p + (acc - p.mean()), 0.0, 1.0)
    return float(rng.binomial(SAMPLES, p).sum() / (PROBLEMS * SAMPLES))


def healthy_run(rng: np.random.Generator, steps: int, reward_sd: float,
                fall: float = 0.0) -> list[dict]:
    """One noisy healthy run (``fall``: the validation accuracy lowered by it from step
    COLLAPSE_AT on)."""
    offsets = rng.normal(0, 1.5, PROBLEMS)
    out = []
    for step in range(1, steps + 1):
        x = step / steps
        d = {
            "actor/pg_loss": -0.01, "actor/grad_norm": 0.3 * float(1 + rng.normal(0, 0.1)),
            "critic/score/mean": curve("critic/rewards/mean", step) + float(
                rng.normal(0, reward_sd)),
            "training/rollout_probs_diff_mean": curve("training/rollout_probs_diff_mean", step)
            * float(1 + rng.normal(0, 0.2)),
            "actor/entropy": (0.5 - 0.1 * x) * float(1 + rng.normal(0, 0.1)),
            "response_length/mean": (2000.0 + 2 * step) * float(1 + rng.normal(0, 0.05)),
            "response_length/clip_ratio": 0.05 * float(1 + rng.normal(0, 0.2)),
        }
        if step % TEST_FREQ == 0:
            acc = curve(VAL, step) - (fall if step >= COLLAPSE_AT else 0.0)
            d[VAL] = validation(rng, acc, offsets)
        out.append({"step": step, "data": d})
    return out


def feed(health, records: list[dict]) -> Watcher:
    w = Watcher(health, CAP)
    for r in records:
        w.feed(r)
    return w


def with_validation(paper: dict, k: float, validations: int):
    cfg = copy.deepcopy(paper)
    cfg["train"]["health"]["validation"].update(k=k, validations=validations)
    return Config.from_dict(cfg).train.health


def collapses() -> dict[str, callable]:
    """Shape name -> an edit of a step's metrics from COLLAPSE_AT on (step, its data)."""
    def at(key, value):
        return lambda s, d: d.__setitem__(key, value)

    def slow_entropy(s, d):
        d["actor/entropy"] = float(0.45 * (0.013 / 0.45) ** min(1.0, (s - COLLAPSE_AT) / 100))

    def explode(s, d):
        d["response_length/mean"] = min(CAP * 0.98, 2048.0 + 150.0 * (s - COLLAPSE_AT + 1))

    return {
        "NaN policy loss": at("actor/pg_loss", float("nan")),
        "drift to 0.05": at("training/rollout_probs_diff_mean", 0.05),
        "reward to -1": at("critic/score/mean", -1.0),
        "reward to -0.97": at("critic/score/mean", -0.97),
        "reward to -0.6": at("critic/score/mean", -0.6),
        "entropy collapse to 0.05": at("actor/entropy", 0.05),
        "slow entropy collapse to 0.013": slow_entropy,
        "entropy rise to 1.2": at("actor/entropy", 1.2),
        "lengths collapse to 300": at("response_length/mean", 300.0),
        "lengths explode toward the cap": explode,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reward-sd", type=float, default=0.03)
    args = ap.parse_args()
    t0 = time.perf_counter()
    paper = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
    health = Config.from_dict(paper).train.health
    rng = np.random.default_rng(args.seed)
    runs = {n: [healthy_run(rng, n, args.reward_sd) for _ in range(args.runs)]
            for n in (200, 300)}

    print(f"healthy runs: {args.runs} of 200 and of 300 steps; config/paper.yaml's rules")
    print(f"{'rule':<18}{'action':<8}{'200 steps':>12}{'300 steps':>12}   (runs where it fired)")
    for name, section in health.rules():
        counts = []
        for n in (200, 300):
            counts.append(sum(any(e.rule == name and e.kind == "fired"
                                  for e in feed(health, r).events) for r in runs[n]))
        print(f"{name:<18}{section.action:<8}{counts[0]:>12}{counts[1]:>12}")
    blind = sum(any(e.kind == "blind" for e in feed(health, r).events) for r in runs[200])
    print(f"{'(blind warns)':<26}{blind:>12}")

    print("\nvalidation rule: k x validations in a row (false-warn runs of 200 / 300 "
          "steps, warns per warned run, validations to catch a 10-point fall from step 101)")
    falls = [healthy_run(rng, 200, args.reward_sd, fall=0.10) for _ in range(min(200, args.runs))]
    only = copy.deepcopy(paper)
    for name in ("nonfinite", "drift", "entropy", "response_length", "clip_ratio",
                 "reward_floor", "reward_fall"):
        only["train"]["health"][name] = {"action": "ignore"}
    for k, v in [(k, v) for k in (3, 3.5, 4, 4.5, 5) for v in (1, 2)]:
            h = with_validation(only, k, v)
            false = []
            per = []
            for n in (200, 300):
                warned = [sum(e.kind == "fired" for e in feed(h, r).events) for r in runs[n]]
                false.append(sum(bool(x) for x in warned))
                per += [x for x in warned if x]
            delays = []
            for r in falls:
                ev = [e for e in feed(h, r).events if e.kind == "fired" and e.step >= COLLAPSE_AT]
                delays.append((ev[0].step - COLLAPSE_AT) // TEST_FREQ + 1 if ev else None)
            caught = [d for d in delays if d is not None]
            mark = "  <- default" if (k, v) == (
                health.validation.k, health.validation.validations) else ""
            print(f"  k {k:<4} x{v}: false {false[0]:>4} / {false[1]:>4} of {args.runs}; "
                  f"warns/run {np.mean(per) if per else 0:.2f}; fall caught in "
                  f"{len(caught)}/{len(falls)} runs, median {np.median(caught) if caught else '-'}"
                  f" max {max(caught) if caught else '-'} validations{mark}")

    print(f"\ncollapse shapes from step {COLLAPSE_AT} (saves every {SAVE_FREQ}; the last "
          f"healthy checkpoint is {((COLLAPSE_AT - 2) // SAVE_FREQ) * SAVE_FREQ})")
    saves = list(range(SAVE_FREQ, 301, SAVE_FREQ))
    shapes = {**collapses(), "validation falls 10 points": None}
    for shape, edit in shapes.items():
        base = healthy_run(rng, 300, args.reward_sd, fall=0.10 if edit is None else 0.0)
        if edit is not None:
            for r in base[COLLAPSE_AT - 1:]:
                edit(r["step"], r["data"])
        w = feed(health, base)
        fired = [e for e in w.events if e.kind == "fired" and e.step >= COLLAPSE_AT - 1]
        if not fired:
            print(f"  {shape:<32} not caught")
            continue
        first = fired[0]
        stop = next((e for e in fired if e.action == "stop"), None)
        named = last_healthy([s for s in saves if s <= first.step], w.events)
        print(f"  {shape:<32} {first.rule} ({first.action}) at step {first.step}"
              + (f", stop at {stop.step} ({stop.rule})" if stop else ", warn only")
              + f"; last healthy named: {named}")
    print(f"\n{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
