"""The report's figures (matplotlib, Agg), each rendered to PNG bytes. Every figure always
exists (they are declared outputs); without data it says why in its own image, and when
training did not run at all the training figures are one small notice (:func:`fig_notice`).
Every string drawn goes through the report's :class:`~hy3rl.redact.Redactor`."""

from __future__ import annotations

import io
import textwrap
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hy3rl.redact import Redactor  # noqa: E402
from hy3rl.report.read import (  # noqa: E402
    Found,
    all_keys,
    per_problem_matrix,
    pick_key,
    resume_points,
    runtime_changes,
    series,
)

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


def _png(fig: Any, redact: Redactor, dpi: int, **savefig: Any) -> bytes:
    buf = io.BytesIO()
    meta = {"Software": f"matplotlib {matplotlib.__version__}", "Title": None}
    fig.savefig(buf, format="png", dpi=dpi, metadata=redact(meta), **savefig)
    plt.close(fig)
    return buf.getvalue()


def _mark_attempts(ax: Any, found: Found, redact: Redactor, label: bool) -> None:
    """The resume points (red dotted) and the runtime changes (purple dashed, labelled with
    the new runtime: hy3rl.report.read.runtime_changes) on a training curve."""
    for i, (step, text) in enumerate(resume_points(found.attempts, found.logs)):
        ax.axvline(step, color="tab:red", ls=":", lw=1.2,
                   label=redact.text(f"resume: {text} @ {step}") if label and i < 4 else None)
    for i, (step, text, _, now) in enumerate(runtime_changes(found.attempts, found.logs)):
        short = now if len(now) <= 48 else f"{now[:22]}...{now[-22:]}"
        ax.axvline(step, color="tab:purple", ls="--", lw=1.4,
                   label=redact.text(f"runtime change: {text} @ {step}: {short}")
                   if label and i < 3 else None)


def _empty(ax: Any, text: str) -> None:
    wrapped = "\n".join(textwrap.fill(line, 42) for line in text.split("\n"))
    ax.text(0.5, 0.5, wrapped, ha="center", va="center", transform=ax.transAxes, fontsize=8,
            color="0.3", bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "0.8"})


def fig_notice(title: str, text: str, redact: Redactor, dpi: int) -> bytes:
    """One small figure holding a notice (training did not run: why, and how to run it),
    in place of a figure of empty panels."""
    body = "\n".join(textwrap.fill(line, 90) for line in text.split("\n"))
    fig = plt.figure(figsize=(8, 1.2 + 0.2 * body.count("\n")))
    fig.text(0.03, 0.9, redact.text(title), ha="left", va="top", fontsize=11,
             fontweight="bold")
    fig.text(0.03, 0.9 - 0.45 / fig.get_figheight(), redact.text(body), ha="left", va="top",
             fontsize=8.5, color="0.2")
    return _png(fig, redact, dpi, bbox_inches="tight", pad_inches=0.25)


def fig_published(found: Found, redact: Redactor, dpi: int, reference: bool,
                  threshold: float, reason: str) -> tuple[bytes, list[str]]:
    """The six panels of the published figure; also the metric key each panel used."""
    m = found.metrics
    keys = all_keys(m)
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
        _mark_attempts(ax, found, redact, label=True)
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
            # verl v1 measures it against the longest response of the batch (the padded
            # width), not the configured maximum: it is no truncation rate (evaluation's
            # finish_reason gives that).
            ax2.plot(x, y, color="tab:gray", lw=1, ls="-.",
                     label="share at batch max length (right)")
            ax2.set_ylabel("share of responses at the batch's longest length")
            ax2.legend(fontsize=7, loc="lower right")
        if not got:
            why = reason if not m else "not logged: " + ", ".join(wanted)
            _empty(ax, redact.text(f"no data\n{why}"))
        _mark_attempts(ax, found, redact, label=bool(got))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    return _png(fig, redact, dpi)


def fig_step_time(found: Found, redact: Redactor, dpi: int, reason: str) -> bytes:
    m = found.metrics
    keys = sorted(k for k in all_keys(m) if k.startswith("timing_s/") and k != "timing_s/step")
    fig, ax = plt.subplots(figsize=(12, 4.5), layout="constrained")
    steps = sorted(s for s, d in m.items() if any(k in d for k in keys))
    if keys and steps:
        stack = np.array([[float(m[s].get(k) or 0.0) for s in steps] for k in keys])
        ax.stackplot(steps, stack, labels=[k.removeprefix("timing_s/") for k in keys], alpha=0.8)
        x, y = series(m, "timing_s/step")
        if len(x):
            ax.plot(x, y, color="black", lw=1.2, label="step (total)")
        _mark_attempts(ax, found, redact, label=True)
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


def _curve(ax: Any, points: list[tuple[float, float, list[float] | None]], label: str,
           color: str) -> None:
    """One series with its intervals as error bars (points: step, value, [low, high])."""
    pts = sorted(points)
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts], dtype=float)
    lo = np.array([p[1] - p[2][0] if p[2] else 0.0 for p in pts])
    hi = np.array([p[2][1] - p[1] if p[2] else 0.0 for p in pts])
    ax.errorbar(x, y, yerr=np.vstack([np.maximum(lo, 0), np.maximum(hi, 0)]), fmt="o-",
                color=color, lw=1.3, capsize=3, label=label)


def fig_eval_curves(found: Found, view: dict[str, Any], redact: Redactor, dpi: int,
                    reason: str) -> bytes:
    """Accuracy against the training step: the test set's avg@n (primary grader) and the
    held-out set's selection metric (the rule's; without a rule its avg@n), each with its
    problem-bootstrap interval, base as a horizontal line, the selected step marked."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    doc = view.get("doc") or {}
    chosen = doc.get("selected") or {}
    sel_step = chosen.get("step")

    def finish(ax: Any, title: str, base: float | None, base_iv: list[float] | None,
               has: bool, empty: str) -> None:
        if base is not None:
            ax.axhline(base, color="0.35", ls="--", lw=1.2, label=f"base {base:.3g}")
            if base_iv:
                ax.axhspan(*base_iv, color="0.5", alpha=0.12)
        if sel_step is not None and has:
            ax.axvline(sel_step, color="tab:green", lw=2, alpha=0.5, ls=":", zorder=0,
                       label=redact.text(f"selected: {chosen.get('tag')} (step {sel_step})"))
        if not has:
            _empty(ax, redact.text(empty))
        ax.set_title(redact.text(title), fontsize=10)
        if has:
            ax.set_xlim(left=0, right=ax.get_xlim()[1])
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")

    # the test set
    ax = axes[0]
    grader = next((e.primary_grader for e in found.evals if e.primary_grader), "math_dapo")
    pts, base, base_iv = [], None, None
    for e in found.evals:
        g = next((g for g in e.graders if g.grader == grader), None)
        if g is None or g.avg is None:
            continue
        if e.tag == "base":
            base, base_iv = g.avg, g.bootstrap_ci
        elif e.step is not None:
            pts.append((float(e.step), g.avg, g.bootstrap_ci))
    if pts:
        _curve(ax, pts, f"{grader} avg@n", "tab:blue")
    ax.set_ylabel("accuracy (avg@n)")
    finish(ax, f"AIME-2024 (test set): {grader} avg@n", base, base_iv, bool(pts),
           f"no checkpoint evaluated on the test set\n{reason or 'no step or final tag yet'}")

    # the held-out set
    ax = axes[1]
    rule = view.get("rule")
    pts, base, base_iv = [], None, None
    if doc.get("candidates") is not None:
        key = (doc.get("rule") or {}).get("key") or (rule or {}).get("key", "")
        title = f"held-out set {(rule or {}).get('set')}: {key} (the selection metric)"
        for c in doc["candidates"]:
            if c.get("value") is not None and c.get("step") is not None:
                pts.append((float(c["step"]), c["value"], c.get("interval")))
        hb = doc.get("heldout_base") or {}
        base, base_iv = hb.get("value"), hb.get("interval")
        label = key
    else:
        hgrader = next((e.primary_grader for e in found.heldout if e.primary_grader),
                       "math_dapo")
        title = f"held-out set: {hgrader} avg@n (no selection rule configured)"
        for e in found.heldout:
            g = next((g for g in e.graders if g.grader == hgrader), None)
            if g is None or g.avg is None:
                continue
            if e.tag.endswith("/base"):
                base, base_iv = g.avg, g.bootstrap_ci
            elif e.step is not None:
                pts.append((float(e.step), g.avg, g.bootstrap_ci))
        label = f"{hgrader} avg@n"
    if pts:
        _curve(ax, pts, label, "tab:purple")
    ax.set_ylabel("held-out value")
    none = ("no held-out set configured (data.heldout)" if found.cfg.data.heldout is None
            else "no checkpoint evaluated on the held-out set yet")
    finish(ax, title, base, base_iv, bool(pts), none)
    fig.suptitle("Accuracy across training steps (bars: problem bootstrap 95% interval; "
                 "dashed: base)", fontsize=11)
    return _png(fig, redact, dpi)
