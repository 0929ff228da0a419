"""The CPU path's launch: the pinned script's overrides moved from verl's Megatron engine to
its FSDP engine, and the overrides a CPU needs. Pure data and functions (verl is not
imported): preflight composes the result with the pinned verl's Hydra config like any other
plan, and records every dropped and added override with its reason.

The paper's launch (examples/grpo_trainer/run_hy_v3_megatron.sh) selects ``model_engine=
megatron`` and sets the Megatron layout under ``actor_rollout_ref.{actor,ref}.megatron.*``;
on a CPU verl's ``dp`` engine (FSDP2 on gloo) trains instead, so the group choice becomes
``model_engine=dp`` and each Megatron-only override, which names a key the FSDP engine's
config does not have, is dropped. Everything else of the script (the algorithm, the
clipping, the reward, the batch and length knobs the config sets) is kept as scripted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ENGINE = "dp"  # verl/trainer/config/model_engine/dp.yaml: the FSDP engine
CPU_PATH = "cpu path"  # the source of a value (docs/formats/preflight.md)


@dataclass(frozen=True)
class CpuOverride:
    key: str
    value: str  # Hydra's override grammar
    why: str  # with the verl line it works around


def overrides(ranks: int) -> tuple[CpuOverride, ...]:
    """What the CPU path sets, after the script and the workflow's corrections (before
    ``train.verl_overrides``, which still win)."""
    return (
        CpuOverride("trainer.device", "cpu",
                    "verl/trainer/config/ppo_trainer.yaml trainer.device: cuda"),
        CpuOverride("trainer.n_gpus_per_node", str(ranks),
                    "trainer ranks on the host (train.cpu.ranks); Ray counts each as a GPU "
                    "(verl/single_controller/ray/base.py bundles ask for GPU: 1)"),
        CpuOverride("trainer.nnodes", "1", "the CPU path runs on one host"),
        CpuOverride("actor_rollout_ref.rollout.name", "hf",
                    "only vllm/sglang/trtllm are registered (verl/workers/rollout/replica.py); "
                    "hy3rl.verl_cpu.rollout registers hf"),
        CpuOverride("actor_rollout_ref.rollout.tensor_model_parallel_size", "1",
                    "the hf rollout is one process"),
        CpuOverride("actor_rollout_ref.actor.strategy", "fsdp2",
                    "FSDP1 wraps with device_id=get_device_id() (verl/workers/engine/fsdp/"
                    "transformer_impl.py), which a CPU has not"),
        CpuOverride("actor_rollout_ref.ref.strategy", "fsdp2", "as the actor's"),
        CpuOverride("+actor_rollout_ref.model.override_config.attn_implementation", "sdpa",
                    "verl/workers/config/model.py defaults to flash_attention_2 (CUDA only)"),
        CpuOverride("actor_rollout_ref.model.use_fused_kernels", "false",
                    "the script's fused kernels are Triton (GPU only)"),
        CpuOverride("transfer_queue.backend.SimpleStorage.num_data_storage_units", "1",
                    "ppo_trainer.yaml's 8 storage units each take a CPU of the Ray cluster"),
        CpuOverride("actor_rollout_ref.rollout.agent.num_workers", "1",
                    "rollout.yaml's 8 agent-loop workers are 8 Ray actor processes, each "
                    "importing torch and verl, for one host's generation"),
        CpuOverride("reward.num_workers", "1",
                    "reward.yaml's 8 reward-loop workers, likewise (the tiny batch scores in "
                    "milliseconds)"),
        CpuOverride("data.dataloader_num_workers", "0",
                    "legacy_data.yaml's 8 dataloader processes for a few hundred rows on 2 "
                    "cores"),
        CpuOverride("actor_rollout_ref.actor.checkpoint.save_contents",
                    "[model,optimizer,extra,hf_model]",
                    "the FSDP checkpoint holds HF weights only with hf_model "
                    "(verl/utils/checkpoint/fsdp_checkpoint_manager.py): evaluation reads them"),
    )


def is_megatron_only(key: str) -> bool:
    return ".megatron." in f".{key}." or key.startswith("megatron.")


def move_to_fsdp(items: list, has_key: Callable[[str], bool], split) -> tuple[list, list]:
    """The script's overrides for the FSDP engine: ``model_engine=megatron`` becomes
    ``model_engine=dp`` in place; an override of a key the FSDP engine's config lacks (every
    ``*.megatron.*`` key, ``optim.min_lr``) is dropped. ``items`` have ``.text``;
    ``has_key(key)`` answers for the config composed with ``model_engine=dp``. Returns
    (kept, dropped) with each dropped item's reason."""
    kept, dropped = [], []
    for item in items:
        prefix, key, _value = split(item.text)
        if key == "model_engine":
            kept.append((item, f"model_engine={ENGINE}"))
        elif is_megatron_only(key):
            dropped.append((item, "Megatron engine only"))
        elif prefix != "+" and not has_key(key):
            dropped.append((item, f"not a key of the {ENGINE} engine's config"))
        else:
            kept.append((item, None))
    return kept, dropped
