"""Build a tiny random Hy3 (``hy_v3``) checkpoint, deterministically from a seed.

The tiny model has the real architecture at toy sizes, so every stage that cannot afford
the 598 GB checkpoint (CPU evaluation, data token counts, checkpoint and bridge checks)
runs on a checkpoint of the same shape: one dense layer (``first_k_dense_replace=1``),
MoE layers with a handful of routed experts + one shared expert, one MTP layer
(``num_nextn_predict_layers=1``), BF16 weights with F32 non-zero expert biases, in the
on-disk ("inner") tensor names, sharded into several safetensors files with an index,
plus a small byte-level BPE tokenizer (digits split one by one, so AIME answers
tokenize), a chat template and a generation config.

How it is made:
- the weights come from transformers' native ``HYV3ForCausalLM`` (5.6.0) built with
  ``num_hidden_layers + 1`` layers under ``torch.manual_seed(seed)`` and written by
  ``save_pretrained`` (which writes the inner names); its last layer becomes the MTP
  layer's block (transformers does not model MTP), to which the MTP heads ``enorm``,
  ``hnorm``, ``eh_proj``, ``final_layernorm`` are added in the real checkpoint's names;
- the tensors are then re-sharded by us (natural name order, near-equal byte size) so
  the shard count is a parameter and the files are byte-identical for the same seed.

Entry point: :func:`run` (rule ``tiny_model`` through ``scripts/adapters/tiny_model.py``,
into ``hy3rl.layout.TINY_MODEL_DIR``; by hand, ``hy3rl tiny_model --configfile ...``).
:func:`build_tiny_model` is the builder itself (tests, the bridge check). This module does
not import the config machinery: the bridge check runs it inside the GPU runtime.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hy3rl.errors import StageError

if TYPE_CHECKING:
    from hy3rl.settings import TinyModel

log = logging.getLogger("hy3rl.model")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    "problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


class ModelError(StageError):
    """The tiny model cannot be built with these sizes, or its output directory is taken."""


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny model: ``model.tiny`` (the schema holds their defaults), then
    the fixed shapes no config key sets."""

    seed: int
    num_hidden_layers: int  # layer 0 dense, the rest MoE; the MTP layer comes on top
    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    vocab_size: int  # the BPE fills it exactly (its corpus yields more merges)
    num_shards: int
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    max_position_embeddings: int = 32768

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, Any]) -> TinySpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(sizes) - known)
        if unknown:
            raise ValueError(f"model.tiny: unknown keys {unknown}")
        spec = cls(**sizes)
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.num_hidden_layers < 2:
            raise ValueError("model.tiny.num_hidden_layers must be >= 2 (one dense + MoE)")
        if self.num_shards < 2:
            raise ValueError("model.tiny.num_shards must be >= 2")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("model.tiny.num_experts_per_tok must be <= num_experts")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model.tiny.num_attention_heads must be a multiple of "
                             "num_key_value_heads")
        if self.vocab_size < 300 + len(SPECIAL_TOKENS):
            raise ValueError("model.tiny.vocab_size must be >= 306 (byte alphabet + specials)")


# ---------------------------------------------------------------------------- tokenizer


def math_corpus(seed: int) -> list[str]:
    """A small deterministic corpus of math text (prompts, numbers, LaTeX, answers)."""
    import random

    rng = random.Random(seed)
    templates = [
        "Find the remainder when ${a}^{{{b}}}$ is divided by ${c}$.",
        "Let $x$ and $y$ be real numbers such that $x + y = {a}$ and $xy = {b}$. Find $x^2 + y^2$.",
        "How many positive integers less than ${c}$ are divisible by ${a}$ or ${b}$?",
        "A triangle has sides {a}, {b} and {c}. Compute its area $\\frac{{m}}{{n}}$.",
        "The sum $\\sum_{{k=1}}^{{{a}}} k^2$ equals $N$. Find $N \\bmod {c}$.",
        "Let $f(x) = {a}x^2 - {b}x + {c}$. Find the minimum value of $f$.",
        "In how many ways can {a} people sit around a round table with {b} chairs?",
        "Compute $\\sqrt{{{a}}} \\cdot \\sqrt{{{b}}}$ and give $m+n$ where the answer is "
        "$m\\sqrt{{n}}$.",
        "Define $a_1 = {a}$ and $a_{{n+1}} = a_n + {b}$. What is $a_{{{c}}}$?",
        "Probability that a fair die shows {a} twice in {b} rolls is $\\frac{{p}}{{q}}$; find "
        "$p+q$.",
    ]
    lines = []
    for i in range(600):
        a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 1000)
        problem = templates[i % len(templates)].format(a=a, b=b, c=c)
        answer = rng.randint(0, 999)
        lines.append(DAPO_PREFIX + problem + DAPO_SUFFIX)
        lines.append(f"We compute step by step: {a} + {b} = {a + b}, {a} \\times {b} = {a * b}, "
                     f"and {c} - {b} = {c - b}. Therefore\nAnswer: {answer}")
    lines.extend(str(n) for n in range(1000))
    return lines


def build_tokenizer(spec: TinySpec):
    """Train a byte-level BPE (digits split individually) and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(math_corpus(spec.seed), trainer=trainer)
    if tok.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > model vocab "
                           f"{spec.vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        padding_side="left",
    )


# ---------------------------------------------------------------------------- weights


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def hf_config(spec: TinySpec, tokenizer) -> Any:
    from transformers import HYV3Config

    return HYV3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        num_shared_experts=1,
        moe_intermediate_size=spec.moe_intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Not fields of HYV3Config in 5.6.0, but the real checkpoint's config and the
        # Megatron-Bridge HYV3 bridge read them.
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
    )


def build_tensors(spec: TinySpec, config) -> dict[str, Any]:
    """All checkpoint tensors in on-disk names: BF16, expert biases F32 and non-zero."""
    import torch
    from safetensors.torch import load_file
    from transformers import HYV3ForCausalLM

    n = spec.num_hidden_layers
    big = config.__class__(**{
        **config.to_dict(),
        "num_hidden_layers": n + 1,
        "mlp_layer_types": ["dense"] + ["sparse"] * n,
    })
    torch.manual_seed(spec.seed)
    model = HYV3ForCausalLM(big).float()
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            # Non-zero, distinct per layer: an unloaded bias (zeros) must be detectable.
            layer.mlp.e_score_correction_bias.copy_(
                0.05 * torch.randn(spec.num_experts, generator=gen) + 0.01)
    tensors: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(shard))
    h = spec.hidden_size
    mtp = f"model.layers.{n}"
    tensors[f"{mtp}.enorm.weight"] = torch.ones(h)
    tensors[f"{mtp}.hnorm.weight"] = torch.ones(h)
    tensors[f"{mtp}.final_layernorm.weight"] = torch.ones(h)
    tensors[f"{mtp}.eh_proj.weight"] = 0.02 * torch.randn(h, 2 * h, generator=gen)
    out = {}
    for name in sorted(tensors, key=_natural_key):
        t = tensors[name]
        dtype = torch.float32 if name.endswith(".mlp.expert_bias") else torch.bfloat16
        out[name] = t.to(dtype).contiguous()
    return out


def write_shards(tensors: dict[str, Any], out: Path, num_shards: int) -> dict[str, Any]:
    """Write ``tensors`` (already in order) into ``num_shards`` files + the HF index."""
    from safetensors.torch import save_file

    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    names = list(tensors)
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    acc = 0
    for name in names:
        idx = min(num_shards - 1, acc * num_shards // total)
        groups[idx].append(name)
        acc += sizes[name]
    groups = [g for g in groups if g]
    if len(groups) < 2:
        raise RuntimeError("tensors did not split into >= 2 shards")
    weight_map = {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    index = {
        "metadata": {
            "total_parameters": sum(t.numel() for t in tensors.values()),
            "total_size": total,
        },
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def schema_sizes() -> dict[str, Any]:
    """``model.tiny`` as the schema's defaults give it (the one place they are written)."""
    from hy3rl.settings import Config

    return dataclasses.asdict(Config.from_dict({}).model.tiny)


def build_tiny_model(out_dir: str | Path, tiny: TinyModel | Mapping[str, Any] | None = None,
                     **sizes: Any) -> Path:
    """Build the tiny checkpoint into ``out_dir`` (must not exist or be empty).

    ``tiny``: the ``model.tiny`` section (typed, or its mapping); ``sizes`` override single
    keys (``seed=1``); any key neither gives comes from the schema's defaults. Written into a
    temporary sibling directory first and renamed into place, so a failure leaves no
    half-written checkpoint. Returns ``out_dir``.
    """
    import torch
    from transformers import GenerationConfig

    if tiny is None:
        given: dict[str, Any] = {}
    elif isinstance(tiny, Mapping):
        given = dict(tiny)
    else:
        given = dataclasses.asdict(tiny)
    given.update(sizes)
    required = [f.name for f in fields(TinySpec) if f.default is dataclasses.MISSING]
    if any(k not in given for k in required):
        given = {**schema_sizes(), **given}
    spec = TinySpec.from_sizes(given)
    seed = spec.seed
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = build_tokenizer(spec)
        config = hf_config(spec, tokenizer)
        tensors = build_tensors(spec, config)
        config.dtype = "bfloat16"
        config.architectures = ["HYV3ForCausalLM"]  # AutoBridge picks the bridge by it
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(tmp)
        write_shards(tensors, tmp, spec.num_shards)
        if len(tokenizer) != spec.vocab_size:
            raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, model vocab is "
                               f"{spec.vocab_size}: lower model.tiny.vocab_size")
        (tmp / "tiny-hy3.json").write_text(json.dumps(
            {"seed": seed, "spec": spec.__dict__,
             "note": "random weights; built by hy3rl.model (rule tiny_model)"},
            indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def run(tiny: TinyModel, *, out: Path) -> Path:
    """Stage ``tiny_model``: build the tiny checkpoint of ``model.tiny`` into ``out``."""
    try:
        path = build_tiny_model(out, tiny)
    except (ValueError, FileExistsError, RuntimeError) as exc:
        raise ModelError(f"{out}: {exc}") from exc
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    log.info("tiny_model: wrote %s (%d tensors, %d shards, %d bytes, seed %d)", path,
             len(index["weight_map"]), len(shards), index["metadata"]["total_size"], tiny.seed)
    return path
