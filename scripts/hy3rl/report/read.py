"""The report's readers of the other stages' files (contracts: docs/formats/*.md), all in
one place so the formats are reconciled here, and the views derived from what was read
(metric series, resume points, the per-problem matrix).

Every path comes from the run's :class:`~hy3rl.layout.Layout`. An absent file is a stage
that did not run; an unreadable one is a :class:`ReportInputError` (or, for verl's metrics
logs, :class:`~hy3rl.verl_log.VerlLogError`) naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hy3rl import timefmt
from hy3rl.errors import StageError
from hy3rl.layout import ATTEMPT_METRICS_RE, ATTEMPT_RE, HELDOUT_PREFIX, Layout, heldout_tag
from hy3rl.settings import Config
from hy3rl.verl_log import attempt_logs, merge_metrics, read_metrics


class ReportInputError(StageError):
    """An input file exists but cannot be read; the message names the file (and line)."""


def read_json(path: str | Path) -> Any | None:
    """The parsed file, None if it does not exist; ReportInputError naming it if invalid."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: not valid JSON: {exc}") from exc


def read_model_manifest(path: str | Path) -> dict[str, Any] | None:
    """Rule model's manifest (docs/formats/model.md) without its file list: where the
    checkpoint came from, its size, and :func:`hy3rl.hub.provenance` (repo id or directory,
    revision, the manifest's sha256). None if absent; ReportInputError if malformed."""
    from hy3rl import hub

    if not Path(path).exists():
        return None
    try:
        m = hub.read_manifest(path)
        prov = hub.provenance(path)
    except hub.ManifestError as exc:
        raise ReportInputError(str(exc)) from exc
    return {"source": m.source.to_dict(), "dir": m.dir, "created": m.created,
            "file_count": len(m.files), "total_size": m.total_size, "provenance": prov}


def _first(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


# ---- verl metrics logs (train/attempts/attempt-<k>.metrics.jsonl, train/metrics.jsonl) ----


@dataclass
class AttemptLog:
    """One attempt's verl metrics log as read (hy3rl.verl_log lines)."""

    attempt: int
    path: str
    records: list[dict[str, Any]]
    dropped_tail: bool = False

    @property
    def first_step(self) -> int | None:
        return min((r["step"] for r in self.records), default=None)


def _read_log(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """verl_log.read_metrics, plus the number of the partial last line it skipped (a crash
    mid-write), else None: it raises on every other bad line, so fewer records than lines
    means that."""
    records = read_metrics(path)
    lines = path.read_bytes().rstrip().split(b"\n")
    return records, len(lines) if len(records) < sum(1 for ln in lines if ln.strip()) else None


def by_step(records: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Merged verl lines as {step: data}, steps ascending."""
    return {r["step"]: dict(r.get("data") or {}) for r in records}


# ---- training attempts (train/attempts/attempt-<k>.json) ----

# Outcomes of an attempt that did not fail (docs/formats/train.md `outcome`): still running,
# finished, or stopped by the launcher right after a save before the time limit.
NOT_FAILED = ("running", "succeeded", "stopped_for_time_limit")


@dataclass
class LogLink:
    """A log an attempt record names: what it is, its path relative to the run directory
    (or absolute, outside it), whether it exists now."""

    label: str
    path: str
    exists: bool


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
    outcome: str | None = None
    failed_at_step: int | None = None
    error: str | None = None
    wandb: dict[str, Any] | None = None
    started: str | None = None
    ended: str | None = None
    hours: float | None = None
    gpu_hours: float | None = None
    log_path: str | None = None
    trajectory: str | None = None  # first 8 hex of the trajectory id it trained under
    total_training_steps: int | None = None
    runtime: str | None = None  # the runtime identity it ran in (runtime.identity.id)
    logs: list[LogLink] = field(default_factory=list)  # a failed attempt's, else none
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """Closed by anything but success or the stop before the time limit (a record
        without ``outcome``: its exit reason is not ``succeeded``/``running``)."""
        return (self.outcome or self.exit_reason or "running") not in NOT_FAILED


def record_logs(layout: Layout, raw: Mapping[str, Any]) -> list[LogLink]:
    """The logs an attempt record names (docs/formats/train.md): its ``log_dir``, each
    node's copied Ray logs (``node_logs``, relative to train/attempts/) and the hang
    diagnostics' ``dir``, each as a :class:`LogLink`."""
    attempts = Path(layout.train_attempts)
    run_dir = os.path.abspath(layout.results)

    def link(label: str, path: Any) -> LogLink:
        p = attempts / str(path)  # an absolute path stays as it is
        shown = os.path.relpath(os.path.abspath(p), run_dir)
        return LogLink(label, str(p.resolve()) if shown.startswith("..") else shown,
                       p.exists())

    links = [link("attempt folder", raw["log_dir"])] if raw.get("log_dir") else []
    node_logs = raw.get("node_logs")
    for node, files in sorted(node_logs.items()) if isinstance(node_logs, Mapping) else []:
        links += [link(f"{node}: {Path(str(f)).name}", f) for f in files or []]
    diag = raw.get("diagnostics")
    if isinstance(diag, Mapping) and diag.get("dir"):
        links.append(link("hang diagnostics", diag["dir"]))
    return links


def read_attempt(path: Path, k: int, default_gpus_per_node: int | None) -> Attempt:
    """``k``: the attempt number in the file name (used when the record has none)."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ReportInputError(f"{path}: expected a JSON object")
    k = _int_or_none(_first(raw, "attempt", "index")) or k
    nodes_raw = _first(raw, "nodes", "nodelist", "hosts")
    nodes = [str(n) for n in nodes_raw] if isinstance(nodes_raw, list) else []
    if isinstance(nodes_raw, str):
        nodes = [n for n in re.split(r"[,\s]+", nodes_raw) if n]
    num_nodes = _int_or_none(_first(raw, "num_nodes", "nnodes")) or (
        len(nodes) if nodes else _int_or_none(nodes_raw)
    )
    gpn = _int_or_none(_first(raw, "gpus_per_node", "n_gpus_per_node")) or default_gpus_per_node
    started = timefmt.parse(_first(raw, "started_at", "start_time", "started", "start"))
    ended = timefmt.parse(_first(raw, "ended_at", "end_time", "ended", "end", "finished_at"))
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
    wandb = raw.get("wandb")
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
        outcome=None if raw.get("outcome") is None else str(raw["outcome"]),
        failed_at_step=_int_or_none(raw.get("failed_at_step")),
        error=None if raw.get("error") is None else str(raw["error"]),
        wandb=dict(wandb) if isinstance(wandb, Mapping) and wandb.get("run_id") else None,
        started=started.isoformat() if started else None,
        ended=ended.isoformat() if ended else None,
        hours=hours,
        gpu_hours=float(gpu_hours) if gpu_hours is not None else None,
        trajectory=str(raw["trajectory_id"])[:8] if raw.get("trajectory_id") else None,
        total_training_steps=_int_or_none(raw.get("total_training_steps")),
        runtime=runtime_of(raw),
        raw=raw,
    )


def runtime_of(raw: Mapping[str, Any]) -> str | None:
    """The runtime identity an attempt record names (``runtime.identity.id``,
    hy3rl.runtime_id; docs/formats/train.md), None when not recorded."""
    rt = raw.get("runtime")
    ident = rt.get("identity") if isinstance(rt, Mapping) else None
    rid = ident.get("id") if isinstance(ident, Mapping) else None
    return None if rid in (None, "") else str(rid)


# ---- generic JSON views (checks/*.json, preflight/plan.json) ----


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


def tag_key(tag: str) -> tuple[int, int, str]:
    """base, then step<N> by N, then anything else (final) by name."""
    if tag == "base":
        return (0, 0, tag)
    m = _TAG_ORDER.match(tag)
    if m:
        return (1, int(m.group(1)), tag)
    return (2, 0, tag)


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


# ---- gathering: one object with everything found, plus what is missing and why ----


@dataclass
class Stage:
    stage: str
    status: str
    detail: str
    path: str


@dataclass
class Found:
    cfg: Config
    layout: Layout
    stages: list[Stage]
    docs: dict[str, Any]  # name -> parsed JSON (None: absent)
    doc_paths: dict[str, str]  # name -> path relative to the run directory
    attempts: list[Attempt]
    logs: list[AttemptLog]
    metrics: dict[int, dict[str, Any]]
    metrics_source: str
    notes: list[str]
    evals: list[EvalRecord]
    # <checkpoint_dir>/hy3rl-run-identity.json (hy3rl.ckptdir), None when absent
    identity: dict[str, Any] | None = None
    identity_notes: list[str] = field(default_factory=list)
    # the held-out set's evaluations (eval/heldout/<tag>/metrics.json; tag heldout/<tag>)
    heldout: list[EvalRecord] = field(default_factory=list)
    first_attempt: int = 1  # the lineage's first attempt (run_identity)

    def rel(self, path: str | Path) -> str:
        return _rel(self.layout, path)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.stage == name)

    @property
    def training_ran(self) -> bool:
        """Anything of training exists: attempts, metrics or the sentinel."""
        return bool(self.attempts or self.metrics or self.docs.get("train_done") is not None)


def _rel(layout: Layout, path: str | Path) -> str:
    """``path`` (one of the layout's) relative to the run directory, for display."""
    return str(path).removeprefix(layout.results + "/")


def _not_there(rel: str, cfg: Config, gpu_stage: bool) -> tuple[str, str]:
    if gpu_stage and not cfg.cluster.gpu:
        return ("not run", "cluster.gpu is false (embedded default / machine without GPU): "
                "GPU stages are not part of this run")
    return ("missing", f"{rel} not found: the stage has not run for this run (or it failed)")


def rehearsal_status(cfg: Config, doc: Any) -> tuple[str, str]:
    """The rehearsal's stage row (rehearsal/checks.json, written pass or fail)."""
    from hy3rl.rehearsal import enabled

    if not cfg.cluster.gpu:
        return _not_there("", cfg, True)
    if not enabled(cfg):
        return ("waived", "preflight.waive names rehearsal: the train job did not wait for a "
                "one-node rehearsal")
    if not isinstance(doc, dict):
        return ("missing", "rehearsal/checks.json not found: the rehearsal has not run")
    checks = doc.get("checks") or []
    if checks and all(c.get("status") == "not run" for c in checks):
        return "not run", str(checks[0].get("detail"))
    bad = [c.get("name") for c in checks if c.get("status") != "pass"]
    if bad:
        return "fail", f"{len(bad)} of {len(checks)} checks failed: {', '.join(map(str, bad))}"
    return "pass", f"{len(checks)} checks passed"


def rehearsal_view(found: Found) -> dict[str, Any]:
    """The rehearsal section: its stage row, the record (rehearsal/checks.json), the
    phases' seconds, the runtime identity, and what ran (the rehearsal plan's
    ``rehearsal``: model, steps, the reductions)."""
    doc = found.docs.get("rehearsal")
    stage = found.stage("rehearsal")
    view: dict[str, Any] = {"status": stage.status, "detail": stage.detail,
                            "path": stage.path, "doc": doc if isinstance(doc, dict) else None}
    if view["doc"] is None:
        return view
    plan = read_json(found.layout.rehearsal_layout().preflight_plan)
    ran = (plan or {}).get("rehearsal") if isinstance(plan, dict) else None
    view["ran"] = ran
    view["reductions"] = (ran or {}).get("reductions") or []
    view["model_text"] = rehearsal_model_text(ran)
    per = (ran or {}).get("per_gpu") or {}
    differ = {d.get("key") for d in per.get("differ") or []}
    view["per_gpu"] = [{"key": k, "run": v, "rehearsal": (per.get("rehearsal") or {}).get(k),
                        "same": k not in differ}
                       for k, v in (per.get("run") or {}).items()]
    gmem = (doc.get("memory") or {}).get("gpu_memory_gb")
    view["memory"] = [{"phase": phase, "metric": name, "peak_gb": f.get("peak"),
                       "step": f.get("step"), "device_gb": gmem}
                      for phase, figures in ((doc.get("memory") or {}).get("phases")
                                             or {}).items()
                      for name, f in figures.items() if isinstance(f, dict)]
    view["phases"] = [{"phase": k, "seconds": v} for k, v in (doc.get("phases_s") or {}).items()]
    view["identity"] = ((doc.get("runtime") or {}).get("identity") or {}).get("id")
    view["checks"] = doc.get("checks") or []
    view["failure"] = doc.get("failure")
    return view


def rehearsal_model_text(ran: Any) -> str:
    """What the rehearsal trained, from its plan's ``rehearsal`` (``shape`` and ``model``:
    the small model's sizes, or the stage's record, hy3rl.stage)."""
    if not isinstance(ran, dict) or not isinstance(ran.get("model"), dict):
        return "a model its plan does not name"
    m = ran["model"]
    if ran.get("shape") == "stage":
        return (f"one pipeline stage of the run's model ({m.get('layers')} of its "
                f"{m.get('real_layers')} layers + {m.get('mtp_layers')} MTP, "
                f"{(m.get('parameters') or 0) / 1e9:.1f}B parameters, "
                f"{(m.get('total_size') or 0) / 1e9:.1f} GB of random weights, its tensors "
                f"checked against the real checkpoint's "
                f"{(m.get('inventory_check') or {}).get('against')}) at the run's per-GPU "
                "layout and lengths")
    return (f"a small Hy3 of hidden size {m.get('hidden_size')}, {m.get('num_hidden_layers')} "
            f"layers + MTP, {m.get('num_experts')} experts")


def _eval_tags(layout: Layout, heldout: bool = False) -> list[str]:
    """The tag folders under eval/ (the test set's; ``heldout``: those under eval/heldout/,
    as ``heldout/<tag>``), in checkpoint order."""
    held = HELDOUT_PREFIX.rstrip("/")
    eval_dir = Path(layout.eval_dir) / (held if heldout else "")
    if not eval_dir.is_dir():
        return []
    names = sorted((d.name for d in eval_dir.iterdir() if d.is_dir() and d.name != held),
                   key=tag_key)
    return [heldout_tag(n) for n in names] if heldout else names


def _read_evals(layout: Layout, tags: list[str], listed: Any, summary_key: str,
                done: Any, notes: list[str]) -> list[EvalRecord]:
    """The metrics.json (and samples.meta.json) of ``tags``; a tag the summary does not
    list (``listed``: its ``tags``, when it has them) is ignored, with a note."""
    evals = []
    for tag in tags:
        p = Path(layout.eval_metrics(tag))
        if not p.exists():
            continue
        if isinstance(listed, list) and tag not in listed:
            notes.append(f"{_rel(layout, p)} ignored: tag not in "
                         f"{_rel(layout, layout.eval_summary)}{summary_key} (left over from "
                         "an earlier configuration)")
            continue
        e = read_eval(p, tag)
        meta = read_json(layout.eval_samples_meta(tag))
        e.samples_meta = meta if isinstance(meta, dict) else {}
        model = tag.removeprefix(HELDOUT_PREFIX)
        # The step is what was evaluated (samples.meta.json), never what training reached
        # since: a final tag evaluated before an extension keeps its own step.
        if e.samples_meta.get("step") is not None:
            e.step = _int_or_none(e.samples_meta.get("step"))
        elif model == "final" and e.step is None and isinstance(done, dict):
            e.step = _int_or_none(done.get("final_step"))
        if model == "final" and isinstance(done, dict) and e.step is not None \
                and e.step != _int_or_none(done.get("final_step")):
            notes.append(f"eval/{tag} evaluated step {e.step}, but training's final step is "
                         f"{done.get('final_step')} ({_rel(layout, layout.train_done)}): "
                         "rerun the workflow to evaluate it")
        evals.append(e)
    return evals


def gather(cfg: Config, layout: Layout) -> Found:
    """Read every stage's files of the run at ``layout``; tolerate absence, not corruption."""

    def rel(path: str | Path) -> str:
        return _rel(layout, path)

    docs: dict[str, Any] = {}
    doc_paths: dict[str, str] = {}
    stages: list[Stage] = []
    notes: list[str] = []

    def doc(name: str, path: str) -> Any:
        read = read_model_manifest if name == "model_manifest" else read_json
        docs[name], doc_paths[name] = read(path), rel(path)
        return docs[name]

    for name, path, stage, gpu_stage in (
        ("lock", layout.deps_lock, "deps", False),
        ("data_summary", layout.data_summary, "data", False),
        ("model_manifest", layout.model_manifest, "model", False),
        ("checkpoint_check", layout.checks_checkpoint, "check_checkpoint", False),
        ("bridge_check", layout.checks_bridge, "check_bridge", True),
        ("cluster_probe", layout.cluster_probe, "cluster_probe", True),
        ("plan", layout.preflight_plan, "preflight", False),
    ):
        d = doc(name, path)
        if d is None:
            status, detail = _not_there(rel(path), cfg, gpu_stage)
        elif name.endswith("_check"):
            status, counts, _ = check_counts(d)
            detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no checks"
        elif name == "model_manifest":
            prov = d["provenance"]
            status, detail = "done", (f"{prov['model.source']} @ {prov['model.revision']}: "
                                      f"{prov['model.files']}")
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
        stages.append(Stage(stage, status, detail, rel(path)))

    reh = doc("rehearsal", layout.rehearsal_checks)
    stages.append(Stage("rehearsal", *rehearsal_status(cfg, reh),
                        rel(layout.rehearsal_checks)))

    # training: attempt records, their verl logs, the train stage's merge, the sentinel
    att_dir = Path(layout.train_attempts)
    records = sorted(
        (int(m.group(1)), p) for p in (att_dir.iterdir() if att_dir.is_dir() else [])
        if (m := ATTEMPT_RE.match(p.name)))
    attempts = sorted((read_attempt(p, k, cfg.cluster.gpus_per_node) for k, p in records),
                      key=lambda a: a.attempt)
    for a in attempts:
        if a.failed:
            a.logs = record_logs(layout, a.raw)
        p = layout.attempt_metrics(a.attempt)
        if Path(p).exists():
            a.log_path = rel(p)
        else:
            notes.append(f"attempt {a.attempt}: no {rel(p)} (it logged no step)")
    identity, identity_notes, first = run_identity(layout, attempts)
    logs: list[AttemptLog] = []
    for p in attempt_logs(att_dir):
        if int(ATTEMPT_METRICS_RE.match(p.name).group(1)) < first:
            continue  # trained checkpoints a fresh start moved aside: not this run's curve
        recs, dropped = _read_log(p)
        if dropped:
            notes.append(f"{rel(p)}: truncated last line dropped (crash mid-write)")
        k = int(ATTEMPT_METRICS_RE.match(p.name).group(1))
        logs.append(AttemptLog(k, str(p), recs, dropped is not None))
    merged_here = by_step(merge_metrics(log.records for log in logs))
    metrics_path = Path(layout.train_metrics)
    if metrics_path.exists():
        recs, dropped = _read_log(metrics_path)
        if dropped:  # the train stage writes this file whole (atomically): never cut
            raise ReportInputError(f"{metrics_path}:{dropped}: not a verl metrics line "
                                   "(cut off, in a file the train stage writes whole)")
        metrics = by_step(merge_metrics([recs]))
        source = f"{rel(metrics_path)} (merged by the train stage)"
        if logs and merged_here != metrics:
            diff = sorted(set(merged_here) ^ set(metrics))
            same = [s for s in metrics if s in merged_here and merged_here[s] != metrics[s]]
            notes.append(
                f"{rel(metrics_path)} differs from the merge of the attempt logs "
                f"(steps only in one: {diff[:10]}; steps with different values: {same[:10]})"
            )
    elif logs:
        metrics = merged_here
        source = f"merged here from {len(logs)} attempt log(s) in {rel(att_dir)}/"
    else:
        metrics, source = {}, ""

    done = doc("train_done", layout.train_done)
    if done is not None:
        d = done if isinstance(done, dict) else {}
        stages.append(Stage(
            "train", "done",
            f"final step {d.get('final_step')}, {len(attempts)} attempt(s), "
            f"{d.get('steps_lost_total', 'n/a')} step(s) lost in total", rel(layout.train_done)))
    elif attempts or metrics:
        last = attempts[-1].exit_reason if attempts else None
        stages.append(Stage("train", "incomplete",
                            f"{len(attempts)} attempt(s), no {rel(layout.train_done)}; "
                            f"last exit reason: {last}", rel(att_dir)))
    else:
        status, detail = _not_there(rel(layout.train_done), cfg, not cfg.trains)
        stages.append(Stage("train", status, detail, rel(layout.train_done)))

    # evaluation: the tags eval/summary.json lists, each tag's metrics and samples' meta;
    # the held-out set's (summary key heldout) apart; the selection (eval/selected.json)
    summary = read_json(layout.eval_summary)
    listed = summary.get("tags") if isinstance(summary, dict) else None
    tags = _eval_tags(layout)
    evals = _read_evals(layout, tags, listed, "", done, notes)
    held = summary.get("heldout") if isinstance(summary, dict) else None
    heldout = _read_evals(layout, _eval_tags(layout, heldout=True),
                          held.get("tags") if isinstance(held, dict) else None, " (heldout)",
                          done, notes)
    doc("selected", layout.eval_selected)
    eval_rel = rel(layout.eval_metrics("<tag>"))
    if evals:
        stages.append(Stage("evaluate", "done", "tags: " + ", ".join(e.tag for e in evals),
                            eval_rel))
    else:
        status, detail = _not_there(eval_rel, cfg, False)
        # generation recorded `not run` (e.g. backend vllm without vLLM): say so and why
        for tag in sorted(tags):
            meta_path = layout.eval_samples_meta(tag)
            meta = read_json(meta_path)
            if isinstance(meta, dict) and meta.get("status") == "not run":
                status = "not run"
                detail = f"{rel(meta_path)}: {meta.get('reason') or 'no reason given'}"
                break
        stages.append(Stage("evaluate", status, detail, eval_rel))
    return Found(cfg, layout, stages, docs, doc_paths, attempts, logs, metrics, source, notes,
                 evals, identity=identity, identity_notes=identity_notes, heldout=heldout,
                 first_attempt=first)


# ---- views of what was read: series, resume points, the per-problem matrix ----


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


def pick_key(keys: set[str], preferred: Iterable[str], pattern: str | None = None) -> str | None:
    for k in preferred:
        if k in keys:
            return k
    if pattern:
        cands = sorted(k for k in keys if re.fullmatch(pattern, k))
        return cands[0] if cands else None
    return None


def run_identity(layout: Layout, attempts: list[Attempt]
                 ) -> tuple[dict[str, Any] | None, list[str], int]:
    """The checkpoint directory's run identity (hy3rl.ckptdir), what the page says of it
    (each extension and each configuration change at its step; attempts of other
    trajectories; attempts a fresh start superseded), and the lineage's first attempt (the
    curves start there)."""
    from hy3rl.ckptdir import CheckpointDirError, read_identity

    try:
        doc = read_identity(layout.checkpoint_dir)
    except CheckpointDirError as exc:
        return None, [f"run identity unreadable: {exc}"], 1
    except OSError:
        doc = None
    if doc is None:
        return None, ([f"no run identity in {layout.checkpoint_dir} (checkpoints made before "
                       "identities, or none yet)"] if attempts else []), 1
    first = int(doc.get("first_attempt") or 1)
    notes = []
    for ev in doc.get("history") or []:
        step, act = ev.get("at_step"), ev.get("action")
        if act == "extend":
            notes.append(f"step {step}: extended to total_training_steps "
                         f"{ev.get('total_training_steps')} (attempt {ev.get('attempt')})")
        elif act in ("resume_changed", "restart_changed", "fresh"):
            what = "; ".join(f"{c['key']}: {json.dumps(c['old'])} -> {json.dumps(c['new'])}"
                             for c in ev.get("changes") or [])
            verb = {"resume_changed": "training continued under a changed configuration",
                    "restart_changed": "the configuration changed before any checkpoint",
                    "fresh": "a fresh start (older checkpoints moved aside)"}[act]
            notes.append(f"step {step}: {verb} (attempt {ev.get('attempt')}): {what}")
        elif act == "adopt":
            notes.append(f"step {step}: checkpoints without an identity adopted (attempt "
                         f"{ev.get('attempt')}): what made them cannot be verified")
    old = [a.attempt for a in attempts if a.attempt < first]
    if old:
        notes.append(f"attempts {', '.join(map(str, old))} trained checkpoints that a fresh "
                     "start moved aside: they are not in the curves")
    ids = {}
    for a in attempts:
        if a.attempt >= first and a.trajectory:
            ids.setdefault(a.trajectory, []).append(a.attempt)
    if len(ids) > 1:
        notes.append("attempts of different trajectories trained these checkpoints: " + "; ".join(
            f"{t}: attempts {', '.join(map(str, ks))}" for t, ks in ids.items())
            + " (the curves join them at the steps above)")
    return doc, notes, first


def resume_points(attempts: list[Attempt], logs: list[AttemptLog]) -> list[tuple[int, str]]:
    """(step, label) for every attempt that resumed: every attempt after the first, and the
    first too when it started from a checkpoint (start step > 0)."""
    points: list[tuple[int, str]] = []
    by_attempt = {log.attempt: log.first_step for log in logs if log.first_step is not None}
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


def runtime_changes(attempts: list[Attempt], logs: list[AttemptLog]
                    ) -> list[tuple[int, str, str, str]]:
    """(step, label, was, now) for every attempt whose runtime identity differs from the
    previous attempt's that recorded one: ``train.runtime`` is operational (a change is no
    new trajectory), so the curves mark where it changed. The step is the attempt's start
    step (else its log's first step); an attempt without either is left out."""
    out: list[tuple[int, str, str, str]] = []
    first_logged = {log.attempt: log.first_step for log in logs if log.first_step is not None}
    prev: str | None = None
    for a in sorted(attempts, key=lambda a: a.attempt):
        if a.runtime is None:
            continue
        step = a.start_step if a.start_step is not None else first_logged.get(a.attempt)
        if prev is not None and a.runtime != prev and step is not None:
            out.append((step, f"attempt {a.attempt}", prev, a.runtime))
        prev = a.runtime
    return out


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


def selection_view(found: Found) -> dict[str, Any]:
    """The checkpoint selection as the page shows it: the rule as the plan holds it
    (``selection``; a plan without that key: ``eval.select`` of the config, said so),
    whether it changed after training started (against ``selection`` of the lineage's first
    attempt record that has the key; None when none has; the candidate set is part of the
    rule, unless one of the two records predates it), and the selection:
    eval/selected.json, or mid-run (none yet) :func:`hy3rl.selection.so_far` over the
    held-out results that exist. ``configured`` False: no rule."""
    from hy3rl import selection

    plan = found.docs.get("plan")
    if isinstance(plan, dict) and "selection" in plan:
        rule, source = plan["selection"], found.doc_paths["plan"]
    else:
        rule = selection.as_rule(found.cfg.eval.select)
        source = (f"the config's eval.select: {found.doc_paths['plan']} holds no selection "
                  "(written before the rule existed, or missing)")
    first = next((a for a in found.attempts
                  if a.attempt >= found.first_attempt and "selection" in a.raw), None)
    changed = None
    before, after = (first.raw["selection"], rule) if first is not None else (None, None)
    if first is not None and any(isinstance(r, Mapping) and not isinstance(
            r.get("candidates"), Mapping) for r in (before, after)):
        # a record written before the candidate set was part of the rule (a sentence there):
        # what it did not fix cannot have changed
        before, after = ({k: v for k, v in r.items() if k != "candidates"}
                         if isinstance(r, Mapping) else r for r in (before, after))
    if first is not None and before != after:
        was, now = selection.describe(first.raw["selection"]), selection.describe(rule)
        if was == now:  # the same description: name the keys that differ
            old, new = before or {}, after or {}
            keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            was = ", ".join(f"{k} {json.dumps(old.get(k))}" for k in keys)
            now = ", ".join(f"{k} {json.dumps(new.get(k))}" for k in keys)
        changed = {"attempt": first.attempt, "was": was, "now": now,
                   "record": found.rel(found.layout.attempt_record(first.attempt))}
    view: dict[str, Any] = {"configured": rule is not None, "rule": rule,
                            "rule_text": selection.describe(rule), "rule_source": source,
                            "tie": selection.TIE_RULE, "changed": changed, "doc": None,
                            "label": "", "final": False, "note": ""}
    if rule is None:
        return view
    done = found.docs.get("selected")
    if isinstance(done, dict) and isinstance(done.get("selected"), Mapping):
        view.update(doc=done, final=True, label="Selection",
                    source=found.doc_paths["selected"])
        return view
    try:
        doc = selection.so_far(found.layout, found.cfg, rule)
    except (KeyError, TypeError, ValueError, StageError) as exc:
        view["note"] = f"the selection so far could not be computed: {exc}"
        return view
    view.update(doc=doc, label=doc["progress"]["label"],
                source=f"computed here from the files that exist (no "
                       f"{found.rel(found.layout.eval_selected)} yet)")
    return view
