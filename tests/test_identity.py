"""Run identity (issue 18): the three kinds of keys (hy3rl.identity), the trajectory of a
plan, and the checkpoint directory's identity file and decisions (hy3rl.ckptdir) on real
checkpoint directories written by the trainer double's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.common import make_config
from hy3rl import ckptdir, identity


def _triggers(**sections) -> dict[str, str]:
    return identity.train_trigger_values(make_config(**sections).raw)


# ---- the kinds of keys ----


def test_training_triggers_move_with_trajectory_and_extent_keys_only():
    base = _triggers()
    assert _triggers() == base
    # trajectory, extent and location keys re-run training ...
    for sections in ({"train": {"total_training_steps": 7}},
                     {"train": {"env": {"ACTOR_LR": 5e-6}}},
                     {"train": {"verl_overrides": {"actor_rollout_ref.actor.optim.lr": 1e-5}}},
                     {"data": {"train": {"limit": 20}}}, {"run": {"name": "other"}},
                     {"train": {"on_config_change": "fresh"}}):
        assert _triggers(**sections) != base, sections
    # ... operational keys, evaluation and the report do not
    for sections in ({"eval": {"steps": [10, 20]}}, {"report": {"dpi": 61}},
                     {"train": {"checkpoint_keep": 9, "restarts_per_job": 0,
                                "watchdog": {"stall_min": 3}, "notify_command": "echo",
                                "loggers": ["console"]}},
                     {"train": {"env": {"SAVE_FREQ": 3, "TEST_FREQ": 3}}},
                     {"train": {"verl_overrides": {"trainer.logger": ["console"],
                                                   "trainer.val_before_train": False}}},
                     {"cluster": {"train_time_min": 17, "nodes": 2}}):
        assert _triggers(**sections) == base, sections


def test_a_segment_is_not_rerun_by_an_extension():
    cfg = make_config(train={"segment_steps": 2}).raw
    longer = make_config(train={"segment_steps": 2, "total_training_steps": 9}).raw
    assert identity.train_keys_params(cfg, "step2") == identity.train_keys_params(longer, "step2")
    assert identity.train_keys_params(cfg, "final") != identity.train_keys_params(longer, "final")
    assert "segment_end=step2" in identity.train_keys_params(cfg, "step2")


def test_eval_request_final_follows_the_total_a_step_tag_does_not():
    keys = ("eval.seed",)
    a, b = make_config().raw, make_config(train={"total_training_steps": 9}).raw
    assert identity.eval_request_params(a, "final", keys) != \
        identity.eval_request_params(b, "final", keys)
    assert identity.eval_request_params(a, "step2", keys) == \
        identity.eval_request_params(b, "step2", keys)
    assert identity.eval_request_params(a, "base", keys) == \
        identity.eval_request_params(b, "base", keys)


def test_verl_kinds():
    assert identity.verl_kind("trainer.total_training_steps") == "extent"
    assert identity.verl_kind("trainer.logger") == "operational"
    assert identity.verl_kind("+ray_kwargs.ray_init.num_cpus") == "operational"
    assert identity.verl_kind("actor_rollout_ref.rollout.val_kwargs.n") == "operational"
    assert identity.verl_kind("actor_rollout_ref.actor.optim.lr") == "trajectory"
    assert identity.verl_kind("actor_rollout_ref.rollout.n") == "trajectory"


def _traj(lr: str = "1e-6", data: str = "aa", **extra: str) -> dict:
    resolved = {
        "actor_rollout_ref.actor.optim.lr": {"value": lr, "origin": "script (ACTOR_LR)"},
        "trainer.total_training_steps": {"value": "4"},
        "trainer.logger": {"value": "['console','file']"},
        "trainer.default_local_dir": {"value": "/ckpt/run"},
        "data.train_files": {"value": "/results/run/data/train.parquet"},
        **{k: {"value": v} for k, v in extra.items()},
    }
    return identity.trajectory(resolved=resolved, pins={"verl": "c0ffee"}, train_sha256=data,
                               model="hub:tencent/Hy3@abc", reward_fn_sha256=None)


def test_trajectory_leaves_out_extent_operational_and_paths():
    t = _traj()
    assert set(t["values"]) == {"actor_rollout_ref.actor.optim.lr", "pin.verl",
                                "data.train.sha256", "model.identity",
                                "reward_function.sha256"}
    assert t["values"]["data.train.sha256"] == "aa"
    assert _traj()["id"] == t["id"]
    assert _traj(**{"trainer.logger": "['console']"})["id"] == t["id"]
    assert _traj(lr="5e-6")["id"] != t["id"]
    assert _traj(data="bb")["id"] != t["id"]
    diff = identity.changes(t["values"], _traj(lr="5e-6")["values"])
    assert diff == [{"key": "actor_rollout_ref.actor.optim.lr", "old": "1e-6", "new": "5e-6"}]
    assert identity.describe_changes(diff, t["origins"]) == \
        'actor_rollout_ref.actor.optim.lr (script (ACTOR_LR)): "1e-6" -> "5e-6"'


def test_model_identity_hub_and_local():
    hub = {"source": {"kind": "hub", "repo_id": "tencent/Hy3", "resolved_revision": "ab"}}
    assert identity.model_identity(hub) == "hub:tencent/Hy3@ab"
    local = {"source": {"kind": "local"}, "files": [{"path": "a", "size": 1, "sha256": "x"}]}
    other = {"source": {"kind": "local"}, "files": [{"path": "a", "size": 1, "sha256": "y"}]}
    assert identity.model_identity(local) != identity.model_identity(other)


# ---- the checkpoint directory ----


@pytest.fixture
def root(ckpt: Path) -> Path:
    return ckpt


def _launch(root: Path, traj: dict, total: int, on_change: str = "refuse",
            attempt: int = 1) -> ckptdir.IdentityDecision:
    d = ckptdir.decide_identity(root, traj, total, on_change)
    if not d.error:
        ckptdir.apply_identity(root, d, traj, total, 0, attempt=attempt)
    return d


def test_new_run_then_same_then_extension(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    t = _traj()
    assert _launch(root, t, 4).action == "new"
    doc = ckptdir.read_identity(root)
    assert doc["trajectory"]["id"] == t["id"] and doc["first_attempt"] == 1
    assert _launch(root, t, 4, attempt=2).action == "same"
    d = _launch(root, t, 8, attempt=3)
    assert d.action == "extend" and "4 -> 8" in d.message
    doc = ckptdir.read_identity(root)
    assert [e["total_training_steps"] for e in doc["extents"]] == [4, 8]
    assert [h["action"] for h in doc["history"]] == ["new", "extend"]


def test_checkpoints_without_identity_are_adopted_with_a_warning(root: Path) -> None:
    d = _launch(root, _traj(), 4)
    assert d.action == "adopt" and d.message.startswith("WARNING") and "step 4" in d.message
    assert ckptdir.read_identity(root)["extents"][0]["at_step"] == 4


def test_a_changed_trajectory_is_refused_naming_the_key(root: Path) -> None:
    _launch(root, _traj(), 4)
    before = sorted(p.name for p in root.iterdir())
    d = ckptdir.decide_identity(root, _traj(lr="5e-6"), 4, "refuse")
    assert d.action == "refuse"
    assert 'actor_rollout_ref.actor.optim.lr (script (ACTOR_LR)): "1e-6" -> "5e-6"' in d.error
    assert "step 4" in d.error and "on_config_change" in d.error
    with pytest.raises(ckptdir.CheckpointDirError, match="optim.lr"):
        ckptdir.apply_identity(root, d, _traj(lr="5e-6"), 4, 0)
    assert sorted(p.name for p in root.iterdir()) == before  # nothing moved, nothing written


def test_a_total_below_the_newest_checkpoint_is_refused(root: Path) -> None:
    d = ckptdir.decide_identity(root, _traj(), 3, "fresh")
    assert d.error and "total_training_steps = 3" in d.error and "step 4" in d.error


def test_fresh_moves_everything_aside_and_deletes_nothing(root: Path) -> None:
    _launch(root, _traj(), 4)
    d = _launch(root, _traj(lr="5e-6"), 2, "fresh", attempt=3)  # a lower total: a new run
    assert d.action == "fresh"
    aside = [p for p in root.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1
    assert sorted(p.name for p in aside[0].iterdir()) == [
        "global_step_2", "global_step_4", ckptdir.IDENTITY_NAME, ckptdir.TRACKER]
    assert ckptdir.scan(root) == []
    doc = ckptdir.read_identity(root)
    assert doc["lineage"] == 2 and doc["first_attempt"] == 3
    assert doc["trajectory"]["values"]["actor_rollout_ref.actor.optim.lr"] == "5e-6"
    assert ckptdir.lineage_first_attempt(root) == 3


def test_resume_records_the_change_at_its_step(root: Path) -> None:
    _launch(root, _traj(), 4)
    d = _launch(root, _traj(lr="5e-6"), 6, "resume", attempt=2)
    assert d.action == "resume_changed"
    doc = ckptdir.read_identity(root)
    last = doc["history"][-1]
    assert (last["action"], last["at_step"], last["attempt"]) == ("resume_changed", 4, 2)
    assert last["changes"][0]["key"] == "actor_rollout_ref.actor.optim.lr"
    assert [c.step for c in ckptdir.scan(root)] == [2, 4]  # nothing moved
    assert _launch(root, _traj(lr="5e-6"), 6, attempt=3).action == "same"


def test_an_identity_file_that_does_not_parse_names_the_file(root: Path) -> None:
    (root / ckptdir.IDENTITY_NAME).write_text("{not json")
    with pytest.raises(ckptdir.CheckpointDirError, match=ckptdir.IDENTITY_NAME):
        ckptdir.decide_identity(root, _traj(), 4, "refuse")
    (root / ckptdir.IDENTITY_NAME).write_text(json.dumps({"trajectory": {}}))
    with pytest.raises(ckptdir.CheckpointDirError, match="not a run identity file"):
        ckptdir.decide_identity(root, _traj(), 4, "refuse")
