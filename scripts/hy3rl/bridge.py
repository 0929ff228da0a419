"""Megatron-Bridge HYV3: the mapping table read from source, and the GPU round-trip check.

Two parts:

1. ``read_mapping_table(source, hf_config)``: the pinned ``hy_v3_bridge.py`` is parsed with
   Python's ``ast`` (never imported: the bridge imports only where Transformer Engine is
   installed) and its ``mapping_registry()`` body is *evaluated* by a small interpreter
   that understands exactly the constructs such a function is made of: a dict of
   Megatron -> HF name patterns, ``AutoMapping`` / ``QKVMapping(q=, k=, v=)`` /
   ``GatedMLPMapping(gate=, up=)`` calls, list comprehensions over ``.items()``, ``for``
   loops over ``range(...)`` (the MTP loop), ``if ...: continue``, ``str.replace``,
   f-strings, ``getattr(hf_config, ...)``. Anything else raises ``TableFormatError``, so a
   changed file yields a check that is ``not run`` with the reason, never a silent pass.
   ``registry_from_import`` gets the same table from the imported bridge where it imports.

2. ``check_bridge`` (``python -m hy3rl.bridge check ...``): run on one GPU node in the verl
   runtime environment. Loads the tiny Hy3 (and optionally the real checkpoint truncated to
   N layers) through ``AutoBridge``, converts HF -> Megatron -> HF with a strict save and
   compares every tensor, the expert biases, and full-sequence logits; any bridge warning
   about a missing mapping or key is a failure. Without a GPU / Transformer Engine /
   importable bridge every check is ``not run`` with the reason.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BRIDGE_RELPATH = "src/megatron/bridge/models/hy_v3/hy_v3_bridge.py"
BRIDGE_MODULE = "megatron.bridge.models.hy_v3.hy_v3_bridge"
MAPPING_ARGS = {
    "AutoMapping": ("megatron_param", "hf_param"),
    "QKVMapping": ("megatron_param", "q", "k", "v"),
    "GatedMLPMapping": ("megatron_param", "gate", "up"),
}
MAX_LOOP = 100_000
REGISTRY_MARKER = "HY3RL_REGISTRY "  # prefix of dump-registry's output line


class TableFormatError(ValueError):
    """The bridge source is not in the shape this reader understands (file moved/changed)."""


@dataclass(frozen=True)
class BridgeMapping:
    """One Megatron parameter pattern and the HF tensor pattern(s) it reads/writes."""

    kind: str  # AutoMapping | QKVMapping | GatedMLPMapping
    megatron: str
    hf: tuple[tuple[str, str], ...]  # (role, pattern); role "param" for AutoMapping
    line: int = 0

    @property
    def hf_patterns(self) -> tuple[str, ...]:
        return tuple(p for _, p in self.hf)

    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return (self.megatron, tuple(sorted(self.hf)))


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """Megatron-Bridge's wildcard rule: ``**`` any characters, ``*`` digits only."""
    rx = re.escape(pattern).replace(r"\*\*", "(.*)").replace(r"\*", r"(\d+)")
    return re.compile(f"^{rx}$")


# --------------------------------------------------------------------------- interpreter


class _Continue(Exception):
    pass


class _Break(Exception):
    pass


class _Return(Exception):
    def __init__(self, value: Any):
        self.value = value


class _Interp:
    """Evaluates the body of ``mapping_registry()``: a tiny, closed subset of Python."""

    def __init__(self, hf_config: Any, filename: str):
        self.self_ns = SimpleNamespace(hf_config=hf_config)
        self.env: dict[str, Any] = {"self": self.self_ns}
        self.filename = filename

    def fail(self, node: ast.AST, what: str) -> TableFormatError:
        line = getattr(node, "lineno", "?")
        return TableFormatError(f"{self.filename}:{line}: {what} (mapping_registry() is not in "
                                "the shape this reader understands)")

    # statements
    def run(self, body: Sequence[ast.stmt]) -> None:
        for stmt in body:
            self.stmt(stmt)

    def stmt(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign):
            value = self.expr(node.value)
            for target in node.targets:
                self.assign(target, value)
        elif isinstance(node, ast.Expr):
            if isinstance(node.value, ast.Constant):  # docstring / comment string
                return
            self.expr(node.value)
        elif isinstance(node, ast.For):
            if node.orelse:
                raise self.fail(node, "for/else")
            items = list(self.expr(node.iter))
            if len(items) > MAX_LOOP:
                raise self.fail(node, f"loop over {len(items)} items")
            for item in items:
                self.assign(node.target, item)
                try:
                    self.run(node.body)
                except _Continue:
                    continue
                except _Break:
                    break
        elif isinstance(node, ast.If):
            self.run(node.body if self.expr(node.test) else node.orelse)
        elif isinstance(node, ast.Continue):
            raise _Continue
        elif isinstance(node, ast.Break):
            raise _Break
        elif isinstance(node, ast.Pass):
            return
        elif isinstance(node, ast.Return):
            raise _Return(self.ret(node.value))
        else:
            raise self.fail(node, f"unsupported statement {type(node).__name__}")

    def assign(self, target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, ast.Tuple | ast.List):
            values = list(value)
            if len(values) != len(target.elts):
                raise self.fail(target, "unpacking mismatch")
            for t, v in zip(target.elts, values, strict=True):
                self.assign(t, v)
        else:
            raise self.fail(target, f"unsupported assignment target {type(target).__name__}")

    def ret(self, node: ast.expr | None) -> list[BridgeMapping]:
        # return MegatronMappingRegistry(*mapping_list)   or   return [..mappings..]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            out: list[Any] = []
            for arg in node.args:
                if isinstance(arg, ast.Starred):
                    out.extend(self.expr(arg.value))
                else:
                    out.append(self.expr(arg))
        elif node is not None:
            value = self.expr(node)
            out = list(value) if isinstance(value, list | tuple) else [value]
        else:
            raise self.fail(ast.Pass(), "bare return: not a list of mappings")
        if not out or not all(isinstance(m, BridgeMapping) for m in out):
            raise self.fail(node, "return value is not a list of mappings")
        return out

    # expressions
    def expr(self, node: ast.expr) -> Any:  # noqa: C901 - one branch per construct
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(str(v.value))
                elif isinstance(v, ast.FormattedValue) and v.format_spec is None \
                        and v.conversion == -1:
                    parts.append(str(self.expr(v.value)))
                else:
                    raise self.fail(node, "unsupported f-string part")
            return "".join(parts)
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            raise self.fail(node, f"unknown name {node.id!r}")
        if isinstance(node, ast.Attribute):
            obj = self.expr(node.value)
            if isinstance(obj, SimpleNamespace):
                if not hasattr(obj, node.attr):
                    raise self.fail(node, f"config has no attribute {node.attr!r}")
                return getattr(obj, node.attr)
            raise self.fail(node, f"attribute {node.attr!r} of a {type(obj).__name__}")
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise self.fail(node, "dict unpacking")
            return {self.expr(k): self.expr(v) for k, v in zip(node.keys, node.values,
                                                                strict=True)}
        if isinstance(node, ast.List | ast.Tuple):
            values = [self.expr(e) for e in node.elts]
            return values if isinstance(node, ast.List) else tuple(values)
        if isinstance(node, ast.ListComp):
            return self.listcomp(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if isinstance(node, ast.BoolOp):
            values = [self.expr(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.expr(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = self.expr(node.left), self.expr(node.right)
            ops: dict[type, Callable[[Any, Any], Any]] = {
                ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y,
                ast.Mult: lambda x, y: x * y,
            }
            if type(node.op) in ops and isinstance(a, int | str) and isinstance(b, int | str):
                return ops[type(node.op)](a, b)
            raise self.fail(node, f"unsupported operator {type(node.op).__name__}")
        raise self.fail(node, f"unsupported expression {type(node).__name__}")

    def listcomp(self, node: ast.ListComp) -> list[Any]:
        if len(node.generators) != 1 or node.generators[0].is_async:
            raise self.fail(node, "list comprehension with several generators")
        gen = node.generators[0]
        saved = dict(self.env)
        out = []
        try:
            for item in list(self.expr(gen.iter)):
                self.assign(gen.target, item)
                if all(self.expr(cond) for cond in gen.ifs):
                    out.append(self.expr(node.elt))
        finally:
            self.env = saved
        return out

    def compare(self, node: ast.Compare) -> bool:
        left = self.expr(node.left)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.expr(right_node)
            table: dict[type, Callable[[Any, Any], bool]] = {
                ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
                ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
                ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
                ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
            }
            if type(op) not in table:
                raise self.fail(node, f"unsupported comparison {type(op).__name__}")
            if not table[type(op)](left, right):
                return False
            left = right
        return True

    def call(self, node: ast.Call) -> Any:
        func = node.func
        if isinstance(func, ast.Name):
            name = func.id
            if name in MAPPING_ARGS:
                return self.mapping(node, name)
            args = [self.expr(a) for a in node.args]
            if node.keywords:
                raise self.fail(node, f"keyword arguments to {name}()")
            if name == "range" and all(isinstance(a, int) for a in args) and 1 <= len(args) <= 3:
                return range(*args)
            if name == "getattr" and len(args) in (2, 3) and isinstance(args[1], str):
                return getattr(args[0], args[1], *args[2:])
            if name in ("int", "str", "len") and len(args) == 1:
                return {"int": int, "str": str, "len": len}[name](args[0])
            raise self.fail(node, f"call of {name}()")
        if isinstance(func, ast.Attribute):
            method = func.attr
            obj = self.expr(func.value)
            args = [self.expr(a) for a in node.args]
            if node.keywords:
                raise self.fail(node, f"keyword arguments to .{method}()")
            if isinstance(obj, str) and method == "replace" and len(args) in (2, 3):
                return obj.replace(*args)
            if isinstance(obj, dict) and method in ("items", "keys", "values") and not args:
                return list(getattr(obj, method)())
            if isinstance(obj, list) and method in ("append", "extend") and len(args) == 1:
                getattr(obj, method)(args[0])
                return None
            raise self.fail(node, f"call of .{method}() on a {type(obj).__name__}")
        raise self.fail(node, "unsupported call")

    def mapping(self, node: ast.Call, cls: str) -> BridgeMapping:
        names = MAPPING_ARGS[cls]
        values: dict[str, Any] = {}
        if len(node.args) > len(names):
            raise self.fail(node, f"{cls} with {len(node.args)} positional arguments")
        for name, arg in zip(names, node.args, strict=False):
            values[name] = self.expr(arg)
        for kw in node.keywords:
            if kw.arg is None or kw.arg not in names:
                raise self.fail(node, f"{cls} keyword {kw.arg!r}")
            values[kw.arg] = self.expr(kw.value)
        if set(values) != set(names) or not all(isinstance(v, str) for v in values.values()):
            raise self.fail(node, f"{cls} needs string arguments {names}")
        if cls == "AutoMapping":
            hf = (("param", values["hf_param"]),)
        else:
            hf = tuple((n, values[n]) for n in names[1:])
        return BridgeMapping(cls, values["megatron_param"], hf, getattr(node, "lineno", 0))


def read_mapping_table(source: str, hf_config: dict[str, Any] | SimpleNamespace,
                       filename: str = "hy_v3_bridge.py") -> list[BridgeMapping]:
    """Evaluate ``mapping_registry()`` of a bridge source for ``hf_config`` (no import)."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise TableFormatError(f"{filename}: not valid Python: {exc}") from exc
    funcs = [n for n in ast.walk(tree)
             if isinstance(n, ast.FunctionDef) and n.name == "mapping_registry"]
    if len(funcs) != 1:
        raise TableFormatError(f"{filename}: expected one function mapping_registry(), found "
                               f"{len(funcs)}")
    cfg = hf_config if isinstance(hf_config, SimpleNamespace) else SimpleNamespace(**hf_config)
    interp = _Interp(cfg, filename)
    try:
        interp.run(funcs[0].body)
    except _Return as ret:
        return ret.value
    except (_Continue, _Break) as exc:
        raise TableFormatError(f"{filename}: continue/break outside a loop") from exc
    except (TypeError, AttributeError) as exc:
        raise TableFormatError(f"{filename}: mapping_registry(): {exc}") from exc
    raise TableFormatError(f"{filename}: mapping_registry() returns nothing")


def read_pinned_source(clone: Path, commit: str) -> str:
    """``hy_v3_bridge.py`` exactly as committed at ``commit`` (not the working tree)."""
    proc = subprocess.run(["git", "-C", str(clone), "show", f"{commit}:{BRIDGE_RELPATH}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise TableFormatError(f"{clone}: {BRIDGE_RELPATH} not found at {commit[:12]}: "
                               f"{proc.stderr.strip().splitlines()[-1:] or ['git failed']}")
    return proc.stdout


# --------------------------------------------------------------------- imported registry


def import_blocker() -> str | None:
    """Why the pinned bridge cannot import here (cheap checks, nothing imported), or None."""
    if sys.version_info < (3, 12):
        return (f"Python {platform.python_version()}: the pinned Megatron-Bridge needs "
                "Python >= 3.12 (typing.override)")
    if importlib.util.find_spec("transformer_engine") is None:
        return ("Transformer Engine is not installed: the pinned Megatron-Bridge imports "
                "transformer_engine.pytorch unconditionally (peft/lora_layers.py)")
    return None


def registry_from_import(src_dir: Path, config_json: Path) -> list[BridgeMapping]:
    """THE MEGATRON CALL (import): the table from the imported bridge's mapping_registry()."""
    sys.path.insert(0, str(src_dir))
    from transformers import AutoConfig  # noqa: PLC0415

    module = importlib.import_module(BRIDGE_MODULE)  # needs TE, CUDA-capable torch, py3.12
    bridge = module.HYV3Bridge()
    bridge.hf_config = AutoConfig.from_pretrained(str(config_json.parent))
    registry = bridge.mapping_registry()
    out = []
    for m in registry.mappings:
        if isinstance(m.hf_param, str):
            hf = (("param", m.hf_param),)
        else:
            hf = tuple((str(k), str(v)) for k, v in m.hf_param.items())
        out.append(BridgeMapping(type(m).__name__, m.megatron_param, hf))
    return out


def imported_registry_subprocess(src_dir: Path, config_json: Path,
                                 timeout: int = 300) -> tuple[list[BridgeMapping] | None, str]:
    """Run ``registry_from_import`` in a child process; (mappings or None, message)."""
    blocker = import_blocker()
    if blocker:
        return None, blocker
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hy3rl.bridge", "dump-registry", "--src", str(src_dir),
             "--config", str(config_json)],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])},
        )
    except subprocess.TimeoutExpired:
        return None, f"importing the pinned bridge took over {timeout} s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"the pinned bridge did not import: {last}"
    # The bridge may print while importing: the table is the last line with our marker.
    marked = [ln[len(REGISTRY_MARKER):] for ln in proc.stdout.splitlines()
              if ln.startswith(REGISTRY_MARKER)]
    try:
        rows = json.loads(marked[-1])
        return [BridgeMapping(r["kind"], r["megatron"], tuple(map(tuple, r["hf"])))
                for r in rows], ""
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        return None, f"dump-registry printed no readable mapping table ({exc!r})"


def compare_tables(parsed: list[BridgeMapping], imported: list[BridgeMapping]) -> list[str]:
    """Problems where the parsed table and the imported registry disagree.

    The imported registry may hold extra aliases that Megatron-Bridge adds itself
    (separate-layernorm names); they must map to HF patterns the parsed table has.
    """
    problems = []
    imp_keys = {m.key() for m in imported}
    for m in parsed:
        if m.key() not in imp_keys:
            problems.append(f"parsed mapping {m.megatron} -> {m.hf_patterns} is not in the "
                            "imported mapping_registry()")
    parsed_hf = {p for m in parsed for p in m.hf_patterns}
    for m in imported:
        for p in m.hf_patterns:
            if p not in parsed_hf:
                problems.append(f"imported mapping {m.megatron} -> {p}: HF pattern not in the "
                                "parsed table")
    return problems


# ----------------------------------------------------------------------- check_bridge (GPU)

WARNING_PATTERNS = (
    re.compile(r"no mapping found", re.I),
    re.compile(r"can'?t find .* in hf_keys", re.I),
    re.compile(r"missing key", re.I),
    re.compile(r"unexpected key", re.I),
    re.compile(r"not (?:found|loaded)", re.I),
    re.compile(r"uninitiali[sz]ed", re.I),
)


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


@dataclass
class CapturedWarnings:
    lines: list[str] = field(default_factory=list)

    def offending(self) -> list[str]:
        return [ln for ln in self.lines if any(p.search(ln) for p in WARNING_PATTERNS)]


@contextlib.contextmanager
def capture_bridge_warnings() -> Iterator[CapturedWarnings]:
    """Collect every Python warning, every log record at WARNING+ (any logger) and every
    line printed to stdout/stderr while converting (the bridge uses all three)."""
    captured = CapturedWarnings()

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.lines.append(f"{record.name}: {record.getMessage()}")

    handler = _Handler(level=logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    out, err = io.StringIO(), io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            yield captured
    finally:
        root.removeHandler(handler)
        captured.lines.extend(f"{w.category.__name__}: {w.message}" for w in caught)
        captured.lines.extend(ln for ln in (out.getvalue() + err.getvalue()).splitlines()
                              if ln.strip())
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())


def compare_state_dicts(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Every tensor present in both, same dtype, shape and bitwise-equal values."""
    import torch

    problems = [f"missing after round trip: {k}" for k in sorted(set(before) - set(after))]
    problems += [f"extra after round trip: {k}" for k in sorted(set(after) - set(before))]
    for k in sorted(set(before) & set(after)):
        a, b = before[k], after[k]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            problems.append(f"{k}: {a.dtype}{tuple(a.shape)} became {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item()
            problems.append(f"{k}: values differ (max abs diff {diff:.3g})")
    return problems


def compare_logits(hf_logits: Any, mg_logits: Any, cosine_min: float) -> tuple[bool, str]:
    """Full-sequence logits [B, T, V]: cosine over all positions > min, same top-1 everywhere."""
    import torch

    a = hf_logits.float().reshape(-1, hf_logits.shape[-1])
    b = mg_logits.float().reshape(-1, mg_logits.shape[-1])
    if a.shape != b.shape:
        return False, f"logits shapes differ: {tuple(hf_logits.shape)} vs {tuple(mg_logits.shape)}"
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False, "non-finite logits"
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    per_pos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    top_same = (a.argmax(-1) == b.argmax(-1))
    ok = cos > cosine_min and bool(top_same.all())
    msg = (f"cosine {cos:.6f} (min over positions {per_pos.min().item():.6f}, required > "
           f"{cosine_min}), top-1 equal at {int(top_same.sum())}/{top_same.numel()} positions")
    return ok, msg


def environment_report() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_available"] = bool(torch.cuda.is_available())
        env["gpus"] = torch.cuda.device_count() if env["cuda_available"] else 0
    except ImportError as exc:
        env["torch"] = None
        env["cuda_available"] = False
        env["torch_error"] = str(exc)
    env["transformer_engine"] = importlib.util.find_spec("transformer_engine") is not None
    return env


def gpu_blocker(env: dict[str, Any]) -> str | None:
    if not env.get("cuda_available"):
        return "no CUDA GPU visible (the HYV3 bridge registers router tensors on the CUDA device)"
    if not env.get("transformer_engine"):
        return "Transformer Engine is not installed (the pinned Megatron-Bridge needs it)"
    return import_blocker()


def truncate_checkpoint(src: Path, dst: Path, layers: int) -> Path:
    """The real checkpoint cut to its first ``layers`` decoder layers (no MTP), via
    transformers (config + the tensors of those layers only, read tensor by tensor)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    keep_rx = re.compile(r"^model\.layers\.(\d+)\.")
    wanted: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        m = keep_rx.match(name)
        if m is None or int(m.group(1)) < layers:
            wanted.setdefault(shard, []).append(name)
    tensors = {}
    for shard, names in sorted(wanted.items()):
        with safe_open(src / shard, "pt") as f:
            for n in names:
                tensors[n] = f.get_tensor(n)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = layers
    cfg["num_nextn_predict_layers"] = 0
    if isinstance(cfg.get("mlp_layer_types"), list):
        cfg["mlp_layer_types"] = cfg["mlp_layer_types"][:layers]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).exists():
            (dst / extra).write_bytes((src / extra).read_bytes())
    return dst


def roundtrip_with_megatron(model_dir: Path, out_dir: Path, tokens: Any) -> dict[str, Any]:
    """THE MEGATRON CALL: HF -> Megatron (AutoBridge, TP=PP=EP=1) -> HF with a strict save,
    plus Megatron's full-sequence logits for ``tokens`` and its loaded expert biases.
    Only runs on a GPU node with Transformer Engine and the pinned bridge importable (as in
    Megatron-Bridge's examples/conversion/compare_hf_and_megatron/compare.py)."""
    import torch
    from megatron.bridge import AutoBridge  # noqa: PLC0415

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    bridge = AutoBridge.from_hf_pretrained(str(model_dir))
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = 1
    provider.pipeline_model_parallel_size = 1
    provider.expert_model_parallel_size = 1
    provider.expert_tensor_parallel_size = 1
    provider.pipeline_dtype = torch.bfloat16
    provider.finalize()
    models = provider.provide_distributed_model(wrap_with_ddp=False)
    model = models[0].eval()
    biases = {name: buf.detach().float().cpu() for name, buf in model.named_buffers()
              if name.endswith("router.expert_bias")}
    with torch.no_grad():
        ids = tokens.cuda()
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
    bridge.save_hf_pretrained(models, str(out_dir), strict=True)
    return {"megatron_logits": logits.float().cpu(), "expert_bias": biases}


def load_state_dict(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def hf_logits(model_dir: Path, tokens: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model = model.cuda() if torch.cuda.is_available() else model
    with torch.no_grad():
        return model(input_ids=tokens.to(model.device)).logits.float().cpu()


def check_one_model(label: str, model_dir: Path, work: Path, cosine_min: float,
                    convert: Callable[[Path, Path, Any], dict[str, Any]] = roundtrip_with_megatron
                    ) -> list[CheckResult]:
    """Round trip, expert biases, logits and warnings for one model directory."""
    import torch

    cfg = json.loads((model_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, int(cfg["vocab_size"]), (2, 32), generator=gen)
    out_dir = work / f"{label}-roundtrip"
    results: list[CheckResult] = []
    with capture_bridge_warnings() as captured:
        try:
            converted = convert(model_dir, out_dir, tokens)
        except Exception as exc:  # the conversion itself failed: every check fails
            msg = f"conversion raised {type(exc).__name__}: {exc}"
            return [CheckResult(f"{label}/{n}", "fail", msg)
                    for n in ("roundtrip_tensors", "expert_bias", "logits", "bridge_warnings")]
    before = load_state_dict(model_dir)
    after = load_state_dict(out_dir)
    mtp_rx = re.compile(rf"^model\.layers\.{int(cfg['num_hidden_layers'])}\.")
    problems = compare_state_dicts(before, after)
    results.append(CheckResult(
        f"{label}/roundtrip_tensors", "fail" if problems else "pass",
        f"{len(before)} tensors HF -> Megatron -> HF (strict save), bitwise equal"
        if not problems else f"{len(problems)} tensors differ", problems))
    hf_bias = {k: v.float() for k, v in before.items() if k.endswith("mlp.expert_bias")}
    mg_bias = converted["expert_bias"]
    bias_problems = []
    for k, v in sorted(hf_bias.items()):
        layer = int(k.split(".")[2])
        matches = [t for n, t in mg_bias.items() if re.search(rf"\.{layer}\.mlp\.router", n)
                   or (mtp_rx.match(k) and "mtp" in n)]
        if not matches:
            bias_problems.append(f"{k}: no Megatron router.expert_bias for layer {layer}")
        elif not any(torch.equal(v, t) for t in matches):
            bias_problems.append(f"{k}: Megatron value differs (zeros: "
                                 f"{bool((matches[0] == 0).all())})")
    results.append(CheckResult(
        f"{label}/expert_bias", "fail" if bias_problems else "pass",
        f"{len(hf_bias)} expert biases equal after loading" if not bias_problems
        else f"{len(bias_problems)} expert biases not loaded", bias_problems))
    ok, msg = compare_logits(hf_logits(model_dir, tokens), converted["megatron_logits"],
                             cosine_min)
    results.append(CheckResult(f"{label}/logits", "pass" if ok else "fail", msg))
    bad = captured.offending()
    results.append(CheckResult(
        f"{label}/bridge_warnings", "fail" if bad else "pass",
        f"{len(captured.lines)} warnings captured, none about a missing mapping or key"
        if not bad else f"{len(bad)} warnings about missing mappings or keys", bad))
    return results


def not_run_results(labels: Sequence[str], why: str) -> list[CheckResult]:
    return [CheckResult(f"{label}/{n}", "not run", why) for label in labels
            for n in ("roundtrip_tensors", "expert_bias", "logits", "bridge_warnings")]


def write_report(path: Path, results: list[CheckResult], extra: dict[str, Any]) -> dict[str, Any]:
    """Write the checks JSON atomically (temp file + os.replace); return the document."""
    from datetime import UTC, datetime

    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "not run")}
    doc = {
        "schema_version": 1,
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "ok": counts["fail"] == 0,
        "counts": counts,
        **extra,
        "checks": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
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


AGREEMENT = "mapping_table_agreement"


def check_table_agreement(lock: Path | None, config_json: Path) -> CheckResult:
    """The mapping table parsed from the pinned hy_v3_bridge.py (as check_checkpoint reads
    it) must agree with the imported bridge's own mapping_registry() for this config."""
    if lock is None:
        return CheckResult(AGREEMENT, "not run", "not run: no --lock (pinned Megatron-Bridge)")
    try:
        entry = json.loads(Path(lock).read_text())["repos"]["megatron_bridge"]
        clone, commit = Path(entry["path"]), entry.get("head") or entry["commit"]
        parsed = read_mapping_table(read_pinned_source(clone, commit),
                                    json.loads(config_json.read_text()),
                                    filename=str(clone / BRIDGE_RELPATH))
    except (OSError, ValueError, KeyError, TypeError) as exc:  # TableFormatError included
        return CheckResult(AGREEMENT, "not run", f"not run: cannot read the parsed table: {exc}")
    imported, why = imported_registry_subprocess(clone / "src", config_json)
    if imported is None:
        return CheckResult(AGREEMENT, "not run", f"not run: {why}")
    problems = compare_tables(parsed, imported)
    return CheckResult(AGREEMENT, "fail" if problems else "pass",
                       f"{len(problems)} disagreements between the parsed table and the "
                       "imported mapping_registry()" if problems else
                       f"imported mapping_registry() agrees with the table parsed from "
                       f"{BRIDGE_RELPATH}@{commit[:12]} ({len(imported)} mappings)", problems)


def check_bridge(out: Path, tiny: dict[str, Any], cosine_min: float, real_path: str | None,
                 real_layers: int, env: dict[str, Any] | None = None,
                 lock: Path | None = None) -> dict[str, Any]:
    env = env if env is not None else environment_report()
    labels = ["tiny"] + (["real_truncated"] if real_path and real_layers > 0 else [])
    blocker = gpu_blocker(env)
    if blocker:
        results = [CheckResult(AGREEMENT, "not run", f"not run: {blocker}"),
                   *not_run_results(labels, f"not run: {blocker}")]
        return write_report(out, results, {"environment": env})
    from hy3rl.model import build_tiny_model

    results = []
    with tempfile.TemporaryDirectory(prefix="hy3rl-bridge-") as tmp:
        work = Path(tmp)
        seed = int(tiny.get("seed", 0))
        sizes = {k: v for k, v in tiny.items() if k != "seed"}
        tiny_dir = build_tiny_model(work / "tiny", seed=seed, **sizes)
        results.append(check_table_agreement(lock, tiny_dir / "config.json"))
        results += check_one_model("tiny", tiny_dir, work, cosine_min)
        if "real_truncated" in labels:
            trunc = truncate_checkpoint(Path(real_path), work / "real", real_layers)
            results += check_one_model("real_truncated", trunc, work, cosine_min)
    env["bridge_imported"] = True
    return write_report(out, results, {"environment": env})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hy3rl.bridge", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="HF -> Megatron -> HF round trip on a GPU node")
    chk.add_argument("--config-json", required=True,
                     help='config slices {"model": {...}, "checks": {...}} as JSON')
    chk.add_argument("--out", required=True, help="results/<run>/checks/bridge.json")
    chk.add_argument("--lock", help="results/<run>/deps/lock.json: the pinned Megatron-Bridge "
                     "clone, whose src/ goes first on sys.path")
    dump = sub.add_parser("dump-registry", help="print the imported bridge's mapping table")
    dump.add_argument("--src", required=True, help="Megatron-Bridge src/ directory")
    dump.add_argument("--config", required=True, help="a Hy3 config.json")
    args = ap.parse_args(argv)
    if args.cmd == "dump-registry":
        rows = registry_from_import(Path(args.src), Path(args.config))
        print(REGISTRY_MARKER
              + json.dumps([{"kind": m.kind, "megatron": m.megatron, "hf": m.hf} for m in rows]))
        return 0
    cfg = json.loads(args.config_json)
    if args.lock:
        clone = json.loads(Path(args.lock).read_text())["repos"]["megatron_bridge"]["path"]
        sys.path.insert(0, str(Path(clone) / "src"))
    bridge_cfg = cfg.get("checks", {}).get("bridge", {})
    model_path = cfg.get("model", {}).get("path")
    from hy3rl.model import TINY_DEFAULT_PATH

    real = model_path if model_path and model_path != TINY_DEFAULT_PATH else None
    doc = check_bridge(Path(args.out), cfg.get("model", {}).get("tiny", {}),
                       float(bridge_cfg.get("logits_cosine_min", 0.9999)), real,
                       int(bridge_cfg.get("real_layers", 0)),
                       lock=Path(args.lock) if args.lock else None)
    results = [CheckResult(**c) for c in doc["checks"]]
    print(f"check_bridge: {doc['counts']} -> {args.out}")
    print("\n".join(summary_lines(results)))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
