"""The coupling rules: checks of the composed launch (parallel layout, token budgets, batch
sizes, frequencies, checkpoints, disk, the DAPO reward lengths), of verl's own validation of it
(hy3rl.verl_checks) and, for a GPU run, of the bridge check's report, before any GPU is
allocated.

Each rule has a stable name (``RULES``; ``preflight.waive`` names them) and a status: pass,
error, warning, waived or not run. One function per rule family below reads the composed
values (``effective``) it needs and records what fails, with the numbers and the knob to
turn; :func:`check_rules` runs them all and applies the waivers. Format:
docs/formats/preflight.md.
"""

from __future__ import annotations

import math
import netrc
import os
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hy3rl import wandb_run
from hy3rl.health import BYPASS_MODE, ROLLOUT_LOG_PROBS, VAL_N, metric_problems
from hy3rl.preflight.resolve import PAPER_DEFAULT, Override, Resolution, select
from hy3rl.settings import Cluster, Config
from hy3rl.verl_checks import FAIL, NOT_RUN, VerlCheck

# Every rule, by its stable name (used in plan.json and in `preflight.waive`).
RULES: dict[str, str] = {
    "verl_pin": "the verl clone is at the commit recorded in deps/lock.json",
    "pins_clean": "every pinned clone (verl, Megatron-Bridge, TransferQueue) is its pin and "
                  "nothing else: no modified, staged, deleted or untracked file, unless "
                  "deps.allow_local_changes counts the diff in the run identity",
    "knobs": "every train.env knob is read by the launch script and not owned by another key",
    "compose": "the overrides compose with the pinned verl's Hydra config (no unknown key), "
               "and the numeric values the rules read are numbers",
    "owned_keys": "verl, as it composes the launch, reads the workflow's own value at every "
                  "key the workflow owns (data files, model, checkpoint location, resume, "
                  "retention, loggers, total, shape), however an override spells it",
    "verl": "verl's own validation of the composed config (validate_config, its config "
            "dataclasses' __post_init__, the reward manager's constructor) passes; a verl check "
            "that cannot run is an error too",
    "checkpoint_checks": "checks/checkpoint.json has no failed check",
    "bridge": "GPU runs: every check in checks/bridge.json passed in the training runtime",
    "gpus": "GPUs = nodes x GPUs per node, the same in the config and in verl's trainer keys",
    "actor_layout": "actor TP x PP x CP and EP x ETP x PP divide the GPUs",
    "ref_layout": "reference TP x PP x CP and EP x ETP x PP divide the GPUs",
    "rollout_tp": "rollout TP divides the GPUs and holds the model's weights on the GPU type",
    "cpu_path": "the CPU path (train.cpu): verl's FSDP engine and the hf rollout on one host, "
                "the trainer ranks as verl's GPUs",
    "actor_token_budget": "ppo_max_token_len_per_gpu x CP >= prompt + response",
    "max_model_len": "rollout.max_model_len >= prompt + response",
    "log_prob_token_budget": "rollout/ref log_prob_max_token_len_per_gpu x CP >= prompt + response",
    "overlong_buffer": "DAPO overlong buffer: reward_kwargs.overlong_buffer_cfg.len <= "
                       "reward_kwargs.max_resp_len (verl asserts it only at trainer setup)",
    "reward_max_resp_len": "reward.reward_kwargs.max_resp_len = data.max_response_length",
    "batch_divisible": "train batch x n divisible by the mini batch and the data-parallel size",
    "total_steps": "trainer.total_training_steps is set and positive",
    "save_test_freq": "save_freq and test_freq are positive and at most the total steps",
    "checkpoint_root": "checkpoints go to an absolute directory outside Ray's working dir",
    "async_save": "actor.checkpoint.async_save is off (with it the tracker file is not written)",
    "disk": "free space on the checkpoint root holds (keep + 1) checkpoints",
    "segment_schedule": "train.segment_steps only with a constant learning-rate schedule",
    "run_identity": "the checkpoint directory's run identity allows this launch: the same "
                    "trajectory (resume, or extend to a larger total), or a change chosen "
                    "with train.on_config_change; never a total below its newest checkpoint",
    "eval_steps_kept": "every eval.steps step is within the total and, once the run has "
                       "passed it, still has its checkpoint or was evaluated under this run "
                       "identity (retention removed none still needed)",
    "eval_steps_saved": "every eval.steps step is a step verl saves (a multiple of save_freq, "
                        "a segment's end or the last step)",
    "hf_weights": "what reads a checkpoint's Hugging Face weights (eval.steps, eval.final, "
                  "release) gets them: verl writes them (hf_model in save_contents, or model "
                  "without Megatron dist checkpointing)",
    "selection": "eval.select names the held-out set (data.heldout), which shares no problem "
                 "with the test set (data.val) nor the training set, and its k fits",
    "resume_schedule": "a resume or extension only with a constant learning-rate schedule "
                       "(verl restarts its scheduler from the current total on every start); "
                       "waive it to opt in",
    "ref_kl_zero": "warning: the reference model is computed while the KL coefficient is 0",
    "val_on_resume": "warning: validation before training re-runs on every resume",
    "prompts_over_max": "warning: training prompts longer than max_prompt_length",
    "overlong_buffer_window": "warning: the overlong buffer is longer than half of max_resp_len",
    "oom_actor_memory": "warning: actor weights + optimizer per GPU vs GPU memory without offload",
    "oom_rollout_memory": "warning: rollout weights per GPU leave little room for the KV cache",
    "oom_micro_batch": "warning: static micro batches whose tokens exceed the token budget",
    "runtime_tag": "warning: train.runtime.prefix names a docker:// image by tag (it can move)",
    "wandb": "GPU runs with wandb in trainer.logger: W&B can start in the training job (a key "
             "in WANDB_API_KEY or the netrc file, or WANDB_MODE offline/disabled)",
    "rehearsal": "GPU runs: the train job starts only after the one-node rehearsal (rule "
                 "rehearsal) passed in the same runtime identity; waive it to go without",
    "health_metrics": "every metric a train.health rule watches is one the pinned verl logs "
                      "(its source in the clone, the rollout log-probs it needs); set a "
                      "rule to ignore rather than watch a metric that never comes",
}
NOT_WAIVABLE = {"compose", "owned_keys", "pins_clean", "run_identity", "health_metrics"}

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
    "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "actor_rollout_ref.actor.optim.warmup_style",
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
    # what hy3rl.stage_memory predicts each pipeline stage's memory from
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer",
    "actor_rollout_ref.actor.megatron.override_transformer_config",
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
    "actor_rollout_ref.rollout.max_num_seqs", "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.rollout.enable_chunked_prefill",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.model.mtp.enable",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.val_kwargs.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p",
    "algorithm.adv_estimator", "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold",
    "algorithm.rollout_correction.bypass_mode",
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
    "max_num_batched_tokens", "temperature", "top_p", "kl_coef",
    "virtual_pipeline_model_parallel_size", "max_num_seqs"})

NO_GPU = "not run: no GPU allocation (cluster.gpu is false)"
# Rules that need an allocation: `not run` when cluster.gpu is false.
ALLOCATION_RULES = ("gpus", "actor_layout", "ref_layout", "rollout_tp", "oom_actor_memory",
                    "oom_rollout_memory")


@dataclass
class RuleResult:
    name: str
    status: str  # pass | error | warning | waived | not run
    messages: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- effective values


def effective_values(composed) -> dict[str, Any]:
    return {key: select(composed, key) for key in EFFECTIVE_KEYS}


def effective_sources(eff: Mapping[str, Any], overrides: list[Override]
                      ) -> dict[str, dict[str, str]]:
    """The source of each effective value: that of the last override setting the key, a key
    below it or above it (Hydra: later overrides win); a key no override touches keeps verl's
    config default, which the published run used as well (``paper default``)."""
    from hy3rl.identity import touches

    out: dict[str, dict[str, str]] = {}
    for key in eff:
        hit = None
        for o in overrides:
            if touches(o.key, key):
                hit = o
        out[key] = ({"source": hit.source, "origin": hit.origin} if hit else
                    {"source": PAPER_DEFAULT, "origin": "verl config default (not overridden)"})
    return out


# --------------------------------------------------------------------------- helpers


def to_int(v: Any, default: int = 0) -> int:
    """A composed value as a number (verl's config may hold null or a string); ``default``
    when it is not one (rule ``compose`` reports that)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def to_float(v: Any, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def truthy(v: Any) -> bool:
    """A composed flag: true, or a string that says so (a knob renders ``True``)."""
    return v is True or str(v).lower() == "true"


def required_rollout_tp(weight_bytes: int, gpu_memory_gb: float, mem_util: float) -> int:
    """Smallest power-of-two TP whose per-GPU share of the weights fits in
    ``gpu_memory_gb * 1e9 * mem_util`` (weights only; the KV cache needs more)."""
    need = weight_bytes / (gpu_memory_gb * 1e9 * mem_util)
    return 1 << max(0, math.ceil(math.log2(max(1.0, math.ceil(need)))))


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


class _Rules:
    """The results being collected: a rule's first error or warning replaces its pass or
    not-run, later ones add messages (an error makes the status error)."""

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


_SIZES = {"tensor": "tensor_model_parallel_size", "pipeline": "pipeline_model_parallel_size",
          "context": "context_parallel_size", "expert": "expert_model_parallel_size",
          "expert_tensor": "expert_tensor_parallel_size"}


@dataclass(frozen=True)
class Shape:
    """The numbers several rule families share, read once from the composed values."""

    gpu: bool  # cluster.gpu
    gpus: int  # G = cluster.nodes x cluster.gpus_per_node
    trains: bool  # on GPUs or on the CPU path (Config.trains)
    prompt: int
    response: int
    actor: dict[str, int]  # tensor, pipeline, context, expert, expert_tensor
    ref: dict[str, int]
    rollout_tp: int
    mem_util: float

    @property
    def seq(self) -> int:
        return self.prompt + self.response

    @classmethod
    def of(cls, cluster: Cluster, eff: Mapping[str, Any], trains: bool | None = None) -> Shape:
        return cls(
            gpu=bool(cluster.gpu),
            gpus=cluster.nodes * cluster.gpus_per_node,
            trains=bool(cluster.gpu) if trains is None else trains,
            prompt=to_int(eff.get("data.max_prompt_length")),
            response=to_int(eff.get("data.max_response_length")),
            actor={k: to_int(eff.get(f"actor_rollout_ref.actor.megatron.{v}"), 1)
                   for k, v in _SIZES.items()},
            ref={k: to_int(eff.get(f"actor_rollout_ref.ref.megatron.{v}"), 1)
                 for k, v in _SIZES.items()},
            rollout_tp=to_int(eff.get("actor_rollout_ref.rollout.tensor_model_parallel_size"), 1),
            mem_util=to_float(eff.get("actor_rollout_ref.rollout.gpu_memory_utilization"), 0.5),
        )


# --------------------------------------------------------------------------- rule families


def _numbers(r: _Rules, eff: Mapping[str, Any]) -> None:
    """compose: Hydra does not type-check values (`ACTOR_PP=abc` composes); verl would reject
    them only after the allocation. The numeric keys the rules read must be numbers (or
    null)."""
    for key in NUMERIC_KEYS:
        value = eff.get(key)
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                r.error("compose", f"{key} = {value!r} is not a number (verl's config expects "
                        f"one and would fail on it after the allocation)")


def _knobs(r: _Rules, res: Resolution) -> None:
    for problem in res.knob_errors:
        r.error("knobs", problem)


def _same_value(composed: Any, wanted: Any) -> bool:
    if isinstance(composed, list) and not isinstance(wanted, list) and len(composed) == 1:
        composed = composed[0]  # data.train_files: a file or a list of files
    if isinstance(composed, bool) or isinstance(wanted, bool):
        return type(composed) is type(wanted) and composed == wanted
    if isinstance(composed, int | float) and isinstance(wanted, int | float):
        return composed == wanted
    return composed == wanted


def _owned_keys(r: _Rules, res: Resolution) -> None:
    """owned_keys: the composed, resolved config (what verl reads) holds the workflow's value
    at each key it owns (``res.owned``), whatever spelling of an override reached the key; a
    key the pinned config lacks is not read."""
    from hy3rl.identity import origin_of

    leaves = res.leaves or {}
    spelled = [(o.key, f"{o.origin}: {o.text}") for o in res.overrides]
    for key, (wanted, what) in res.owned.items():
        if key not in leaves and not any(k.startswith(key + ".") for k in leaves):
            continue
        value = leaves.get(key)
        if _same_value(value, wanted):
            continue
        origin = origin_of(key, spelled) or "verl's config default"
        r.error("owned_keys", f"{key}: verl would read {value!r} (set by {origin}); the run "
                f"has {wanted!r} ({what}: set it there)")


def _checkpoint_checks(r: _Rules, ckpt_check: Mapping[str, Any] | None) -> None:
    if ckpt_check:
        failed = [c.get("name", "?") for c in ckpt_check.get("checks", [])
                  if c.get("status") == "fail"]
        if failed:
            r.error("checkpoint_checks", f"checks/checkpoint.json has failed checks: "
                    f"{', '.join(failed)}")
    else:
        r.not_run("checkpoint_checks", "not run: checks/checkpoint.json not given")


def _gpus(r: _Rules, c: Cluster, eff: Mapping[str, Any], s: Shape) -> None:
    g_verl = to_int(eff.get("trainer.nnodes")) * to_int(eff.get("trainer.n_gpus_per_node"))
    if s.gpus <= 0:
        r.error("gpus", f"cluster.gpu is true but cluster.nodes x cluster.gpus_per_node = "
                f"{c.nodes} x {c.gpus_per_node} = {s.gpus}")
    if g_verl != s.gpus:
        r.error("gpus", f"verl's trainer.nnodes x trainer.n_gpus_per_node = "
                f"{eff.get('trainer.nnodes')} x {eff.get('trainer.n_gpus_per_node')} = "
                f"{g_verl} but the allocation is cluster.nodes x cluster.gpus_per_node = "
                f"{c.nodes} x {c.gpus_per_node} = {s.gpus}")


def _layouts(r: _Rules, s: Shape) -> None:
    """actor_layout, ref_layout: model and expert parallel sizes divide the GPUs."""
    g = s.gpus
    for name, p, who in (("actor_layout", s.actor, "actor"), ("ref_layout", s.ref, "ref")):
        mp = p["tensor"] * p["pipeline"] * p["context"]
        if g <= 0 or g % mp:
            r.error(name, f"{who} TP x PP x CP = {p['tensor']} x {p['pipeline']} x "
                    f"{p['context']} = {mp} does not divide the {g} GPUs "
                    f"(ACTOR_TP/ACTOR_PP/ACTOR_CP)")
        ep = p["expert"] * p["expert_tensor"] * p["pipeline"]
        if g <= 0 or g % ep:
            r.error(name, f"{who} EP x ETP x PP = {p['expert']} x {p['expert_tensor']} x "
                    f"{p['pipeline']} = {ep} does not divide the {g} GPUs "
                    f"(ACTOR_EP/ACTOR_ETP/ACTOR_PP)")


def _rollout_tp(r: _Rules, gmem: float, s: Shape, weights: int | None,
                weights_from: str) -> None:
    """rollout_tp: divides the GPUs, and holds the weights (the memory part needs both the
    weights' size and the GPUs' memory)."""
    tp, g = s.rollout_tp, s.gpus
    if g <= 0 or g % tp:
        r.error("rollout_tp", f"rollout TP = {tp} does not divide the {g} GPUs (ROLLOUT_TP)")
    if weights is None or gmem <= 0:
        r.not_run("rollout_tp", f"not run (memory part): model bytes {weights_from}; "
                  f"cluster.gpu_memory_gb = {gmem}")
        return
    need = required_rollout_tp(weights, gmem, s.mem_util)
    if tp < need:
        r.error("rollout_tp", f"rollout TP = {tp} is below the {need} needed: "
                f"{weights / 1e9:.1f} GB of weights / ({gmem:g} GB x "
                f"gpu_memory_utilization {s.mem_util:g}) = "
                f"{weights / (gmem * 1e9 * s.mem_util):.2f} GPUs, rounded up to a power of "
                f"2 (ROLLOUT_TP)")


def _rollout_memory(r: _Rules, gmem: float, s: Shape, weights: int) -> None:
    """oom_rollout_memory (when the rollout TP is at least the one needed)."""
    tp = s.rollout_tp
    per_gpu = weights / tp
    budget = gmem * 1e9 * s.mem_util
    if tp >= required_rollout_tp(weights, gmem, s.mem_util) and per_gpu > 0.8 * budget:
        r.warn("oom_rollout_memory", f"rollout weights take {per_gpu / 1e9:.1f} GB of the "
               f"{budget / 1e9:.1f} GB vLLM may use per GPU ({per_gpu / budget:.0%}), "
               f"little KV cache left: raise ROLLOUT_TP or ROLLOUT_GPU_MEM_UTIL")


def _actor_memory(r: _Rules, gmem: float, eff: Mapping[str, Any], s: Shape,
                  weights: int) -> None:
    """oom_actor_memory: actor states per GPU without offload."""
    a = s.actor
    offload = (truthy(eff.get("actor_rollout_ref.actor.megatron.param_offload"))
               and truthy(eff.get("actor_rollout_ref.actor.megatron.optimizer_offload")))
    shard = a["pipeline"] * max(a["tensor"], a["expert"] * a["expert_tensor"])
    states = 9 * weights / shard  # bf16 params + fp32 grads, master, 2 Adam moments
    if not offload and states > 0.8 * gmem * 1e9:
        r.warn("oom_actor_memory", f"actor weights + grads + optimizer ~ "
               f"{states / 1e9:.0f} GB per GPU (9 x {weights / 1e9:.1f} GB / PP x "
               f"max(TP, EP x ETP) = {shard}) vs {gmem:g} GB GPUs without offload: set "
               f"ALL_OFFLOAD=True or raise ACTOR_PP / ACTOR_EP")


def _allocation(r: _Rules, c: Cluster, eff: Mapping[str, Any], s: Shape, weights: int | None,
                weights_from: str) -> None:
    """The rules that need an allocation; `not run` without a GPU."""
    if not s.gpu:
        for name in ALLOCATION_RULES:
            r.not_run(name, NO_GPU)
        return
    _gpus(r, c, eff, s)
    _layouts(r, s)
    gmem = float(c.gpu_memory_gb)
    _rollout_tp(r, gmem, s, weights, weights_from)
    if weights is not None and gmem > 0:
        _rollout_memory(r, gmem, s, weights)
        _actor_memory(r, gmem, eff, s, weights)


# The composed values the CPU path needs (hy3rl.verl_cpu): a user's train.verl_overrides
# that moves one of them would send verl back to a GPU code path after the start.
CPU_PATH_VALUES = {
    "trainer.device": "cpu",
    "actor_rollout_ref.rollout.name": "hf",
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.ref.strategy": "fsdp2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "trainer.nnodes": 1,
}


def _cpu_path(r: _Rules, cfg: Config, res: Resolution, eff: Mapping[str, Any]) -> None:
    """cpu_path: the CPU path's couplings (train.cpu): its own engine and rollout, one host,
    the trainer ranks as verl's GPUs; not run off the CPU path."""
    if not cfg.train.cpu.enable:
        r.not_run("cpu_path", "not run: train.cpu.enable is false")
        return
    # (with cluster.gpu true the config itself is refused: Config.from_dict)
    composed = res.composed
    engine = select(composed, "model_engine") if composed is not None else None
    if engine != "dp":
        r.error("cpu_path", f"model_engine = {engine!r}: the CPU path trains with verl's "
                "FSDP engine (dp)")
    want = {**CPU_PATH_VALUES, "trainer.n_gpus_per_node": cfg.train.cpu.ranks}
    for key, value in want.items():
        got = select(composed, key) if composed is not None else None
        if str(got).lower() != str(value).lower():
            r.error("cpu_path", f"{key} = {got!r} but the CPU path needs {value!r} "
                    f"(train.verl_overrides must not move it)")
    for key in ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"):
        size = to_int(eff.get(key))
        if size and size % cfg.train.cpu.ranks:
            r.error("cpu_path", f"{key} = {size} is not divisible by train.cpu.ranks = "
                    f"{cfg.train.cpu.ranks}")


def _token_budgets(r: _Rules, eff: Mapping[str, Any], s: Shape) -> None:
    """actor_token_budget, max_model_len, log_prob_token_budget: each holds a sequence."""
    prompt, response, seq, a = s.prompt, s.response, s.seq, s.actor
    ppo_tok = to_int(eff.get("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"))
    if truthy(eff.get("actor_rollout_ref.actor.use_dynamic_bsz")) and ppo_tok * a["context"] < seq:
        r.error("actor_token_budget", f"ppo_max_token_len_per_gpu x CP = {ppo_tok} x "
                f"{a['context']} = {ppo_tok * a['context']} < max_prompt_length + "
                f"max_response_length = {prompt} + {response} = {seq} "
                f"(PPO_MAX_TOKEN_LEN_PER_GPU or ACTOR_CP)")
    mml = eff.get("actor_rollout_ref.rollout.max_model_len")
    if mml is not None and to_int(mml) < seq:
        r.error("max_model_len", f"rollout.max_model_len = {mml} < max_prompt_length + "
                f"max_response_length = {prompt} + {response} = {seq} (ROLLOUT_MAX_MODEL_LEN)")
    mnbt = eff.get("actor_rollout_ref.rollout.max_num_batched_tokens")
    chunked = truthy(eff.get("actor_rollout_ref.rollout.enable_chunked_prefill"))
    if mnbt is not None and not chunked and to_int(mnbt) < seq:
        r.error("max_model_len", f"rollout.max_num_batched_tokens = {mnbt} < {seq} with chunked "
                f"prefill off (ROLLOUT_MAX_NUM_BATCHED_TOKENS)")
    for who, cp, knob in (("rollout", a["context"], "ROLLOUT_LOG_PROB_MAX_TOKEN_LEN_PER_GPU"),
                          ("ref", s.ref["context"], "REF_LOG_PROB_MAX_TOKEN_LEN_PER_GPU")):
        if not truthy(eff.get(f"actor_rollout_ref.{who}.log_prob_use_dynamic_bsz")):
            continue
        budget = to_int(eff.get(f"actor_rollout_ref.{who}.log_prob_max_token_len_per_gpu"))
        if budget * cp < seq:
            r.error("log_prob_token_budget", f"{who}.log_prob_max_token_len_per_gpu x CP = "
                    f"{budget} x {cp} = {budget * cp} < {prompt} + {response} = {seq} ({knob})")


def _micro_batch(r: _Rules, eff: Mapping[str, Any], s: Shape) -> None:
    """oom_micro_batch: static micro batches over the token budget."""
    if truthy(eff.get("actor_rollout_ref.actor.use_dynamic_bsz")):
        return
    ppo_tok = to_int(eff.get("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"))
    cp = s.actor["context"]
    mbs = to_int(eff.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"), 1)
    tokens = mbs * s.seq / cp
    if ppo_tok and tokens > ppo_tok:
        r.warn("oom_micro_batch", f"static micro batches of {mbs} x {s.seq} tokens / CP "
               f"{cp} = {tokens:.0f} tokens per GPU exceed the "
               f"{ppo_tok}-token budget: lower ACTOR_PPO_MICRO_BATCH_SIZE_PER_GPU, raise "
               f"ACTOR_CP, or use dynamic batch sizes")


def _batch_divisible(r: _Rules, eff: Mapping[str, Any], s: Shape) -> None:
    tbs = to_int(eff.get("data.train_batch_size"))
    n = to_int(eff.get("actor_rollout_ref.rollout.n"), 1)
    mini = to_int(eff.get("actor_rollout_ref.actor.ppo_mini_batch_size"))
    if mini <= 0 or tbs < mini or tbs % mini:
        r.error("batch_divisible", f"data.train_batch_size = {tbs} is not a positive multiple "
                f"of actor.ppo_mini_batch_size = {mini} (TRAIN_BATCH_SIZE / PPO_MINI_BATCH_SIZE)")
    g, a = s.gpus, s.actor
    if not (s.gpu and g > 0):
        return
    mp = a["tensor"] * a["pipeline"] * a["context"]
    dp = g // mp if mp and g % mp == 0 else 0
    if not dp:
        return
    if (tbs * n) % dp:
        r.error("batch_divisible", f"train_batch_size x n = {tbs} x {n} = {tbs * n} is "
                f"not divisible by the actor's data-parallel size {g} / ({mp}) = {dp}")
    if (mini * n) % dp:
        r.error("batch_divisible", f"ppo_mini_batch_size x n = {mini} x {n} = "
                f"{mini * n} is not divisible by the actor's data-parallel size {dp}")


def _steps_and_frequencies(r: _Rules, eff: Mapping[str, Any]) -> None:
    """total_steps, save_test_freq."""
    total = to_int(eff.get("trainer.total_training_steps"))
    if total <= 0:
        r.error("total_steps", f"trainer.total_training_steps = "
                f"{eff.get('trainer.total_training_steps')}: set train.total_training_steps > 0 "
                f"(the script alone trains {eff.get('trainer.total_epochs')} epochs)")
    save, test = to_int(eff.get("trainer.save_freq")), to_int(eff.get("trainer.test_freq"))
    if save <= 0:
        r.error("save_test_freq", f"trainer.save_freq = {save}: no checkpoint would be saved, "
                f"so nothing could resume (SAVE_FREQ)")
    elif total > 0 and save > total:
        r.error("save_test_freq", f"trainer.save_freq = {save} > total_training_steps = "
                f"{total}: only the final step is saved, a failure loses everything (SAVE_FREQ)")
    if total > 0 and test > total:
        r.error("save_test_freq", f"trainer.test_freq = {test} > total_training_steps = {total}: "
                f"no validation during training (TEST_FREQ)")


def _checkpoint_root(r: _Rules, cfg: Config) -> None:
    root = cfg.train.checkpoint_root
    if cfg.cluster.gpu and not root:
        r.error("checkpoint_root", "train.checkpoint_root is empty: set an absolute directory on "
                "storage shared by every node")
    elif root and not Path(root).is_absolute():
        r.error("checkpoint_root", f"train.checkpoint_root = {root!r} is relative: verl would "
                f"resolve it inside Ray's copy of the working dir; give an absolute path")


def _async_save(r: _Rules, eff: Mapping[str, Any]) -> None:
    if truthy(eff.get("actor_rollout_ref.actor.checkpoint.async_save")):
        r.error("async_save", "actor_rollout_ref.actor.checkpoint.async_save = True: verl then "
                "does not write latest_checkpointed_iteration.txt and resume breaks")


def checkpoint_space(ckpt_dir: Path) -> tuple[int, int]:
    """What the checkpoint directory holds already: its complete checkpoints (they occupy
    their space: only the rest of the checkpoints kept at once needs free space) and the
    bytes of the leftovers the job removes at its start (hy3rl.ckptdir.leftovers: they
    count as free)."""
    from hy3rl.ckptdir import leftovers, scan
    from hy3rl.watchdog import tree_bytes

    if not ckpt_dir.is_dir():
        return 0, 0
    held = sum(1 for c in scan(ckpt_dir) if c.complete)
    return held, sum(tree_bytes(p) for p in leftovers(ckpt_dir))


def _disk(r: _Rules, cfg: Config, eff: Mapping[str, Any], ckpt_dir: Path, weights: int | None,
          weights_from: str) -> dict[str, Any]:
    """disk: free space for (keep + kept for eval + 1) checkpoints; returns plan.json's
    ``checkpoint`` record."""
    save = to_int(eff.get("trainer.save_freq"))
    total = to_int(eff.get("trainer.total_training_steps"))
    save_contents = eff.get("actor_rollout_ref.actor.checkpoint.save_contents") or []
    keep = max(1, cfg.train.checkpoint_keep)
    extra = kept_for_eval(cfg.eval_keep_steps, save, total, keep, cfg.train.segment_steps)
    ck = {"dir": str(ckpt_dir), "keep": keep, "kept_for_eval": extra,
          "save_contents": save_contents, "weights_bytes": weights,
          "weights_from": weights_from}
    if weights is None:
        r.not_run("disk", f"not run: model bytes {weights_from}")
        return ck
    per = checkpoint_bytes(weights, list(save_contents))
    held, reclaim = checkpoint_space(ckpt_dir)
    there = min(held, keep + len(extra))  # complete checkpoints already in place
    need = (keep + len(extra) + 1 - there) * per
    free, probe = free_bytes(ckpt_dir)
    free += reclaim  # leftovers the job removes at its start
    ck.update(bytes_per_checkpoint=per, bytes_needed=need, free_bytes=free,
              free_on=str(probe), checkpoints_there=held, reclaimable_bytes=reclaim)
    if need > free:
        already = f" - {there} already there" if there else ""
        r.error("disk", f"checkpoints need (keep {keep} + {len(extra)} kept for "
                f"eval.steps {extra} + 1 being written{already}) x "
                f"{per / 1e12:.3f} TB (weights {weights / 1e12:.3f} TB + optimizer "
                f"6 x weights) = {need / 1e12:.3f} TB but {probe} has {free / 1e12:.3f} TB "
                f"free (train.checkpoint_keep, eval.steps, train.checkpoint_root)")
    return ck


def non_constant_schedule(eff: Mapping[str, Any]) -> str | None:
    """Why the actor's learning rate is not constant (verl@220e903 restarts the scheduler
    on every start, deriving warmup and decay from the current total: a resume, a segment
    or an extension is then not the schedule of one uninterrupted run), None if it is."""
    warm = to_int(eff.get("actor_rollout_ref.actor.optim.lr_warmup_steps"), -1)
    ratio = to_float(eff.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"))
    lr = to_float(eff.get("actor_rollout_ref.actor.optim.lr"))
    warming = warm > 0 or (warm < 0 and ratio > 0)
    if eff.get("actor_rollout_ref.actor.strategy") in ("fsdp", "fsdp2"):
        # verl's FSDP optimizer (optim/fsdp.yaml): lr_scheduler_type (warmup_style its older
        # name) constant or cosine, after the warmup
        kind = eff.get("actor_rollout_ref.actor.optim.warmup_style") or eff.get(
            "actor_rollout_ref.actor.optim.lr_scheduler_type")
        if warming or kind != "constant":
            return (f"lr_warmup_steps = {warm}, lr_warmup_steps_ratio = {ratio}, "
                    f"lr_scheduler_type = {kind}, lr = {lr:g}")
        return None
    style = eff.get("actor_rollout_ref.actor.optim.lr_decay_style")
    min_lr = to_float(eff.get("actor_rollout_ref.actor.optim.min_lr"))
    if warming or (style != "constant" and lr != min_lr):
        return (f"lr_warmup_steps = {warm}, lr_warmup_steps_ratio = {ratio}, "
                f"lr_decay_style = {style}, lr = {lr:g}, min_lr = {min_lr:g}")
    return None


def _segment_schedule(r: _Rules, seg: int, eff: Mapping[str, Any]) -> None:
    if seg <= 0:
        return
    why = non_constant_schedule(eff)
    if why:
        r.error("segment_schedule", f"train.segment_steps = {seg} needs a constant learning "
                f"rate (each segment restarts the scheduler) but {why}")


def _run_identity(r: _Rules, ckpt_dir: Path, identity: Mapping[str, Any] | None,
                  eff: Mapping[str, Any]) -> None:
    """run_identity and resume_schedule: what a launch would do on the checkpoint directory
    as the submit host sees it (hy3rl.ckptdir.decide_identity; the training job decides
    again before it starts the trainer)."""
    from hy3rl.ckptdir import CheckpointDirError, decide_identity

    if identity is None:
        return
    try:
        d = decide_identity(ckpt_dir, identity["trajectory"], identity["total_training_steps"],
                            identity["on_config_change"])
    except CheckpointDirError as exc:
        r.error("run_identity", str(exc))
        return
    identity["decision"] = {"action": d.action, "newest_step": d.newest_step,
                            "changes": d.changes, "message": d.error or d.message}
    if d.error:
        r.error("run_identity", d.error)
        return
    if d.action == "adopt":
        r.warn("run_identity", d.message.removeprefix("WARNING: "))
    elif d.message:
        r.results["run_identity"] = RuleResult("run_identity", "pass", [d.message])
    why = non_constant_schedule(eff)
    if why and d.action in ("same", "extend", "adopt", "resume_changed") and d.newest_step:
        r.error("resume_schedule", f"this launch continues from step {d.newest_step} "
                f"({d.action}) but the learning rate is not constant ({why}): verl restarts "
                "its scheduler from the current total_training_steps, so the run would not "
                "follow one schedule; waive resume_schedule to accept it")


def _eval_steps_kept(r: _Rules, cfg: Config, ckpt_dir: Path, steps: list[int],
                     identity: Mapping[str, Any] | None) -> None:
    """An evaluation step the run has already passed must still have its checkpoint, unless
    it was evaluated under this run identity (hy3rl.evalckpt.evaluated_steps): retention
    (``keep_eval_checkpoints: selected``) lets such a step go by design, and a rerun
    (unchanged, an operational change, an extension) must not be refused for it. One added
    to eval.steps after retention removed it, or whose evaluation is not done under this
    identity, cannot be evaluated."""
    from hy3rl.ckptdir import newest_complete, scan
    from hy3rl.evalckpt import evaluated_steps
    from hy3rl.layout import Layout

    ckpts = scan(ckpt_dir)
    best = newest_complete(ckpts)
    have = {c.step for c in ckpts if c.complete}
    traj = ((identity or {}).get("trajectory") or {}).get("id")
    done = set(evaluated_steps(cfg, Layout.from_config(cfg), traj)) if traj else set()
    gone = [s for s in steps
            if best is not None and s <= best.step and s not in have and s not in done]
    if gone:
        r.error("eval_steps_kept", f"eval.steps {gone}: no complete checkpoint of "
                f"{'these steps' if len(gone) > 1 else 'this step'} in {ckpt_dir} (newest "
                f"{best.step}; retention keeps train.checkpoint_keep and the eval.steps "
                "known when it ran) and no finished evaluation of "
                f"{'them' if len(gone) > 1 else 'it'} under this run identity: remove "
                f"{'them' if len(gone) > 1 else 'it'} from eval.steps")


def _eval_steps_saved(r: _Rules, cfg: Config, eff: Mapping[str, Any], trains: bool) -> None:
    save, total = to_int(eff.get("trainer.save_freq")), cfg.train.total_training_steps
    if not trains or save is None or save <= 0:
        return
    seg = cfg.train.segment_steps
    saved = set(range(save, total + 1, save)) | {total} | (
        set(range(seg, total + 1, seg)) if seg > 0 else set())
    bad = [x for x in cfg.eval.steps if x not in saved and x <= total]
    if bad:
        r.error("eval_steps_saved", f"eval.steps {bad}: verl saves no checkpoint at "
                f"{'these steps' if len(bad) > 1 else 'this step'} (trainer.save_freq = {save}"
                f"{f', segments of {seg}' if seg > 0 else ''}, last step {total}); use "
                "multiples of the save frequency")


SAVE_CONTENTS = "actor_rollout_ref.actor.checkpoint.save_contents"
DIST_CKPT = "actor_rollout_ref.actor.megatron.use_dist_checkpointing"


def writes_hf_weights(strategy: Any, contents: list[str], dist: bool) -> bool:
    """Whether verl@220e903 writes a checkpoint's HF weights (``<global_step_N>/actor/model/
    huggingface/``): the Megatron manager with ``hf_model`` in ``save_contents``, or ``model``
    without dist checkpointing (megatron_checkpoint_manager.py ``should_save_hf_model``);
    the FSDP manager only with ``hf_model``."""
    if "hf_model" in contents:
        return True
    return strategy == "megatron" and "model" in contents and not dist


def _hf_weights(r: _Rules, cfg: Config, eff: Mapping[str, Any], composed: Any,
                trains: bool) -> None:
    """hf_weights: the evaluation of checkpoints and the releases read each checkpoint's HF
    weights; a run whose verl settings write none would train for days and then have nothing
    to evaluate or release."""
    from hy3rl.release import ReleaseError, release_tags

    if not trains or composed is None:
        return
    readers = []
    if cfg.eval.steps:
        readers.append(f"eval.steps {cfg.eval.steps}")
    if cfg.eval.final:
        readers.append("eval.final")
    try:
        tags = release_tags(cfg)
    except ReleaseError:  # refused by name while the DAG is built
        tags = []
    if tags:
        readers.append(f"release.tags {tags}")
    raw = eff.get(SAVE_CONTENTS) or []
    contents = ([c.strip(" '\"") for c in raw.strip("[] ").split(",") if c.strip()]
                if isinstance(raw, str) else [str(c) for c in raw])
    strategy = eff.get("actor_rollout_ref.actor.strategy")
    dist = truthy(select(composed, DIST_CKPT))
    if not readers or writes_hf_weights(strategy, contents, dist):
        return
    r.error("hf_weights", f"{', '.join(readers)} read each checkpoint's Hugging Face weights "
            "(<checkpoint>/global_step_N/actor/model/huggingface/), but verl writes none with "
            f"{SAVE_CONTENTS} = {contents} and {DIST_CKPT} = {str(dist).lower()} (strategy "
            f"{strategy}: it writes them with hf_model in save_contents"
            + (", or model without dist checkpointing" if strategy == "megatron" else "")
            + f"); add hf_model to {SAVE_CONTENTS}")


def _selection(r: _Rules, cfg: Config, files: Mapping[str, Path | None] | None) -> None:
    from hy3rl.preflight import heldout

    if files is None or not files.get("val") or not files.get("train"):
        if cfg.eval.select is not None:
            r.not_run("selection", "not run: the data files were not given")
        return
    heldout.check(r, cfg, heldout=files.get("heldout"), val=Path(files["val"]),
                  train=Path(files["train"]))


def _ref_kl_zero(r: _Rules, eff: Mapping[str, Any]) -> None:
    if (truthy(eff.get("actor_rollout_ref.actor.use_kl_loss"))
            and to_float(eff.get("actor_rollout_ref.actor.kl_loss_coef")) == 0.0
            and not truthy(eff.get("algorithm.use_kl_in_reward"))):
        tbs = to_int(eff.get("data.train_batch_size"))
        n = to_int(eff.get("actor_rollout_ref.rollout.n"), 1)
        r.warn("ref_kl_zero", f"use_kl_loss=True with kl_loss_coef=0: verl builds the reference "
               f"model and computes its log-probs for all {tbs} x {n} = {tbs * n} responses "
               f"every step for a term multiplied by 0 (one extra forward pass per step and the "
               f"reference weights in memory); USE_KL_LOSS=False removes it")


def _val_on_resume(r: _Rules, eff: Mapping[str, Any], facts: Mapping[str, Any],
                   s: Shape) -> None:
    if truthy(eff.get("trainer.val_before_train")):
        rows = facts.get("val_rows")
        val_n = to_int(eff.get("actor_rollout_ref.rollout.val_kwargs.n"), 1)
        what = f"{rows} x {val_n} generations" if rows else f"the validation set x {val_n}"
        r.warn("val_on_resume", f"trainer.val_before_train=True: validation ({what}, up to "
               f"{s.response} tokens each) re-runs on every start, including each resume; add "
               f"trainer.val_before_train=false to train.verl_overrides to skip it")


def _prompts_over_max(r: _Rules, facts: Mapping[str, Any], s: Shape) -> None:
    over = facts.get("prompts_over_max")
    prompt = s.prompt
    if over:
        r.warn("prompts_over_max", f"{over} training prompts exceed max_prompt_length = {prompt} "
               f"tokens (data/summary.json); with data.truncation="
               f"{'left' if prompt else '?'} they are cut, losing part of the problem")
    elif over is None:
        r.not_run("prompts_over_max", "not run: no count in data/summary.json")


def _verl(r: _Rules, checks: list[VerlCheck]) -> None:
    """verl: verl's own validation (hy3rl.verl_checks); a check that could not run is an
    error as well (a missing requirement must not pass silently), waivable as ``verl``."""
    for c in checks:
        if c.status == FAIL:
            r.error("verl", f"{c.name}: verl raised {c.exception or 'an error'}: {c.message} "
                    f"(at {c.where or 'no frame inside the verl clone'})")
        elif c.status == NOT_RUN:
            r.error("verl", f"{c.name}: not run: {c.reason}; what this verl check catches would "
                    f"surface only after the allocation: install verl's requirements "
                    f"(./install.sh), or write `preflight.waive: [verl]` to go without it")


WAIVE_BRIDGE = "or write `preflight.waive: [bridge]` to launch without it"


def _bridge(r: _Rules, gpu: bool, doc: Mapping[str, Any] | None, path: Path | None) -> None:
    """bridge: a GPU run launches only after the bridge check passed in the training runtime;
    a check that is `not run` (a runtime without Transformer Engine) or `fail` stops it."""
    if not gpu:
        r.not_run("bridge", NO_GPU)
        return
    where = str(path) if path else "checks/bridge.json"
    if doc is None:
        r.error("bridge", f"{where} is missing: a GPU run needs the report of the bridge check "
                f"(rule check_bridge, run in the training runtime); {WAIVE_BRIDGE}")
        return
    checks = [c for c in doc.get("checks") or [] if isinstance(c, Mapping)]
    if not checks:
        r.error("bridge", f"{where} reports no checks: the HF <-> Megatron conversion of the "
                f"model is unverified in the training runtime; {WAIVE_BRIDGE}")
        return
    groups: dict[tuple[str, str], list[str]] = {}
    for c in checks:
        status = str(c.get("status"))
        if status == "pass":
            continue
        details = str(c.get("details") or "")
        details = details[len(status) + 2:] if details.startswith(f"{status}: ") else details
        groups.setdefault((status, details), []).append(str(c.get("name", "?")))
    if groups:
        bad = sum(len(names) for names in groups.values())
        parts = [f"{', '.join(names)} {status}" + (f" ({details})" if details else "")
                 for (status, details), names in groups.items()]
        r.error("bridge", f"{where}: {bad} of {len(checks)} bridge checks did not pass: "
                f"{'; '.join(parts)}. The HF <-> Megatron conversion of the model is unverified "
                f"in the training runtime (train.runtime): fix the runtime and rerun "
                f"check_bridge, {WAIVE_BRIDGE}")


def _reward_lengths(r: _Rules, eff: Mapping[str, Any], s: Shape) -> None:
    """overlong_buffer, reward_max_resp_len, overlong_buffer_window: the lengths of the DAPO
    reward manager (verl asserts ``max_resp_len >= overlong_buffer.len`` in its constructor,
    at trainer setup, after the actor model has loaded)."""
    kwargs = eff.get("reward.reward_kwargs")
    if not isinstance(kwargs, Mapping):
        return  # no reward kwargs (reward_mode scripted: verl's naive manager)
    mrl = kwargs.get("max_resp_len")
    if mrl is not None and to_int(mrl, -1) != s.response:
        r.error("reward_max_resp_len", f"reward.reward_kwargs.max_resp_len = {mrl} != "
                f"data.max_response_length = {s.response}: the overlong penalty would be "
                f"measured against a length the rollout does not generate to (the script sets "
                f"both from MAX_RESPONSE_LENGTH; check train.verl_overrides)")
    buf = kwargs.get("overlong_buffer_cfg")
    if not isinstance(buf, Mapping) or not truthy(buf.get("enable")):
        return
    length = to_int(buf.get("len"))
    fix = ("shorten the buffer (train.verl_overrides: "
           "++reward.reward_kwargs.overlong_buffer_cfg.len) or raise MAX_RESPONSE_LENGTH")
    if mrl is None:
        r.error("overlong_buffer", f"reward.reward_kwargs.overlong_buffer_cfg is enabled (len = "
                f"{length}) but reward.reward_kwargs.max_resp_len is not set: verl's DAPO reward "
                f"manager asserts it is, at trainer setup")
        return
    top = to_int(mrl)
    if length > top:
        r.error("overlong_buffer", f"reward.reward_kwargs.overlong_buffer_cfg.len = {length} > "
                f"reward.reward_kwargs.max_resp_len = {top}: verl's DAPO reward manager asserts "
                f"max_resp_len >= overlong_buffer.len only at trainer setup, after the model has "
                f"loaded on every GPU; {fix}")
    elif length <= 0:
        r.error("overlong_buffer", f"reward.reward_kwargs.overlong_buffer_cfg.len = {length} with "
                f"the buffer enabled: verl's DAPO reward manager asserts it is positive (disable "
                f"it with ++reward.reward_kwargs.overlong_buffer_cfg.enable=false)")
    elif 2 * length > top:
        r.warn("overlong_buffer_window", f"reward.reward_kwargs.overlong_buffer_cfg.len / "
               f"max_resp_len = {length} / {top} = {length / top:.2f} (over 1/2): every response "
               f"longer than {top} - {length} = {top - length} tokens is penalised, so the "
               f"penalty window covers most of the allowed length (published: 4096 / 8192 = "
               f"0.50); {fix}")


def _runtime_tag(r: _Rules, prefix: str) -> None:
    """runtime_tag: an image named by tag can move between runs, attempts and nodes."""
    try:
        tokens = shlex.split(prefix)
    except ValueError:
        tokens = prefix.split()
    for tok in tokens:
        if not tok.startswith("docker://") or "@sha256:" in tok:
            continue
        ref = tok[len("docker://"):]
        name, tag = (ref.rsplit(":", 1) if ":" in ref.rsplit("/", 1)[-1] else (ref, ""))
        what = f"tag {tag!r}" if tag else "no tag (Docker's implicit 'latest')"
        r.warn("runtime_tag", f"train.runtime.prefix names the image {tok} by {what}: a tag can "
               f"move, so a resume, a rerun or check_bridge may get a different image than the "
               f"one checked; pin the digest (docker://{name}@sha256:<digest>) or a local .sif "
               f"file (see config/paper.yaml)")


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "shared", "run")
WANDB_NO_KEY_MODES = ("offline", "disabled", "dryrun")
WANDB_DEFAULT_URL = "https://api.wandb.ai"


def netrc_path(environ: Mapping[str, str]) -> Path:
    """The netrc file W&B reads its key from: ``$NETRC``, else ``~/.netrc``."""
    return Path(environ.get("NETRC") or "~/.netrc").expanduser()


def _wandb(r: _Rules, loggers: list[str], trains: bool, environ: Mapping[str, str]) -> None:
    """wandb: verl's Tracking calls ``wandb.init`` when the trainer starts, after the
    allocation; without a key (and not offline) it fails there, on every attempt (``trains``:
    the run trains, on GPUs or on the CPU path). Read from
    this environment, which the training job inherits (sbatch exports it; the launcher
    passes the WANDB_* names to the Ray job)."""
    if not wandb_run.enabled(loggers):
        return
    if not trains:
        r.not_run("wandb", NO_GPU)
        return
    mode = environ.get("WANDB_MODE", "")
    if mode and mode not in WANDB_MODES:
        r.error("wandb", f"WANDB_MODE={mode!r} is not a W&B mode ({', '.join(WANDB_MODES)}): "
                "wandb.init refuses it when the trainer starts")
        return
    if mode in WANDB_NO_KEY_MODES or environ.get("WANDB_API_KEY"):
        return
    url = environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL
    host = urlsplit(url).netloc or url
    path = netrc_path(environ)
    try:
        entry = netrc.netrc(path).authenticators(host)
    except FileNotFoundError:
        found = f"there is no {path}"
    except netrc.NetrcParseError as exc:  # its message can quote a key: only the line
        found = f"{path} cannot be parsed (line {exc.lineno})"
    except OSError as exc:
        found = f"{path} cannot be read ({exc.strerror})"
    else:
        if entry and entry[2]:
            return
        found = f"{path} has no key for {host}"
    r.error("wandb", f"trainer.logger includes wandb, but the training job would have no W&B "
            f"key: WANDB_API_KEY is not set, {found}, and WANDB_MODE is "
            f"{repr(mode) if mode else 'not set'}. verl's wandb.init would fail when the "
            f"trainer starts, after the allocation. Export WANDB_API_KEY (the launcher passes "
            f"it to the Ray job), run `wandb login`, set WANDB_MODE=offline, or leave wandb "
            f"out of train.loggers")


def _with_waivers(r: _Rules, waive: list[str]) -> list[RuleResult]:
    """Every rule in RULES order: pass unless recorded; a waived error or warning shows as
    waived (the schema refuses unknown names and `compose`)."""
    out = []
    for name in RULES:
        res = r.results.get(name, RuleResult(name, "pass", []))
        if name not in NOT_WAIVABLE and res.status in ("error", "warning") and name in waive:
            res.status = "waived"
        out.append(res)
    return out


# --------------------------------------------------------------------------- entry points


def check_rules(cfg: Config, res: Resolution, eff: Mapping[str, Any],
                facts: Mapping[str, Any], ckpt_check: Mapping[str, Any] | None,
                weights: int | None, weights_from: str, *, verl_checks: list[VerlCheck],
                bridge: Mapping[str, Any] | None, bridge_path: Path | None,
                environ: Mapping[str, str] | None = None,
                identity: dict[str, Any] | None = None,
                data_files: Mapping[str, Path | None] | None = None,
                ) -> tuple[list[RuleResult], dict]:
    """Every rule on the composed values, verl's own checks (``verl_checks``) and the bridge
    check's report (``bridge``, read from ``bridge_path``; None when absent); returns the
    results and the checkpoint facts. ``environ`` (default: this process's) is the
    environment the training job inherits. ``data_files``: the ``train``, ``val`` and
    ``heldout`` parquet files (the selection rule; not run without them)."""
    r = _Rules()
    s = Shape.of(cfg.cluster, eff, cfg.trains)
    _numbers(r, eff)
    _knobs(r, res)
    _owned_keys(r, res)
    _verl(r, verl_checks)
    _checkpoint_checks(r, ckpt_check)
    _bridge(r, s.gpu, bridge, bridge_path)
    _allocation(r, cfg.cluster, eff, s, weights, weights_from)
    _cpu_path(r, cfg, res, eff)
    _token_budgets(r, eff, s)
    _reward_lengths(r, eff, s)
    _micro_batch(r, eff, s)
    _batch_divisible(r, eff, s)
    _steps_and_frequencies(r, eff)
    _checkpoint_root(r, cfg)
    _async_save(r, eff)
    ck = _disk(r, cfg, eff, Path(res.checkpoint_dir), weights, weights_from)
    _segment_schedule(r, cfg.train.segment_steps, eff)
    _run_identity(r, Path(res.checkpoint_dir), identity, eff)
    if ((identity or {}).get("decision") or {}).get("action") not in ("fresh", "refuse"):
        _eval_steps_kept(r, cfg, Path(res.checkpoint_dir),
                         cfg.eval_keep_steps if s.trains else [], identity)
    beyond = [x for x in cfg.eval_keep_steps if x > cfg.train.total_training_steps]
    if s.trains and beyond:
        r.error("eval_steps_kept", f"eval.steps {beyond}: beyond train.total_training_steps "
                f"= {cfg.train.total_training_steps}, no such checkpoint will exist")
    _eval_steps_saved(r, cfg, eff, s.trains)
    _hf_weights(r, cfg, eff, res.composed, s.trains)
    _selection(r, cfg, data_files)
    _ref_kl_zero(r, eff)
    _val_on_resume(r, eff, facts, s)
    _prompts_over_max(r, facts, s)
    _runtime_tag(r, cfg.train.runtime.prefix)
    _wandb(r, res.loggers, s.trains, os.environ if environ is None else environ)
    _rehearsal(r, s.gpu, cfg.preflight.waive)
    return _with_waivers(r, cfg.preflight.waive), ck


def _rehearsal(r: _Rules, gpu: bool, waive: list[str]) -> None:
    """The gate is on unless waived: a waiver is the knowing choice to spend the allocation
    on a stack nothing ran before (the rule shows `waived` in the plan)."""
    if not gpu:
        r.not_run("rehearsal", NO_GPU)
    elif "rehearsal" in waive:
        r.error("rehearsal", "the train job starts without the one-node rehearsal: vLLM, "
                "the reward, a step, a save and a resume in the training runtime run first "
                "on the whole allocation")


def not_composed(res: Resolution) -> list[RuleResult]:
    """The rules when the overrides do not compose: compose (and knobs) in error, the rest
    not run."""
    rules = [RuleResult(n, "not run", ["not run: the config did not compose"]) for n in RULES]
    rules[list(RULES).index("compose")] = RuleResult(
        "compose", "error", [res.compose_error or "not composed"])
    if res.knob_errors:
        rules[list(RULES).index("knobs")] = RuleResult("knobs", "error", res.knob_errors)
    return rules


def check_health_metrics(rules: list[RuleResult], cfg: Config, verl_dir: Path,
                         eff: Mapping[str, Any],
                         summary: Mapping[str, Any] | None = None) -> None:
    """health_metrics: the watched metrics are logged by the verl clone at ``verl_dir`` with
    the composed values ``eff``, and the validation key names a data source of the
    validation set (``summary``: data/summary.json; not checked without it) and the composed
    responses per prompt (hy3rl.health.metric_problems; set in ``rules`` in place)."""
    val = (((summary or {}).get("splits") or {}).get("val") or {}) if summary else None
    sources = (val or {}).get("data_sources")
    problems = metric_problems(
        cfg.train.health, verl_dir, truthy(eff.get(ROLLOUT_LOG_PROBS)),
        bypass_mode=truthy(eff.get(BYPASS_MODE)),
        val_sources=list(sources) if isinstance(sources, Mapping) else None,
        val_n=eff.get(VAL_N))
    if problems:
        rules[list(RULES).index("health_metrics")] = RuleResult(
            "health_metrics", "error", problems)


def check_pins_clean(rules: list[RuleResult], trees: Mapping[str, Mapping[str, Any]],
                     allow: bool) -> None:
    """pins_clean (set in ``rules`` in place): ``trees`` is each clone's
    :func:`hy3rl.deps.tree_state` with its ``path``. A clone with local changes is an error
    naming its files, or with ``deps.allow_local_changes`` a warning naming the diff's
    sha256, which the run identity counts (``pin.<name>``)."""
    errors, warnings = [], []
    for name, tree in sorted(trees.items()):
        changes = list(tree.get("changes") or [])
        if not changes:
            continue
        shown = ", ".join(changes[:10]) + (f", ... ({len(changes)} in all)"
                                           if len(changes) > 10 else "")
        if allow:
            warnings.append(f"{name}: {tree['path']} runs with local changes ({shown}); "
                            f"deps.allow_local_changes counts them in the run identity "
                            f"(pin.{name} with diff sha256 {tree['diff_sha256']})")
        else:
            errors.append(f"{name}: {tree['path']} differs from its pin {tree.get('head')} "
                          f"({shown}): the Ray job would upload and run these changes, which "
                          f"no pin records. Restore the clone (`git -C {tree['path']} "
                          f"checkout -- . && git -C {tree['path']} clean -fd`), or set "
                          f"deps.allow_local_changes: true to run them, counted in the run "
                          f"identity")
    if errors or warnings:
        rules[list(RULES).index("pins_clean")] = RuleResult(
            "pins_clean", "error" if errors else "warning", errors + warnings)


def check_verl_pin(rules: list[RuleResult], verl_dir: Path, head: str | None, commit: str,
                   waive: list[str]) -> None:
    """verl_pin: the clone's HEAD is the locked commit (set in ``rules`` in place)."""
    if head == commit:
        return
    rules[list(RULES).index("verl_pin")] = RuleResult(
        "verl_pin", "waived" if "verl_pin" in waive else "error",
        [f"{verl_dir} is at {head}, deps/lock.json says {commit}: rerun rule deps"])
