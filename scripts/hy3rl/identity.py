"""Which configuration makes a run's checkpoints: three kinds of keys, defined once here.

- **Trajectory**: whatever changes the weights a step produces. It is computed from
  preflight's resolved plan (``plan.json``), so the launch script's own defaults and the
  corrections are covered without a list to maintain: every resolved verl override except
  the extent and operational ones below, the three pins (verl, Megatron-Bridge,
  TransferQueue), the training data's content (sha256 of ``train.parquet``), the model's
  identity (``model/manifest.json``) and the custom reward function's content. Path-valued
  overrides count by their content, never by their path.
- **Extent**: how far the run goes (``train.total_training_steps``, ``train.segment_steps``).
- **Operational**: everything else (loggers, runtime, resources and node count, watchdog,
  retention, ports, save and validation frequencies, names).

The config-level form (:data:`TRAIN_TRIGGER_KEYS`) is what re-runs training in the same
invocation (rule ``train_keys``'s params, rules/train.smk). Its verl-level form
(:data:`EXTENT_VERL_KEYS`, :data:`OPERATIONAL_VERL`) decides what :func:`trajectory`
leaves out; the same classification filters ``train.env`` knobs and ``train.verl_overrides``
entries out of the triggers, so an operational override never resubmits a finished run.

The identity of a checkpoint directory, its history and the decision on a rerun are
:mod:`hy3rl.ckptdir`'s (docs/formats/train.md "Run identity").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# ---- config level ---------------------------------------------------------------------

# Config keys (dotted; a mapping counts by its leaves) that may change the trajectory.
# train.env and train.verl_overrides count only by their non-operational entries
# (train_trigger_values).
TRAJECTORY_CONFIG_KEYS = (
    "deps.repos",
    "data",
    "model.source",
    "model.revision",
    "train.reward_mode",
    "train.env",
    "train.algorithm",
    "train.reward_function",
    "train.launch_script",
    "train.verl_overrides",
)
EXTENT_CONFIG_KEYS = ("train.total_training_steps", "train.segment_steps")
# Where the checkpoints live: a new place is a new checkpoint directory (training runs
# there, or finds the run's checkpoints moved there).
LOCATION_CONFIG_KEYS = ("run.name", "train.checkpoint_root")
TRAIN_TRIGGER_KEYS = TRAJECTORY_CONFIG_KEYS + EXTENT_CONFIG_KEYS + LOCATION_CONFIG_KEYS

# ---- verl level -----------------------------------------------------------------------

EXTENT_VERL_KEYS = ("trainer.total_training_steps", "trainer.total_epochs")
# Resolved verl keys (a key or every key below it) that change no weight a step produces.
OPERATIONAL_VERL = (
    "trainer.logger", "trainer.project_name", "trainer.experiment_name",
    "trainer.save_freq", "trainer.test_freq", "trainer.val_before_train", "trainer.val_only",
    "trainer.resume_mode", "trainer.resume_from_path", "trainer.default_local_dir",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "trainer.del_local_ckpt_after_load", "trainer.esi_redundant_time",
    "trainer.log_val_generations", "trainer.rollout_data_dir", "trainer.validation_data_dir",
    "trainer.ray_wait_register_center_timeout", "trainer.nnodes", "trainer.n_gpus_per_node",
    "ray_kwargs", "data.val_files", "data.val_batch_size",
    "actor_rollout_ref.rollout.val_kwargs",
)
# Path-valued keys that count by content (what replaces them in the trajectory).
CONTENT_KEYS = {
    "data.train_files": "data.train.sha256",
    "actor_rollout_ref.model.path": "model.identity",
    "reward.custom_reward_function.path": "reward_function.sha256",
}
# The launch script's environment knobs that set an operational or extent key (the rest of
# train.env is trajectory): a change of one of them re-runs no finished training.
NON_TRAJECTORY_KNOBS = {
    "SAVE_FREQ": "trainer.save_freq", "TEST_FREQ": "trainer.test_freq",
    "TOTAL_EPOCHS": "trainer.total_epochs", "VAL_N": "actor_rollout_ref.rollout.val_kwargs.n",
    "VAL_TEMPERATURE": "actor_rollout_ref.rollout.val_kwargs.temperature",
    "VAL_TOP_P": "actor_rollout_ref.rollout.val_kwargs.top_p",
}


def verl_kind(key: str) -> str:
    """``trajectory``, ``extent`` or ``operational`` for a resolved verl key (``+`` prefix
    ignored)."""
    key = key.lstrip("+~")
    if key in EXTENT_VERL_KEYS:
        return "extent"
    if any(key == k or key.startswith(k + ".") for k in OPERATIONAL_VERL):
        return "operational"
    return "trajectory"


def _lookup(config: Mapping[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def train_trigger_values(config: Mapping[str, Any], extent: bool = True) -> dict[str, str]:
    """``key=<JSON value>`` for every trajectory, location and (``extent``) extent key of
    the validated config (``hy3rl.smk.triggers``), ``train.env`` and
    ``train.verl_overrides`` without their operational entries, and
    ``train.on_config_change`` (choosing fresh or resume after a refusal launches at once)."""
    from hy3rl.smk import triggers

    skip = {"train.env", "train.verl_overrides"} | (set() if extent else set(EXTENT_CONFIG_KEYS))
    out = triggers(config, *(k for k in TRAIN_TRIGGER_KEYS if k not in skip),
                   "train.on_config_change")
    env = {k: v for k, v in (_lookup(config, "train.env") or {}).items()
           if k not in NON_TRAJECTORY_KNOBS}
    ovr = {k: v for k, v in (_lookup(config, "train.verl_overrides") or {}).items()
           if verl_kind(k) == "trajectory"}
    out.update(triggers({"train": {"env": env, "verl_overrides": ovr}},
                        "train.env", "train.verl_overrides"))
    return out


def train_keys_params(config: Mapping[str, Any], stretch: str) -> str:
    """Rule ``train_keys``'s one param for a training job: ``final`` (rule train) takes
    every trigger, a segment ``step<N>`` every one but the total (an extension re-runs no
    finished segment), plus its own end. One ``key=value`` a line, sorted."""
    values = train_trigger_values(config, extent=stretch == "final")
    if stretch != "final":
        from hy3rl.smk import triggers

        values["segment_end"] = f"segment_end={stretch}"
        values.update(triggers(config, "train.segment_steps"))
    return "\n".join(sorted(values.values()))


def eval_request_params(config: Mapping[str, Any], tag: str,
                        generation_keys: tuple[str, ...]) -> str:
    """Rule ``eval_request``'s one param for tag ``tag``: the generation settings
    (``generation_keys``), and for a checkpoint tag the training triggers (a new trajectory
    re-evaluates it; ``final`` also the total, so an extension re-evaluates the final
    checkpoint in the same invocation)."""
    from hy3rl.layout import split_tag
    from hy3rl.smk import triggers

    values = triggers(config, *generation_keys)
    values["tag"] = f"tag={tag}"
    model, _ = split_tag(tag)
    if model != "base":
        values.update(train_trigger_values(config, extent=model == "final"))
    return "\n".join(sorted(values.values()))


# ---- the trajectory of a plan ---------------------------------------------------------


def model_identity(manifest: Mapping[str, Any]) -> str:
    """The checkpoint's identity from rule model's manifest (docs/formats/model.md): a hub
    source by repo id and resolved commit; a local directory by every file's path, size
    and hash (or modification time, when the manifest took the cheap identity)."""
    src = manifest.get("source") or {}
    if src.get("kind") == "hub":
        return f"hub:{src.get('repo_id')}@{src.get('resolved_revision')}"
    rows = [[f.get("path"), f.get("size"), f.get("sha256") or f.get("git_blob")
             or f.get("mtime_ns")] for f in manifest.get("files") or []]
    return "local:sha256:" + hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def digest(values: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``values``."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def trajectory(*, resolved: Mapping[str, Mapping[str, Any]], pins: Mapping[str, str],
               train_sha256: str | None, model: str | None,
               reward_fn_sha256: str | None) -> dict[str, Any]:
    """``{"id", "values", "origins"}``: the trajectory identity of a plan. ``resolved``:
    plan.json's ``resolved`` (verl key -> ``{"value", "source"[, "origin"]}``); ``pins``:
    repository name -> commit; the content identities of the training data, the model and
    the custom reward function (None: none)."""
    values: dict[str, Any] = {f"pin.{name}": commit for name, commit in sorted(pins.items())}
    origins: dict[str, str] = {}
    content = {"data.train.sha256": train_sha256, "model.identity": model,
               "reward_function.sha256": reward_fn_sha256}
    for key, entry in sorted(resolved.items()):
        bare = key.lstrip("+~")
        if verl_kind(bare) != "trajectory":
            continue
        if bare in CONTENT_KEYS:
            values[CONTENT_KEYS[bare]] = content[CONTENT_KEYS[bare]]
            continue
        values[bare] = entry.get("value")
        if entry.get("origin"):
            origins[bare] = str(entry["origin"])
    for name, value in content.items():
        values.setdefault(name, value)
    return {"id": digest(values), "values": values, "origins": origins}


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every key whose value differs (absent on one side: null), sorted by key."""
    return [{"key": k, "old": old.get(k), "new": new.get(k)}
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def describe_changes(diff: list[dict[str, Any]], origins: Mapping[str, str]) -> str:
    """``key (origin): old -> new; ...`` for a refusal message."""
    parts = []
    for c in diff:
        where = f" ({origins[c['key']]})" if c["key"] in origins else ""
        parts.append(f"{c['key']}{where}: {json.dumps(c['old'])} -> {json.dumps(c['new'])}")
    return "; ".join(parts)
