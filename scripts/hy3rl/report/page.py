"""The report's tables (CSV), the resolved config (YAML) and the HTML page (jinja2 template
``hy3rl/templates/report.html.j2``), rendered from what :mod:`hy3rl.report.read` found and
the figures :mod:`hy3rl.report.figures` drew. Every string goes through the report's
:class:`~hy3rl.redact.Redactor`."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import platform
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from hy3rl import timefmt
from hy3rl.layout import REPORT_TABLES
from hy3rl.redact import Redactor
from hy3rl.report.figures import PUBLISHED
from hy3rl.report.read import (
    Found,
    all_keys,
    check_counts,
    find_key,
    per_problem_matrix,
    pick_key,
    rehearsal_view,
    resume_points,
    runtime_changes,
    selection_view,
    series,
)

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"

ATTEMPT_HEADER = ["attempt", "slurm_job_id", "nodes", "gpus_per_node", "start_step", "end_step",
                  "last_logged_step", "steps_lost", "outcome", "exit_reason", "failed_at_step",
                  "error", "started", "ended", "hours", "gpu_hours", "trajectory",
                  "total_training_steps", "runtime"]
EVAL_HEADER = ["tag", "step", "n", "problems", "grader", "avg@n", "bootstrap_95", "sampling_se",
               "pass@n", "maj@n", "pass@k", "maj@k", "grader_failures", "format_failure_rate",
               "format_failures", "truncation_rate", "mean_response_tokens"]
# The page's headline table (the CSV has every column, pass@k and maj@k for every k).
EVAL_HTML_HEADER = ["tag", "step", "n", "grader", "avg@n", "bootstrap_95", "sampling_se",
                    "pass@n", "maj@n", "grader_failures", "format_failure_rate",
                    "truncation_rate", "mean_response_tokens"]
PAIRED_HEADER = ["grader", "base_avg", "final_avg", "diff", "paired_interval", "source"]
SELECT_CAND_HEADER = ["tag", "step", "value", "interval", "n"]
SELECT_TEST_HEADER = ["role", "tag", "step", "grader", "avg@n", "bootstrap_95", "n"]
SELECT_PAIRED_HEADER = ["grader", "selected_avg", "final_avg", "diff", "paired_interval",
                        "excludes_0"]
SETTINGS_HEADER = ["tag", "step", "model", "backend", "preset", "temperature", "top_p", "n",
                   "max_tokens", "seed", "math_dapo", "math_verify"]


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


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


def _csv(header: list[str], rows: list[Mapping[str, Any]], redact: Redactor) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=header, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: redact.text(_fmt(r.get(k), 6) if r.get(k) is not None else "")
                    for k in header})
    return buf.getvalue().encode()


# ---- training: why there are no curves, claims, GPU-hours ----


@dataclass
class TrainingNotice:
    """Training did not run at all: why, and how to run it (the page shows this once,
    instead of figures of empty panels)."""

    why: str
    how: str
    command: str

    @property
    def text(self) -> str:
        return f"{self.why}\n{self.how}\n{self.command}"


def training_notice(found: Found) -> TrainingNotice | None:
    """None when anything of training exists (then the curves show what was logged)."""
    if found.training_ran:
        return None
    why = "Training did not run: " + found.stage("train").detail + "."
    if not found.cfg.trains:
        how = ("To train, give the workflow GPU nodes: in a config file of your own set "
               "cluster.gpu: true and describe the nodes (cluster.nodes, gpus_per_node, "
               "gpu_type, ...; config/paper.yaml holds the published run's values, "
               "README.md \"The paper configuration\"), then run:")
        command = ("snakemake --profile profiles/slurm --configfile config/config.yaml "
                   "config/paper.yaml site.yaml")
    else:
        how = (f"Training is a target of this run: run the workflow again (it resumes from the "
               f"newest checkpoint) and read {found.layout.log('train')} if it fails:")
        command = "snakemake --profile profiles/slurm --configfile <your config files>"
    return TrainingNotice(why, how, command)


def training_reason(found: Found) -> str:
    """Why there are no training metrics ('' when there are)."""
    if found.metrics:
        return ""
    train = found.stage("train")
    if train.status == "not run":
        return "training did not run: " + train.detail
    if found.attempts:
        return "training attempts exist but logged no metrics"
    return "no training metrics: " + train.detail


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


def failed_attempts(found: Found) -> list[dict[str, Any]]:
    """Per failed attempt (``Attempt.failed``): its outcome, exit reason and error, and the
    logs its record names, each with ``href`` relative to the page (the report folder)."""
    page_dir = os.path.abspath(found.layout.report_dir)
    run_dir = os.path.abspath(found.layout.results)
    return [{"attempt": a.attempt, "outcome": a.outcome, "exit_reason": a.exit_reason,
             "error": a.error,
             "logs": [{**asdict(link),
                       "href": os.path.relpath(os.path.join(run_dir, link.path), page_dir)}
                      for link in a.logs]}
            for a in found.attempts if a.failed]


def _threshold(section: Any) -> str:
    """A health rule's threshold band in words (its section's fields, hy3rl.settings)."""
    skip = {"action", "when", "metric", "metrics"}
    return ", ".join(f"{k} {v}" for k, v in asdict(section).items()
                     if k not in skip and v is not None) or "any non-finite value"


def health_view(found: Found) -> dict[str, Any]:
    """The health panel: ``train.health``'s rules each with its metric(s), action, threshold
    band, the logged steps it judged (hy3rl.health.Watcher.judged), the steps where it fired
    and where it went blind, over the lineage's merged metrics (the rules of this
    config, hy3rl.health.watch); the events; the last healthy checkpoint (the newest
    complete checkpoint in the checkpoint directory before every stop rule's first step);
    and the stops the launcher recorded (attempt records ``health_stop``)."""
    from hy3rl import ckptdir
    from hy3rl.health import Watcher, last_healthy, response_cap

    health = found.cfg.train.health
    plan = found.docs.get("plan")
    watcher = Watcher(health, response_cap(plan if isinstance(plan, dict) else None))
    for s in sorted(found.metrics):
        watcher.feed({"step": s, "data": found.metrics[s]})
    events = list(watcher.events)
    judged = watcher.judged()
    rules = []
    for name, section in health.rules():
        metrics = section.metrics if hasattr(section, "metrics") else [section.metric]
        fired = [e for e in events if e.rule == name and e.kind != "blind"]
        blind = [e for e in events if e.rule == name and e.kind == "blind"]
        rules.append({"rule": name, "action": section.action, "when": section.when,
                      "metrics": ", ".join(metrics),
                      "threshold": _threshold(section), "judged": judged.get(name, 0),
                      "fired": ", ".join(f"step {e.step}" for e in fired) or "never",
                      "blind": ", ".join(f"step {e.step} ({e.metric})" for e in blind)
                      or "never"})
    try:
        complete = [c.step for c in ckptdir.scan(found.layout.checkpoint_dir) if c.complete]
    except OSError:
        complete = []
    best = last_healthy(complete, events)
    stopped = any(e.action == "stop" for e in events)
    if best is None:
        healthy = "none" + (" (no complete checkpoint before the first stop rule's steps)"
                            if stopped and complete else " (no complete checkpoint)")
    else:
        healthy = f"step {best}" + ("" if stopped else " (no stop rule fired: the newest)")
    recorded = [{"attempt": a.attempt, "message": a.raw["health_stop"].get("message")}
                for a in found.attempts if a.attempt >= found.first_attempt
                and isinstance(a.raw.get("health_stop"), Mapping)]
    return {"rules": rules, "events": [asdict(e) for e in events], "last_healthy": healthy,
            "last_healthy_step": best, "stops": recorded, "steps": len(found.metrics)}


def wandb_runs(found: Found) -> list[dict[str, Any]]:
    """The W&B runs the attempt records name (``wandb``; one for a whole training run), in
    order: run id, project, the attempts that logged there, and the run page's URL when an
    attempt's output printed one (an http(s) URL only; offline runs have none)."""
    runs: dict[str, dict[str, Any]] = {}
    for a in found.attempts:
        if not a.wandb:
            continue
        run = runs.setdefault(str(a.wandb["run_id"]), {
            "run_id": str(a.wandb["run_id"]), "project": None, "url": None, "attempts": []})
        run["attempts"].append(a.attempt)
        run["project"] = a.wandb.get("project") or run["project"]
        url = a.wandb.get("url")
        if isinstance(url, str) and url.startswith(("https://", "http://")):
            run["url"] = url
    return list(runs.values())


def running_now(found: Found) -> list[str]:
    """What the records say is still running: training attempts whose record is open
    (``outcome`` and ``exit_reason`` ``running``, as hy3rl.train opens it; a job killed
    without closing it reads the same until the next job closes it as ``killed``)."""
    out = []
    for a in found.attempts:
        if a.outcome in (None, "running") and a.exit_reason == "running":
            out.append(f"training attempt {a.attempt} (job {a.slurm_job_id or 'local'}, "
                       f"started {a.started or 'n/a'}) is running: its record is open; the "
                       f"curves hold the steps logged so far")
    return out


def time_profile(found: Found) -> dict[str, Any] | None:
    """Where the training job's time went and what the supervisor expects of each phase:
    sums of verl's ``timing_s/step`` (the save included), ``timing_s/save_checkpoint`` and
    ``timing_s/testing`` (its own validation, TEST_FREQ, on the training GPUs) over the
    merged metrics, and the newest attempt record's time model (``timing.model``,
    hy3rl.watchdog). None when there is neither."""
    sums = {"step": 0.0, "save": 0.0, "testing": 0.0}
    keys = {"step": "timing_s/step", "save": "timing_s/save_checkpoint",
            "testing": "timing_s/testing"}
    for data in found.metrics.values():
        for name, key in keys.items():
            value = data.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                sums[name] += float(value)
    timing = next((a.raw.get("timing") for a in reversed(found.attempts)
                   if isinstance(a.raw.get("timing"), Mapping)), None)
    model = timing.get("model") if timing else None
    if not sums["step"] and not isinstance(model, Mapping):
        return None
    total = sums["step"] + sums["testing"]
    phases = []
    for name, est in (model or {}).items() if isinstance(model, Mapping) else []:
        if isinstance(est, Mapping) and isinstance(est.get("s"), int | float):
            phases.append({"phase": name, "minutes": est["s"] / 60,
                           "basis": (f"learned from {est.get('samples')} record(s)"
                                     if est.get("learned") else "allowance (not seen yet)")})
    return {"hours": total / 3600, "save_hours": sums["save"] / 3600,
            "testing_hours": sums["testing"] / 3600,
            "testing_share": sums["testing"] / total if total else None,
            "phases": phases}


def gpu_hours_summary(found: Found) -> dict[str, Any]:
    used = [a.gpu_hours for a in found.attempts if a.gpu_hours is not None]
    plan = found.docs.get("plan")
    return {
        "used": sum(used) if used else None,
        "used_note": (f"sum over {len(used)} of {len(found.attempts)} attempt(s): "
                      "wall hours x nodes x GPUs per node") if found.attempts else
                     "no training attempts",
        "plan": find_key(plan, r"gpu_hours") if plan is not None else [],
    }


# ---- evaluation tables ----


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
            "source": f"{found.rel(found.layout.eval_metrics(final.tag))} vs_base "
                      "(paired problem bootstrap, 95%)",
        })
    return rows


def selection_tables(found: Found, view: Mapping[str, Any]) -> dict[str, Any]:
    """The selection section's tables from :func:`~hy3rl.report.read.selection_view`: the
    candidates (held-out value and interval; base for reference), the test set's rows of
    base, selected and final per grader, and the paired selected - final comparison."""
    doc = view.get("doc") or {}
    cands = [{"tag": c["tag"], "step": c.get("step"), "value": c.get("value"),
              "interval": _fmt_iv(c.get("interval")), "n": c.get("n")}
             for c in doc.get("candidates") or []]
    hb = doc.get("heldout_base")
    if hb and hb.get("value") is not None:
        cands.append({"tag": "base (reference, never a candidate)", "step": None,
                      "value": hb["value"], "interval": _fmt_iv(hb.get("interval")),
                      "n": hb.get("n")})
    test = (doc.get("test") or {}).get("rows") or []
    graders = sorted({k.removesuffix("_avg") for r in test for k in r if k.endswith("_avg")})
    test_rows = [{"role": r["role"], "tag": r.get("tag"), "step": r.get("step"), "grader": g,
                  "avg@n": r.get(f"{g}_avg"), "bootstrap_95": _fmt_iv(r.get(f"{g}_ci")),
                  "n": r.get("n")} for r in test for g in graders]
    by_role = {r["role"]: r for r in test}
    paired = []
    for g, d in (doc.get("selected_vs_final") or {}).items():
        ci = d.get("paired_bootstrap_ci") or {}
        paired.append({
            "grader": g, "selected_avg": by_role.get("selected", {}).get(f"{g}_avg"),
            "final_avg": by_role.get("final", {}).get(f"{g}_avg"), "diff": d.get("mean_diff"),
            "paired_interval": _fmt_iv([ci["low"], ci["high"]]) if "low" in ci else "",
            "excludes_0": "yes" if ci and (ci["low"] > 0 or ci["high"] < 0) else "no"})
    show_curves = (any(e.tag != "base" and e.step is not None for e in found.evals)
                   or any(c["value"] is not None for c in cands)
                   or any(not e.tag.endswith("/base") for e in found.heldout))
    return {"candidates": cands, "test": test_rows, "paired": paired,
            "selected": doc.get("selected"), "verdict": doc.get("verdict"),
            "key": (doc.get("rule") or view.get("rule") or {}).get("key"),
            "test_missing": (doc.get("test") or {}).get("missing") or [],
            "show_curves": show_curves}


# ---- provenance ----


def env_versions(packages: Iterable[str]) -> list[tuple[str, str]]:
    out = [("python", platform.python_version()), ("platform", platform.platform())]
    for p in packages:
        try:
            out.append((p, metadata.version(p)))
        except metadata.PackageNotFoundError:
            out.append((p, "not installed here"))
    return out


def deps_rows(found: Found) -> list[dict[str, Any]]:
    """Dependency pins: from deps/lock.json (docs/formats/deps.md), else from the config."""
    lock = found.docs.get("lock")
    rows: list[dict[str, Any]] = []
    repos = lock.get("repos") if isinstance(lock, dict) else None
    if isinstance(repos, Mapping):
        for name, r in repos.items():
            if not isinstance(r, Mapping):
                continue
            ok = r.get("head") == r.get("commit") and r.get("head") is not None
            check = "verified = pin" if ok else f"NOT the pin {r.get('commit')}"
            rows.append({"section": f"dependency ({found.doc_paths['lock']})", "name": str(name),
                         "value": f"{r.get('head')} ({check}) {r.get('url')}"})
            for sub in r.get("submodules") or []:
                if isinstance(sub, Mapping):
                    rows.append({"section": "dependency submodule (not fetched)",
                                 "name": f"{name}/{sub.get('path')}", "value": sub.get("commit")})
        for w in (lock.get("warnings") or []):
            rows.append({"section": "dependency warning", "name": "deps", "value": w})
        return rows
    for name, repo in found.cfg.deps.repos.items():
        rows.append({"section": f"dependency (config pin; {found.doc_paths['lock']} missing)",
                     "name": name, "value": f"{repo.commit} {repo.url}"})
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


RAY_MATCH = {True: "equal", False: "DIFFERENT: submission refused", None: "not compared"}


def runtime_rows(found: Found) -> list[dict[str, Any]]:
    """The training runtime as the newest attempt record names it (``runtime``:
    ``train.runtime``, its identity by hy3rl.runtime_id, the job client's and the cluster's
    Ray; docs/formats/train.md)."""
    if not found.attempts:
        return []
    a = found.attempts[-1]
    sec = f"training runtime ({found.rel(found.layout.attempt_record(a.attempt))})"
    rt = a.raw.get("runtime")
    if not isinstance(rt, Mapping) or not rt:
        return [{"section": sec, "name": "runtime", "value": "not recorded"}]
    rows = [("prefix", rt.get("prefix") or "(none: the workflow env)"),
            ("python", rt.get("python"))]
    ident = rt.get("identity")
    if isinstance(ident, Mapping):
        kind = ident.get("kind")
        rows.append((f"identity ({kind})", ident.get("id")))
        if kind == "image" and not ident.get("pinned"):
            rows.append(("identity note", ident.get("note")))
        if kind == "unknown":
            rows.append(("identity reason", ident.get("reason")))
        if kind == "interpreter":
            freeze = ident.get("freeze") or []
            rows += [("freeze_sha256", ident.get("freeze_sha256")),
                     (f"freeze ({ident.get('freeze_method')})", "; ".join(map(str, freeze)))]
    else:
        rows.append(("identity", "not recorded"))
    ray = rt.get("ray")
    if isinstance(ray, Mapping):
        rows.append(("ray (job client / cluster)", f"{ray.get('client')} / {ray.get('cluster')} "
                     f"({RAY_MATCH.get(ray.get('match'), ray.get('match'))})"))
    else:
        rows.append(("ray (job client / cluster)", "not recorded (no Ray head ran)"))
    return [{"section": sec, "name": n, "value": v} for n, v in rows]


def local_diffs(found: Found) -> dict[str, str]:
    """The local changes each pinned clone ran with (plan.json ``pins``: only under
    ``deps.allow_local_changes``, which counts them in the run identity): name -> diff."""
    plan = found.docs.get("plan")
    pins = plan.get("pins") if isinstance(plan, dict) else None
    return {name: str(pin["diff"]) for name, pin in sorted((pins or {}).items())
            if isinstance(pin, Mapping) and pin.get("diff")}


def provenance_rows(found: Found, env: Mapping[str, str]) -> list[dict[str, Any]]:
    opts = found.cfg.report
    rows = deps_rows(found)
    rows.append({"section": "config", "name": "config_hash (sha256)", "value": found.cfg.hash})
    rows += data_rows(found.docs.get("data_summary"))
    model = found.docs.get("model_manifest")
    if model is not None:  # hy3rl.hub.provenance: source, revision, manifest sha256, size
        rows += [{"section": f"model ({found.doc_paths['model_manifest']})", "name": k,
                  "value": v} for k, v in model["provenance"].items()]
    for name in ("checkpoint_check", "bridge_check"):
        d = found.docs.get(name)
        if d is not None:
            _, _, checks = check_counts(d)
            for c in checks:
                status, details = str(c.get("status")), str(c.get("details", ""))
                value = details if details.startswith(status) else f"{status}: {details}"
                rows.append({"section": found.doc_paths[name], "name": c.get("name"),
                             "value": value})
    plan = found.docs.get("plan")
    if isinstance(plan, dict) and isinstance(plan.get("launch"), Mapping):
        rows.append({"section": "preflight", "name": "launch.sh sha256",
                     "value": plan["launch"].get("sha256")})
    for name in local_diffs(found):
        rows.append({"section": "deps (local changes, deps.allow_local_changes)",
                     "name": f"{name} diff sha256 (pin.{name})",
                     "value": plan["pins"][name].get("diff_sha256")})
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
    rows += runtime_rows(found)
    for a in found.attempts:
        rows.append({"section": "slurm", "name": f"attempt {a.attempt}",
                     "value": f"job {a.slurm_job_id}; nodes {','.join(a.nodes) or a.num_nodes}"})
    for name, ver in env_versions(opts.packages):
        rows.append({"section": "environment (report host)", "name": name, "value": ver})
    pre = tuple(opts.env_prefixes)
    for name in sorted(env):
        if name.startswith(pre):
            rows.append({"section": "environment variable", "name": name, "value": env[name]})
    return rows


# ---- every table, the resolved config and the page ----


def releases_link(found: Found) -> dict[str, Any] | None:
    """The releases' page (report/releases.html, rule release_page) as the report links it:
    the tags, and whether the page existed when the report was written (the report runs
    beside the releases, not after them); None without releases."""
    from hy3rl.release import ReleaseError, release_tags

    try:
        tags = release_tags(found.cfg)
    except ReleaseError as exc:
        return {"tags": [], "why": str(exc), "href": "", "exists": False}
    if not tags:
        return None
    page = Path(found.layout.releases_page)
    return {"tags": tags, "why": "", "href": page.name, "exists": page.is_file(),
            "records": [found.layout.release_record(t) for t in tags]}


def render(found: Found, redact: Redactor, env: Mapping[str, str], figs: Mapping[str, bytes],
           panel_keys: list[str], selection: Mapping[str, Any] | None = None
           ) -> dict[str, bytes]:
    """The CSV tables, ``config.resolved.yaml`` and ``index.html``: {file name: bytes}.
    ``selection``: :func:`~hy3rl.report.read.selection_view` (computed when None)."""
    opts = found.cfg.report
    selection = selection_view(found) if selection is None else selection
    notice = training_notice(found)
    eval_reason = found.stage("evaluate").detail
    stage_rows = [asdict(s) for s in found.stages]
    att_rows = [{**asdict(a), "nodes": ",".join(a.nodes) or a.num_nodes} for a in found.attempts]
    claim_rows = claims(found, opts.drift_threshold)
    ev_rows = eval_rows(found)
    problems, tags, mat, grader = per_problem_matrix(found)
    pp_rows = [{"problem": p, **{t: (None if np.isnan(mat[i, j]) else float(mat[i, j]))
                                 for j, t in enumerate(tags)}} for i, p in enumerate(problems)]
    paired = paired_rows(found)
    at_k_header, at_k_rows = at_k_table(found)
    prov = provenance_rows(found, env)
    files = {
        "stages.csv": _csv(["stage", "status", "detail", "path"], stage_rows, redact),
        "attempts.csv": _csv(ATTEMPT_HEADER, att_rows, redact),
        "claims.csv": _csv(["claim", "published", "this_run", "verdict"], claim_rows, redact),
        "eval_headline.csv": _csv(EVAL_HEADER, ev_rows, redact),
        "eval_per_problem.csv": _csv(["problem", *tags], pp_rows, redact),
        "eval_paired.csv": _csv(PAIRED_HEADER, paired, redact),
        "provenance.csv": _csv(["section", "name", "value"], prov, redact),
    }
    cfg_yaml = redact.text(yaml.safe_dump(redact(found.cfg.raw), sort_keys=False))
    files["config.resolved.yaml"] = cfg_yaml.encode()

    jenv = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True,
                       undefined=StrictUndefined, finalize=redact.text,
                       trim_blocks=True, lstrip_blocks=True)
    jenv.filters["fmt"] = _fmt
    jenv.filters["pretty"] = lambda o: json.dumps(redact(o), indent=2, sort_keys=True, default=str)
    html = jenv.get_template("report.html.j2").render(
        run=found.cfg.run.name,
        generated=timefmt.utc_now(),
        results=found.layout.results,
        stages=stage_rows,
        gpu=gpu_hours_summary(found),
        attempts=att_rows,
        att_header=ATTEMPT_HEADER,
        failed=failed_attempts(found),
        health=health_view(found),
        wandb=wandb_runs(found),
        identity_notes=found.identity_notes,
        local_diffs=local_diffs(found),
        trajectory=((found.identity or {}).get("trajectory") or {}).get("id"),
        resume=resume_points(found.attempts, found.logs),
        runtime_changes=runtime_changes(found.attempts, found.logs),
        time=time_profile(found),
        running=running_now(found),
        notes=found.notes,
        notice=notice,
        training_reason="" if notice else training_reason(found),
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
        paired_header=PAIRED_HEADER,
        settings=settings_rows(found),
        settings_header=SETTINGS_HEADER,
        at_k_header=at_k_header,
        at_k=at_k_rows,
        rehearsal=rehearsal_view(found),
        selection=selection,
        releases=releases_link(found),
        sel=selection_tables(found, selection),
        sel_cand_header=SELECT_CAND_HEADER,
        sel_test_header=SELECT_TEST_HEADER,
        sel_paired_header=SELECT_PAIRED_HEADER,
        prov=prov,
        config_yaml=cfg_yaml,
        config_hash=found.cfg.hash,
        docs={k: redact(v) for k, v in found.docs.items() if v is not None},
        attempts_raw=[redact(a.raw) for a in found.attempts],
        img={k: base64.b64encode(v).decode() for k, v in figs.items()},
        tables=REPORT_TABLES,
    )
    files["index.html"] = redact.text(html).encode()
    return files
