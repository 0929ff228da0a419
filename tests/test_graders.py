"""The two graders: math_dapo (our reimplementation pinned case by case, and checked against
the pinned verl file when a verl mirror is at hand), math-verify, where they disagree, which
implementation is chosen from deps/lock.json, and the per-task timeout of the worker pool."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures.common import make_config
from fixtures.eval import make_val_parquet
from hy3rl import graders
from hy3rl.graders import (
    DapoImpl,
    GraderPool,
    GraderSetupError,
    GradingError,
    dapo_compute_score,
    dapo_impl_from_file,
    load_dapo_function,
    math_verify_grade,
    resolve_math_dapo,
)

VERL_MIRROR = Path("/work/.mirror/verl-project+verl/repo")
VERL_PIN = "220e9039902c6db56860e2afd659803dc34ec005"

# (response, ground truth, acc, pred) as verl@220e903 math_dapo.compute_score gives them.
DAPO_CASES = [
    ("Let me think.\nAnswer: 204", "204", True, "204"),
    ("Answer: 204.", "204", False, "204."),
    ("Answer: 025", "25", False, "025"),
    ("Answer: 025", "025", True, "025"),
    ("Answer: **204**", "204", False, "**204**"),
    ("so the answer is \\boxed{204}", "204", False, "[INVALID]"),
    ("Answer: 204\nAnswer: 205", "204", False, "205"),
    ("Answer: 205\nAnswer: 204", "204", True, "204"),
    ("Answer: $204$", "204", True, "204"),
    ("Answer: \\boxed{204}", "204", True, "204"),
    ("answer : 1,000", "1000", True, "1000"),
    ("Answer: x = 204", "204", True, "204"),
    ("Answer: 204 degrees", "204", True, "204"),
    ("Answer: 204\n" + "x" * 400, "204", False, "[INVALID]"),  # only the last 300 chars
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: -5", "-5", True, "-5"),
    ("ANSWER:204", "204", True, "204"),
    ("Answer: \\text{204}", "204", True, "204"),
    ("Final Answer: The final answer is 204", "204", False, "Thefinalansweris204"),
    ("", "204", False, "[INVALID]"),
    ("Answer: 10^{3}", "1000", False, "10^{3}"),
]


@pytest.mark.parametrize(("response", "gt", "acc", "pred"), DAPO_CASES)
def test_math_dapo_reimplementation_case_by_case(response, gt, acc, pred):
    res = dapo_compute_score(response, gt)
    assert res == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# (response, ground truth, math_dapo acc, math_verify acc): the AIME formats where they differ.
DISAGREE = [
    ("Answer: 204.", "204", False, True),
    ("Answer: 025", "25", False, True),
    ("Answer: **204**", "204", False, True),
    ("The answer is \\boxed{204}.", "204", False, True),  # boxed without an Answer line
    ("\\boxed{204}\nAnswer: 205", "204", False, True),  # two conflicting answers: mv lenient
    ("Answer: 204\nAnswer: 205", "204", False, False),
    ("Answer: 205\nAnswer: 204", "204", True, True),
    ("Answer: 204", "204", True, True),
    ("Answer: 17", "204", False, False),
]


@pytest.mark.parametrize(("response", "gt", "dapo", "mv"), DISAGREE)
def test_graders_agree_and_disagree(response, gt, dapo, mv):
    assert dapo_compute_score(response, gt)["acc"] is dapo
    assert math_verify_grade(response, gt)["acc"] is mv


def _pinned_file(tmp_path: Path) -> Path:
    if not (VERL_MIRROR / "HEAD").exists() and not (VERL_MIRROR / ".git").exists():
        pytest.skip(f"no verl mirror at {VERL_MIRROR}")
    text = subprocess.run(
        ["git", "-C", str(VERL_MIRROR), "show", f"{VERL_PIN}:{graders.MATH_DAPO_RELPATH}"],
        check=True, capture_output=True, text=True).stdout
    path = tmp_path / "verl" / graders.MATH_DAPO_RELPATH
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_reimplementation_matches_pinned_file(tmp_path):
    """Same verdict and pred as the pinned file on every case plus varied strings."""
    impl = dapo_impl_from_file(_pinned_file(tmp_path), VERL_PIN)
    assert impl.implementation == "pinned verl file" and len(impl.sha256) == 64
    pinned = load_dapo_function(impl)
    import random

    rng = random.Random(0)
    atoms = ["Answer:", "answer :", " 204", "204.", "$", "\\boxed{", "}", "\\frac", "12", ",",
             "000", " degrees", "=", "x", "\n", "\\text{", "**", "-", "\\sqrt", "3", " an ",
             "^\\circ", "\\!", "{,}", "mbox", "\\ "]
    responses = [r for r, *_ in DAPO_CASES]
    responses += ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 30)))
                  for _ in range(400)]
    for r in responses:
        for gt in ("204", "1000", "\\frac{1}{2}", "12"):
            assert dapo_compute_score(r, gt) == pinned(r, gt), (r, gt)


def _lock(tmp_path: Path, verl_path: Path | None) -> Path:
    lock = {"schema_version": 1, "repos": {}}
    if verl_path is not None:
        lock["repos"]["verl"] = {"name": "verl", "commit": VERL_PIN, "head": VERL_PIN,
                                 "path": str(verl_path)}
    p = tmp_path / "results" / "deps" / "lock.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(lock))
    return p


def test_resolve_uses_pinned_file_from_lock(tmp_path):
    clone = _pinned_file(tmp_path).parents[3]
    impl = resolve_math_dapo(_lock(tmp_path, clone))
    assert impl.implementation == "pinned verl file"
    assert impl.commit == VERL_PIN and impl.path.endswith(graders.MATH_DAPO_RELPATH)
    # the module is loaded by path: no verl package (and so no torch/ray) gets imported
    import sys

    load_dapo_function(impl)
    assert "verl" not in sys.modules


def test_resolve_falls_back_and_says_why(tmp_path):
    assert resolve_math_dapo(None).implementation == "hy3rl reimplementation"
    missing = resolve_math_dapo(tmp_path / "nope.json")
    assert "does not exist" in missing.reason
    no_verl = resolve_math_dapo(_lock(tmp_path, None))
    assert no_verl.implementation == "hy3rl reimplementation" and "no verl" in no_verl.reason
    clone = tmp_path / "clone"
    f = clone / graders.MATH_DAPO_RELPATH
    f.parent.mkdir(parents=True)
    f.write_text("import torch\n\ndef compute_score(s, gt):\n    return {}\n")
    heavy = resolve_math_dapo(_lock(tmp_path, clone))
    assert heavy.implementation == "hy3rl reimplementation" and "torch" in heavy.reason
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GraderSetupError, match="bad.json"):
        resolve_math_dapo(bad)


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_pool_cuts_off_a_hanging_math_verify(tmp_path):
    """9^(9^(9^9)): sympy never finishes comparing it; the sample is a grader failure, the
    other tasks are graded, the run ends."""
    tasks = [("math_verify", "Answer: \\boxed{9^{9^{9^{9}}}}", "204"),
             ("math_dapo", "Answer: \\boxed{9^{9^{9^{9}}}}", "204"),
             ("math_verify", "Answer: 204.", "204"),
             ("math_dapo", "Answer: 204", "204")]
    t0 = time.monotonic()
    with GraderPool(DapoImpl("hy3rl reimplementation"), workers=2, timeout_s=1.0) as pool:
        res = pool.run(tasks)
    assert time.monotonic() - t0 < 30
    assert res[0]["status"] == "timeout" and res[0]["acc"] is False
    assert res[1] == {"status": "ok", "acc": False, "score": -1.0, "pred": "9^{9^{9^{9}}}"}
    assert res[2]["status"] == "ok" and res[2]["acc"] is True
    assert res[3]["status"] == "ok" and res[3]["acc"] is True


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_pool_kills_a_grader_that_ignores_the_timer(tmp_path):
    """A grader stuck where the timer cannot interrupt it (SIGALRM blocked) is killed by the
    parent; its task fails with `timeout`, the worker is replaced, the rest is graded."""
    clone = tmp_path / "clone"
    f = clone / graders.MATH_DAPO_RELPATH
    f.parent.mkdir(parents=True)
    f.write_text(
        "import signal\nimport time\n\n\n"
        "def compute_score(solution_str, ground_truth):\n"
        "    if 'HANG' in solution_str:\n"
        "        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "        time.sleep(600)\n"
        "    ok = solution_str.strip().endswith(ground_truth)\n"
        "    return {'score': 1.0 if ok else -1.0, 'acc': ok, 'pred': ground_truth}\n")
    impl = resolve_math_dapo(_lock(tmp_path, clone))
    assert impl.implementation == "pinned verl file"
    tasks = [("math_dapo", "Answer: 1", "1"), ("math_dapo", "HANG", "1"),
             ("math_dapo", "Answer: 2", "2"), ("math_verify", "Answer: 3", "3")]
    t0 = time.monotonic()
    with GraderPool(impl, workers=1, timeout_s=0.5, grace_s=0.5) as pool:
        res = pool.run(tasks, chunk=4)
        assert pool.kills == 2  # the chunk, then the hanging task on its own
    assert time.monotonic() - t0 < 60
    assert [r["status"] for r in res] == ["ok", "timeout", "ok", "ok"]
    assert [r["acc"] for r in res] == [True, False, True, True]


def test_grader_exception_is_an_error_not_a_crash():
    def broken(solution_str, ground_truth):
        raise KeyError("boom")

    res = graders.grade_one("math_dapo", "Answer: 1", "1", broken, 5.0)
    assert res["status"] == "error" and res["acc"] is False and "boom" in res["error"]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_run_scores_samples(tmp_path, eval_val_parquet):
    samples = tmp_path / "samples.jsonl"
    rows = [{"problem_id": "2", "sample_index": k, "seed": k, "prompt_hash": "h",
             "response": resp, "num_tokens": 5, "finish_reason": "stop"}
            for k, resp in enumerate(["Answer: 104", "Answer: 104.", "no idea"])]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, meta = tmp_path / "scores.jsonl", tmp_path / "scores.meta.json"
    gcfg = make_config(eval={"graders": {"timeout_s": 5}}).eval.graders
    graders.run(gcfg, samples=samples, val=eval_val_parquet, lock=None, out=out, meta=meta)
    scores = [json.loads(x) for x in out.read_text().splitlines()]
    assert [s["math_dapo"]["acc"] for s in scores] == [True, False, False]
    assert [s["math_verify"]["acc"] for s in scores] == [True, True, False]
    assert scores[0]["ground_truth"] == "104"
    m = json.loads(meta.read_text())
    assert m["graders"]["math_dapo"]["implementation"] == "hy3rl reimplementation"
    assert m["graders"]["math_verify"]["version"] == "0.9.0"
    assert m["timeout_s"] == 5.0 and m["samples"] == str(samples)
    # a sample of a problem the validation file lacks: clear error, no output
    rows[0]["problem_id"] = "99"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.unlink()
    with pytest.raises(GradingError, match=r"samples.jsonl: sample 0: problem_id '99' not in"):
        graders.run(gcfg, samples=samples, val=eval_val_parquet, lock=None, out=out, meta=meta)
    assert not out.exists()


def test_hy3rl_score_errors_exit_1_with_the_message(tmp_path):
    """`hy3rl score` without samples: the message names the file, exit status 1."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "k"}}))
    make_val_parquet(tmp_path / "results" / "k" / "data" / "val.parquet")
    proc = subprocess.run([sys.executable, "-m", "hy3rl.cli", "score", "--configfile", str(cfg),
                           "--tag", "step20"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "hy3rl score: error: results/k/eval/step20/samples.jsonl: cannot read" in proc.stderr
    assert "Traceback" not in proc.stderr
