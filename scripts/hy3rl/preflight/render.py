"""Rendering the outputs: ``launch.sh`` (the launch, exactly as composed) and ``plan.json``
(every value with its source, the rule results, the estimate). Formats:
docs/formats/preflight.md."""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from hy3rl.preflight.resolve import Override, Resolution
from hy3rl.preflight.rules import RuleResult, effective_sources
from hy3rl.timefmt import utc_now

SCHEMA_VERSION = 1
NOT_LAUNCHED = ("not launched: no GPU (cluster.gpu is false) and not the CPU path "
                "(train.cpu.enable is false)")
LAUNCH_COMMAND = "ray job submit ... -- bash launch.sh (inside the verl working dir)"

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
    verl_checks: dict[str, Any]
    errors: list[str]
    warnings: list[str]
    waived: list[str]
    estimate: dict[str, Any]
    launch: dict[str, Any]
    # The run identity (hy3rl.identity): the trajectory (id, values, origins), the extent,
    # train.on_config_change and what a launch would do on the checkpoint directory.
    identity: dict[str, Any]
    # The checkpoint selection rule (eval.select, hy3rl.preflight.heldout.selection_record),
    # fixed here before the first training step; null without one.
    selection: dict[str, Any] | None = None
    # The CPU path (train.cpu, hy3rl.verl_cpu): the engine, the script's overrides dropped
    # for it (each with why), the environment of verl's processes, the trainer ranks and
    # Ray's logical CPUs, the workarounds; null on GPUs.
    cpu_path: dict[str, Any] | None = None
    # Each pinned clone as it is (hy3rl.preflight.clone_trees): path, HEAD, local changes,
    # the sha256 of their diff (the run identity's ``pin.<name>`` suffix) and the diff.
    pins: dict[str, Any] | None = None


def render_launch(res: Resolution, run: str, commit: str) -> str:
    """launch.sh: the env contract checks, the script's exports, then ``exec python3 -m
    <entrypoint> <overrides...> "$@"``."""
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


def _messages(rules: list[RuleResult], status: str) -> list[str]:
    return [f"{r.name}: {m}" for r in rules if r.status == status for m in r.messages]


def build_plan(*, run: str, trains: bool, res: Resolution, commit: str, head: str | None,
               effective: dict[str, Any], rules: list[RuleResult], checkpoint: dict[str, Any],
               verl_checks: dict[str, Any], estimate: dict[str, Any], launch: Path,
               launch_text: str, identity: dict[str, Any],
               selection: dict[str, Any] | None = None) -> Plan:
    """The plan record (``ok`` exactly when no rule is in error)."""
    errors = _messages(rules, "error")
    resolved: dict[str, dict[str, str]] = {}
    for o in res.overrides:
        resolved[o.key] = {"value": o.value, "source": o.source, "origin": o.origin}
    return Plan(
        schema_version=SCHEMA_VERSION, created=utc_now(), run=run, ok=not errors,
        launched=trains, not_launched_reason=None if trains else NOT_LAUNCHED,
        verl={"path": str(res.verl_dir), "commit": commit, "head": head, "script": res.script,
              "entrypoint": res.module, "config_dir": str(res.config_dir),
              "config_name": res.config_name},
        knobs=res.knobs, script_exports=res.exports, overrides=res.overrides,
        resolved=resolved, effective=effective,
        effective_sources=effective_sources(effective, res.overrides), reward=res.reward,
        checkpoint=checkpoint,
        loggers={"list": res.loggers, "env": {lg: LOGGER_ENV.get(lg, []) for lg in res.loggers}},
        rules=rules, verl_checks=verl_checks, errors=errors,
        warnings=_messages(rules, "warning"),
        waived=_messages(rules, "waived"), estimate=estimate,
        launch={"path": str(launch.absolute()),
                "sha256": hashlib.sha256(launch_text.encode()).hexdigest(),
                "command": LAUNCH_COMMAND},
        identity=identity, selection=selection, cpu_path=res.cpu_path,
    )


def write_outputs(plan: Plan, *, plan_path: Path, launch: Path, launch_text: str,
                  reward: tuple[bytes, Path] | None) -> None:
    """A passing preflight's files, each written atomically: the reward function's copy
    (``reward``: its bytes as read once, and its content-addressed path), launch.sh
    (executable), then plan.json, last."""
    if reward:
        write_bytes_atomic(reward[1], reward[0])
    write_text_atomic(launch, launch_text, mode=0o755)
    write_json_atomic(plan_path, asdict(plan), default=str)
