"""Which configuration makes a run's checkpoints: four kinds of keys, defined once here.

- **Trajectory**: whatever changes the weights a step produces. Its identity is computed
  from preflight's resolved plan (``plan.json``), so the launch script's own defaults and
  the corrections are covered: every resolved verl override of kind trajectory (a key not
  in :data:`VERL_KINDS` counts as trajectory), the three pins (verl, Megatron-Bridge,
  TransferQueue), the training data's content (sha256 of ``train.parquet``), the model's
  identity (``model/manifest.json``) and the custom reward function's content. Values count
  as verl reads them (Hydra's override grammar: ``1e-6``, ``1.0e-6`` and ``"1e-6"`` are one
  float; ``True`` and ``true`` one boolean). A path counts by what it names, never by its
  name: the workflow-owned paths (:data:`OWNED_PATHS`) by the content the workflow made,
  any other absolute path that exists by its content (a file by its sha256, a directory by
  a manifest of its files' paths, sizes and sha256); an override of an owned path is
  refused by preflight, naming the workflow key to set instead.
- **Extent**: how far the run goes (``train.total_training_steps``, ``train.segment_steps``).
- **Operational**: what changes no weight: loggers, names, the runtime, resources and node
  count, the watchdog, retention, save and validation frequencies, the validation set, and
  memory-only knobs (offload, recompute, token budgets of dynamic batching, micro batches,
  vLLM's memory share), each with its reason in :data:`VERL_KINDS`.
- **Location**: where the checkpoints are read or written (``run.name``,
  ``train.checkpoint_root``; verl's ``trainer.default_local_dir``, resume and checkpoint
  retention keys). They belong to the workflow: an override of one is refused by
  preflight; a new location is a new checkpoint directory.

Every config key (:data:`CONFIG_KINDS`), launch-script knob (:data:`KNOBS`) and verl key
(:data:`VERL_KINDS`) has its kind written here with a reason; :func:`kind_table` renders
them for docs/formats/train.md. The config-level kinds decide what re-runs training in the
same invocation (the training keys that name a job's keys record, rules/train.smk:
trajectory, extent and location keys, ``train.env`` and ``train.verl_overrides`` by their
trajectory entries, and the files read under an unchanged path, :func:`content_stats`).

The identity of a checkpoint directory, its history and the decision on a rerun are
:mod:`hy3rl.ckptdir`'s (docs/formats/train.md "Run identity").
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TRAJECTORY, EXTENT, OPERATIONAL, LOCATION = "trajectory", "extent", "operational", "location"
KINDS = (TRAJECTORY, EXTENT, OPERATIONAL, LOCATION)
PER_ENTRY = "per entry"  # train.env, train.verl_overrides: each entry by its own kind

# ---- config level ---------------------------------------------------------------------

# Config key (dotted; a section counts for every key below it; ``*`` one level) -> kind and
# why. The longest matching entry decides; tests/test_identity.py fails on a schema key
# that none matches.
CONFIG_KINDS: dict[str, tuple[str, str]] = {
    "run.name": (LOCATION, "names the checkpoint directory (`<checkpoint_root>/<run.name>`)"),
    "run.results_root": (LOCATION, "holds the checkpoint directory when "
                         "train.checkpoint_root is empty"),
    "deps.dir": (OPERATIONAL, "where the clones live; their commits identify them"),
    "deps.allow_local_changes": (OPERATIONAL, "whether a clone may differ from its pin; the "
                                 "difference itself counts (`pin.<name>` holds its diff's "
                                 "sha256)"),
    "deps.repos.*.url": (OPERATIONAL, "where a repository is fetched from: its commit, not "
                         "its url, is what runs"),
    "deps.repos.*.commit": (TRAJECTORY, "the code that trains (`pin.<name>`)"),
    "data.max_prompt_length": (TRAJECTORY, "prompt length limit (MAX_PROMPT_LENGTH)"),
    "data.train": (TRAJECTORY, "the training set (counted by content: data.train.sha256)"),
    "data.val": (OPERATIONAL, "the validation set: verl's validation during training and the "
                 "evaluation's test set (re-evaluated through its file), no weight"),
    "data.heldout": (OPERATIONAL, "the selection set: evaluation only; with from_train "
                     "it is carved out of the training set, so then it counts as trajectory "
                     "(heldout_kind)"),
    "model.source": (TRAJECTORY, "the starting weights (counted by model.identity)"),
    "model.revision": (TRAJECTORY, "the starting weights (counted by model.identity)"),
    "model.dir": (OPERATIONAL, "where a hub checkpoint is stored; repo id and commit identify "
                  "it"),
    "model.tiny": (TRAJECTORY, "the generated tiny model's weights (model.identity)"),
    "checks": (OPERATIONAL, "checks of the checkpoint before training"),
    "cluster": (OPERATIONAL, "resources, node count, time limit: where and how long, not what"),
    "preflight": (OPERATIONAL, "checks and estimates before the launch"),
    "rehearsal": (OPERATIONAL, "the rehearsal's own run on its own checkpoint directory"),
    "eval": (OPERATIONAL, "evaluation (rule eval_request re-runs it), never training"),
    "report": (OPERATIONAL, "the report"),
    "release": (OPERATIONAL, "the release of evaluated checkpoints (rule release_model), "
                "never training"),
    "train.reward_mode": (TRAJECTORY, "which reward keys are live"),
    "train.total_training_steps": (EXTENT, "how far the run goes"),
    "train.segment_steps": (EXTENT, "where the run stops between jobs"),
    "train.env": (PER_ENTRY, "each knob by its kind (knob table)"),
    "train.verl_overrides": (PER_ENTRY, "each override by its verl key's kind (verl table); "
                             "owned paths and location keys are refused"),
    "train.loggers": (OPERATIONAL, "where metrics go"),
    "train.algorithm": (TRAJECTORY, "advantage estimator, policy loss"),
    "train.reward_function": (TRAJECTORY, "the custom reward (counted by content: "
                              "reward_function.sha256) and its name"),
    "train.launch_script": (TRAJECTORY, "the launch's overrides"),
    "train.checkpoint_root": (LOCATION, "holds the checkpoint directory"),
    "train.checkpoint_keep": (OPERATIONAL, "the workflow's retention"),
    "train.keep_eval_checkpoints": (OPERATIONAL, "the workflow's retention"),
    "train.prune_interval_s": (OPERATIONAL, "the workflow's retention"),
    "train.on_config_change": (OPERATIONAL, "what a launch does after a trajectory change, "
                               "not what it trains: no training key (a change that it "
                               "answers already names a missing keys record)"),
    "train.max_submissions": (OPERATIONAL, "resubmission"),
    "train.restarts_per_job": (OPERATIONAL, "restarts inside an allocation"),
    "train.watchdog": (OPERATIONAL, "hang and time limits"),
    "train.time_limit_margin_min": (OPERATIONAL, "stop before the time limit"),
    "train.node_logs_mb": (OPERATIONAL, "log copies"),
    "train.notify_command": (OPERATIONAL, "notification"),
    "train.ray_env_passthrough": (OPERATIONAL, "environment of the Ray job"),
    "train.runtime": (OPERATIONAL, "container and interpreter (each attempt records its "
                      "runtime identity)"),
    "train.ray": (OPERATIONAL, "Ray's ports and timeouts"),
    "train.cpu.enable": (TRAJECTORY, "the CPU path: verl's FSDP engine and a transformers "
                         "rollout instead of Megatron and vLLM (its overrides are counted "
                         "with the launch's)"),
    "train.cpu.ranks": (TRAJECTORY, "the FSDP world size on the host (trainer.n_gpus_per_node): "
                        "how each batch is sharded and reduced"),
    "train.cpu.ray_cpus": (OPERATIONAL, "Ray's logical CPUs on the host: where actors fit, "
                           "not what they compute"),
    "train.health": (OPERATIONAL, "the training-health guard's rules (they watch the "
                     "metrics, never change a step)"),
}
TRIGGER_KINDS = (TRAJECTORY, EXTENT, LOCATION)  # what re-runs a training job

# ---- verl level -----------------------------------------------------------------------

_DYNAMIC = ("token budget of dynamic micro-batches: verl@220e903 divides each micro-batch's "
            "loss by the whole mini-batch's token / sequence count (core_algos.agg_loss with "
            "global_batch_info), so the cut into micro-batches changes summation order, not "
            "the gradient")
_MICRO = "micro-batch size (gradient accumulation): same mini-batch normalisation as above"
_LOGPROB = ("batching of a log-prob forward pass (no gradient): each sequence's values do not "
            "depend on its neighbours")
_OFFLOAD = "parameters / optimizer state kept in host memory between phases: same values"
_RECOMPUTE = "activation recomputation: memory for compute, same gradients"
_VLLM = "vLLM memory / scheduling: the sampling distribution is unchanged"
_CKPT = "decides where checkpoints are read or written: the workflow's (train.checkpoint_root)"

# Resolved verl key (a key or every key below it) -> kind and why. The longest matching
# entry decides; a key none matches counts as trajectory (tests fail on one in the paper
# plan).
VERL_KINDS: dict[str, tuple[str, str]] = {
    "algorithm": (TRAJECTORY, "advantages, KL, rollout correction"),
    "reward": (TRAJECTORY, "the reward manager and its arguments"),
    "reward_model": (TRAJECTORY, "legacy reward keys (live where migrated)"),
    "model_engine": (TRAJECTORY, "the training engine"),
    "data": (TRAJECTORY, "how training prompts are read and batched"),
    "data.train_files": (TRAJECTORY, "counted by content (data.train.sha256); owned: "
                         "data.train.source"),
    "data.val_files": (OPERATIONAL, "validation set; owned: data.val.source"),
    "data.val_batch_size": (OPERATIONAL, "validation batching"),
    "actor_rollout_ref.hybrid_engine": (TRAJECTORY, "actor and rollout share the weights"),
    "actor_rollout_ref.model": (TRAJECTORY, "the policy model and how it is built"),
    "actor_rollout_ref.model.path": (TRAJECTORY, "counted by model.identity; owned: "
                                     "model.source"),
    "actor_rollout_ref.model.tokenizer_path": (TRAJECTORY, "owned: model.source"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (OPERATIONAL, _RECOMPUTE),
    "actor_rollout_ref.actor": (TRAJECTORY, "the policy update: optimiser, loss, clipping, KL, "
                                "parallel layout"),
    "actor_rollout_ref.actor.use_dynamic_bsz": (OPERATIONAL, _DYNAMIC),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (OPERATIONAL, _DYNAMIC),
    "actor_rollout_ref.actor.ppo_micro_batch_size": (OPERATIONAL, _MICRO),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (OPERATIONAL, _MICRO),
    "actor_rollout_ref.actor.megatron.param_offload": (OPERATIONAL, _OFFLOAD),
    "actor_rollout_ref.actor.megatron.grad_offload": (OPERATIONAL, _OFFLOAD),
    "actor_rollout_ref.actor.megatron.optimizer_offload": (OPERATIONAL, _OFFLOAD),
    **{f"actor_rollout_ref.actor.megatron.override_transformer_config.{k}": (OPERATIONAL,
                                                                             _RECOMPUTE)
       for k in ("recompute_method", "recompute_granularity", "recompute_num_layers",
                 "recompute_modules")},
    "actor_rollout_ref.rollout": (TRAJECTORY, "sampling: backend, n, temperature, top_p, "
                                  "lengths, parallel layout"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (OPERATIONAL, _VLLM),
    "actor_rollout_ref.rollout.max_num_batched_tokens": (OPERATIONAL, _VLLM),
    "actor_rollout_ref.rollout.enable_chunked_prefill": (OPERATIONAL, _VLLM),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.rollout.val_kwargs": (OPERATIONAL, "validation sampling"),
    "actor_rollout_ref.ref": (TRAJECTORY, "the reference model (KL)"),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (OPERATIONAL, _LOGPROB),
    "actor_rollout_ref.ref.megatron.param_offload": (OPERATIONAL, _OFFLOAD),
    "trainer.balance_batch": (TRAJECTORY, "reorders samples across data-parallel ranks"),
    "trainer.logger": (OPERATIONAL, "where metrics go"),
    "trainer.project_name": (OPERATIONAL, "a name (W&B, logs)"),
    "trainer.experiment_name": (OPERATIONAL, "a name (W&B, logs)"),
    "trainer.save_freq": (OPERATIONAL, "when to save (steps lost to a crash)"),
    "trainer.test_freq": (OPERATIONAL, "when to validate"),
    "trainer.val_before_train": (OPERATIONAL, "validation"),
    "trainer.val_only": (OPERATIONAL, "validation"),
    "trainer.log_val_generations": (OPERATIONAL, "validation samples logged"),
    "trainer.rollout_data_dir": (OPERATIONAL, "dump of generations"),
    "trainer.validation_data_dir": (OPERATIONAL, "dump of generations"),
    "trainer.esi_redundant_time": (OPERATIONAL, "save timing before a preemption"),
    "trainer.ray_wait_register_center_timeout": (OPERATIONAL, "a timeout"),
    "trainer.nnodes": (OPERATIONAL, "the allocation (cluster.nodes); the batch is "
                       "data.train_batch_size"),
    "trainer.n_gpus_per_node": (OPERATIONAL, "the allocation (cluster.gpus_per_node)"),
    "trainer.total_training_steps": (EXTENT, "how far the run goes"),
    "trainer.total_epochs": (EXTENT, "how far the run goes (total_training_steps bounds it)"),
    "trainer.default_local_dir": (LOCATION, _CKPT),
    "trainer.resume_mode": (LOCATION, "which checkpoint verl resumes from: the workflow's "
                            "(auto, from the newest complete checkpoint)"),
    "trainer.resume_from_path": (LOCATION, "which checkpoint verl resumes from: the "
                                 "workflow's"),
    "trainer.del_local_ckpt_after_load": (LOCATION, "deletes checkpoints: retention is the "
                                          "workflow's (train.checkpoint_keep)"),
    "trainer.max_actor_ckpt_to_keep": (LOCATION, "deletes checkpoints (and breaks after a "
                                       "restart): retention is the workflow's"),
    "trainer.max_critic_ckpt_to_keep": (LOCATION, "deletes checkpoints: retention is the "
                                        "workflow's"),
    "trainer.default_hdfs_dir": (LOCATION, "copies checkpoints elsewhere: where they are "
                                 "written is the workflow's (train.checkpoint_root)"),
    "ray_kwargs": (OPERATIONAL, "Ray's start-up"),
    "ray_kwargs.ray_init.runtime_env": (TRAJECTORY, "the environment of every worker: its "
                                        "variables and the modules verl imports in each "
                                        "process (VERL_USE_EXTERNAL_MODULES), its pip and "
                                        "working_dir"),
    "actor_rollout_ref.rollout.prometheus": (OPERATIONAL, "the rollout server's metrics "
                                             "export"),
    "global_profiler": (OPERATIONAL, "profiling"),
}

# Workflow-owned paths verl reads: the workflow key to set instead, and what the identity
# counts in their place (None: not in the trajectory).
OWNED_PATHS: dict[str, tuple[str, str | None]] = {
    "data.train_files": ("data.train.source", "data.train.sha256"),
    "data.val_files": ("data.val.source", None),
    "actor_rollout_ref.model.path": ("model.source", "model.identity"),
    "actor_rollout_ref.model.tokenizer_path": ("model.source", "model.identity"),
    "reward.custom_reward_function.path": ("train.reward_function.path",
                                           "reward_function.sha256"),
}
CONTENT_NAMES = ("data.train.sha256", "model.identity", "reward_function.sha256")
# Values the workflow sets that are no path or location: the config key to set instead.
OWNED_VALUES: dict[str, str] = {
    "trainer.total_training_steps": "train.total_training_steps",
}

# The pinned launch script's knobs (verl@220e903 examples/grpo_trainer/run_hy_v3_megatron.sh)
# -> the verl keys each one sets; a knob's kind is the strongest of its keys' (trajectory,
# location, extent, operational). A knob not listed counts as trajectory.
_A, _R, _O = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
KNOBS: dict[str, tuple[str, ...]] = {
    "INFER_BACKEND": (_R + "name", "trainer.experiment_name"),
    "DATA_DIR": ("data.train_files", "data.val_files"),
    "MODEL_PATH": ("actor_rollout_ref.model.path",),
    "NNODES": ("trainer.nnodes",),
    "NGPUS_PER_NODE": ("trainer.n_gpus_per_node",),
    "GPUS_PER_NODE": ("trainer.n_gpus_per_node",),
    "TRAIN_FILES": ("data.train_files",),
    "DAPO_MATH_TRAIN": ("data.train_files",),
    "VAL_FILES": ("data.val_files",),
    "AIME_VAL": ("data.val_files",),
    "TRAIN_BATCH_SIZE": ("data.train_batch_size",),
    "PPO_MINI_BATCH_SIZE": (_A + "ppo_mini_batch_size",),
    "MAX_PROMPT_LENGTH": ("data.max_prompt_length", _R + "prompt_length"),
    "MAX_RESPONSE_LENGTH": ("data.max_response_length", _R + "response_length",
                            "reward_model.reward_kwargs.max_resp_len"),
    "PPO_MAX_TOKEN_LEN_PER_GPU": (_A + "ppo_max_token_len_per_gpu",),
    "ACTOR_LR": (_A + "optim.lr",),
    "MIN_LR": (_A + "optim.min_lr",),
    "ROLLOUT_IS": ("algorithm.rollout_correction.rollout_is",),
    "ROLLOUT_IS_THRESHOLD": ("algorithm.rollout_correction.rollout_is_threshold",),
    "ENTROPY_COEFF": (_A + "entropy_coeff",),
    "ACTOR_CLIP_RATIO_LOW": (_A + "clip_ratio_low",),
    "ACTOR_CLIP_RATIO_HIGH": (_A + "clip_ratio_high",),
    "ACTOR_CLIP_RATIO_C": (_A + "clip_ratio_c",),
    "ACTOR_PPO_MICRO_BATCH_SIZE_PER_GPU": (_A + "ppo_micro_batch_size_per_gpu",),
    "USE_KL_LOSS": (_A + "use_kl_loss",),
    "KL_LOSS_COEF": (_A + "kl_loss_coef",),
    **{f"ACTOR_{p}": (f"{_A}megatron.{k}", f"{_O}megatron.{k}") for p, k in (
        ("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
        ("VPP", "virtual_pipeline_model_parallel_size"), ("EP", "expert_model_parallel_size"),
        ("CP", "context_parallel_size"), ("ETP", "expert_tensor_parallel_size"))},
    **{f"REF_{p}": (f"{_O}megatron.{k}",) for p, k in (
        ("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
        ("VPP", "virtual_pipeline_model_parallel_size"), ("EP", "expert_model_parallel_size"),
        ("CP", "context_parallel_size"), ("ETP", "expert_tensor_parallel_size"))},
    "ALL_OFFLOAD": (_A + "megatron.param_offload", _A + "megatron.optimizer_offload",
                    _O + "megatron.param_offload"),
    "ROLLOUT_TP": (_R + "tensor_model_parallel_size",),
    "INFER_TP": (_R + "tensor_model_parallel_size",),
    "ROLLOUT_GPU_MEM_UTIL": (_R + "gpu_memory_utilization",),
    "ROLLOUT_N": (_R + "n",),
    "ROLLOUT_MAX_NUM_BATCHED_TOKENS": (_R + "max_num_batched_tokens",),
    "ROLLOUT_MAX_MODEL_LEN": (_R + "max_model_len",),
    "ROLLOUT_TEMPERATURE": (_R + "temperature",),
    "ROLLOUT_TOP_P": (_R + "top_p",),
    "REF_LOG_PROB_MAX_TOKEN_LEN_PER_GPU": (_O + "log_prob_max_token_len_per_gpu",),
    "REF_LOG_PROB_MICRO_BATCH_SIZE_PER_GPU": (_O + "log_prob_micro_batch_size_per_gpu",),
    "ROLLOUT_LOG_PROB_MAX_TOKEN_LEN_PER_GPU": (_R + "log_prob_max_token_len_per_gpu",),
    "ROLLOUT_LOG_PROB_MICRO_BATCH_SIZE_PER_GPU": (_R + "log_prob_micro_batch_size_per_gpu",),
    "VAL_DO_SAMPLE": (_R + "val_kwargs.do_sample",),
    "VAL_TEMPERATURE": (_R + "val_kwargs.temperature",),
    "VAL_TOP_P": (_R + "val_kwargs.top_p",),
    "VAL_N": (_R + "val_kwargs.n",),
    "LOG_VAL_GENERATIONS": ("trainer.log_val_generations",),
    "TOTAL_EPOCHS": ("trainer.total_epochs",),
    "SAVE_FREQ": ("trainer.save_freq",),
    "TEST_FREQ": ("trainer.test_freq",),
    "PROJECT_NAME": ("trainer.project_name",),
    "EXPERIMENT_NAME": ("trainer.experiment_name",),
}
_STRENGTH = (TRAJECTORY, LOCATION, EXTENT, OPERATIONAL)


def _matches(pattern: str, key: str) -> bool:
    p, k = pattern.split("."), key.split(".")
    return len(k) >= len(p) and all(a in ("*", b) for a, b in zip(p, k, strict=False))


def _entry(table: Mapping[str, tuple[str, str]], key: str) -> tuple[str, str] | None:
    """The longest entry of ``table`` that is ``key`` or a section above it."""
    hits = [p for p in table if _matches(p, key)]
    return table[max(hits, key=lambda p: p.count(".") + 1)] if hits else None


@functools.cache  # the tables are constants; asked for every config leaf at each digest
def config_kind(key: str) -> str | None:
    """The kind of a config key (dotted leaf), None when no entry of CONFIG_KINDS names it."""
    entry = _entry(CONFIG_KINDS, key)
    return entry[0] if entry else None


@functools.cache
def verl_entry(key: str) -> tuple[str, str] | None:
    """``(kind, why)`` of a resolved verl key (``+``/``~`` prefix ignored), None when no entry
    of VERL_KINDS names it."""
    return _entry(VERL_KINDS, key.lstrip("+~"))


def verl_kind(key: str) -> str:
    """The kind of a resolved verl key; trajectory for one no entry names (counted, to be
    safe)."""
    entry = verl_entry(key)
    return entry[0] if entry else TRAJECTORY


def knob_kind(name: str) -> str:
    """The kind of a launch-script knob: the strongest of the verl keys it sets (a knob
    :data:`KNOBS` does not list counts as trajectory)."""
    if name not in KNOBS:
        return TRAJECTORY
    kinds = {verl_kind(k) for k in KNOBS[name]}
    return next(k for k in _STRENGTH if k in kinds)


def refused_override(key: str) -> str | None:
    """Why ``train.verl_overrides`` may not set verl key ``key`` (None: it may): a
    workflow-owned path (named by the workflow key to set instead) or a location key."""
    bare = key.lstrip("+~")
    if bare in OWNED_PATHS:
        return (f"the workflow owns this path (the run identity counts what it names); set "
                f"{OWNED_PATHS[bare][0]} instead")
    if bare in OWNED_VALUES:
        return f"the workflow owns this value; set {OWNED_VALUES[bare]} instead"
    entry = verl_entry(bare)
    if entry and entry[0] == LOCATION:
        return f"a checkpoint location key: {entry[1]}"
    return None


def content_stats(config: Mapping[str, Any]) -> dict[str, tuple[str, tuple[Path, ...]]]:
    """What the training reads from files whose path stays the same, as seen while the DAG
    is built: name -> ``(value, files)``. The names are the run identity's where it has one
    (:data:`CONTENT_NAMES`, computed the same way where that is cheap):
    ``reward_function.sha256``, the sha256 of ``train.reward_function.path`` (a small file,
    read whole; null when it is unset, ``missing`` when absent: preflight names it);
    ``data.train.source.sha256`` (a local training data source) and
    ``override_paths.sha256`` (:func:`override_paths`): ``sha256:`` of each file's content
    (a directory's files by relative path), each file's sha256 taken from the run's content
    cache (``Layout.content_sha_cache``) while its size, mtime and inode are unchanged and
    read again otherwise (:func:`hy3rl.runtime_id.cached_sha256`), so a file only touched,
    or copied back with the same bytes, changes no value; and ``model.source.stats`` (a
    local model directory other than the generated tiny model): ``sha256:`` of each file's
    path, size and mtime (:func:`hy3rl.hub.local_file_stats`, a stat per file and nothing
    read, the same stats that re-run rule model), since hashing the weights at every DAG
    build is too slow and their content identity (``model.identity``) exists only once rule
    model has run again. A changed value names a missing training keys record, so the job
    is planned in the same invocation; its own identity check then compares the content."""
    import os

    from hy3rl.data import local_source_path
    from hy3rl.hub import is_local_source, list_files, local_file_stats
    from hy3rl.layout import TINY_MODEL_DIR, Layout
    from hy3rl.runtime_id import cached_sha256, sha256_file

    def files_of(paths: list[Path]) -> tuple[Path, ...]:
        return tuple(f for p in paths
                     for f in ([p] if p.is_file() else [p / rel for rel in list_files(p)]
                               if p.is_dir() else []))

    def stats(paths: list[Path]) -> tuple[str, tuple[Path, ...]]:
        # by the path resolved: a relative, ./ or symlinked spelling of one path is one value
        paths = [Path(os.path.realpath(p)) for p in paths]
        rows = [[str(p), sorted(local_file_stats(p).values())] for p in paths]
        return "sha256:" + digest({"stats": rows}), files_of(paths)

    try:
        cache: Path | None = Path(Layout.from_config(dict(config)).content_sha_cache)
    except (KeyError, TypeError):
        cache = None

    def contents(paths: list[Path]) -> tuple[str, tuple[Path, ...]]:
        paths = [Path(os.path.realpath(p)) for p in paths]
        rows: list[Any] = []
        for p in paths:
            if p.is_file():
                rows.append(cached_sha256(p, cache)[0])
            elif p.is_dir():
                rows.append([[rel, cached_sha256(p / rel, cache)[0]] for rel in list_files(p)])
            else:
                rows.append(None)
        return "sha256:" + digest({"contents": rows}), files_of(paths)

    train = config.get("train") or {}
    out: dict[str, tuple[str, tuple[Path, ...]]] = {}
    reward = str((train.get("reward_function") or {}).get("path") or "")
    out["reward_function.sha256"] = ((sha256_file(reward), (Path(reward),))
                                     if reward and Path(reward).is_file()
                                     else ("missing" if reward else None, ()))
    source = str(((config.get("data") or {}).get("train") or {}).get("source") or "")
    local = local_source_path(source) if source else None
    if local:
        out["data.train.source.sha256"] = contents([Path(local)])
    model = str((config.get("model") or {}).get("source") or "")
    if model and is_local_source(model) and model != TINY_MODEL_DIR:
        out["model.source.stats"] = stats([Path(model).expanduser()])
    paths = override_paths(config)
    if paths:
        out["override_paths.sha256"] = contents([Path(p) for p in paths])
    return out


def content_triggers(config: Mapping[str, Any]) -> dict[str, str]:
    """:func:`content_stats` as training keys (``name=<JSON value>``): computed once while
    the DAG is built (rules/common.smk) and handed to the functions below."""
    return {f"content_{name}": f"{name}={json.dumps(value)}"
            for name, (value, _) in sorted(content_stats(config).items())}


# Config keys that name a local path (a hub id is left as it is): counted by the path they
# resolve to, so that `./data.parquet`, `data.parquet`, a trailing slash and a symlink are
# one value.
PATH_KEYS = ("data.train.source", "data.val.source", "model.source",
             "train.reward_function.path")


def real_paths(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with each local path of :data:`PATH_KEYS` resolved (``os.path.realpath``
    of the expanded path, whether it exists yet or not): the value a training key counts."""
    import copy
    import os

    from hy3rl.hub import is_local_source

    # not only when the path exists: the tiny model's directory appears with its first run,
    # and a key must be the same before and after
    out = copy.deepcopy(dict(config))
    for key in PATH_KEYS:
        *parents, last = key.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(last) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value or not is_local_source(value):
            continue
        node[last] = os.path.realpath(os.path.expanduser(value))
    return out


def knob_typed(value: Any) -> Any:
    """A launch-script knob as verl reads it: the text the script gets
    (``hy3rl.preflight.resolve.knob_value``) parsed as Hydra parses an override, so
    ``ACTOR_LR: '1e-6'`` and ``1.0e-6``, ``TRAIN_BATCH_SIZE: 128`` and ``'128'``, are one
    value."""
    from hy3rl.preflight.resolve import knob_value

    return typed_value(knob_value(value))


def flat_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``train.verl_overrides`` as the leaves verl reads, in order (a later entry wins, as
    Hydra applies them): a nested mapping by its dotted leaves, each value typed as Hydra
    reads it (:func:`typed_value` of its rendering), so the flat and the nested spelling of
    one value, and ``1e-6`` and ``1.0e-6``, are one training key."""
    from hy3rl.preflight.resolve import hydra_value
    from hy3rl.smk import _leaves

    by_bare: dict[str, tuple[str, Any]] = {}  # bare key -> (the key as spelled, value)
    for key, value in overrides.items():
        leaves = _leaves(value, str(key)) if isinstance(value, Mapping) and value else [
            (str(key), value)]
        for leaf, v in leaves:
            bare = leaf.lstrip("+~")
            by_bare.pop(bare, None)  # re-inserted: the order of the last setting
            by_bare[bare] = (leaf, typed_value(hydra_value(v)))
    # each leaf under its own spelling (``++`` kept: the keys of runs begun before stay)
    return dict(by_bare.values())


def heldout_kind(config: Mapping[str, Any]) -> str:
    """The kind of ``data.heldout``: trajectory when ``from_train`` carves it out of the
    training set (its seed, size or source choose which prompts train), operational when it
    is a set of its own (evaluation only)."""
    heldout = (config.get("data") or {}).get("heldout")
    return TRAJECTORY if isinstance(heldout, Mapping) and heldout.get("from_train") \
        else OPERATIONAL


def train_trigger_values(config: Mapping[str, Any], extent: bool = True,
                         content: Mapping[str, str] | None = None) -> dict[str, str]:
    """``key=<JSON value>`` (``hy3rl.smk.triggers``) for every leaf of the validated config
    whose kind is trajectory, location or (``extent``) extent, ``train.env`` and
    ``train.verl_overrides`` by their trajectory entries, and what the training reads from
    files under an unchanged path (``content``: :func:`content_triggers`, computed here
    when None). ``train.on_config_change`` is none of them: it says what a launch does
    after a trajectory change, and that change names a missing keys record by itself
    (choosing ``fresh`` after a refusal re-runs preflight, which passes, and the job that
    was missing runs); counted, a change of the choice alone planned a job that trained
    nothing."""
    from hy3rl.smk import _leaves, triggers

    kinds = TRIGGER_KINDS if extent else (TRAJECTORY, LOCATION)
    keys = [leaf for section in sorted(config) for leaf, _ in _leaves(config[section], section)
            if (heldout_kind(config) if leaf.startswith("data.heldout.")
                else config_kind(leaf)) in kinds]
    out = triggers(real_paths(config), *keys)
    train = config.get("train") or {}
    env = {k: knob_typed(v) for k, v in (train.get("env") or {}).items()
           if knob_kind(k) == TRAJECTORY}
    ovr = {k: v for k, v in flat_overrides(train.get("verl_overrides") or {}).items()
           if verl_kind(k) == TRAJECTORY}
    out.update(triggers({"train": {"env": env, "verl_overrides": ovr}},
                        "train.env", "train.verl_overrides"))
    out.update(content_triggers(config) if content is None else content)
    return out


def train_keys_params(config: Mapping[str, Any], stretch: str,
                      content: Mapping[str, str] | None = None) -> str:
    """A training job's training keys (their digest names its keys record,
    ``hy3rl.train.keys_digest``): ``final`` (rule train) takes
    every trigger, a segment ``step<N>`` every one but the total (an extension re-runs no
    finished segment), plus its own end. One ``key=value`` a line, sorted."""
    values = train_trigger_values(config, extent=stretch == "final", content=content)
    if stretch != "final":
        from hy3rl.smk import triggers

        values["segment_end"] = f"segment_end={stretch}"
        values.update(triggers(config, "train.segment_steps"))
    return "\n".join(sorted(values.values()))


# The settings of a generation (params of rule eval_generate; with the training keys of a
# checkpoint tag, what names its request, eval_request_digest): what the samples depend on.
# How an engine is laid out and fed is not among them (EVAL_ENGINE_KEYS): a new
# eval.vllm.gpu_memory_utilization after an out-of-memory, another tensor or data
# parallelism, eager mode, or the model copied to another model.dir re-evaluates no tag
# already evaluated (the sampling distribution, the prompts and the weights are the same).
EVAL_GENERATION_KEYS = (
    "eval.backend",
    "eval.preset",
    "eval.temperature",
    "eval.top_p",
    "eval.n_samples",
    "eval.max_tokens",
    "eval.num_problems",
    "eval.seed",
    "eval.transformers",
    "eval.vllm.max_model_len",  # a shorter context cuts generations
    "model.source",
    "model.revision",
)
EVAL_ENGINE_KEYS = (
    "eval.vllm.tensor_parallel_size",
    "eval.vllm.data_parallel_size",
    "eval.vllm.nodes",
    "eval.vllm.gpus_per_node",
    "eval.vllm.gpu_memory_utilization",
    "eval.vllm.enforce_eager",
    "model.dir",
)


def eval_request_params(config: Mapping[str, Any], tag: str,
                        content: Mapping[str, str] | None = None) -> str:
    """Rule ``eval_request``'s one param for tag ``tag``: the generation settings
    (:data:`EVAL_GENERATION_KEYS`), and for a checkpoint tag the training triggers (a new
    trajectory re-evaluates it; ``final`` also the total, so an extension re-evaluates the
    final checkpoint in the same invocation). One ``key=value`` a line, sorted."""
    from hy3rl.layout import split_tag
    from hy3rl.smk import triggers

    values = triggers(config, *EVAL_GENERATION_KEYS)
    values["tag"] = f"tag={tag}"
    model, _ = split_tag(tag)
    if model != "base":
        values.update(train_trigger_values(config, extent=model == "final", content=content))
    return "\n".join(sorted(values.values()))


def eval_request_digest(config: Mapping[str, Any], tag: str,
                        content: Mapping[str, str] | None = None) -> str:
    """The first 16 hex digits of the sha256 of :func:`eval_request_params`: the name of
    the tag's request (``Layout.eval_request``). Pure and cheap, computed while the DAG is
    built: values never seen name a missing request (the tag is evaluated again), values
    restored after a refused change name the request still in place (nothing runs)."""
    return hashlib.sha256(eval_request_params(config, tag, content).encode()).hexdigest()[:16]


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


def path_identity(path: Path) -> str:
    """What a path verl reads counts as: a file by its sha256, a directory by the sha256 of
    its files' relative paths, sizes and sha256 (sorted)."""
    from hy3rl.runtime_id import sha256_file

    if path.is_file():
        return f"file sha256:{sha256_file(path)}"
    rows = [[p.relative_to(path).as_posix(), p.stat().st_size, sha256_file(p)]
            for p in sorted(path.rglob("*")) if p.is_file()]
    return "directory sha256:" + hashlib.sha256(json.dumps(rows).encode()).hexdigest()


@functools.cache
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _normal(value: Any) -> Any:
    """Numbers as numbers (an integral float as its int: verl's float and int fields read
    1 and 1.0 alike), containers recursively."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def typed_value(text: str) -> Any:
    """An override's value as verl reads it: parsed with Hydra's override grammar
    (``1e-6`` and ``1.0e-6`` one float, ``True``/``true`` one boolean, ``'x'`` a string),
    numbers normalised (:func:`_normal`); the text itself when it is no single value (a
    sweep)."""
    from hydra.errors import HydraException

    try:
        override = _parser().parse_override(f"k={text}")
    except HydraException:
        return text
    if override.is_sweep_override():
        return text
    return _normal(override.value())


def digest(values: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``values``."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def _verl_value(text: str) -> Any:
    """A resolved trajectory value for the identity: typed; an absolute path that exists by
    what it names (:func:`path_identity`), so a path counts by content, never by name."""
    value = typed_value(text)
    if isinstance(value, str) and value.startswith("/") and Path(value).exists():
        return path_identity(Path(value))
    return value


def override_paths(config: Mapping[str, Any]) -> list[str]:
    """The existing absolute paths that ``train.verl_overrides`` and ``train.env`` give to
    trajectory keys (the identity counts them by content, :func:`_verl_value`): each file,
    and each file under a directory, sorted. Rule preflight takes them as inputs, so an
    edited file re-runs preflight and the identity sees the edit."""
    train = config.get("train") or {}
    texts = [str(v) for k, v in (train.get("verl_overrides") or {}).items()
             if verl_kind(str(k)) == TRAJECTORY and not refused_override(str(k))]
    texts += [str(v) for k, v in (train.get("env") or {}).items()
              if knob_kind(str(k)) == TRAJECTORY]
    out: set[str] = set()
    for text in texts:
        if "/" not in text:  # no path (and Hydra's parser is slow at every DAG build)
            continue
        value = typed_value(text)
        if not (isinstance(value, str) and value.startswith("/")):
            continue
        path = Path(value)
        if path.is_file():
            out.add(str(path))
        elif path.is_dir():
            out.update(str(p) for p in path.rglob("*") if p.is_file())
    return sorted(out)


def trajectory(*, resolved: Mapping[str, Mapping[str, Any]], pins: Mapping[str, str],
               train_sha256: str | None, model: str | None,
               reward_fn_sha256: str | None) -> dict[str, Any]:
    """``{"id", "values", "origins", "form"}``: the trajectory identity of a plan.
    ``resolved``: plan.json's ``resolved`` (verl key -> ``{"value", "source"[, "origin"]}``,
    the value as override text); ``pins``: repository name -> commit; the content identities
    of the training data, the model and the custom reward function (None: none). Values are
    typed (``form: typed``)."""
    items = {key.lstrip("+~"): entry for key, entry in sorted(resolved.items())}
    values = _trajectory_values(
        {k: e.get("value") for k, e in items.items()}, lambda v: _verl_value(str(v)), pins,
        {"data.train.sha256": train_sha256, "model.identity": model,
         "reward_function.sha256": reward_fn_sha256})
    origins = {k: str(e["origin"]) for k, e in items.items() if k in values and e.get("origin")}
    return {"id": digest(values), "values": values, "origins": origins, "form": "typed"}


def _trajectory_values(leaves: Mapping[str, Any], value_of: Any, pins: Mapping[str, str],
                       content: Mapping[str, str | None]) -> dict[str, Any]:
    """The values of a trajectory: the pins, each key of kind trajectory (``value_of`` its
    value), a workflow-owned path by its content name, then the content names."""
    values: dict[str, Any] = {f"pin.{name}": commit for name, commit in sorted(pins.items())}
    for key, value in sorted(leaves.items()):
        if verl_kind(key) != TRAJECTORY:
            continue
        if key in OWNED_PATHS:
            name = OWNED_PATHS[key][1]
            if name:
                values[name] = content[name]
            continue
        values[key] = value_of(value)
    for name, value in content.items():
        values.setdefault(name, value)
    return values


def composed_leaves(composed: Any) -> dict[str, Any]:
    """The configuration verl runs with, as its leaves: the composed config (Hydra's, from the
    launch's exact argument list) resolved (``OmegaConf.to_container(resolve=True)``) and
    flattened to dotted keys. Nested mappings, ``+``/``++``, interpolations and the order of
    overrides are thereby reduced to the one value verl reads; a list, or an empty mapping,
    is one leaf. Raises ValueError naming the key whose interpolation does not resolve."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = OmegaConf.to_container(composed, resolve=True) if hasattr(
            composed, "_metadata") else composed
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ValueError(f"{key}: does not resolve as verl would resolve it "
                         f"({str(exc).splitlines()[0]})") from None
    from hy3rl.smk import _leaves  # the config's own flattening (an empty mapping a leaf)

    return {leaf: value for section in data for leaf, value in _leaves(data[section],
                                                                      str(section))}


def touches(override_key: str, key: str) -> bool:
    """Whether an override of ``override_key`` (``+``/``~`` prefix ignored) sets ``key``: the
    key itself, a section above it or a key below it."""
    bare = override_key.lstrip("+~")
    return bare == key or key.startswith(bare + ".") or bare.startswith(key + ".")


def origin_of(key: str, overrides: list[tuple[str, str]]) -> str | None:
    """The origin of the last override (``(key, origin)`` in launch order) that sets ``key``
    (:func:`touches`; Hydra: later overrides win); None: verl's default."""
    hit = None
    for okey, origin in overrides:
        if touches(okey, key):
            hit = origin
    return hit


def composed_trajectory(leaves: Mapping[str, Any], *, pins: Mapping[str, str],
                        owned: Mapping[str, str], train_sha256: str | None,
                        model: str | None, reward_fn_sha256: str | None,
                        origins: Mapping[str, str]) -> dict[str, Any]:
    """``{"id", "values", "origins", "form": "composed"}``: the trajectory identity of the
    configuration verl runs with (:func:`composed_leaves`): every leaf of kind trajectory
    (:data:`VERL_KINDS`; a key none names counts), the pins and the content identities of
    the training data, the model and the custom reward function. A workflow-owned path
    (:data:`OWNED_PATHS`) counts by its content name; ``owned`` maps the workflow's own path
    values (the data file, the model directory, the reward function's copy) to their content
    names, so that a key interpolating one of them (``${actor_rollout_ref.model.path}``)
    counts the same content, never the directory's bytes again; any other absolute path
    that exists counts by its content (:func:`path_identity`). ``origins``: where the
    values of the launch's overrides came from (for refusal messages)."""
    values = _trajectory_values(
        leaves, lambda v: _leaf_value(v, owned), pins,
        {"data.train.sha256": train_sha256, "model.identity": model,
         "reward_function.sha256": reward_fn_sha256})
    kept = {k: v for k, v in origins.items() if k in values}
    return {"id": digest(values), "values": values, "origins": kept, "form": "composed"}


def _leaf_value(value: Any, owned: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        if value in owned:
            return f"the workflow's {owned[value]}"
        if value.startswith("/") and Path(value).exists():
            return path_identity(Path(value))
    if isinstance(value, list):
        return [_leaf_value(v, owned) for v in value]
    return _normal(value)


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _at(values: Mapping[str, Any], key: str) -> Any:
    """``values[key]``, or the section rebuilt from the leaves below ``key``; None: absent."""
    if key in values:
        return values[key]
    below = {k[len(key) + 1:]: v for k, v in values.items() if k.startswith(key + ".")}
    return _nest(below) if below else None


def trajectory_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """:func:`changes` between two trajectories (an identity file's and a plan's). Both of
    the composed form: every leaf. One written before it (its values the launch's override
    keys only): the keys that one names, each compared with the other side's value at that
    key (a section rebuilt from its leaves), since a key neither names was verl's default
    under the same pin (a pin change shows as ``pin.verl``)."""
    a, b = comparable(old), comparable(new)
    if (old.get("form") == "composed") != (new.get("form") == "composed"):
        short, full = (a, b) if old.get("form") != "composed" else (b, a)
        full = {k: _at(full, k) for k in short}
        a, b = (short, full) if short is a else (full, short)
    return changes(a, b)


def comparable(traj: Mapping[str, Any]) -> dict[str, Any]:
    """A trajectory's values as :func:`changes` compares them: the verl keys of kind
    trajectory under the current :data:`VERL_KINDS` (an identity file written before a key
    became operational still lists it), typed. A file written before typed values (no
    ``form``) holds the override text: its verl values are parsed the same way (a path there
    stays as it was recorded)."""
    out = {}
    for key, value in (traj.get("values") or {}).items():
        if key.startswith("pin.") or key in CONTENT_NAMES:
            out[key] = value
        elif verl_kind(key) == TRAJECTORY:
            legacy = traj.get("form") not in ("typed", "composed") and isinstance(value, str)
            out[key] = typed_value(value) if legacy else value
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal by type and value: numbers as numbers, a boolean never a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return json.dumps(_normal(a), sort_keys=True) == json.dumps(_normal(b), sort_keys=True)


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every key whose value differs (absent on one side: null), sorted by key; values are
    compared by type and value (:func:`_same`), as :func:`comparable` gives them."""
    return [{"key": k, "old": old.get(k), "new": new.get(k)}
            for k in sorted(set(old) | set(new)) if not _same(old.get(k), new.get(k))]


def describe_changes(diff: list[dict[str, Any]], origins: Mapping[str, str]) -> str:
    """``key (origin): old -> new; ...`` for a refusal message."""
    parts = []
    for c in diff:
        where = f" ({origins[c['key']]})" if c["key"] in origins else ""
        parts.append(f"{c['key']}{where}: {json.dumps(c['old'])} -> {json.dumps(c['new'])}")
    return "; ".join(parts)


# ---- the key table (docs/formats/train.md) --------------------------------------------

TABLE_BEGIN = "<!-- key kinds: generated by hy3rl.identity.kind_table; do not edit -->"
TABLE_END = "<!-- end of key kinds -->"


def kind_table() -> str:
    """The kinds of every config key, knob and verl key, as Markdown tables (the block
    between :data:`TABLE_BEGIN` and :data:`TABLE_END` in docs/formats/train.md)."""
    def rows(table: Mapping[str, tuple[str, str]]) -> list[str]:
        return [f"| `{k}` | {kind} | {why} |" for k, (kind, why) in sorted(table.items())]

    knob_rows = [f"| `{name}` | {knob_kind(name)} | "
                 + ", ".join(f"`{k}`" for k in keys) + " |" for name, keys in sorted(KNOBS.items())]
    owned = [f"| `{k}` | `{key}` | {f'`{name}`' if name else 'not in the trajectory'} |"
             for k, (key, name) in sorted(OWNED_PATHS.items())]
    return "\n".join([
        TABLE_BEGIN, "",
        "Config keys (a section counts for every key below it; `*` is one level; the longest "
        "entry decides):", "",
        "| config key | kind | why |", "|---|---|---|", *rows(CONFIG_KINDS), "",
        "Launch-script knobs (`train.env`): the kind of the strongest verl key each sets:", "",
        "| knob | kind | sets |", "|---|---|---|", *knob_rows, "",
        "Resolved verl keys (`plan.json` `resolved`, `train.verl_overrides`; a key no entry "
        "names counts as trajectory):", "",
        "| verl key | kind | why |", "|---|---|---|", *rows(VERL_KINDS), "",
        "Workflow-owned paths (an override is refused, naming the key to set):", "",
        "| verl key | set instead | counted in the trajectory as |", "|---|---|---|", *owned,
        "", TABLE_END])
