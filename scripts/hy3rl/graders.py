"""Score generated samples with two graders: math_dapo (as the pinned verl scores AIME) and
math-verify.

math_dapo: when the pinned verl clone named by ``deps/lock.json`` holds
``verl/utils/reward_score/math_dapo.py`` and that file imports nothing but the standard
library, that very file is loaded by path (``importlib.util.spec_from_file_location`` on the
file, never the ``verl`` package, which pulls torch and ray) and used; otherwise the
reimplementation below runs. ``scores.meta.json`` records which one ran (with the file's
sha256). The reimplementation is pinned case by case in tests/test_graders.py, and checked
against the pinned file when a verl mirror is available.

math-verify: gold ``\\boxed{<ground truth>}`` parsed with the LaTeX extractor, the response
parsed with the expression then LaTeX extractors (as verl's own ``math_verify`` reward does),
``verify`` on the two lists.

Every grading call runs in a worker process under a per-task time limit: an interval timer
inside the worker first, then a hard kill of the worker from the parent. A grader cut off
(or raising) counts as incorrect with status ``timeout``/``error``; the run never stalls.

Entry point: :func:`run` (rule ``eval_score`` through ``scripts/adapters/eval_score.py``, and
``hy3rl score --tag T``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import logging
import multiprocessing as mp
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_json_atomic, write_jsonl_atomic
from hy3rl.errors import StageError
from hy3rl.settings import Graders

GRADERS = ("math_dapo", "math_verify")
MATH_DAPO_RELPATH = "verl/utils/reward_score/math_dapo.py"
INVALID = "[INVALID]"
# The pinned math_dapo.py is loaded by path only if it imports nothing but the standard
# library (at 220e903: re, typing), so loading it cannot pull torch or ray.
_SAFE_IMPORTS = set(sys.stdlib_module_names)


class GradingError(StageError):
    """Bad input for scoring (the message names the file, line or problem)."""


class GraderSetupError(GradingError):
    """The graders cannot be set up (bad lock file, unreadable pinned file)."""


# --------------------------------------------------------------------------------------
# math_dapo: our reimplementation of verl@220e903 verl/utils/reward_score/math_dapo.py
# (Minerva-style normalisation of the last "Answer:" line in the last 300 characters,
# then exact string comparison). Behaviour pinned in tests/test_graders.py.
# --------------------------------------------------------------------------------------

# Plain-text replacements, applied in this order.
_DAPO_REPLACE: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# Substrings deleted, in this order (units, filler words, TeX spacing).
_DAPO_DELETE: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_DAPO_ANSWER_RE = r"(?i)Answer\s*:\s*([^\n]+)"


def dapo_normalize(answer: str) -> str:
    """Normalise a final answer the way math_dapo does before its exact comparison."""
    s = answer.split("=")[-1]
    for old, new in _DAPO_REPLACE:
        s = s.replace(old, new)
    for gone in _DAPO_DELETE:
        s = s.replace(gone, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for command in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_compute_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """math_dapo.compute_score(solution, ground_truth) with default arguments (how verl's
    default_compute_score calls it for data_source math_dapo / aime*)."""
    tail = solution_str[-300:]
    matches = re.findall(_DAPO_ANSWER_RE, tail)
    pred = dapo_normalize(matches[-1] if matches else INVALID)
    correct = pred == dapo_normalize(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# --------------------------------------------------------------------------------------
# Locating and loading the pinned file
# --------------------------------------------------------------------------------------


@dataclass
class DapoImpl:
    """Which math_dapo implementation runs (recorded in scores.meta.json / metrics.json)."""

    implementation: str  # "pinned verl file" | "hy3rl reimplementation"
    path: str | None = None
    commit: str | None = None
    sha256: str | None = None
    reason: str = ""


def _find_verl_in_lock(lock: Any) -> tuple[str | None, str | None]:
    """(clone path, commit) of verl from a deps lock file, tolerant of its exact layout:
    looks for a mapping named ``verl`` (at the top or under ``repos``) with a path-like key."""
    candidates: list[Any] = []
    if isinstance(lock, dict):
        for key in ("repos", "repositories", "deps"):
            sub = lock.get(key)
            if isinstance(sub, dict) and isinstance(sub.get("verl"), dict):
                candidates.append(sub["verl"])
            if isinstance(sub, list):
                candidates += [r for r in sub if isinstance(r, dict) and r.get("name") == "verl"]
        if isinstance(lock.get("verl"), dict):
            candidates.append(lock["verl"])
    for entry in candidates:
        path = next((entry[k] for k in ("path", "dir", "local_path", "checkout", "clone")
                     if isinstance(entry.get(k), str)), None)
        commit = next((entry[k] for k in ("commit", "head", "sha", "verified_head")
                       if isinstance(entry.get(k), str)), None)
        if path:
            return path, commit
    return None, None


def _imports_only_stdlib(source: str) -> tuple[bool, str]:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]] if node.level == 0 else ["<relative>"]
        else:
            continue
        bad = [n for n in names if n not in _SAFE_IMPORTS]  # includes relative imports
        if bad:
            return False, f"imports {', '.join(bad)}"
    return True, ""


def resolve_math_dapo(lock_path: str | Path | None) -> DapoImpl:
    """Decide which math_dapo implementation to use; never raises for a missing clone (falls
    back to the reimplementation and says why), raises for an unreadable lock file."""
    if not lock_path:
        return DapoImpl("hy3rl reimplementation", reason="no deps lock file given")
    lock_path = Path(lock_path)
    if not lock_path.exists():
        return DapoImpl("hy3rl reimplementation", reason=f"{lock_path} does not exist")
    try:
        lock = json.loads(lock_path.read_text())
    except json.JSONDecodeError as exc:
        raise GraderSetupError(f"{lock_path}: not valid JSON: {exc}") from exc
    clone, commit = _find_verl_in_lock(lock)
    if clone is None:
        return DapoImpl("hy3rl reimplementation", reason=f"{lock_path}: no verl clone path")
    clone_path = Path(clone)
    if not clone_path.is_absolute():
        clone_path = lock_path.parent / clone_path if not clone_path.exists() else clone_path
    return dapo_impl_from_file(clone_path / MATH_DAPO_RELPATH, commit)


def dapo_impl_from_file(path: Path, commit: str | None = None) -> DapoImpl:
    if not path.is_file():
        return DapoImpl("hy3rl reimplementation", commit=commit, reason=f"{path} not found")
    source = path.read_text()
    ok, why = _imports_only_stdlib(source)
    digest = hashlib.sha256(source.encode()).hexdigest()
    if not ok:
        return DapoImpl("hy3rl reimplementation", path=str(path), commit=commit, sha256=digest,
                        reason=f"pinned file not loadable without side effects: {why}")
    return DapoImpl("pinned verl file", path=str(path.resolve()), commit=commit, sha256=digest)


def load_dapo_function(impl: DapoImpl) -> Callable[[str, str], dict[str, Any]]:
    """The compute_score function of ``impl``: the pinned file's (loaded by path) or ours."""
    if impl.implementation != "pinned verl file":
        return dapo_compute_score
    assert impl.path is not None
    spec = importlib.util.spec_from_file_location("_hy3rl_pinned_math_dapo", impl.path)
    if spec is None or spec.loader is None:
        raise GraderSetupError(f"{impl.path}: cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "compute_score", None)
    if fn is None:
        raise GraderSetupError(f"{impl.path}: has no compute_score")
    return fn


# --------------------------------------------------------------------------------------
# math-verify
# --------------------------------------------------------------------------------------


def math_verify_grade(response: str, ground_truth: str) -> dict[str, Any]:
    """math-verify verdict. Its own signal timeouts are off: the caller's timer bounds it."""
    from math_verify import parse, verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),),
                 parsing_timeout=None)
    pred = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()),
                 parsing_timeout=None)
    ok = bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    # pred[-1] is math-verify's matched string (fallback); pred[0] the parsed expression.
    shown = str(pred[-1]) if pred else ""
    return {"acc": ok, "pred": shown}


# --------------------------------------------------------------------------------------
# Worker processes with per-task time limits
# --------------------------------------------------------------------------------------


class _GraderTimeout(BaseException):
    """Raised by the worker's interval timer (BaseException: graders' `except Exception`
    must not swallow it)."""


def _on_alarm(signum, frame):  # pragma: no cover - runs in the worker
    raise _GraderTimeout()


def grade_one(grader: str, response: str, ground_truth: str, dapo_fn, timeout_s: float):
    """Run one grader on one sample under an interval timer (must run in a main thread)."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        if grader == "math_dapo":
            res = dapo_fn(response, ground_truth)
            out = {"status": "ok", "acc": bool(res["acc"]), "score": float(res["score"]),
                   "pred": str(res["pred"])}
        elif grader == "math_verify":
            out = {"status": "ok", **math_verify_grade(response, ground_truth)}
        else:
            raise ValueError(f"unknown grader {grader!r}")
    except _GraderTimeout:
        out = {"status": "timeout", "acc": False, "pred": ""}
    except Exception as exc:  # a grader bug on a strange answer is a grader failure
        out = {"status": "error", "acc": False, "pred": "", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if grader == "math_dapo" and out["status"] != "ok":
        out["score"] = -1.0
    return out


def _worker(conn, impl_dict: dict[str, Any]) -> None:  # pragma: no cover - child process
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    dapo_fn = load_dapo_function(DapoImpl(**impl_dict))
    # Warm up (imports, regex compilation, the LaTeX parser) before the first timed task.
    math_verify_grade("Answer: $\\frac{1}{2}$", "\\frac{1}{2}")
    dapo_fn("Answer: 1", "1")
    conn.send("ready")  # the parent starts a task's clock only once the worker is up
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        out = []
        for task_id, grader, response, gt, timeout_s in msg:
            out.append((task_id, grade_one(grader, response, gt, dapo_fn, timeout_s)))
        conn.send(out)


@dataclass
class _Slot:
    proc: Any
    conn: Any
    task: tuple | None = None
    started: float = 0.0


@dataclass
class GraderPool:
    """Worker processes running grading tasks, each under ``timeout_s``; a worker still busy
    ``timeout_s + grace_s`` after it got a task is killed and replaced, the task failing with
    status ``timeout``."""

    impl: DapoImpl
    workers: int
    timeout_s: float
    grace_s: float = 2.0
    _slots: list[_Slot] = field(default_factory=list)
    kills: int = 0

    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        slots = [self._start() for _ in range(self.workers)]
        for slot in slots:
            self._await_ready(slot)
        self._slots = slots

    def _start(self) -> _Slot:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, asdict(self.impl)), daemon=True)
        proc.start()
        child.close()
        return _Slot(proc, parent)

    def _await_ready(self, slot: _Slot) -> None:
        try:
            ok = slot.conn.poll(self.startup_timeout_s) and slot.conn.recv() == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            slot.proc.kill()
            raise GraderSetupError(f"a grader worker did not start (exit code "
                                   f"{slot.proc.exitcode}); see the log above")

    def _spawn(self) -> _Slot:
        slot = self._start()
        self._await_ready(slot)
        return slot

    def close(self) -> None:
        for slot in self._slots:
            try:
                slot.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for slot in self._slots:
            slot.proc.join(timeout=5)
            if slot.proc.is_alive():
                slot.proc.kill()
                slot.proc.join()
        self._slots = []

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, tasks: Sequence[tuple[str, str, str]], chunk: int = 8) -> list[dict[str, Any]]:
        """Grade ``tasks`` = [(grader, response, ground_truth)]; results in task order.
        Tasks go to workers in small chunks; a chunk that hits the hard limit is re-sent one
        task at a time so that only the hanging task is marked as a timeout."""
        results: list[dict[str, Any] | None] = [None] * len(tasks)
        queue = [list(range(i, min(i + chunk, len(tasks)))) for i in range(0, len(tasks), chunk)]
        queue.reverse()  # pop() from the end = task order

        def deadline(slot: _Slot) -> float:
            return slot.started + self.timeout_s * len(slot.task) + self.grace_s

        while queue or any(s.task is not None for s in self._slots):
            for slot in self._slots:
                if slot.task is None and queue:
                    ids = queue.pop()
                    slot.task = tuple(ids)
                    slot.conn.send([(i, *tasks[i], self.timeout_s) for i in ids])
                    slot.started = time.monotonic()
            busy = [s for s in self._slots if s.task is not None]
            wait_s = max(0.0, min(deadline(s) for s in busy) - time.monotonic())
            ready = mp_wait([s.conn for s in busy], timeout=wait_s)
            for slot in busy:
                if slot.conn in ready:
                    try:
                        for task_id, res in slot.conn.recv():
                            results[task_id] = res
                        slot.task = None
                        continue
                    except (EOFError, OSError):
                        pass  # the worker died: handled like a hang
                elif time.monotonic() < deadline(slot):
                    continue
                # Past the hard limit (or dead): kill, replace, then retry singly or fail.
                ids = list(slot.task)
                slot.proc.kill()
                slot.proc.join()
                self.kills += 1
                new = self._spawn()
                slot.proc, slot.conn, slot.task = new.proc, new.conn, None
                if len(ids) == 1:
                    results[ids[0]] = _failure(tasks[ids[0]][0], "timeout")
                else:
                    queue.extend([i] for i in reversed(ids))
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"{len(missing)} grading results missing (first: task {missing[0]})")
        return results  # type: ignore[return-value]


def _failure(grader: str, status: str) -> dict[str, Any]:
    out: dict[str, Any] = {"status": status, "acc": False, "pred": ""}
    if grader == "math_dapo":
        out["score"] = -1.0
    return out


# --------------------------------------------------------------------------------------
# Scoring samples.jsonl
# --------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object a line (blank lines skipped); a missing file or a bad line is a
    :class:`GradingError` naming the file and line."""
    rows = []
    try:
        with open(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise GradingError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
    except OSError as exc:
        raise GradingError(f"{path}: cannot read: {exc}") from exc
    return rows


def score_samples(samples: Iterable[dict[str, Any]], ground_truths: dict[str, str],
                  pool: GraderPool) -> list[dict[str, Any]]:
    """Both graders' verdicts for every sample (order kept)."""
    samples = list(samples)
    tasks = []
    for i, s in enumerate(samples):
        pid = str(s["problem_id"])
        if pid not in ground_truths:
            raise GradingError(f"sample {i}: problem_id {pid!r} not in the validation file")
        for g in GRADERS:
            tasks.append((g, s["response"], ground_truths[pid]))
    verdicts = pool.run(tasks)
    out = []
    for i, s in enumerate(samples):
        pid = str(s["problem_id"])
        out.append({
            "problem_id": pid, "sample_index": int(s["sample_index"]),
            "finish_reason": s.get("finish_reason"), "num_tokens": s.get("num_tokens"),
            "ground_truth": ground_truths[pid],
            "math_dapo": verdicts[2 * i], "math_verify": verdicts[2 * i + 1],
        })
    return out


def run(graders: Graders, *, samples: Path, val: Path, lock: Path | None, out: Path,
        meta: Path) -> None:
    """Score ``samples`` (samples.jsonl) against the ground truths of ``val``
    (data/val.parquet) with both graders: ``out`` (scores.jsonl) and ``meta``
    (scores.meta.json). ``lock`` (deps/lock.json) names the pinned verl clone whose
    math_dapo.py is used when loadable; ``graders`` gives the workers and per-task timeout."""
    from hy3rl.evaluate import load_problems  # light: pyarrow only

    samples, val, out, meta = Path(samples), Path(val), Path(out), Path(meta)
    impl = resolve_math_dapo(lock)
    problems = load_problems(val)
    rows = read_jsonl(samples)
    print(f"math_dapo: {impl.implementation} {impl.path or ''} {impl.reason}", file=sys.stderr)
    gts = {p.problem_id: p.ground_truth for p in problems}
    t0 = time.monotonic()
    with GraderPool(impl, workers=graders.workers, timeout_s=graders.timeout_s) as pool:
        try:
            scores = score_samples(rows, gts, pool)
        except GradingError as exc:
            raise GradingError(f"{samples}: {exc}") from None
        kills = pool.kills
    write_jsonl_atomic(out, scores)
    import math_verify

    meta_doc = {
        "samples": str(samples), "val_file": str(val), "num_scored": len(scores),
        "graders": {
            "math_dapo": asdict(impl),
            "math_verify": {"implementation": "math-verify",
                            "version": getattr(math_verify, "__version__", None) or _dist_version(
                                "math-verify"),
                            "gold": "\\boxed{ground_truth}, LaTeX extractor",
                            "pred_extractors": ["expr", "latex"]},
        },
        "timeout_s": float(graders.timeout_s), "workers_killed": kills,
        "failures": {g: {st: sum(1 for s in scores if s[g]["status"] == st)
                         for st in ("timeout", "error")} for g in GRADERS},
        "seconds": round(time.monotonic() - t0, 3),
    }
    write_json_atomic(meta, meta_doc, indent=1)
    print(f"scored {len(scores)} samples in {meta_doc['seconds']} s", file=sys.stderr)


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None

