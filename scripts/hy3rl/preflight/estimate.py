"""The GPU-hour estimate of a run (formula in docs/formats/preflight.md) and the compute
cost it puts on the warnings whose cost is compute (``ref_kl_zero``, ``val_on_resume``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hy3rl.preflight.rules import RuleResult, to_float, to_int, truthy
from hy3rl.settings import Config

# Dense BF16 peak TFLOPS by GPU type (vendor datasheets), for the GPU-hour estimate.
GPU_TFLOPS = {"h20": 148.0, "h100": 989.0, "h800": 989.0, "h200": 989.0, "a100": 312.0,
              "a800": 312.0, "b200": 2250.0, "l40s": 362.0}

FORMULA = ("tokens/step T = train_batch_size x n x (mean_prompt + f x max_response); "
           "train FLOPs = (6 + 2 old-log-prob + 2 ref if KL loss) x active_params x T; "
           "rollout FLOPs = 2 x active_params x T; step_s = train FLOPs / (G x peak x "
           "train_mfu) + rollout FLOPs / (G x peak x rollout_mfu); validation_s = 2 x "
           "active_params x val_rows x val_n x (mean_prompt + f x max_response) / (G x peak "
           "x rollout_mfu), run every test_freq steps plus once per start with "
           "val_before_train; GPU-hours = G x (steps x step_s + validations x validation_s) "
           "/ 3600")

NOT_COMPOSED = {"gpu_hours": None, "reason": "not composed"}


def estimate_gpu_hours(cfg: Config, eff: Mapping[str, Any], facts: Mapping[str, Any],
                       weights: int | None) -> dict[str, Any]:
    """GPU-hours of the run (formula in docs/formats/preflight.md)."""
    est, cluster = cfg.preflight.estimate, cfg.cluster
    gpus = cluster.nodes * cluster.gpus_per_node
    gpu_type = cluster.gpu_type.lower()
    tflops = est.gpu_tflops or GPU_TFLOPS.get(gpu_type, 0.0)
    active = est.active_params_b * 1e9
    if not active and weights:
        active = weights / 2  # dense BF16 model: every parameter is active
    if gpus <= 0 or tflops <= 0 or not active:
        return {"gpu_hours": None, "formula": FORMULA,
                "reason": f"not estimated: GPUs = {gpus}, peak TFLOPS = {tflops} "
                          f"(cluster.gpu_type {gpu_type!r} or preflight.estimate.gpu_tflops), "
                          f"active params = {active:g}"}
    peak = tflops * 1e12
    f = est.mean_response_fraction
    prompt_mean = to_float(facts.get("mean_prompt_tokens")) or to_float(
        eff.get("data.max_prompt_length")) / 4
    resp = to_float(eff.get("data.max_response_length"))
    tbs = to_int(eff.get("data.train_batch_size"))
    n = to_int(eff.get("actor_rollout_ref.rollout.n"))
    tokens = tbs * n * (prompt_mean + f * resp)
    ref = 2 if truthy(eff.get("actor_rollout_ref.actor.use_kl_loss")) else 0
    train_mfu, rollout_mfu = est.train_mfu, est.rollout_mfu
    step_s = ((6 + 2 + ref) * active * tokens / (gpus * peak * train_mfu)
              + 2 * active * tokens / (gpus * peak * rollout_mfu))
    steps = to_int(eff.get("trainer.total_training_steps"))
    val_rows = to_float(facts.get("val_rows")) or 0.0
    val_n = to_int(eff.get("actor_rollout_ref.rollout.val_kwargs.n"), 1)
    val_s = 2 * active * val_rows * val_n * (prompt_mean + f * resp) / (gpus * peak * rollout_mfu)
    test = to_int(eff.get("trainer.test_freq"))
    seg = cfg.train.segment_steps
    segments = -(-steps // seg) if seg > 0 and steps > 0 else 1  # each segment is a start
    starts = max(1, est.starts, segments)
    vals = (steps // test if test > 0 else 0) + (
        starts if truthy(eff.get("trainer.val_before_train")) else 0)
    hours = gpus * (steps * step_s + vals * val_s) / 3600
    ref_s = ref * active * tokens / (gpus * peak * train_mfu)  # the reference forward pass
    return {
        "gpu_hours": round(hours, 1), "wall_hours": round(hours / gpus, 2), "formula": FORMULA,
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
