"""AIME metrics from graded samples: avg@n, unbiased pass@k, maj@k, format failures,
truncation, sampling standard error, problem-level bootstrap intervals, per-problem table,
and for a checkpoint the per-problem differences against ``base`` with a paired bootstrap.

Definitions are in docs/formats/eval.md (the contract); in short, with n samples per
problem, N problems and c_i correct samples of problem i:
pass@k = mean_i [1 - C(n - c_i, k) / C(n, k)] (Chen et al. 2021); maj@k is the expected
majority-vote score of k samples drawn without replacement from the n (every subset when
there are at most MAJ_SUBSETS, else MAJ_SUBSETS seeded random ones), a tie scoring the
fraction of tied answers that are correct; sampling_se = sqrt(sum_i p_i (1 - p_i) / n) / N;
bootstrap intervals resample problems with numpy ``default_rng(seed)``.

Entry points: :func:`run` (one tag's metrics.json: rule ``eval_metrics`` through
``scripts/adapters/eval_metrics.py``, and ``hy3rl metrics --tag T``) and :func:`run_summary`
(summary.json over the tags: rule ``evaluate`` through ``scripts/adapters/evaluate.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hy3rl.atomic import write_json_atomic
from hy3rl.errors import StageError
from hy3rl.settings import Bootstrap

GRADERS = ("math_dapo", "math_verify")
MAJ_SUBSETS = 1000  # maj@k, k < n: exact over all C(n, k) subsets up to this many, else sampled
NO_ANSWER = {"math_dapo": "[INVALID]", "math_verify": ""}


class MetricsError(StageError):
    """Inconsistent or unreadable scores (the message names the file and problem at fault)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples (Chen et al. 2021):
    1 - C(n-c, k)/C(n, k), computed as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def ks_for(n: int) -> list[int]:
    """k = 1, 2, 4, ... below n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority_vote(answers: Sequence[str | None],
                  correct: Sequence[bool]) -> tuple[float, list[str]]:
    """maj score of one problem: the most common extracted answer among ``answers`` (None =
    no answer, does not vote). Ties: the score is the fraction of the tied top answers that
    are correct (expected score of a uniformly random tie-break), and all tied answers are
    returned (in order of first appearance). An answer is correct per the verdict of its
    first sample. No vote at all: 0.0."""
    counts: Counter[str] = Counter(a for a in answers if a is not None)
    if not counts:
        return 0.0, []
    top = max(counts.values())
    first_verdict: dict[str, bool] = {}
    for a, ok in zip(answers, correct, strict=True):
        if a is not None and a not in first_verdict:
            first_verdict[a] = bool(ok)
    tied = [a for a in first_verdict if counts[a] == top]
    return sum(first_verdict[a] for a in tied) / len(tied), tied


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int,
             seed: Sequence[int], max_subsets: int = MAJ_SUBSETS) -> float:
    """Expected majority-vote score (the rule of ``majority_vote``, ties included) of k of
    the n samples drawn without replacement: the mean over every k-subset when C(n, k) <=
    ``max_subsets``, else over ``max_subsets`` random k-subsets from numpy
    ``default_rng(seed)`` (reproducible). Every sample is used (not just the first k), so
    maj@1 equals the accuracy of the samples that have an answer, i.e. pass@1."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n (n={n}, k={k})")
    if k == n:
        return majority_vote(answers, correct)[0]
    # answer codes (-1: no answer) and each answer's verdict (that of its first sample)
    code_of: dict[str, int] = {}
    verdict: list[bool] = []
    for a, ok in zip(answers, correct, strict=True):
        if a is not None and a not in code_of:
            code_of[a] = len(verdict)
            verdict.append(bool(ok))
    if not verdict:
        return 0.0
    codes = np.array([-1 if a is None else code_of[a] for a in answers])
    if math.comb(n, k) <= max_subsets:
        subsets = np.array(list(itertools.combinations(range(n), k)))
    else:
        rng = np.random.default_rng(list(seed))
        subsets = rng.permuted(np.tile(np.arange(n), (max_subsets, 1)), axis=1)[:, :k]
    picked = codes[subsets]  # (subsets, k)
    counts = (picked[..., None] == np.arange(len(verdict))).sum(axis=1)  # (subsets, answers)
    top = counts.max(axis=1, keepdims=True)
    tied = (counts == top) & (top > 0)
    right = (tied & np.array(verdict)).sum(axis=1)
    scores = np.where(top[:, 0] > 0, right / np.maximum(tied.sum(axis=1), 1), 0.0)
    return float(scores.mean())


def sampling_se(p: Sequence[float], n: int) -> float:
    """Standard error of the mean accuracy from sampling n answers per problem, problems
    fixed: sqrt(sum_i p_i (1 - p_i) / n) / N."""
    arr = np.asarray(p, dtype=float)
    return float(math.sqrt(float(np.sum(arr * (1 - arr))) / n) / len(arr))


def bootstrap_ci(values: Sequence[float], resamples: int, level: float,
                 seed: int) -> dict[str, Any]:
    """Percentile interval of the mean of ``values`` over problem-level resamples."""
    arr = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(arr), size=(resamples, len(arr)))
    means = arr[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"level": level, "low": float(lo), "high": float(hi), "resamples": resamples,
            "seed": seed}


@dataclass
class ProblemScores:
    problem_id: str
    ground_truth: str
    # per grader: lists indexed by sample_index
    acc: dict[str, list[bool]] = field(default_factory=dict)
    pred: dict[str, list[str | None]] = field(default_factory=dict)
    status: dict[str, list[str]] = field(default_factory=dict)
    finish: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def group_scores(scores: Sequence[dict[str, Any]], source: str = "scores") -> list[ProblemScores]:
    """Group scores.jsonl lines by problem id (order of first appearance), checking that
    each problem has sample indices 0..n-1 exactly once and all problems the same n."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for s in scores:
        by_id.setdefault(str(s["problem_id"]), []).append(s)
    out = []
    n_expected = None
    for pid, rows in by_id.items():
        rows = sorted(rows, key=lambda r: int(r["sample_index"]))
        idx = [int(r["sample_index"]) for r in rows]
        if idx != list(range(len(rows))):
            raise MetricsError(f"{source}: problem {pid}: sample indices are not 0..{len(rows)-1}"
                               " exactly once (duplicates or gaps)")
        if n_expected is None:
            n_expected = len(rows)
        elif len(rows) != n_expected:
            raise MetricsError(f"{source}: problem {pid} has {len(rows)} samples, others "
                               f"{n_expected}")
        ps = ProblemScores(pid, str(rows[0].get("ground_truth", "")))
        for g in GRADERS:
            ps.acc[g] = [bool(r[g]["acc"]) and r[g]["status"] == "ok" for r in rows]
            ps.status[g] = [r[g]["status"] for r in rows]
            ps.pred[g] = [r[g]["pred"] if r[g]["status"] == "ok" and r[g]["pred"] != NO_ANSWER[g]
                          else None for r in rows]
        ps.finish = [str(r.get("finish_reason")) for r in rows]
        ps.tokens = [int(r.get("num_tokens") or 0) for r in rows]
        out.append(ps)
    if not out:
        raise MetricsError(f"{source}: no scored samples")
    return out


def grader_metrics(problems: Sequence[ProblemScores], grader: str,
                   boot: dict[str, Any]) -> dict[str, Any]:
    n = len(problems[0].acc[grader])
    c = [sum(p.acc[grader]) for p in problems]
    p_i = [ci / n for ci in c]
    res: dict[str, Any] = {
        "avg@n": float(np.mean(p_i)),
        "pass@k": {str(k): float(np.mean([pass_at_k(n, ci, k) for ci in c])) for k in ks_for(n)},
        "maj@k": {str(k): float(np.mean([
            maj_at_k(p.pred[grader], p.acc[grader], k, (int(boot["seed"]), i, k))
            for i, p in enumerate(problems)])) for k in ks_for(n)},
        "sampling_se": sampling_se(p_i, n),
        "bootstrap_ci": bootstrap_ci(p_i, boot["resamples"], boot["level"], boot["seed"]),
        "grader_failures": {st: sum(s == st for p in problems for s in p.status[grader])
                            for st in ("timeout", "error")},
    }
    return res


def paired_difference(this: Mapping[str, float], base: Mapping[str, float],
                      boot: Mapping[str, Any], base_tag: str = "base") -> dict[str, Any]:
    """Per-problem differences ``this - base`` of one grader's per-problem accuracy
    ({problem id: accuracy}; problems in ``this``'s order, the same ids in both) and a
    paired bootstrap interval of their mean (the same problem resample applied to both)."""
    if set(this) != set(base):
        only = sorted(set(this) ^ set(base))[:5]
        raise MetricsError(f"problem ids differ from {base_tag}'s (e.g. {only})")
    rows = [{"problem_id": pid, "base": base[pid], "this": a, "diff": a - base[pid]}
            for pid, a in this.items()]
    diffs = [r["diff"] for r in rows]
    return {"mean_diff": float(np.mean(diffs)),
            "paired_bootstrap_ci": bootstrap_ci(diffs, boot["resamples"], boot["level"],
                                                boot["seed"]),
            "per_problem": rows}


def compare_to_base(this: Sequence[ProblemScores], base: Sequence[ProblemScores],
                    boot: dict[str, Any], base_tag: str = "base") -> dict[str, Any]:
    """Per-problem accuracy differences (this - base) and a paired bootstrap interval of
    their mean (the same problem resample applied to both): :func:`paired_difference` per
    grader."""
    out: dict[str, Any] = {"base_tag": base_tag}
    for g in GRADERS:
        out[g] = paired_difference({p.problem_id: sum(p.acc[g]) / len(p.acc[g]) for p in this},
                                   {p.problem_id: sum(p.acc[g]) / len(p.acc[g]) for p in base},
                                   boot, base_tag)
    return out


def compute_metrics(scores: Sequence[dict[str, Any]], tag: str, graders_info: dict[str, Any],
                    boot: dict[str, Any], base_scores: Sequence[dict[str, Any]] | None = None,
                    source: str = "scores", step: int | None = None) -> dict[str, Any]:
    """One tag's metrics.json document (docs/formats/eval.md). ``step``: the training step
    of the checkpoint evaluated (samples.meta.json ``step``; None for base or unknown)."""
    problems = group_scores(scores, source)
    n = len(problems[0].finish)
    total = n * len(problems)
    # format failure: math-verify right, math_dapo wrong (a math_dapo grader failure is not one)
    fmt = [sum(mv and not md and st == "ok" for mv, md, st in zip(
        p.acc["math_verify"], p.acc["math_dapo"], p.status["math_dapo"], strict=True))
        for p in problems]
    per_problem = []
    for p, f in zip(problems, fmt, strict=True):
        row: dict[str, Any] = {"problem_id": p.problem_id, "ground_truth": p.ground_truth,
                               "n": n, "truncated": sum(x == "length" for x in p.finish),
                               "format_failures": f}
        for g in GRADERS:
            maj, tied = majority_vote(p.pred[g], p.acc[g])
            row[g] = {"correct": sum(p.acc[g]), "acc": sum(p.acc[g]) / n,
                      "pass@n": 1.0 if any(p.acc[g]) else 0.0, "maj": maj,
                      "majority_answers": tied}
        per_problem.append(row)
    return {
        "tag": tag, "step": step, "num_problems": len(problems), "n": n,
        "primary_grader": "math_dapo",
        "graders": graders_info,
        "by_grader": {g: grader_metrics(problems, g, boot) for g in GRADERS},
        "format_failures": int(sum(fmt)), "format_failure_rate": sum(fmt) / total,
        "truncation_rate": sum(x == "length" for p in problems for x in p.finish) / total,
        "mean_response_tokens": float(np.mean([t for p in problems for t in p.tokens])),
        "per_problem": per_problem,
        "vs_base": (compare_to_base(problems, group_scores(base_scores, "base scores"), boot)
                    if base_scores is not None else None),
    }


def summarize(metrics: Sequence[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for m in metrics:
        bg = m["by_grader"]
        row = {"tag": m["tag"], "num_problems": m["num_problems"], "n": m["n"]}
        for g in GRADERS:
            row[f"{g}_avg"] = bg[g]["avg@n"]
            row[f"{g}_ci"] = [bg[g]["bootstrap_ci"]["low"], bg[g]["bootstrap_ci"]["high"]]
            row[f"{g}_pass@n"] = bg[g]["pass@k"][str(m["n"])]
            row[f"{g}_maj@n"] = bg[g]["maj@k"][str(m["n"])]
        row["sampling_se"] = bg["math_dapo"]["sampling_se"]
        row["format_failure_rate"] = m["format_failure_rate"]
        row["truncation_rate"] = m["truncation_rate"]
        if m.get("vs_base"):
            row["math_dapo_diff_vs_base"] = m["vs_base"]["math_dapo"]["mean_diff"]
            ci = m["vs_base"]["math_dapo"]["paired_bootstrap_ci"]
            row["math_dapo_diff_ci"] = [ci["low"], ci["high"]]
        rows.append(row)
    return {"tags": [m["tag"] for m in metrics], "rows": rows}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MetricsError(f"{path}: cannot read: {exc}") from exc


def _step_of(meta: Mapping[str, Any], source: Path) -> int | None:
    step = meta.get("step")
    if step is None:
        return None
    if not isinstance(step, int) or isinstance(step, bool):
        raise MetricsError(f"{source}: 'step' is not an integer ({step!r})")
    return step


def run(boot: Bootstrap, *, tag: str, scores: Path, scores_meta: Path, out: Path,
        base_scores: Path | None = None, samples_meta: Path | None = None) -> None:
    """``out`` (``<tag>/metrics.json``) from ``scores`` (scores.jsonl) and the grader
    implementations of ``scores_meta`` (scores.meta.json); a checkpoint tag is compared with
    ``base_scores`` (``base/scores.jsonl``). ``boot`` is ``eval.bootstrap``. The document's
    ``step`` is ``samples_meta``'s (samples.meta.json) when given, else scores.meta.json's
    ``step`` if it has one, else null."""
    from hy3rl.graders import read_jsonl

    meta = _read_json(scores_meta)
    graders_info = meta.get("graders")
    if not isinstance(graders_info, dict):
        raise MetricsError(f"{scores_meta}: no 'graders' mapping")
    step = (_step_of(_read_json(samples_meta), Path(samples_meta)) if samples_meta is not None
            else _step_of(meta, Path(scores_meta)))
    base = read_jsonl(Path(base_scores)) if base_scores is not None else None
    try:
        metrics = compute_metrics(read_jsonl(Path(scores)), tag, graders_info,
                                  dataclasses.asdict(boot), base, source=str(scores), step=step)
    except KeyError as exc:
        where = f"{scores}" + (f" or {base_scores}" if base_scores is not None else "")
        raise MetricsError(f"{where}: a score line lacks the key {exc}") from exc
    write_json_atomic(Path(out), metrics, indent=1)
    bg = metrics["by_grader"]
    print(f"{tag}: math_dapo avg@{metrics['n']} {bg['math_dapo']['avg@n']:.4f}, "
          f"math_verify {bg['math_verify']['avg@n']:.4f}", file=sys.stderr)


def run_summary(*, metrics: Sequence[Path], out: Path, heldout: Sequence[Path] = (),
                selected: Path | None = None) -> None:
    """``out`` (eval/summary.json): one row per ``metrics`` file (``<tag>/metrics.json``),
    in the order given; ``heldout``: the same for the held-out set's files
    (``heldout/<tag>/metrics.json``), under key ``heldout``; ``selected``
    (eval/selected.json, hy3rl.selection): the selected checkpoint and its test-set rows,
    under key ``selected`` (null without)."""
    summary = summarize([_read_json(p) for p in metrics])
    summary["heldout"] = summarize([_read_json(p) for p in heldout])
    summary["selected"] = None
    if selected is not None:
        doc = _read_json(selected)
        try:
            summary["selected"] = {**doc["selected"], "rows": doc["test"]["rows"]}
        except (KeyError, TypeError) as exc:
            raise MetricsError(f"{selected}: lacks the key {exc} (docs/formats/eval.md)") \
                from exc
    write_json_atomic(Path(out), summary, indent=1)
