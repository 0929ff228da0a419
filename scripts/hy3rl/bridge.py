"""check_bridge: HF -> Megatron -> HF through the pinned Megatron-Bridge on one GPU node.

``run(bridge, model, runtime, lock=, out=)`` (rule check_bridge's adapter, on the host of the
GPU job) starts this module's internal entry point in the training runtime, as the
trainer's nodes run (``train.runtime``: ``<prefix> <python> -m hy3rl.bridge --out ...``,
with ``PYTHONPATH`` naming this package), and fails when the report has a failed check.

Inside the runtime (``main``), :func:`check_bridge` loads the tiny Hy3 (and optionally the
real checkpoint truncated to N layers) through ``AutoBridge``, converts HF -> Megatron ->
HF with a strict save and compares every tensor, the expert biases, and full-sequence
logits; any bridge warning about a missing mapping or key is a failure. It first checks
that the mapping table read from the pinned source (:mod:`hy3rl.bridge_source`, as
check_checkpoint reads it) agrees with the imported bridge's own. Without a GPU /
Transformer Engine / importable bridge every check is ``not run`` with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hy3rl.bridge_source import (
    BRIDGE_RELPATH,
    bridge_source_from_lock,
    compare_tables,
    import_blocker,
    imported_registry_subprocess,
    read_mapping_table,
    read_pinned_source,
)
from hy3rl.checkpoint import CheckResult, failure_message, summary_lines, write_report
from hy3rl.errors import StageError

if TYPE_CHECKING:
    from hy3rl.settings import BridgeCheck, Model, Runtime


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


AGREEMENT = "mapping_table_agreement"


def check_table_agreement(lock: Path | None, config_json: Path) -> CheckResult:
    """The mapping table parsed from the pinned hy_v3_bridge.py (as check_checkpoint reads
    it) must agree with the imported bridge's own mapping_registry() for this config."""
    if lock is None:
        return CheckResult(AGREEMENT, "not run", "not run: no --lock (pinned Megatron-Bridge)")
    source, why = bridge_source_from_lock(Path(lock))
    if source is None:
        return CheckResult(AGREEMENT, "not run", f"not run: cannot read the parsed table: {why}")
    try:
        parsed = read_mapping_table(read_pinned_source(source.clone, source.commit),
                                    json.loads(config_json.read_text()),
                                    filename=str(source.file))
    except (OSError, ValueError) as exc:  # TableFormatError included
        return CheckResult(AGREEMENT, "not run", f"not run: cannot read the parsed table: {exc}")
    imported, why = imported_registry_subprocess(source.clone / "src", config_json)
    if imported is None:
        return CheckResult(AGREEMENT, "not run", f"not run: {why}")
    problems = compare_tables(parsed, imported)
    return CheckResult(AGREEMENT, "fail" if problems else "pass",
                       f"{len(problems)} disagreements between the parsed table and the "
                       "imported mapping_registry()" if problems else
                       f"imported mapping_registry() agrees with the table parsed from "
                       f"{BRIDGE_RELPATH}@{source.commit[:12]} ({len(imported)} mappings)",
                       problems)


def check_bridge(out: Path, tiny: dict[str, Any], cosine_min: float, real_path: str | None,
                 real_layers: int, env: dict[str, Any] | None = None,
                 lock: Path | None = None) -> dict[str, Any]:
    """Every check of the report ``out``: the table agreement (``lock``: deps/lock.json),
    then the round trip of the tiny Hy3 built from ``tiny`` (model.tiny's seed and sizes)
    and, with ``real_path`` and ``real_layers`` > 0, of the truncated real checkpoint.
    ``env``: this machine's (``environment_report()``), or a test's."""
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
        tiny_dir = build_tiny_model(work / "tiny", **tiny)
        results.append(check_table_agreement(lock, tiny_dir / "config.json"))
        results += check_one_model("tiny", tiny_dir, work, cosine_min)
        if "real_truncated" in labels:
            trunc = truncate_checkpoint(Path(real_path), work / "real", real_layers)
            results += check_one_model("real_truncated", trunc, work, cosine_min)
    env["bridge_imported"] = True
    return write_report(out, results, {"environment": env})


# ------------------------------------------------------------ the rule's side (the host)


class BridgeCheckFailed(StageError):
    """The bridge check failed, or could not run in the training runtime."""


def runtime_command(runtime: Runtime) -> list[str]:
    """``<train.runtime.prefix> <python>``: the training runtime's interpreter, resolved as
    the launcher resolves it for every node (``hy3rl.launch.resolve_runtime``)."""
    from hy3rl.launch import LaunchError, resolve_runtime

    try:
        rt = resolve_runtime(runtime)
    except LaunchError as exc:
        raise BridgeCheckFailed(str(exc)) from None
    return [*shlex.split(rt["prefix"]), rt["python"]]


def run(bridge: BridgeCheck, model: Model, runtime: Runtime, *, lock: Path, out: Path) -> None:
    """Run the bridge check in the training runtime (``train.runtime``) on this node,
    writing ``out`` (``checks/bridge.json``); ``lock`` is ``deps/lock.json`` (the pinned
    Megatron-Bridge clone). Raises :class:`BridgeCheckFailed` when a check failed or the
    runtime did not run it. Checks that cannot run here are ``not run``, not a failure."""
    from hy3rl.launch import SCRIPTS_DIR
    from hy3rl.layout import TINY_MODEL_DIR

    out = Path(out).resolve()
    out.unlink(missing_ok=True)  # the report read below is this run's
    interpreter = runtime_command(runtime)
    cmd = [*interpreter, "-m", "hy3rl.bridge", "--out", str(out),
           "--lock", str(Path(lock).resolve()),
           "--cosine-min", repr(bridge.logits_cosine_min),
           "--real-layers", str(bridge.real_layers)]
    if model.path != TINY_MODEL_DIR and bridge.real_layers > 0:
        cmd += ["--real-path", str(Path(model.path).resolve())]
    cmd += [f"--tiny={k}={v}" for k, v in asdict(model.tiny).items()]
    # The runtime has no hy3rl installed: it imports this checkout's package.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SCRIPTS_DIR), os.environ.get("PYTHONPATH", "")) if p)}
    print(f"check_bridge: {shlex.join(cmd)}", flush=True)
    try:
        code = subprocess.run(cmd, env=env).returncode
    except OSError as exc:
        raise BridgeCheckFailed(f"cannot start the training runtime (train.runtime "
                                f"{cmd[0]!r}): {exc}") from None
    if code == 0:
        return
    try:
        doc = json.loads(out.read_text())
    except (OSError, ValueError):
        doc = None
    if doc is None or doc.get("ok", True):
        raise BridgeCheckFailed(f"the bridge check exited {code} in the training runtime "
                                f"({shlex.join(interpreter)}) without a report of failed checks; "
                                "its output is above")
    raise BridgeCheckFailed(failure_message(doc, "check_bridge", out))


# ------------------------------------------------- the entry point inside the runtime


def main(argv: list[str] | None = None) -> int:
    """Internal entry point, run by :func:`run` in the training runtime: exit 0 when no
    check failed (``not run`` included), 1 otherwise."""
    ap = argparse.ArgumentParser(prog="python -m hy3rl.bridge",
                                 description="HF -> Megatron -> HF round trip on a GPU node")
    ap.add_argument("--out", required=True, type=Path, help="checks/bridge.json")
    ap.add_argument("--lock", type=Path, help="deps/lock.json: the pinned Megatron-Bridge "
                    "clone, whose src/ goes first on sys.path")
    ap.add_argument("--cosine-min", required=True, type=float)
    ap.add_argument("--real-layers", type=int, default=0)
    ap.add_argument("--real-path", help="the real checkpoint to truncate (cfg.model.path)")
    ap.add_argument("--tiny", action="append", default=[], metavar="KEY=INT",
                    help="model.tiny.<KEY> (repeated)")
    args = ap.parse_args(argv)
    tiny = {k: int(v) for k, v in (t.split("=", 1) for t in args.tiny)}
    if args.lock:
        source, _ = bridge_source_from_lock(args.lock)
        if source is not None:
            sys.path.insert(0, str(source.clone / "src"))
    doc = check_bridge(args.out, tiny, args.cosine_min, args.real_path, args.real_layers,
                       lock=args.lock)
    results = [CheckResult(**c) for c in doc["checks"]]
    print(f"check_bridge: {doc['counts']} -> {args.out}")
    print("\n".join(summary_lines(results)), flush=True)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
