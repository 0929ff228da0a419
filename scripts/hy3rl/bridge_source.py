"""Megatron-Bridge's HYV3 mapping table, read from the pinned source without importing it.

``read_mapping_table(source, hf_config)``: the pinned ``hy_v3_bridge.py`` (read from the
clone at the locked commit, :func:`read_pinned_source`) is parsed with Python's ``ast``
(never imported: the bridge imports only where Transformer Engine is installed) and its
``mapping_registry()`` body is *evaluated* by a small interpreter that understands exactly
the constructs such a function is made of: a dict of Megatron -> HF name patterns,
``AutoMapping`` / ``QKVMapping(q=, k=, v=)`` / ``GatedMLPMapping(gate=, up=)`` calls, list
comprehensions over ``.items()``, ``for`` loops over ``range(...)`` (the MTP loop),
``if ...: continue``, ``str.replace``, f-strings, ``getattr(hf_config, ...)``. Anything
else raises ``TableFormatError``, so a changed file yields a check that is ``not run`` with
the reason, never a silent pass.

Where the pinned bridge does import, :func:`imported_registry_subprocess` gets the same
table from its own ``mapping_registry()`` in a child process (``python -m
hy3rl.bridge_source --src <clone>/src --config <config.json>``, this module's internal entry
point) and :func:`compare_tables` says where the two disagree. Used by
``hy3rl.checkpoint`` (rule check_checkpoint) and ``hy3rl.bridge`` (rule check_bridge).
Standard library only (``hy3rl.bridge`` runs inside the training runtime).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
REGISTRY_MARKER = "HY3RL_REGISTRY "  # prefix of the entry point's output line


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



@dataclass(frozen=True)
class BridgeSource:
    """The pinned Megatron-Bridge clone and the commit its ``hy_v3_bridge.py`` is read at."""

    clone: Path
    commit: str

    @property
    def file(self) -> Path:
        return self.clone / BRIDGE_RELPATH


def bridge_source_from_lock(lock_path: Path) -> tuple[BridgeSource | None, str]:
    """The pinned clone named by ``deps/lock.json``, or None and why not."""
    try:
        lock = json.loads(Path(lock_path).read_text())
        entry = lock["repos"]["megatron_bridge"]
        return BridgeSource(Path(entry["path"]), entry.get("head") or entry["commit"]), ""
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{lock_path}: no repos.megatron_bridge.path/head ({exc!r})"


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
            [sys.executable, "-m", "hy3rl.bridge_source", "--src", str(src_dir),
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
        return None, f"the import printed no readable mapping table ({exc!r})"


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


def main(argv: list[str] | None = None) -> int:
    """Internal entry point (child of :func:`imported_registry_subprocess`): print the
    imported bridge's mapping table as one marked JSON line."""
    ap = argparse.ArgumentParser(prog="python -m hy3rl.bridge_source",
                                 description="print the imported bridge's mapping table")
    ap.add_argument("--src", required=True, type=Path, help="Megatron-Bridge src/ directory")
    ap.add_argument("--config", required=True, type=Path, help="a Hy3 config.json")
    args = ap.parse_args(argv)
    rows = registry_from_import(args.src, args.config)
    print(REGISTRY_MARKER
          + json.dumps([{"kind": m.kind, "megatron": m.megatron, "hf": m.hf} for m in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
