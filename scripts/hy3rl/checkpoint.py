"""check_checkpoint: a Hy3 HF checkpoint is whole, and Megatron-Bridge's HYV3 bridge will
convert all of it, proven on CPU from the safetensors headers alone.

Reads each shard's header (8-byte little-endian length + JSON) with ``struct``/``json``;
never reads weights, except the small ``mlp.expert_bias`` tensors (through safetensors'
``safe_open``). Checks, in order (see docs/formats/checkpoint.md): config, index, headers,
index_vs_shards, total_size, format, inventory, expert_bias, bridge_mapping,
bridge_mapping_import, manifest (the files against rule model's manifest,
:func:`hy3rl.hub.verify`: sizes always, hashes with ``checks.checkpoint.sha256``). The
mapping table comes from :mod:`hy3rl.bridge_source`.

``run(checks, model=, manifest=, lock=, out=, threads=)`` writes ``checks/checkpoint.json``
(one entry per check, status pass | fail | not run; the report record below, which
``hy3rl.bridge`` writes too) and a readable summary, and raises :class:`ChecksFailed` on
any fail.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hy3rl import hub
from hy3rl.atomic import write_json_atomic
from hy3rl.bridge_source import (
    BRIDGE_RELPATH,
    BridgeMapping,
    BridgeSource,
    TableFormatError,
    bridge_source_from_lock,
    compare_tables,
    imported_registry_subprocess,
    pattern_regex,
    read_mapping_table,
    read_pinned_source,
)
from hy3rl.errors import StageError
from hy3rl.timefmt import utc_now

if TYPE_CHECKING:
    from hy3rl.settings import CheckpointCheck

INDEX_FILE = "model.safetensors.index.json"
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
REQUIRED_CONFIG = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                   "num_experts", "num_shared_experts")
OUTER_PATTERNS = (
    (re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$"),
     "fused experts (mlp.experts.gate_up_proj / down_proj)"),
    (re.compile(r"\.e_score_correction_bias$"), "e_score_correction_bias"),
    (re.compile(r"\.mlp\.shared_experts\."), "shared_experts"),
    (re.compile(r"\.mlp\.gate\.weight$"), "mlp.gate.weight (router)"),
)
OUTER_HELP = (
    "the checkpoint is in the outer (fused) format, which the Megatron-Bridge HYV3 bridge "
    "cannot read (it maps the on-disk inner names mlp.experts.<E>.{gate,up,down}_proj.weight, "
    "mlp.expert_bias, mlp.router.gate.weight, mlp.shared_mlp.*). Use the original inner-format "
    "checkpoint, or convert it back (e.g. load it with transformers >= 5.6.0 "
    "HYV3ForCausalLM and save_pretrained, which writes the inner names; copy the MTP layer's "
    "tensors over, since transformers drops them)"
)
LAYER_RX = re.compile(r"^model\.layers\.(\d+)\.")


class ChecksFailed(StageError):
    """At least one check failed; the report is written and names every problem."""


# ---------------------------------------------------------------------------- the report
# One record for checks/checkpoint.json and checks/bridge.json (docs/formats/checkpoint.md).


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | not run
    details: str
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0

    def __post_init__(self) -> None:
        if self.status not in ("pass", "fail", "not run"):
            raise ValueError(f"bad status {self.status!r}")
        self.problem_count = max(self.problem_count, len(self.problems))
        self.problems = self.problems[:200]


def write_report(path: Path, results: list[CheckResult], extra: dict[str, Any]) -> dict[str, Any]:
    """Write the checks JSON atomically; return the document."""
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "not run")}
    doc = {
        "schema_version": 1,
        "created": utc_now(),
        "ok": counts["fail"] == 0,
        "counts": counts,
        **extra,
        "checks": [asdict(r) for r in results],
    }
    write_json_atomic(Path(path), doc)
    return doc


def summary_lines(results: list[CheckResult]) -> list[str]:
    width = max((len(r.name) for r in results), default=4)
    lines = []
    for r in results:
        lines.append(f"  {r.status.upper():8} {r.name:{width}}  {r.details}")
        for p in r.problems[:10]:
            lines.append(f"           - {p}")
        if r.problem_count > 10:
            lines.append(f"           ... {r.problem_count - 10} more (see the JSON)")
    return lines


def failure_message(doc: dict[str, Any], what: str, out: Path) -> str:
    """The error message of a report with failed checks, naming them."""
    names = [c["name"] for c in doc["checks"] if c["status"] == "fail"]
    return (f"{what}: {len(names)} check(s) failed ({', '.join(names)}); details in {out} "
            "and above")


class HeaderError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Shard:
    file: str
    size: int = 0
    header_len: int = 0
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    error: str | None = None


# ---------------------------------------------------------------------------- headers


def read_header(path: Path) -> Shard:
    """Parse one safetensors header without touching the data region."""
    shard = Shard(path.name)
    try:
        shard.size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise HeaderError(f"file is {len(raw)} bytes, shorter than the 8-byte length")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise HeaderError(f"header length {n} exceeds the 100 MiB limit (corrupt)")
            if 8 + n > shard.size:
                raise HeaderError(f"truncated header: it says {n} bytes, the file has only "
                                  f"{shard.size - 8} after the length")
            blob = fh.read(n)
        shard.header_len = n
        try:
            header = json.loads(blob)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HeaderError(f"header is not valid JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise HeaderError("header is not a JSON object")
        data_len = shard.size - 8 - n
        spans = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = entry["dtype"]
                shape = tuple(int(s) for s in entry["shape"])
                start, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise HeaderError(f"{name}: malformed entry {entry!r}") from exc
            if dtype not in DTYPE_SIZES:
                raise HeaderError(f"{name}: unknown dtype {dtype!r}")
            count = 1
            for s in shape:
                count *= s
            if end - start != count * DTYPE_SIZES[dtype] or start < 0:
                raise HeaderError(f"{name}: data_offsets [{start}, {end}] do not hold "
                                  f"{dtype}{list(shape)}")
            spans.append((start, end, name))
            shard.tensors[name] = TensorInfo(name, path.name, dtype, shape, start, end)
        spans.sort()
        pos = 0
        for start, end, name in spans:
            if start != pos:
                raise HeaderError(f"{name}: data starts at {start}, expected {pos} "
                                  "(hole or overlap in the data region)")
            pos = end
        if pos != data_len:
            what = "truncated" if pos > data_len else "has trailing bytes"
            raise HeaderError(f"data region {what}: tensors end at {pos}, the file holds "
                              f"{data_len} bytes after the header")
    except (OSError, HeaderError) as exc:
        shard.error = str(exc)
    return shard


# ---------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class Expected:
    dtype: str
    shape: tuple[int, ...]
    kind: str  # embedding | norm | lm_head | dense | moe | mtp


@dataclass
class ModelShape:
    cfg: dict[str, Any]
    layers: int
    dense: list[int]
    moe: list[int]
    mtp: list[int]

    def kind_of(self, layer: int) -> str:
        if layer in self.mtp:
            return "mtp"
        return "dense" if layer in self.dense else "moe"


def model_shape(cfg: dict[str, Any]) -> tuple[ModelShape | None, list[str]]:
    """Layer kinds from config.json, or the problems that prevent knowing them."""
    problems = []
    if cfg.get("model_type") != "hy_v3":
        problems.append(f"model_type is {cfg.get('model_type')!r}, expected 'hy_v3' (Hy3, "
                        "HYV3ForCausalLM): this check and the HYV3 bridge cover only Hy3")
    missing = [k for k in REQUIRED_CONFIG if not isinstance(cfg.get(k), int)]
    if missing:
        problems.append(f"missing or non-integer keys: {', '.join(missing)}")
    if problems:
        return None, problems
    n = cfg["num_hidden_layers"]
    types = cfg.get("mlp_layer_types")
    k = cfg.get("first_k_dense_replace")
    if types is not None:
        if len(types) != n or set(types) - {"dense", "sparse"}:
            problems.append(f"mlp_layer_types must list 'dense'/'sparse' for all {n} layers")
            return None, problems
        dense = [i for i, t in enumerate(types) if t == "dense"]
        if k is not None and dense != list(range(k)):
            problems.append(f"first_k_dense_replace={k} disagrees with mlp_layer_types "
                            f"(dense layers {dense})")
            return None, problems
    elif k is not None:
        dense = list(range(k))
    else:
        problems.append("neither first_k_dense_replace nor mlp_layer_types: cannot tell "
                        "dense from MoE layers (the HYV3 bridge needs first_k_dense_replace)")
        return None, problems
    m = int(cfg.get("num_nextn_predict_layers") or 0)
    return ModelShape(cfg, n, dense, [i for i in range(n) if i not in dense],
                      list(range(n, n + m))), []


def expected_inventory(ms: ModelShape) -> dict[str, Expected]:
    """Every tensor name, dtype and shape the config implies (inner on-disk names)."""
    c = ms.cfg
    h, v = c["hidden_size"], c["vocab_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // nh
    inter, moe_i = c["intermediate_size"], c["moe_intermediate_size"]
    e, shared = c["num_experts"], c["num_shared_experts"] * c["moe_intermediate_size"]
    bf = "BF16"
    out: dict[str, Expected] = {
        "model.embed_tokens.weight": Expected(bf, (v, h), "embedding"),
        "model.norm.weight": Expected(bf, (h,), "norm"),
    }
    if not c.get("tie_word_embeddings", False):
        out["lm_head.weight"] = Expected(bf, (v, h), "lm_head")
    for i in range(ms.layers + len(ms.mtp)):
        kind = ms.kind_of(i)
        p = f"model.layers.{i}."
        block = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (nh * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
            "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, nh * hd),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        }
        if kind == "dense":
            block |= {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                      "mlp.down_proj.weight": (h, inter)}
        else:
            block |= {"mlp.router.gate.weight": (e, h),
                      "mlp.shared_mlp.gate_proj.weight": (shared, h),
                      "mlp.shared_mlp.up_proj.weight": (shared, h),
                      "mlp.shared_mlp.down_proj.weight": (h, shared)}
            for x in range(e):
                block |= {f"mlp.experts.{x}.gate_proj.weight": (moe_i, h),
                          f"mlp.experts.{x}.up_proj.weight": (moe_i, h),
                          f"mlp.experts.{x}.down_proj.weight": (h, moe_i)}
        if kind == "mtp":
            block |= {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                      "final_layernorm.weight": (h,)}
        for name, shape in block.items():
            out[p + name] = Expected(bf, shape, kind)
        if kind != "dense":
            out[p + "mlp.expert_bias"] = Expected("F32", (e,), kind)
    return out


# ---------------------------------------------------------------------------- checks


def _check(name: str, problems: list[str], ok: str, bad: str) -> CheckResult:
    return CheckResult(name, "fail" if problems else "pass", bad if problems else ok,
                       problems, len(problems))


@dataclass
class State:
    """What the checks learn, passed from one to the next."""

    model_dir: Path
    cfg: dict[str, Any] | None = None
    shape: ModelShape | None = None
    index: dict[str, Any] | None = None
    shards: dict[str, Shard] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    _expected: dict[str, Expected] | None = None

    def expected(self) -> dict[str, Expected]:
        assert self.shape is not None
        if self._expected is None:
            self._expected = expected_inventory(self.shape)
        return self._expected


def check_config(st: State) -> CheckResult:
    path = st.model_dir / "config.json"
    try:
        st.cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return CheckResult("config", "fail", f"{path}: cannot read: {exc}")
    if not isinstance(st.cfg, dict):
        return CheckResult("config", "fail", f"{path}: not a JSON object")
    st.shape, problems = model_shape(st.cfg)
    problems = [f"{path}: {p}" for p in problems]
    if st.shape:
        s = st.shape
        ok = (f"model_type hy_v3, {s.layers} layers (dense {s.dense}, {len(s.moe)} MoE, MTP "
              f"{s.mtp}), {st.cfg['num_experts']} experts")
    else:
        ok = ""
    return _check("config", problems, ok, problems[0] if problems else "")


def check_index(st: State) -> CheckResult:
    path = st.model_dir / INDEX_FILE
    problems = []
    try:
        index = json.loads(path.read_text())
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ValueError("no 'weight_map' object")
        if not index["weight_map"]:
            raise ValueError("'weight_map' is empty (no tensor indexed)")
        total = index.get("metadata", {}).get("total_size")
        if not isinstance(total, int):
            raise ValueError("no integer metadata.total_size")
    except (OSError, ValueError) as exc:
        return CheckResult("index", "fail", f"{path}: cannot use it: {exc}", [str(exc)], 1)
    st.index = index
    named = sorted(set(index["weight_map"].values()))
    for shard in named:
        if "/" in shard or not (st.model_dir / shard).is_file():
            problems.append(f"{path.name}: shard {shard} is missing "
                            f"({sum(v == shard for v in index['weight_map'].values())} "
                            "tensors indexed in it)")
    on_disk = sorted(p.name for p in st.model_dir.glob("*.safetensors"))
    for extra in sorted(set(on_disk) - set(named)):
        problems.append(f"{extra}: shard file in the directory but not in {path.name}")
    return _check("index", problems,
                  f"{len(index['weight_map'])} tensors in {len(named)} shards, all present",
                  f"{len(problems)} shard files missing or extra")


def check_headers(st: State, threads: int) -> CheckResult:
    names = set(p.name for p in st.model_dir.glob("*.safetensors"))
    if st.index:
        names |= {s for s in set(st.index["weight_map"].values())
                  if (st.model_dir / s).is_file()}
    files = sorted(names)
    if not files:
        return CheckResult("headers", "not run", f"not run: no *.safetensors shard file in "
                           f"{st.model_dir}")
    with ThreadPoolExecutor(max(1, threads)) as pool:
        shards = list(pool.map(read_header, (st.model_dir / f for f in files)))
    st.shards = {s.file: s for s in shards}
    problems = [f"{s.file}: {s.error}" for s in shards if s.error]
    for s in shards:
        if not s.error:
            for name, info in s.tensors.items():
                st.tensors.setdefault(name, info)
    return _check("headers", problems,
                  f"{len(shards)} headers parsed, {len(st.tensors)} tensors, data regions "
                  "complete", f"{len(problems)} of {len(shards)} shard headers unreadable")


def check_index_vs_shards(st: State) -> CheckResult:
    if st.index is None:
        return CheckResult("index_vs_shards", "not run", "not run: no usable index (see index)")
    if not st.shards:
        return CheckResult("index_vs_shards", "not run", "not run: no shard file to compare "
                           "with the index (see headers)")
    problems = []
    wm = st.index["weight_map"]
    for name, shard in wm.items():
        s = st.shards.get(shard)
        if s is None or s.error:
            continue  # reported by index / headers
        if name not in s.tensors:
            problems.append(f"{name}: indexed in {shard} but absent from that shard's header")
    seen: dict[str, str] = {}
    for s in st.shards.values():
        if s.error:
            continue
        for name in s.tensors:
            if name in seen:
                problems.append(f"{name}: in two shards, {seen[name]} and {s.file}")
            seen[name] = s.file
            if name not in wm:
                problems.append(f"{name}: in {s.file} but missing from the index "
                                "(loaders would never find it)")
            elif wm[name] != s.file:
                problems.append(f"{name}: in {s.file} but the index says {wm[name]}")
    unreadable = [s.file for s in st.shards.values() if s.error]
    if unreadable and not problems:
        return CheckResult("index_vs_shards", "not run",
                           f"not run for unreadable shards {unreadable} (see headers)")
    return _check("index_vs_shards", problems,
                  f"index and {len(st.shards)} shard headers agree on {len(wm)} tensors",
                  f"{len(problems)} disagreements between index and shards")


def check_total_size(st: State) -> CheckResult:
    if st.index is None or not st.shards or any(s.error for s in st.shards.values()):
        return CheckResult("total_size", "not run",
                           "not run: needs the index and every shard header (see above)")
    declared = st.index["metadata"]["total_size"]
    actual = sum(t.nbytes for s in st.shards.values() for t in s.tensors.values())
    if declared != actual:
        msg = (f"{INDEX_FILE}: metadata.total_size is {declared:,} but the shard headers hold "
               f"{actual:,} bytes of tensors (difference {actual - declared:+,})")
        return CheckResult("total_size", "fail", msg, [msg], 1)
    return CheckResult("total_size", "pass", f"metadata.total_size {declared:,} bytes = sum of "
                       "tensor bytes")


def check_format(st: State) -> CheckResult:
    if not st.tensors:
        return CheckResult("format", "not run", "not run: no readable tensor names (see "
                           "index and headers)")
    hits: dict[str, list[str]] = defaultdict(list)
    for name in st.tensors:
        for rx, what in OUTER_PATTERNS:
            if rx.search(name):
                hits[what].append(name)
    if hits:
        problems = [f"{len(v)} x {what}, e.g. {v[0]}" for what, v in hits.items()]
        return CheckResult("format", "fail", OUTER_HELP, problems, len(problems))
    return CheckResult("format", "pass", "inner (on-disk) tensor names")


def check_inventory(st: State) -> CheckResult:
    if st.shape is None:
        return CheckResult("inventory", "not run", "not run: needs a valid Hy3 config.json "
                           "(see config)")
    expected = st.expected()
    problems = []
    for name, exp in expected.items():
        got = st.tensors.get(name)
        if got is None:
            problems.append(f"missing {exp.kind} tensor {name} ({exp.dtype}{list(exp.shape)})")
            continue
        if got.dtype != exp.dtype:
            problems.append(f"{name} in {got.shard}: dtype {got.dtype}, expected {exp.dtype}")
        if got.shape != exp.shape:
            problems.append(f"{name} in {got.shard}: shape {list(got.shape)}, expected "
                            f"{list(exp.shape)} from config.json")
    for name in st.tensors.keys() - expected.keys():
        problems.append(f"unexpected tensor {name} in {st.tensors[name].shard} (config.json "
                        "implies no such tensor)")
    kinds = defaultdict(int)
    for exp in expected.values():
        kinds[exp.kind] += 1
    return _check("inventory", problems,
                  f"{len(expected)} tensors match config.json in dtype and shape ("
                  + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ")",
                  f"{len(problems)} tensors missing, unexpected, or of wrong dtype/shape")


def read_small_tensor(model_dir: Path, info: TensorInfo) -> Any:
    """Read one small tensor through safetensors (numpy for F32, torch otherwise)."""
    from safetensors import safe_open

    if info.dtype == "F32":
        with safe_open(model_dir / info.shard, framework="numpy") as f:
            return f.get_tensor(info.name)
    with safe_open(model_dir / info.shard, framework="pt") as f:
        return f.get_tensor(info.name).float().numpy()


def check_expert_bias(st: State) -> CheckResult:
    import numpy as np

    if st.shape is None:
        return CheckResult("expert_bias", "not run", "not run: needs a valid Hy3 config.json")
    problems = []
    layers = st.shape.moe + st.shape.mtp
    for i in layers:
        name = f"model.layers.{i}.mlp.expert_bias"
        info = st.tensors.get(name)
        if info is None:
            problems.append(f"missing {name}: the bridge would leave layer {i}'s "
                            "router.expert_bias at zero (routing silently changes)")
            continue
        if st.shards[info.shard].error:
            continue
        try:
            values = np.asarray(read_small_tensor(st.model_dir, info), dtype=np.float64)
        except Exception as exc:  # safetensors raises its own error types
            problems.append(f"{name} in {info.shard}: cannot read: {exc}")
            continue
        if not np.isfinite(values).all():
            problems.append(f"{name} in {info.shard}: {int((~np.isfinite(values)).sum())} "
                            "non-finite values")
        elif not values.any():
            problems.append(f"{name} in {info.shard}: all zero (an expert bias that was never "
                            "trained or was lost in a conversion)")
    return _check("expert_bias", problems,
                  f"{len(layers)} expert biases present, finite, not all zero",
                  f"{len(problems)} expert biases missing, non-finite or all zero")


# ------------------------------------------------------------------------ bridge coverage


def _wildcard_kinds(megatron: str) -> list[str]:
    """For each ``*`` of a Megatron pattern: 'layer', 'expert' or 'any'."""
    kinds = []
    for m in re.finditer(r"\*", megatron):
        before = megatron[: m.start()]
        if before.endswith(("decoder.layers.", "mtp.layers.")):
            kinds.append("layer")
        elif before.endswith(("experts.", "local_experts.")) or re.search(
                r"experts\.linear_fc\d\.weight$", before):
            kinds.append("expert")
        else:
            kinds.append("any")
    return kinds


@dataclass
class Claim:
    """One HF name pattern as the bridge can use it: the wildcard ranges come from its
    Megatron side (a decoder layer index < num_hidden_layers, an expert index < num_experts)."""

    pattern: str
    kinds: tuple[str, ...]
    mappings: list[BridgeMapping]
    regex: re.Pattern[str]

    def matches(self, name: str, layers: int, experts: int) -> tuple[str, ...] | None:
        m = self.regex.match(name)
        if not m:
            return None
        for value, kind in zip(m.groups(), self.kinds, strict=False):
            if kind == "layer" and int(value) >= layers:
                return None
            if kind == "expert" and int(value) >= experts:
                return None
        return m.groups()


def build_claims(mappings: list[BridgeMapping]) -> list[Claim]:
    claims: dict[tuple[str, tuple[str, ...]], Claim] = {}
    for m in mappings:
        kinds = tuple(_wildcard_kinds(m.megatron))
        for _, pattern in m.hf:
            key = (pattern, kinds)
            if key not in claims:
                claims[key] = Claim(pattern, kinds, [], pattern_regex(pattern))
            claims[key].mappings.append(m)
    return list(claims.values())


def _shape_key(text: str) -> str:
    return re.sub(r"\d+|\*+", "#", text)


def bridge_coverage(names: Iterable[str], expected: dict[str, Expected], ms: ModelShape,
                    mappings: list[BridgeMapping]) -> tuple[list[str], str]:
    """Problems with the bridge's coverage of this checkpoint, and a one-line summary."""
    claims = build_claims(mappings)
    by_shape: dict[str, list[Claim]] = defaultdict(list)
    slow: list[Claim] = []
    for c in claims:
        (slow if "**" in c.pattern else by_shape[_shape_key(c.pattern)]).append(c)
    layers, experts = ms.layers, ms.cfg["num_experts"]
    present = set(names)
    problems: list[str] = []

    def claimers(name: str) -> list[tuple[Claim, tuple[str, ...]]]:
        out = []
        candidates = by_shape.get(_shape_key(name), [])
        for c in (candidates + slow) if slow else candidates:
            groups = c.matches(name, layers, experts)
            if groups is not None:
                out.append((c, groups))
        return out

    def kind_of(name: str) -> str:
        exp = expected.get(name)
        if exp is not None:
            return exp.kind
        m = LAYER_RX.match(name)
        return ms.kind_of(int(m.group(1))) if m else "other"

    live: dict[str, set[str]] = defaultdict(set)
    partner_seen: set[str] = set()
    for name in sorted(present | expected.keys()):
        found = claimers(name)
        if not found:
            where = "checkpoint tensor" if name in present else "tensor the config implies"
            problems.append(f"{where} {name} ({kind_of(name)}): no bridge mapping claims it "
                            "(the bridge would skip it with only a warning)")
            continue
        if len(found) > 1:
            pats = ", ".join(c.pattern for c, _ in found)
            problems.append(f"{name}: claimed by {len(found)} different mappings ({pats})")
            continue
        claim, groups = found[0]
        live[kind_of(name)].add(claim.pattern)
        if name not in present:
            problems.append(f"{name} ({kind_of(name)}): the config implies it and mapping "
                            f"{claim.mappings[0].megatron} needs it, but the checkpoint lacks "
                            "it (\"Can't find ... in hf_keys\": parameter left uninitialised)")
            continue
        # Multi-tensor mappings (QKV, gated MLP) need all their parts, or none.
        for m in claim.mappings:
            for role, pattern in m.hf if len(m.hf) > 1 else ():
                if pattern == claim.pattern:
                    continue
                partner = pattern
                for g in groups:
                    partner = partner.replace("*", g, 1)
                if partner not in present and partner not in partner_seen:
                    partner_seen.add(partner)
                    problems.append(f"{m.kind} {m.megatron}: has {name} but not its {role} "
                                    f"part {partner}")
    used = set().union(*live.values()) if live else set()
    inert = sorted({m.megatron for c in claims if c.pattern not in used for m in c.mappings})
    summary = (f"{len(mappings)} mappings ({len(claims)} HF patterns); live patterns per layer "
               "kind: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(live.items()))
               + (f"; {len(inert)} mappings match nothing here (alternatives for other layer "
                  "kinds/specs)" if inert else ""))
    return problems, summary


def check_bridge_mapping(st: State, source: BridgeSource | None, why: str
                         ) -> tuple[CheckResult, list[BridgeMapping] | None]:
    name = "bridge_mapping"
    if st.shape is None:
        return CheckResult(name, "not run", "not run: needs a valid Hy3 config.json"), None
    if source is None:
        return CheckResult(name, "not run", f"not run: no pinned Megatron-Bridge: {why}"), None
    try:
        text = read_pinned_source(source.clone, source.commit)
        mappings = read_mapping_table(text, st.shape.cfg, filename=str(source.file))
    except TableFormatError as exc:
        return CheckResult(name, "not run", f"not run: cannot read the mapping table: {exc}"), None
    problems, summary = bridge_coverage(st.tensors.keys(), st.expected(),
                                        st.shape, mappings)
    where = f"{BRIDGE_RELPATH}@{source.commit[:12]}"
    return _check(name, problems, f"{where}: every tensor claimed by exactly one mapping; "
                  f"{summary}", f"{where}: {len(problems)} coverage problems; {summary}"), mappings


def check_bridge_import(st: State, source: BridgeSource | None,
                        parsed: list[BridgeMapping] | None, try_import: bool) -> CheckResult:
    name = "bridge_mapping_import"
    if parsed is None or source is None:
        return CheckResult(name, "not run", "not run: no parsed mapping table to compare with")
    if not try_import:
        return CheckResult(name, "not run", "not run: import attempt disabled")
    imported, why = imported_registry_subprocess(source.clone / "src",
                                                 st.model_dir / "config.json")
    if imported is None:
        return CheckResult(name, "not run", f"not run: {why}")
    problems = compare_tables(parsed, imported)
    return _check(name, problems, f"imported mapping_registry() agrees with the parsed table "
                  f"({len(imported)} mappings)", f"{len(problems)} disagreements")


# ---------------------------------------------------------------------------- manifest


def check_manifest(st: State, manifest: Path | None, sha256: bool, threads: int) -> CheckResult:
    """The directory against rule ``model``'s manifest (hy3rl.hub.verify): sizes always,
    hashes with ``sha256``; every file missing, extra or different named, a hash mismatch
    with both hashes."""
    name = "manifest"
    if manifest is None:
        return CheckResult(name, "not run", "not run: no model manifest given")
    try:
        m = hub.read_manifest(manifest)
        problems = []
        if Path(m.dir).resolve() != st.model_dir:
            problems.append(f"the manifest {manifest} describes {m.dir}, not {st.model_dir} "
                            "(rerun rule model)")
        problems += hub.verify(manifest, st.model_dir, sha256=sha256, threads=threads)
    except hub.ManifestError as exc:
        return CheckResult(name, "fail", str(exc), [str(exc)], 1)
    what = ("sizes and hashes (sha256 / git blob id)" if sha256 else
            "sizes (hashes not compared: checks.checkpoint.sha256 is false)")
    return _check(name, problems, f"{len(m.files)} files ({m.total_size} bytes) match "
                  f"{manifest}: {what}",
                  f"{len(problems)} problem(s) against {manifest}, comparing {what}")


# ---------------------------------------------------------------------------- driver


def check_checkpoint(model_dir: Path, source: BridgeSource | None = None, source_why: str = "",
                     sha256: bool = False, manifest: Path | None = None, threads: int = 2,
                     try_import: bool = True) -> tuple[list[CheckResult], dict[str, Any]]:
    """Run every check; return the results and the extra top-level fields of the report.
    ``manifest``: rule model's manifest (None: the manifest check is ``not run``)."""
    st = State(Path(model_dir).resolve())
    results = [check_config(st), check_index(st), check_headers(st, threads),
               check_index_vs_shards(st), check_total_size(st), check_format(st),
               check_inventory(st), check_expert_bias(st)]
    bridge_result, parsed = check_bridge_mapping(st, source, source_why)
    results.append(bridge_result)
    results.append(check_bridge_import(st, source, parsed, try_import))
    results.append(check_manifest(st, manifest, sha256, threads))
    extra: dict[str, Any] = {
        "model_path": str(st.model_dir),
        "inventory": {
            "tensors": len(st.tensors), "shards": len(st.shards),
            "total_size": sum(t.nbytes for t in st.tensors.values()),
            "layers": ({"dense": st.shape.dense, "moe": st.shape.moe, "mtp": st.shape.mtp}
                       if st.shape else None),
        },
        "bridge_source": ({"path": str(source.file), "commit": source.commit}
                          if source else None),
    }
    if manifest is not None:
        extra["manifest"] = str(manifest)
    return results, extra


def run(checks: CheckpointCheck, *, model: Path, manifest: Path, lock: Path | None, out: Path,
        threads: int) -> dict[str, Any]:
    """Check the checkpoint in ``model`` against rule model's ``manifest`` (sizes always,
    hashes with ``checks.sha256``) and the pinned bridge of ``lock`` (``deps/lock.json``;
    None: the bridge checks are ``not run``), write the report to ``out`` and print the
    summary; raise :class:`ChecksFailed` when any check failed (the report is written
    first). Returns the report."""
    if lock is not None:
        source, why = bridge_source_from_lock(Path(lock))
    else:
        source, why = None, "no deps lock given"
    t0 = time.perf_counter()
    results, extra = check_checkpoint(Path(model), source, why, sha256=checks.sha256,
                                      manifest=Path(manifest), threads=threads)
    doc = write_report(Path(out), results, extra)
    print(f"check_checkpoint: {model}: {extra['inventory']['tensors']} tensors in "
          f"{extra['inventory']['shards']} shards, {time.perf_counter() - t0:.2f} s")
    print("\n".join(summary_lines(results)))
    c = doc["counts"]
    print(f"check_checkpoint: {c['pass']} pass, {c['fail']} fail, {c['not run']} not run "
          f"-> {out}", flush=True)
    if not doc["ok"]:
        raise ChecksFailed(failure_message(doc, f"check_checkpoint of {model}", Path(out)))
    return doc
