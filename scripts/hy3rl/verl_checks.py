"""verl's own validation of the composed launch, run on CPU before any GPU is allocated.

verl validates its configuration itself: ``main_ppo`` calls ``validate_config``, and the
workers and the v1 trainer convert config sections to verl's dataclasses
(``verl.utils.config.omega_conf_to_dataclass``), whose ``__post_init__`` asserts and raises.
The reward loop constructs the configured reward manager, whose constructor asserts too
(DAPO: ``max_resp_len >= overlong_buffer_cfg.len``). On a real run all of this happens at
trainer setup, after the actor model has loaded on 128 GPUs. :func:`run_verl_checks` runs the
same calls on the composed config, on CPU, in a subprocess with the pinned verl clone first on
``PYTHONPATH``, and returns one :class:`VerlCheck` a call:

- ``validate_config``: ``main_ppo.main``: ``auto_set_device``, then ``validate_config(config,
  use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))``;
- then, after ``OmegaConf.resolve`` (as ``TaskRunnerV1.run``), the conversions of
  ``ActorRolloutRefWorker`` (``verl/workers/engine_workers.py``) and the v1 trainer
  (``verl/trainer/ppo/v1/trainer_base.py``): ``actor_rollout_ref.model`` (HFModelConfig: loads
  the model's HF config and tokenizer from ``model_dir``), ``.actor``, ``.actor.profiler``,
  ``.ref`` (when the run uses a reference policy; renamed the way ``init_model`` renames it),
  ``.rollout``, ``.rollout.checkpoint_engine``, ``critic`` (when ``need_critic``) and
  ``distillation`` (when enabled);
- ``reward_manager``: ``verl.trainer.ppo.reward.load_reward_manager(config, tokenizer)`` as
  ``RewardLoopWorker._init_reward_fn`` calls it (the class from verl's registry: for ``dapo``
  ``verl/experimental/reward_loop/reward_manager/dapo.py``), with the model's own tokenizer
  (verl's ``hf_tokenizer``, i.e. ``AutoTokenizer``, from ``model_dir``).

At verl@220e903 ``data`` and ``trainer`` have no dataclass; ``algorithm`` (AlgoConfig, no
``__post_init__``), ``reward`` (RewardConfig, which lacks the ``reward_kwargs`` and
``custom_reward_function`` keys the section carries) and ``global_profiler``/``skip`` are never
converted on the v1 path, so they are not converted here either (converting them would report
errors verl never raises).

A check is ``pass``, ``fail`` (verl raised: ``message`` is verl's message, ``where`` the
innermost ``file:line`` inside the verl tree) or ``not run`` (``reason``: a module that does not
import, naming it; a section the composed config lacks; the runner stopped). A missing
requirement is ``not run``, never skipped silently.

This file is also the subprocess's runner (``python -P verl_checks.py --out FILE``, the payload
as JSON on stdin), so its module level imports the standard library only.
"""

from __future__ import annotations

import argparse
import copy
import json
import linecache
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PASS = "pass"
FAIL = "fail"
NOT_RUN = "not run"
RUNNER = "verl_checks"  # the name of the one check reported when the runner itself fails


@dataclass
class VerlCheck:
    """One of verl's own validations, run on the composed config (JSON-serialisable via
    ``dataclasses.asdict``)."""

    name: str  # the section converted ("actor_rollout_ref.actor") or the call ("validate_config")
    status: str  # pass | fail | not run
    message: str = ""  # fail: verl's message; pass: what was built (the dataclass / class)
    where: str = ""  # fail: innermost verl file:line (relative to the clone), "" if none
    reason: str = ""  # not run: why (the ImportError naming the module, a missing section ...)
    exception: str = ""  # fail / not run: the exception's class name
    verl_call: str = ""  # the verl call this mirrors, and where verl makes it


def verl_env(verl_dir: Path) -> dict[str, str]:
    """The environment of a subprocess that imports the pinned verl from its clone: the clone
    first on ``PYTHONPATH``; its bytecode cached outside the clone (``PYTHONPYCACHEPREFIX``),
    so that importing it leaves the pinned tree as it was (rule pins_clean reads its
    untracked files); the hub never reached for (the model is local)."""
    import tempfile

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(verl_dir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "hy3rl-pycache"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_verl_checks(verl_dir: Path, composed: Any, model_dir: Path, *, timeout_s: float = 180,
                    python: str | None = None, reward_fn: bytes | None = None
                    ) -> list[VerlCheck]:
    """Run verl's own validation of ``composed`` (the composed Hydra config: a DictConfig or its
    plain container, interpolations unresolved) in a subprocess of ``python`` (default: this
    interpreter, which must have verl's requirements) with ``verl_dir`` first on PYTHONPATH.
    ``model_dir`` is the policy checkpoint as this machine sees it: it stands in for
    ``actor_rollout_ref.model.path`` and gives the reward manager its tokenizer. Never raises
    for what verl reports; returns the checks in the order they ran. ``reward_fn``: the bytes
    of the custom reward function, which verl's reward manager loads from
    ``reward.custom_reward_function.path``: preflight writes that copy only when it passes
    (hy3rl.preflight), so the checks read the same bytes from a temporary copy."""
    import copy

    verl_dir = Path(verl_dir).resolve()
    if hasattr(composed, "_metadata"):  # an OmegaConf container
        from omegaconf import OmegaConf

        composed = OmegaConf.to_container(composed, resolve=False)
    tmp_dir = tempfile.TemporaryDirectory(prefix="hy3rl-verl-checks-")
    if reward_fn is not None:
        custom = (composed.get("reward") or {}).get("custom_reward_function") or {}
        if custom.get("path"):
            stand_in = Path(tmp_dir.name) / Path(str(custom["path"])).name
            stand_in.write_bytes(reward_fn)
            composed = copy.deepcopy(composed)
            composed["reward"]["custom_reward_function"]["path"] = str(stand_in)
    payload = json.dumps({"verl_dir": str(verl_dir), "model_dir": str(Path(model_dir).absolute()),
                          "composed": composed}, default=str)
    env = verl_env(verl_dir)
    with tmp_dir as tmp:
        out = Path(tmp) / "checks.jsonl"
        cmd = [python or sys.executable, "-P", str(Path(__file__).resolve()), "--out", str(out)]
        try:
            proc = subprocess.run(cmd, input=payload, cwd=tmp, env=env, capture_output=True,
                                  text=True, timeout=timeout_s)
            stopped = (f"the runner exited {proc.returncode}; its stderr ends with: "
                       f"{_tail(proc.stderr)}" if proc.returncode else "")
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) \
                else (exc.stderr or "")
            stopped = f"the runner timed out after {timeout_s:g}s; its stderr ends with: " \
                      f"{_tail(stderr)}"
        lines = out.read_text().splitlines() if out.exists() else []
    return _collect(lines, stopped)


def _tail(text: str, n: int = 1500) -> str:
    text = text.strip()
    return text[-n:] if text else "(empty)"


def _collect(lines: list[str], stopped: str) -> list[VerlCheck]:
    """The runner's JSON lines (a ``{"planned": [...]}`` line, then one check a line) as
    checks; a planned check that never reported is ``not run`` with why the runner stopped."""
    planned: list[str] = []
    checks: list[VerlCheck] = []
    for line in lines:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if "planned" in doc:
            planned = list(doc["planned"])
        else:
            checks.append(VerlCheck(**doc))
    done = {c.name for c in checks}
    for name in planned:
        if name not in done:
            checks.append(VerlCheck(name, NOT_RUN, reason=stopped or "the runner stopped early"))
    if not checks:
        checks.append(VerlCheck(RUNNER, NOT_RUN, reason=stopped or "the runner reported nothing"))
    return checks


# --------------------------------------------------------------------------- the runner
# Everything below runs in the subprocess, with the pinned verl importable.


def _raised_by_hydra(exc: BaseException) -> bool:
    """Hydra's own wrapper: an InstantiationException, or the ImportError its ``_locate``
    raises (``raise ImportError(...) from e``) when a ``_target_`` does not import."""
    if type(exc).__module__.split(".")[0] == "hydra":
        return True
    tb = traceback.extract_tb(exc.__traceback__)
    return bool(tb) and f"{os.sep}hydra{os.sep}" in tb[-1].filename


def _innermost(exc: BaseException) -> BaseException:
    """The exception verl (or the module it imports) raised, unwrapped from Hydra's
    ``raise ... from e`` wrappers around it."""
    while exc.__cause__ is not None and _raised_by_hydra(exc):
        exc = exc.__cause__
    return exc


def _where(exc: BaseException, verl_dir: Path) -> tuple[str, str]:
    """(``file:line`` of the innermost traceback frame inside ``verl_dir``, that line's text)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        try:
            rel = Path(frame.filename).resolve().relative_to(verl_dir)
        except (ValueError, OSError):
            continue
        text = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
        return f"{rel.as_posix()}:{frame.lineno}", text
    return "", ""


def _result(name: str, call: str, exc: BaseException, verl_dir: Path) -> VerlCheck:
    inner = _innermost(exc)
    where, line = _where(inner, verl_dir)
    if isinstance(inner, ImportError):
        missing = f"{type(inner).__name__}: {inner}" + (f" (at {where})" if where else "")
        return VerlCheck(name, NOT_RUN, reason=missing, where=where,
                         exception=type(inner).__name__, verl_call=call)
    message = str(inner).strip()
    if not message and isinstance(inner, AssertionError):
        message = line or "assertion failed"  # a bare `assert cond`: the condition is the message
    return VerlCheck(name, FAIL, message=message or type(inner).__name__, where=where,
                     exception=type(inner).__name__, verl_call=call)


class _Runner:
    def __init__(self, payload: Mapping[str, Any], out) -> None:
        from omegaconf import OmegaConf

        self.verl_dir = Path(payload["verl_dir"]).resolve()
        self.model_dir = str(payload["model_dir"])
        self.cfg = OmegaConf.create(payload["composed"])
        OmegaConf.set_struct(self.cfg, True)  # as Hydra composes it
        self.out = out

    def emit(self, doc: Mapping[str, Any]) -> None:
        self.out.write(json.dumps(doc, default=str) + "\n")
        self.out.flush()

    def check(self, name: str, call: str, fn: Callable[[], str]) -> None:
        """Run ``fn`` (it returns what it built); record pass / fail / not run."""
        try:
            built = fn()
        except _NotRun as exc:
            self.emit(asdict(VerlCheck(name, NOT_RUN, reason=str(exc), verl_call=call)))
        except Exception as exc:  # verl's validation raising: the point of the check
            self.emit(asdict(_result(name, call, exc, self.verl_dir)))
        else:
            self.emit(asdict(VerlCheck(name, PASS, message=built, verl_call=call)))

    def section(self, key: str):
        from omegaconf import OmegaConf

        node = OmegaConf.select(self.cfg, key, default=None)
        if node is None:
            raise _NotRun(f"the composed config has no section {key}")
        return node

    # ------------------------------------------------------------ verl's decisions

    def uses(self) -> dict[str, Any]:
        """Which optional parts this run builds, decided by verl's own functions. An exception
        (a module that does not import, a config verl cannot read) is kept: the checks that
        depend on it report it."""
        decided: dict[str, Any] = {}
        try:
            from verl.trainer.ppo.utils import need_critic, need_reference_policy

            decided["ref"] = bool(need_reference_policy(self.cfg))
            decided["critic"] = bool(need_critic(self.cfg))
        except Exception as exc:
            decided["ref"] = decided["critic"] = exc
        try:
            from verl.trainer.distillation import is_distillation_enabled

            decided["distillation"] = bool(is_distillation_enabled(self.cfg.get("distillation")))
        except Exception as exc:
            decided["distillation"] = exc
        return decided

    # ------------------------------------------------------------ the checks

    def validate_config(self) -> str:
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config
        from verl.utils.device import auto_set_device

        config = copy.deepcopy(self.cfg)
        auto_set_device(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
        return "validate_config passed"

    def convert(self, key: str, dataclass_type: str | None = None,
                prepare: Callable[[Any], None] | None = None) -> Callable[[], str]:
        def fn() -> str:
            from omegaconf import open_dict
            from verl.utils.config import omega_conf_to_dataclass

            node = copy.deepcopy(self.section(key))
            if prepare is not None:
                with open_dict(node):
                    prepare(node)
            kind = None
            if dataclass_type:
                module, _, cls = dataclass_type.rpartition(".")
                kind = getattr(__import__(module, fromlist=[cls]), cls)
            built = omega_conf_to_dataclass(node, dataclass_type=kind)
            return type(built).__name__
        return fn

    def _model_path(self, node) -> None:
        """``model_dir`` stands in for the checkpoint path (this machine's view of it)."""
        node.path = self.model_dir

    @staticmethod
    def _as_ref(ref) -> None:
        """``ActorRolloutRefWorker.init_model`` (verl/workers/engine_workers.py) renames the
        ref section's log-prob keys to the actor's names before converting it."""
        root = ref._get_root()
        ref.ppo_mini_batch_size = root.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)

    def reward_manager(self) -> str:
        from verl.trainer.ppo.reward import load_reward_manager
        from verl.utils import hf_tokenizer

        self.section("reward.reward_manager")
        tokenizer = hf_tokenizer(self.model_dir, trust_remote_code=True)
        manager = load_reward_manager(self.cfg, tokenizer, reward_router_address=None,
                                      reward_model_tokenizer=None)
        return f"{type(manager).__name__} ({self.cfg.reward.reward_manager.name})"

    def run(self) -> None:
        from omegaconf import OmegaConf

        uses = self.uses()
        ew = "verl/workers/engine_workers.py ActorRolloutRefWorker"
        v1 = "verl/trainer/ppo/v1/trainer_base.py PPOTrainer._setup"
        plan: list[tuple[str, str, Callable[[], str]]] = [
            ("validate_config", "verl/trainer/main_ppo.py main: validate_config(config, "
             "need_reference_policy, need_critic)", self.validate_config),
            ("actor_rollout_ref.model", f"{ew}.init_model: omega_conf_to_dataclass(model)",
             self.convert("actor_rollout_ref.model", prepare=self._model_path)),
            ("actor_rollout_ref.actor", f"{ew}.init_model: omega_conf_to_dataclass(actor)",
             self.convert("actor_rollout_ref.actor")),
            ("actor_rollout_ref.actor.profiler", f"{ew}.__init__: omega_conf_to_dataclass("
             "actor.profiler, ProfilerConfig)",
             self.convert("actor_rollout_ref.actor.profiler",
                          "verl.utils.profiler.ProfilerConfig")),
            *self._optional("actor_rollout_ref.ref", uses["ref"],
                            f"{ew}.init_model: omega_conf_to_dataclass(ref), its log_prob keys "
                            "renamed", self.convert("actor_rollout_ref.ref", prepare=self._as_ref)),
            ("actor_rollout_ref.rollout", f"{ew}.init_model: omega_conf_to_dataclass(rollout)",
             self.convert("actor_rollout_ref.rollout")),
            ("actor_rollout_ref.rollout.checkpoint_engine",
             f"{v1}: omega_conf_to_dataclass(rollout.checkpoint_engine)",
             self.convert("actor_rollout_ref.rollout.checkpoint_engine")),
            *self._optional("critic", uses["critic"], f"{v1}: omega_conf_to_dataclass(critic)",
                            self.convert("critic")),
            *self._optional("distillation", uses["distillation"],
                            f"{v1}: omega_conf_to_dataclass(distillation)",
                            self.convert("distillation")),
            ("reward_manager", "verl/experimental/reward_loop/reward_loop.py RewardLoopWorker."
             "_init_reward_fn: load_reward_manager(config, hf_tokenizer(model path))",
             self.reward_manager),
        ]
        self.emit({"planned": [name for name, _, _ in plan]})

        self.check(*plan[0])  # main_ppo validates the config as composed
        try:  # TaskRunnerV1.run resolves it before the trainer converts anything
            OmegaConf.resolve(self.cfg)
        except Exception as exc:
            self.emit(asdict(_result("resolve", "verl/trainer/main_ppo.py TaskRunnerV1.run: "
                                     "OmegaConf.resolve(config)", exc, self.verl_dir)))
        for name, call, fn in plan[1:]:
            self.check(name, call, fn)

    @staticmethod
    def _optional(name: str, used: Any, call: str, fn: Callable[[], str]
                  ) -> list[tuple[str, str, Callable[[], str]]]:
        """A check only for what this run builds; when verl could not decide (``used`` is the
        exception its decider raised), the check reports that exception."""
        if isinstance(used, BaseException):
            def undecided() -> str:
                raise used
            return [(name, call, undecided)]
        return [(name, call, fn)] if used else []


class _NotRun(Exception):
    """A check that cannot run (the message says why)."""


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run verl's own config validation (internal; "
                                     "payload as JSON on stdin)")
    parser.add_argument("--out", required=True, help="JSON lines of the checks, written as run")
    args = parser.parse_args(argv)
    payload = json.load(sys.stdin)
    with open(args.out, "a") as out:
        try:
            runner = _Runner(payload, out)
        except ImportError as exc:
            out.write(json.dumps(asdict(VerlCheck(RUNNER, NOT_RUN, reason=(
                f"{type(exc).__name__}: {exc}"), exception=type(exc).__name__))) + "\n")
            return 0
        runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
