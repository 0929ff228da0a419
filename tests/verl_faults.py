"""Faults injected into the pinned verl's own trainer (verl@220e903) for the real-trainer tier
(tests/test_real_verl.py): a TEST module, never the product's. verl imports it in every one
of its processes through its own plugin hook, as it imports the CPU path
(``VERL_USE_EXTERNAL_MODULES=hy3rl.verl_cpu,verl_faults``, with ``tests/`` on the Ray
cluster's PYTHONPATH); without ``$HY3RL_VERL_FAULTS``, or outside a training job's
processes, it does nothing. Nothing of verl's
source is edited: the hooks wrap verl's own functions in memory.

Faults, from the JSON file named by ``$HY3RL_VERL_FAULTS`` (the names of the trainer
double's, tests/fixtures/trainer_double.py, where both exist):

- ``die_mid_save: k`` (once): the trainer process dies in the middle of step k's save,
  after the actor's shards are written and before verl's ``data.pt`` and its
  ``latest_checkpointed_iteration.txt`` (the driver's part of
  ``verl/trainer/ppo/v1/trainer_base.py`` ``_save_checkpoint``), as a node lost mid-save
  leaves it;
- ``nan_loss_from: k`` (persistent): the policy loss is NaN from step k on, through a hook on
  the loss verl's FSDP engine computes (``verl/workers/utils/losses.py`` ``ppo_loss`` calls
  ``get_policy_loss_fn``): verl's engine skips the optimizer step on a non-finite gradient
  norm and its file logger writes the NaN ``actor/pg_loss`` and ``actor/grad_norm`` as
  ``null``;
- ``hang_at: k`` (once): the trainer stops at the start of step k and never goes on (its
  processes live, nothing is printed).

The step: the driver writes ``global_steps`` to ``<faults file>.step`` at every step's
start (``PPOTrainer.on_step_begin``); the workers (another process, the same host on the CPU
path) read it. A fault fired once leaves ``<faults file>.<name>.taken``.
"""

from __future__ import annotations

import importlib.abc
import json
import math
import os
import sys
import time
from pathlib import Path

ENV = "HY3RL_VERL_FAULTS"


def _faults() -> Path | None:
    path = os.environ.get(ENV)
    return Path(path) if path else None


def _read() -> dict:
    path = _faults()
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def _state(name: str) -> Path:
    path = _faults()
    assert path is not None
    return path.with_name(f"{path.name}.{name}")


def current_step() -> int | None:
    try:
        return int(_state("step").read_text())
    except (OSError, ValueError):
        return None


def _take(kind: str, step: int) -> bool:
    """Whether the once-only fault ``kind`` fires at ``step`` (and marks it taken)."""
    if _read().get(kind) != step or _state(f"{kind}.taken").exists():
        return False
    _state(f"{kind}.taken").write_text(str(step))
    return True


def _say(text: str) -> None:
    print(f"[verl_faults] {text}", file=sys.stderr, flush=True)


def _hook_driver(trainer_base) -> None:
    trainer = trainer_base.PPOTrainer
    step_begin, save = trainer.on_step_begin, trainer._save_checkpoint

    def on_step_begin(self):
        _state("step").write_text(str(self.global_steps))
        if _take("hang_at", self.global_steps):
            _say(f"hang_at {self.global_steps}: the trainer stops here")
            while True:
                time.sleep(3600)
        return step_begin(self)

    def _save_checkpoint(self):
        if not _take("die_mid_save", self.global_steps):
            return save(self)
        real_save = trainer_base.torch.save

        def torch_save(obj, f, *args, **kwargs):
            if str(f).endswith("data.pt"):
                _say(f"die_mid_save {self.global_steps}: the actor's shards are written; "
                     "dying before data.pt")
                os._exit(17)
            return real_save(obj, f, *args, **kwargs)

        trainer_base.torch.save = torch_save
        try:
            return save(self)
        finally:
            trainer_base.torch.save = real_save

    trainer.on_step_begin, trainer._save_checkpoint = on_step_begin, _save_checkpoint


def _hook_loss(losses) -> None:
    get = losses.get_policy_loss_fn

    def get_policy_loss_fn(loss_mode):
        fn = get(loss_mode)

        def policy_loss(*args, **kwargs):
            pg_loss, metrics = fn(*args, **kwargs)
            start, step = _read().get("nan_loss_from"), current_step()
            if start is not None and step is not None and step >= start:
                _say(f"nan_loss_from {start}: step {step}'s policy loss is NaN")
                pg_loss = pg_loss * math.nan
            return pg_loss, metrics

        return policy_loss

    losses.get_policy_loss_fn = get_policy_loss_fn


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` once verl itself has imported ``name``: importing verl's
    modules here, while verl's plugin hook loads this module, would run their import-time
    code (the platform lookup) before the CPU path's platform is registered."""

    def __init__(self, hooks: dict) -> None:
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            hook(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    hooks = {"verl.trainer.ppo.v1.trainer_base": _hook_driver,
             "verl.workers.utils.losses": _hook_loss}
    for name in [n for n in hooks if n in sys.modules]:
        hooks.pop(name)(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(hooks))


# Only in the processes of a training job (the launch sets VERL_FILE_LOGGER_PATH in the Ray
# job's runtime env): other processes that import verl with this environment (preflight runs
# verl's own validators) are left alone.
if _faults() is not None and os.environ.get("VERL_FILE_LOGGER_PATH"):
    install()
