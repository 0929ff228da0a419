"""Checkpoint selection (``eval.select``): the rule, fixed before training, that picks the
checkpoint to report on the held-out set (``data.heldout``), never on the test set
(AIME-2024, ``data.val``), and what the pick scores on the test set against ``final``.

The rule: among the checkpoint tags (``step<N>`` of ``eval.steps``, and ``final``; a
``final`` at the step of a ``step<N>`` tag is one candidate, the step tag; this candidate
set is part of the rule, :func:`candidate_set`), the one whose
held-out ``metric`` of ``grader`` is highest (``avg`` = avg@n, ``pass`` = pass@k, ``maj`` =
maj@k of ``eval/heldout/<tag>/metrics.json``). **A tie goes to the earliest step**: of
checkpoints the held-out set cannot tell apart, the one that took fewer training steps
(less compute, less drift from the base model) is the simpler claim, and a tie rule fixed
before any result is seen leaves no room to pick among the tied ones after looking at the
test set. Values equal within float rounding (relative 1e-9) are a tie.

Then, on the test set, the rows of ``base``, the selected tag and ``final`` (avg@n with the
problem bootstrap interval, per grader) and the paired comparison selected - final per
grader (the paired problem bootstrap of :func:`hy3rl.metrics.paired_difference`, as
``vs_base``); the two differ beyond the intervals when the interval of the rule's grader
excludes 0.

Entry points: :func:`run` (``eval/selected.json``, docs/formats/eval.md "selected.json")
and :func:`so_far` (the same over the files that exist mid-run: the report and retention).
:func:`select` and :func:`metric_value` are pure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_json_atomic
from hy3rl.errors import StageError
from hy3rl.layout import Layout, heldout_tag, split_tag
from hy3rl.metrics import (
    GRADERS,
    MetricsError,
    bootstrap_ci,
    paired_difference,
    pass_at_k,
    summarize,
)
from hy3rl.settings import Bootstrap, Config, Select
from hy3rl.verl_log import finite_number

TIE_RULE = "earliest step"
TIE_REL_TOL = 1e-9  # values this close are equal (the same accuracy summed in another order)
_STEP_TAG = re.compile(r"^step(\d+)$")


class SelectionError(StageError):
    """An unreadable or inconsistent input (the message names the file and key)."""


# ---- the rule ----


def as_rule(select: Select | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The rule as a dict (``set``, ``grader``, ``metric``, ``k``, ...): ``eval.select``
    (a :class:`~hy3rl.settings.Select`) or the plan's ``selection`` as they are."""
    if select is None:
        return None
    if dataclasses.is_dataclass(select):
        return dataclasses.asdict(select)  # type: ignore[arg-type]
    return dict(select)


def resolve_k(rule: Mapping[str, Any], n: int | None) -> int | None:
    """The rule's k: as written, or n (every sample) when null."""
    return rule.get("k") if rule.get("k") is not None else n


def rule_key(rule: Mapping[str, Any], n: int | None = None) -> str:
    """The display name of the rule's metric: ``math_dapo avg@32``, ``math_dapo pass@4``."""
    k = resolve_k(rule, n)
    return f"{rule['grader']} {rule.get('metric', 'avg')}@{k if k is not None else 'n'}"


def resolved(rule: Mapping[str, Any], n: int | None) -> dict[str, Any]:
    """The rule with ``k`` resolved against n and its ``key`` and ``tie`` spelled out (the
    form preflight/plan.json and selected.json hold)."""
    return {**rule, "k": resolve_k(rule, n), "key": rule_key(rule, n), "tie": TIE_RULE}


def describe_candidates(candidates: Any) -> str | None:
    """The rule's candidate set (``{"steps": [...], "final": bool}``, :func:`candidate_set`)
    in words: ``step20, step40 and final``; None for a record without one (a plan written
    before the candidate set was part of the rule held a sentence there)."""
    if not isinstance(candidates, Mapping):
        return None
    tags = [f"step{s}" for s in candidates.get("steps") or []] + (
        ["final"] if candidates.get("final") else [])
    if not tags:
        return "no checkpoint"
    return tags[0] if len(tags) == 1 else f"{', '.join(tags[:-1])} and {tags[-1]}"


def describe(rule: Mapping[str, Any] | None) -> str:
    """One line naming a rule (the report's "was X, now Y"): the metric, the held-out set
    and the candidates."""
    if rule is None:
        return "no selection rule"
    text = f"highest {rule.get('key') or rule_key(rule)} on held-out set {rule.get('set')}"
    if rule.get("set_sha256"):
        text += f" (sha256 {str(rule['set_sha256'])[:12]})"
    cands = describe_candidates(rule.get("candidates"))
    if cands is not None:
        text += f" among {cands}"
    return text


# ---- one metrics.json document ----


def metric_value(metrics: Mapping[str, Any], rule: Mapping[str, Any]) -> float | None:
    """The rule's metric in a metrics.json document: ``avg`` -> ``by_grader[g]["avg@n"]``;
    ``pass``/``maj`` -> ``by_grader[g]["pass@k"|"maj@k"][str(k)]`` (k null: n). None when
    absent."""
    bg = (metrics.get("by_grader") or {}).get(rule["grader"])
    if not isinstance(bg, Mapping):
        return None
    metric = rule.get("metric", "avg")
    if metric == "avg":
        return finite_number(bg.get("avg@n"))
    k = resolve_k(rule, metrics.get("n"))
    table = bg.get(f"{metric}@k")
    if not isinstance(table, Mapping) or k is None:
        return None
    return finite_number(table.get(str(k)))


def problem_values(metrics: Mapping[str, Any], rule: Mapping[str, Any]) -> list[float] | None:
    """The rule's metric per problem, from ``per_problem``: avg -> ``acc``; pass@k -> the
    unbiased estimator from ``correct`` and ``n``; maj@n -> ``maj``. None when the document
    does not hold it (maj@k for k < n needs the answers)."""
    g, metric = rule["grader"], rule.get("metric", "avg")
    n = metrics.get("n")
    k = resolve_k(rule, n)
    out = []
    for row in metrics.get("per_problem") or []:
        cell = row.get(g) if isinstance(row, Mapping) else None
        if not isinstance(cell, Mapping):
            return None
        if metric == "avg":
            v = finite_number(cell.get("acc"))
        elif metric == "pass" and isinstance(n, int) and isinstance(k, int) and 1 <= k <= n \
                and isinstance(cell.get("correct"), int):
            v = pass_at_k(n, cell["correct"], k)
        elif metric == "maj" and k == n:
            v = finite_number(cell.get("maj"))
        else:
            v = None
        if v is None:
            return None
        out.append(v)
    return out or None


def metric_interval(metrics: Mapping[str, Any], rule: Mapping[str, Any],
                    boot: Mapping[str, Any]) -> list[float] | None:
    """The problem bootstrap interval of the rule's metric: avg -> the document's own
    ``bootstrap_ci``; pass@k, maj@n -> :func:`~hy3rl.metrics.bootstrap_ci` of
    :func:`problem_values` with ``boot``; None when neither exists."""
    if rule.get("metric", "avg") == "avg":
        ci = ((metrics.get("by_grader") or {}).get(rule["grader"]) or {}).get("bootstrap_ci")
        if isinstance(ci, Mapping) and finite_number(ci.get("low")) is not None \
                and finite_number(ci.get("high")) is not None:
            return [float(ci["low"]), float(ci["high"])]
    values = problem_values(metrics, rule)
    if not values:
        return None
    ci = bootstrap_ci(values, boot["resamples"], boot["level"], boot["seed"])
    return [ci["low"], ci["high"]]


# ---- the selection (pure) ----


def _step_order(c: Mapping[str, Any]) -> float:
    """Earliest step first; an unknown step (a final whose step is not recorded) last."""
    return float("inf") if c.get("step") is None else float(c["step"])


def select(candidates: list[dict[str, Any]], rule: Mapping[str, Any] | None = None,
           stop_at: int | None = None) -> dict[str, Any]:
    """The selected candidate of ``candidates`` (``{"tag", "step", "value"}``; value None:
    no held-out result). Highest value wins; a tie (equal within :data:`TIE_REL_TOL`)
    goes to the earliest step (module docstring: why). ``stop_at``: the first checkpoint a
    ``stop`` rule that fired in the lineage calls sick (:func:`hy3rl.train.health_stop_at`):
    a checkpoint at or past it (or of an unknown step) is unhealthy and never selected.
    Returns ``{"tag", "step", "value", "ties", "missing", "considered", "unhealthy",
    "reason"}``: ``ties`` the other candidates with the winner's value (passed over by the
    tie rule), ``missing`` the tags without a value,
    ``considered`` how many had one, ``unhealthy`` the tags passed over for ``stop_at``;
    ``tag`` None (and ``reason``) when none had."""
    missing = [c["tag"] for c in candidates if c.get("value") is None]
    have = sorted((c for c in candidates if c.get("value") is not None), key=_step_order)
    past = [] if stop_at is None else [c["tag"] for c in have
                                        if c.get("step") is None or c["step"] >= stop_at]
    have = [c for c in have if c["tag"] not in past]
    unhealthy = (f"; passed over, unhealthy by a stop rule that fired (from checkpoint "
                 f"{stop_at}): {', '.join(past)}") if past else ""
    if not have:
        what = f"a held-out {rule_key(rule)}" if rule else "a held-out value"
        why = (f"no candidate has {what} (missing: {', '.join(missing)})" if missing
               else "no checkpoint tag to select from (no eval.steps, no final)")
        return {"tag": None, "step": None, "value": None, "ties": [], "missing": missing,
                "considered": 0, "unhealthy": past, "reason": why + unhealthy}
    best = max(c["value"] for c in have)
    tied = [c for c in have
            if math.isclose(c["value"], best, rel_tol=TIE_REL_TOL, abs_tol=1e-12)]
    win = tied[0]  # have is in step order: the earliest of the tied
    reason = (f"highest value {win['value']:.4g}" + (
        f"; tied with {', '.join(c['tag'] for c in tied[1:])}: the earliest step wins"
        if len(tied) > 1 else "")) + unhealthy
    return {"tag": win["tag"], "step": win.get("step"), "value": win["value"],
            "ties": [c["tag"] for c in tied[1:]], "missing": missing, "considered": len(have),
            "unhealthy": past, "reason": reason}


def selects(cfg: Config) -> bool:
    """Rule eval_select is in the DAG: eval.select and data.heldout are set and checkpoints
    are evaluated (rules/common.smk's selection_enabled; hy3rl.release.release_tags)."""
    return (cfg.eval.select is not None and cfg.data.heldout is not None
            and bool(candidate_tags(cfg)))


def candidate_tags(cfg: Config) -> list[str]:
    """The checkpoint tags that may be selected: ``step<N>`` for eval.steps, and ``final``
    when eval.final (only when training is in the DAG, as hy3rl.evaluate.eval_tags). A
    ``final`` at the step of a ``step<N>`` tag is dropped when the steps are known
    (:func:`dedup_final`)."""
    from hy3rl.evaluate import eval_tags

    return [t for t in eval_tags(cfg) if t != "base" and not split_tag(t)[1]]


def candidate_set(cfg: Config) -> dict[str, Any]:
    """The candidate set as the rule fixes it (plan.json ``selection.candidates``): the
    steps of :func:`candidate_tags` and whether ``final`` is one. Adding a step after seeing
    results changes the rule."""
    tags = candidate_tags(cfg)
    return {"steps": sorted(int(m.group(1)) for t in tags if (m := _STEP_TAG.match(t))),
            "final": "final" in tags}


def dedup_final(candidates: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """Drop ``final`` when its step is that of a ``step<N>`` candidate (the same
    checkpoint: one candidate, the step tag); also the tag it duplicates, else None."""
    final = next((c for c in candidates if c["tag"] == "final"), None)
    if final is None or final.get("step") is None:
        return candidates, None
    same = next((c["tag"] for c in candidates
                 if c["tag"] != "final" and c.get("step") == final["step"]), None)
    if same is None:
        return candidates, None
    return [c for c in candidates if c["tag"] != "final"], same


def tag_step(tag: str, *docs: Mapping[str, Any] | None) -> int | None:
    """``step<N>`` -> N; otherwise the first ``step`` the documents record (metrics.json or
    samples.meta.json ``step``), else None."""
    m = _STEP_TAG.match(tag)
    if m:
        return int(m.group(1))
    for d in docs:
        if isinstance(d, Mapping) and isinstance(d.get("step"), int) \
                and not isinstance(d.get("step"), bool):
            return int(d["step"])
    return None


def _acc(doc: Mapping[str, Any], grader: str, source: str) -> dict[str, float]:
    out = {}
    for i, row in enumerate(doc.get("per_problem") or []):
        try:
            out[str(row["problem_id"])] = float(row[grader]["acc"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SelectionError(f"{source}: per_problem[{i}] lacks {grader}.acc ({exc})") \
                from exc
    if not out:
        raise SelectionError(f"{source}: no per_problem rows")
    return out


def _boot(boot: Bootstrap | Mapping[str, Any]) -> dict[str, Any]:
    return dataclasses.asdict(boot) if dataclasses.is_dataclass(boot) else dict(boot)


def selection_doc(rule: Mapping[str, Any], heldout: Mapping[str, Mapping[str, Any] | None],
                  test: Mapping[str, Mapping[str, Any] | None],
                  boot: Bootstrap | Mapping[str, Any], *,
                  sources: Mapping[str, str] | None = None,
                  final_step: int | None = None,
                  stop_at: int | None = None) -> dict[str, Any]:
    """The selected.json document (docs/formats/eval.md) from documents already read:
    ``heldout`` {model tag: held-out metrics.json or None (not evaluated)} of the candidate
    tags (and ``base``, shown for reference, never a candidate), ``test`` {model tag: the
    test set's metrics.json or None} of ``base``, the candidates and ``final``.
    ``sources``: {"heldout/<tag>" or "<tag>": path} for messages and the document;
    ``final_step``: final's step when no document records it; ``stop_at``: see
    :func:`select`."""
    boot = _boot(boot)
    sources = dict(sources or {})
    n = next((d.get("n") for d in heldout.values() if isinstance(d, Mapping)), None)
    rule = resolved(rule, n)
    cands = []
    for tag, doc in heldout.items():
        if tag == "base":
            continue
        step = tag_step(tag, doc, test.get(tag), {"step": final_step})
        cands.append({
            "tag": tag, "step": step,
            "value": metric_value(doc, rule) if doc else None,
            "interval": metric_interval(doc, rule, boot) if doc else None,
            "n": doc.get("n") if doc else None,
            "metrics": sources.get(heldout_tag(tag))})
    cands.sort(key=_step_order)
    cands, duplicate = dedup_final(cands)
    chosen = select(cands, rule, stop_at)
    if duplicate:
        chosen["reason"] += f"; final is the checkpoint of {duplicate} (one candidate)"
    base = heldout.get("base")
    base_row = None if not base else {
        "tag": "base", "value": metric_value(base, rule),
        "interval": metric_interval(base, rule, boot), "n": base.get("n"),
        "metrics": sources.get(heldout_tag("base"))}

    sel_tag = chosen["tag"]
    final_doc, sel_doc = test.get("final"), test.get(sel_tag) if sel_tag else None
    final_at = tag_step("final", final_doc, heldout.get("final"), {"step": final_step})
    rows, test_missing = [], []
    for role, tag in (("base", "base"), ("selected", sel_tag), ("final", "final")):
        if tag is None:
            continue
        doc = test.get(tag)
        if doc is None:
            test_missing.append(tag)
            continue
        step = final_at if tag == "final" else tag_step(tag, doc, heldout.get(tag))
        rows.append({"role": role, "step": step, **summarize([doc])["rows"][0]})
    comparison, differ = None, None
    g = rule["grader"]
    if sel_tag is None:
        verdict = f"Nothing selected: {chosen['reason']}."
    elif sel_tag == "final" or (final_at is not None and chosen["step"] == final_at):
        verdict = (f"The rule selects {sel_tag} (step {chosen['step']}), the final checkpoint:"
                   " the reported checkpoint is the final one, nothing to compare.")
    elif final_doc is None or sel_doc is None:
        absent = " and ".join(t for t in (sel_tag, "final") if test.get(t) is None)
        verdict = (f"The rule selects {sel_tag} (step {chosen['step']}); {absent} not "
                   "evaluated on the test set (yet): no comparison with final.")
    else:
        comparison = {}
        where = f"{sources.get(sel_tag, sel_tag)} against {sources.get('final', 'final')}"
        for grader in GRADERS:
            try:
                d = paired_difference(
                    _acc(sel_doc, grader, sources.get(sel_tag, sel_tag)),
                    _acc(final_doc, grader, sources.get("final", "final")), boot, "final")
            except MetricsError as exc:
                raise SelectionError(f"{where}: {exc}") from exc
            d["per_problem"] = [{"problem_id": r["problem_id"], "selected": r["this"],
                                 "final": r["base"], "diff": r["diff"]}
                                for r in d["per_problem"]]
            comparison[grader] = d
        ci = comparison[g]["paired_bootstrap_ci"]
        differ = bool(ci["low"] > 0 or ci["high"] < 0)
        a = sel_doc["by_grader"][g]["avg@n"]
        b = final_doc["by_grader"][g]["avg@n"]
        verdict = (
            f"On the test set, {sel_tag} (step {chosen['step']}) scores {a:.4g} and final "
            f"(step {final_at if final_at is not None else 'n/a'}) {b:.4g} ({g} "
            f"avg@{sel_doc.get('n')}); the paired difference {comparison[g]['mean_diff']:+.4g} "
            f"has {ci['level']:.0%} interval [{ci['low']:.4g}, {ci['high']:.4g}], which "
            + ("excludes 0: selected and final differ beyond the interval." if differ else
               "includes 0: selected and final do not differ beyond the interval."))
    return {"rule": rule, "selected": chosen, "candidates": cands, "heldout_base": base_row,
            "health_stop_at": stop_at,
            "test": {"rows": rows, "missing": test_missing,
                     "metrics": {t: sources[t] for t in ("base", sel_tag, "final")
                                 if t and t in sources}},
            "selected_vs_final": comparison, "differ_beyond_intervals": differ,
            "verdict": verdict}


# ---- files ----


def _read(path: Path, missing_ok: bool) -> dict[str, Any] | None:
    path = Path(path)
    if missing_ok and not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SelectionError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(doc, dict):
        raise SelectionError(f"{path}: expected a JSON object")
    return doc


def run(rule: Select | Mapping[str, Any], *, heldout: Mapping[str, Path],
        test: Mapping[str, Path], out: Path, boot: Bootstrap | Mapping[str, Any],
        rule_source: str = "preflight/plan.json", stop_at: int | None = None
        ) -> dict[str, Any]:
    """``out`` (eval/selected.json, atomically) from the held-out metrics.json of each
    candidate tag (``heldout``: {tag: path}, tags as ``step20`` or ``heldout/step20``;
    ``base`` too, for reference) and the test set's (``test``: {tag: path} of base, the
    candidates and final). Every file must exist. Returns the document. ``boot``:
    ``eval.bootstrap``; ``rule_source``: where the rule was read (the document's
    ``rule_source``); ``stop_at``: see :func:`select`."""
    rule_d = as_rule(rule)
    if rule_d is None:
        raise SelectionError("no selection rule (eval.select is null)")
    hdocs, sources = {}, {}
    for tag, path in heldout.items():
        model_tag = split_tag(tag)[0]
        hdocs[model_tag] = _read(path, missing_ok=False)
        sources[heldout_tag(model_tag)] = str(path)
    tdocs = {}
    for tag, path in test.items():
        tdocs[tag] = _read(path, missing_ok=False)
        sources[tag] = str(path)
    doc = {"rule_source": rule_source,
           **selection_doc(rule_d, hdocs, tdocs, boot, sources=sources, stop_at=stop_at)}
    write_json_atomic(Path(out), doc, indent=1)
    sel = doc["selected"]
    print(f"selection ({doc['rule']['key']} on {doc['rule'].get('set')}): "
          f"{sel['tag'] or 'nothing'} ({sel['reason']}). {doc['verdict']}", file=sys.stderr)
    return doc


def run_rule(cfg: Config, rule: Mapping[str, Any] | None, *, heldout: Sequence[Path],
             test: Sequence[Path], out: Path) -> dict[str, Any]:
    """Rule eval_select: :func:`run` over the run's files (``heldout``: the candidates'
    held-out metrics.json, ``test``: the test set's of base and the candidates, paths of
    the config's :class:`~hy3rl.layout.Layout`, each tag found by its path) with ``rule``,
    the plan's ``selection``; a plan without one (written before the selection existed)
    falls back to ``eval.select``, and the document says so (``rule_source``)."""
    layout = Layout.from_config(cfg)
    tags = ["base", *candidate_tags(cfg)]
    by_path = {os.path.normpath(layout.eval_metrics(name)): name
               for t in tags for name in (t, heldout_tag(t))}

    def tagged(paths: Sequence[Path]) -> dict[str, Path]:
        out_ = {}
        for p in paths:
            tag = by_path.get(os.path.normpath(str(p)))
            if tag is None:
                raise SelectionError(f"{p}: not the metrics.json of a tag of this run "
                                     f"({', '.join(tags)}; held-out: heldout/<tag>)")
            out_[tag] = Path(p)
        return out_

    source = "preflight/plan.json"
    if rule is None:
        rule, source = as_rule(cfg.eval.select), \
            "config (eval.select; preflight/plan.json holds no selection)"
    from hy3rl.train import health_stop_at

    return run(rule, heldout=tagged(heldout), test=tagged(test), out=out,
               boot=cfg.eval.bootstrap, rule_source=source, stop_at=health_stop_at(layout))


def so_far(layout: Layout, cfg: Config, rule: Select | Mapping[str, Any] | None
           ) -> dict[str, Any] | None:
    """The selection over the held-out metrics.json files that exist now (mid-run; the
    others are listed in ``selected.missing``), as :func:`selection_doc`, plus the
    selected ``tag`` and ``step`` at the top (None: nothing yet) and ``progress``:
    ``{"evaluated", "expected", "complete", "label"}`` ("selection so far (N of M steps
    evaluated)"). None without a rule."""
    rule_d = as_rule(rule)
    if rule_d is None:
        return None
    tags = candidate_tags(cfg)
    sources: dict[str, str] = {}
    hdocs: dict[str, dict[str, Any] | None] = {}
    tdocs: dict[str, dict[str, Any] | None] = {}
    for tag in ["base", *tags]:
        h, t = layout.eval_metrics(heldout_tag(tag)), layout.eval_metrics(tag)
        hdocs[tag], tdocs[tag] = _read(Path(h), True), _read(Path(t), True)
        sources[heldout_tag(tag)], sources[tag] = h, t
    final_step = None
    if "final" in tags:
        metas = [_read(Path(layout.eval_samples_meta(t)), True)
                 for t in (heldout_tag("final"), "final")]
        final_step = tag_step("final", *metas)
    from hy3rl.train import health_stop_at

    doc = selection_doc(rule_d, hdocs, tdocs, cfg.eval.bootstrap, sources=sources,
                        final_step=final_step, stop_at=health_stop_at(layout))
    done = sum(hdocs[t] is not None for t in tags)
    doc = {"tag": doc["selected"]["tag"], "step": doc["selected"]["step"], **doc}
    doc["progress"] = {"evaluated": done, "expected": len(tags),
                       "complete": done == len(tags),
                       "label": f"selection so far ({done} of {len(tags)} steps evaluated)"}
    return doc
