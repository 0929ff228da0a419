"""Per-GPU memory of every pipeline stage of a Megatron plan, and vLLM's KV capacity and
load per engine (issue 43; docs/formats/rehearsal.md "What the stage proves").

The rehearsal's ``stage`` shape trains one pipeline stage on one node; the run trains
``PP`` stages whose layer mixes, extra weights and activations in flight differ. This
module predicts each real stage's peak from the plan (its effective verl values) and the
model's config, in the terms the paper plan's hand computation uses:

- **static training memory**: every parameter of the stage on a GPU, its bf16 weight
  (:data:`WEIGHT_BYTES`), its fp32 main grad (:data:`GRAD_BYTES`) and the optimizer's fp32
  master copy and two Adam moments (:data:`OPTIM_BYTES`), the optimizer sharded over the
  data-parallel group with context parallel (dense parameters: ``world / (TP x PP)``
  ranks) or the expert data-parallel group (experts: ``world / (PP x EP x ETP)``) when
  ``use_distributed_optimizer`` (verl's default); dense parameters split by TP, experts by
  EP x ETP. The expert bias is an fp32 buffer (no grad, no optimizer state). The MTP layer
  counts only when ``actor_rollout_ref.model.mtp.enable`` (verl builds it then, on the last
  stage). Offload (``param_offload``, ``optimizer_offload``) moves these off the GPU between
  phases, not during the update, so the update's peak holds them all.
- **activations stored by the schedule**: with full recompute (``recompute_granularity:
  full``, ``recompute_method: uniform``, ``recompute_num_layers: k``, the pinned launch
  script's), a microbatch stores each group of ``k`` layers' input, ``tokens x hidden`` in
  bf16 (split by TP under sequence parallelism); ``tokens`` a GPU is
  ``ppo_max_token_len_per_gpu`` with dynamic batching (verl packs ``x CP`` tokens a
  microbatch and CP splits them); under 1F1B stage ``s`` holds ``PP - s`` microbatches at
  the end of its warm-up (Megatron's schedule: ``PP - s - 1`` warm-up forwards and one
  more), with virtual pipelining ``v`` the interleaved schedule's ``2 (PP - s - 1) + (v -
  1) PP + 1`` model chunks of ``1/v`` of the stage. An upper bound when a mini-batch has
  fewer microbatches than PP. Other recompute settings are not modeled: the stage's
  prediction then has ``activations: null`` and its reason.

Not modeled (named in the record): transient peaks (the output layer's logits, the
recomputed layer's working set, communication buffers). The rehearsal measures them on its
stage, which holds the output layer: :func:`from_measured` adds the predicted difference
between a real stage and the rehearsal's stage to the peak the rehearsal logged.

The rollout (:func:`rollout`): vLLM loads every tensor but the MTP layer's (it skips
``model.layers.<num_hidden_layers>.*`` without speculative decoding), split by the rollout
TP; its KV cache takes what ``gpu_memory_utilization`` leaves of the GPU, at ``2 x
KV heads a rank (at least one: vLLM replicates them when TP exceeds them) x head_dim x
dtype bytes x layers`` bytes a token; each engine (``TP`` GPUs) serves ``batch x n /
engines`` requests a step, ``max_num_seqs`` at a time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from hy3rl.checkpoint import DTYPE_SIZES, ModelShape, expected_inventory, model_shape
from hy3rl.preflight.rules import to_int, truthy
from hy3rl.verl_log import finite_number

GB = 1e9  # as cluster.gpu_memory_gb and preflight's memory rules count a GB
WEIGHT_BYTES = 2  # bf16 parameters
GRAD_BYTES = 4  # Megatron's main grads, fp32
OPTIM_BYTES = 12  # fp32 master copy + Adam's exp_avg and exp_avg_sq
ACT_BYTES = 2  # a stored layer input, bf16
A = "actor_rollout_ref.actor.megatron."
R = "actor_rollout_ref.rollout."
RECOMPUTE = A + "override_transformer_config"
# the dtypes vLLM's KV cache can take from verl's rollout.dtype (kv_cache_dtype "auto")
KV_DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
                  "float32": 4, "fp32": 4, "float": 4}
NOT_MODELED = ("transient peaks: the output layer's logits, the recomputed layer's working "
               "set, communication buffers (the rehearsal's measured peak holds them for "
               "its stage)")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MemoryModelError(ValueError):
    """The model's config or the plan does not give what the prediction needs."""


def _parallel(eff: Mapping[str, Any], world: int) -> dict[str, Any]:
    tp, pp = to_int(eff.get(A + "tensor_model_parallel_size"), 1), to_int(
        eff.get(A + "pipeline_model_parallel_size"), 1)
    cp = to_int(eff.get(A + "context_parallel_size"), 1)
    ep, etp = to_int(eff.get(A + "expert_model_parallel_size"), 1), to_int(
        eff.get(A + "expert_tensor_parallel_size"), 1)
    vpp = to_int(eff.get(A + "virtual_pipeline_model_parallel_size"), None)
    dist = eff.get(A + "use_distributed_optimizer")
    dist = True if dist is None else truthy(dist)
    if min(tp, pp, cp, ep, etp) < 1 or world < 1 or world % (tp * pp * cp) \
            or world % (pp * ep * etp):
        raise MemoryModelError(
            f"TP {tp} x PP {pp} x CP {cp} or PP x EP {ep} x ETP {etp} does not divide the "
            f"{world} GPUs")
    return {"world": world, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp,
            "vpp": vpp if vpp and vpp > 1 else None, "distributed_optimizer": dist,
            "dense_shards": world // (tp * pp) if dist else 1,
            "expert_shards": world // (pp * ep * etp) if dist else 1}


def _shape(model_cfg: Mapping[str, Any]) -> ModelShape:
    """The config's layer kinds (hy3rl.checkpoint.model_shape), or what prevents knowing them
    as a :class:`MemoryModelError`."""
    ms, problems = model_shape(dict(model_cfg))
    if ms is None:
        raise MemoryModelError("; ".join(problems))
    return ms


def _counts(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters of the model by where they live: per decoder layer ``dense`` / ``expert``
    / ``buffer`` (the fp32 expert bias) counts, the MTP layer's, the embedding, and the
    output (lm_head, or the tied embedding's copy, and the final norm)."""
    ms = _shape(model_cfg)
    n = ms.layers
    layers = [{"dense": 0, "expert": 0, "buffer": 0} for _ in range(n + len(ms.mtp))]
    embed = output = 0
    for name, e in expected_inventory(ms).items():
        numel = math.prod(e.shape)
        m = _LAYER.match(name)
        if m:
            row = layers[int(m.group(1))]
            if e.dtype == "F32":
                row["buffer"] += numel
            elif ".mlp.experts." in name:
                row["expert"] += numel
            else:
                row["dense"] += numel
        elif name == "model.embed_tokens.weight":
            embed += numel
        else:  # lm_head, the final norm
            output += numel
    if model_cfg.get("tie_word_embeddings"):
        output += embed  # Megatron keeps the output layer's copy on the last stage
    return {"layers": layers[:n], "mtp": layers[n:], "embedding": embed, "output": output,
            "hidden": int(model_cfg["hidden_size"]), "kinds": [ms.kind_of(i) for i in range(n)]}


def _activation(eff: Mapping[str, Any], par: Mapping[str, Any], hidden: int,
                layers: int) -> tuple[float | None, str]:
    """Bytes a microbatch stores on one GPU of a stage of ``layers`` layers, and the terms;
    None with the reason where the plan's recompute is not modeled."""
    rc = eff.get(RECOMPUTE)
    rc = rc if isinstance(rc, Mapping) else {}
    gran, method, k = rc.get("recompute_granularity"), rc.get("recompute_method"), to_int(
        rc.get("recompute_num_layers"), None)
    if gran != "full" or method != "uniform" or not k:
        return None, (f"not modeled: recompute_granularity {gran!r}, recompute_method "
                      f"{method!r}, recompute_num_layers {k!r} (only full/uniform is)")
    if truthy(eff.get("actor_rollout_ref.actor.use_dynamic_bsz")):
        tokens = to_int(eff.get("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), None)
        how = "ppo_max_token_len_per_gpu"
    else:
        mbs = to_int(eff.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"), None)
        seq = (to_int(eff.get("data.max_prompt_length"), 0)
               + to_int(eff.get("data.max_response_length"), 0))
        tokens = None if not mbs else mbs * seq // par["cp"]
        how = "ppo_micro_batch_size_per_gpu x (max_prompt_length + max_response_length) / CP"
    if not tokens:
        return None, f"not modeled: no token count a microbatch ({how})"
    stored = math.ceil(layers / k)
    per = stored * tokens * hidden * ACT_BYTES / par["tp"]
    return per, (f"{stored} layer input(s) (full recompute, {k} a group) x {tokens} tokens "
                 f"({how}) x hidden {hidden} x {ACT_BYTES} B" + (
                     f" / TP {par['tp']}" if par["tp"] > 1 else ""))


def _in_flight(pp: int, s: int, vpp: int | None) -> float:
    """Microbatches (in whole-stage units) stage ``s`` holds at its peak under Megatron's
    1F1B schedule (interleaved with ``vpp`` model chunks)."""
    if not vpp:
        return float(pp - s)
    return (2 * (pp - s - 1) + (vpp - 1) * pp + 1) / vpp


def stages(model_cfg: Mapping[str, Any], eff: Mapping[str, Any], world: int
           ) -> dict[str, Any]:
    """Every pipeline stage's predicted peak on one GPU (module doc): ``stages`` (per stage
    its layers, layer mix, embedding/output, parameters, ``static_gb``,
    ``activation_gb`` a microbatch, ``in_flight``, ``stored_gb``, ``peak_gb``), ``worst``
    (the stage of the largest peak), ``parallel`` and the ``terms``."""
    par = _parallel(eff, world)
    c = _counts(model_cfg)
    n, pp = len(c["layers"]), par["pp"]
    if n % pp:
        raise MemoryModelError(f"num_hidden_layers {n} does not split into PP {pp} stages")
    per_stage = n // pp
    mtp = truthy(eff.get("actor_rollout_ref.model.mtp.enable"))
    out = []
    for s in range(pp):
        idx = list(range(s * per_stage, (s + 1) * per_stage))
        rows = [c["layers"][i] for i in idx] + (c["mtp"] if mtp and s == pp - 1 else [])
        dense = sum(r["dense"] for r in rows) + (c["embedding"] if s == 0 else 0) + (
            c["output"] if s == pp - 1 else 0)
        expert = sum(r["expert"] for r in rows)
        buffers = sum(r["buffer"] for r in rows)
        static = (dense / par["tp"] * (WEIGHT_BYTES + GRAD_BYTES
                                       + OPTIM_BYTES / par["dense_shards"])
                  + expert / (par["ep"] * par["etp"]) * (WEIGHT_BYTES + GRAD_BYTES
                                                         + OPTIM_BYTES / par["expert_shards"])
                  + buffers * 4)
        act, act_terms = _activation(eff, par, c["hidden"], len(rows))
        flight = _in_flight(pp, s, par["vpp"])
        stored = None if act is None else act * flight
        kinds = [c["kinds"][i] for i in idx]
        mix = ", ".join(f"{kinds.count(k)} {'MoE' if k == 'moe' else k}"
                        for k in ("dense", "moe") if kinds.count(k)) + (
            " + MTP" if mtp and s == pp - 1 and c["mtp"] else "")
        extra = [w for w, on in (("embedding", s == 0), ("output", s == pp - 1)) if on]
        out.append({
            "stage": s, "layers": [idx[0], idx[-1]], "mix": mix + "".join(
                f" + {w}" for w in extra),
            "dense_params": dense, "expert_params": expert,
            "static_gb": round(static / GB, 4),
            "activation_gb": None if act is None else round(act / GB, 4),
            "activation_terms": act_terms, "in_flight": flight,
            "stored_gb": None if stored is None else round(stored / GB, 4),
            "peak_gb": round((static + (stored or 0.0)) / GB, 4),
            "complete": act is not None})
    worst = max(out, key=lambda r: r["peak_gb"])["stage"]
    return {"stages": out, "worst": worst, "parallel": par, "mtp_trained": mtp,
            "terms": (f"static: dense parameters / TP x ({WEIGHT_BYTES} + {GRAD_BYTES} + "
                      f"{OPTIM_BYTES} / {par['dense_shards']}) B, experts / (EP x ETP) x "
                      f"({WEIGHT_BYTES} + {GRAD_BYTES} + {OPTIM_BYTES} / "
                      f"{par['expert_shards']}) B; stored: activation a microbatch x "
                      "microbatches in flight (1F1B: PP - stage"
                      + (f", interleaved over {par['vpp']} chunks" if par["vpp"] else "")
                      + ")"),
            "not_modeled": NOT_MODELED}


def describe(row: Mapping[str, Any]) -> str:
    """One stage's prediction in words, with its terms."""
    head = (f"stage {row['stage']} (layers {row['layers'][0]}-{row['layers'][1]}: "
            f"{row['mix']}): static {row['static_gb']:.2f} GB")
    if row["activation_gb"] is None:
        return (f"{head} + activations {row['activation_terms']} = at least "
                f"{row['peak_gb']:.2f} GB")
    return (f"{head} + {row['in_flight']:g} microbatch(es) in flight x "
            f"{row['activation_gb']:.3f} GB = {row['peak_gb']:.2f} GB")


def from_measured(measured_gb: float, run: Mapping[str, Any], rehearsal: Mapping[str, Any]
                  ) -> list[dict[str, Any]]:
    """Each real stage's peak from the rehearsal's measured one: the measured peak plus the
    predicted difference between the real stage and the rehearsal's stage (both from
    :func:`stages`; the rehearsal's has one stage). What the model leaves out but the
    rehearsal's stage holds (its transients) stays in the measured figure."""
    (reh,) = rehearsal["stages"]
    return [{"stage": r["stage"], "mix": r["mix"],
             "peak_gb": round(measured_gb + r["peak_gb"] - reh["peak_gb"], 2)}
            for r in run["stages"]]


# --------------------------------------------------------------------------- the rollout


def _bytes(model_cfg: Mapping[str, Any]) -> tuple[int, int]:
    """Bytes of the config's tensors: those vLLM loads (all but the MTP layer's), all."""
    ms = _shape(model_cfg)
    loaded = total = 0
    for name, e in expected_inventory(ms).items():
        size = math.prod(e.shape) * DTYPE_SIZES[e.dtype]
        total += size
        m = _LAYER.match(name)
        if not (m and int(m.group(1)) >= ms.layers):
            loaded += size
    return loaded, total


def loaded_bytes(model_cfg: Mapping[str, Any], model_bytes: int | None = None) -> float:
    """What vLLM loads of a checkpoint of ``model_bytes`` bytes (:func:`rollout`)."""
    loaded, total = _bytes(model_cfg)
    return float(loaded) if not model_bytes else model_bytes * loaded / total


def rollout(model_cfg: Mapping[str, Any], eff: Mapping[str, Any], *, gpus: int,
            gpu_memory_gb: float | None, model_bytes: int | None = None) -> dict[str, Any]:
    """vLLM's figures a GPU and an engine (module doc): ``weights_gb`` (no MTP layer: of
    ``model_bytes``, the checkpoint's size where given, the share the config's non-MTP
    tensors hold; else those tensors' bytes),
    ``kv_budget_gb``, ``kv_bytes_per_token``, ``kv_tokens`` (the cache's capacity in
    tokens), ``full_sequences`` (of ``max_prompt_length + max_response_length``),
    ``engines``, ``requests_per_engine`` a step, ``max_num_seqs``; None where the plan
    or the GPU's memory does not give a figure."""
    rtp = to_int(eff.get(R + "tensor_model_parallel_size"), 1)
    util = finite_number(eff.get(R + "gpu_memory_utilization"))
    nkv, nh = to_int(model_cfg.get("num_key_value_heads"), None), to_int(
        model_cfg.get("num_attention_heads"), None)
    hidden, layers = to_int(model_cfg.get("hidden_size"), None), to_int(
        model_cfg.get("num_hidden_layers"), None)
    head_dim = to_int(model_cfg.get("head_dim"), None) or (
        hidden // nh if hidden and nh else None)
    dtype = str(eff.get(R + "dtype") or "bfloat16").lower()
    dbytes = KV_DTYPE_BYTES.get(dtype)
    weights = loaded_bytes(model_cfg, model_bytes) / max(rtp, 1)
    kv_token = (2 * max(nkv // rtp, 1) * head_dim * dbytes * layers
                if nkv and head_dim and dbytes and layers else None)
    budget = (gpu_memory_gb * GB * util - weights
              if gpu_memory_gb and util is not None else None)
    tokens = int(budget // kv_token) if budget is not None and kv_token and budget > 0 else None
    seq = to_int(eff.get("data.max_prompt_length"), 0) + to_int(
        eff.get("data.max_response_length"), 0)
    batch, n = to_int(eff.get("data.train_batch_size"), None), to_int(eff.get(R + "n"), None)
    engines = gpus // rtp if rtp and gpus % rtp == 0 else None
    return {"weights_gb": round(weights / GB, 2),
            "kv_budget_gb": None if budget is None else round(budget / GB, 2),
            "kv_dtype": dtype, "kv_bytes_per_token": kv_token, "kv_tokens": tokens,
            "full_sequences": None if tokens is None or not seq else round(tokens / seq, 1),
            "engines": engines,
            "requests_per_engine": (batch * n / engines if batch and n and engines
                                    else None),
            "max_num_seqs": to_int(eff.get(R + "max_num_seqs"), None)}


def matching_utilization(run: Mapping[str, Any], model_cfg: Mapping[str, Any],
                         eff: Mapping[str, Any], gpu_memory_gb: float,
                         model_bytes: int | None = None) -> float | None:
    """The rehearsal's ``gpu_memory_utilization`` that gives its engines the run's KV
    capacity in tokens: the run's tokens x the stage's bytes a token, plus the stage's
    weights a GPU as vLLM loads them, over the GPU's memory."""
    reh = rollout(model_cfg, {**eff, R + "gpu_memory_utilization": 0.0}, gpus=1,
                  gpu_memory_gb=gpu_memory_gb)
    if run.get("kv_tokens") is None or reh["kv_bytes_per_token"] is None:
        return None
    rtp = max(to_int(eff.get(R + "tensor_model_parallel_size"), 1), 1)
    need = run["kv_tokens"] * reh["kv_bytes_per_token"] + loaded_bytes(model_cfg,
                                                                         model_bytes) / rtp
    return math.ceil(need / (gpu_memory_gb * GB) * 1e4) / 1e4


# --------------------------------------------------------------------------- the plans


def plan_prediction(run_cfg: Mapping[str, Any], run_eff: Mapping[str, Any],
                      reh_cfg: Mapping[str, Any], reh_eff: Mapping[str, Any]
                      ) -> dict[str, Any]:
    """:func:`stages` of the run's plan (every pipeline stage) and of the
    rehearsal's (its one stage), the run's heaviest stage and whether the rehearsal's stage
    holds its layer mix; ``not_run`` (the reason) for a plan it cannot model (not Megatron,
    a model or layout it cannot read)."""
    if run_eff.get("actor_rollout_ref.actor.strategy") != "megatron":
        return {"not_run": f"not run: actor strategy "
                           f"{run_eff.get('actor_rollout_ref.actor.strategy')!r} (the model "
                           "covers Megatron's pipeline stages)"}

    def world(eff: Mapping[str, Any]) -> int:
        return to_int(eff.get("trainer.nnodes"), 0) * to_int(eff.get("trainer.n_gpus_per_node"), 0)

    try:
        run = stages(run_cfg, run_eff, world(run_eff))
        reh = stages(reh_cfg, reh_eff, world(reh_eff))
    except MemoryModelError as exc:
        return {"not_run": f"not run: {exc}"}
    worst = run["stages"][run["worst"]]
    return {"run": run, "rehearsal": reh, "heaviest": worst["stage"],
            "heaviest_mix": worst["mix"], "rehearsal_mix": reh["stages"][0]["mix"]}


def refusal(memory: Mapping[str, Any], gpu_memory_gb: float | None,
                   headroom: float) -> str | None:
    """Why the run cannot fit (its predicted stages above ``headroom`` x the GPU), naming
    each such stage with its terms; None when every stage fits or nothing was predicted."""
    if "run" not in memory or not gpu_memory_gb:
        return None
    limit = headroom * gpu_memory_gb
    over = [r for r in memory["run"]["stages"] if r["peak_gb"] > limit]
    if not over:
        return None
    return (f"the run's predicted peak exceeds {headroom:g} of the {gpu_memory_gb:g} GB GPU "
            f"({limit:.1f} GB) on {len(over)} of {len(memory['run']['stages'])} pipeline "
            "stage(s): " + "; ".join(describe(r) for r in sorted(
                over, key=lambda r: -r["peak_gb"])[:3])
            + f" ({memory['run']['terms']}; not modeled: {memory['run']['not_modeled']})")
