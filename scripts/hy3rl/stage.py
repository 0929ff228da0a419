"""One pipeline stage of the real Hy3 for the rehearsal's ``shape: stage`` (issue 28).

The paper trains Hy3 at PP 16: each GPU holds 80 / 16 = 5 decoder layers at the real
hidden size, heads, FFN sizes and 192 experts (24 a rank at EP 8), and the first and last
stages hold the 120,832-token embedding and output layer. The small rehearsal model says
nothing about memory at those sizes; this module builds a checkpoint that does:

- :func:`stage_config`: the real model's ``config.json`` with ``num_hidden_layers`` =
  layers / PP, the layers of the run's heaviest stage (:func:`heaviest_offset`: the stage
  with the most MoE layers; Hy3: stage 1, real layers 5-9, five MoE), every per-layer list
  cut to them and ``first_k_dense_replace`` to their dense prefix; everything else (hidden
  size, heads, experts, top-k, FFN sizes, vocabulary, MTP, rope) stays the real one's.
- :func:`inventory`: the stage's tensors (names, dtypes, shapes; hy3rl.checkpoint's
  expected inventory of its config): those layers renumbered from 0, the MTP layer after
  them, the embedding, final norm and output layer. So the stage holds the heaviest real
  stage's layers and the first and the last stage's extra weights at once: at least the
  static memory of any real stage (hy3rl.stage_memory; the activations in flight it
  predicts).
- :func:`check_against_real`: every stage tensor against the real checkpoint's, header-only
  (the safetensors headers of the shards that hold those layers; the real config's
  expected inventory where no shard is on disk): same name (the layers and the MTP layer
  renumbered), dtype and shape.
- :func:`build_stage`: random weights written shard by shard (one shard in host memory at
  a time, ``shard_bytes`` each), the real tokenizer files copied, written to a temporary
  sibling and renamed into place (no half-written checkpoint).
- :func:`per_gpu`: the per-GPU shapes and lengths a plan implies (layers per PP stage,
  experts per EP rank, heads per TP rank, CP, token limits, the rollout's weights and KV
  budget per GPU), for the run's plan and the rehearsal's, side by side in the rehearsal
  plan (hy3rl.rehearsal.plan).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hy3rl.checkpoint import (
    DTYPE_SIZES,
    Expected,
    expected_inventory,
    model_shape,
    read_header,
)
from hy3rl.errors import StageError
from hy3rl.preflight.rules import to_int
from hy3rl.verl_log import finite_number

log = logging.getLogger(__name__)

SHARD_BYTES = 2 * 1024**3  # one shard in host memory at a time while building
STAGE_RECORD = "stage-hy3.json"
# files of the real checkpoint that are not copied into the stage (its own are written)
NOT_COPIED = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.gguf)$|^model\.safetensors\.index"
                        r"\.json$|^config\.json$|^pytorch_model\.bin\.index\.json$|^tiny-hy3\.json$")
COPY_MAX_BYTES = 64 * 1024**2  # tokenizer, generation and template files are small


class StageBuildError(StageError):
    """The stage cannot be derived from the real model, or does not match it."""


def _layer(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StageBuildError(f"{path}: the real model's config is unreadable ({exc})") from None
    if not isinstance(cfg, dict):
        raise StageBuildError(f"{path}: not a JSON object")
    return cfg


def stage_layers(real: Mapping[str, Any], pp: int, where: str = "config.json") -> int:
    """Decoder layers one pipeline stage holds: num_hidden_layers / PP (must divide)."""
    n = real.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise StageBuildError(f"{where}: num_hidden_layers = {n!r} is not a positive integer")
    if pp < 1 or n % pp:
        raise StageBuildError(f"{where}: num_hidden_layers = {n} does not split into {pp} "
                              "pipeline stages (the run's ACTOR_PP): no stage to rehearse")
    return n // pp


def heaviest_offset(real: Mapping[str, Any], pp: int, where: str = "config.json") -> int:
    """The first real layer of the run's heaviest layer mix: the pipeline stage holding the
    most MoE layers (the first of them; Hy3 at PP 16: stage 1, layers 5-9, five MoE)."""
    k = stage_layers(real, pp, where)
    ms, problems = model_shape(dict(real))
    if ms is None:
        raise StageBuildError(f"{where}: {'; '.join(problems)}")
    moe = [sum(1 for i in range(s * k, (s + 1) * k) if ms.kind_of(i) == "moe")
           for s in range(pp)]
    return moe.index(max(moe)) * k


def stage_config(real: Mapping[str, Any], pp: int, where: str = "config.json"
                 ) -> tuple[dict[str, Any], list[str]]:
    """The stage's config and the per-layer keys cut to its layers (see the module doc):
    the layers of the run's heaviest stage (:func:`heaviest_offset`), renumbered from 0."""
    n = real["num_hidden_layers"] if isinstance(real.get("num_hidden_layers"), int) else None
    k = stage_layers(real, pp, where)
    off = heaviest_offset(real, pp, where)
    cfg = json.loads(json.dumps(dict(real)))
    cut = []
    for key, value in real.items():
        if isinstance(value, list) and len(value) == n and key != "architectures":
            cfg[key] = list(value[off:off + k])
            cut.append(key)
    if isinstance(real.get("first_k_dense_replace"), int):
        cfg["first_k_dense_replace"] = max(0, min(real["first_k_dense_replace"], off + k) - off)
    cfg["num_hidden_layers"] = k
    ms, problems = model_shape(cfg)
    if ms is None:
        raise StageBuildError(f"{where}: {'; '.join(problems)}")
    if not ms.moe:
        raise StageBuildError(f"{where}: every stage's {k} layers are all dense "
                              f"(first_k_dense_replace = {real.get('first_k_dense_replace')}): "
                              "the stage would hold no expert")
    return cfg, sorted(cut)


def inventory(cfg: Mapping[str, Any]) -> dict[str, Expected]:
    ms, problems = model_shape(dict(cfg))
    if ms is None:
        raise StageBuildError("; ".join(problems))
    return expected_inventory(ms)


def _nbytes(e: Expected) -> int:
    return math.prod(e.shape) * DTYPE_SIZES[e.dtype]


def stage_bytes(cfg: Mapping[str, Any]) -> int:
    return sum(_nbytes(e) for e in inventory(cfg).values())


def real_name(name: str, layers: int, real_layers: int, offset: int = 0) -> str:
    """The real checkpoint's name of a stage tensor: stage layer ``i`` is the real ``offset +
    i`` (the heaviest stage's layers), the MTP layer (stage layer ``layers + j``) the real
    ``real_layers + j``; every other name is the same."""
    i = _layer(name)
    if i is None:
        return name
    j = offset + i if i < layers else real_layers + i - layers
    return name.replace(f"model.layers.{i}.", f"model.layers.{j}.", 1)


def _real_headers(real_dir: Path, wanted: set[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """dtype and shape of every tensor in the real shards that hold any of ``wanted`` (the
    index says which), from their headers only; {} when those shards are not on disk."""
    index = real_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            files = {wmap[n] for n in wanted if n in wmap}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StageBuildError(f"{index}: unreadable weight_map ({exc})") from None
    else:
        files = {p.name for p in real_dir.glob("*.safetensors")}
    out = {}
    for f in sorted(files):
        path = real_dir / f
        if not path.is_file():
            return {}  # not downloaded (the index only): the config decides
        shard = read_header(path)
        if shard.error:
            raise StageBuildError(f"{path}: {shard.error}")
        out.update({n: (i.dtype, i.shape) for n, i in shard.tensors.items()})
    return out


def check_against_real(stage_cfg: Mapping[str, Any], real_dir: Path,
                       real_cfg: Mapping[str, Any], offset: int = 0) -> dict[str, Any]:
    """The stage's inventory against the real checkpoint's (module doc): each stage tensor
    has the real one's dtype and shape, and each real tensor of the layers the stage holds
    (real layers ``offset`` on, the MTP layer, the embedding, final norm and output) is in
    the stage. Returns the record (``against``: ``headers`` or ``config``, ``tensors``,
    ``problems``)."""
    layers, real_layers = stage_cfg["num_hidden_layers"], real_cfg["num_hidden_layers"]
    mtp = int(stage_cfg.get("num_nextn_predict_layers") or 0)
    inv = inventory(stage_cfg)
    names = {n: real_name(n, layers, real_layers, offset) for n in inv}
    real = _real_headers(Path(real_dir), set(names.values()))
    against = "headers" if real else "config"
    if not real:
        real = {n: (e.dtype, e.shape) for n, e in inventory(real_cfg).items()}
    problems = []
    for n, e in inv.items():
        r = real.get(names[n])
        if r is None:
            problems.append(f"{n}: the real checkpoint has no {names[n]}")
        elif (e.dtype, tuple(e.shape)) != (r[0], tuple(r[1])):
            problems.append(f"{n}: stage {e.dtype}{list(e.shape)}, real {names[n]} "
                            f"{r[0]}{list(r[1])}")
    held = set(names.values())
    for n in sorted(real):
        i = _layer(n)
        if (i is None or offset <= i < offset + layers or real_layers <= i < real_layers + mtp) \
                and n not in held:
            problems.append(f"{n}: in the real checkpoint, not in the stage")
    return {"against": against, "tensors": len(inv), "problems": problems[:50],
            "problem_count": len(problems)}


def _random_tensor(name: str, e: Expected, gen: Any, std: float) -> Any:
    import torch

    dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[e.dtype]
    if name.endswith(".mlp.expert_bias"):
        # non-zero and distinct per layer: an unloaded bias (zeros) stays detectable
        return (0.05 * torch.randn(e.shape, generator=gen) + 0.01).to(dtype)
    if name.endswith("norm.weight"):
        return torch.ones(e.shape, dtype=dtype)
    t = torch.empty(e.shape, dtype=torch.float32)
    t.normal_(0.0, std, generator=gen)
    return t.to(dtype)


def _groups(inv: Mapping[str, Expected], shard_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, e in inv.items():
        n = _nbytes(e)
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def build_stage(real_dir: str | Path, out_dir: str | Path, *, pp: int, seed: int = 0,
                shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Build the stage of the real model at ``real_dir`` for ``pp`` pipeline stages into
    ``out_dir`` (absent or empty). Returns the record written as ``stage-hy3.json``."""
    import torch
    from safetensors.torch import save_file

    real_dir, out = Path(real_dir), Path(out_dir)
    real_cfg = read_config(real_dir)
    where = str(real_dir / "config.json")
    cfg, cut = stage_config(real_cfg, pp, where)
    offset = heaviest_offset(real_cfg, pp, where)
    check = check_against_real(cfg, real_dir, real_cfg, offset)
    if check["problems"]:
        raise StageBuildError(
            f"{real_dir}: the stage's tensors differ from the real checkpoint's "
            f"({check['problem_count']}, against its {check['against']}): "
            + "; ".join(check["problems"][:5]))
    if out.exists() and any(out.iterdir()):
        raise StageBuildError(f"{out}: exists and is not empty; choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    inv = inventory(cfg)
    groups = _groups(inv, shard_bytes)
    std = float(real_cfg.get("initializer_range") or 0.02)
    gen = torch.Generator().manual_seed(seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        weight_map, total = {}, 0
        for i, group in enumerate(groups, 1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            tensors = {n: _random_tensor(n, inv[n], gen, std) for n in group}
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(group, fname))
            del tensors
            log.info("stage: wrote %s (%d tensors)", fname, len(group))
        params = sum(math.prod(e.shape) for e in inv.values())
        (tmp / "model.safetensors.index.json").write_text(json.dumps({
            "metadata": {"total_parameters": params, "total_size": total},
            "weight_map": weight_map}, indent=2) + "\n")
        cfg["architectures"] = real_cfg.get("architectures") or ["HYV3ForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        copied = []
        for f in sorted(real_dir.iterdir()):
            if (f.is_file() and not NOT_COPIED.search(f.name) and f.name != STAGE_RECORD
                    and f.stat().st_size <= COPY_MAX_BYTES):
                shutil.copy2(f, tmp / f.name)
                copied.append(f.name)
        record = {
            "shape": "stage", "of": str(real_dir), "pipeline_stages": pp,
            "layers": cfg["num_hidden_layers"], "real_layers": real_cfg["num_hidden_layers"],
            "real_layers_held": [offset, offset + cfg["num_hidden_layers"] - 1],
            "stage_of_run": offset // cfg["num_hidden_layers"],
            "mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0),
            "per_layer_keys_cut": cut, "seed": seed, "shards": len(groups),
            "parameters": params, "total_size": total, "copied": copied,
            "inventory_check": check,
            "note": "random weights; built by hy3rl.stage (rule rehearsal_model, shape stage)",
        }
        (tmp / STAGE_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("stage: %s: %d layers + %d MTP of %s, %d tensors, %.1f GB in %d shards", out,
             record["layers"], record["mtp_layers"], real_dir, len(inv), total / 1e9,
             len(groups))
    return record


# --------------------------------------------------------------------------- per GPU


# the per-GPU figures that must be equal between the run's plan and a stage rehearsal's:
# the training layout and lengths, and vLLM's load an engine (hy3rl.stage_memory.rollout:
# its KV capacity in tokens within KV_TOLERANCE, its requests a step, max_num_seqs, the KV
# dtype), not its budget in GB (a stage's bytes a token differ from the run's)
SAME = ("layers_per_pp_stage", "experts_per_ep_rank", "attention_heads_per_tp_rank",
        "kv_heads_per_tp_rank", "hidden_size", "moe_intermediate_size", "intermediate_size",
        "vocab_size", "num_experts_per_tok", "mtp_layers", "context_parallel",
        "max_prompt_length", "max_response_length", "ppo_max_token_len_per_gpu",
        "ref_log_prob_max_token_len_per_gpu", "rollout_log_prob_max_token_len_per_gpu",
        "rollout_max_model_len", "rollout_kv_tokens", "rollout_requests_per_engine",
        "rollout_max_num_seqs", "rollout_kv_dtype")
KV_TOLERANCE = 0.01  # the rehearsal's KV capacity within 1 % of the run's (and not below it)


def per_gpu(model_cfg: Mapping[str, Any], eff: Mapping[str, Any], *,
            gpu_memory_gb: float | None, model_bytes: int | None) -> dict[str, Any]:
    """The per-GPU shapes and lengths of a plan (``eff``: its effective verl values) for the
    model of ``model_cfg`` (its config.json) of ``model_bytes`` bytes, and vLLM's figures
    a GPU and an engine (hy3rl.stage_memory.rollout; None where the config cannot say)."""
    from hy3rl.stage_memory import MemoryModelError, rollout

    a = "actor_rollout_ref.actor.megatron."
    tp, pp = to_int(eff.get(a + "tensor_model_parallel_size"), 1), to_int(
        eff.get(a + "pipeline_model_parallel_size"), 1)
    cp, ep = to_int(eff.get(a + "context_parallel_size"), 1), to_int(
        eff.get(a + "expert_model_parallel_size"), 1)
    n, e = to_int(model_cfg.get("num_hidden_layers"), None), to_int(
        model_cfg.get("num_experts"), None)
    nh, nkv = to_int(model_cfg.get("num_attention_heads"), None), to_int(
        model_cfg.get("num_key_value_heads"), None)
    rtp = to_int(eff.get("actor_rollout_ref.rollout.tensor_model_parallel_size"), 1)
    gpus = to_int(eff.get("trainer.nnodes"), 1) * to_int(eff.get("trainer.n_gpus_per_node"), 1)
    try:
        vllm = rollout(model_cfg, eff, gpus=gpus, gpu_memory_gb=gpu_memory_gb,
                       model_bytes=model_bytes)
    except MemoryModelError:
        vllm = {}
    return {
        "layers_per_pp_stage": None if n is None else n / pp,
        "experts_per_ep_rank": None if e is None else e / ep,
        "attention_heads_per_tp_rank": None if nh is None else nh / tp,
        "kv_heads_per_tp_rank": None if nkv is None else max(nkv / tp, 1),
        "hidden_size": model_cfg.get("hidden_size"),
        "moe_intermediate_size": model_cfg.get("moe_intermediate_size"),
        "intermediate_size": model_cfg.get("intermediate_size"),
        "vocab_size": model_cfg.get("vocab_size"),
        "num_experts_per_tok": model_cfg.get("num_experts_per_tok"),
        "mtp_layers": int(model_cfg.get("num_nextn_predict_layers") or 0),
        "context_parallel": cp,
        "max_prompt_length": to_int(eff.get("data.max_prompt_length"), None),
        "max_response_length": to_int(eff.get("data.max_response_length"), None),
        "ppo_max_token_len_per_gpu": to_int(
            eff.get("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), None),
        "ref_log_prob_max_token_len_per_gpu": to_int(
            eff.get("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"), None),
        "rollout_log_prob_max_token_len_per_gpu": to_int(
            eff.get("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"), None),
        "rollout_max_model_len": to_int(eff.get("actor_rollout_ref.rollout.max_model_len"), None),
        "rollout_tp": rtp,
        "rollout_gpu_memory_utilization": finite_number(
            eff.get("actor_rollout_ref.rollout.gpu_memory_utilization")),
        "rollout_weights_gb": vllm.get("weights_gb"),
        "rollout_kv_budget_gb": vllm.get("kv_budget_gb"),
        "rollout_kv_bytes_per_token": vllm.get("kv_bytes_per_token"),
        "rollout_kv_tokens": vllm.get("kv_tokens"),
        "rollout_full_sequences": vllm.get("full_sequences"),
        "rollout_engines": vllm.get("engines"),
        "rollout_requests_per_engine": vllm.get("requests_per_engine"),
        "rollout_max_num_seqs": vllm.get("max_num_seqs"),
        "rollout_kv_dtype": vllm.get("kv_dtype"),
        "gpu_memory_gb": gpu_memory_gb,
    }


def compare(run: Mapping[str, Any], rehearsal: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The :data:`SAME` figures that differ (the KV capacity: below the run's, or more than
    :data:`KV_TOLERANCE` above it)."""
    out = []
    for key in SAME:
        a, b = run.get(key), rehearsal.get(key)
        if key == "rollout_kv_tokens" and a is not None and b is not None:
            if a <= b <= a * (1 + KV_TOLERANCE):
                continue
        elif a == b:
            continue
        out.append({"key": key, "run": a, "rehearsal": b})
    return out


def run(cfg: Any, *, out: Path, plan: Path, threads: int = 1) -> dict[str, Any]:
    """Rule rehearsal_model with ``rehearsal.shape: stage``: the stage of ``model.path`` at
    the run's pipeline size (``plan``: the run's preflight/plan.json, effective values)."""
    import torch

    try:
        eff = json.loads(Path(plan).read_text())["effective"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StageBuildError(f"{plan}: the run's plan has no effective values ({exc})") \
            from None
    key = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"
    pp = to_int(eff.get(key), None)
    if pp is None or pp < 1:
        raise StageBuildError(f"{plan}: effective {key} = {eff.get(key)!r} is not a positive "
                              "integer")
    torch.set_num_threads(max(1, int(threads)))
    return build_stage(cfg.model.path, out, pp=pp, seed=cfg.rehearsal.model.seed)
