"""Preflight: resolve the exact verl launch and check it before any GPU is allocated.

1. Run the pinned verl launch script (``examples/grpo_trainer/run_hy_v3_megatron.sh``, or a
   recipe script) with its environment knobs taken from the config and a printer in place of
   ``python3``: the printer records the script's exact ``python3 -m <entrypoint> ...`` argv.
2. Append corrections of upstream traps as Hydra overrides (later overrides win): the live
   ``reward.*`` keys of the DAPO reward manager, an absolute checkpoint directory, a bounded
   number of steps, ``resume_mode=auto``, the ``file`` logger, then ``train.algorithm``, a
   custom reward function, and ``train.verl_overrides`` last.
3. Compose the result with the pinned verl's Hydra config (``hydra.compose``; verl itself is
   not imported): an unknown key is an error naming it.
4. Check coupling rules (parallel layout, token budgets, batch sizes, frequencies, disk) on
   the composed values; each rule has a stable name and can be waived by name.
5. Write ``plan.json`` (every value with its source) and ``launch.sh`` (the rendered launch),
   and estimate the GPU-hours. Exit 1 when any rule is in error. Formats:
   docs/formats/preflight.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from hy3rl.atomic import write_json_atomic, write_text_atomic

SCHEMA_VERSION = 1
DEFAULT_SCRIPT = "examples/grpo_trainer/run_hy_v3_megatron.sh"
DEFAULT_ENTRYPOINT = "verl.trainer.main_ppo"
PRINTER_TIMEOUT_S = 60

PAPER_DEFAULT = "paper default"
CONFIG = "config"
CORRECTION = "correction"

# Every rule, by its stable name (used in plan.json and in `preflight.waive`).
RULES: dict[str, str] = {
    "verl_pin": "the verl clone is at the commit recorded in deps/lock.json",
    "knobs": "every train.env knob is read by the launch script and not owned by another key",
    "compose": "the overrides compose with the pinned verl's Hydra config (no unknown key), "
               "and the numeric values the rules read are numbers",
    "checkpoint_checks": "checks/checkpoint.json has no failed check",
    "gpus": "GPUs = nodes x GPUs per node, the same in the config and in verl's trainer keys",
    "actor_layout": "actor TP x PP x CP and EP x ETP x PP divide the GPUs",
    "ref_layout": "reference TP x PP x CP and EP x ETP x PP divide the GPUs",
    "rollout_tp": "rollout TP divides the GPUs and holds the model's weights on the GPU type",
    "actor_token_budget": "ppo_max_token_len_per_gpu x CP >= prompt + response",
    "max_model_len": "rollout.max_model_len >= prompt + response",
    "log_prob_token_budget": "rollout/ref log_prob_max_token_len_per_gpu x CP >= prompt + response",
    "batch_divisible": "train batch x n divisible by the mini batch and the data-parallel size",
    "total_steps": "trainer.total_training_steps is set and positive",
    "save_test_freq": "save_freq and test_freq are positive and at most the total steps",
    "checkpoint_root": "checkpoints go to an absolute directory outside Ray's working dir",
    "async_save": "actor.checkpoint.async_save is off (with it the tracker file is not written)",
    "disk": "free space on the checkpoint root holds (keep + 1) checkpoints",
    "segment_schedule": "train.segment_steps only with a constant learning-rate schedule",
    "ref_kl_zero": "warning: the reference model is computed while the KL coefficient is 0",
    "val_on_resume": "warning: validation before training re-runs on every resume",
    "prompts_over_max": "warning: training prompts longer than max_prompt_length",
    "oom_actor_memory": "warning: actor weights + optimizer per GPU vs GPU memory without offload",
    "oom_rollout_memory": "warning: rollout weights per GPU leave little room for the KV cache",
    "oom_micro_batch": "warning: static micro batches whose tokens exceed the token budget",
}
NOT_WAIVABLE = {"compose"}

# Dense BF16 peak TFLOPS by GPU type (vendor datasheets), for the GPU-hour estimate.
GPU_TFLOPS = {"h20": 148.0, "h100": 989.0, "h800": 989.0, "h200": 989.0, "a100": 312.0,
              "a800": 312.0, "b200": 2250.0, "l40s": 362.0}

# Keys the workflow owns: a recipe script's own value is replaced by the workflow's.
WORKFLOW_OWNED = (
    "actor_rollout_ref.model.path", "data.train_files", "data.val_files",
    "data.max_prompt_length", "trainer.nnodes", "trainer.n_gpus_per_node",
)
# Settings Hy3 needs (MoE router with expert bias and no aux loss, the Megatron bridge, the
# layout that fits the model): carried over from the default script when a recipe lacks them.
HY3_REQUIRED = (
    "model_engine",
    "actor_rollout_ref.model.trust_remote_code",
    "actor_rollout_ref.actor.megatron.use_mbridge",
    "actor_rollout_ref.actor.megatron.vanilla_mbridge",
    "actor_rollout_ref.ref.megatron.use_mbridge",
    "actor_rollout_ref.ref.megatron.vanilla_mbridge",
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_enable_expert_bias",
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_bias_update_rate",
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_load_balancing_type",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size",
    "actor_rollout_ref.actor.megatron.context_parallel_size",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
)
HY3_ORIGIN = f"hy3-required (carried over from {DEFAULT_SCRIPT})"
# Environment variables a logger reads (verl/utils/tracking.py at the pin and the logger
# libraries): names only; the train launcher passes those that are set to the Ray job.
LOGGER_ENV = {
    "file": ["VERL_FILE_LOGGER_PATH"],
    "wandb": ["WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_ENTITY"],
    "swanlab": ["SWANLAB_API_KEY", "SWANLAB_MODE"],
    "mlflow": ["MLFLOW_TRACKING_URI"],
    "tensorboard": ["TENSORBOARD_DIR"],
    "clearml": ["CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY", "CLEARML_API_HOST"],
}
# Knobs of the default script that other config keys own.
OWNED_KNOBS = {
    "NNODES": "cluster.nodes", "NGPUS_PER_NODE": "cluster.gpus_per_node",
    "GPUS_PER_NODE": "cluster.gpus_per_node", "MODEL_PATH": "model.path",
    "TRAIN_FILES": "data (results/<run>/data/train.parquet)",
    "VAL_FILES": "data (results/<run>/data/val.parquet)",
    "MAX_PROMPT_LENGTH": "data.max_prompt_length",
}


class PreflightError(RuntimeError):
    """An input is missing or wrong; the message names the file or key."""


# --------------------------------------------------------------------------- records


@dataclass
class Override:
    text: str  # exactly as passed to Hydra
    key: str
    value: str
    source: str  # paper default | config | correction
    origin: str  # script | reward_mode=... | train.verl_overrides | ...


@dataclass
class RuleResult:
    name: str
    status: str  # pass | error | warning | waived | not run
    messages: list[str] = field(default_factory=list)


@dataclass
class Capture:
    module: str
    overrides: list[str]
    exports: dict[str, str]


@dataclass
class Plan:
    schema_version: int
    created: str
    run: str
    ok: bool
    launched: bool
    not_launched_reason: str | None
    verl: dict[str, Any]
    knobs: dict[str, dict[str, str]]
    script_exports: dict[str, str]
    overrides: list[Override]
    resolved: dict[str, dict[str, str]]
    effective: dict[str, Any]
    effective_sources: dict[str, dict[str, str]]
    reward: dict[str, Any]
    checkpoint: dict[str, Any]
    loggers: dict[str, Any]
    rules: list[RuleResult]
    errors: list[str]
    warnings: list[str]
    waived: list[str]
    estimate: dict[str, Any]
    launch: dict[str, Any]


# --------------------------------------------------------------------------- overrides


def split_override(text: str) -> tuple[str, str, str]:
    """``'+a.b=1'`` -> ``('+', 'a.b', '1')``; a bare key gives value ''."""
    m = re.match(r"^(\+\+|\+|~)?([^=]+)(?:=(.*))?$", text, re.S)
    if not m:
        raise PreflightError(f"cannot parse the Hydra override {text!r}")
    return m.group(1) or "", m.group(2), m.group(3) or ""


_SAFE = re.compile(r"^[A-Za-z0-9_./:\-+@~]+$")


def hydra_value(value: Any) -> str:
    """Render a YAML value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _SAFE.match(text) and text.lower() not in {"null", "true", "false"}:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def knob_value(value: Any) -> str:
    """Render a config value as a shell environment value (bash scripts compare strings)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "null"
    return str(value)


def last_values(overrides: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for text in overrides:
        _, key, value = split_override(text)
        out[key] = value
    return out


# --------------------------------------------------------------------------- the script


def script_knobs(text: str) -> list[str]:
    """Environment variables a launch script reads with a default (``${NAME:-...}``)."""
    return sorted(set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-", text)))


_PRINTER = """#!{python}
import json, os, sys
with open(os.environ["HY3RL_PRINTER_OUT"], "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
"""
_SHELL_NOISE = {"PWD", "OLDPWD", "SHLVL", "_", "LC_CTYPE", "HY3RL_PRINTER_OUT", "PATH", "HOME"}


def capture_launch(verl_dir: Path, script: str, env: Mapping[str, str]) -> Capture:
    """Run ``script`` (relative to the verl clone) with ``env`` only and a ``python3`` that
    records its argv instead of training; return the last ``python3 -m <module>`` call."""
    path = verl_dir / script
    if not path.is_file():
        raise PreflightError(f"launch script {path} does not exist (train.launch_script)")
    with tempfile.TemporaryDirectory(prefix="hy3rl-printer-") as tmp:
        bindir = Path(tmp) / "bin"
        bindir.mkdir()
        for name in ("python3", "python"):
            exe = bindir / name
            exe.write_text(_PRINTER.format(python=sys.executable))
            exe.chmod(0o755)
        out = Path(tmp) / "calls.jsonl"
        run_env = {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "HOME": tmp,
                   "HY3RL_PRINTER_OUT": str(out), **env}
        try:
            proc = subprocess.run(["bash", str(path)], cwd=verl_dir, env=run_env,
                                  capture_output=True, text=True, timeout=PRINTER_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise PreflightError(f"{script} did not reach python3 within "
                                 f"{PRINTER_TIMEOUT_S}s") from exc
        calls = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    calls = [c for c in calls if len(c["argv"]) >= 2 and c["argv"][0] == "-m"]
    if proc.returncode != 0 or not calls:
        raise PreflightError(
            f"{script} exited {proc.returncode} without a `python3 -m <module>` call; "
            f"its stderr ends with:\n{proc.stderr[-2000:]}")
    call = calls[-1]
    exports = {k: v for k, v in call["env"].items()
               if k not in _SHELL_NOISE and run_env.get(k) != v}
    return Capture(module=call["argv"][1], overrides=list(call["argv"][2:]), exports=exports)


def hydra_config_of(verl_dir: Path, module: str) -> tuple[Path, str]:
    """The Hydra config dir and name of an entrypoint module (its ``@hydra.main``)."""
    src = verl_dir / (module.replace(".", "/") + ".py")
    if not src.is_file():
        raise PreflightError(f"entrypoint module {module} not found at {src}")
    text = src.read_text()
    m = re.search(r"@hydra\.main\(([^)]*)\)", text)
    default_dir = verl_dir / "verl/trainer/config"
    if not m and module == DEFAULT_ENTRYPOINT and (default_dir / "ppo_trainer.yaml").is_file():
        return default_dir.resolve(), "ppo_trainer"  # main_ppo's config at the pin
    if not m:
        raise PreflightError(f"{src}: no @hydra.main(...) found; cannot compose its config")
    args = dict(re.findall(r"(config_path|config_name)\s*=\s*[\"']([^\"']+)[\"']", m.group(1)))
    if "config_name" not in args:
        raise PreflightError(f"{src}: @hydra.main has no config_name")
    return (src.parent / args.get("config_path", ".")).resolve(), args["config_name"]


def compose(config_dir: Path, config_name: str, overrides: list[str]):
    """Compose with Hydra (no verl import). Raise PreflightError with Hydra's message (which
    names an unknown key) on failure."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        msg = str(exc).strip()
        cause = exc.__cause__
        if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
            msg += f" ({str(cause).strip().splitlines()[0]})"
        raise PreflightError(msg) from exc


_MISSING = object()


def select(cfg, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False)
    except Exception:  # an interpolation that cannot resolve here
        return default
    if value is _MISSING:
        return default
    if hasattr(value, "_metadata"):
        return OmegaConf.to_container(value, resolve=True)
    return value


def has_key(cfg, key: str) -> bool:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False) is not _MISSING
    except Exception:
        return True


def legacy_reward_callers(verl_dir: Path) -> list[str]:
    """Files of the pinned verl (tests excluded) that call ``migrate_legacy_reward_impl(``."""
    files = []
    for path in sorted(verl_dir.rglob("*.py")):
        rel = path.relative_to(verl_dir).as_posix()
        if rel.startswith(("tests/", ".git/")):
            continue
        text = path.read_text(errors="replace")
        if "migrate_legacy_reward_impl(" not in text:
            continue
        if any("migrate_legacy_reward_impl(" in ln and not ln.lstrip().startswith("def ")
               for ln in text.splitlines()):
            files.append(rel)
    return files


# --------------------------------------------------------------------------- inputs


def read_json(path: Path | None, what: str) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PreflightError(f"{path}: not valid JSON ({what}): {exc}") from exc


def verl_from_lock(lock: Mapping[str, Any], lock_path: Path) -> tuple[Path, str]:
    try:
        entry = lock["repos"]["verl"]
        return Path(entry["path"]), str(entry.get("head") or entry["commit"])
    except (KeyError, TypeError) as exc:
        raise PreflightError(f"{lock_path}: no repos.verl.path/commit ({exc})") from exc


def git_head(path: Path) -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def model_bytes(cfg: Mapping[str, Any]) -> tuple[int | None, str]:
    """Bytes of the policy's weights: preflight.model_bytes, else the checkpoint's index."""
    configured = int(cfg.get("preflight", {}).get("model_bytes", 0) or 0)
    if configured > 0:
        return configured, "preflight.model_bytes"
    mpath = Path(cfg.get("model", {}).get("path", ""))
    index = mpath / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return int(total), f"{index} metadata.total_size"
    shards = sorted(mpath.glob("*.safetensors")) if mpath.is_dir() else []
    if shards:
        return sum(p.stat().st_size for p in shards), f"size of {len(shards)} shards in {mpath}"
    return None, f"unknown (no preflight.model_bytes and no safetensors under {mpath})"


def summary_facts(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """Numbers preflight uses from data/summary.json (format: docs/formats/data.md)."""
    if not summary:
        return {}
    splits = summary.get("splits") or {}
    train, val = splits.get("train") or {}, splits.get("val") or {}
    over = train.get("over_max_prompt_length")
    return {
        "train_rows": train.get("rows"),
        "val_rows": val.get("rows"),
        "val_n": summary.get("val_n"),
        "prompts_over_max": over.get("rows") if isinstance(over, Mapping) else over,
        "mean_prompt_tokens": (train.get("prompt_tokens") or {}).get("mean"),
    }


# --------------------------------------------------------------------------- resolution


@dataclass
class Resolution:
    verl_dir: Path
    script: str
    module: str
    config_dir: Path
    config_name: str
    knobs: dict[str, dict[str, str]]
    exports: dict[str, str]
    overrides: list[Override]
    reward: dict[str, Any]
    loggers: list[str]
    checkpoint_dir: str
    reward_fn_copy: tuple[Path, Path] | None  # (source, destination)
    composed: Any = None
    compose_error: str | None = None
    knob_errors: list[str] = field(default_factory=list)


def knob_env(cfg: Mapping[str, Any], paths: Mapping[str, Path], known: list[str],
             val_n: Any = None) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The script's environment: workflow-owned knobs, VAL_N from the data summary, then
    train.env. Returns knobs with their origin and the problems (unknown knob, knob owned by
    another key)."""
    cluster, train = cfg.get("cluster", {}), cfg.get("train", {})
    knobs: dict[str, dict[str, str]] = {
        "NNODES": {"value": str(cluster.get("nodes", 1)), "from": "cluster.nodes"},
        "NGPUS_PER_NODE": {"value": str(cluster.get("gpus_per_node", 0)),
                           "from": "cluster.gpus_per_node"},
        "MODEL_PATH": {"value": str(Path(cfg["model"]["path"]).absolute()), "from": "model.path"},
        "TRAIN_FILES": {"value": str(paths["train_files"]), "from": "data"},
        "VAL_FILES": {"value": str(paths["val_files"]), "from": "data"},
        "MAX_PROMPT_LENGTH": {"value": str(cfg.get("data", {}).get("max_prompt_length", 2048)),
                              "from": "data.max_prompt_length"},
    }
    if val_n is not None and "VAL_N" in known:
        knobs["VAL_N"] = {"value": str(val_n), "from": "data/summary.json val_n"}
    problems = []
    for name, value in (train.get("env") or {}).items():
        if name in OWNED_KNOBS:
            problems.append(f"train.env.{name}: set {OWNED_KNOBS[name]} instead")
        elif name not in known:
            problems.append(f"train.env.{name}: the launch script does not read this knob "
                            f"(it reads: {', '.join(known)})")
        else:
            knobs[name] = {"value": knob_value(value), "from": f"train.env.{name}"}
    for knob in knobs.values():
        knob["source"] = CONFIG
    return knobs, problems


def _correction_text(key: str, value: str, base) -> str:
    if key == "model_engine" or has_key(base, key):
        return f"{key}={value}"
    return f"+{key}={value}"


def resolve(cfg: Mapping[str, Any], verl_dir: Path, paths: Mapping[str, Path]) -> Resolution:
    """Steps 1-3 of the module docstring (raises PreflightError for unusable inputs)."""
    train = cfg.get("train", {})
    run_name = cfg["run"]["name"]
    script = train.get("launch_script") or DEFAULT_SCRIPT
    known = script_knobs((verl_dir / DEFAULT_SCRIPT).read_text()) if (
        verl_dir / DEFAULT_SCRIPT).is_file() else []
    if script != DEFAULT_SCRIPT and (verl_dir / script).is_file():
        known = sorted(set(known) | set(script_knobs((verl_dir / script).read_text())))
    knobs, knob_errors = knob_env(cfg, paths, known, paths.get("val_n"))
    env = {k: v["value"] for k, v in knobs.items()}

    # Sources: a value that differs from the script's own default came from the config.
    default_cap = capture_launch(verl_dir, DEFAULT_SCRIPT, {})
    defaults = last_values(default_cap.overrides)
    cap = capture_launch(verl_dir, DEFAULT_SCRIPT, env)
    if script != DEFAULT_SCRIPT:
        hy3 = cap
        cap = capture_launch(verl_dir, script, env)
    config_dir, config_name = hydra_config_of(verl_dir, cap.module)

    overrides: list[Override] = []
    for text in cap.overrides:
        _, key, value = split_override(text)
        source = PAPER_DEFAULT if defaults.get(key) == value else CONFIG
        overrides.append(Override(text, key, value, source, "script" if script == DEFAULT_SCRIPT
                                  else f"recipe {script}"))
    script_vals = last_values(cap.overrides)
    if script != DEFAULT_SCRIPT:  # Hy3's config-group choices first: they decide the key set
        hy3_vals = last_values(hy3.overrides)
        for key in HY3_REQUIRED:
            if "." not in key and key in hy3_vals and key not in script_vals:
                overrides.append(Override(f"{key}={hy3_vals[key]}", key, hy3_vals[key],
                                          CORRECTION, HY3_ORIGIN))
    try:
        base = compose(config_dir, config_name, [o.text for o in overrides])
    except PreflightError as exc:
        base = None
        base_error = f"the launch script's own overrides do not compose: {exc}"
    else:
        base_error = None

    def add(key: str, value: Any, source: str, origin: str, raw: bool = False) -> None:
        rendered = value if raw else hydra_value(value)
        text = _correction_text(key, rendered, base) if base is not None else f"{key}={rendered}"
        overrides.append(Override(text, key, rendered, source, origin))

    if script != DEFAULT_SCRIPT:  # carry Hy3's required settings into the recipe's launch
        for key in WORKFLOW_OWNED:
            if key in hy3_vals and script_vals.get(key) != hy3_vals[key]:
                add(key, hy3_vals[key], CORRECTION, "workflow-owned (recipe value replaced)",
                    raw=True)
        for key in HY3_REQUIRED:
            if "." in key and key in hy3_vals and key not in script_vals:
                add(key, hy3_vals[key], CORRECTION, HY3_ORIGIN, raw=True)

    # Reward: the script's legacy reward_model.* keys are not read by this entrypoint.
    callers = legacy_reward_callers(verl_dir)
    entry_file = cap.module.replace(".", "/") + ".py"
    migrated = entry_file in callers
    legacy = {k: v for k, v in script_vals.items()
              if k == "reward_model.reward_manager" or k.startswith("reward_model.reward_kwargs.")}
    mode = train.get("reward_mode", "intended")
    reward: dict[str, Any] = {
        "mode": mode,
        "legacy_keys_in_script": legacy,
        "legacy_migration_callers": callers,
        "entrypoint_migrates_legacy_keys": migrated,
        "scripted_manager": select(base, "reward.reward_manager.name") if base else None,
        "scripted_kwargs": select(base, "reward.reward_kwargs") if base else None,
    }
    if legacy and not migrated:
        reward["finding"] = (
            f"the launch passes legacy {', '.join(sorted(legacy))}; they compose (Hydra accepts "
            f"them) but {cap.module} reads only reward.*, and the legacy-to-reward migration "
            f"(migrate_legacy_reward_impl) is called only by: {', '.join(callers) or 'nothing'}. "
            f"As scripted the live reward manager is "
            f"{reward['scripted_manager']!r} with reward_kwargs {reward['scripted_kwargs']!r}.")
    elif legacy:
        reward["finding"] = f"{cap.module} migrates the legacy reward_model.* keys: they are live."
    else:
        reward["finding"] = "the launch passes no legacy reward_model.* reward keys."
    if mode == "intended" and legacy and not migrated:
        origin = "reward_mode=intended (legacy reward_model.* made live)"
        if "reward_model.reward_manager" in legacy:
            add("reward.reward_manager.name", legacy["reward_model.reward_manager"], CORRECTION,
                origin, raw=True)
        for key, value in legacy.items():
            if key.startswith("reward_model.reward_kwargs."):
                add("reward." + key[len("reward_model."):], value, CORRECTION, origin, raw=True)

    # Checkpoints, steps, resume, loggers.
    root = train.get("checkpoint_root") or ""
    if root:
        ckpt_dir = str((Path(root) / run_name).absolute())
    else:
        ckpt_dir = str((Path(cfg["run"].get("results_root", "results")) / run_name
                        / "checkpoints").absolute())
    add("trainer.default_local_dir", ckpt_dir, CORRECTION,
        "absolute checkpoint dir (script leaves it relative to Ray's working-dir copy)")
    add("trainer.total_training_steps", int(train.get("total_training_steps", 0)), CORRECTION,
        "bounded run (script trains 1000 epochs)")
    add("trainer.resume_mode", "auto", CORRECTION, "resume contract")
    user_loggers = list(train.get("loggers") or [])
    if not user_loggers:
        scripted = select(base, "trainer.logger") if base is not None else None
        user_loggers = list(scripted) if isinstance(scripted, list) else ["console"]
    loggers = user_loggers + ([] if "file" in user_loggers else ["file"])
    add("trainer.logger", loggers, CORRECTION,
        "file logger next to the user's (path from VERL_FILE_LOGGER_PATH per attempt)")

    # Published-guide customisations (config, not code edits).
    algo = train.get("algorithm") or {}
    if algo.get("adv_estimator"):
        add("algorithm.adv_estimator", algo["adv_estimator"], CONFIG, "train.algorithm")
    if algo.get("loss_mode"):
        add("actor_rollout_ref.actor.policy_loss.loss_mode", algo["loss_mode"], CONFIG,
            "train.algorithm")
    rfn = train.get("reward_function") or {}
    reward_fn_copy = None
    if rfn.get("path"):
        src = Path(rfn["path"])
        if not src.is_file():
            raise PreflightError(f"train.reward_function.path: {src} is not a file")
        dest = paths["out_dir"] / "reward_fn.py"
        reward_fn_copy = (src, dest)
        add("reward.custom_reward_function.path", str(dest.absolute()), CONFIG,
            "train.reward_function (copied next to the plan)")
        add("reward.custom_reward_function.name", rfn.get("name") or "compute_score", CONFIG,
            "train.reward_function")
    for key, value in (train.get("verl_overrides") or {}).items():
        prefix, bare, _ = split_override(str(key))
        if bare == "trainer.logger":
            knob_errors.append("train.verl_overrides.trainer.logger: use train.loggers (the "
                               "file logger is added to it)")
            continue
        overrides.append(Override(f"{prefix}{bare}={hydra_value(value)}", bare,
                                  hydra_value(value), CONFIG, "train.verl_overrides"))

    res = Resolution(verl_dir=verl_dir, script=script, module=cap.module, config_dir=config_dir,
                     config_name=config_name, knobs=knobs, exports=cap.exports,
                     overrides=overrides, reward=reward, loggers=loggers,
                     checkpoint_dir=ckpt_dir, reward_fn_copy=reward_fn_copy,
                     knob_errors=knob_errors)
    if base_error:
        res.compose_error = base_error
        return res
    try:
        res.composed = compose(config_dir, config_name, [o.text for o in overrides])
    except PreflightError as exc:
        res.compose_error = str(exc)
        return res
    reward["effective_manager"] = select(res.composed, "reward.reward_manager.name")
    reward["effective_kwargs"] = select(res.composed, "reward.reward_kwargs")
    return res


# --------------------------------------------------------------------------- rules

EFFECTIVE_KEYS = (
    "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_training_steps",
    "trainer.save_freq", "trainer.test_freq", "trainer.val_before_train",
    "trainer.resume_mode", "trainer.default_local_dir", "trainer.logger",
    "trainer.total_epochs", "trainer.project_name", "trainer.experiment_name",
    "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
    "data.train_files", "data.val_files",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.optim.min_lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    "actor_rollout_ref.actor.optim.lr_decay_style",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c", "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor_rollout_ref.actor.checkpoint.save_contents",
    "actor_rollout_ref.actor.checkpoint.async_save",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "actor_rollout_ref.actor.megatron.context_parallel_size",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size",
    "actor_rollout_ref.actor.megatron.param_offload",
    "actor_rollout_ref.actor.megatron.optimizer_offload",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size",
    "actor_rollout_ref.ref.megatron.context_parallel_size",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size",
    "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.enable_chunked_prefill",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.val_kwargs.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p",
    "algorithm.adv_estimator", "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold",
    "reward.reward_manager.name", "reward.reward_kwargs",
    "reward.custom_reward_function.path",
)


NUMERIC_KEYS = tuple(k for k in EFFECTIVE_KEYS if k.rsplit(".", 1)[1] in {
    "nnodes", "n_gpus_per_node", "total_training_steps", "save_freq", "test_freq",
    "train_batch_size", "max_prompt_length", "max_response_length", "lr", "min_lr",
    "lr_warmup_steps", "lr_warmup_steps_ratio", "ppo_mini_batch_size",
    "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "kl_loss_coef",
    "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size",
    "log_prob_max_token_len_per_gpu", "n", "gpu_memory_utilization", "max_model_len",
    "max_num_batched_tokens", "temperature", "top_p", "kl_coef"})


def effective_values(composed) -> dict[str, Any]:
    return {key: select(composed, key) for key in EFFECTIVE_KEYS}


def effective_sources(eff: Mapping[str, Any], overrides: list[Override]
                      ) -> dict[str, dict[str, str]]:
    """The source of each effective value: that of the last override setting the key, a key
    below it or above it (Hydra: later overrides win); a key no override touches keeps verl's
    config default, which the published run used as well (``paper default``)."""
    out: dict[str, dict[str, str]] = {}
    for key in eff:
        hit = None
        for o in overrides:
            if o.key == key or o.key.startswith(key + ".") or key.startswith(o.key + "."):
                hit = o
        out[key] = ({"source": hit.source, "origin": hit.origin} if hit else
                    {"source": PAPER_DEFAULT, "origin": "verl config default (not overridden)"})
    return out


def check_waivers(cfg: Mapping[str, Any]) -> list[str]:
    """``preflight.waive``, each name a rule that can be waived (else PreflightError)."""
    waive = list(cfg.get("preflight", {}).get("waive") or [])
    for name in waive:
        if name in NOT_WAIVABLE:
            raise PreflightError(f"preflight.waive: rule {name!r} cannot be waived (an override "
                                 f"that does not compose would fail in verl too)")
        if name not in RULES:
            raise PreflightError(f"preflight.waive: unknown rule {name!r} (rules: "
                                 f"{', '.join(n for n in RULES if n not in NOT_WAIVABLE)})")
    return waive


def required_rollout_tp(weight_bytes: int, gpu_memory_gb: float, mem_util: float) -> int:
    """Smallest power-of-two TP whose per-GPU share of the weights fits in
    ``gpu_memory_gb * 1e9 * mem_util`` (weights only; the KV cache needs more)."""
    need = weight_bytes / (gpu_memory_gb * 1e9 * mem_util)
    return 1 << max(0, math.ceil(math.log2(max(1.0, math.ceil(need)))))


class _Rules:
    def __init__(self) -> None:
        self.results: dict[str, RuleResult] = {}

    def error(self, name: str, msg: str) -> None:
        self._add(name, "error", msg)

    def warn(self, name: str, msg: str) -> None:
        self._add(name, "warning", msg)

    def not_run(self, name: str, why: str) -> None:
        if name not in self.results:
            self.results[name] = RuleResult(name, "not run", [why])

    def _add(self, name: str, status: str, msg: str) -> None:
        assert name in RULES, name
        res = self.results.get(name)
        if res is None or res.status in ("pass", "not run"):
            self.results[name] = RuleResult(name, status, [msg])
        else:
            res.messages.append(msg)
            if status == "error":
                res.status = "error"


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _float(v: Any, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _truthy(v: Any) -> bool:
    return v is True or str(v).lower() == "true"


def checkpoint_bytes(weights: int, save_contents: list[str]) -> int:
    """One checkpoint: HF weights (the model's bytes) + optimizer (fp32 master copy and two
    Adam moments: 12 bytes per parameter = 6 x the BF16 weight bytes)."""
    total = 0
    if "model" in save_contents or "hf_model" in save_contents:
        total += weights
    if "optimizer" in save_contents:
        total += 6 * weights
    return total


def kept_for_eval(eval_steps: list[int], save_freq: int, total: int, keep: int,
                  segment: int = 0) -> list[int]:
    """Checkpoints retention keeps for evaluation beyond the newest ``keep``: the eval steps
    that are saved (multiples of save_freq, each segment's end, the last step) but not among
    the newest."""
    if save_freq <= 0 or total <= 0:
        return []
    ends = set(range(segment, total + 1, segment)) if segment > 0 else set()
    saved = sorted(set(range(save_freq, total + 1, save_freq)) | ends | {total})
    newest = set(saved[-keep:])
    return sorted({int(s) for s in eval_steps} & set(saved) - newest)


def free_bytes(path: Path) -> tuple[int, Path]:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free, probe


def check_rules(cfg: Mapping[str, Any], res: Resolution, eff: Mapping[str, Any],
                facts: Mapping[str, Any], ckpt_check: Mapping[str, Any] | None,
                weights: int | None, weights_from: str, keep_steps: list[int] | None = None
                ) -> tuple[list[RuleResult], dict]:
    """Every rule on the composed values; returns the results and the checkpoint facts."""
    r = _Rules()
    cluster, train = cfg.get("cluster", {}), cfg.get("train", {})
    gpu = bool(cluster.get("gpu"))
    no_gpu = "not run: no GPU allocation (cluster.gpu is false)"

    # Hydra does not type-check values (`ACTOR_PP=abc` composes); verl would reject them only
    # after the allocation. The numeric keys the rules read must be numbers (or null).
    for key in NUMERIC_KEYS:
        value = eff.get(key)
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                r.error("compose", f"{key} = {value!r} is not a number (verl's config expects "
                        f"one and would fail on it after the allocation)")

    for problem in res.knob_errors:
        r.error("knobs", problem)

    if ckpt_check:
        failed = [c.get("name", "?") for c in ckpt_check.get("checks", [])
                  if c.get("status") == "fail"]
        if failed:
            r.error("checkpoint_checks", f"checks/checkpoint.json has failed checks: "
                    f"{', '.join(failed)}")
    else:
        r.not_run("checkpoint_checks", "not run: checks/checkpoint.json not given")

    prompt = _int(eff.get("data.max_prompt_length"))
    response = _int(eff.get("data.max_response_length"))
    seq = prompt + response
    g_cfg = _int(cluster.get("nodes")) * _int(cluster.get("gpus_per_node"))
    g_verl = _int(eff.get("trainer.nnodes")) * _int(eff.get("trainer.n_gpus_per_node"))
    sizes = {"tensor": "tensor_model_parallel_size", "pipeline": "pipeline_model_parallel_size",
             "context": "context_parallel_size", "expert": "expert_model_parallel_size",
             "expert_tensor": "expert_tensor_parallel_size"}
    a = {k: _int(eff.get(f"actor_rollout_ref.actor.megatron.{v}"), 1) for k, v in sizes.items()}
    rf = {k: _int(eff.get(f"actor_rollout_ref.ref.megatron.{v}"), 1) for k, v in sizes.items()}
    rollout_tp = _int(eff.get("actor_rollout_ref.rollout.tensor_model_parallel_size"), 1)
    mem_util = _float(eff.get("actor_rollout_ref.rollout.gpu_memory_utilization"), 0.5)

    # --- allocation-dependent rules
    if not gpu:
        for name in ("gpus", "actor_layout", "ref_layout", "rollout_tp", "oom_actor_memory",
                     "oom_rollout_memory"):
            r.not_run(name, no_gpu)
    else:
        if g_cfg <= 0:
            r.error("gpus", f"cluster.gpu is true but cluster.nodes x cluster.gpus_per_node = "
                    f"{cluster.get('nodes')} x {cluster.get('gpus_per_node')} = {g_cfg}")
        if g_verl != g_cfg:
            r.error("gpus", f"verl's trainer.nnodes x trainer.n_gpus_per_node = "
                    f"{eff.get('trainer.nnodes')} x {eff.get('trainer.n_gpus_per_node')} = "
                    f"{g_verl} but the allocation is cluster.nodes x cluster.gpus_per_node = "
                    f"{cluster.get('nodes')} x {cluster.get('gpus_per_node')} = {g_cfg}")
        for name, p, who in (("actor_layout", a, "actor"), ("ref_layout", rf, "ref")):
            mp = p["tensor"] * p["pipeline"] * p["context"]
            if g_cfg <= 0 or g_cfg % mp:
                r.error(name, f"{who} TP x PP x CP = {p['tensor']} x {p['pipeline']} x "
                        f"{p['context']} = {mp} does not divide the {g_cfg} GPUs "
                        f"(ACTOR_TP/ACTOR_PP/ACTOR_CP)")
            ep = p["expert"] * p["expert_tensor"] * p["pipeline"]
            if g_cfg <= 0 or g_cfg % ep:
                r.error(name, f"{who} EP x ETP x PP = {p['expert']} x {p['expert_tensor']} x "
                        f"{p['pipeline']} = {ep} does not divide the {g_cfg} GPUs "
                        f"(ACTOR_EP/ACTOR_ETP/ACTOR_PP)")
        if g_cfg <= 0 or g_cfg % rollout_tp:
            r.error("rollout_tp", f"rollout TP = {rollout_tp} does not divide the {g_cfg} GPUs "
                    f"(ROLLOUT_TP)")
        gmem = _float(cluster.get("gpu_memory_gb"))
        if weights is None or gmem <= 0:
            r.not_run("rollout_tp", f"not run (memory part): model bytes {weights_from}; "
                      f"cluster.gpu_memory_gb = {gmem}")
        else:
            need = required_rollout_tp(weights, gmem, mem_util)
            if rollout_tp < need:
                r.error("rollout_tp", f"rollout TP = {rollout_tp} is below the {need} needed: "
                        f"{weights / 1e9:.1f} GB of weights / ({gmem:g} GB x "
                        f"gpu_memory_utilization {mem_util:g}) = "
                        f"{weights / (gmem * 1e9 * mem_util):.2f} GPUs, rounded up to a power of "
                        f"2 (ROLLOUT_TP)")
            per_gpu = weights / rollout_tp
            budget = gmem * 1e9 * mem_util
            if rollout_tp >= need and per_gpu > 0.8 * budget:
                r.warn("oom_rollout_memory", f"rollout weights take {per_gpu / 1e9:.1f} GB of the "
                       f"{budget / 1e9:.1f} GB vLLM may use per GPU ({per_gpu / budget:.0%}), "
                       f"little KV cache left: raise ROLLOUT_TP or ROLLOUT_GPU_MEM_UTIL")
            offload = (_truthy(eff.get("actor_rollout_ref.actor.megatron.param_offload"))
                       and _truthy(eff.get("actor_rollout_ref.actor.megatron.optimizer_offload")))
            shard = a["pipeline"] * max(a["tensor"], a["expert"] * a["expert_tensor"])
            states = 9 * weights / shard  # bf16 params + fp32 grads, master, 2 Adam moments
            if not offload and states > 0.8 * gmem * 1e9:
                r.warn("oom_actor_memory", f"actor weights + grads + optimizer ~ "
                       f"{states / 1e9:.0f} GB per GPU (9 x {weights / 1e9:.1f} GB / PP x "
                       f"max(TP, EP x ETP) = {shard}) vs {gmem:g} GB GPUs without offload: set "
                       f"ALL_OFFLOAD=True or raise ACTOR_PP / ACTOR_EP")

    # --- sequence-length coupling
    ppo_tok = _int(eff.get("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"))
    if _truthy(eff.get("actor_rollout_ref.actor.use_dynamic_bsz")) and ppo_tok * a["context"] < seq:
        r.error("actor_token_budget", f"ppo_max_token_len_per_gpu x CP = {ppo_tok} x "
                f"{a['context']} = {ppo_tok * a['context']} < max_prompt_length + "
                f"max_response_length = {prompt} + {response} = {seq} "
                f"(PPO_MAX_TOKEN_LEN_PER_GPU or ACTOR_CP)")
    mml = eff.get("actor_rollout_ref.rollout.max_model_len")
    if mml is not None and _int(mml) < seq:
        r.error("max_model_len", f"rollout.max_model_len = {mml} < max_prompt_length + "
                f"max_response_length = {prompt} + {response} = {seq} (ROLLOUT_MAX_MODEL_LEN)")
    mnbt = eff.get("actor_rollout_ref.rollout.max_num_batched_tokens")
    chunked = _truthy(eff.get("actor_rollout_ref.rollout.enable_chunked_prefill"))
    if mnbt is not None and not chunked and _int(mnbt) < seq:
        r.error("max_model_len", f"rollout.max_num_batched_tokens = {mnbt} < {seq} with chunked "
                f"prefill off (ROLLOUT_MAX_NUM_BATCHED_TOKENS)")
    for who, cp, knob in (("rollout", a["context"], "ROLLOUT_LOG_PROB_MAX_TOKEN_LEN_PER_GPU"),
                          ("ref", rf["context"], "REF_LOG_PROB_MAX_TOKEN_LEN_PER_GPU")):
        if not _truthy(eff.get(f"actor_rollout_ref.{who}.log_prob_use_dynamic_bsz")):
            continue
        budget = _int(eff.get(f"actor_rollout_ref.{who}.log_prob_max_token_len_per_gpu"))
        if budget * cp < seq:
            r.error("log_prob_token_budget", f"{who}.log_prob_max_token_len_per_gpu x CP = "
                    f"{budget} x {cp} = {budget * cp} < {prompt} + {response} = {seq} ({knob})")
    if not _truthy(eff.get("actor_rollout_ref.actor.use_dynamic_bsz")):
        mbs = _int(eff.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"), 1)
        tokens = mbs * seq / a["context"]
        if ppo_tok and tokens > ppo_tok:
            r.warn("oom_micro_batch", f"static micro batches of {mbs} x {seq} tokens / CP "
                   f"{a['context']} = {tokens:.0f} tokens per GPU exceed the "
                   f"{ppo_tok}-token budget: lower ACTOR_PPO_MICRO_BATCH_SIZE_PER_GPU, raise "
                   f"ACTOR_CP, or use dynamic batch sizes")

    # --- batch sizes
    tbs = _int(eff.get("data.train_batch_size"))
    n = _int(eff.get("actor_rollout_ref.rollout.n"), 1)
    mini = _int(eff.get("actor_rollout_ref.actor.ppo_mini_batch_size"))
    if mini <= 0 or tbs < mini or tbs % mini:
        r.error("batch_divisible", f"data.train_batch_size = {tbs} is not a positive multiple "
                f"of actor.ppo_mini_batch_size = {mini} (TRAIN_BATCH_SIZE / PPO_MINI_BATCH_SIZE)")
    if gpu and g_cfg > 0:
        mp = a["tensor"] * a["pipeline"] * a["context"]
        dp = g_cfg // mp if mp and g_cfg % mp == 0 else 0
        if dp:
            if (tbs * n) % dp:
                r.error("batch_divisible", f"train_batch_size x n = {tbs} x {n} = {tbs * n} is "
                        f"not divisible by the actor's data-parallel size {g_cfg} / ({mp}) = {dp}")
            if (mini * n) % dp:
                r.error("batch_divisible", f"ppo_mini_batch_size x n = {mini} x {n} = "
                        f"{mini * n} is not divisible by the actor's data-parallel size {dp}")

    # --- steps and frequencies
    total = _int(eff.get("trainer.total_training_steps"))
    if total <= 0:
        r.error("total_steps", f"trainer.total_training_steps = "
                f"{eff.get('trainer.total_training_steps')}: set train.total_training_steps > 0 "
                f"(the script alone trains {eff.get('trainer.total_epochs')} epochs)")
    save, test = _int(eff.get("trainer.save_freq")), _int(eff.get("trainer.test_freq"))
    if save <= 0:
        r.error("save_test_freq", f"trainer.save_freq = {save}: no checkpoint would be saved, "
                f"so nothing could resume (SAVE_FREQ)")
    elif total > 0 and save > total:
        r.error("save_test_freq", f"trainer.save_freq = {save} > total_training_steps = "
                f"{total}: only the final step is saved, a failure loses everything (SAVE_FREQ)")
    if total > 0 and test > total:
        r.error("save_test_freq", f"trainer.test_freq = {test} > total_training_steps = {total}: "
                f"no validation during training (TEST_FREQ)")

    # --- checkpoints
    ckpt_dir = Path(res.checkpoint_dir)
    root = train.get("checkpoint_root") or ""
    if gpu and not root:
        r.error("checkpoint_root", "train.checkpoint_root is empty: set an absolute directory on "
                "storage shared by every node")
    elif root and not Path(root).is_absolute():
        r.error("checkpoint_root", f"train.checkpoint_root = {root!r} is relative: verl would "
                f"resolve it inside Ray's copy of the working dir; give an absolute path")
    if _truthy(eff.get("actor_rollout_ref.actor.checkpoint.async_save")):
        r.error("async_save", "actor_rollout_ref.actor.checkpoint.async_save = True: verl then "
                "does not write latest_checkpointed_iteration.txt and resume breaks")
    save_contents = eff.get("actor_rollout_ref.actor.checkpoint.save_contents") or []
    keep = max(1, _int(train.get("checkpoint_keep"), 1))
    extra = kept_for_eval(keep_steps or [], save, total, keep,
                          _int(train.get("segment_steps")))
    ck = {"dir": str(ckpt_dir), "keep": keep, "kept_for_eval": extra,
          "save_contents": save_contents, "weights_bytes": weights,
          "weights_from": weights_from}
    if weights is None:
        r.not_run("disk", f"not run: model bytes {weights_from}")
    else:
        per = checkpoint_bytes(weights, list(save_contents))
        need = (keep + len(extra) + 1) * per
        free, probe = free_bytes(ckpt_dir)
        ck.update(bytes_per_checkpoint=per, bytes_needed=need, free_bytes=free,
                  free_on=str(probe))
        if need > free:
            r.error("disk", f"checkpoints need (keep {keep} + {len(extra)} kept for "
                    f"eval.steps {extra} + 1 being written) x "
                    f"{per / 1e12:.3f} TB (weights {weights / 1e12:.3f} TB + optimizer "
                    f"6 x weights) = {need / 1e12:.3f} TB but {probe} has {free / 1e12:.3f} TB "
                    f"free (train.checkpoint_keep, eval.steps, train.checkpoint_root)")

    seg = _int(train.get("segment_steps"))
    if seg > 0:
        warm = _int(eff.get("actor_rollout_ref.actor.optim.lr_warmup_steps"), -1)
        ratio = _float(eff.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"))
        style = eff.get("actor_rollout_ref.actor.optim.lr_decay_style")
        lr = _float(eff.get("actor_rollout_ref.actor.optim.lr"))
        min_lr = _float(eff.get("actor_rollout_ref.actor.optim.min_lr"))
        if warm > 0 or (warm < 0 and ratio > 0) or (style != "constant" and lr != min_lr):
            r.error("segment_schedule", f"train.segment_steps = {seg} needs a constant learning "
                    f"rate (each segment restarts the scheduler) but lr_warmup_steps = {warm}, "
                    f"lr_warmup_steps_ratio = {ratio}, lr_decay_style = {style}, lr = {lr:g}, "
                    f"min_lr = {min_lr:g}")

    # --- warnings with their cost
    if (_truthy(eff.get("actor_rollout_ref.actor.use_kl_loss"))
            and _float(eff.get("actor_rollout_ref.actor.kl_loss_coef")) == 0.0
            and not _truthy(eff.get("algorithm.use_kl_in_reward"))):
        r.warn("ref_kl_zero", f"use_kl_loss=True with kl_loss_coef=0: verl builds the reference "
               f"model and computes its log-probs for all {tbs} x {n} = {tbs * n} responses "
               f"every step for a term multiplied by 0 (one extra forward pass per step and the "
               f"reference weights in memory); USE_KL_LOSS=False removes it")
    if _truthy(eff.get("trainer.val_before_train")):
        rows = facts.get("val_rows")
        val_n = _int(eff.get("actor_rollout_ref.rollout.val_kwargs.n"), 1)
        what = f"{rows} x {val_n} generations" if rows else f"the validation set x {val_n}"
        r.warn("val_on_resume", f"trainer.val_before_train=True: validation ({what}, up to "
               f"{response} tokens each) re-runs on every start, including each resume; add "
               f"trainer.val_before_train=false to train.verl_overrides to skip it")
    over = facts.get("prompts_over_max")
    if over:
        r.warn("prompts_over_max", f"{over} training prompts exceed max_prompt_length = {prompt} "
               f"tokens (data/summary.json); with data.truncation="
               f"{'left' if prompt else '?'} they are cut, losing part of the problem")
    elif over is None:
        r.not_run("prompts_over_max", "not run: no count in data/summary.json")

    # Defaults and waivers (names checked by check_waivers before anything ran).
    waive = set(cfg.get("preflight", {}).get("waive") or [])
    out = []
    for name in RULES:
        if name == "compose":  # never waived
            out.append(r.results.get("compose", RuleResult("compose", "pass", [])))
            continue
        res_ = r.results.get(name, RuleResult(name, "pass", []))
        if res_.status in ("error", "warning") and name in waive:
            res_.status = "waived"
        out.append(res_)
    return out, ck


# --------------------------------------------------------------------------- estimate


def estimate_gpu_hours(cfg: Mapping[str, Any], eff: Mapping[str, Any], facts: Mapping[str, Any],
                       weights: int | None, starts_hint: int = 1) -> dict[str, Any]:
    """GPU-hours of the run (formula in docs/formats/preflight.md)."""
    est_cfg = cfg.get("preflight", {}).get("estimate", {}) or {}
    cluster = cfg.get("cluster", {})
    gpus = _int(cluster.get("nodes")) * _int(cluster.get("gpus_per_node"))
    gpu_type = str(cluster.get("gpu_type", "")).lower()
    tflops = _float(est_cfg.get("gpu_tflops")) or GPU_TFLOPS.get(gpu_type, 0.0)
    active = _float(est_cfg.get("active_params_b")) * 1e9
    if not active and weights:
        active = weights / 2  # dense BF16 model: every parameter is active
    formula = ("tokens/step T = train_batch_size x n x (mean_prompt + f x max_response); "
               "train FLOPs = (6 + 2 old-log-prob + 2 ref if KL loss) x active_params x T; "
               "rollout FLOPs = 2 x active_params x T; step_s = train FLOPs / (G x peak x "
               "train_mfu) + rollout FLOPs / (G x peak x rollout_mfu); validation_s = 2 x "
               "active_params x val_rows x val_n x (mean_prompt + f x max_response) / (G x peak "
               "x rollout_mfu), run every test_freq steps plus once per start with "
               "val_before_train; GPU-hours = G x (steps x step_s + validations x validation_s) "
               "/ 3600")
    if gpus <= 0 or tflops <= 0 or not active:
        return {"gpu_hours": None, "formula": formula,
                "reason": f"not estimated: GPUs = {gpus}, peak TFLOPS = {tflops} "
                          f"(cluster.gpu_type {gpu_type!r} or preflight.estimate.gpu_tflops), "
                          f"active params = {active:g}"}
    peak = tflops * 1e12
    f = _float(est_cfg.get("mean_response_fraction"), 0.5)
    prompt_mean = _float(facts.get("mean_prompt_tokens")) or _float(
        eff.get("data.max_prompt_length")) / 4
    resp = _float(eff.get("data.max_response_length"))
    tbs, n = _int(eff.get("data.train_batch_size")), _int(eff.get("actor_rollout_ref.rollout.n"))
    tokens = tbs * n * (prompt_mean + f * resp)
    ref = 2 if _truthy(eff.get("actor_rollout_ref.actor.use_kl_loss")) else 0
    train_mfu = _float(est_cfg.get("train_mfu"), 0.2)
    rollout_mfu = _float(est_cfg.get("rollout_mfu"), 0.05)
    step_s = ((6 + 2 + ref) * active * tokens / (gpus * peak * train_mfu)
              + 2 * active * tokens / (gpus * peak * rollout_mfu))
    steps = _int(eff.get("trainer.total_training_steps"))
    val_rows = _float(facts.get("val_rows")) or 0.0
    val_n = _int(eff.get("actor_rollout_ref.rollout.val_kwargs.n"), 1)
    val_s = 2 * active * val_rows * val_n * (prompt_mean + f * resp) / (gpus * peak * rollout_mfu)
    test = _int(eff.get("trainer.test_freq"))
    seg = _int(cfg.get("train", {}).get("segment_steps"))
    segments = -(-steps // seg) if seg > 0 and steps > 0 else 1  # each segment is a start
    starts = max(1, _int(est_cfg.get("starts"), starts_hint), segments)
    vals = (steps // test if test > 0 else 0) + (
        starts if _truthy(eff.get("trainer.val_before_train")) else 0)
    hours = gpus * (steps * step_s + vals * val_s) / 3600
    ref_s = ref * active * tokens / (gpus * peak * train_mfu)  # the reference forward pass
    return {
        "gpu_hours": round(hours, 1), "wall_hours": round(hours / gpus, 2), "formula": formula,
        "costs": {"reference_gpu_hours": round(gpus * steps * ref_s / 3600, 1),
                  "validation_gpu_hours_each": round(gpus * val_s / 3600, 1)},
        "inputs": {"gpus": gpus, "peak_tflops": tflops, "active_params": active,
                   "tokens_per_step": tokens, "mean_prompt_tokens": prompt_mean,
                   "mean_response_fraction": f, "train_mfu": train_mfu,
                   "rollout_mfu": rollout_mfu, "steps": steps, "step_s": round(step_s, 1),
                   "validations": vals, "validation_s": round(val_s, 1), "starts": starts},
    }


def add_costs(rules: list[RuleResult], estimate: Mapping[str, Any]) -> None:
    """Append the estimate's GPU-hours to the warnings whose cost is compute."""
    costs = estimate.get("costs") or {}
    steps = (estimate.get("inputs") or {}).get("steps")
    for res in rules:
        if res.status not in ("warning", "waived") or not res.messages:
            continue
        if res.name == "ref_kl_zero" and costs.get("reference_gpu_hours"):
            res.messages[0] += (f"; cost ~{costs['reference_gpu_hours']:g} GPU-hours over "
                                f"{steps} steps (estimate)")
        if res.name == "val_on_resume" and costs.get("validation_gpu_hours_each"):
            res.messages[0] += (f"; cost ~{costs['validation_gpu_hours_each']:g} GPU-hours per "
                                f"start (estimate)")


# --------------------------------------------------------------------------- outputs


def render_launch(res: Resolution, run: str, commit: str) -> str:
    module_file = res.module.replace(".", "/") + ".py"
    lines = [
        "#!/usr/bin/env bash",
        f"# The verl launch of run {run!r}, rendered by hy3rl.preflight from {res.script}",
        f"# at verl {commit}. Do not edit: change the config and rerun the preflight rule.",
        "# Run inside the verl working dir; env contract: docs/formats/preflight.md.",
        "set -euo pipefail",
        'if [ -z "${VERL_FILE_LOGGER_PATH:-}" ]; then',
        "  echo 'launch.sh: VERL_FILE_LOGGER_PATH is not set (the train launcher sets it per "
        "attempt in the Ray job runtime_env)' >&2",
        "  exit 2",
        "fi",
        f"if [ ! -f {shlex.quote(module_file)} ]; then",
        f"  echo \"launch.sh: run me inside the verl working dir ({module_file} not found in "
        "$PWD)\" >&2",
        "  exit 2",
        "fi",
        'mkdir -p "$(dirname "$VERL_FILE_LOGGER_PATH")"',
    ]
    for key, value in sorted(res.exports.items()):
        lines.append(f"export {key}={shlex.quote(value)}  # exported by {res.script}")
    lines.append(f"exec python3 -m {res.module} \\")
    for o in res.overrides:
        lines.append(f"    {shlex.quote(o.text)} \\")
    lines.append('    "$@"')
    return "\n".join(lines) + "\n"


def make_plan(cfg: Mapping[str, Any], lock_path: Path, out_dir: Path,
              summary_path: Path | None = None, ckpt_check_path: Path | None = None,
              train_files: Path | None = None, val_files: Path | None = None,
              keep_steps: list[int] | None = None) -> Plan:
    """Resolve, compose, check; write plan.json and launch.sh into ``out_dir``."""
    check_waivers(cfg)
    lock = read_json(lock_path, "deps lock")
    if lock is None:
        raise PreflightError(f"{lock_path}: missing (run rule deps)")
    verl_dir, commit = verl_from_lock(lock, lock_path)
    if not verl_dir.is_dir():
        raise PreflightError(f"{lock_path}: repos.verl.path {verl_dir} is not a directory")
    summary = read_json(summary_path, "data summary")
    ckpt_check = read_json(ckpt_check_path, "checkpoint checks")
    data_dir = summary_path.parent if summary_path else out_dir.parent / "data"
    paths = {"train_files": (train_files or data_dir / "train.parquet").absolute(),
             "val_files": (val_files or data_dir / "val.parquet").absolute(),
             "out_dir": out_dir}
    facts = summary_facts(summary)
    if facts.get("val_n") is not None:
        paths["val_n"] = facts["val_n"]
    res = resolve(cfg, verl_dir, paths)
    head = git_head(verl_dir)
    weights, weights_from = model_bytes(cfg)
    gpu = bool(cfg.get("cluster", {}).get("gpu"))

    if res.composed is None:
        eff: dict[str, Any] = {}
        rules = [RuleResult(n, "not run", ["not run: the config did not compose"])
                 for n in RULES]
        rules[list(RULES).index("compose")] = RuleResult(
            "compose", "error", [res.compose_error or "not composed"])
        if res.knob_errors:
            rules[list(RULES).index("knobs")] = RuleResult("knobs", "error", res.knob_errors)
        ck: dict[str, Any] = {"dir": res.checkpoint_dir}
        estimate: dict[str, Any] = {"gpu_hours": None, "reason": "not composed"}
    else:
        eff = effective_values(res.composed)
        rules, ck = check_rules(cfg, res, eff, facts, ckpt_check, weights, weights_from,
                                keep_steps)
        estimate = estimate_gpu_hours(cfg, eff, facts, weights)
        add_costs(rules, estimate)
    if head != commit:
        idx = list(RULES).index("verl_pin")
        rules[idx] = RuleResult("verl_pin", "waived" if "verl_pin" in (
            cfg.get("preflight", {}).get("waive") or []) else "error",
            [f"{verl_dir} is at {head}, deps/lock.json says {commit}: rerun rule deps"])

    errors = [f"{r.name}: {m}" for r in rules if r.status == "error" for m in r.messages]
    warnings = [f"{r.name}: {m}" for r in rules if r.status == "warning" for m in r.messages]
    waived = [f"{r.name}: {m}" for r in rules if r.status == "waived" for m in r.messages]
    resolved: dict[str, dict[str, str]] = {}
    for o in res.overrides:
        resolved[o.key] = {"value": o.value, "source": o.source}
    launch_path = out_dir / "launch.sh"
    script_text = render_launch(res, cfg["run"]["name"], commit)
    plan = Plan(
        schema_version=SCHEMA_VERSION, created=datetime.now(UTC).isoformat(timespec="seconds"),
        run=cfg["run"]["name"], ok=not errors, launched=gpu,
        not_launched_reason=None if gpu else "not launched: no GPU (cluster.gpu is false)",
        verl={"path": str(verl_dir), "commit": commit, "head": head, "script": res.script,
              "entrypoint": res.module, "config_dir": str(res.config_dir),
              "config_name": res.config_name},
        knobs=res.knobs, script_exports=res.exports, overrides=res.overrides,
        resolved=resolved, effective=eff,
        effective_sources=effective_sources(eff, res.overrides), reward=res.reward, checkpoint=ck,
        loggers={"list": res.loggers, "env": {lg: LOGGER_ENV.get(lg, []) for lg in res.loggers}},
        rules=rules, errors=errors, warnings=warnings, waived=waived, estimate=estimate,
        launch={"path": str(launch_path.absolute()),
                "sha256": hashlib.sha256(script_text.encode()).hexdigest(),
                "command": "ray job submit ... -- bash launch.sh (inside the verl working dir)"},
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    if res.reward_fn_copy:
        src, dest = res.reward_fn_copy
        write_text_atomic(dest, src.read_text())
    write_text_atomic(launch_path, script_text, mode=0o755)
    write_json_atomic(out_dir / "plan.json", asdict(plan), default=str)
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hy3rl.preflight",
        description="Resolve the verl launch, compose it with the pinned verl's Hydra config, "
                    "check it, and write plan.json + launch.sh.")
    ap.add_argument("--config-json", required=True,
                    help="config sections as JSON (run, cluster, model, data, train, preflight)")
    ap.add_argument("--lock", required=True, type=Path, help="results/<run>/deps/lock.json")
    ap.add_argument("--data-summary", type=Path, help="results/<run>/data/summary.json")
    ap.add_argument("--checkpoint-check", type=Path, help="results/<run>/checks/checkpoint.json")
    ap.add_argument("--train-files", type=Path, help="default: data/train.parquet next to summary")
    ap.add_argument("--val-files", type=Path, help="default: data/val.parquet next to summary")
    ap.add_argument("--keep-steps", default="[]",
                    help="JSON list of steps retention keeps for evaluation (eval.steps)")
    ap.add_argument("--out-dir", required=True, type=Path, help="results/<run>/preflight")
    args = ap.parse_args(argv)
    try:
        cfg = json.loads(args.config_json)
    except json.JSONDecodeError as exc:
        print(f"--config-json: not valid JSON: {exc}", file=sys.stderr)
        return 2
    try:
        keep_steps = [int(s) for s in json.loads(args.keep_steps)]
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        print(f"--keep-steps: not a JSON list of steps: {exc}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(cfg, args.lock, args.out_dir, args.data_summary, args.checkpoint_check,
                         args.train_files, args.val_files, keep_steps)
    except PreflightError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return 1
    print(yaml.safe_dump({"plan": str(args.out_dir / "plan.json"), "launched": plan.launched,
                          "not_launched_reason": plan.not_launched_reason,
                          "gpu_hours": plan.estimate.get("gpu_hours"),
                          "overrides": len(plan.overrides)}, sort_keys=False).rstrip())
    for line in plan.warnings:
        print(f"WARNING {line}")
    for line in plan.waived:
        print(f"WAIVED  {line}")
    for line in plan.errors:
        print(f"ERROR   {line}", file=sys.stderr)
    if plan.errors:
        print(f"preflight: {len(plan.errors)} error(s); see {args.out_dir / 'plan.json'}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
