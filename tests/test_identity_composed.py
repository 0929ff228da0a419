"""The run identity is a function of the configuration verl composes (issue 40), tried on the
pinned verl's own Hydra tree and launch script (fixtures.deps.real_verl): preflight's
resolution of the paper config, then the trajectory (hy3rl.identity.composed_trajectory over
the composed, resolved leaves) and rule owned_keys on the same leaves. Each case is a row of
the issue's table: what a user writes, what verl would read, what the identity says."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.deps import VERL_PIN
from hy3rl import ckptdir, identity
from hy3rl import config as cfgmod
from hy3rl import preflight as pf
from hy3rl.layout import Layout
from hy3rl.preflight import rules
from hy3rl.preflight.resolve import PreflightError, resolve
from hy3rl.settings import Config

REPO = Path(__file__).resolve().parents[1]
LR = "actor_rollout_ref.actor.optim.lr"


def paper(tmp_path: Path, **overrides) -> dict:
    cfg = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
    cfg["train"]["checkpoint_root"] = str(tmp_path / "ckpt")
    cfg["run"]["results_root"] = str(tmp_path / "results")
    (tmp_path / "model").mkdir(exist_ok=True)
    cfg["model"].update(source=str(tmp_path / "model"), revision=None)
    cfg["train"]["verl_overrides"].update(overrides)
    return cfg


class Composed:
    """Preflight's resolution of ``cfg`` against the pinned verl: its trajectory and what rule
    owned_keys says."""

    def __init__(self, cfg: dict, verl: Path, tmp_path: Path):
        typed = Config.from_dict(cfg)
        self.res = resolve(typed, verl, train_files=tmp_path / "data/train.parquet",
                           val_files=tmp_path / "data/val.parquet", val_n=None,
                           checkpoint_dir=Layout.from_config(cfg).checkpoint_dir,
                           reward_fn=tmp_path / "out/reward_fn.py")
        assert self.res.compose_error is None, self.res.compose_error
        lock = {"repos": {"verl": {"head": VERL_PIN}}}
        self.trajectory = pf.run_identity(typed, self.res, lock, None, None, None)["trajectory"]
        r = rules._Rules()
        rules._knobs(r, self.res)
        rules._owned_keys(r, self.res)
        self.errors = {name: res.messages for name, res in r.results.items()}

    @property
    def id(self) -> str:
        return self.trajectory["id"]


@pytest.fixture
def compose(real_verl, tmp_path):
    return lambda cfg: Composed(cfg, real_verl, tmp_path)


def test_the_paper_config_composes_owned_values_intact_and_counts_every_leaf(compose,
                                                                            tmp_path):
    """The paper's own launch: no owned key touched; the trajectory holds the composed
    leaves of kind trajectory (verl's defaults too, not only the overridden keys), the data
    and model by their content names; an identity file of the older override form made from
    the same launch compares equal (checkpoints made before the composed form resume)."""
    run = compose(paper(tmp_path))
    assert run.errors == {}
    values = run.trajectory["values"]
    assert run.trajectory["form"] == "composed" and len(values) > 300
    assert values[LR] == 1e-6 and values["pin.verl"] == VERL_PIN
    assert "data.train.sha256" in values and "model.identity" in values
    assert "data.train_files" not in values and "trainer.total_training_steps" not in values
    # a default nobody overrides counts (actor.optim.weight_decay: verl's 0.01)
    assert values["actor_rollout_ref.actor.optim.weight_decay"] == 0.01
    assert run.trajectory["origins"][LR].startswith("script")
    resolved = {o.key: {"value": o.value, "origin": o.origin} for o in run.res.overrides}
    older = identity.trajectory(resolved=resolved, pins={"verl": VERL_PIN}, train_sha256=None,
                                model=None, reward_fn_sha256=None)
    assert identity.trajectory_changes(older, run.trajectory) == []
    moved = {**older, "values": {**older["values"], LR: 2e-6}}
    assert [c["key"] for c in identity.trajectory_changes(moved, run.trajectory)] == [LR]


@pytest.mark.parametrize("override, key, read", [
    ({"data": {"train_files": "/x/other.parquet"}}, "data.train_files", "/x/other.parquet"),
    ({"trainer": {"default_local_dir": "/x/elsewhere"}}, "trainer.default_local_dir",
     "/x/elsewhere"),
    ({"trainer": {"resume_mode": "disable"}}, "trainer.resume_mode", "disable"),
    ({"trainer": {"default_hdfs_dir": "/x/hdfs"}}, "trainer.default_hdfs_dir", "/x/hdfs"),
    ({"trainer": {"max_actor_ckpt_to_keep": 1}}, "trainer.max_actor_ckpt_to_keep", 1),
    ({"actor_rollout_ref.model": {"path": "/x/model"}}, "actor_rollout_ref.model.path",
     "/x/model"),
])
def test_an_owned_key_reached_by_a_nested_mapping_is_refused_by_name(compose, tmp_path,
                                                                      override, key, read):
    """A nested mapping in train.verl_overrides (ordinary YAML) reaches what the flat spelling
    may not: refused on what verl composes, naming the key, the value verl would read, the
    override that set it and the config key to set instead."""
    run = compose(paper(tmp_path, **override))
    (msg,) = run.errors["owned_keys"]
    assert msg.startswith(f"{key}: verl would read {read!r}"), msg
    assert "train.verl_overrides" in msg, msg


def test_the_file_logger_removed_by_a_nested_mapping_is_refused(compose, tmp_path):
    run = compose(paper(tmp_path, trainer={"logger": ["console"]}))
    (msg,) = run.errors["owned_keys"]
    assert msg.startswith("trainer.logger: verl would read ['console']"), msg
    assert "train.loggers" in msg


def test_key_order_decides_the_value_and_the_identity_follows_it(compose, tmp_path):
    """The same two overrides in two orders: verl reads the later one; the identity is that
    value, so the orders have two trajectories, and each equals the flat spelling of its
    value."""
    nested, flat = "actor_rollout_ref.actor.optim", LR
    a = compose(paper(tmp_path, **{nested: {"lr": 5e-6}, flat: 1e-6}))
    b = compose(paper(tmp_path, **{flat: 1e-6, nested: {"lr": 5e-6}}))
    assert a.trajectory["values"][LR] == 1e-6 and b.trajectory["values"][LR] == 5e-6
    assert a.id != b.id
    assert b.id == compose(paper(tmp_path, **{flat: 5e-6})).id
    assert a.id == compose(paper(tmp_path)).id
    # ... and a checkpoint directory made under one refuses the other, naming the key
    ckpt = tmp_path / "ckpt-order"
    ckpt.mkdir()
    d = ckptdir.decide_identity(ckpt, a.trajectory, 400, "refuse")
    ckptdir.apply_identity(ckpt, d, a.trajectory, 400, 0)
    complete = ckpt / "global_step_2" / "actor"
    complete.mkdir(parents=True)
    import json
    import zipfile

    with zipfile.ZipFile(ckpt / "global_step_2" / "data.pt", "w") as zf:
        zf.writestr("data/data.pkl", b"state")
    (complete / "ckpt_contents.json").write_text(json.dumps({"global_step": 2}))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    refused = ckptdir.decide_identity(ckpt, b.trajectory, 400, "refuse")
    assert refused.action == "refuse" and f"{LR}" in refused.error
    assert "1e-06 -> 5e-06" in refused.error, refused.error


def test_an_interpolation_counts_by_the_value_it_resolves_to(compose, tmp_path):
    """``${...}`` in an override counts as the value verl resolves, not as its text."""
    key = "actor_rollout_ref.rollout.temperature"
    via = compose(paper(tmp_path, **{key: "${actor_rollout_ref.rollout.val_kwargs.temperature}"}))
    resolved = via.trajectory["values"][key]
    assert resolved == compose(paper(tmp_path)).res.leaves[
        "actor_rollout_ref.rollout.val_kwargs.temperature"]
    assert via.id == compose(paper(tmp_path, **{key: resolved})).id
    assert via.id != compose(paper(tmp_path)).id  # the paper's 0.9 is another temperature


def test_a_knob_the_script_word_splits_is_refused_by_name(compose, tmp_path):
    """The pinned script passes ``trainer.experiment_name=${EXPERIMENT_NAME}`` unquoted: a
    value with a space smuggles another override (here another data file) past every key
    check. Refused by knob name, before anything composes into a launch."""
    cfg = paper(tmp_path)
    cfg["train"]["env"]["EXPERIMENT_NAME"] = "exp data.train_files=/x/other.parquet"
    run = compose(cfg)
    (msg,) = run.errors["knobs"]
    assert msg.startswith("train.env.EXPERIMENT_NAME: 'exp data.train_files=/x/other.parquet'")
    assert "unquoted" in msg
    # ... and had it passed, the composed data file is not the run's: owned_keys says so too
    assert run.res.leaves["data.train_files"] == str(tmp_path / "data/train.parquet")


def test_worker_modules_are_trajectory_and_the_total_is_the_workflows(compose, tmp_path):
    """Kinds fixed: the Ray runtime env of every worker (the modules verl imports in each
    process) changes the trajectory; ``trainer.total_training_steps`` as an override is
    refused, naming ``train.total_training_steps``."""
    plugin = {"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES":
              "my_patches"}
    assert compose(paper(tmp_path, **plugin)).id != compose(paper(tmp_path)).id
    with pytest.raises(PreflightError) as err:
        compose(paper(tmp_path, **{"trainer.total_training_steps": 50}))
    assert ("train.verl_overrides.trainer.total_training_steps: the workflow owns this value; "
            "set train.total_training_steps instead") in str(err.value)


def test_a_carved_heldout_set_is_training_data():
    """``data.heldout`` with ``from_train`` chooses which prompts train: its seed is a training
    key (a job is planned at once); a held-out set of its own is evaluation only."""
    base = {"data": {"heldout": {"from_train": True, "limit": 8, "seed": 1}},
            "train": {"total_training_steps": 2}}
    other = {"data": {"heldout": {"from_train": True, "limit": 8, "seed": 2}},
             "train": {"total_training_steps": 2}}
    assert identity.train_trigger_values(base, content={}) != identity.train_trigger_values(
        other, content={})
    own = {"data": {"heldout": {"source": "/x/heldout.parquet", "seed": 1}},
           "train": {"total_training_steps": 2}}
    own2 = {"data": {"heldout": {"source": "/x/heldout.parquet", "seed": 2}},
            "train": {"total_training_steps": 2}}
    assert identity.train_trigger_values(own, content={}) == identity.train_trigger_values(
        own2, content={})


def test_training_keys_count_typed_values_and_resolved_paths(tmp_path):
    """The training keys (what plans a training job while the DAG is built) count what verl
    reads: a knob or an override respelled (``'1e-6'``, ``1.0e-6``; ``128``, ``'128'``; a
    nested mapping for a dotted key) and a local path respelled (relative, ``./``, a
    trailing slash, a symlink) plan no job; another value does."""
    import os

    data = tmp_path / "dapo"
    data.mkdir()
    (data / "train.parquet").write_bytes(b"rows")
    (tmp_path / "link").symlink_to(data)

    def keys(env: dict, overrides: dict, source: str) -> str:
        cfg = {"data": {"train": {"source": source}},
               "train": {"env": env, "verl_overrides": overrides, "total_training_steps": 2}}
        return identity.train_keys_params(cfg, "final")

    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        first = keys({"ACTOR_LR": "1e-6", "TRAIN_BATCH_SIZE": 128},
                     {"actor_rollout_ref.actor.optim.lr": 1e-6}, str(data))
        for spelled in ("./dapo", "dapo/", str(tmp_path / "link")):
            assert keys({"ACTOR_LR": 1.0e-6, "TRAIN_BATCH_SIZE": "128"},
                        {"actor_rollout_ref.actor.optim": {"lr": "1.0e-6"}}, spelled) == first
        assert keys({"ACTOR_LR": 2e-6, "TRAIN_BATCH_SIZE": 128},
                    {"actor_rollout_ref.actor.optim.lr": 1e-6}, str(data)) != first
        assert keys({"ACTOR_LR": "1e-6", "TRAIN_BATCH_SIZE": 128},
                    {"actor_rollout_ref.actor.optim": {"lr": 5e-6}}, str(data)) != first
    finally:
        os.chdir(here)
