"""Run identity (issues 18 and 27): the four kinds of keys (hy3rl.identity), the trajectory of a
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


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_training_triggers_move_with_trajectory_and_extent_keys_only():
    base = _triggers()
    assert _triggers() == base
    # trajectory, extent and location keys re-run training ...
    for sections in ({"train": {"total_training_steps": 7}},
                     {"train": {"env": {"ACTOR_LR": 5e-6}}},
                     {"train": {"verl_overrides": {"actor_rollout_ref.actor.optim.lr": 1e-5}}},
                     {"data": {"train": {"limit": 20}}}, {"run": {"name": "other"}}):
        assert _triggers(**sections) != base, sections
    # ... operational keys, evaluation and the report do not
    for sections in ({"eval": {"steps": [10, 20]}}, {"report": {"dpi": 61}},
                     {"train": {"on_config_change": "fresh"}},
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
    a, b = make_config().raw, make_config(train={"total_training_steps": 9}).raw
    assert identity.eval_request_params(a, "final") != identity.eval_request_params(b, "final")
    assert identity.eval_request_params(a, "step2") == identity.eval_request_params(b, "step2")
    assert identity.eval_request_params(a, "base") == identity.eval_request_params(b, "base")
    # the request's name follows its values: a refused change names another request, the
    # restored values the first one again (nothing is evaluated again, issue 27)
    lr = make_config(train={"env": {"ACTOR_LR": 5e-6}}).raw
    assert identity.eval_request_digest(a, "step2") == identity.eval_request_digest(
        make_config().raw, "step2")
    assert identity.eval_request_digest(a, "step2") != identity.eval_request_digest(lr, "step2")
    assert identity.eval_request_digest(a, "base") == identity.eval_request_digest(lr, "base")
    assert identity.eval_request_digest(a, "step2") != identity.eval_request_digest(a, "step4")
    assert len(identity.eval_request_digest(a, "final")) == 16


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
    assert diff == [{"key": "actor_rollout_ref.actor.optim.lr", "old": 1e-6, "new": 5e-6}]
    assert identity.describe_changes(diff, t["origins"]) == \
        "actor_rollout_ref.actor.optim.lr (script (ACTOR_LR)): 1e-06 -> 5e-06"


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
    assert "actor_rollout_ref.actor.optim.lr (script (ACTOR_LR)): 1e-06 -> 5e-06" in d.error
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
    assert doc["trajectory"]["values"]["actor_rollout_ref.actor.optim.lr"] == 5e-6
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


# ---- issue 27: a run identity without holes ----


def test_names_urls_validation_and_memory_knobs_rerun_no_training():
    """Item 9: names, validation settings, a repository's url and the validation set are
    operational: no training job and no checkpoint tag's evaluation re-runs; a commit does."""
    import copy

    raw = make_config().raw  # validated once; each variant edits a copy of it
    base = identity.train_trigger_values(raw)
    step = identity.eval_request_params(raw, "step2")

    def variant(edit) -> dict:
        cfg = copy.deepcopy(raw)
        edit(cfg)
        return cfg

    for edit in (lambda c: c["train"]["env"].update(
                     PROJECT_NAME="p", EXPERIMENT_NAME="e", LOG_VAL_GENERATIONS=0,
                     VAL_DO_SAMPLE=False, ROLLOUT_GPU_MEM_UTIL=0.5,
                     PPO_MAX_TOKEN_LEN_PER_GPU=20480),
                 lambda c: c["deps"]["repos"]["verl"].update(url="/mirror/verl.git"),
                 lambda c: c["data"]["val"].update(limit=3, n=2)):
        cfg = variant(edit)
        assert identity.train_trigger_values(cfg) == base
        assert identity.eval_request_params(cfg, "step2") == step
    for edit in (lambda c: c["deps"]["repos"]["verl"].update(commit="f" * 40),
                 lambda c: c["train"]["env"].update(ACTOR_LR=2e-6),
                 lambda c: c["data"]["train"].update(limit=3)):
        assert identity.train_trigger_values(variant(edit)) != base


def test_how_an_engine_is_laid_out_re_evaluates_no_tag():
    """Issue 40: an evaluation request (and rule eval_generate's params) counts what the
    samples depend on: the sampling settings, the context length, the model's identity. The
    engine's layout and memory (a new gpu_memory_utilization after an out-of-memory, another
    tensor parallelism, eager mode) and the directory the model is copied to re-evaluate no
    tag; the sampling settings do."""
    import copy

    from hy3rl.smk import triggers

    raw = make_config().raw
    tags = ("base", "step2", "final")
    before = {t: identity.eval_request_digest(raw, t) for t in tags}
    params = triggers(raw, *identity.EVAL_GENERATION_KEYS)
    for key, value in (("gpu_memory_utilization", 0.5), ("tensor_parallel_size", 4),
                       ("data_parallel_size", 2), ("enforce_eager", True), ("nodes", 2),
                       ("gpus_per_node", 4)):
        cfg = copy.deepcopy(raw)
        cfg["eval"]["vllm"][key] = value
        assert {t: identity.eval_request_digest(cfg, t) for t in tags} == before, key
        assert triggers(cfg, *identity.EVAL_GENERATION_KEYS) == params, key
    cfg = copy.deepcopy(raw)
    cfg["model"]["dir"] = "/elsewhere/tiny"
    assert {t: identity.eval_request_digest(cfg, t) for t in tags} == before
    for section, key, value in (("eval", "temperature", 0.6), ("eval", "max_tokens", 77),
                                ("eval", "seed", 7)):
        cfg = copy.deepcopy(raw)
        cfg[section][key] = value
        assert all(identity.eval_request_digest(cfg, t) != before[t] for t in tags), key
    cfg = copy.deepcopy(raw)
    cfg["eval"]["vllm"]["max_model_len"] = 1024
    assert identity.eval_request_digest(cfg, "base") != before["base"]


def test_kinds_of_knobs_and_verl_keys():
    """Item 2 and 8: checkpoint location keys are `location`; memory-only knobs operational;
    a knob is as strong as the strongest key it sets."""
    for key in ("trainer.default_local_dir", "trainer.resume_mode", "trainer.resume_from_path",
                "trainer.del_local_ckpt_after_load", "trainer.max_actor_ckpt_to_keep"):
        assert identity.verl_kind(key) == "location", key
        assert "checkpoint" in identity.refused_override("++" + key), key
    assert identity.refused_override("data.train_files").endswith("data.train.source instead")
    assert identity.refused_override("actor_rollout_ref.actor.optim.lr") is None
    for knob in ("ROLLOUT_GPU_MEM_UTIL", "PPO_MAX_TOKEN_LEN_PER_GPU", "ALL_OFFLOAD",
                 "ROLLOUT_LOG_PROB_MAX_TOKEN_LEN_PER_GPU", "ROLLOUT_MAX_NUM_BATCHED_TOKENS",
                 "ACTOR_PPO_MICRO_BATCH_SIZE_PER_GPU", "PROJECT_NAME", "VAL_DO_SAMPLE"):
        assert identity.knob_kind(knob) == "operational", knob
    assert identity.knob_kind("INFER_BACKEND") == "trajectory"  # name + experiment name
    assert identity.knob_kind("TOTAL_EPOCHS") == "extent"
    assert identity.knob_kind("SOME_NEW_KNOB") == "trajectory"  # unknown: counted


def test_values_compare_by_type_and_value(root: Path) -> None:
    """Item 8: 1e-6, 1.0e-6 and the YAML float's rendering are one float; True and true one
    boolean; a boolean is no number; an identity file written with override text (before
    typed values) compares the same way."""
    from hy3rl.preflight.resolve import hydra_value

    t = _traj(lr="1e-6", **{"actor_rollout_ref.actor.use_kl_loss": "True",
                            "actor_rollout_ref.rollout.top_p": "1"})
    for lr, kl, top_p in (("1.0e-6", "true", "1.0"), (hydra_value(1.0e-6), "True", "1")):
        u = _traj(lr=lr, **{"actor_rollout_ref.actor.use_kl_loss": kl,
                            "actor_rollout_ref.rollout.top_p": top_p})
        assert u["id"] == t["id"] and identity.changes(t["values"], u["values"]) == []
    assert identity.changes({"k": True}, {"k": 1}) != []
    assert identity.changes({"k": "1e-6"}, {"k": 1e-6}) != []  # typed: a string is no float
    # a file from before typed values holds the override text: "1e-6" -> compared as 1e-06
    # and listed the keys that were trajectory then (memory-only knobs, names)
    legacy = {**t, "values": {**t["values"], "actor_rollout_ref.actor.optim.lr": "1e-6",
                              "actor_rollout_ref.actor.use_kl_loss": "True",
                              "actor_rollout_ref.rollout.gpu_memory_utilization": "0.65"}}
    del legacy["form"]
    _launch(root, legacy, 4)
    assert _launch(root, _traj(lr="1.0e-6", **{"actor_rollout_ref.actor.use_kl_loss": "true",
                                               "actor_rollout_ref.rollout.top_p": "1.0"}),
                   4).action == "same"
    assert ckptdir.decide_identity(root, _traj(lr="2e-6"), 4, "refuse").action == "refuse"


def test_a_path_verl_reads_counts_by_content(tmp_path: Path) -> None:
    """Item 1: a path-valued key that is not workflow-owned counts by what it names: a file
    by its sha256, a directory by its files; its name does not count."""
    a, b = tmp_path / "a" / "ds.py", tmp_path / "b" / "ds.py"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("class D: pass\n")
    key = "data.custom_cls.path"
    ta, tb = _traj(**{key: str(a)}), _traj(**{key: str(b)})
    assert ta["values"][key].startswith("file sha256:") and ta["id"] == tb["id"]
    b.write_text("class D: x = 1\n")
    assert _traj(**{key: str(b)})["id"] != ta["id"]
    da, db = _traj(**{key: str(a.parent)}), _traj(**{key: str(b.parent)})
    assert da["values"][key].startswith("directory sha256:") and da["id"] != db["id"]
    # the workflow-owned paths count by the workflow's content identities, not the path
    moved = _traj(**{"data.train_files": "/elsewhere/train.parquet"})
    assert moved["id"] == _traj()["id"] and "data.train_files" not in moved["values"]


def _schema_leaves() -> list[str]:
    from hy3rl.settings import schema_paths

    keys = schema_paths()
    return sorted(k for k in keys if not any(o.startswith(k + ".") for o in keys))


def test_every_config_key_has_a_kind():
    missing = [k for k in _schema_leaves() if identity.config_kind(k) is None]
    assert missing == [], f"config keys without a kind in hy3rl.identity.CONFIG_KINDS: {missing}"
    assert all(kind in identity.KINDS + (identity.PER_ENTRY,)
               for kind, _ in identity.CONFIG_KINDS.values())
    assert all(kind in identity.KINDS for kind, _ in identity.VERL_KINDS.values())


def test_the_key_table_in_the_docs_is_the_generated_one():
    doc = (Path(__file__).resolve().parents[1] / "docs/formats/train.md").read_text()
    begin, end = doc.find(identity.TABLE_BEGIN), doc.find(identity.TABLE_END)
    assert begin >= 0 and end > begin, "docs/formats/train.md has no generated key table"
    committed = doc[begin:end + len(identity.TABLE_END)]
    assert committed == identity.kind_table(), (
        "docs/formats/train.md's key table differs from hy3rl.identity.kind_table(): "
        "paste its output between the markers")


# ---- the training keys: what a training job's keys record is named by ----


def test_on_config_change_alone_names_the_same_keys_record():
    """train.on_config_change says what a launch does after a trajectory change; that change
    names a missing record by itself, so the choice alone plans no training job (counted,
    it planned one that trained nothing) and re-evaluates nothing."""
    import copy

    from hy3rl import train

    base = make_config().raw  # validated once; each variant edits a copy of it
    for choice in ("fresh", "resume"):
        other = copy.deepcopy(base)
        other["train"]["on_config_change"] = choice
        assert train.keys_digest(other, True) == train.keys_digest(base, True), choice
        assert train.keys_digest(other, False) == train.keys_digest(base, False), choice
        assert identity.eval_request_digest(other, "step2") == identity.eval_request_digest(
            base, "step2")
    assert not [v for v in identity.train_keys_params(base, "final").splitlines()
                if v.startswith("train.on_config_change")]
    # a trajectory change with the choice still names another record
    lr = copy.deepcopy(base)
    lr["train"].update(on_config_change="fresh", env={**lr["train"]["env"], "ACTOR_LR": 5e-6})
    assert train.keys_digest(lr, True) != train.keys_digest(base, True)


def test_a_file_changed_under_the_same_path_names_another_keys_record(tmp_path: Path,
                                                                      monkeypatch):
    """The training keys count what the job reads from files whose path stays: the custom
    reward function by its sha256 (as the run identity counts it), a local training data
    source by its content (hashed again when its stats change); a local model directory by
    its files' sizes and mtimes; a file replaced in place names a missing record
    (the job is planned in the same invocation) and another request for a checkpoint tag."""
    import copy
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq
    from hy3rl import train
    from hy3rl.layout import Layout

    monkeypatch.chdir(tmp_path)  # the run's results (its content cache) under tmp_path
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(*a, **k):\n    return 1.0\n")
    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["1"]}), data)
    cfg = copy.deepcopy(make_config().raw)  # as validated, with the files set
    cfg["train"]["reward_function"]["path"] = str(reward)
    cfg["data"]["train"]["source"] = str(data)

    def names() -> tuple[str, str, str]:  # as the DAG names them: the content once
        content = identity.content_triggers(cfg)
        return (train.keys_digest(cfg, True, content), train.keys_digest(cfg, False, content),
                identity.eval_request_digest(cfg, "step2", content))

    before = names()
    assert names() == before  # stable: nothing changed, nothing written
    reward.write_text("def compute_score(*a, **k):\n    return 0.0\n")
    edited = names()
    assert all(a != b for a, b in zip(edited, before, strict=True)), (edited, before)
    reward.write_text("def compute_score(*a, **k):\n    return 1.0\n")  # by content
    assert names() == before
    values = identity.train_keys_params(cfg, "final")
    sha = identity.content_stats(cfg)["reward_function.sha256"][0]
    assert f'reward_function.sha256="{sha}"' in values and "data.train.source.sha256=" in values

    # the data source only touched, or copied back with the same bytes: no change (its
    # content is hashed again, the run's content cache keeps the digest)
    cache = Path(Layout.from_config(cfg).content_sha_cache)
    assert cache.is_file() and str(data.resolve()) in json.loads(cache.read_text())
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert names() == before
    copy_back = tmp_path / "copy.parquet"
    copy_back.write_bytes(data.read_bytes())
    copy_back.replace(data)
    assert names() == before
    # ... new content under the same path and stats: another record
    st = data.stat()
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert all(a != b for a, b in zip(names(), before, strict=True))
    # a local model directory (not the generated tiny model) by its files' stats too
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg["model"]["source"] = str(model)
    before = names()
    st = (model / "config.json").stat()
    (model / "config.json").write_text('{"a": 1}')
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert all(a != b for a, b in zip(names(), before, strict=True))
    # computed here when not handed in: the same digest
    assert train.keys_digest(cfg, True) == names()[0]
