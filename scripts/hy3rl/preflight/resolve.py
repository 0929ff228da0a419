"""Resolving the verl launch: the pinned script's exact override list, the corrections of
upstream traps appended to it, and its composition with the pinned verl's Hydra config.

1. Run the pinned verl launch script (``examples/grpo_trainer/run_hy_v3_megatron.sh``, or a
   recipe script) with its environment knobs taken from the config and a printer in place of
   ``python3``: the printer records the script's exact ``python3 -m <entrypoint> ...`` argv.
2. Append corrections of upstream traps as Hydra overrides (later overrides win): the live
   ``reward.*`` keys of the DAPO reward manager, an absolute checkpoint directory, a bounded
   number of steps, ``resume_mode=auto``, the ``file`` logger, then ``train.algorithm``, a
   custom reward function, and ``train.verl_overrides`` last.
3. Compose the result with the pinned verl's Hydra config (``hydra.compose``; verl itself is
   not imported): an unknown key is an error naming it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hy3rl.errors import StageError
from hy3rl.settings import Config

DEFAULT_SCRIPT = "examples/grpo_trainer/run_hy_v3_megatron.sh"
DEFAULT_ENTRYPOINT = "verl.trainer.main_ppo"
PRINTER_TIMEOUT_S = 60

# The source of a value (docs/formats/preflight.md).
PAPER_DEFAULT = "paper default"
CONFIG = "config"
CORRECTION = "correction"

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
# Knobs of the default script that other config keys own.
OWNED_KNOBS = {
    "NNODES": "cluster.nodes", "NGPUS_PER_NODE": "cluster.gpus_per_node",
    "GPUS_PER_NODE": "cluster.gpus_per_node", "MODEL_PATH": "model.source / model.dir",
    "TRAIN_FILES": "data (results/<run>/data/train.parquet)",
    "VAL_FILES": "data (results/<run>/data/val.parquet)",
    "MAX_PROMPT_LENGTH": "data.max_prompt_length",
    "DATA_DIR": "data.train.source / data.val.source",
    "DAPO_MATH_TRAIN": "data.train.source", "AIME_VAL": "data.val.source",
}


class PreflightError(StageError):
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
class Capture:
    module: str
    overrides: list[str]
    exports: dict[str, str]


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
    composed: Any = None
    compose_error: str | None = None
    knob_errors: list[str] = field(default_factory=list)
    # The CPU path (train.cpu): the script's overrides dropped for the FSDP engine (with
    # why), the environment verl's processes get, the workarounds; None on GPUs.
    cpu_path: dict[str, Any] | None = None
    # The composed config's leaves, resolved (hy3rl.identity.composed_leaves): what verl
    # runs with; None when it does not compose or resolve.
    leaves: dict[str, Any] | None = None
    # Keys whose value is the workflow's: key -> (the workflow's value, the config key that
    # sets it); checked on the composed leaves (rule owned_keys).
    owned: dict[str, tuple[Any, str]] = field(default_factory=dict)


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
    """The composed value at ``key`` as plain data; ``default`` when absent or unresolvable."""
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
    """Whether ``key`` names a node of the composed ``cfg``; a ``???`` (missing) value counts:
    Hydra refuses to append (``+``) a key that is there."""
    from omegaconf import OmegaConf

    try:
        if OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False) is not _MISSING:
            return True
    except Exception:
        return True
    return _path_exists(cfg, key)


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


# --------------------------------------------------------------------------- resolution


def knob_env(cfg: Config, train_files: Path, val_files: Path, known: list[str],
             val_n: Any = None) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The script's environment: workflow-owned knobs, VAL_N from the data summary, then
    train.env. Returns knobs with their origin and the problems (unknown knob, knob owned by
    another key)."""
    cpu = cfg.train.cpu.enable
    knobs: dict[str, dict[str, str]] = {
        "NNODES": {"value": "1" if cpu else str(cfg.cluster.nodes),
                   "from": "train.cpu (one host)" if cpu else "cluster.nodes"},
        "NGPUS_PER_NODE": {"value": str(cfg.train.cpu.ranks if cpu else
                                        cfg.cluster.gpus_per_node),
                           "from": "train.cpu.ranks" if cpu else "cluster.gpus_per_node"},
        "MODEL_PATH": {"value": str(Path(cfg.model.path).absolute()),
                       "from": "model.source" if cfg.model.is_local else "model.dir"},
        "TRAIN_FILES": {"value": str(train_files), "from": "data"},
        "VAL_FILES": {"value": str(val_files), "from": "data"},
        "MAX_PROMPT_LENGTH": {"value": str(cfg.data.max_prompt_length),
                              "from": "data.max_prompt_length"},
    }
    if val_n is not None and "VAL_N" in known:
        knobs["VAL_N"] = {"value": str(val_n), "from": "data/summary.json val_n"}
    problems = []
    for name, value in cfg.train.env.items():
        if name in OWNED_KNOBS:
            problems.append(f"train.env.{name}: set {OWNED_KNOBS[name]} instead")
        elif name not in known:
            problems.append(f"train.env.{name}: the launch script does not read this knob "
                            f"(it reads: {', '.join(known)})")
        elif _SPLITS.search(knob_value(value)):
            problems.append(
                f"train.env.{name}: {knob_value(value)!r} holds whitespace or '=': the pinned "
                f"script passes its knobs to verl unquoted, so the shell splits the value into "
                f"more arguments and verl would read them as overrides of their own (write "
                f"the value without them; set a verl key with train.verl_overrides)")
        else:
            knobs[name] = {"value": knob_value(value), "from": f"train.env.{name}"}
    for knob in knobs.values():
        knob["source"] = CONFIG
    return knobs, problems


# What the shell's word splitting (or Hydra's parser) turns into another argument.
_SPLITS = re.compile(r"[\s=]")


class _Overrides:
    """The override list being built, and ``base``: the script's own overrides composed
    (None when they do not compose), which decides whether a correction needs a ``+``."""

    def __init__(self) -> None:
        self.items: list[Override] = []
        self.base: Any = None

    def append(self, override: Override) -> None:
        self.items.append(override)

    def add(self, key: str, value: Any, source: str, origin: str, raw: bool = False) -> None:
        rendered = value if raw else hydra_value(value)
        if self.base is None:
            text = f"{key}={rendered}"
        elif key == "model_engine" or has_key(self.base, key):
            text = f"{key}={rendered}"
        else:
            text = f"+{key}={rendered}"
        self.items.append(Override(text, key, rendered, source, origin))


def _known_knobs(verl_dir: Path, script: str) -> list[str]:
    """The knobs the default script (and a recipe script) read."""
    known = script_knobs((verl_dir / DEFAULT_SCRIPT).read_text()) if (
        verl_dir / DEFAULT_SCRIPT).is_file() else []
    if script != DEFAULT_SCRIPT and (verl_dir / script).is_file():
        known = sorted(set(known) | set(script_knobs((verl_dir / script).read_text())))
    return known


def _script_overrides(ov: _Overrides, cap: Capture, defaults: dict[str, str], script: str,
                      hy3_vals: dict[str, str] | None) -> None:
    """The script's own overrides (a value differing from the script's own default came from
    the config), then, for a recipe, Hy3's config-group choices it lacks (they decide the key
    set, so they come before anything is composed)."""
    origin = "script" if script == DEFAULT_SCRIPT else f"recipe {script}"
    for text in cap.overrides:
        _, key, value = split_override(text)
        source = PAPER_DEFAULT if defaults.get(key) == value else CONFIG
        ov.append(Override(text, key, value, source, origin))
    if hy3_vals is None:
        return
    script_vals = last_values(cap.overrides)
    for key in HY3_REQUIRED:
        if "." not in key and key in hy3_vals and key not in script_vals:
            ov.append(Override(f"{key}={hy3_vals[key]}", key, hy3_vals[key], CORRECTION,
                               HY3_ORIGIN))


def _recipe_carry_over(ov: _Overrides, script_vals: dict[str, str],
                       hy3_vals: dict[str, str]) -> None:
    """A recipe's launch gets the workflow-owned values and Hy3's required settings."""
    for key in WORKFLOW_OWNED:
        if key in hy3_vals and script_vals.get(key) != hy3_vals[key]:
            ov.add(key, hy3_vals[key], CORRECTION, "workflow-owned (recipe value replaced)",
                   raw=True)
    for key in HY3_REQUIRED:
        if "." in key and key in hy3_vals and key not in script_vals:
            ov.add(key, hy3_vals[key], CORRECTION, HY3_ORIGIN, raw=True)


def _reward(ov: _Overrides, mode: str, module: str, script_vals: dict[str, str],
            verl_dir: Path) -> dict[str, Any]:
    """The reward finding: the script's legacy reward_model.* keys are not read by this
    entrypoint unless it migrates them; ``intended`` re-issues them as the live reward.*."""
    base = ov.base
    callers = legacy_reward_callers(verl_dir)
    entry_file = module.replace(".", "/") + ".py"
    migrated = entry_file in callers
    legacy = {k: v for k, v in script_vals.items()
              if k == "reward_model.reward_manager" or k.startswith("reward_model.reward_kwargs.")}
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
            f"them) but {module} reads only reward.*, and the legacy-to-reward migration "
            f"(migrate_legacy_reward_impl) is called only by: {', '.join(callers) or 'nothing'}. "
            f"As scripted the live reward manager is "
            f"{reward['scripted_manager']!r} with reward_kwargs {reward['scripted_kwargs']!r}.")
    elif legacy:
        reward["finding"] = f"{module} migrates the legacy reward_model.* keys: they are live."
    else:
        reward["finding"] = "the launch passes no legacy reward_model.* reward keys."
    if mode == "intended" and legacy and not migrated:
        origin = "reward_mode=intended (legacy reward_model.* made live)"
        if "reward_model.reward_manager" in legacy:
            ov.add("reward.reward_manager.name", legacy["reward_model.reward_manager"],
                   CORRECTION, origin, raw=True)
        for key, value in legacy.items():
            if key.startswith("reward_model.reward_kwargs."):
                ov.add("reward." + key[len("reward_model."):], value, CORRECTION, origin,
                       raw=True)
    return reward


def _run_corrections(ov: _Overrides, cfg: Config, checkpoint_dir: str) -> list[str]:
    """Checkpoints, steps, resume, loggers; returns the loggers."""
    ov.add("trainer.default_local_dir", checkpoint_dir, CORRECTION,
           "absolute checkpoint dir (script leaves it relative to Ray's working-dir copy)")
    ov.add("trainer.total_training_steps", cfg.train.total_training_steps, CORRECTION,
           "bounded run (script trains 1000 epochs)")
    ov.add("trainer.resume_mode", "auto", CORRECTION, "resume contract")
    user_loggers = list(cfg.train.loggers)
    if not user_loggers:
        scripted = select(ov.base, "trainer.logger") if ov.base is not None else None
        user_loggers = list(scripted) if isinstance(scripted, list) else ["console"]
    loggers = user_loggers + ([] if "file" in user_loggers else ["file"])
    ov.add("trainer.logger", loggers, CORRECTION,
           "file logger next to the user's (path from VERL_FILE_LOGGER_PATH per attempt)")
    return loggers


def _customisations(ov: _Overrides, cfg: Config, reward_fn: Path) -> None:
    """Published-guide customisations (config, not code edits): ``train.algorithm`` and a
    custom reward function, read by verl from its copy ``reward_fn`` (preflight writes the
    copy, content addressed, only when the plan passes)."""
    algo = cfg.train.algorithm
    if algo.adv_estimator:
        ov.add("algorithm.adv_estimator", algo.adv_estimator, CONFIG, "train.algorithm")
    if algo.loss_mode:
        ov.add("actor_rollout_ref.actor.policy_loss.loss_mode", algo.loss_mode, CONFIG,
               "train.algorithm")
    rfn = cfg.train.reward_function
    if not rfn.path:
        return
    src = Path(rfn.path)
    if not src.is_file():
        raise PreflightError(f"train.reward_function.path: {src} is not a file")
    ov.add("reward.custom_reward_function.path", str(reward_fn.absolute()), CONFIG,
           "train.reward_function (its content-addressed copy, preflight/reward/)")
    ov.add("reward.custom_reward_function.name", rfn.name, CONFIG, "train.reward_function")


def _path_exists(cfg, key: str) -> bool:
    """Whether ``key`` names a node of the composed ``cfg`` (a ``???`` value counts)."""
    node = cfg
    for part in key.split("."):
        try:  # `in` is false for a ??? value; keys() lists it
            if part not in node.keys():
                return False
            node = node._get_node(part)
        except Exception:
            return False
    return True


def _cpu_move(ov: _Overrides, config_dir: Path, config_name: str) -> dict[str, Any]:
    """The CPU path, step 1: the script's overrides for verl's FSDP engine
    (hy3rl.verl_cpu.plan.move_to_fsdp); returns the record of what was dropped."""
    from hy3rl.verl_cpu import plan as cpu_plan

    dp = compose(config_dir, config_name, [f"model_engine={cpu_plan.ENGINE}"])
    kept, dropped = cpu_plan.move_to_fsdp(ov.items, lambda k: has_key(dp, k), split_override)
    items = []
    for item, new_text in kept:
        if new_text is not None:
            _, key, value = split_override(new_text)
            item = Override(new_text, key, value, cpu_plan.CPU_PATH,
                            f"train.cpu (was {item.text})")
        items.append(item)
    ov.items = items
    return {"engine": cpu_plan.ENGINE,
            "dropped": [{"override": item.text, "origin": item.origin, "why": why}
                        for item, why in dropped]}


def _cpu_overrides(ov: _Overrides, cfg: Config, record: dict[str, Any]) -> None:
    """The CPU path, step 2: its overrides, after the workflow's corrections and before
    ``train.verl_overrides``."""
    from hy3rl.verl_cpu import ENV
    from hy3rl.verl_cpu import plan as cpu_plan
    from hy3rl.verl_cpu.workarounds import WORKAROUNDS

    for o in cpu_plan.overrides(cfg.train.cpu.ranks):
        ov.add(o.key, o.value, cpu_plan.CPU_PATH, f"train.cpu: {o.why}", raw=True)
    record["env"] = dict(ENV)
    record["ranks"] = cfg.train.cpu.ranks
    record["ray_cpus"] = cfg.train.cpu.ray_cpus
    record["workarounds"] = [w.name for w in WORKAROUNDS]


def _verl_overrides(ov: _Overrides, overrides: Mapping[str, Any], knob_errors: list[str]
                    ) -> None:
    """``train.verl_overrides``, last (they win). An override of a workflow-owned path or of
    a checkpoint location key (:func:`hy3rl.identity.refused_override`) is refused, every one
    named: the run identity counts what the workflow's keys name, and the checkpoint
    location is the workflow's."""
    from hy3rl.identity import refused_override

    refused = []
    for key, value in overrides.items():
        prefix, bare, _ = split_override(str(key))
        if bare == "trainer.logger":
            knob_errors.append("train.verl_overrides.trainer.logger: use train.loggers (the "
                               "file logger is added to it)")
            continue
        why = refused_override(bare)
        if why:
            refused.append(f"train.verl_overrides.{key}: {why}")
            continue
        ov.append(Override(f"{prefix}{bare}={hydra_value(value)}", bare,
                           hydra_value(value), CONFIG, "train.verl_overrides"))
    if refused:
        raise PreflightError("refused override(s) (docs/formats/train.md \"What re-runs "
                             "training\"):\n  " + "\n  ".join(refused))


def resolve(cfg: Config, verl_dir: Path, *, train_files: Path, val_files: Path, val_n: Any,
            checkpoint_dir: Path, reward_fn: Path) -> Resolution:
    """Steps 1-3 of the module docstring (raises PreflightError for unusable inputs).
    ``train_files``/``val_files`` are the absolute data paths, ``val_n`` the data summary's
    (or None), ``reward_fn`` where the custom reward function is copied to."""
    script = cfg.train.launch_script or DEFAULT_SCRIPT
    known = _known_knobs(verl_dir, script)
    knobs, knob_errors = knob_env(cfg, train_files, val_files, known, val_n)
    env = {k: v["value"] for k, v in knobs.items()}

    # Sources: a value that differs from the script's own default came from the config.
    defaults = last_values(capture_launch(verl_dir, DEFAULT_SCRIPT, {}).overrides)
    cap = capture_launch(verl_dir, DEFAULT_SCRIPT, env)
    hy3_vals = None
    if script != DEFAULT_SCRIPT:
        hy3_vals = last_values(cap.overrides)
        cap = capture_launch(verl_dir, script, env)
    config_dir, config_name = hydra_config_of(verl_dir, cap.module)

    ov = _Overrides()
    _script_overrides(ov, cap, defaults, script, hy3_vals)
    cpu_path = _cpu_move(ov, config_dir, config_name) if cfg.train.cpu.enable else None
    try:
        ov.base = compose(config_dir, config_name, [o.text for o in ov.items])
    except PreflightError as exc:
        base_error = f"the launch script's own overrides do not compose: {exc}"
    else:
        base_error = None

    script_vals = last_values(cap.overrides)
    if hy3_vals is not None:
        if cpu_path is not None:  # the FSDP engine has no Megatron layout to carry over
            from hy3rl.verl_cpu.plan import is_megatron_only

            hy3_vals = {k: v for k, v in hy3_vals.items() if not is_megatron_only(k)}
        _recipe_carry_over(ov, script_vals, hy3_vals)
    reward = _reward(ov, cfg.train.reward_mode, cap.module, script_vals, verl_dir)
    loggers = _run_corrections(ov, cfg, str(checkpoint_dir))
    _customisations(ov, cfg, reward_fn)
    if cpu_path is not None:
        _cpu_overrides(ov, cfg, cpu_path)
    _verl_overrides(ov, cfg.train.verl_overrides, knob_errors)

    res = Resolution(verl_dir=verl_dir, script=script, module=cap.module, config_dir=config_dir,
                     config_name=config_name, knobs=knobs, exports=cap.exports,
                     overrides=ov.items, reward=reward, loggers=loggers,
                     checkpoint_dir=str(checkpoint_dir),
                     knob_errors=knob_errors, cpu_path=cpu_path)
    if base_error:
        res.compose_error = base_error
        return res
    try:
        res.composed = compose(config_dir, config_name, [o.text for o in ov.items])
    except PreflightError as exc:
        res.compose_error = str(exc)
        return res
    from hy3rl.identity import composed_leaves

    try:
        res.leaves = composed_leaves(res.composed)
    except ValueError as exc:
        res.compose_error = str(exc)
        res.composed = None
        return res
    res.owned = owned_values(cfg, knobs, checkpoint_dir=str(checkpoint_dir), loggers=loggers,
                             reward_fn=str(reward_fn.absolute())
                             if cfg.train.reward_function.path else None)
    reward["effective_manager"] = select(res.composed, "reward.reward_manager.name")
    reward["effective_kwargs"] = select(res.composed, "reward.reward_kwargs")
    return res


def owned_values(cfg: Config, knobs: Mapping[str, Mapping[str, str]], *, checkpoint_dir: str,
                 loggers: list[str], reward_fn: str | None) -> dict[str, tuple[Any, str]]:
    """The values the workflow gives verl, each with the config key that sets it: the data
    files and the model (the run identity counts what they name), where checkpoints are
    written and resumed from (retention is the workflow's), the loggers (the file logger
    the watchdog and the health guard read), the total, the prompt limit and the shape.
    After composition verl must read exactly these (rule owned_keys): an override that
    reaches one by any spelling (a nested mapping, ``+``/``++``, an interpolation, a word
    of a knob the script splits) is refused by name."""
    def knob(name: str, what: str) -> tuple[Any, str]:
        value = knobs[name]["value"]
        return (int(value) if value.isdigit() else value), what

    return {
        "data.train_files": knob("TRAIN_FILES", "data.train.source (the run's train.parquet)"),
        "data.val_files": knob("VAL_FILES", "data.val.source (the run's val.parquet)"),
        "actor_rollout_ref.model.path": knob("MODEL_PATH", "model.source / model.dir"),
        "actor_rollout_ref.model.tokenizer_path": (None, "model.source (the model's own "
                                                   "tokenizer)"),
        "reward.custom_reward_function.path": (reward_fn, "train.reward_function.path"),
        "custom_reward_function.path": (None, "train.reward_function.path (verl reads "
                                        "reward.custom_reward_function)"),
        "data.max_prompt_length": (cfg.data.max_prompt_length, "data.max_prompt_length"),
        "trainer.nnodes": knob("NNODES", knobs["NNODES"]["from"]),
        "trainer.n_gpus_per_node": knob("NGPUS_PER_NODE", knobs["NGPUS_PER_NODE"]["from"]),
        "trainer.total_training_steps": (cfg.train.total_training_steps,
                                         "train.total_training_steps"),
        "trainer.default_local_dir": (checkpoint_dir, "train.checkpoint_root / run.name"),
        "trainer.default_hdfs_dir": (None, "train.checkpoint_root (no copy elsewhere)"),
        "trainer.resume_mode": ("auto", "the workflow's resume (from the newest complete "
                                "checkpoint)"),
        "trainer.resume_from_path": (None, "the workflow's resume"),
        "trainer.del_local_ckpt_after_load": (False, "train.checkpoint_keep"),
        "trainer.max_actor_ckpt_to_keep": (None, "train.checkpoint_keep"),
        "trainer.max_critic_ckpt_to_keep": (None, "train.checkpoint_keep"),
        "trainer.logger": (loggers, "train.loggers (the file logger added)"),
    }
