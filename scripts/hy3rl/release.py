"""Rule release: a checkpoint as a Hugging Face model directory, verified before it is
called a release (docs/formats/release.md).

For a release tag (``selected``: the checkpoint of eval/selected.json; ``final``), the job
copies the HF weights verl saved with the checkpoint (``model_for_tag``) and their
``config.json``, plus the base model's tokenizer, chat template, generation config and
license files, into a temporary directory beside the destination, and checks it:

- ``tokenizer``: the checkpoint's own tokenizer (when it carries one) is the base's
  (vocabulary, added and special tokens, chat template);
- ``index``, ``headers``, ``index_vs_shards``: hy3rl.checkpoint's header-only checks (a
  missing shard, an unreadable header, a tensor the index misplaces);
- ``inventory``: the same tensor names, shapes and dtypes as the base, each missing or extra
  tensor named;
- ``fixed_tensors``: the expert bias (hy3rl.rehearsal.FIXED_TENSOR) bit-identical to the
  base when the plan's moe_router_bias_update_rate is 0, and trained tensors changed;
- ``generates``: loaded from its own directory with the evaluation's backend (transformers
  in this process; vLLM through hy3rl.evaluate.run, on the evaluation's nodes), it answers
  ``release.problems`` problems greedily (recorded); ``not run`` where vLLM is not there;
- ``report``: the run's report (every file of rule report) is copied into ``report/`` beside
  the card, byte for byte, and shows the released evaluation (its eval_headline.csv has the
  tag's rows at the tag's step);
- ``card``: the model card (README.md with Hugging Face metadata) written from the records
  parses with ``huggingface_hub.ModelCard`` and its metadata round-trips;
- ``evaluated``: the weight files' sha256 (every file of the directory is hashed: the
  manifest in release.json) equal those the tag's evaluation loaded (samples.meta.json
  ``weights``), file for file.

Every check goes to ``release/<tag>/checks.json`` (hy3rl.checkpoint's report shape). Only
when none failed is the temporary directory renamed to ``<release.dir>/<run>/<tag>`` and
``release/<tag>/release.json`` written; otherwise the temporary directory is removed and
:class:`ReleaseFailed` names each failed check: nothing that looks like a release is left.

With ``release.hub`` set, the release in place is then pushed to the hub (:func:`upload`:
one commit, refused naming the repository when its revision holds other files, unless
``overwrite``), and release.json records the commit; a failed or refused upload leaves the
verified directory in place and writes no release.json (the rule fails naming the repository).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hy3rl import checkpoint as ck
from hy3rl.atomic import write_json_atomic, write_text_atomic
from hy3rl.errors import StageError
from hy3rl.timefmt import utc_now

RELEASE_TAGS = ("selected", "final")
BIAS_RATE_KEY = ("actor_rollout_ref.actor.megatron.override_transformer_config."
                 "moe_router_bias_update_rate")
# Taken from the evaluated checkpoint's HF directory: every file that computes the model's
# answers (hy3rl.evaluate.COMPUTES: weights, config, generation config, tokenizer, chat
# template), the very files the evaluation loaded. From the base: only its license.
BASE_FILES = re.compile(r"^(LICEN[CS]E.*|NOTICE.*)$")
# config.json keys an export may write otherwise than the base without computing otherwise
CONFIG_METADATA = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
CARD = "README.md"
# Files the hub writes into a new repository itself: not content of another release.
HUB_OWN_FILES = frozenset({".gitattributes"})
SHOWN = 5  # tensors or tokens named in one problem line


class ReleaseError(StageError):
    """An input of the release is unusable (the message names the file or key)."""


class ReleaseFailed(StageError):
    """A check failed; checks.json is written and nothing release-looking is left."""


@dataclass(frozen=True)
class Records:
    """The run's records a release reads (None: not part of this run)."""

    val: Path  # data/val.parquet (the problems the release answers)
    summary: Path  # eval/summary.json
    samples_meta: Path | None = None  # eval/<evaluated tag>/samples.meta.json (default: the
    # layout's, of the tag the release is of)
    plan: Path | None = None  # train/launch/plan.json (the recipe, the bias update rate)
    selected: Path | None = None  # eval/selected.json
    train_done: Path | None = None  # train/done.json (attempts)
    lock: Path | None = None  # deps/lock.json (pins)
    data_summary: Path | None = None  # data/summary.json (data hashes)
    rehearsal: Path | None = None  # rehearsal/rehearsal.json
    report: Path | None = None  # report/index.html (linked from the card)
    runtime_env: Path | None = None  # deps/runtime_env.yaml (vLLM on several nodes: Ray's)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReleaseError(f"{path}: cannot read {what}: {exc}") from None


def release_tags(cfg: Any) -> list[str]:
    """``release.tags`` of a GPU run (none without training), each checked against the DAG:
    ``selected`` needs rule eval_select (eval.select, data.heldout, checkpoint tags),
    ``final`` needs eval.final. Raises :class:`ReleaseError` naming the key. Unset (null):
    the tags whose evaluation the DAG has, none refused."""
    from hy3rl.selection import selects

    if not cfg.cluster.gpu:
        return []
    selectable = selects(cfg)
    if cfg.release.tags is None:  # the default: what the DAG evaluates
        return _one_target_each(cfg, [tag for tag, evaluated in (
            ("selected", selectable), ("final", bool(cfg.eval.final))) if evaluated])
    for tag in cfg.release.tags:
        if tag == "selected" and not selectable:
            raise ReleaseError("release.tags: 'selected' needs eval.select and data.heldout "
                               "set (rule eval_select picks the checkpoint); remove it or "
                               "set them")
        if tag == "final" and not cfg.eval.final:
            raise ReleaseError("release.tags: 'final' needs eval.final true (a release must "
                               "be the evaluated model); remove it or set eval.final")
    return _one_target_each(cfg, list(cfg.release.tags))


def _one_target_each(cfg: Any, tags: list[str]) -> list[str]:
    """``tags``, refused (naming release.hub) when several would be pushed to one
    repository's revision: the second would find the first's files there."""
    hub = cfg.release.hub
    if hub is not None and len(tags) > 1 and not hub.per_tag:
        raise ReleaseError(f"release.hub: releases {', '.join(tags)} would all be pushed to "
                           f"{hub.repo} at revision {hub.revision}: put {{tag}} in "
                           "release.hub.repo or release.hub.revision (a repository or branch "
                           "a tag), or release one tag (release.tags)")
    return tags


def evaluated_tag(tag: str, selected: Path | None) -> str:
    """The evaluation tag a release tag is of: ``final`` itself; ``selected`` the tag
    eval/selected.json names (refused when nothing was selected, with its reason)."""
    if tag == "final":
        return "final"
    if tag != "selected":
        raise ReleaseError(f"release.tags: unknown tag {tag!r} ({', '.join(RELEASE_TAGS)})")
    if selected is None:
        raise ReleaseError("release tag 'selected' needs eval/selected.json (eval.select and "
                           "data.heldout set)")
    sel = (_read_json(selected, "the selection") or {}).get("selected") or {}
    if not sel.get("tag"):
        raise ReleaseError(f"{selected}: nothing was selected ({sel.get('reason')}): no "
                           "'selected' release")
    return str(sel["tag"])


# --------------------------------------------------------------------------- staging


def stage(source: Path, base: Path, staging: Path) -> dict[str, str]:
    """Copy the checkpoint's files that compute (hy3rl.evaluate.COMPUTES: what its
    evaluation loaded) and the base's license into ``staging`` (a new directory); returns
    file name -> where it came from."""
    from hy3rl.evaluate import COMPUTES

    if not source.is_dir():
        raise ReleaseError(f"{source}: the checkpoint's HF directory does not exist")
    if not base.is_dir():
        raise ReleaseError(f"{base}: the base model directory does not exist")
    ckpt = sorted(p.name for p in source.iterdir() if p.is_file() and COMPUTES.match(p.name))
    if "config.json" not in ckpt or not any(n.endswith(".safetensors") for n in ckpt):
        raise ReleaseError(f"{source}: no config.json or no *.safetensors weight file (an "
                           "empty or incomplete HF export)")
    taken = sorted(p.name for p in base.iterdir() if p.is_file() and BASE_FILES.match(p.name))
    staging.mkdir(parents=True)
    origin = {}
    for folder, names in ((source, ckpt), (base, taken)):
        for name in names:
            shutil.copy2(folder / name, staging / name)
            origin[name] = str(folder / name)
    return origin


# --------------------------------------------------------------------------- checks


def _tokenizer_view(folder: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return {"vocab": tok.get_vocab(), "special": dict(tok.special_tokens_map),
            "chat_template": tok.chat_template}


def check_tokenizer(source: Path, base: Path) -> ck.CheckResult:
    """The checkpoint's tokenizer (when its export carries one) against the base's: the
    vocabulary (added tokens included), the special tokens, the chat template: a model
    exported with another tokenizer than the one it was trained with is refused (the
    release ships the checkpoint's, which its evaluation loaded; :func:`check_encodings`
    compares what it makes of the evaluation's prompts)."""
    name = "tokenizer"
    from hy3rl.evaluate import TOKENIZER_FILES

    own = sorted(p.name for p in source.iterdir() if TOKENIZER_FILES.match(p.name))
    if not own:
        return ck.CheckResult(name, "pass", f"{source} carries no tokenizer file to compare "
                              "with the base's (the release ships what its evaluation loaded)")
    try:
        mine, theirs = _tokenizer_view(source), _tokenizer_view(base)
    except Exception as exc:  # transformers raises many kinds for a broken tokenizer
        return ck.CheckResult(name, "fail", f"{source}: its tokenizer does not load: {exc}",
                              [f"{source} ({', '.join(own)}): {exc}"])
    problems = []
    where = ", ".join(f"{source}/{n}" for n in own)
    vm, vb = mine["vocab"], theirs["vocab"]
    diff = sorted({t for t in vm.keys() | vb.keys() if vm.get(t) != vb.get(t)})
    if diff:
        shown = ", ".join(f"{t!r}: {vm.get(t)} vs base {vb.get(t)}" for t in diff[:SHOWN])
        problems.append(f"{where}: {len(diff)} vocabulary entries differ from the base's "
                        f"({shown})")
    if mine["special"] != theirs["special"]:
        problems.append(f"{where}: special tokens {mine['special']} differ from the base's "
                        f"{theirs['special']}")
    if mine["chat_template"] != theirs["chat_template"]:
        problems.append(f"{where}: the chat template differs from the base's")
    return ck._check(name, problems, f"{source}'s tokenizer ({', '.join(own)}) is the base's: "
                     f"{len(vb)} tokens, special tokens and chat template equal",
                     f"the checkpoint's tokenizer differs from the base's {base}")


def headers(folder: Path, threads: int) -> tuple[ck.State, list[ck.CheckResult]]:
    """hy3rl.checkpoint's header-only checks of ``folder``: index, headers, index_vs_shards."""
    st = ck.State(folder.resolve())
    results = [ck.check_index(st), ck.check_headers(st, threads), ck.check_index_vs_shards(st)]
    return st, results


MTP_KEY = "actor_rollout_ref.model.mtp.enable"


@dataclass(frozen=True)
class Mtp:
    """The release's MTP policy (``release.mtp`` resolved) and what it makes the inventory:
    ``absent`` the base's MTP tensors the release must not hold (policy ``none``),
    ``nextn`` the num_nextn_predict_layers its config.json must say, ``why`` in words."""

    policy: str
    absent: frozenset[str]
    nextn: int | None
    why: str


def _config(folder: Path) -> dict[str, Any]:
    doc = _read_json(folder / "config.json", "config.json")
    if not isinstance(doc, dict):
        raise ReleaseError(f"{folder / 'config.json'}: not a JSON object")
    return doc


def mtp_policy(cfg: Any, plan: Path | None, base_dir: Path,
               base: dict[str, ck.TensorInfo]) -> Mtp:
    """``release.mtp`` resolved against the plan (``auto``: ``trained`` when the composed
    actor_rollout_ref.model.mtp.enable is true, ``none`` when false or not recorded: the
    pinned stack's default) and the base (its MTP layer: ``model.layers.<num_hidden_layers>``
    onwards, num_nextn_predict_layers of them). A base without an MTP layer has nothing to
    decide."""
    from hy3rl.rehearsal import LAYER_INDEX  # the MTP layer as the rehearsal's check knows it
    from hy3rl.train import plan_value

    conf = _config(base_dir)
    layers, nextn = conf.get("num_hidden_layers"), int(conf.get("num_nextn_predict_layers") or 0)
    mtp = frozenset(n for n in base if isinstance(layers, int) and (m := LAYER_INDEX.match(n))
                    and int(m.group(1)) >= layers)
    if not mtp or not nextn:
        return Mtp("none", frozenset(), None, f"the base {base_dir} has no MTP layer")
    entry = (plan_value(_read_json(plan, "the training plan") or {}, MTP_KEY)
             if plan is not None else None)
    trained = str(entry).lower() in ("true", "1")
    said = (f"{MTP_KEY} = {entry!r} in {plan}" if entry is not None else
            f"{MTP_KEY} not recorded in {plan} (verl's default: false)")
    policy = cfg.release.mtp
    if policy == "auto":
        policy = "trained" if trained else "none"
    if policy == "trained" and not trained:
        raise ReleaseError(f"release.mtp is trained but the run did not train MTP ({said}): "
                           "its export holds no trained MTP layer; set release.mtp: none "
                           "(or auto)")
    if policy == "trained":
        return Mtp("trained", frozenset(), nextn, f"MTP trained ({said})")
    return Mtp("none", mtp, 0, f"MTP not trained ({said}): the pinned stack exports no MTP "
               f"layer (num_nextn_predict_layers 0), so the release leaves out the base's "
               f"{len(mtp)} MTP tensors")


def check_inventory(base: dict[str, ck.TensorInfo], rel: dict[str, ck.TensorInfo],
                    base_dir: Path, mtp: Mtp | None = None,
                    rel_dir: Path | None = None) -> ck.CheckResult:
    """The release's tensors against the inventory the base and the MTP policy ``mtp`` give:
    the base's names, shapes and dtypes, less ``mtp.absent`` (which the release must not
    hold); its config.json's num_nextn_predict_layers as the policy says (``rel_dir``)."""
    absent = mtp.absent if mtp else frozenset()
    problems = []
    for n in sorted(base.keys() - rel.keys() - absent):
        problems.append(f"missing tensor {n} ({base[n].dtype}{list(base[n].shape)} in the "
                        f"base's {base[n].shard})")
    for n in sorted(absent & rel.keys()):
        problems.append(f"MTP tensor {n} in {rel[n].shard}: release.mtp {mtp.policy} "
                        f"({mtp.why}) leaves the MTP layer out")
    if mtp is not None and mtp.nextn is not None and rel_dir is not None:
        got = _config(rel_dir).get("num_nextn_predict_layers")
        if int(got or 0) != mtp.nextn:
            problems.append(f"{rel_dir / 'config.json'}: num_nextn_predict_layers {got!r}, "
                            f"release.mtp {mtp.policy} needs {mtp.nextn} ({mtp.why})")
    for n in sorted(rel.keys() - base.keys()):
        problems.append(f"extra tensor {n} in {rel[n].shard} (the base {base_dir} has none)")
    for n in sorted(base.keys() & rel.keys()):
        a, b = base[n], rel[n]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            problems.append(f"{n} in {b.shard}: {b.dtype}{list(b.shape)}, the base's is "
                            f"{a.dtype}{list(a.shape)}")
    if not base:
        problems.append(f"{base_dir}: no tensor read from the base's headers")
    left = f"; the base's {len(absent)} MTP tensors left out ({mtp.why})" if absent else ""
    return ck._check("inventory", problems,
                     f"{len(rel)} tensors: the base's names, shapes and dtypes{left}",
                     f"{len(problems)} tensors missing, extra or unlike the base's"
                     + (f" (release.mtp {mtp.policy})" if mtp else ""))


def bias_update_rate(plan: Path | None) -> tuple[float | None, str]:
    """The plan's moe_router_bias_update_rate (None: not recorded) and where it was read."""
    if plan is None:
        return None, "no training plan given"
    entry = ((_read_json(plan, "the training plan") or {}).get("resolved") or {}).get(BIAS_RATE_KEY)
    if not isinstance(entry, dict) or entry.get("value") is None:
        return None, f"{plan} resolves no {BIAS_RATE_KEY}"
    try:
        return float(entry["value"]), f"{plan}: {BIAS_RATE_KEY}={entry['value']}"
    except (TypeError, ValueError):
        raise ReleaseError(f"{plan}: {BIAS_RATE_KEY} is {entry['value']!r}, not a number") from None


def check_fixed(base_dir: Path, rel_dir: Path, base: dict[str, ck.TensorInfo],
                rel: dict[str, ck.TensorInfo], rate: float | None, why: str) -> ck.CheckResult:
    """Tensor by tensor (one at a time, safetensors), bitwise: at update rate 0 the fixed
    tensors (the expert bias) equal the base's; some trained tensor differs from the base's
    (a release of unchanged weights is no trained model). Tensors of unlike shape or dtype
    are left to ``inventory``."""
    from safetensors import safe_open

    from hy3rl.rehearsal import FIXED_TENSOR, tensor_bits

    name = "fixed_tensors"
    if not rel:
        return ck.CheckResult(name, "not run", "not run: no readable tensor (see headers)")
    fixed_required = rate == 0
    problems: list[str] = []
    moved_fixed, fixed, changed, trained = [], 0, 0, 0
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def tensor(folder: Path, info: ck.TensorInfo) -> Any:
            path = folder / info.shard
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path].get_tensor(info.name)

        for n in sorted(base.keys() & rel.keys()):
            a, b = base[n], rel[n]
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                continue
            differ = int((tensor_bits(tensor(base_dir, a))
                          != tensor_bits(tensor(rel_dir, b))).sum())
            if FIXED_TENSOR.search(n):
                fixed += 1
                if differ:
                    moved_fixed.append(f"{n} in {b.shard}: {differ} of "
                                       f"{b.shape[0] if b.shape else 1} elements differ from "
                                       "the base's")
            else:
                trained += 1
                changed += bool(differ)
    if fixed_required:
        problems += [f"{m} (fixed: expert bias at update rate 0)" for m in moved_fixed]
        if not fixed:
            problems.append("no expert bias (mlp.expert_bias / e_score_correction_bias) to "
                            "compare")
    if trained and not changed:
        problems.append(f"none of {trained} trained tensors differs from the base's: the "
                        "release holds the base's weights")
    bias = (f"{fixed - len(moved_fixed)} of {fixed} expert biases bit-identical to the base "
            f"({why})" if fixed_required else
            f"expert biases not required fixed ({why}); {len(moved_fixed)} of {fixed} moved")
    summary = f"{bias}; {changed} of {trained} trained tensors changed"
    return ck._check(name, problems, summary, summary)


def _answers_check(answers: list[dict], how: str, max_tokens: int) -> ck.CheckResult:
    """``generates`` from the greedy answers: each problem must have got a token."""
    bad = [f"problem {a['problem_id']}: no token generated" for a in answers
           if not a["num_tokens"]]
    if not answers:
        bad.append("no answer at all")
    return ck._check("generates", bad, f"loaded from {how}, {len(answers)} greedy answers of "
                     f"at most {max_tokens} tokens", "generated nothing")


def generates_vllm(folder: Path, val: Path, cfg: Any, work: Path,
                   runtime_env: Path | None) -> tuple[ck.CheckResult, list[dict]]:
    """``generates`` with ``eval.backend: vllm``: the release directory loaded by the
    evaluation's own vLLM path (hy3rl.evaluate.run: its engine settings, and Ray over the
    job's nodes when ``eval.vllm.nodes`` > 1), greedy, ``release.problems`` problems of at most
    ``release.max_tokens`` tokens; its samples and meta in ``work`` (never in the release).
    ``not run`` (never a pass) where vLLM does not import."""
    from dataclasses import replace

    from hy3rl import evaluate

    rc = cfg.release
    ev = replace(cfg.eval, temperature=0.0, top_p=1.0, n_samples=1, max_tokens=rc.max_tokens,
                 num_problems=rc.problems)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    samples, meta = work / "samples.jsonl", work / "samples.meta.json"
    try:
        evaluate.run(ev, tag=f"release-{folder.name}", model=folder, val=val, samples=samples,
                     meta=meta, runtime_env=runtime_env, ray_dir=work / "ray",
                     cpus_per_node=cfg.cluster.cpus_per_node, runtime=cfg.train.runtime,
                     ray=cfg.train.ray)
        truth = {p.problem_id: p.ground_truth for p in evaluate.load_problems(val, rc.problems)}
        records = [json.loads(x) for x in samples.read_text().splitlines() if x.strip()]
    except evaluate.EvalNotRun as exc:
        return ck.CheckResult("generates", "not run", f"not run: {exc} (vLLM, eval.backend; "
                              f"{meta})"), []
    except Exception as exc:  # a model that does not load or run: the check's failure
        msg = f"{folder}: does not load or generate with vLLM: {type(exc).__name__}: {exc}"
        return ck.CheckResult("generates", "fail", msg, [msg]), []
    answers = [{"problem_id": r["problem_id"], "ground_truth": truth.get(r["problem_id"]),
                "response": r["response"], "num_tokens": r["num_tokens"],
                "finish_reason": r["finish_reason"]} for r in records]
    return _answers_check(answers, f"{folder} with vLLM ({meta})", rc.max_tokens), answers


def check_generates(folder: Path, val: Path, cfg: Any, *, work: Path | None = None,
                    runtime_env: Path | None = None) -> tuple[ck.CheckResult, list[dict]]:
    """The release, loaded from its own directory with the evaluation's backend, answers
    ``release.problems`` problems of ``val`` greedily: transformers (eval.transformers) in
    this process; vLLM by :func:`generates_vllm` (its files in ``work``)."""
    from hy3rl.evaluate import (
        Sampling,
        TransformersBackend,
        build_requests,
        load_problems,
        render_prompts,
    )

    name = "generates"
    if cfg.eval.backend == "vllm":
        if work is None:
            raise ReleaseError("the generates check with vLLM needs a work directory")
        return generates_vllm(folder, val, cfg, work, runtime_env)
    rc = cfg.release
    sampling = Sampling(preset="greedy", temperature=0.0, top_p=1.0, n_samples=1,
                        max_tokens=rc.max_tokens, seed=cfg.eval.seed, num_problems=rc.problems)
    try:
        problems = load_problems(val, rc.problems)
        be = TransformersBackend(str(folder), device=cfg.eval.transformers.device,
                                 dtype=cfg.eval.transformers.dtype)
        requests = build_requests(problems, render_prompts(be.tokenizer, problems), sampling)
        records = be.generate(requests, sampling)
    except Exception as exc:  # a model that does not load or run: the check's failure
        msg = f"{folder}: does not load or generate: {type(exc).__name__}: {exc}"
        return ck.CheckResult(name, "fail", msg, [msg]), []
    truth = {p.problem_id: p.ground_truth for p in problems}
    answers = [{"problem_id": r.problem_id, "ground_truth": truth[r.problem_id],
                "response": r.response, "num_tokens": r.num_tokens,
                "finish_reason": r.finish_reason} for r in records]
    return _answers_check(answers, f"{folder} ({be.settings()})", rc.max_tokens), answers


REPORT_DIR = "report"  # the report's copy inside a release


def copy_report(report_html: Path | None, folder: Path, eval_tag: str,
                step: int | None) -> ck.CheckResult:
    """Copy the run's report (``report_html``'s folder: every file of rule report,
    hy3rl.layout.REPORT_FILES) into ``folder``/report/ and check the copy: every file there,
    equal to its source byte for byte, and a report that shows this release's evaluation
    (its ``eval_headline.csv`` has rows of ``eval_tag`` at ``step``; a report rendered
    before that evaluation does not)."""
    import csv
    import filecmp

    from hy3rl.layout import REPORT_FILES

    name = "report"
    if report_html is None:
        msg = "no report given: the release copies the run's report beside its card"
        return ck.CheckResult(name, "fail", msg, [msg])
    src = Path(report_html).parent
    missing = [n for n, _ in REPORT_FILES if not (src / n).is_file()]
    if missing:
        msg = (f"{src}: the run's report lacks {', '.join(missing)}: render it (snakemake "
               "report) before the release")
        return ck.CheckResult(name, "fail", msg, [msg])
    dst = folder / REPORT_DIR
    dst.mkdir(parents=True, exist_ok=True)
    problems = []
    for n, _ in REPORT_FILES:
        shutil.copyfile(src / n, dst / n)
        if not filecmp.cmp(src / n, dst / n, shallow=False):
            problems.append(f"{dst / n}: differs from {src / n} after the copy")
    headline = src / "eval_headline.csv"
    with open(headline, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("tag") == eval_tag]
    want = "" if step is None else str(step)
    if not rows:
        problems.append(f"{headline}: no row of {eval_tag}: the report was rendered before "
                        f"this evaluation; render it again (snakemake report)")
    elif any(r.get("step", "") != want for r in rows):
        problems.append(f"{headline}: {eval_tag} is at step "
                        f"{sorted({r.get('step') for r in rows})}, the release at {want}")
    if problems:
        return ck.CheckResult(name, "fail", "; ".join(problems), problems)
    return ck.CheckResult(name, "pass", f"{REPORT_DIR}/ ({len(REPORT_FILES)} files, copied "
                          f"from {src}) shows {eval_tag} (step {want or 'n/a'})", [])


def file_manifest(folder: Path, threads: int) -> dict[str, dict[str, Any]]:
    """Every file of ``folder``: size and sha256 (hy3rl.hub.hash_files)."""
    from hy3rl.hub import hash_files, list_files

    files = [folder / rel for rel in list_files(folder)]
    got = hash_files([(f, "sha256") for f in files], threads, progress=False,
                     desc="hashing the release")
    return {f.relative_to(folder).as_posix(): {"size": f.stat().st_size, "sha256": got[f]}
            for f in files}


def _recorded(samples_meta: Path, name: str, key: str,
              what: str) -> tuple[dict[str, Any], dict[str, Any], None] | tuple[
                  None, None, ck.CheckResult]:
    """The evaluation's record and its ``key`` (a non-empty mapping: ``what``), or the
    failed check ``name`` that says why they cannot be used."""
    if not Path(samples_meta).is_file():
        msg = (f"{samples_meta}: missing (the record of the evaluation of this model): "
               "evaluate the tag first")
        return None, None, ck.CheckResult(name, "fail", msg, [msg])
    meta = _read_json(samples_meta, "the evaluation's samples meta")
    if not isinstance(meta, dict) or meta.get("status") != "complete":
        status = meta.get("status") if isinstance(meta, dict) else None
        msg = f"{samples_meta}: status {status!r}, not 'complete'"
        return None, None, ck.CheckResult(name, "fail", msg, [msg])
    value = meta.get(key)
    if not isinstance(value, dict) or not value:
        msg = f"{samples_meta}: records no '{key}' ({what}): evaluate the tag again"
        return None, None, ck.CheckResult(name, "fail", msg, [msg])
    return meta, value, None


def check_evaluated(manifest: dict[str, dict[str, Any]], samples_meta: Path,
                    folder: Path) -> ck.CheckResult:
    """Every file of the release that computes (hy3rl.evaluate.COMPUTES: weights, config,
    generation config, tokenizer, chat template) against what the evaluation loaded
    (samples.meta.json ``files``), file for file both ways; a JSON file that differs is
    named with the top-level keys that differ (``folder``: the release being made)."""
    from hy3rl.evaluate import COMPUTES, json_keys

    name = "evaluated"
    meta, loaded, failed = _recorded(samples_meta, name, "files", "the sha256 of each file "
                                     "the evaluation loaded: weights, config, generation "
                                     "config, tokenizer")
    if failed is not None:
        return failed
    mine = {k: v["sha256"] for k, v in manifest.items() if "/" not in k and COMPUTES.match(k)}
    problems = []
    for f in sorted(mine.keys() | loaded.keys()):
        theirs = loaded.get(f) if isinstance(loaded.get(f), dict) else None
        if theirs is None:
            problems.append(f"{f}: in the release, not among the files evaluated "
                            f"({samples_meta})")
        elif f not in mine:
            problems.append(f"{f}: evaluated ({samples_meta}), not in the release")
        elif mine[f] != theirs.get("sha256"):
            keys = json_keys(folder / f) if isinstance(theirs.get("keys"), dict) else None
            if keys is not None:
                diff = sorted(k for k in keys.keys() | theirs["keys"].keys()
                              if keys.get(k) != theirs["keys"].get(k))
                what = (f"key(s) {', '.join(diff[:SHOWN])} differ" if diff
                        else "its bytes differ (the same values)")
                problems.append(f"{f}: {what} from the file evaluated ({samples_meta})")
            else:
                problems.append(f"{f}: sha256 {mine[f]} in the release, {theirs.get('sha256')} "
                                f"evaluated ({samples_meta})")
    return ck._check(name, problems, f"{len(mine)} files that compute (weights, config, "
                     f"tokenizer, ...) equal those evaluated ({samples_meta}, model "
                     f"{meta.get('model_path')})",
                     f"{len(problems)} files differ from those evaluated")


def check_config(folder: Path, base: Path, mtp: Mtp | None,
                 may_differ: Sequence[str] = ()) -> ck.CheckResult:
    """The release's config.json against the base's: every key equal but the export's
    metadata (:data:`CONFIG_METADATA`), the MTP layers the policy sets
    (``num_nextn_predict_layers``) and ``release.config_may_differ``; each other key that
    differs is named with both values (an architecture, a dtype, the router's scaling
    changed is another model than the one trained from the base)."""
    name = "config"
    mine, theirs = _config(folder), _config(base)
    allowed = set(CONFIG_METADATA) | set(may_differ)
    if mtp is not None and mtp.nextn is not None:
        allowed.add("num_nextn_predict_layers")
    diff = sorted(k for k in mine.keys() | theirs.keys()
                  if k not in allowed and mine.get(k, _ABSENT) != theirs.get(k, _ABSENT))
    problems = [f"{folder.name}/config.json {k}: {_shown(mine.get(k, _ABSENT))}, the base's "
                f"{_shown(theirs.get(k, _ABSENT))} ({base}/config.json)" for k in diff]
    named = sorted(k for k in allowed if mine.get(k, _ABSENT) != theirs.get(k, _ABSENT))
    return ck._check(name, problems, f"config.json equals the base's in {len(theirs)} keys"
                     + (f" but {', '.join(named)} (allowed)" if named else ""),
                     f"{len(problems)} config.json key(s) differ from the base's")


_ABSENT = object()


def _shown(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)[:80]


def check_encodings(folder: Path, samples_meta: Path) -> ck.CheckResult:
    """What the release's tokenizer makes of the evaluation's own prompts (its problems,
    rendered with the release's chat template) against what the evaluated one made
    (samples.meta.json ``prompt_ids``): a normalizer, template or special token changed
    after the evaluation changes the ids the model reads."""
    from transformers import AutoTokenizer

    from hy3rl.evaluate import load_problems, prompt_encodings, render_prompts

    name = "encodings"
    meta, want, failed = _recorded(samples_meta, name, "prompt_ids",
                                   "what the evaluated tokenizer made of its prompts")
    if failed is not None:
        return failed
    val = Path(str(meta.get("val_file")))
    try:
        problems = load_problems(val, meta.get("num_problems"))
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        got = prompt_encodings(tokenizer, render_prompts(tokenizer, problems))
    except Exception as exc:  # noqa: BLE001 - a tokenizer or a file that does not load
        msg = f"the release's tokenizer on the evaluation's prompts ({val}): {exc}"
        return ck.CheckResult(name, "fail", msg, [msg])
    problems_ = [f"problem {pid}: {got.get(pid, ['none'])[0]} token ids from the release's "
                 f"tokenizer, {ids[0]} evaluated"
                 + (" (other ids)" if pid in got and got[pid][0] == ids[0] else "")
                 for pid, ids in sorted(want.items()) if got.get(pid) != list(ids)]
    return ck._check(name, problems_, f"the release's tokenizer encodes the evaluation's "
                     f"{len(want)} prompts ({val}) as the evaluated one did",
                     f"{len(problems_)} of {len(want)} prompts encode otherwise than evaluated")


# --------------------------------------------------------------------------- the card


def _opt_json(path: Path | None, what: str) -> Any:
    return _read_json(path, what) if path is not None and Path(path).exists() else None


def _base_card_data(base: Path) -> dict[str, Any]:
    from huggingface_hub import ModelCard

    readme = base / CARD
    if not readme.is_file():
        return {}
    try:
        return ModelCard.load(readme).data.to_dict()
    except Exception as exc:  # a base card that does not parse: its license is unknown
        raise ReleaseError(f"{readme}: the base's model card does not parse: {exc}") from None


def card_data(cfg: Any, tag: str, eval_tag: str, step: int | None, rec: Records,
              base: Path) -> tuple[Any, dict[str, Any]]:
    """The card's metadata (huggingface_hub.ModelCardData) and the values of its text."""
    from huggingface_hub import EvalResult, ModelCardData

    summary = _read_json(rec.summary, "the evaluation summary")
    selected = _opt_json(rec.selected, "the selection")
    grader = cfg.eval.select.grader if cfg.eval.select else "math_dapo"
    rows = {r["tag"]: r for r in summary.get("rows", [])}
    roles = [("base", "base"), ("final", "final")]
    if selected and (selected.get("selected") or {}).get("tag"):
        roles.insert(1, ("selected", selected["selected"]["tag"]))
    table = []
    for role, t in roles:
        r = rows.get(t)
        if r is None:
            continue
        ci = r.get(f"{grader}_ci") or [None, None]
        table.append({"role": role, "tag": t, "n": r.get("n"), "avg": r.get(f"{grader}_avg"),
                      "low": ci[0], "high": ci[1]})
    own = rows.get(eval_tag)
    if own is None or own.get(f"{grader}_avg") is None:
        raise ReleaseError(f"{rec.summary}: no {grader} result of tag {eval_tag} (the model "
                           "released): its evaluation must finish first")
    n = own.get("n")
    data_cfg = cfg.data
    val_name = data_cfg.val.source
    metric = f"avg@{n}"
    results = []
    ci = own.get(f"{grader}_ci") or [None, None]
    for kind, value in (("", own[f"{grader}_avg"]), ("_ci_low", ci[0]), ("_ci_high", ci[1])):
        if value is None:
            continue
        results.append(EvalResult(
            task_type="text-generation", task_name="AIME-2024 (math)", dataset_type=val_name,
            dataset_name="AIME-2024", dataset_split="train", metric_type=f"{metric}{kind}",
            metric_value=float(value),
            metric_name=f"{grader} {metric}" + (f" ({kind[4:]} end of the "
                                                 f"{cfg.eval.bootstrap.level:.0%} problem "
                                                 "bootstrap interval)" if kind else ""),
            ))
    if selected and tag == "selected":
        sel = selected["selected"]
        rule = selected.get("rule") or {}
        results.append(EvalResult(
            task_type="text-generation", task_name="held-out selection",
            dataset_type=str(rule.get("set") or "heldout"), dataset_name="held-out set",
            metric_type=str(rule.get("key") or "selection"), metric_value=float(sel["value"]),
            metric_name=f"held-out {rule.get('key')} (the selection rule)",
            ))
    base_data = _base_card_data(base)
    hub_base = not cfg.model.is_local
    # the Hub's `datasets`: what the model was trained on; the test and held-out sets are
    # under the evaluation results only
    datasets = [s for s in (data_cfg.train.source,) if s and "/" in s and not Path(s).exists()]
    data = ModelCardData(
        base_model=cfg.model.source if hub_base else None,
        datasets=datasets or None,
        license=base_data.get("license"),
        license_name=base_data.get("license_name"),
        license_link=base_data.get("license_link"),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["hy3", "grpo", "verl", "reinforcement-learning", "math"],
        model_name=f"{cfg.run.name}-{tag}",
        eval_results=results,
        base_model_revision=cfg.model.revision if hub_base else None,
    )
    values = {"table": table, "grader": grader, "metric": metric, "selected": selected,
              "step": step, "hub_base": hub_base, "level": cfg.eval.bootstrap.level}
    return data, values


CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ run }} ({{ tag }})

{{ what }}, trained from {{ base }} with GRPO (verl) by the hy3rl workflow, and
released by it with every check passed (`release/{{ tag }}/checks.json` of the run).
This card is written from the run's records; nothing in it is typed by hand.

## Evaluation: AIME-2024, {{ grader }} {{ metric }}

| model | tag | step | {{ metric }} | {{ level_pct }} problem-bootstrap interval |
|---|---|---|---|---|
{% for r in table -%}
| {{ r.role }} | {{ r.tag }} | {{ r.step_s }} | {{ r.avg_s }} | {{ r.ci_s }} |
{% endfor %}
{% if selection %}
**Selection.** {{ selection }}
{% endif %}
## Loading

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("<this directory>", dtype="auto")
tokenizer = AutoTokenizer.from_pretrained("<this directory>")
```
or `vllm serve <this directory>`. The tokenizer, chat template and generation config are
the base model's.
{% if mtp %}
**Multi-token prediction (MTP).** {{ mtp }}
{% endif %}
## Recipe

{% if recipe %}The training plan's resolved verl values (`train/launch/plan.json`):

<details><summary>{{ recipe|length }} values</summary>

| key | value |
|---|---|
{% for k, v in recipe -%}
| `{{ k }}` | `{{ v }}` |
{% endfor %}
</details>
{% else %}No training plan was recorded.{% endif %}

## Provenance

{% for line in provenance -%}
- {{ line }}
{% endfor %}
"""


def _fmt(x: Any, missing: str = "n/a") -> str:
    return missing if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def provenance_lines(rec: Records, cfg: Any) -> list[str]:
    """Pins, data hashes, runtime identity, attempts, health and rehearsal, the report."""
    lines = []
    lock = _opt_json(rec.lock, "the deps lock")
    if lock:
        pins = ", ".join(f"{n} {r.get('commit')}" for n, r in (lock.get("repos") or {}).items())
        lines.append(f"Pinned sources: {pins}.")
    data = _opt_json(rec.data_summary, "the data summary")
    if data:
        hashes = []
        for split, s in (data.get("splits") or data.get("outputs") or {}).items():
            if isinstance(s, dict) and s.get("sha256"):
                hashes.append(f"{split} sha256 {s['sha256']}")
        lines.append("Data: " + ("; ".join(hashes) if hashes else f"see {rec.data_summary}")
                     + ".")
    plan = _opt_json(rec.plan, "the training plan")
    if plan:
        ident = ((plan.get("identity") or {}).get("trajectory") or {}).get("id")
        lines.append(f"Run identity (the trajectory of the training plan): {ident}.")
    done = _opt_json(rec.train_done, "the train sentinel")
    if done:
        lines.append(f"Training: final step {done.get('final_step')} of "
                     f"{done.get('total_training_steps')}, {len(done.get('attempts') or [])} "
                     f"attempt(s), {done.get('steps_lost_total')} step(s) lost to failures.")
        health = done.get("health") or {}
        if health:
            lines.append(f"Training health: {json.dumps(health, sort_keys=True)[:300]}.")
    reh = _opt_json(rec.rehearsal, "the rehearsal record")
    if reh:
        lines.append(f"Rehearsal: {reh.get('counts') or reh.get('status') or 'passed'} "
                     f"({rec.rehearsal}).")
    lines.append(f"Model: {cfg.model.source}" + (f" at revision {cfg.model.revision}"
                                                  if cfg.model.revision else "") + ".")
    if rec.report is not None:
        lines.append(f"Report: [{REPORT_DIR}/index.html]({REPORT_DIR}/index.html), the run's "
                     f"HTML report as rendered for this release, copied beside this card from "
                     f"{rec.report} (its links into the run's results resolve there only).")
    return lines


def _mtp_text(mtp: Mtp | None) -> str | None:
    if mtp is None or (mtp.policy == "none" and not mtp.absent):
        return None
    if mtp.policy == "trained":
        return (f"The MTP layer is included, trained with the model ({mtp.why}); "
                f"`num_nextn_predict_layers` is {mtp.nextn}.")
    return (f"This release has no MTP layer: {mtp.why}. Its config says "
            "`num_nextn_predict_layers: 0`; speculative decoding with the base's MTP layer "
            "is not available from it.")


def write_card(folder: Path, cfg: Any, tag: str, eval_tag: str, step: int | None,
               rec: Records, base: Path, mtp: Mtp | None = None) -> ck.CheckResult:
    """Write README.md into ``folder`` and check that it parses (huggingface_hub.ModelCard)
    with the metadata it was written with (model-index results included). ``mtp``: the
    release's MTP policy, said in the text when the base has an MTP layer."""
    from huggingface_hub import ModelCard

    data, v = card_data(cfg, tag, eval_tag, step, rec, base)
    sel = v["selected"]
    selection = None
    if sel and (sel.get("selected") or {}).get("tag"):
        rule = sel.get("rule") or {}
        selection = (f"{sel['selected']['tag']} was picked by the rule fixed before training "
                     f"({rule.get('key')} on the held-out set {rule.get('set')}, tie: "
                     f"{rule.get('tie')}): {sel['selected'].get('reason')}. "
                     f"{sel.get('verdict') or ''}")
    steps = {r["tag"]: r.get("step") for r in ((sel or {}).get("test") or {}).get("rows", [])}
    table = [{**r, "step_s": _fmt(steps.get(r["tag"], step if r["tag"] == eval_tag else None),
                                  "-"),
              "avg_s": _fmt(r["avg"]),
              "ci_s": "n/a" if r["low"] is None else f"[{_fmt(r['low'])}, {_fmt(r['high'])}]"}
             for r in v["table"]]
    plan = _opt_json(rec.plan, "the training plan") or {}
    recipe = [(k, e.get("value") if isinstance(e, dict) else e)
              for k, e in sorted((plan.get("resolved") or {}).items())]
    what = ("The checkpoint selected on the held-out set" if tag == "selected"
            else "The final checkpoint")
    from jinja2 import Template

    text = Template(CARD_TEMPLATE, keep_trailing_newline=True).render(
        card_data=data.to_yaml(), run=cfg.run.name, tag=tag,
        what=f"{what} ({eval_tag}, step {step})", base=cfg.model.source, grader=v["grader"],
        metric=v["metric"], level_pct=f"{v['level']:.0%}", table=table, selection=selection,
        recipe=recipe, provenance=provenance_lines(rec, cfg), mtp=_mtp_text(mtp))
    path = folder / CARD
    write_text_atomic(path, text)
    try:
        parsed = ModelCard(path.read_text(), ignore_metadata_errors=False)
    except Exception as exc:  # huggingface_hub raises ValueError or yaml's errors
        msg = f"{path}: does not parse as a model card: {exc}"
        return ck.CheckResult("card", "fail", msg, [msg])
    problems = []
    want, got = data.to_dict(), parsed.data.to_dict()
    for key in sorted(want.keys() | got.keys()):
        if want.get(key) != got.get(key):
            problems.append(f"{path}: metadata {key!r} reads back as {got.get(key)!r}, written "
                            f"{want.get(key)!r}")
    if not parsed.data.eval_results:
        problems.append(f"{path}: no evaluation results (model-index) in its metadata")
    return ck._check("card", problems, f"{path.name} parses (huggingface_hub ModelCard), "
                     f"{len(parsed.data.eval_results or [])} evaluation results",
                     f"{path.name}: metadata does not read back")


# --------------------------------------------------------------------------- the upload


def _remote_problems(folder: Path, manifest: dict[str, dict[str, Any]],
                     siblings: list[Any]) -> tuple[list[str], dict[str, str]]:
    """The hub's files (``ModelInfo.siblings`` with metadata) against the release's: the
    files the release does not have, and those of the release whose content differs (name
    -> how). The hub gives an LFS file's sha256 (compared with the manifest's) and a regular
    file's git blob id (compared with the local file's)."""
    from hy3rl.hub import file_digest

    other, changed = [], {}
    for s in siblings:
        name = s.rfilename
        if name in HUB_OWN_FILES:
            continue
        mine = manifest.get(name)
        if mine is None:
            other.append(name)
        elif s.size is not None and int(s.size) != mine["size"]:
            changed[name] = f"{s.size} bytes, the release's {mine['size']}"
        elif s.lfs is not None:
            if s.lfs.sha256.lower() != mine["sha256"]:
                changed[name] = f"sha256 {s.lfs.sha256}, the release's {mine['sha256']}"
        elif not s.blob_id or str(s.blob_id).lower() != file_digest(folder / name, "git_blob"):
            changed[name] = f"git blob {s.blob_id}, unlike the release's"
    return sorted(other), dict(sorted(changed.items()))


def upload(hub: Any, tag: str, folder: Path, manifest: dict[str, dict[str, Any]], *,
           message: str, token_env: str = "HF_TOKEN") -> dict[str, Any]:
    """Push the release ``folder`` (its files: ``manifest``) to ``release.hub``'s repository
    and revision of ``tag`` in one commit, and return the record release.json keeps:
    ``repo``, ``revision``, ``commit`` (the commit the revision then points at), ``url``,
    ``private``, ``endpoint``, ``pushed`` (files the commit carried; 0 when the revision
    already held the release), ``deleted`` (files of the revision the release lacks, with
    ``overwrite``).

    The repository is created when missing (``private``); a branch that is missing is
    created from main. An existing repository of the other visibility is refused naming the
    repository; so is a revision that holds other files (other names or other content; the
    hub's own ``.gitattributes`` aside) unless ``overwrite``. After the commit the commit's
    files are read back and compared with ``manifest`` (refused when they differ).
    ``HF_TOKEN`` (``token_env``) is sent and written nowhere (messages and log records are
    redacted); ``HF_ENDPOINT`` picks the hub. Why not ``upload_folder``: with hf_xet
    installed, huggingface_hub 1.33 commits a large folder in batches
    (``_upload_pipeline``), so an interruption would leave a revision holding part of a
    release; ``create_commit`` makes one commit or none.
    Raises :class:`ReleaseError` naming the repository."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    from hy3rl.hub import hub_endpoint, hub_offline, redacted_logs, without_userinfo
    from hy3rl.redact import Redactor

    repo, revision = hub.at(tag)
    endpoint = hub_endpoint()
    where = f"release.hub.repo {repo} (revision {revision}, {without_userinfo(endpoint)})"
    if hub_offline():
        raise ReleaseError(f"{where}: HF_HUB_OFFLINE is set, the release cannot be uploaded; "
                           "unset it, or set release.hub to null")
    token = os.environ.get(token_env) or None
    redactor = Redactor(([token] if token else []) + endpoint_secrets(endpoint))
    with redacted_logs(redactor):
        try:
            return _push(hub, repo, revision, folder, manifest, message, endpoint, token,
                         where)
        except (HfHubHTTPError, OfflineModeIsEnabled, httpx.HTTPError, ConnectionError,
                ValueError) as exc:
            said = " ".join(redactor.text(str(exc)).split())
            raise ReleaseError(f"{where}: the upload failed ({type(exc).__name__}: "
                               f"{_shorten(said)}); the release directory {folder} is "
                               "verified and stays, release.json is not written") from None


def endpoint_secrets(endpoint: str) -> list[str]:
    """The credentials an endpoint URL carries (``http://user:secret@host``): its password
    and ``user:password``, for the redactor (a log record or an error quoting the URL)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
    except ValueError:
        return []
    out = []
    if parts.password:
        out += [f"{parts.username}:{parts.password}", parts.password]
    return out


def _push(hub: Any, repo: str, revision: str, folder: Path,
          manifest: dict[str, dict[str, Any]], message: str, endpoint: str,
          token: str | None, where: str) -> dict[str, Any]:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import RevisionNotFoundError

    from hy3rl.hub import without_userinfo

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo, private=hub.private, exist_ok=True)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except RevisionNotFoundError:  # a new branch: from main, whose files count as its own
        api.create_branch(repo, branch=revision, exist_ok=True)
        info = api.model_info(repo, revision=revision, files_metadata=True)
    if info.private is not None and bool(info.private) != hub.private:
        raise ReleaseError(f"{where}: the repository exists and is "
                           f"{'private' if info.private else 'public'}, release.hub.private "
                           f"is {str(hub.private).lower()}: refusing to push (change its "
                           "visibility on the hub, or release.hub.private)")
    other, changed = _remote_problems(folder, manifest, info.siblings or [])
    if (other or changed) and not hub.overwrite:
        shown = "; ".join([f"{n} (not in the release)" for n in other]
                          + [f"{n} ({how})" for n, how in changed.items()])
        raise ReleaseError(
            f"{where}: the repository exists and holds other files than this release at "
            f"{info.sha}: {len(other) + len(changed)} of them: {_shorten(shown)}. Refusing "
            "to push over them: set release.hub.overwrite: true to replace them, or choose "
            "another release.hub.repo or revision")
    same = {s.rfilename for s in info.siblings or []} - set(changed)
    todo = sorted(set(manifest) - same)
    if not todo and not other:
        commit, url, pushed = str(info.sha), None, 0  # the revision holds this release
    else:
        ops: list[Any] = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n))
                          for n in todo]
        ops += [CommitOperationDelete(path_in_repo=n) for n in other]
        done = api.create_commit(repo, ops, commit_message=message, revision=revision,
                                 parent_commit=info.sha)
        commit, url, pushed = str(done.oid), done.commit_url, len(todo)
    after = api.model_info(repo, revision=commit, files_metadata=True)
    extra, wrong = _remote_problems(folder, manifest, after.siblings or [])
    missing = sorted(set(manifest) - {s.rfilename for s in after.siblings or []})
    if extra or wrong or missing or str(after.sha) != commit:
        raise ReleaseError(f"{where}: commit {commit} does not hold the release as pushed: "
                           + _shorten("; ".join([f"{n} missing" for n in missing]
                                                + [f"{n} ({how})" for n, how in wrong.items()]
                                                + [f"{n} extra" for n in extra]
                                                + [f"the hub resolves it to {after.sha}"]
                                                * (str(after.sha) != commit))))
    return {"repo": repo, "revision": revision, "commit": commit,
            "url": url or f"{without_userinfo(endpoint)}/{repo}/commit/{commit}",
            "private": hub.private, "endpoint": without_userinfo(endpoint),
            "pushed": pushed, "deleted": other}


def _shorten(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


# --------------------------------------------------------------------------- the stage


def _clear_leftovers(dest: Path) -> None:
    """Temporary directories of earlier release jobs of ``dest`` (killed or refused)."""
    for p in dest.parent.glob(f".{dest.name}.*"):
        shutil.rmtree(p, ignore_errors=True)


def build(cfg: Any, layout: Any, tag: str, rec: Records, *, threads: int) -> dict[str, Any]:
    """Release ``tag`` (docs/formats/release.md): stage, check, and only when no check
    failed rename the directory into place and write release.json. Raises
    :class:`ReleaseFailed` (checks.json written, the staging directory removed) or
    :class:`ReleaseError` (bad input)."""
    from hy3rl.evaluate import checkpoint_step, model_for_tag

    t0 = time.monotonic()
    eval_tag = evaluated_tag(tag, rec.selected)
    samples_meta = rec.samples_meta or Path(layout.eval_samples_meta(eval_tag))
    source = Path(model_for_tag(cfg, eval_tag, rec.train_done)).resolve()
    step = checkpoint_step(str(source))
    base = Path(cfg.model.path).resolve()
    dest = layout.release_model(tag)
    checks_path = Path(layout.release_checks(tag))
    dest.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(dest)
    checks_path.unlink(missing_ok=True)  # an earlier job's checks never stand for this one
    staging = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    try:
        origin = stage(source, base, staging)
        rate, why = bias_update_rate(rec.plan)
        base_st, base_results = headers(base, threads)
        bad_base = [r for r in base_results if r.status != "pass"]
        if bad_base:
            raise ReleaseError(f"{base}: the base model's headers do not read: "
                               + "; ".join(r.details for r in bad_base))
        st, results = headers(staging, threads)
        results.insert(0, check_tokenizer(source, base))
        mtp = mtp_policy(cfg, rec.plan, base, base_st.tensors)
        results.insert(1, check_config(staging, base, mtp, cfg.release.config_may_differ))
        results.insert(2, check_encodings(staging, samples_meta))
        results.append(check_inventory(base_st.tensors, st.tensors, base, mtp, staging))
        results.append(check_fixed(base, staging, base_st.tensors, st.tensors, rate, why))
        gen, answers = check_generates(
            staging, rec.val, cfg, work=checks_path.parent / "generates",
            runtime_env=rec.runtime_env)
        results.append(gen)
        results.append(copy_report(rec.report, staging, eval_tag, step))
        results.append(write_card(staging, cfg, tag, eval_tag, step, rec, base, mtp))
        manifest = file_manifest(staging, threads)  # every file's sha256, for release.json
        results.append(check_evaluated(manifest, samples_meta, staging))
        extra = {"tag": tag, "evaluated_tag": eval_tag, "step": step, "source": str(source),
                 "base": str(base), "dir": str(dest),
                 "size": {"files": len(manifest),
                          "bytes": sum(f["size"] for f in manifest.values())}}
        doc = ck.write_report(checks_path, results, extra)
        print("\n".join(ck.summary_lines(results)), flush=True)
        if not doc["ok"]:
            raise ReleaseFailed(ck.failure_message(doc, f"release {tag} of {source}",
                                                   checks_path)
                                + f"; nothing was released to {dest}")
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        # The record of an earlier release never stands for the directory replacing it.
        Path(layout.release_record(tag)).unlink(missing_ok=True)
        if dest.exists():
            os.replace(dest, old)
        os.replace(staging, dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"release {tag}: {eval_tag} (step {step}) -> {dest}", flush=True)
    hub = None
    if cfg.release.hub is not None:  # only a release in place, every check passed
        hub = upload(cfg.release.hub, tag, dest, manifest,
                     message=f"{cfg.run.name} {tag}: {eval_tag} (step {step}), released by "
                             "hy3rl with every check passed")
        print(f"release {tag}: pushed {hub['pushed']} files to {hub['repo']} "
              f"({hub['revision']}): commit {hub['commit']}", flush=True)
    record = {"schema_version": 1, "created": utc_now(), **extra,
              "samples_meta": str(samples_meta), "origin": origin, "files": manifest,
              "generated": answers, "checks": str(checks_path), "counts": doc["counts"],
              "hub": hub, "seconds": round(time.monotonic() - t0, 2)}
    token = os.environ.get("HF_TOKEN")
    if token and token in json.dumps(record):
        raise ReleaseError(f"{layout.release_record(tag)}: refusing to write it: it would "
                           "contain HF_TOKEN")
    write_json_atomic(Path(layout.release_record(tag)), record)
    return record


def run(cfg: Any, tag: str, *, inputs: Any, out: Path, threads: int) -> dict[str, Any]:
    """Rule release_model (scripts/adapters/release_model.py): :func:`build` of ``tag`` from the
    rule's named ``inputs`` (a mapping: val, summary, and what the run has of selected,
    plan, train_done, lock, data_summary, rehearsal); ``out`` is the layout's release.json."""
    from hy3rl.layout import Layout

    layout = Layout.from_config(cfg)
    if Path(out) != Path(layout.release_record(tag)):
        raise ReleaseError(f"{out}: not the layout's release record of {tag} "
                           f"({layout.release_record(tag)})")

    def opt(key: str) -> Path | None:
        return Path(inputs[key]) if key in inputs else None

    rec = Records(val=Path(inputs["val"]), summary=Path(inputs["summary"]),
                  plan=opt("plan"), selected=opt("selected"), train_done=opt("train_done"),
                  lock=opt("lock"), data_summary=opt("data_summary"),
                  rehearsal=opt("rehearsal"), report=opt("report"),
                  runtime_env=opt("runtime_env"))
    return build(cfg, layout, tag, rec, threads=threads)
