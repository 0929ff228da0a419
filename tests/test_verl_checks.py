"""verl's own validation in a subprocess (hy3rl.verl_checks): against a fake verl package
(fixtures/fake_verl.py), and against the pinned verl itself (the fixture ``real_verl``: a
checkout of the local mirror at the pin). The composed config always comes from preflight's
own resolution (hy3rl.preflight.resolve) of the embedded default or the paper config."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from fixtures.fake_verl import line_of
from hy3rl import config as cfgmod
from hy3rl.preflight.resolve import resolve, select
from hy3rl.settings import Config
from hy3rl.verl_checks import FAIL, NOT_RUN, PASS, VerlCheck, run_verl_checks

REPO = Path(__file__).resolve().parents[1]
DAPO = "verl/experimental/reward_loop/reward_manager/dapo.py"
DAPO_MESSAGE = "max_resp_len must be larger than overlong_buffer.len"


def default_cfg(tmp_path: Path, *extra: str, **overrides) -> dict:
    """The embedded default (plus ``extra`` config files), results under tmp_path, with
    ``overrides`` (``__`` for ``.``) added to its ``train.verl_overrides``."""
    cfg = cfgmod.load(REPO / "config/config.yaml", *(REPO / e for e in extra))
    cfg["run"]["results_root"] = str(tmp_path / "results")
    cfg["train"]["checkpoint_root"] = str(tmp_path / "ckpt")
    cfg["train"]["verl_overrides"].update(
        {k.replace("__", "."): v for k, v in overrides.items()})
    return cfg


def composed(cfg: dict, verl_dir: Path, tmp_path: Path):
    """Preflight's composition of ``cfg`` against the clone at ``verl_dir``."""
    res = resolve(Config.from_dict(cfg), verl_dir, train_files=tmp_path / "data/train.parquet",
                  val_files=tmp_path / "data/val.parquet", val_n=None,
                  checkpoint_dir=tmp_path / "ckpt", reward_fn=tmp_path / "reward_fn.py")
    assert res.composed is not None, res.compose_error
    return res.composed


def by_name(checks: list[VerlCheck]) -> dict[str, VerlCheck]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), names
    return {c.name: c for c in checks}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


FAKE_CHECKS = ["validate_config", "actor_rollout_ref.model", "actor_rollout_ref.actor",
               "actor_rollout_ref.actor.profiler", "actor_rollout_ref.ref",
               "actor_rollout_ref.rollout", "actor_rollout_ref.rollout.checkpoint_engine",
               "reward_manager"]


# --------------------------------------------------------------------------- fake verl


def test_consistent_config_passes_every_check(fake_verl_pkg, tmp_path, model_dir):
    verl = fake_verl_pkg()
    cfg = default_cfg(tmp_path)  # the embedded default: buffer 128 of 256 response tokens
    checks = run_verl_checks(verl.path, composed(cfg, verl.path, tmp_path), model_dir)
    assert [c.name for c in checks] == FAKE_CHECKS
    assert {c.name: c.status for c in checks} == dict.fromkeys(FAKE_CHECKS, PASS), checks
    got = by_name(checks)
    assert got["actor_rollout_ref.actor"].message == "ActorConfig"
    assert got["reward_manager"].message == "DAPORewardManager (dapo)"
    assert "engine_workers.py" in got["actor_rollout_ref.rollout"].verl_call
    json.dumps([asdict(c) for c in checks])  # the plan records them as they are


def test_dapo_assert_reaches_the_result_with_message_and_line(fake_verl_pkg, tmp_path,
                                                               model_dir):
    verl = fake_verl_pkg()
    cfg = default_cfg(tmp_path)  # MAX_RESPONSE_LENGTH 256 with the script's buffer of 4096
    cfg["train"]["env"]["MAX_RESPONSE_LENGTH"] = 256
    cfg["train"]["verl_overrides"] = {"reward.reward_kwargs.overlong_buffer_cfg.len": 4096}
    cfg_c = composed(cfg, verl.path, tmp_path)
    assert select(cfg_c, "reward.reward_kwargs.max_resp_len") == 256
    got = by_name(run_verl_checks(verl.path, cfg_c, model_dir))
    dapo = got["reward_manager"]
    assert dapo.status == FAIL and dapo.exception == "AssertionError"
    assert dapo.message == DAPO_MESSAGE
    assert dapo.where == f"{DAPO}:{line_of(verl.path / DAPO, 'assert self.max_resp_len >=')}"
    assert got["actor_rollout_ref.actor"].status == PASS  # one failure does not stop the rest


def test_post_init_error_reaches_the_result(fake_verl_pkg, tmp_path, model_dir):
    verl = fake_verl_pkg()
    cfg = default_cfg(tmp_path, **{
        "actor_rollout_ref__actor__loss_agg_mode": "bogus",
        "actor_rollout_ref__rollout__mode": "sync"})
    got = by_name(run_verl_checks(verl.path, composed(cfg, verl.path, tmp_path), model_dir))
    src = verl.path / "verl/workers/config/__init__.py"
    actor_line = f"verl/workers/config/__init__.py:{line_of(src, 'Invalid loss_agg_mode')}"
    for name in ("validate_config", "actor_rollout_ref.actor"):  # verl converts it twice
        assert got[name].status == FAIL
        assert got[name].message == "Invalid loss_agg_mode: bogus"
        assert got[name].where == actor_line and got[name].exception == "ValueError"
    rollout = got["actor_rollout_ref.rollout"]
    assert rollout.status == FAIL and rollout.message == "Rollout mode 'sync' has been removed."
    assert rollout.where.startswith("verl/workers/config/__init__.py:")
    assert got["reward_manager"].status == PASS


def test_unknown_reward_manager_and_missing_model_fail(fake_verl_pkg, tmp_path):
    verl = fake_verl_pkg()
    cfg = default_cfg(tmp_path, reward__reward_manager__name="nope")
    got = by_name(run_verl_checks(verl.path, composed(cfg, verl.path, tmp_path),
                                  tmp_path / "no-such-model"))
    assert got["reward_manager"].message == "Unknown reward manager: nope"
    assert got["reward_manager"].where.startswith(
        "verl/experimental/reward_loop/reward_manager/registry.py:")
    model = got["actor_rollout_ref.model"]  # model_dir stands in for the checkpoint path
    assert model.status == FAIL and str(tmp_path / "no-such-model") in model.message


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_missing_requirement_is_not_run_with_the_module_named(fake_verl_pkg, tmp_path,
                                                              model_dir):
    verl = fake_verl_pkg(extra_files={
        "verl/utils/config.py": "import hy3rl_absent_requirement  # noqa: F401\n"})
    cfg = default_cfg(tmp_path)
    got = by_name(run_verl_checks(verl.path, composed(cfg, verl.path, tmp_path), model_dir))
    for name in FAKE_CHECKS[:-1]:
        assert got[name].status == NOT_RUN, got[name]
        assert "No module named 'hy3rl_absent_requirement'" in got[name].reason
        assert got[name].reason.endswith("(at verl/utils/config.py:1)")
        assert got[name].message == ""
    assert got["reward_manager"].status == PASS  # what can still run, runs


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_a_part_verl_lacks_is_not_run(fake_verl_pkg, tmp_path, model_dir):
    verl = fake_verl_pkg(extra_files={"verl/trainer/ppo/reward.py": "# no load_reward_manager\n"})
    cfg = default_cfg(tmp_path)
    got = by_name(run_verl_checks(verl.path, composed(cfg, verl.path, tmp_path), model_dir))
    assert got["reward_manager"].status == NOT_RUN
    assert "cannot import name 'load_reward_manager'" in got["reward_manager"].reason


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_runner_timeout_reports_every_planned_check_not_run(fake_verl_pkg, tmp_path,
                                                            model_dir):
    verl = fake_verl_pkg(extra_files={"verl/utils/device.py": (
        "import time\n\n\ndef auto_set_device(config):\n    time.sleep(120)\n")})
    cfg = default_cfg(tmp_path)
    checks = run_verl_checks(verl.path, composed(cfg, verl.path, tmp_path), model_dir,
                             timeout_s=8)
    assert checks and all(c.status == NOT_RUN for c in checks), checks
    assert all("timed out after 8s" in c.reason for c in checks)


def test_runner_without_omegaconf_is_one_not_run_check(tmp_path, model_dir):
    python = tmp_path / "python"  # an interpreter without omegaconf (-S: no site-packages)
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    checks = run_verl_checks(tmp_path, {"trainer": {}}, model_dir, python=str(python))
    assert len(checks) == 1 and checks[0].name == "verl_checks"
    assert checks[0].status == NOT_RUN and "omegaconf" in checks[0].reason


# --------------------------------------------------------------------------- real verl

REAL_CHECKS = ["validate_config", "actor_rollout_ref.model", "actor_rollout_ref.actor",
               "actor_rollout_ref.actor.profiler", "actor_rollout_ref.ref",
               "actor_rollout_ref.rollout", "actor_rollout_ref.rollout.checkpoint_engine",
               "reward_manager"]


@pytest.mark.slow  # verl's own validators in a subprocess (torch, verl)
def test_real_default_passes(tmp_path, tiny_hy3_dir, real_verl):
    verl = real_verl
    base = composed(default_cfg(tmp_path), verl, tmp_path)
    max_resp = select(base, "reward.reward_kwargs.max_resp_len")
    assert max_resp == select(base, "data.max_response_length") == 64
    assert select(base, "reward.reward_kwargs.overlong_buffer_cfg.len") == 32
    checks = run_verl_checks(verl, base, tiny_hy3_dir)
    assert [c.name for c in checks] == REAL_CHECKS
    assert all(c.status == PASS for c in checks), [asdict(c) for c in checks]
    got = by_name(checks)
    # the embedded default runs the CPU path: verl's FSDP2 engine
    assert got["actor_rollout_ref.actor"].message == "FSDPActorConfig"
    assert got["actor_rollout_ref.model"].message == "HFModelConfig"
    assert got["reward_manager"].message == "DAPORewardManager (dapo)"


@pytest.mark.slow  # verl's own validators in a subprocess (torch, verl)
def test_real_overlong_buffer_longer_than_the_response_fails(tmp_path, tiny_hy3_dir,
                                                              real_verl):
    verl = real_verl
    cfg = default_cfg(tmp_path)
    max_resp = select(composed(cfg, verl, tmp_path), "reward.reward_kwargs.max_resp_len")
    cfg["train"]["verl_overrides"]["reward.reward_kwargs.overlong_buffer_cfg.len"] = max_resp + 1
    got = by_name(run_verl_checks(verl, composed(cfg, verl, tmp_path), tiny_hy3_dir))
    dapo = got["reward_manager"]
    assert dapo.status == FAIL and dapo.message == DAPO_MESSAGE, asdict(dapo)
    assert dapo.where == f"{DAPO}:{line_of(verl / DAPO, 'assert self.max_resp_len >=')}"
    assert all(c.status == PASS for n, c in got.items() if n != "reward_manager")


@pytest.mark.slow  # verl's own validators in a subprocess (torch, verl)
def test_real_paper_config_passes(tmp_path, tiny_hy3_dir, real_verl):
    verl = real_verl
    cfg = default_cfg(tmp_path, "config/paper.yaml")
    cfg["model"].update(source=str(tiny_hy3_dir), revision=None)
    checks = run_verl_checks(verl, composed(cfg, verl, tmp_path), tiny_hy3_dir)
    assert [c.name for c in checks] == REAL_CHECKS
    assert all(c.status == PASS for c in checks), [asdict(c) for c in checks]
