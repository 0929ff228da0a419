"""The config schema: defaults filled, every error named by its key path, both shipped
configs valid, and several config files merging like Snakemake's --configfile."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hy3rl import config as cfgmod

REPO = Path(__file__).resolve().parents[1]


def test_default_and_paper_configs_validate():
    default = cfgmod.load(REPO / "config/config.yaml")
    repos = default["deps"]["repos"]
    assert repos["verl"]["commit"] == "220e9039902c6db56860e2afd659803dc34ec005"
    assert repos["megatron_bridge"]["commit"] == "df0852cf94c674de07f9f7ef933c484de8aca505"
    assert repos["transfer_queue"]["commit"] == "35bcf198ac087f0a0e41a69a897f48929c313d22"
    assert repos["transfer_queue"]["url"].endswith("Ascend/TransferQueue.git")  # tag v0.1.8
    assert default["model"]["source"] == "resources/tiny-hy3" and default["cluster"]["gpu"] is False
    paper = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
    assert paper["cluster"]["nodes"] == 16 and paper["cluster"]["gpus_per_node"] == 8


def test_errors_name_every_key_path(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "run": {"nme": "x"},
        "deps": {"repos": {"verl": {"url": "u", "commit": "220e903"}}},
    }))
    with pytest.raises(cfgmod.ConfigError) as err:
        cfgmod.load(REPO / "config/config.yaml", bad)
    msg = str(err.value)
    assert "run.nme" in msg
    assert "deps.repos.verl.commit" in msg and "220e903" in msg


def test_every_schema_key_has_description_and_default():
    def walk(node, path):
        if isinstance(node, dict):
            for name, sub in (node.get("properties") or {}).items():
                if "$ref" in sub:
                    sub = {**_ref(sub), **sub}
                assert "description" in sub, f"{path}.{name} has no description"
                # A required key inside a $defs type gets its default from its parent's default.
                if name not in node.get("required", []):
                    assert "default" in sub, f"{path}.{name} has no default"
                walk(sub, f"{path}.{name}")
            for sub in (node.get("$defs") or {}).values():
                walk(sub, path)

    def _ref(sub):
        target = sub["$ref"]
        if target.startswith("#"):
            return {}
        return yaml.safe_load((REPO / "config/schema" / target).read_text())

    for f in sorted((REPO / "config/schema").glob("*.schema.yaml")):
        walk(yaml.safe_load(f.read_text()), f.stem.split(".")[0])


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_snakemake_stops_before_any_job_naming_the_key(tmp_path: Path):
    """A misspelled key and a bad value in a second --configfile: the real Snakemake run
    (not a dry run) stops at startup, names both key paths, and runs no job."""
    from fixtures.common import run_snakemake

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"run": {"name": "my run!"},
                                   "data": {"train": {"dedupe": True}}}))
    work = tmp_path / "work"
    work.mkdir()
    proc = run_snakemake(["--configfile", str(REPO / "config/config.yaml"), str(bad),
                          "--cores", "1"], work, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "run.name" in out and "my run!" in out, out
    assert "data.train" in out and "dedupe" in out, out
    assert not (work / "results").exists() and not (work / "resources").exists()
    assert "deps" not in {p.name for p in work.iterdir()}


def _schema_keys() -> set[str]:
    """Every dotted key the schema declares (properties, recursively, $refs resolved)."""
    root = yaml.safe_load((REPO / "config/schema/config.schema.yaml").read_text())
    out: set[str] = set()

    def walk(node, prefix, doc):
        if "$ref" in node:
            ref = node["$ref"]
            if ref.startswith("#"):
                node = {**doc["$defs"][ref.split("/")[-1]], **node}
            else:
                doc = yaml.safe_load((REPO / "config/schema" / ref).read_text())
                node = {**doc, **node}
        for name, sub in (node.get("properties") or {}).items():
            key = f"{prefix}{name}"
            out.add(key)
            walk(sub, key + ".", doc)

    walk(root, "", root)
    return out


def test_typed_config_declares_exactly_the_schema_keys():
    """hy3rl.settings holds names and types only; the schema holds the defaults. The two
    must agree key for key, so that no default is ever written a second time in code."""
    from hy3rl.settings import schema_paths

    schema, typed = _schema_keys(), schema_paths()
    assert schema - typed == set(), f"schema keys without a typed field: {schema - typed}"
    assert typed - schema == set(), f"typed fields not in the schema: {typed - schema}"


def test_typed_config_carries_the_schema_defaults():
    from hy3rl.settings import Config

    cfg = Config.load(REPO / "config/config.yaml")
    assert cfg.train.ray.port_base == 20000 and cfg.eval.bootstrap.resamples == 10000
    assert cfg.data.val.n == 1 and cfg.data.train.convert is None  # VAL_N 1: CPU time
    assert isinstance(cfg.cluster.gpu_memory_gb, float)
    assert cfg.hash == cfgmod.config_hash(cfg.raw)
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):  # code cannot change the config
        cfg.train.checkpoint_keep = 3  # type: ignore[misc]


def test_placeholders_are_refused_by_key(tmp_path: Path):
    paper = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
    with pytest.raises(cfgmod.ConfigError) as err:
        cfgmod.refuse_placeholders(paper, {"slurm_partition": "CHANGE_ME_partition",
                                           "slurm_account": "acct"})
    msg = str(err.value)
    for key in ("model.revision", "model.dir", "train.checkpoint_root", "train.runtime.prefix",
                "data.heldout.revision", "slurm_partition"):
        assert key in msg, msg
    assert "slurm_account" not in msg
    site = cfgmod.deep_merge(paper, {"model": {"revision": "a" * 40, "dir": "/m"}, "data": {
        "heldout": {"revision": "b" * 40}}, "train": {
        "checkpoint_root": "/c", "runtime": {"prefix": ""}}})
    cfgmod.refuse_placeholders(site, {"slurm_partition": "gpu"})  # nothing left: passes


def test_paper_dry_run_stops_on_placeholders_before_the_dag(tmp_path: Path):
    """Today's profile and paper config as shipped: the run stops at parse time naming each
    placeholder, instead of a MissingInputException on /CHANGE_ME/... paths."""
    from fixtures.common import run_snakemake

    proc = run_snakemake(["-n", "--profile", str(REPO / "profiles/slurm"), "--configfile",
                          str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")],
                         tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "CHANGE_ME" in out and "model.revision" in out and "slurm_partition" in out, out
    assert "MissingInputException" not in out, out


def test_triggers_name_each_key_and_hide_secrets():
    from hy3rl.smk import triggers

    cfg = {"train": {"env": {"SAVE_FREQ": 5}, "total_training_steps": 8,
                     "verl_overrides": {"+trainer.api_key": "s3cr3t-value"}}}
    t = triggers(cfg, "train.env", "train.total_training_steps", "train.verl_overrides")
    assert set(t.values()) >= {"train.env.SAVE_FREQ=5", "train.total_training_steps=8"}
    secret = [v for v in t.values() if v.startswith("train.verl_overrides")]
    assert secret and "s3cr3t" not in secret[0] and "sha256:" in secret[0]
    assert all(k.isidentifier() for k in t)


def test_the_stage_is_rebuilt_for_the_pipeline_size_only():
    """Issue 40: with rehearsal.shape stage, any train.env change (a project name, the
    rollout's memory: the mid-run OOM fix) rebuilt the 40 GB stage in a 120-min cluster job;
    its layers depend on the run's pipeline size alone (ACTOR_PP, or a verl override of it,
    flat or nested, which train.env did not even see)."""
    from hy3rl.smk import stage_triggers

    base = {"train": {"env": {"ACTOR_PP": 8, "PROJECT_NAME": "a", "ROLLOUT_GPU_MEM_UTIL": 0.7},
                      "verl_overrides": {"trainer.val_before_train": False}}}
    same = {"train": {"env": {"ACTOR_PP": 8, "PROJECT_NAME": "b", "ROLLOUT_GPU_MEM_UTIL": 0.5},
                      "verl_overrides": {"trainer.val_before_train": True}}}
    assert stage_triggers(base) == stage_triggers(same)
    assert list(stage_triggers(base).values()) == ["train.env.ACTOR_PP=8"]
    assert stage_triggers({"train": {"env": {"ACTOR_PP": 4}}}) != stage_triggers(base)
    key = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"
    for over in ({key: 4}, {f"+{key}": 4},
                 {"actor_rollout_ref": {"actor": {"megatron": {
                     "pipeline_model_parallel_size": 4}}}}):
        moved = {"train": {"env": {"ACTOR_PP": 8}, "verl_overrides": over}}
        assert stage_triggers(moved) != stage_triggers(base), over
        assert any(v.endswith("pipeline_model_parallel_size=4")
                   for v in stage_triggers(moved).values())
    assert all(k.isidentifier() for k in stage_triggers(moved))
    assert list(stage_triggers({}).values()) == ["train.env.ACTOR_PP=null"]


def test_layout_is_the_one_checkpoint_dir(tmp_path: Path):
    from hy3rl.layout import Layout
    from hy3rl.settings import Config

    cfg = Config.load(REPO / "config/config.yaml")
    lay = Layout.from_config(cfg)
    assert lay.checkpoint_dir == Path.cwd() / "results" / "tiny-default" / "checkpoints"
    assert Layout("r", "x", str(tmp_path)).checkpoint_dir == tmp_path / "x"
    assert lay.eval_samples("{tag}") == "results/tiny-default/eval/{tag}/samples.jsonl"
    assert Layout.of_results(lay.results) == Layout("results", "tiny-default")


def test_hy3rl_cli_prints_the_resolved_config_and_names_bad_keys(tmp_path: Path):
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "hy3rl.cli", "config", "--configfile",
                         str(REPO / "config/config.yaml")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["run"]["name"] == "tiny-default"
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {totl_training_steps: 3}\n")
    err = subprocess.run([sys.executable, "-m", "hy3rl.cli", "config", "--configfile",
                          str(REPO / "config/config.yaml"), "--configfile", str(bad)],
                         capture_output=True, text=True)
    assert err.returncode == 2 and "train.totl_training_steps" in err.stderr, err.stderr


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_model_source_hub_or_local_and_its_path(tmp_path: Path):
    """model.path (not a key) is model.dir for a hub repository, model.source itself for a
    local directory (hy3rl.hub.is_local_source decides, as rule model does); a hub source
    needs a full SHA and an absolute model.dir, refused at parse time by key."""
    from fixtures.common import make_config

    tiny = make_config().model
    assert tiny.is_local and tiny.path == "resources/tiny-hy3" and tiny.revision is None
    local = make_config(model={"source": str(tmp_path), "dir": "/ignored"}).model
    assert local.is_local and local.path == str(tmp_path)
    sha = "0123456789abcdef0123456789abcdef01234567"
    hub = make_config(model={"source": "tencent/Hy3", "revision": sha, "dir": "/m/hy3"}).model
    assert not hub.is_local and hub.path == "/m/hy3"
    for model, key, words in (
            ({"source": "tencent/Hy3", "dir": "/m"}, "model.revision", "missing"),
            ({"source": "tencent/Hy3", "revision": "main", "dir": "/m"}, "model.revision",
             "does not match"),
            ({"source": "tencent/Hy3", "revision": sha[:12], "dir": "/m"}, "model.revision",
             "does not match"),
            ({"source": "tencent/Hy3", "revision": sha}, "model.dir", "absolute"),
            ({"source": "tencent/Hy3", "revision": sha, "dir": "rel"}, "model.dir", "absolute"),
            ({"path": "/old"}, "model.path", "unknown key")):
        with pytest.raises(cfgmod.ConfigError) as err:
            make_config(model=model)
        assert key in str(err.value) and words in str(err.value), (model, str(err.value))
