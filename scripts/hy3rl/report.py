"""Stage `report`: one self-contained HTML page of everything a run produced.

Reads whatever exists under ``results/<run>/`` (lock file, data summary, checkpoint checks,
preflight plan, training attempts and their verl logs, evaluation metrics) and writes
``report/index.html`` (figures embedded as base64 PNG, no external URL) plus the figures as
PNG and the tables as CSV beside it (docs/formats/report.md). A stage that did not run is
shown as such, with the reason. Every string rendered anywhere goes through one
:class:`Redactor`; the bytes of every output are checked for the known secret values before
anything is written.

All readers of other stages' files are in the section "Readers" below, so the formats can
be reconciled in one place.
"""

from __future__ import annotations

import argparse
import base64
import csv
import datetime as dt
import io
import json
import math
import os
import platform
import re
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from jinja2 import Environment, FileSystemLoader, StrictUndefined  # noqa: E402

from hy3rl.config import config_hash  # noqa: E402
from hy3rl.redact import Redactor, make_redactor  # noqa: E402

TEMPLATES = Path(__file__).resolve().parent / "templates"

FIGURES = (
    "fig_training_published.png",
    "fig_training_extra.png",
    "fig_step_time.png",
    "fig_eval_checkpoints.png",
    "fig_eval_heatmap.png",
)
TABLES = (
    "stages.csv",
    "attempts.csv",
    "claims.csv",
    "eval_headline.csv",
    "eval_per_problem.csv",
    "eval_paired.csv",
    "provenance.csv",
)
OUTPUTS = ("index.html", "config.resolved.yaml", *FIGURES, *TABLES)

DEFAULT_PACKAGES = (
    "torch", "transformers", "snakemake", "snakemake-executor-plugin-slurm", "ray",
    "verl", "vllm", "megatron-bridge", "megatron-core", "transformer-engine", "hydra-core",
    "numpy", "pandas", "pyarrow", "datasets", "safetensors", "math-verify", "matplotlib",
    "jinja2", "jsonschema",
)
DEFAULT_ENV_PREFIXES = ("SLURM_", "VERL_", "RAY_", "WANDB_", "HF_", "CUDA_", "NCCL_", "VLLM_")


class ReportInputError(ValueError):
    """An input file exists but cannot be read; the message names the file (and line)."""


# --------------------------------------------------------------------------------------
# Readers of the other stages' files (contracts: docs/formats/*.md). Keep them here.
# --------------------------------------------------------------------------------------

PATHS = {
    "lock": "deps/lock.json",
    "data_summary": "data/summary.json",
    "checkpoint_check": "checks/checkpoint.json",
    "bridge_check": "checks/bridge.json",
    "cluster_probe": "cluster/probe.json",
    "plan": "preflight/plan.json",
    "train_done": "train/done.json",
    "metrics": "train/metrics.jsonl",
    "attempts": "train/attempts",
    "eval": "eval",
}


def read_json(path: Path) -> Any | None:
    """The parsed file, None if it does not exist; ReportInputError naming it if invalid."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: not valid JSON: {exc}") from exc


@dataclass
class VerlLog:
    path: str
    lines: list[tuple[int, dict[str, Any]]]
    dropped_tail: bool = False


def read_verl_log(path: Path, allow_truncated_tail: bool = True) -> VerlLog:
    """verl file-logger lines ``{"step": N, "data": {...}}``. A truncated last line (a crash
    mid-write) is dropped when allowed; any other bad line names file and line number."""
    raw = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    while raw and not raw[-1].strip():
        raw.pop()
    lines: list[tuple[int, dict[str, Any]]] = []
    dropped = False
    for i, text in enumerate(raw, start=1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            if allow_truncated_tail and i == len(raw):
                dropped = True
                continue
            raise ReportInputError(f"{path}:{i}: not valid JSON: {exc}") from exc
        if not isinstance(rec, dict) or "step" not in rec or not isinstance(rec.get("data"), dict):
            raise ReportInputError(f'{path}:{i}: expected {{"step": N, "data": {{...}}}}')
        try:
            step = int(rec["step"])
        except (TypeError, ValueError) as exc:
            raise ReportInputError(f"{path}:{i}: step {rec['step']!r} is not an integer") from exc
        lines.append((step, rec["data"]))
    return VerlLog(str(path), lines, dropped)


def _validation_only(data: Mapping[str, Any]) -> bool:
    return bool(data) and all(str(k).startswith("val-") for k in data)


def merge_logs(logs: Iterable[VerlLog]) -> dict[int, dict[str, Any]]:
    """Merge verl logs given in attempt order, the train stage's rule (docs/formats/train.md):
    a step logged twice keeps the later line, except that a validation-only line (verl's
    ``val_before_train`` at the resumed step) adds its keys to the training metrics already
    logged for that step instead of replacing them."""
    merged: dict[int, dict[str, Any]] = {}
    for log in logs:
        for step, data in log.lines:
            old = merged.get(step)
            if old is not None and _validation_only(data) and not _validation_only(old):
                merged[step] = {**old, **data}
            else:
                merged[step] = dict(data)
    return dict(sorted(merged.items()))


def _first(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _to_time(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return dt.datetime.fromtimestamp(float(value), tz=dt.UTC)
    try:
        t = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@dataclass
class Attempt:
    """One training attempt (train/attempts/attempt-<k>.json), normalised."""

    attempt: int
    slurm_job_id: str | None = None
    nodes: list[str] = field(default_factory=list)
    num_nodes: int | None = None
    gpus_per_node: int | None = None
    start_step: int | None = None
    end_step: int | None = None
    last_logged_step: int | None = None
    steps_lost: int | None = None
    exit_reason: str | None = None
    started: str | None = None
    ended: str | None = None
    hours: float | None = None
    gpu_hours: float | None = None
    log_path: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


def read_attempt(path: Path, default_gpus_per_node: int | None) -> Attempt:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ReportInputError(f"{path}: expected a JSON object")
    m = re.search(r"attempt-(\d+)\.json$", path.name)
    k = _int_or_none(_first(raw, "attempt", "index")) or (int(m.group(1)) if m else 0)
    nodes_raw = _first(raw, "nodes", "nodelist", "hosts")
    nodes = [str(n) for n in nodes_raw] if isinstance(nodes_raw, list) else []
    if isinstance(nodes_raw, str):
        nodes = [n for n in re.split(r"[,\s]+", nodes_raw) if n]
    num_nodes = _int_or_none(_first(raw, "num_nodes", "nnodes")) or (
        len(nodes) if nodes else _int_or_none(nodes_raw)
    )
    gpn = _int_or_none(_first(raw, "gpus_per_node", "n_gpus_per_node")) or default_gpus_per_node
    started = _to_time(_first(raw, "started_at", "start_time", "started", "start"))
    ended = _to_time(_first(raw, "ended_at", "end_time", "ended", "end", "finished_at"))
    hours = None
    dur = _first(raw, "wall_s", "duration_s", "elapsed_s", "runtime_s")
    if isinstance(dur, int | float):
        hours = float(dur) / 3600.0
    elif started and ended:
        hours = max((ended - started).total_seconds(), 0.0) / 3600.0
    gpu_hours = _first(raw, "gpu_hours")
    if not isinstance(gpu_hours, int | float):
        gpu_hours = hours * num_nodes * gpn if hours is not None and num_nodes and gpn else None
    job = _first(raw, "slurm_job_id", "job_id", "jobid")
    reason = _first(raw, "exit_reason", "reason", "status", "exit_status")
    return Attempt(
        attempt=k,
        slurm_job_id=None if job is None else str(job),
        nodes=nodes,
        num_nodes=num_nodes,
        gpus_per_node=gpn,
        start_step=_int_or_none(_first(raw, "start_step", "resumed_from_step", "resume_step")),
        end_step=_int_or_none(_first(raw, "end_step", "final_step")),
        last_logged_step=_int_or_none(_first(raw, "last_logged_step", "last_step")),
        steps_lost=_int_or_none(_first(raw, "steps_lost", "lost_steps")),
        exit_reason=None if reason is None else str(reason),
        started=started.isoformat() if started else None,
        ended=ended.isoformat() if ended else None,
        hours=hours,
        gpu_hours=float(gpu_hours) if gpu_hours is not None else None,
        raw=raw,
    )


def find_key(obj: Any, pattern: str) -> list[tuple[str, Any]]:
    """(dotted path, value) of every key matching ``pattern`` in nested JSON."""
    pat = re.compile(pattern, re.I)
    found: list[tuple[str, Any]] = []

    def walk(o: Any, path: str) -> None:
        if isinstance(o, Mapping):
            for k, v in o.items():
                p = f"{path}.{k}" if path else str(k)
                if pat.search(str(k)) and not isinstance(v, Mapping | list):
                    found.append((p, v))
                walk(v, p)
        elif isinstance(o, list):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")

    walk(obj, "")
    return found


def check_counts(doc: Any) -> tuple[str, dict[str, int], list[dict[str, Any]]]:
    """Overall status, counts by status, and the check rows of a checks/*.json file."""
    checks = doc.get("checks", []) if isinstance(doc, dict) else []
    rows = [c for c in checks if isinstance(c, dict)]
    counts: dict[str, int] = {}
    for c in rows:
        s = str(c.get("status", "?"))
        counts[s] = counts.get(s, 0) + 1
    if counts.get("fail"):
        overall = "fail"
    elif counts.get("pass") and not any(k not in ("pass", "not run") for k in counts):
        overall = "pass" if not counts.get("not run") else "pass (some not run)"
    elif rows and all(c.get("status") == "not run" for c in rows):
        overall = "not run"
    else:
        overall = str(doc.get("status", "ran")) if isinstance(doc, dict) else "ran"
    return overall, counts, rows


# ---- evaluation (eval/<tag>/metrics.json, docs/formats/eval.md) ----

_TAG_ORDER = re.compile(r"^step(\d+)$")


def tag_key(tag: str) -> tuple[int, int]:
    if tag == "base":
        return (0, 0)
    m = _TAG_ORDER.match(tag)
    if m:
        return (1, int(m.group(1)))
    return (2, 0)


@dataclass
class GraderResult:
    grader: str
    avg: float | None = None
    sampling_se: float | None = None
    bootstrap_ci: list[float] | None = None
    pass_at: dict[str, float] = field(default_factory=dict)
    maj_at: dict[str, float] = field(default_factory=dict)
    failures: dict[str, Any] = field(default_factory=dict)
    per_problem: dict[str, float] = field(default_factory=dict)

    @property
    def sampling_ci(self) -> list[float] | None:
        """avg +- 1.96 sampling_se (normal approximation)."""
        if self.avg is None or self.sampling_se is None:
            return None
        return [self.avg - 1.96 * self.sampling_se, self.avg + 1.96 * self.sampling_se]


@dataclass
class EvalRecord:
    tag: str
    step: int | None
    n: int | None
    num_problems: int | None
    primary_grader: str | None
    graders: list[GraderResult]
    format_failure_rate: float | None = None
    format_failures: int | None = None
    truncation_rate: float | None = None
    mean_response_tokens: float | None = None
    vs_base: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    samples_meta: dict[str, Any] = field(default_factory=dict)  # <tag>/samples.meta.json


def _interval(v: Any) -> list[float] | None:
    if isinstance(v, list | tuple) and len(v) == 2 and all(isinstance(x, int | float) for x in v):
        return [float(v[0]), float(v[1])]
    if isinstance(v, Mapping):
        lo, hi = _first(v, "low", "lo", "lower"), _first(v, "high", "hi", "upper")
        if isinstance(lo, int | float) and isinstance(hi, int | float):
            return [float(lo), float(hi)]
    return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _at_k(v: Any) -> dict[str, float]:
    if not isinstance(v, Mapping):
        return {}
    out = {str(k): float(x) for k, x in v.items() if _num(x) is not None}
    return dict(sorted(out.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))


def read_eval(path: Path, tag: str) -> EvalRecord:
    """One ``eval/<tag>/metrics.json`` (docs/formats/eval.md)."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ReportInputError(f"{path}: expected a JSON object")
    by_grader = raw.get("by_grader")
    if not isinstance(by_grader, Mapping) or not by_grader:
        raise ReportInputError(f"{path}: key 'by_grader' missing or empty")
    per_problem = raw.get("per_problem") or []
    if not isinstance(per_problem, list):
        raise ReportInputError(f"{path}: key 'per_problem' is not a list")
    graders: list[GraderResult] = []
    for name, g in by_grader.items():
        if not isinstance(g, Mapping):
            raise ReportInputError(f"{path}: by_grader.{name} is not an object")
        avg = _first(g, "avg@n", "avg")
        if avg is None:
            avg = next((v for k, v in g.items() if re.fullmatch(r"avg@\d+", str(k))), None)
        r = GraderResult(
            grader=str(name), avg=_num(avg), sampling_se=_num(g.get("sampling_se")),
            bootstrap_ci=_interval(g.get("bootstrap_ci")), pass_at=_at_k(g.get("pass@k")),
            maj_at=_at_k(g.get("maj@k")), failures=dict(g.get("grader_failures") or {}),
        )
        for i, row in enumerate(per_problem):
            if not isinstance(row, Mapping):
                raise ReportInputError(f"{path}: per_problem[{i}] is not an object")
            cell = row.get(str(name))
            pid = row.get("problem_id", i)
            if isinstance(cell, Mapping) and _num(cell.get("acc")) is not None:
                r.per_problem[str(pid)] = float(cell["acc"])
        graders.append(r)
    vs_base = []
    vb = raw.get("vs_base")
    if isinstance(vb, Mapping):
        for name, d in vb.items():
            if isinstance(d, Mapping) and name != "base_tag":
                vs_base.append({
                    "grader": name, "base_tag": vb.get("base_tag", "base"),
                    "diff": _num(d.get("mean_diff")),
                    "interval": _interval(d.get("paired_bootstrap_ci")),
                })
    m = _TAG_ORDER.match(tag)
    return EvalRecord(
        tag=tag,
        step=_int_or_none(raw.get("step")) or (int(m.group(1)) if m else None),
        n=_int_or_none(raw.get("n")),
        num_problems=_int_or_none(raw.get("num_problems")),
        primary_grader=raw.get("primary_grader"),
        graders=graders,
        format_failure_rate=_num(raw.get("format_failure_rate")),
        format_failures=_int_or_none(raw.get("format_failures")),
        truncation_rate=_num(raw.get("truncation_rate")),
        mean_response_tokens=_num(raw.get("mean_response_tokens")),
        vs_base=vs_base,
        raw=raw,
    )


# --------------------------------------------------------------------------------------
# Gathering: one object with everything found, plus what is missing and why.
# --------------------------------------------------------------------------------------


@dataclass
class Stage:
    stage: str
    status: str
    detail: str
    path: str


@dataclass
class Found:
    results: Path
    config: dict[str, Any]
    stages: list[Stage]
    docs: dict[str, Any]
    attempts: list[Attempt]
    logs: list[VerlLog]
    metrics: dict[int, dict[str, Any]]
    metrics_source: str
    notes: list[str]
    evals: list[EvalRecord]


def _gpu(config: Mapping[str, Any]) -> bool:
    return bool(config.get("cluster", {}).get("gpu", False))


def _not_there(rel: str, config: Mapping[str, Any], gpu_stage: bool) -> tuple[str, str]:
    if gpu_stage and not _gpu(config):
        return ("not run", "cluster.gpu is false (embedded default / machine without GPU): "
                "GPU stages are not part of this run")
    return ("missing", f"{rel} not found: the stage has not run for this run (or it failed)")


def gather(results: Path, config: Mapping[str, Any]) -> Found:
    """Read every stage's files under ``results``; tolerate absence, not corruption."""
    config = dict(config)
    docs: dict[str, Any] = {}
    stages: list[Stage] = []
    notes: list[str] = []

    def doc(name: str) -> Any:
        docs[name] = read_json(results / PATHS[name])
        return docs[name]

    for name, stage, gpu_stage in (
        ("lock", "deps", False),
        ("data_summary", "data", False),
        ("checkpoint_check", "check_checkpoint", False),
        ("bridge_check", "check_bridge", True),
        ("cluster_probe", "cluster_probe", True),
        ("plan", "preflight", False),
    ):
        rel = PATHS[name]
        d = doc(name)
        if d is None:
            status, detail = _not_there(rel, config, gpu_stage)
        elif name.endswith("_check"):
            status, counts, _ = check_counts(d)
            detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no checks"
        elif name == "plan" and isinstance(d, dict):
            errors = d.get("errors") or []
            status = "pass" if d.get("ok", not errors) else "fail"
            detail = (f"{len(errors)} error(s), {len(d.get('warnings') or [])} warning(s); "
                      + ("launched" if d.get("launched", True)
                         else str(d.get("not_launched_reason") or "not launched")))
        else:
            status, detail = "done", "written"
            if isinstance(d, dict) and d.get("status"):
                status, detail = str(d["status"]), str(d.get("reason") or detail)
        stages.append(Stage(stage, status, detail, rel))

    gpn = _int_or_none(config.get("cluster", {}).get("gpus_per_node"))
    att_dir = results / PATHS["attempts"]
    attempts = sorted(
        (read_attempt(p, gpn) for p in att_dir.glob("attempt-*.json")) if att_dir.is_dir() else [],
        key=lambda a: a.attempt,
    )
    logs: list[VerlLog] = []
    for a in attempts:
        p = att_dir / f"attempt-{a.attempt}.metrics.jsonl"
        if p.exists():
            a.log_path = str(p.relative_to(results))
        else:
            notes.append(f"attempt {a.attempt}: no {p.relative_to(results)} (it logged no step)")
    log_paths = sorted(
        att_dir.glob("attempt-*.metrics.jsonl") if att_dir.is_dir() else [],
        key=lambda p: int(re.search(r"attempt-(\d+)", p.name).group(1)),
    )
    for p in log_paths:
        log = read_verl_log(p)
        if log.dropped_tail:
            notes.append(f"{p.relative_to(results)}: truncated last line dropped (crash mid-write)")
        logs.append(log)
    merged_here = merge_logs(logs)
    metrics_path = results / PATHS["metrics"]
    if metrics_path.exists():
        metrics = merge_logs([read_verl_log(metrics_path, allow_truncated_tail=False)])
        source = f"{PATHS['metrics']} (merged by the train stage)"
        if logs and merged_here != metrics:
            diff = sorted(set(merged_here) ^ set(metrics))
            same = [s for s in metrics if s in merged_here and merged_here[s] != metrics[s]]
            notes.append(
                f"{PATHS['metrics']} differs from the merge of the attempt logs "
                f"(steps only in one: {diff[:10]}; steps with different values: {same[:10]})"
            )
    elif logs:
        metrics = merged_here
        source = f"merged here from {len(logs)} attempt log(s) in {PATHS['attempts']}/"
    else:
        metrics, source = {}, ""

    done = doc("train_done")
    if done is not None:
        d = done if isinstance(done, dict) else {}
        stages.append(Stage(
            "train", "done",
            f"final step {d.get('final_step')}, {len(attempts)} attempt(s), "
            f"{d.get('steps_lost_total', 'n/a')} step(s) lost in total", PATHS["train_done"]))
    elif attempts or metrics:
        last = attempts[-1].exit_reason if attempts else None
        stages.append(Stage("train", "incomplete",
                            f"{len(attempts)} attempt(s), no {PATHS['train_done']}; "
                            f"last exit reason: {last}", PATHS["attempts"]))
    else:
        status, detail = _not_there(PATHS["train_done"], config, True)
        stages.append(Stage("train", status, detail, PATHS["train_done"]))

    evals: list[EvalRecord] = []
    eval_dir = results / PATHS["eval"]
    summary = read_json(eval_dir / "summary.json")
    listed = summary.get("tags") if isinstance(summary, dict) else None
    if eval_dir.is_dir():
        for p in sorted(eval_dir.glob("*/metrics.json"), key=lambda p: tag_key(p.parent.name)):
            if isinstance(listed, list) and p.parent.name not in listed:
                notes.append(f"{p.relative_to(results)} ignored: tag not in eval/summary.json "
                             "(left over from an earlier configuration)")
                continue
            e = read_eval(p, p.parent.name)
            meta = read_json(p.parent / "samples.meta.json")
            e.samples_meta = meta if isinstance(meta, dict) else {}
            if e.tag == "final" and e.step is None and isinstance(done, dict):
                e.step = _int_or_none(done.get("final_step"))
            evals.append(e)
    if evals:
        stages.append(Stage("evaluate", "done", "tags: " + ", ".join(e.tag for e in evals),
                            f"{PATHS['eval']}/<tag>/metrics.json"))
    else:
        status, detail = _not_there(f"{PATHS['eval']}/<tag>/metrics.json", config, False)
        # generation recorded `not run` (e.g. backend vllm without vLLM): say so and why
        for p in sorted(eval_dir.glob("*/samples.meta.json")) if eval_dir.is_dir() else []:
            meta = read_json(p)
            if isinstance(meta, dict) and meta.get("status") == "not run":
                status = "not run"
                detail = f"{p.relative_to(results)}: {meta.get('reason') or 'no reason given'}"
                break
        stages.append(Stage("evaluate", status, detail, f"{PATHS['eval']}/<tag>/metrics.json"))
    return Found(results, config, stages, docs, attempts, logs, metrics, source, notes, evals)


# --------------------------------------------------------------------------------------
# Analysis: series, resume points, claims.
# --------------------------------------------------------------------------------------


def series(metrics: Mapping[int, Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for step, data in metrics.items():
        v = data.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(step)
            ys.append(float(v))
    return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def all_keys(metrics: Mapping[int, Mapping[str, Any]]) -> set[str]:
    return {k for d in metrics.values() for k in d}


def resume_points(attempts: list[Attempt], logs: list[VerlLog]) -> list[tuple[int, str]]:
    """(step, label) for every attempt that resumed: every attempt after the first, and the
    first too when it started from a checkpoint (start step > 0)."""
    points: list[tuple[int, str]] = []
    by_attempt = {}
    for log in logs:
        m = re.search(r"attempt-(\d+)", Path(log.path).name)
        if m and log.lines:
            by_attempt[int(m.group(1))] = min(s for s, _ in log.lines)
    known = {a.attempt for a in attempts}
    for a in attempts:
        if a.attempt == min(known) and not a.start_step:
            continue
        step = a.start_step if a.start_step is not None else by_attempt.get(a.attempt)
        if step is not None:
            job = f" (job {a.slurm_job_id})" if a.slurm_job_id else ""
            points.append((step, f"attempt {a.attempt}{job}"))
    for k, step in sorted(by_attempt.items()):
        if k not in known and k != min(by_attempt):
            points.append((step, f"attempt {k}"))
    return points


def pick_key(keys: set[str], preferred: Iterable[str], pattern: str | None = None) -> str | None:
    for k in preferred:
        if k in keys:
            return k
    if pattern:
        cands = sorted(k for k in keys if re.fullmatch(pattern, k))
        return cands[0] if cands else None
    return None


# Published Hy3 curves: approximate values read from the published figure (see
# ../shared/docs/upstream-facts.md); for orientation only.
PUBLISHED: dict[str, dict[str, Any]] = {
    "training/rollout_probs_diff_mean": {
        "points": [(20, 0.016), (190, 0.008)],
        "note": "rises to ~0.016 near step 20, then falls to ~0.008",
    },
    "rollout_corr/k3_kl": {"points": [(0, 0.010), (190, 0.002)], "note": "~0.01 falling to ~0.002"},
    "critic/rewards/mean": {"points": [(0, 0.4), (190, 0.8)], "note": "~0.4 rising to ~0.8"},
    "val-core/math_dapo/acc/mean@1": {
        "points": [(0, 0.84), (30, 0.81), (80, 0.88), (110, 0.88), (190, 0.86)],
        "note": "~0.84, dip ~0.81 at step 30, peak ~0.88 at steps 80-110, ~0.86 at the end",
    },
    "val-aux/math_dapo/reward/mean@1": {
        "points": [(0, 0.68), (30, 0.62), (80, 0.76), (110, 0.76), (190, 0.72)],
        "note": "follows the accuracy, range 0.62-0.76 (shape assumed from the accuracy)",
    },
}

PANELS = (
    ("Rollout-vs-actor probability drift", ["training/rollout_probs_diff_mean"], None),
    ("Rollout correction K3 KL", ["rollout_corr/k3_kl"], None),
    ("Training reward", ["critic/rewards/mean"], None),
    ("AIME validation accuracy", ["val-core/math_dapo/acc/mean@1"], r"val-core/.+/acc/mean@\d+"),
    # verl@220e903's engine workers (model_engine=megatron) log actor/loss (the summed loss)
    # and actor/pg_loss; the legacy workers only actor/pg_loss. The panel names the one used.
    ("Actor loss", ["actor/loss", "actor/pg_loss"], r"actor/.*loss"),
    ("AIME validation reward", ["val-aux/math_dapo/reward/mean@1"],
     r"val-aux/.+/reward/mean@\d+"),
)


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def claims(found: Found, threshold: float) -> list[dict[str, str]]:
    m = found.metrics
    keys = all_keys(m)
    rows: list[dict[str, str]] = []
    why_none = "no training metrics" if not m else None

    x, y = series(m, "training/rollout_probs_diff_mean")
    if len(y):
        imax = int(np.argmax(y))
        share = float(np.mean(y < threshold))
        above = int(np.sum(y >= threshold))
        verdict = (f"stays below {threshold} on every logged step" if above == 0 else
                   f"above {threshold} on {above} of {len(y)} steps (the published plot is "
                   "also briefly above)")
        this = (f"max {y[imax]:.4g} at step {int(x[imax])}; {share:.1%} of {len(y)} steps "
                f"under {threshold}")
    else:
        this, verdict = "n/a", why_none or "training/rollout_probs_diff_mean not logged"
    rows.append({"claim": "Probability drift (training/rollout_probs_diff_mean)",
                 "published": 'text: "stays below 0.015"; plot: ~0.016 near step 20, then '
                              "~0.008", "this_run": this, "verdict": verdict})

    x, y = series(m, "critic/rewards/mean")
    if len(y) >= 2:
        n = max(1, len(y) // 10)
        first, last = float(np.mean(y[:n])), float(np.mean(y[-n:]))
        slope = float(np.polyfit(x, y, 1)[0]) * 100
        this = (f"{first:.3f} (mean of first {n}) -> {last:.3f} (mean of last {n}); "
                f"linear trend {slope:+.3f} per 100 steps")
        verdict = "rising" if last > first else "not rising"
    else:
        this, verdict = "n/a", why_none or "critic/rewards/mean has fewer than 2 points"
    rows.append({"claim": "Reward trend (critic/rewards/mean)",
                 "published": "~0.4 rising to ~0.8 over ~190 steps", "this_run": this,
                 "verdict": verdict})

    vkey = pick_key(keys, ["val-core/math_dapo/acc/mean@1"], r"val-core/.+/acc/mean@\d+")
    if vkey:
        x, y = series(m, vkey)
        ip = int(np.argmax(y))
        this = (f"first {y[0]:.3f} (step {int(x[0])}), peak {y[ip]:.3f} (step {int(x[ip])}), "
                f"last {y[-1]:.3f} (step {int(x[-1])}); key {vkey}")
        verdict = f"{'gain' if y[-1] > y[0] else 'no gain'} of {y[-1] - y[0]:+.3f} first to last"
    else:
        this, verdict = "n/a", why_none or "no val-core/*/acc/mean@* key logged"
    rows.append({"claim": "AIME validation (val-core acc)",
                 "published": "first ~0.84, peak ~0.88 (steps 80-110), last ~0.86",
                 "this_run": this, "verdict": verdict})
    return rows


# --------------------------------------------------------------------------------------
# Figures (matplotlib, Agg). Every figure always exists; without data it says why.
# --------------------------------------------------------------------------------------


def _png(fig: Any, redact: Redactor, dpi: int) -> bytes:
    buf = io.BytesIO()
    meta = {"Software": f"matplotlib {matplotlib.__version__}", "Title": None}
    fig.savefig(buf, format="png", dpi=dpi, metadata=redact(meta))
    plt.close(fig)
    return buf.getvalue()


def _mark_resumes(ax: Any, points: list[tuple[int, str]], redact: Redactor, label: bool) -> None:
    for i, (step, text) in enumerate(points):
        ax.axvline(step, color="tab:red", ls=":", lw=1.2,
                   label=redact.text(f"resume: {text} @ {step}") if label and i < 4 else None)


def _empty(ax: Any, text: str) -> None:
    wrapped = "\n".join(textwrap.fill(line, 42) for line in text.split("\n"))
    ax.text(0.5, 0.5, wrapped, ha="center", va="center", transform=ax.transAxes, fontsize=8,
            color="0.3", bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "0.8"})


def fig_published(found: Found, redact: Redactor, dpi: int, reference: bool,
                  threshold: float, reason: str) -> tuple[bytes, list[str]]:
    m = found.metrics
    keys = all_keys(m)
    points = resume_points(found.attempts, found.logs)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), layout="constrained")
    used: list[str] = []
    for ax, (title, preferred, pattern) in zip(axes.flat, PANELS, strict=True):
        key = pick_key(keys, preferred, pattern)
        ref = PUBLISHED.get(preferred[0]) if reference else None
        if key:
            x, y = series(m, key)
            ax.plot(x, y, marker="." if len(x) < 60 else None, lw=1.4, label="this run")
            used.append(f"{title}: {key}")
        else:
            used.append(f"{title}: not logged (looked for {', '.join(preferred)})")
            _empty(ax, redact.text(f"no data\n{reason if not m else 'key not logged'}"))
        if ref:
            rx, ry = zip(*ref["points"], strict=True)
            ax.plot(rx, ry, color="0.5", ls="--", lw=1.2,
                    label="published (approx., read from the figure)")
            if key:
                ax.set_xlim(left=0, right=max(float(np.max(series(m, key)[0])), 1.0) * 1.05)
        if preferred[0] == "training/rollout_probs_diff_mean":
            ax.axhline(threshold, color="tab:orange", lw=1, label=f"claimed bound {threshold}")
        _mark_resumes(ax, points, redact, label=True)
        ax.set_title(redact.text(f"{title}\n{key or preferred[0]}"), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle("Hy3 GRPO: the six panels of the published figure (dashed: approximate "
                 "published values)", fontsize=12)
    return _png(fig, redact, dpi), used


def fig_extra(found: Found, redact: Redactor, dpi: int, reason: str) -> bytes:
    m = found.metrics
    keys = all_keys(m)
    points = resume_points(found.attempts, found.logs)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), layout="constrained")
    specs = (
        ("Response length (tokens)", ["response_length/mean", "response_length/max"]),
        ("Entropy", ["actor/entropy"]),
        ("Throughput (tokens/s/GPU)", ["perf/throughput"]),
        ("MFU (actor)", ["perf/mfu/actor", "perf/mfu/actor_infer"]),
    )
    for ax, (title, wanted) in zip(axes.flat, specs, strict=True):
        got = [k for k in wanted if k in keys]
        for k in got:
            x, y = series(m, k)
            ax.plot(x, y, marker="." if len(x) < 60 else None, lw=1.3, label=k)
        if "response_length/clip_ratio" in keys and title.startswith("Response"):
            ax2 = ax.twinx()
            x, y = series(m, "response_length/clip_ratio")
            ax2.plot(x, y, color="tab:gray", lw=1, ls="-.", label="clip_ratio (right)")
            ax2.set_ylabel("clip ratio")
            ax2.legend(fontsize=7, loc="lower right")
        if not got:
            why = reason if not m else "not logged: " + ", ".join(wanted)
            _empty(ax, redact.text(f"no data\n{why}"))
        _mark_resumes(ax, points, redact, label=bool(got))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    return _png(fig, redact, dpi)


def fig_step_time(found: Found, redact: Redactor, dpi: int, reason: str) -> bytes:
    m = found.metrics
    keys = sorted(k for k in all_keys(m) if k.startswith("timing_s/") and k != "timing_s/step")
    points = resume_points(found.attempts, found.logs)
    fig, ax = plt.subplots(figsize=(12, 4.5), layout="constrained")
    steps = sorted(s for s, d in m.items() if any(k in d for k in keys))
    if keys and steps:
        stack = np.array([[float(m[s].get(k) or 0.0) for s in steps] for k in keys])
        ax.stackplot(steps, stack, labels=[k.removeprefix("timing_s/") for k in keys], alpha=0.8)
        x, y = series(m, "timing_s/step")
        if len(x):
            ax.plot(x, y, color="black", lw=1.2, label="step (total)")
        _mark_resumes(ax, points, redact, label=True)
        ax.legend(fontsize=7, loc="upper left", ncol=4)
    else:
        _empty(ax, redact.text(f"no data\n{reason if not m else 'no timing_s/* keys logged'}"))
    ax.set_title("Step-time breakdown (timing_s/*, stacked; black: timing_s/step)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    return _png(fig, redact, dpi)


def fig_eval_checkpoints(found: Found, redact: Redactor, dpi: int, reason: str) -> bytes:
    fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
    evs = found.evals
    if evs:
        xs = np.arange(len(evs))
        names = sorted({g.grader for e in evs for g in e.graders})
        width = 0.6 / max(len(names), 1)
        for j, name in enumerate(names):
            off = xs + (j - (len(names) - 1) / 2) * width
            gs = [next((g for g in e.graders if g.grader == name), None) for e in evs]
            vals = np.array([g.avg if g and g.avg is not None else np.nan for g in gs])
            line = ax.plot(off, vals, "o-", lw=1, label=redact.text(f"{name} avg@n"))[0]
            for x, g, v in zip(off, gs, vals, strict=True):
                if g and g.bootstrap_ci:
                    ax.vlines(x, *g.bootstrap_ci, color=line.get_color(), lw=1, alpha=0.7)
                    ax.hlines(g.bootstrap_ci, x - 0.04, x + 0.04, color=line.get_color(), lw=1)
                if g and g.sampling_ci and np.isfinite(v):
                    ax.vlines(x, *g.sampling_ci, color=line.get_color(), lw=5, alpha=0.45)
        ax.set_xticks(xs, [redact.text(e.tag) for e in evs])
        lo, hi = ax.get_ylim()
        ax.set_ylim(max(lo, -0.02), min(hi, 1.02))
        ax.set_xlabel("checkpoint")
        ax.set_ylabel("accuracy (avg@n)")
        ax.legend(fontsize=8, loc="best")
        ax.set_title("AIME accuracy across checkpoints\n(thin: problem bootstrap 95% interval; "
                     "thick: +-1.96 sampling SE)", fontsize=10)
    else:
        _empty(ax, redact.text(f"no evaluation results\n{reason}"))
        ax.set_title("AIME accuracy across checkpoints")
    ax.grid(alpha=0.3)
    return _png(fig, redact, dpi)


def per_problem_matrix(found: Found) -> tuple[list[str], list[str], np.ndarray, str]:
    """Problems x tags accuracy for the primary grader (else the first with per-problem data)."""
    tags = [e.tag for e in found.evals]
    grader = next((e.primary_grader for e in found.evals if e.primary_grader), "")
    if not any(g.grader == grader and g.per_problem for e in found.evals for g in e.graders):
        grader = next((g.grader for e in found.evals for g in e.graders if g.per_problem), "")
    probs: set[str] = set()
    for e in found.evals:
        for g in e.graders:
            if g.grader == grader:
                probs |= set(g.per_problem)
    problems = sorted(probs, key=lambda p: (0, int(p), "") if p.isdigit() else (1, 0, p))
    mat = np.full((len(problems), len(tags)), np.nan)
    for j, e in enumerate(found.evals):
        g = next((g for g in e.graders if g.grader == grader), None)
        if g:
            for i, p in enumerate(problems):
                mat[i, j] = g.per_problem.get(p, np.nan)
    return problems, tags, mat, grader


def fig_heatmap(found: Found, redact: Redactor, dpi: int, reason: str) -> bytes:
    problems, tags, mat, grader = per_problem_matrix(found)
    size = (max(5, 1.1 * len(tags) + 3), max(4, 0.28 * len(problems) + 1.5))
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    if problems and tags:
        im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks(range(len(tags)), [redact.text(t) for t in tags])
        ax.set_yticks(range(len(problems)), [redact.text(p) for p in problems], fontsize=7)
        ax.set_xlabel("checkpoint")
        ax.set_ylabel("problem")
        fig.colorbar(im, ax=ax, label="accuracy over samples")
        ax.set_title(redact.text(f"Per-problem accuracy ({grader})"))
    else:
        _empty(ax, redact.text(f"no per-problem results\n{reason}"))
        ax.set_title("Per-problem accuracy")
    return _png(fig, redact, dpi)


# --------------------------------------------------------------------------------------
# Tables.
# --------------------------------------------------------------------------------------


def _csv(header: list[str], rows: list[Mapping[str, Any]], redact: Redactor) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=header, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: redact.text(_fmt(r.get(k), 6) if r.get(k) is not None else "")
                    for k in header})
    return buf.getvalue().encode()


def eval_rows(found: Found) -> list[dict[str, Any]]:
    rows = []
    for e in found.evals:
        for g in e.graders:
            rows.append({
                "tag": e.tag, "step": e.step, "n": e.n, "problems": e.num_problems,
                "grader": g.grader + (" (primary)" if g.grader == e.primary_grader else ""),
                "avg@n": g.avg, "bootstrap_95": _fmt_iv(g.bootstrap_ci),
                "sampling_se": g.sampling_se,
                "pass@k": "; ".join(f"pass@{k}={v:.3g}" for k, v in g.pass_at.items()),
                "maj@k": "; ".join(f"maj@{k}={v:.3g}" for k, v in g.maj_at.items()),
                "pass@n": g.pass_at.get(str(e.n)) if e.n else None,
                "maj@n": g.maj_at.get(str(e.n)) if e.n else None,
                "grader_failures": _short(g.failures) if any(g.failures.values()) else "0",
                "format_failure_rate": e.format_failure_rate,
                "format_failures": e.format_failures,
                "truncation_rate": e.truncation_rate,
                "mean_response_tokens": e.mean_response_tokens,
            })
    return rows


EVAL_HEADER = ["tag", "step", "n", "problems", "grader", "avg@n", "bootstrap_95", "sampling_se",
               "pass@n", "maj@n", "pass@k", "maj@k", "grader_failures", "format_failure_rate",
               "format_failures", "truncation_rate", "mean_response_tokens"]
# The page's headline table (the CSV has every column, pass@k and maj@k for every k).
EVAL_HTML_HEADER = ["tag", "step", "n", "grader", "avg@n", "bootstrap_95", "sampling_se",
                    "pass@n", "maj@n", "grader_failures", "format_failure_rate",
                    "truncation_rate", "mean_response_tokens"]


def _fmt_iv(iv: list[float] | None) -> str:
    return f"[{iv[0]:.4g}, {iv[1]:.4g}]" if iv else ""


def _short(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict | list):
        return json.dumps(v, sort_keys=True)[:300]
    return str(v)


PAIRED_HEADER = ["grader", "base_avg", "final_avg", "diff", "paired_interval", "source"]
SETTINGS_HEADER = ["tag", "step", "model", "backend", "preset", "temperature", "top_p", "n",
                   "max_tokens", "seed", "math_dapo", "math_verify"]


def _grader_impl(raw: Mapping[str, Any], name: str) -> str:
    """One line naming the grader implementation recorded in metrics.json ``graders``."""
    g = (raw.get("graders") or {}).get(name)
    if not isinstance(g, Mapping):
        return ""
    parts = [str(g.get("implementation") or "?")]
    for key in ("version", "commit"):
        if g.get(key):
            parts.append(f"{key} {g[key]}")
    if g.get("reason"):
        parts.append(f"({g['reason']})")
    return " ".join(parts)


def settings_rows(found: Found) -> list[dict[str, Any]]:
    """Per tag: the model and sampling settings the samples were generated with
    (<tag>/samples.meta.json) and the grader implementations (metrics.json ``graders``)."""
    rows = []
    for e in found.evals:
        meta = e.samples_meta
        smp = meta.get("sampling") if isinstance(meta.get("sampling"), Mapping) else {}
        rows.append({
            "tag": e.tag, "step": e.step, "model": meta.get("model_path"),
            "backend": meta.get("backend"), "preset": meta.get("preset"),
            "temperature": smp.get("temperature"), "top_p": smp.get("top_p"),
            "n": smp.get("n_samples", e.n), "max_tokens": smp.get("max_tokens"),
            "seed": smp.get("seed"),
            "math_dapo": _grader_impl(e.raw, "math_dapo"),
            "math_verify": _grader_impl(e.raw, "math_verify"),
        })
    return rows


def at_k_table(found: Found) -> tuple[list[str], list[dict[str, Any]]]:
    """pass@k and maj@k for every k, one row a (tag, grader): (header, rows)."""
    ks = sorted({int(k) for e in found.evals for g in e.graders
                 for k in (*g.pass_at, *g.maj_at) if k.isdigit()})
    header = ["tag", "grader", *[f"pass@{k}" for k in ks], *[f"maj@{k}" for k in ks]]
    rows = []
    for e in found.evals:
        for g in e.graders:
            rows.append({"tag": e.tag, "grader": g.grader,
                         **{f"pass@{k}": v for k, v in g.pass_at.items()},
                         **{f"maj@{k}": v for k, v in g.maj_at.items()}})
    return header, rows


def paired_rows(found: Found) -> list[dict[str, Any]]:
    """Base against final: the evaluate stage's paired bootstrap (final's ``vs_base``)."""
    final = next((e for e in found.evals if e.tag == "final"), None)
    base = next((e for e in found.evals if e.tag == "base"), None)
    if not final:
        return []
    rows = []
    for p in final.vs_base:
        gb = next((g for g in base.graders if g.grader == p["grader"]), None) if base else None
        gf = next((g for g in final.graders if g.grader == p["grader"]), None)
        rows.append({
            "grader": p["grader"], "base_avg": gb.avg if gb else None,
            "final_avg": gf.avg if gf else None, "diff": p["diff"],
            "paired_interval": _fmt_iv(p["interval"]),
            "source": "eval/final/metrics.json vs_base (paired problem bootstrap, 95%)",
        })
    return rows


def env_versions(packages: Iterable[str]) -> list[tuple[str, str]]:
    out = [("python", platform.python_version()), ("platform", platform.platform())]
    for p in packages:
        try:
            out.append((p, metadata.version(p)))
        except metadata.PackageNotFoundError:
            out.append((p, "not installed here"))
    return out


def deps_rows(lock: Any, config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Dependency pins: from deps/lock.json (docs/formats/deps.md), else from the config."""
    rows: list[dict[str, Any]] = []
    repos = lock.get("repos") if isinstance(lock, dict) else None
    if isinstance(repos, Mapping):
        for name, r in repos.items():
            if not isinstance(r, Mapping):
                continue
            ok = r.get("head") == r.get("commit") and r.get("head") is not None
            check = "verified = pin" if ok else f"NOT the pin {r.get('commit')}"
            rows.append({"section": "dependency (deps/lock.json)", "name": str(name),
                         "value": f"{r.get('head')} ({check}) {r.get('url')}"})
            for sub in r.get("submodules") or []:
                if isinstance(sub, Mapping):
                    rows.append({"section": "dependency submodule (not fetched)",
                                 "name": f"{name}/{sub.get('path')}", "value": sub.get("commit")})
        for w in (lock.get("warnings") or []):
            rows.append({"section": "dependency warning", "name": "deps", "value": w})
        return rows
    for name, r in (config.get("deps", {}).get("repos") or {}).items():
        rows.append({"section": "dependency (config pin; deps/lock.json missing)", "name": name,
                     "value": f"{r.get('commit')} {r.get('url')}"})
    return rows


def data_rows(summary: Any) -> list[dict[str, Any]]:
    """Data hashes and sizes from data/summary.json (docs/formats/data.md)."""
    if summary is None:
        return []
    rows: list[dict[str, Any]] = []
    splits = summary.get("splits") if isinstance(summary, dict) else None
    if isinstance(splits, Mapping):
        for split, d in splits.items():
            if not isinstance(d, Mapping):
                continue
            src = d.get("source") or {}
            rows += [
                {"section": "data", "name": f"{split}.sha256", "value": d.get("sha256")},
                {"section": "data", "name": f"{split}.rows / unique_prompts",
                 "value": f"{d.get('rows')} / {d.get('unique_prompts')}"},
                {"section": "data", "name": f"{split}.source",
                 "value": " ".join(str(x) for x in (src.get("kind"), src.get("id") or
                                   src.get("path"), src.get("revision") or src.get("sha256"))
                                   if x)},
            ]
        tok = summary.get("tokenizer") or {}
        if tok.get("chat_template_sha256"):
            rows.append({"section": "data", "name": "tokenizer.chat_template_sha256",
                         "value": tok["chat_template_sha256"]})
        return rows
    return [{"section": "data", "name": k, "value": v}
            for k, v in find_key(summary, r"(sha|hash|digest|rows)")]


def provenance_rows(found: Found, env: Mapping[str, str], packages: Iterable[str],
                    prefixes: Iterable[str], cfg_hash: str | None = None) -> list[dict[str, Any]]:
    rows = deps_rows(found.docs.get("lock"), found.config)
    rows.append({"section": "config", "name": "config_hash (sha256)",
                 "value": cfg_hash or config_hash(found.config)})
    rows += data_rows(found.docs.get("data_summary"))
    for name in ("checkpoint_check", "bridge_check"):
        d = found.docs.get(name)
        if d is not None:
            _, _, checks = check_counts(d)
            for c in checks:
                status, details = str(c.get("status")), str(c.get("details", ""))
                value = details if details.startswith(status) else f"{status}: {details}"
                rows.append({"section": PATHS[name], "name": c.get("name"), "value": value})
    plan = found.docs.get("plan")
    if isinstance(plan, dict) and isinstance(plan.get("launch"), Mapping):
        rows.append({"section": "preflight", "name": "launch.sh sha256",
                     "value": plan["launch"].get("sha256")})
    for e in found.evals:
        meta, sec = e.samples_meta, f"evaluation {e.tag}"
        for key in ("model_path", "backend", "preset", "sampling", "backend_settings",
                    "val_sha256", "chat_template_sha256", "versions"):
            if meta.get(key) is not None:
                v = meta[key]
                rows.append({"section": sec, "name": key, "value": json.dumps(
                    v, sort_keys=True) if isinstance(v, dict | list) else v})
        for g in ("math_dapo", "math_verify"):
            if _grader_impl(e.raw, g):
                rows.append({"section": sec, "name": f"grader {g}",
                             "value": _grader_impl(e.raw, g)})
    for a in found.attempts:
        rows.append({"section": "slurm", "name": f"attempt {a.attempt}",
                     "value": f"job {a.slurm_job_id}; nodes {','.join(a.nodes) or a.num_nodes}"})
    for name, ver in env_versions(packages):
        rows.append({"section": "environment (report host)", "name": name, "value": ver})
    pre = tuple(prefixes)
    for name in sorted(env):
        if name.startswith(pre):
            rows.append({"section": "environment variable", "name": name, "value": env[name]})
    return rows


# --------------------------------------------------------------------------------------
# The page.
# --------------------------------------------------------------------------------------


@dataclass
class ReportOptions:
    reference_curves: bool = True
    drift_threshold: float = 0.015
    env_prefixes: tuple[str, ...] = DEFAULT_ENV_PREFIXES
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    redact_env: tuple[str, ...] = ()
    dpi: int = 100

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ReportOptions:
        sec = dict(config.get("report") or {})
        d = cls()
        return cls(
            reference_curves=bool(sec.get("reference_curves", d.reference_curves)),
            drift_threshold=float(sec.get("drift_threshold", d.drift_threshold)),
            env_prefixes=tuple(sec.get("env_prefixes", d.env_prefixes)),
            packages=tuple(sec.get("packages", d.packages)),
            redact_env=tuple(sec.get("redact_env", d.redact_env)),
            dpi=int(sec.get("dpi", d.dpi)),
        )


def _training_reason(found: Found) -> str:
    if found.metrics:
        return ""
    train = next(s for s in found.stages if s.stage == "train")
    if train.status == "not run":
        return "training did not run: " + train.detail
    if found.attempts:
        return "training attempts exist but logged no metrics"
    return "no training metrics: " + train.detail


def gpu_hours_summary(found: Found) -> dict[str, Any]:
    used = [a.gpu_hours for a in found.attempts if a.gpu_hours is not None]
    plan = found.docs.get("plan")
    est = find_key(plan, r"gpu_hours") if plan is not None else []
    return {
        "used": sum(used) if used else None,
        "used_note": (f"sum over {len(used)} of {len(found.attempts)} attempt(s): "
                      "wall hours x nodes x GPUs per node") if found.attempts else
                     "no training attempts",
        "plan": [(k, v) for k, v in est],
    }


def build(results: Path, config: Mapping[str, Any], env: Mapping[str, str],
          cfg_hash: str | None = None) -> dict[str, bytes]:
    """Render every output in memory: {file name: bytes}. Nothing is written here.
    ``cfg_hash``: the hash of the full config when ``config`` was redacted before it got
    here (the Snakemake rule); default: the hash of ``config``."""
    found = gather(results, config)
    cfg_hash = cfg_hash or config_hash(found.config)
    opts = ReportOptions.from_config(config)
    redact = make_redactor(env, [found.config, *found.docs.values(),
                                 *[a.raw for a in found.attempts]], opts.redact_env)
    reason = _training_reason(found)
    eval_reason = next(s for s in found.stages if s.stage == "evaluate").detail
    files: dict[str, bytes] = {}
    figs: dict[str, bytes] = {}
    figs["fig_training_published.png"], panel_keys = fig_published(
        found, redact, opts.dpi, opts.reference_curves, opts.drift_threshold, reason)
    figs["fig_training_extra.png"] = fig_extra(found, redact, opts.dpi, reason)
    figs["fig_step_time.png"] = fig_step_time(found, redact, opts.dpi, reason)
    figs["fig_eval_checkpoints.png"] = fig_eval_checkpoints(found, redact, opts.dpi, eval_reason)
    figs["fig_eval_heatmap.png"] = fig_heatmap(found, redact, opts.dpi, eval_reason)
    files.update(figs)

    stage_rows = [asdict(s) for s in found.stages]
    att_header = ["attempt", "slurm_job_id", "nodes", "gpus_per_node", "start_step", "end_step",
                  "last_logged_step", "steps_lost", "exit_reason", "started", "ended", "hours",
                  "gpu_hours"]
    att_rows = [{**asdict(a), "nodes": ",".join(a.nodes) or a.num_nodes} for a in found.attempts]
    claim_rows = claims(found, opts.drift_threshold)
    ev_rows = eval_rows(found)
    ev_header = EVAL_HEADER
    problems, tags, mat, grader = per_problem_matrix(found)
    pp_rows = [{"problem": p, **{t: (None if np.isnan(mat[i, j]) else float(mat[i, j]))
                                 for j, t in enumerate(tags)}} for i, p in enumerate(problems)]
    paired = paired_rows(found)
    paired_header = PAIRED_HEADER
    at_k_header, at_k_rows = at_k_table(found)
    prov = provenance_rows(found, env, opts.packages, opts.env_prefixes, cfg_hash)
    files["stages.csv"] = _csv(["stage", "status", "detail", "path"], stage_rows, redact)
    files["attempts.csv"] = _csv(att_header, att_rows, redact)
    files["claims.csv"] = _csv(["claim", "published", "this_run", "verdict"], claim_rows, redact)
    files["eval_headline.csv"] = _csv(ev_header, ev_rows, redact)
    files["eval_per_problem.csv"] = _csv(["problem", *tags], pp_rows, redact)
    files["eval_paired.csv"] = _csv(paired_header, paired, redact)
    files["provenance.csv"] = _csv(["section", "name", "value"], prov, redact)
    cfg_yaml = redact.text(yaml.safe_dump(redact(found.config), sort_keys=False))
    files["config.resolved.yaml"] = cfg_yaml.encode()

    jenv = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True,
                       undefined=StrictUndefined, finalize=redact.text,
                       trim_blocks=True, lstrip_blocks=True)
    jenv.filters["fmt"] = _fmt
    jenv.filters["pretty"] = lambda o: json.dumps(redact(o), indent=2, sort_keys=True, default=str)
    html = jenv.get_template("report.html.j2").render(
        run=found.config.get("run", {}).get("name", results.name),
        generated=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        results=str(results),
        stages=stage_rows,
        gpu=gpu_hours_summary(found),
        attempts=att_rows,
        att_header=att_header,
        resume=resume_points(found.attempts, found.logs),
        notes=found.notes,
        training_reason=reason,
        metrics_source=found.metrics_source,
        n_steps=len(found.metrics),
        panel_keys=panel_keys,
        published=PUBLISHED,
        claims=claim_rows,
        evals=ev_rows,
        ev_header=EVAL_HTML_HEADER,
        eval_reason=eval_reason if not found.evals else "",
        pp_grader=grader,
        pp_count=len(problems),
        paired=paired,
        paired_header=paired_header,
        settings=settings_rows(found),
        settings_header=SETTINGS_HEADER,
        at_k_header=at_k_header,
        at_k=at_k_rows,
        prov=prov,
        config_yaml=cfg_yaml,
        config_hash=cfg_hash,
        docs={k: redact(v) for k, v in found.docs.items() if v is not None},
        attempts_raw=[redact(a.raw) for a in found.attempts],
        img={k: base64.b64encode(v).decode() for k, v in figs.items()},
        tables=TABLES,
    )
    files["index.html"] = redact.text(html).encode()
    for name, blob in files.items():
        redact.check_bytes(name, blob)
    return files


def write_outputs(out_dir: Path, files: Mapping[str, bytes]) -> None:
    """Each file to a temp name in ``out_dir`` then renamed; index.html last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(files, key=lambda n: n == "index.html")
    for name in order:
        tmp = out_dir / f".{name}.tmp"
        tmp.write_bytes(files[name])
        os.replace(tmp, out_dir / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hy3rl.report", description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, required=True, help="results/<run> directory")
    ap.add_argument("--out-dir", type=Path, help="default: <results>/report")
    ap.add_argument("--config-json", help="the resolved config as JSON")
    ap.add_argument("--config", type=Path, nargs="*", help="config files (instead of JSON)")
    ap.add_argument("--config-hash", help="hash of the full config, when --config-json is a "
                    "redacted copy (the Snakemake rule); default: the hash of the config given")
    args = ap.parse_args(argv)
    if args.config_json:
        config = json.loads(args.config_json)
    elif args.config:
        from hy3rl.config import load

        config = load(*args.config)
    else:
        ap.error("one of --config-json or --config is required")
    try:
        files = build(args.results, config, dict(os.environ), args.config_hash)
    except ReportInputError as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 1
    out = args.out_dir or args.results / "report"
    write_outputs(out, files)
    print(f"report: wrote {len(files)} files to {out} (page: {out / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
