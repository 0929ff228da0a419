"""verl's ``cpu`` platform: the device is the host, the process group is gloo, and Ray's
``GPU`` resource stands for a training slot (Ray is started with as many logical GPUs as
the run has trainer ranks). Registered with verl's own ``PlatformRegistry`` and chosen by
``VERL_PLATFORM=cpu`` (verl/plugin/platform/platform_manager.py ``_detect_platform_name``
falls back to ``nvidia`` where none is named)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _noop(*_args, **_kwargs) -> None:
    return None


class _HostMemory:
    """verl asks its device module for memory figures (``memory_allocated``,
    ``max_memory_reserved``, ``mem_get_info`` ...) to log them; on the host they are the
    process's resident set and the machine's free memory, from psutil."""

    @staticmethod
    def rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    @staticmethod
    def mem_get_info(*_args) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total


def _device_module() -> SimpleNamespace:
    """The module verl calls ``get_torch_device()`` for: torch.cpu's own functions where it
    has them, the memory figures of the host, and no-ops for the allocator and the caches
    (a CPU has no caching allocator to empty)."""
    rss = _HostMemory.rss
    return SimpleNamespace(
        current_device=lambda: "cpu",  # verl moves modules with .to(get_device_id())
        device_count=lambda: 1,
        set_device=_noop,
        is_available=lambda: True,
        is_initialized=lambda: True,
        synchronize=_noop,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        empty_cache=_noop,
        ipc_collect=_noop,
        reset_peak_memory_stats=_noop,
        reset_max_memory_allocated=_noop,
        memory_allocated=lambda *_a: rss(),
        max_memory_allocated=lambda *_a: rss(),
        memory_reserved=lambda *_a: rss(),
        max_memory_reserved=lambda *_a: rss(),
        mem_get_info=_HostMemory.mem_get_info,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        get_device_name=lambda *_a: "cpu",
        Stream=torch.cpu.Stream,
        Event=torch.cpu.Event,
        current_stream=torch.cpu.current_stream,
        stream=torch.cpu.stream,
        set_per_process_memory_fraction=_noop,
        memory=SimpleNamespace(_set_allocator_settings=_noop),
    )


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """The host as verl's device (the CPU path; never the paper's stack)."""

    _module = None

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        if PlatformCPU._module is None:
            PlatformCPU._module = _device_module()
        return PlatformCPU._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
