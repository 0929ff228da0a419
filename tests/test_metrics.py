"""Statistics: pass@k against brute-force enumeration, maj@k ties, standard error, bootstrap
reproducibility, the full metrics.json on hand-made scores, and the paired comparison."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import yaml
from fixtures.common import make_config
from hy3rl import metrics
from hy3rl.errors import StageError
from hy3rl.metrics import (
    MetricsError,
    bootstrap_ci,
    compute_metrics,
    ks_for,
    maj_at_k,
    majority_vote,
    pass_at_k,
    sampling_se,
)

BOOT = {"resamples": 2000, "level": 0.95, "seed": 7}


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_equals_brute_force_over_subsets(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable_and_checked():
    assert pass_at_k(64, 1, 1) == pytest.approx(1 / 64)
    assert pass_at_k(64, 0, 64) == 0.0 and pass_at_k(64, 1, 64) == 1.0
    assert pass_at_k(1000, 3, 10) == pytest.approx(
        1 - math.comb(997, 10) / math.comb(1000, 10), rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_ks():
    assert ks_for(32) == [1, 2, 4, 8, 16, 32]
    assert ks_for(5) == [1, 2, 4, 5]
    assert ks_for(1) == [1]


def test_majority_vote_plain_and_ties():
    assert majority_vote(["7", "7", "8"], [True, True, False]) == (1.0, ["7"])
    assert majority_vote(["7", "8", "8"], [True, False, False]) == (0.0, ["8"])
    # two-way tie, one right: half credit, both answers listed in order of appearance
    assert majority_vote(["8", "7", "7", "8"], [False, True, True, False]) == (0.5, ["8", "7"])
    # three-way tie, one right: one third
    score, tied = majority_vote(["1", "2", "3"], [False, True, False])
    assert score == pytest.approx(1 / 3) and tied == ["1", "2", "3"]
    # no extracted answer does not vote; nothing to vote on scores 0
    assert majority_vote([None, None, "5"], [False, False, False]) == (0.0, ["5"])
    assert majority_vote([None, "5", None, None], [False, True, False, False]) == (1.0, ["5"])
    assert majority_vote([None, None], [False, False]) == (0.0, [])


def test_majority_vote_tie_rule_does_not_depend_on_sample_order():
    answers, correct = ["a", "b", "a", "b", "c"], [True, False, True, False, False]
    base = majority_vote(answers, correct)[0]
    for perm in itertools.permutations(range(5)):
        assert majority_vote([answers[i] for i in perm], [correct[i] for i in perm])[0] == base


def _brute_maj(answers, correct, k):
    subs = list(itertools.combinations(range(len(answers)), k))
    return sum(majority_vote([answers[i] for i in s], [correct[i] for i in s])[0]
               for s in subs) / len(subs)


def test_maj_at_k_is_the_mean_over_all_k_subsets():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        answers = [None if x == 3 else str(x) for x in rng.integers(0, 4, n)]
        correct = [a == "1" for a in answers]
        for k in range(1, n + 1):
            assert maj_at_k(answers, correct, k, (0,)) == pytest.approx(
                _brute_maj(answers, correct, k), abs=1e-12), (answers, k)
    # maj@1 is the accuracy over all samples (not the first one's verdict)
    assert maj_at_k(["7", "8", "8", "8"], [True, False, False, False], 1, (0,)) == 0.25
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True], 2, (0,))


def test_maj_at_k_sampled_subsets_are_seeded_and_close():
    rng = np.random.default_rng(1)
    answers = [str(x) for x in rng.integers(0, 3, 16)]
    correct = [a == "0" for a in answers]
    exact = _brute_maj(answers, correct, 8)  # C(16, 8) = 12870 subsets
    a = maj_at_k(answers, correct, 8, (5, 0, 8), max_subsets=2000)
    assert a == maj_at_k(answers, correct, 8, (5, 0, 8), max_subsets=2000)
    assert a != maj_at_k(answers, correct, 8, (6, 0, 8), max_subsets=2000)
    assert a == pytest.approx(exact, abs=0.03)


def test_sampling_se_formula():
    p = [0.5, 0.25, 1.0]
    expected = math.sqrt((0.25 + 0.1875 + 0.0) / 4) / 3
    assert sampling_se(p, 4) == pytest.approx(expected)
    # ~1.6 points for 30 problems at p=0.5, k=32 (upstream-facts figure)
    assert sampling_se([0.5] * 30, 32) == pytest.approx(math.sqrt(30 * 0.25 / 32) / 30)


def test_bootstrap_reproducible_by_seed():
    values = np.random.default_rng(1).random(30)
    a = bootstrap_ci(values, 5000, 0.95, seed=3)
    b = bootstrap_ci(values, 5000, 0.95, seed=3)
    c = bootstrap_ci(values, 5000, 0.95, seed=4)
    assert a == b and a != c
    assert a["low"] < values.mean() < a["high"]
    # the same computation by hand
    rng = np.random.default_rng(3)
    means = values[rng.integers(0, 30, size=(5000, 30))].mean(axis=1)
    assert a["low"] == pytest.approx(np.quantile(means, 0.025))
    assert a["high"] == pytest.approx(np.quantile(means, 0.975))
    narrow = bootstrap_ci(values, 5000, 0.5, seed=3)
    assert a["low"] < narrow["low"] < narrow["high"] < a["high"]


def _score(pid, k, dapo_ok, mv_ok, pred="1", finish="stop", gt="1", dapo_status="ok",
           mv_pred=None):
    return {"problem_id": pid, "sample_index": k, "finish_reason": finish, "num_tokens": 10,
            "ground_truth": gt,
            "math_dapo": {"status": dapo_status, "acc": dapo_ok, "score": 1.0 if dapo_ok else -1.0,
                          "pred": pred},
            "math_verify": {"status": "ok", "acc": mv_ok, "pred": mv_pred or pred}}


def _scores():
    """3 problems x 4 samples with known outcomes."""
    rows = []
    # problem 0: 2/4 by both graders; answers 1,1,2,2 -> tie, half right
    for k, (ok, pred) in enumerate([(True, "1"), (False, "2"), (True, "1"), (False, "2")]):
        rows.append(_score("0", k, ok, ok, pred))
    # problem 1: math_dapo 0/4 (format), math_verify 3/4; one truncated
    for k in range(4):
        rows.append(_score("1", k, False, k < 3, "5.", finish="length" if k == 3 else "stop",
                           gt="5", mv_pred="5"))
    # problem 2: 4/4, but sample 3 a grader timeout for math_dapo
    for k in range(4):
        rows.append(_score("2", k, k < 3, True, "9" if k < 3 else "", gt="9",
                           dapo_status="timeout" if k == 3 else "ok"))
    return rows


def test_compute_metrics_on_known_scores():
    m = compute_metrics(_scores(), "base", {"math_dapo": {}}, BOOT)
    assert m["num_problems"] == 3 and m["n"] == 4
    md, mv = m["by_grader"]["math_dapo"], m["by_grader"]["math_verify"]
    assert md["avg@n"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert mv["avg@n"] == pytest.approx((0.5 + 0.75 + 1.0) / 3)
    assert md["pass@k"]["4"] == pytest.approx((1 + 0 + 1) / 3)
    assert md["pass@k"]["2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + pass_at_k(4, 3, 2)) / 3)
    # maj@4, math_dapo: p0 tie -> 0.5; p1 all "5." wrong -> 0; p2 "9" x3 right -> 1
    assert md["maj@k"]["4"] == pytest.approx(1.5 / 3)
    # maj@1: a single sample's verdict, averaged over all samples = pass@1 = avg@n
    assert md["maj@k"]["1"] == pytest.approx(md["avg@n"])
    # maj@2: mean over the 6 pairs of each problem. p0 (answers 1,2,1,2; "1" right): one
    # pair "1","1" (1), one "2","2" (0), four ties (1/2 each) -> 3/6; p1: 0
    p2_pairs = [1, 1, 1, 1, 1, 1]  # "9" x3 + no answer: every pair has a "9" majority
    assert md["maj@k"]["2"] == pytest.approx((3 / 6 + 0 + sum(p2_pairs) / 6) / 3)
    assert md["grader_failures"] == {"timeout": 1, "error": 0}
    assert md["sampling_se"] == pytest.approx(sampling_se([0.5, 0, 0.75], 4))
    assert md["bootstrap_ci"]["seed"] == 7
    # p1: 3 samples; p2's timed-out math_dapo sample is a grader failure, not a format one
    assert m["format_failures"] == 3
    assert m["format_failure_rate"] == pytest.approx(3 / 12)
    assert m["truncation_rate"] == pytest.approx(1 / 12)
    p0 = m["per_problem"][0]
    assert p0["math_dapo"] == {"correct": 2, "acc": 0.5, "pass@n": 1.0, "maj": 0.5,
                               "majority_answers": ["1", "2"]}
    assert m["vs_base"] is None
    json.dumps(m)  # serialisable


def test_compare_to_base_paired():
    base = _scores()
    better = [dict(s) for s in base]
    for s in better:  # problem 1 becomes all right for math_dapo
        if s["problem_id"] == "1":
            s["math_dapo"] = {**s["math_dapo"], "acc": True, "pred": "5"}
    m = compute_metrics(better, "step20", {}, BOOT, base_scores=base)
    vs = m["vs_base"]["math_dapo"]
    diffs = {r["problem_id"]: r["diff"] for r in vs["per_problem"]}
    assert diffs == {"0": 0.0, "1": 1.0, "2": 0.0}
    assert vs["mean_diff"] == pytest.approx(1 / 3)
    assert vs["paired_bootstrap_ci"] == bootstrap_ci([0.0, 1.0, 0.0], 2000, 0.95, 7)
    same = compute_metrics(base, "step20", {}, BOOT, base_scores=base)["vs_base"]["math_dapo"]
    assert same["mean_diff"] == 0 and same["paired_bootstrap_ci"]["low"] == 0 == \
        same["paired_bootstrap_ci"]["high"]
    with pytest.raises(MetricsError, match="problem ids differ"):
        compute_metrics(base, "step20", {}, BOOT,
                        base_scores=[s for s in base if s["problem_id"] != "2"])


def test_bad_scores_are_named():
    rows = _scores()
    rows[1]["sample_index"] = 0  # duplicate sample 0 of problem 0
    with pytest.raises(MetricsError, match="problem 0"):
        compute_metrics(rows, "base", {}, BOOT, source="x/scores.jsonl")
    rows = [s for s in _scores() if not (s["problem_id"] == "2" and s["sample_index"] == 3)]
    with pytest.raises(MetricsError, match="problem 2 has 3 samples"):
        compute_metrics(rows, "base", {}, BOOT)


def test_run_and_run_summary(tmp_path):
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps(s) + "\n" for s in _scores()))
    meta = tmp_path / "scores.meta.json"
    meta.write_text(json.dumps({"graders": {"math_dapo": {"implementation": "x"}}}))
    out = tmp_path / "base" / "metrics.json"
    boot = make_config(eval={"bootstrap": {"resamples": 500, "seed": 1, "level": 0.9}})
    metrics.run(boot.eval.bootstrap, tag="base", scores=scores, scores_meta=meta, out=out)
    m = json.loads(out.read_text())
    assert m["by_grader"]["math_dapo"]["bootstrap_ci"] == bootstrap_ci([0.5, 0.0, 0.75], 500,
                                                                       0.9, 1)
    assert m["graders"] == {"math_dapo": {"implementation": "x"}}
    out2 = tmp_path / "step1" / "metrics.json"
    metrics.run(make_config().eval.bootstrap, tag="step1", scores=scores, scores_meta=meta,
                base_scores=scores, out=out2)
    assert json.loads(out2.read_text())["by_grader"]["math_dapo"]["bootstrap_ci"][
        "resamples"] == 10000  # the schema's default
    summary = tmp_path / "summary.json"
    metrics.run_summary(metrics=[out, out2], out=summary)
    s = json.loads(summary.read_text())
    assert s["tags"] == ["base", "step1"]
    assert s["rows"][1]["math_dapo_diff_vs_base"] == 0.0
    with pytest.raises(StageError, match="nope: cannot read"):
        metrics.run(boot.eval.bootstrap, tag="x", scores=tmp_path / "nope", scores_meta=meta,
                    out=tmp_path / "x.json")
    meta.write_text("{}")
    with pytest.raises(MetricsError, match="scores.meta.json: no 'graders'"):
        metrics.run(boot.eval.bootstrap, tag="x", scores=scores, scores_meta=meta,
                    out=tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_hy3rl_metrics_errors_exit_1_with_the_message(tmp_path):
    """`hy3rl metrics` without scores: the message names the file, exit status 1."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "k"}}))
    proc = subprocess.run([sys.executable, "-m", "hy3rl.cli", "metrics", "--configfile",
                           str(cfg), "--tag", "base"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 1, proc.stderr
    assert "hy3rl metrics: error: results/k/eval/base/scores.meta.json: cannot read" in \
        proc.stderr
    assert "Traceback" not in proc.stderr
