"""Every workaround the CPU path makes for verl@220e903, each with the verl line it works
around. ``WORKAROUNDS`` is the record: the file and the exact text at the pin that makes the
workaround necessary. tests/test_verl_cpu.py holds each to the pinned clone (the text still
there: the workaround still needed) and the real-trainer tier shows them enough (verl trains).
``apply()`` makes the few that are code; the others are overrides or environment
(``hy3rl.verl_cpu.OVERRIDES``, ``hy3rl.verl_cpu.ENV``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    name: str
    verl_file: str  # relative to the verl clone
    verl_text: str  # the text at the pin that makes the workaround necessary
    cause: str
    remedy: str


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "platform", "verl/plugin/platform/platform_manager.py",
        "Falling back to 'nvidia'",
        "only cuda, npu and rocm platforms are registered; with none available verl picks nvidia",
        "hy3rl.verl_cpu.platform registers a 'cpu' platform; VERL_PLATFORM=cpu chooses it"),
    Workaround(
        "engine_registry", "verl/workers/engine/fsdp/transformer_impl.py",
        'backend=["fsdp", "fsdp2"], device=["cuda", "npu"]',
        "the FSDP engine is registered for cuda and npu only",
        "VERL_ENGINE_DEVICE=cuda, VERL_ENGINE_VENDOR=nvidia (verl/workers/engine/base.py "
        "get_engine_cls honours them): the same FSDP engine, on the cpu platform's device"),
    Workaround(
        "process_group", "verl/utils/distributed.py",
        'backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"',
        "on a cpu device the backend string names cpu twice (cpu:gloo,cpu:gloo), which "
        "torch.distributed rejects",
        "init_process_group is given each device's backend once (apply())"),
    Workaround(
        "rollout_replica", "verl/workers/rollout/replica.py",
        'RolloutReplicaRegistry.register("trtllm", _load_trtllm)',
        "only vllm, sglang and trtllm rollout replicas are registered",
        "hy3rl.verl_cpu.rollout registers an 'hf' replica and server adapter "
        "(actor_rollout_ref.rollout.name=hf)"),
    Workaround(
        "rollout_adapter", "verl/workers/rollout/base.py",
        '("trtllm", "async"): "verl.workers.rollout.trtllm_rollout.trtllm_rollout.ServerAdapter"',
        "the hybrid worker finds its rollout adapter only among vllm, sglang and trtllm",
        "hy3rl.verl_cpu.rollout adds ('hf', 'async') to _ROLLOUT_REGISTRY"),
    Workaround(
        "pin_memory", "verl/workers/engine/fsdp/transformer_impl.py",
        "offload_policy = CPUOffloadPolicy(pin_memory=True)",
        "the reference model (forward only) is always wrapped with a pinned-memory offload "
        "policy; pinning needs an accelerator",
        "torch's CPUOffloadPolicy pins nothing in verl's processes on the CPU path (apply()): "
        "the parameters already live on the host"),
)


def _dedup_backend(backend):
    """``cpu:gloo,cpu:gloo`` -> ``cpu:gloo``: each device named once, order kept."""
    if not isinstance(backend, str) or "," not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.partition(":")
        seen.setdefault(device.strip(), name.strip())
    return ",".join(f"{d}:{b}" for d, b in seen.items())


def _unpinned_offload() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    if getattr(CPUOffloadPolicy.__init__, "_hy3rl_cpu", False):
        return
    original = CPUOffloadPolicy.__init__

    def __init__(self, pin_memory: bool = True, *args, **kwargs):
        original(self, False, *args, **kwargs)

    __init__._hy3rl_cpu = True
    CPUOffloadPolicy.__init__ = __init__


def apply() -> None:
    """The workarounds that are code (idempotent)."""
    import torch.distributed as dist

    _unpinned_offload()

    if getattr(dist.init_process_group, "_hy3rl_cpu", False):
        return
    original = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = _dedup_backend(kwargs["backend"])
        return original(_dedup_backend(backend), *args, **kwargs)

    init_process_group._hy3rl_cpu = True
    dist.init_process_group = init_process_group
