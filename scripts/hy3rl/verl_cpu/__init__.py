"""The CPU path: the pinned verl (verl@220e903) training GRPO on a machine without an
accelerator, for the embedded default and the test suite's real-trainer tier.

THIS IS NOT THE PAPER'S STACK. The paper run trains with Megatron on GPUs and generates with
vLLM; here verl's own v1 trainer runs its FSDP2 engine on gloo and generates with
transformers. Nothing of verl's source is edited: verl imports this package in every one of
its processes through its own plugin hook (``VERL_USE_EXTERNAL_MODULES=hy3rl.verl_cpu``,
read by ``verl/__init__.py``), and this package registers what verl lacks for a CPU:

- a ``cpu`` platform (``hy3rl.verl_cpu.platform``), chosen with ``VERL_PLATFORM=cpu``;
- an ``hf`` rollout (``hy3rl.verl_cpu.rollout``): a Ray actor that generates with
  transformers from the actor's current weights, taken at each weight sync.

Each workaround names the verl line it works around (``WORKAROUNDS``); the tests hold every
one of them to the pinned clone, so a moved pin that no longer needs one, or needs another,
fails by name. What a CPU run proves and what only GPUs show: docs/formats/train.md.
"""

from __future__ import annotations

import os

from hy3rl.verl_cpu.workarounds import WORKAROUNDS  # noqa: F401  (re-exported)

# The environment verl's processes need on the CPU path: the plugin hook itself, the platform,
# and the engine registry's device (verl/workers/engine/base.py get_engine_cls honours
# VERL_ENGINE_DEVICE; FSDP is registered for cuda/npu only: workarounds.WORKAROUNDS).
ENV = {
    "VERL_USE_EXTERNAL_MODULES": "hy3rl.verl_cpu",
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_ENGINE_VENDOR": "nvidia",
}


def _register() -> None:
    """Called when verl imports this package (VERL_USE_EXTERNAL_MODULES): the platform and
    the ``hf`` rollout become known to verl's registries. Outside verl it does nothing."""
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != "cpu":
        return
    from hy3rl.verl_cpu import (
        platform,  # noqa: F401  (registers itself)
        rollout,
        workarounds,
    )

    workarounds.apply()
    rollout.register()


_register()
