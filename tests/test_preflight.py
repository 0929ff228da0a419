"""Preflight: the launch resolved from a (fake) pinned verl script, composed with its Hydra
config, every coupling rule failing with its numbers, waivers, and the paper plan checked
value by value against the published hyperparameters. The stage runs in-process through
``hy3rl.preflight.run`` and, for its error behaviour, through the ``hy3rl preflight`` CLI."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from fixtures.data import DAPO_PREFIX, DAPO_SUFFIX
from fixtures.fake_verl import line_of
from fixtures.verl import write_lock
from hy3rl import cli
from hy3rl import config as cfgmod
from hy3rl import preflight as pf
from hy3rl.config import ConfigError
from hy3rl.layout import Layout
from hy3rl.preflight import rules
from hy3rl.settings import Config

REPO = Path(__file__).resolve().parents[1]
HY3_BYTES = 597_572_342_272

# The published run, from ../shared/docs/upstream-facts.md (paper text + the pinned script's
# defaults), written here independently of the code under test: composed key -> value.
PUBLISHED = {
    "trainer.nnodes": 16,                                     # 16 nodes
    "trainer.n_gpus_per_node": 8,                             # x 8 H20
    "data.train_batch_size": 128,                             # batch 128 prompts
    "actor_rollout_ref.rollout.n": 16,                        # x 16 samples
    "actor_rollout_ref.actor.ppo_mini_batch_size": 128,       # ppo_mini_batch 128
    "data.max_prompt_length": 2048,                           # MAX_PROMPT_LENGTH=2048
    "data.max_response_length": 8192,                         # max response 8192
    "actor_rollout_ref.actor.optim.lr": 1e-6,                 # lr 1e-6
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,            # clip 0.2
    "actor_rollout_ref.actor.clip_ratio_high": 0.28,          # clip 0.28
    "actor_rollout_ref.actor.clip_ratio_c": 10.0,             # dual-clip c=10
    "actor_rollout_ref.actor.kl_loss_coef": 0.0,              # KL-free
    "algorithm.use_kl_in_reward": False,                      # KL-free
    "algorithm.adv_estimator": "grpo",                        # GRPO
    "reward.reward_manager.name": "dapo",                     # DAPO reward manager
    "reward.reward_kwargs": {                                 # overlong buffer 4096, penalty 1
        "overlong_buffer_cfg": {"enable": True, "len": 4096, "penalty_factor": 1.0,
                                "log": False},
        "max_resp_len": 8192,
    },
    "algorithm.rollout_correction.rollout_is": "token",       # IcePop rollout_is=token
    "algorithm.rollout_correction.rollout_is_threshold": "0.5_4.0",  # threshold 0.5_4.0
    "actor_rollout_ref.rollout.temperature": 0.9,             # rollout temperature 0.9
    "actor_rollout_ref.rollout.top_p": 1,                     # top_p 1.0
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 16,  # TP=16 on H20
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 30720,  # PPO_MAX_TOKEN_LEN_PER_GPU
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,    # ACTOR_TP=1
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 16,  # PP=16
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": 8,    # EP=8
    "actor_rollout_ref.actor.megatron.context_parallel_size": 8,         # CP=8
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": 1,   # ETP=1
    "actor_rollout_ref.rollout.max_model_len": 10240,         # ROLLOUT_MAX_MODEL_LEN=10240
    "actor_rollout_ref.rollout.val_kwargs.n": 1,              # VAL_N=1
    "trainer.save_freq": 20,                                  # SAVE_FREQ=20
    "trainer.test_freq": 10,                                  # TEST_FREQ=10
    "actor_rollout_ref.actor.strategy": "megatron",           # model_engine=megatron
    # the pinned script's other defaults (upstream-facts: "env knobs with defaults ...")
    "algorithm.kl_ctrl.kl_coef": 0.0,                         # KL-free
    "algorithm.norm_adv_by_std_in_grpo": False,
    "actor_rollout_ref.actor.optim.min_lr": 1e-6,             # MIN_LR=1e-6: constant LR
    "actor_rollout_ref.actor.use_kl_loss": True,              # USE_KL_LOSS=True (coef 0)
    "actor_rollout_ref.actor.entropy_coeff": 0,               # ENTROPY_COEFF=0
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.actor.megatron.param_offload": True,   # ALL_OFFLOAD=True
    "actor_rollout_ref.actor.megatron.optimizer_offload": True,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.65,  # ROLLOUT_GPU_MEM_UTIL=0.65
    "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0,  # VAL_TEMPERATURE=1.0
    "actor_rollout_ref.rollout.val_kwargs.top_p": 1.0,        # VAL_TOP_P=1.0
    "trainer.val_before_train": True,
    # ours, not the script's: bounded (curves end near step 190), resumable
    "trainer.total_training_steps": 200,
    "trainer.resume_mode": "auto",
}


def _num_equal(a, b) -> bool:
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(
            _num_equal(a[k], b[k]) for k in b)
    if isinstance(b, bool) or isinstance(a, bool):
        return str(a).lower() == str(b).lower()
    if isinstance(b, int | float):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return str(a) == str(b)


def with_model_dir(cfg: dict, tmp_path: Path) -> dict:
    """``model.source``: a local directory (the fake verl's HFModelConfig and tokenizer only
    need it to exist), in place of the tiny default's or the paper's hub checkpoint."""
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    cfg["model"].update(source=str(path), revision=None)
    return cfg


def paper_cfg(tmp_path: Path) -> dict:
    cfg = cfgmod.load(REPO / "config/config.yaml", REPO / "config/paper.yaml")
    cfg["train"]["checkpoint_root"] = str(tmp_path / "ckpt")
    cfg["preflight"]["waive"] = ["disk"]
    cfg["run"]["results_root"] = str(tmp_path / "results")
    return with_model_dir(cfg, tmp_path)


def default_cfg(tmp_path: Path) -> dict:
    cfg = cfgmod.load(REPO / "config/config.yaml")
    cfg["run"]["results_root"] = str(tmp_path / "results")
    return with_model_dir(cfg, tmp_path)


TE_MISSING = "not run: no Transformer Engine in this runtime (import transformer_engine failed)"


def bridge_report(path: Path, status: str = "pass", details: str = "") -> Path:
    """A checks/bridge.json (docs/formats/checkpoint.md) whose checks all have ``status``."""
    names = ["mapping_table_agreement", "tiny/roundtrip_tensors", "tiny/expert_bias",
             "tiny/logits", "tiny/bridge_warnings"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "schema_version": 1, "ok": status != "fail",
        "counts": {status: len(names)},
        "checks": [{"name": n, "status": status, "details": details or status, "problems": [],
                    "problem_count": 0} for n in names],
        "environment": {"transformer_engine": status == "pass"}}))
    return path


PASSING = object()  # plan_for's default bridge report: every check passed


def plan_for(cfg: dict, verl, tmp_path: Path, name: str = "out", lock: Path | None = None,
             summary: Path | None = None, checkpoint_check: Path | None = None,
             bridge_check: Path | None | object = PASSING) -> pf.Plan:
    """``pf.run`` on ``cfg`` (a config mapping, validated and typed here) with its outputs
    under ``tmp_path/name``; the plan also when rules are in error (pf.RulesFailed: then
    written to ``refused.json`` alone). The
    bridge report is a passing one unless given."""
    out = tmp_path / name
    if bridge_check is PASSING:
        bridge_check = bridge_report(tmp_path / "checks-pass" / "bridge.json")
    try:
        return pf.run(Config.from_dict(cfg), lock=lock or (verl.lock if verl else None),
                      data_summary=summary, train_files=tmp_path / "data/train.parquet",
                      val_files=tmp_path / "data/val.parquet", checkpoint_check=checkpoint_check,
                      bridge_check=bridge_check, plan=out / "plan.json",
                      launch=out / "launch.sh", refused=out / "refused.json",
                      reward_fn=lambda sha: out / "reward" / f"{sha}.py")
    except pf.RulesFailed as exc:
        assert (out / "refused.json").is_file() and exc.plan.errors
        assert not (out / "plan.json").exists() and not (out / "launch.sh").exists()
        return exc.plan


def hy3rl_preflight(cfg: dict, tmp_path: Path, lock: Path | None) -> int:
    """``hy3rl preflight --configfile <cfg written as YAML>`` in-process, on the layout's
    paths (the lock copied to the layout's deps/lock.json, a passing checks/bridge.json)."""
    config = tmp_path / f"config-{len(list(tmp_path.glob('config-*.yaml')))}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    layout = Layout.from_config(cfg)
    if lock is not None:
        dest = Path(layout.deps_lock)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(lock.read_text())
        bridge_report(Path(layout.checks_bridge))
    return cli.main(["preflight", "--configfile", str(config)])


def rule(plan: pf.Plan, name: str) -> pf.RuleResult:
    return next(r for r in plan.rules if r.name == name)


@pytest.fixture
def verl(fake_verl_repo):
    return fake_verl_repo()


WANDB_NAMES = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL")
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def wandb_login(tmp_path_factory, monkeypatch) -> Path:
    """Every test here runs as a user who ran `wandb login` (a key for api.wandb.ai in the
    netrc file, ``$NETRC``) and has no WANDB_* variable set: the scripted loggers include
    wandb, so rule `wandb` passes. Returns the netrc file (tests of the rule change it)."""
    path = tmp_path_factory.mktemp("home") / ".netrc"
    path.write_text(f"machine api.wandb.ai\n  login user\n  password {FAKE_KEY}\n")
    for name in WANDB_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(path))
    return path


# --------------------------------------------------------------------------- the paper plan


def _check_published(plan: pf.Plan) -> None:
    assert plan.effective, plan.errors
    wrong = {k: (plan.effective.get(k), v) for k, v in PUBLISHED.items()
             if not _num_equal(plan.effective.get(k), v)}
    assert not wrong, f"plan differs from the published run (got, published): {wrong}"


def test_paper_plan_matches_published_values(verl, tmp_path):
    plan = plan_for(paper_cfg(tmp_path), verl, tmp_path)
    _check_published(plan)
    assert plan.ok and plan.launched and plan.errors == []
    assert rule(plan, "disk").status == "waived" and plan.waived[0].startswith("disk: ")
    assert plan.reward["mode"] == "intended"
    # Every value carries its source; the published values are the script's defaults.
    assert plan.resolved["trainer.nnodes"] == {"value": "16", "source": "paper default",
                                             "origin": "script"}
    assert plan.resolved["data.train_files"]["source"] == "config"
    assert plan.resolved["trainer.default_local_dir"]["source"] == "correction"
    src = {k: v["source"] for k, v in plan.effective_sources.items()}
    assert set(src) == set(plan.effective)
    assert src["data.train_batch_size"] == "paper default"
    assert src["data.train_files"] == "config"
    assert src["trainer.total_training_steps"] == "correction"
    # +reward.reward_kwargs.* corrections, then the buffer length set back from the tiny
    # default's by the paper config (train.verl_overrides, last)
    assert plan.effective_sources["reward.reward_kwargs"] == {
        "source": "config", "origin": "train.verl_overrides"}
    assert [o.origin for o in plan.overrides if o.key.startswith("reward.reward_kwargs.")] == [
        "reward_mode=intended (legacy reward_model.* made live)"] * 5 + ["train.verl_overrides"]
    # verl's own checks ran against the fake verl package, every one passed
    assert plan.verl_checks["counts"] == {"pass": 8, "fail": 0, "not run": 0}
    assert rule(plan, "verl").status == "pass" and rule(plan, "bridge").status == "pass"
    assert rule(plan, "overlong_buffer").status == "pass"
    assert rule(plan, "overlong_buffer_window").status == "pass"  # 4096 / 8192: exactly 1/2
    assert rule(plan, "runtime_tag").status == "warning"  # the guide's image, by tag
    assert plan.effective_sources["actor_rollout_ref.actor.optim.lr_decay_style"] == {
        "source": "paper default", "origin": "verl config default (not overridden)"}
    assert plan.estimate["gpu_hours"] > 0 and "GPU-hours" in plan.estimate["formula"]
    # the KL-0 reference pass, priced: 2 x active params x tokens per step, at the train MFU
    i = plan.estimate["inputs"]
    ref_h = 2 * 21e9 * i["tokens_per_step"] / (148e12 * 0.2) * 200 / 3600
    assert i["active_params"] == 21e9 and i["tokens_per_step"] == 128 * 16 * (512 + 4096)
    assert plan.estimate["costs"]["reference_gpu_hours"] == round(ref_h, 1)
    assert rule(plan, "ref_kl_zero").messages[0].endswith(
        f"; cost ~{round(ref_h, 1):g} GPU-hours over 200 steps (estimate)")
    on_disk = json.loads((tmp_path / "out/plan.json").read_text())
    assert on_disk["effective"]["data.train_batch_size"] == 128
    assert on_disk["overrides"][0]["source"] in ("paper default", "config")
    got = {c["name"]: c for c in on_disk["verl_checks"]["checks"]}
    assert got["reward_manager"]["status"] == "pass"
    assert got["reward_manager"]["message"] == "DAPORewardManager (dapo)"
    assert on_disk["verl_checks"]["model_dir"] == str(tmp_path / "model")
    assert list(on_disk)[list(on_disk).index("rules") + 1] == "verl_checks"


@pytest.mark.slow  # verl's own validators in a subprocess (torch, verl)
def test_paper_plan_against_real_pinned_verl(tmp_path, tiny_hy3_dir, real_verl):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=real_verl, capture_output=True,
                          text=True).stdout.strip()
    lock = write_lock(tmp_path / "lock.json", real_verl, head)
    cfg = paper_cfg(tmp_path)
    cfg["model"]["source"] = str(tiny_hy3_dir)  # verl reads its HF config and tokenizer
    plan = plan_for(cfg, None, tmp_path, lock=lock)
    _check_published(plan)
    assert plan.ok, plan.errors
    # verl's own validation of the paper config, every check run and passed
    checks = plan.verl_checks["checks"]
    assert [c["name"] for c in checks] == [
        "validate_config", "actor_rollout_ref.model", "actor_rollout_ref.actor",
        "actor_rollout_ref.actor.profiler", "actor_rollout_ref.ref",
        "actor_rollout_ref.rollout", "actor_rollout_ref.rollout.checkpoint_engine",
        "reward_manager"], checks
    assert plan.verl_checks["counts"] == {"pass": 8, "fail": 0, "not run": 0}, checks
    assert plan.reward["scripted_manager"] == "naive" and plan.reward["scripted_kwargs"] is None
    assert rule(plan, "health_metrics").status == "pass"  # hy3rl.health.VERL_METRICS holds
    assert plan.reward["legacy_migration_callers"] == [
        "verl/experimental/fully_async_policy/fully_async_main.py"]
    # the pinned schedule is constant (segments allowed); an unknown key names itself
    cfg["train"]["segment_steps"] = 50
    cfg["train"]["verl_overrides"]["trainer.totl_training_steps"] = 3
    bad = plan_for(cfg, None, tmp_path, "bad", lock=lock)
    assert rule(bad, "compose").status == "error"
    assert "trainer.totl_training_steps" in rule(bad, "compose").messages[0]
    del cfg["train"]["verl_overrides"]["trainer.totl_training_steps"]
    seg = plan_for(cfg, None, tmp_path, "seg", lock=lock)
    assert rule(seg, "segment_schedule").status == "pass" and seg.ok, seg.errors


# --------------------------------------------------------------------------- resolution


def test_segment_steps_with_constant_schedule_passes(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    cfg["train"]["segment_steps"] = 50  # lr = min_lr = 1e-6, no warmup: constant
    plan = plan_for(cfg, verl, tmp_path)
    assert rule(plan, "segment_schedule").status == "pass" and plan.ok, plan.errors
    assert plan.estimate["inputs"]["starts"] == 4  # 200 steps / 50: four jobs, four starts


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_reward_mode_scripted_keeps_upstream_behaviour(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    cfg["train"]["reward_mode"] = "scripted"
    plan = plan_for(cfg, verl, tmp_path)
    assert plan.ok, plan.errors
    assert plan.effective["reward.reward_manager.name"] == "naive"
    # no correction; only the config's buffer length (++: added, inert without `enable` and
    # under the naive manager, which reads no reward_kwargs)
    assert [o.origin for o in plan.overrides if o.key.startswith("reward.")] == [
        "train.verl_overrides"]
    assert plan.effective["reward.reward_kwargs"] == {"overlong_buffer_cfg": {"len": 4096}}
    finding = plan.reward["finding"]
    assert "reads only reward.*" in finding
    assert "verl/experimental/fully_async_policy/fully_async_main.py" in finding
    assert plan.reward["entrypoint_migrates_legacy_keys"] is False
    cfg["train"]["verl_overrides"] = {}  # as the script alone composes
    bare = plan_for(cfg, verl, tmp_path, "bare")
    assert bare.effective["reward.reward_kwargs"] is None
    assert not [o for o in bare.overrides if o.key.startswith("reward.")]


def test_entrypoint_that_migrates_makes_legacy_keys_live(fake_verl_repo, tmp_path):
    main = ("from verl.experimental.reward_loop import migrate_legacy_reward_impl\nimport hydra\n"
            "@hydra.main(config_path='config', config_name='ppo_trainer')\n"
            "def main(config):\n    migrate_legacy_reward_impl(config)\n")
    verl = fake_verl_repo(extra_files={"verl/trainer/main_ppo.py": main})
    plan = plan_for(paper_cfg(tmp_path), verl, tmp_path)
    assert plan.reward["entrypoint_migrates_legacy_keys"] is True
    assert "they are live" in plan.reward["finding"]
    assert not [o for o in plan.overrides if o.key.startswith("reward.")
                and o.origin != "train.verl_overrides"]  # no correction


def test_corrections_and_rendered_launch(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    cfg["train"]["loggers"] = ["console", "tensorboard"]
    plan = plan_for(cfg, verl, tmp_path)
    last = {o.key: o for o in plan.overrides}
    assert last["trainer.default_local_dir"].value == str(tmp_path / "ckpt" / "hy3-grpo-paper")
    assert plan.effective["trainer.default_local_dir"] == str(tmp_path / "ckpt/hy3-grpo-paper")
    assert plan.effective["trainer.total_training_steps"] == 200
    assert plan.effective["trainer.resume_mode"] == "auto"
    assert plan.effective["trainer.logger"] == ["console", "tensorboard", "file"]
    assert plan.loggers["env"]["file"] == ["VERL_FILE_LOGGER_PATH"]
    assert plan.script_exports == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

    # Run launch.sh for real inside the verl dir with a python3 that prints its argv.
    launch = tmp_path / "out/launch.sh"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], "
        "'cuda': os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}))\n")
    (bindir / "python3").chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    missing = subprocess.run(["bash", str(launch)], cwd=verl.path, env=env, capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "VERL_FILE_LOGGER_PATH is not set" in missing.stderr
    log = tmp_path / "train/attempts/attempt-1.metrics.jsonl"
    env["VERL_FILE_LOGGER_PATH"] = str(log)
    wrong_dir = subprocess.run(["bash", str(launch)], cwd=tmp_path, env=env,
                               capture_output=True, text=True)
    assert wrong_dir.returncode == 2 and "verl working dir" in wrong_dir.stderr
    ok = subprocess.run(["bash", str(launch), "trainer.val_before_train=false"], cwd=verl.path,
                        env=env, capture_output=True, text=True, check=True)
    got = json.loads(ok.stdout)
    assert got["argv"] == ["-m", "verl.trainer.main_ppo", *[o.text for o in plan.overrides],
                           "trainer.val_before_train=false"]
    assert got["cuda"] == "1" and log.parent.is_dir()


def test_unknown_key_is_an_error_naming_it(verl, tmp_path, capsys):
    cfg = paper_cfg(tmp_path)
    cfg["train"]["verl_overrides"] = {"trainer.totl_training_steps": 3}
    rc = hy3rl_preflight(cfg, tmp_path, verl.lock)
    assert rc == 1
    err = capsys.readouterr().err
    assert "compose:" in err and "trainer.totl_training_steps" in err
    plan = json.loads(Path(Layout.from_config(cfg).preflight_refused).read_text())
    assert plan["ok"] is False and plan["rules"][3]["name"] == "compose"
    assert "trainer.totl_training_steps" in plan["errors"][0]
    # nothing composed, so none of verl's own checks ran: recorded, and why
    assert plan["verl_checks"]["counts"] == {"pass": 0, "fail": 0, "not run": 1}
    (check,) = plan["verl_checks"]["checks"]
    assert (check["name"], check["status"]) == ("verl_checks", "not run")
    assert check["reason"].startswith("not composed")
    for i, name in ((4, "owned_keys"), (5, "verl")):
        assert plan["rules"][i] == {"name": name, "status": "not run",
                                    "messages": ["not run: the config did not compose"]}


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_verl_overrides_algorithm_and_reward_function(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    fn = tmp_path / "my_reward.py"
    fn.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return 1.0\n")
    cfg["train"]["reward_function"] = {"path": str(fn), "name": "score"}
    cfg["train"]["algorithm"] = {"adv_estimator": "rloo", "loss_mode": "gspo"}
    cfg["train"]["verl_overrides"] = {
        "actor_rollout_ref.rollout.temperature": 1.0,
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff": 0.0,
        "trainer.val_before_train": False,
    }
    plan = plan_for(cfg, verl, tmp_path)
    assert plan.ok, plan.errors
    eff = plan.effective
    assert eff["algorithm.adv_estimator"] == "rloo"
    assert eff["actor_rollout_ref.actor.policy_loss.loss_mode"] == "gspo"
    assert eff["actor_rollout_ref.rollout.temperature"] == 1.0
    copy_ = tmp_path / "out/reward" / f"{hashlib.sha256(fn.read_bytes()).hexdigest()}.py"
    assert eff["reward.custom_reward_function.path"] == str(copy_)
    assert copy_.read_text() == fn.read_text()
    assert plan.overrides[-1].origin == "train.verl_overrides"
    assert plan.resolved["actor_rollout_ref.rollout.temperature"]["source"] == "config"
    assert rule(plan, "val_on_resume").status == "pass"


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_a_refused_preflight_leaves_the_approved_launch_as_it_was(verl, tmp_path, capsys):
    """Issue 27 item 3: the reward function is copied to a content-addressed path that the
    launch names, and only by a passing preflight. Editing the reward and running a preflight
    that is refused (here an invalid SAVE_FREQ) leaves every file of the approved launch
    byte-identical: plan.json, launch.sh and the reward copy it points at; the refusal's plan
    goes to plan.refused.json alone, and the next passing preflight removes it."""
    cfg = paper_cfg(tmp_path)
    cfg["data"]["heldout"] = cfg["eval"]["select"] = None  # no held-out file written here
    fn = tmp_path / "my_reward.py"
    fn.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return 1.0\n")
    cfg["train"]["reward_function"] = {"path": str(fn), "name": "score"}
    layout = Layout.from_config(cfg)
    assert hy3rl_preflight(cfg, tmp_path, verl.lock) == 0
    copy_ = Path(layout.preflight_reward_fn(hashlib.sha256(fn.read_bytes()).hexdigest()))
    launch = Path(layout.preflight_launch).read_text()
    assert f"reward.custom_reward_function.path={copy_.absolute()}" in launch
    approved = [Path(layout.preflight_plan), Path(layout.preflight_launch), copy_]
    before = {p: p.read_bytes() for p in approved}

    fn.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return 0.0\n")
    save_freq = cfg["train"]["env"]["SAVE_FREQ"]
    assert hy3rl_preflight(_set(cfg, env={"SAVE_FREQ": -1}), tmp_path, verl.lock) == 1
    assert "save_test_freq: trainer.save_freq = -1" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in approved} == before
    assert sorted(copy_.parent.iterdir()) == [copy_]  # the new reward was not copied
    refused = json.loads(Path(layout.preflight_refused).read_text())
    assert refused["ok"] is False and refused["errors"][0].startswith("save_test_freq: ")

    # fixed: the new reward gets its own copy beside the old one, which stays
    cfg["train"]["env"]["SAVE_FREQ"] = save_freq
    assert hy3rl_preflight(cfg, tmp_path, verl.lock) == 0
    new = Path(layout.preflight_reward_fn(hashlib.sha256(fn.read_bytes()).hexdigest()))
    assert sorted(copy_.parent.iterdir()) == sorted([copy_, new])
    assert copy_.read_bytes() == before[copy_] and new.read_bytes() == fn.read_bytes()
    assert str(new.absolute()) in Path(layout.preflight_launch).read_text()
    assert not Path(layout.preflight_refused).exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("named_by", ["reward_function", "verl_override"])
def test_an_edited_file_the_identity_counts_makes_preflight_out_of_date(tmp_path, named_by):
    """The reward function, and a file an override names for a trajectory key (issue 27: the
    identity counts it by content), are inputs of rule preflight: with every input and
    output of the stage in place (made by hand here, older than the plan), touching the file
    makes a dry run re-run preflight for it, and for nothing else."""
    from fixtures.common import run_snakemake

    named = tmp_path / "named.py"
    override = tmp_path / "named.yaml"
    if named_by == "reward_function":
        over = {"train": {"reward_function": {"path": str(named), "name": "score"}}}
    else:  # a custom dataset class, and an operational key's path that must not count
        over = {"train": {"verl_overrides": {"data.custom_cls.path": str(named),
                                             "trainer.project_name": str(override)}}}
    override.write_text(yaml.safe_dump(over))
    cfg = cfgmod.load(REPO / "config/config.yaml", override)
    layout = Layout.from_config(cfg)
    work = tmp_path / "work"
    made = [layout.deps_lock, layout.deps_runtime_env, layout.model_manifest, layout.data_train,
            layout.data_val, layout.data_heldout, layout.data_summary, layout.checks_checkpoint]
    (work / cfg["model"]["source"]).mkdir(parents=True)  # rule tiny_model's directory
    for i, rel in enumerate([*made, layout.preflight_plan, layout.preflight_launch]):
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    os.utime(work / cfg["model"]["source"], (999_000, 999_000))
    os.utime(override, (999_000, 999_000))
    named.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return 1.0\n")  # now: newer than the plan
    proc = run_snakemake(["-n", layout.preflight_plan, "--profile", str(REPO / "profiles/local"),
                          "--configfile",
                          str(REPO / "config/config.yaml"), str(override)], work)
    out = proc.stdout + proc.stderr
    jobs = re.findall(r"^(?:local)?rule (\w+):$", out, flags=re.M)
    assert jobs == ["preflight"], out[-3000:]
    assert f"reason: Updated input files: {named}" in out, out[-3000:]


def test_override_paths_are_the_files_trajectory_overrides_name(tmp_path):
    """hy3rl.identity.override_paths: files and the files under directories that overrides
    and launch knobs give to trajectory keys; not a missing path, not an operational key's,
    not a workflow-owned key's (refused by preflight, named by the workflow key)."""
    from hy3rl.identity import override_paths

    f = tmp_path / "cls.py"
    f.write_text("x = 1\n")
    d = tmp_path / "server"
    (d / "sub").mkdir(parents=True)
    (d / "a.py").write_text("a\n")
    (d / "sub" / "b.py").write_text("b\n")
    cfg = {"train": {"verl_overrides": {
        "data.custom_cls.path": str(f),
        "actor_rollout_ref.rollout.agent.custom_async_server.path": f"'{d}'",
        "reward_model.model.path": str(tmp_path / "missing"),
        "trainer.project_name": str(f.with_name("op.py")),
        "data.train_files": str(f.with_name("owned.parquet")),
    }, "env": {"MY_FILE": str(f), "PROJECT_NAME": str(f.with_name("op.py"))}}}
    for name in ("op.py", "owned.parquet"):
        (tmp_path / name).write_text("")
    assert override_paths(cfg) == sorted([str(f), str(d / "a.py"), str(d / "sub" / "b.py")])
    assert override_paths({"train": {}}) == []


def test_recipe_script_gets_hy3_settings_carried_over(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    cfg["train"]["launch_script"] = "recipe/toy/run_toy.sh"
    plan = plan_for(cfg, verl, tmp_path)
    carried = {o.key: o for o in plan.overrides if o.origin.startswith("hy3-required")}
    assert carried["model_engine"].text == "model_engine=megatron"
    key = "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_bias_update_rate"
    assert carried[key].text == f"+{key}=0" and carried[key].source == "correction"
    assert plan.effective["actor_rollout_ref.actor.strategy"] == "megatron"
    assert plan.effective["actor_rollout_ref.model.path"] == str(
        Path(cfg["model"]["source"]).absolute())
    assert plan.effective["algorithm.adv_estimator"] == "rloo"  # the recipe's own choice
    assert plan.verl["script"] == "recipe/toy/run_toy.sh"


def test_knob_errors(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    cfg["train"]["env"].update({"ACTR_PP": 4, "NNODES": 2})
    plan = plan_for(cfg, verl, tmp_path)
    msgs = rule(plan, "knobs").messages
    assert any("train.env.ACTR_PP: the launch script does not read this knob" in m for m in msgs)
    assert any("train.env.NNODES: set cluster.nodes instead" in m for m in msgs)


def test_default_config_plans_the_cpu_path(verl, tmp_path):
    """The embedded default trains on the CPU path: the pinned script's launch moved to verl's
    FSDP engine (every Megatron override dropped, named, with why), the CPU overrides added
    with their reasons, the environment of verl's processes recorded; the allocation rules
    stay `not run` (no GPU) and rule cpu_path passes."""
    cfg = default_cfg(tmp_path)
    plan = plan_for(cfg, verl, tmp_path, bridge_check=None)
    assert plan.ok, plan.errors
    assert plan.launched and plan.not_launched_reason is None
    assert rule(plan, "actor_layout").status == "not run"
    assert rule(plan, "bridge").messages == ["not run: no GPU allocation (cluster.gpu is false)"]
    assert rule(plan, "cpu_path").status == "pass", rule(plan, "cpu_path")
    eff = plan.effective
    cpu = plan.cpu_path
    assert cpu["engine"] == "dp" and cpu["ranks"] == 1 and cpu["ray_cpus"] == 16
    assert cpu["env"]["VERL_USE_EXTERNAL_MODULES"] == "hy3rl.verl_cpu"
    assert cpu["env"]["VERL_PLATFORM"] == "cpu"
    dropped = {d["override"].lstrip("+").split("=")[0]: d["why"] for d in cpu["dropped"]}
    assert dropped["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"] == \
        "Megatron engine only"
    assert not any("megatron" in o.text for o in plan.overrides)
    resolved = plan.resolved
    assert resolved["model_engine"]["value"] == "dp"
    assert resolved["model_engine"]["origin"] == "train.cpu (was model_engine=megatron)"
    assert resolved["actor_rollout_ref.rollout.name"]["source"] == "cpu path"
    assert "replica.py" in resolved["actor_rollout_ref.rollout.name"]["origin"]
    assert resolved["trainer.n_gpus_per_node"]["value"] == "1"
    # the tiny plan passes the DAPO assert, ours and verl's: buffer 32 of 64 response tokens
    assert eff["reward.reward_kwargs"]["overlong_buffer_cfg"]["len"] == 32
    assert eff["reward.reward_kwargs"]["max_resp_len"] == 64
    for name in ("overlong_buffer", "reward_max_resp_len", "overlong_buffer_window", "verl",
                 "health_metrics", "hf_weights", "eval_steps_saved"):
        assert rule(plan, name).status == "pass", rule(plan, name)
    assert {c["name"]: c["status"] for c in plan.verl_checks["checks"]}["reward_manager"] == "pass"
    assert eff["data.train_batch_size"] == 4
    assert eff["trainer.default_local_dir"] == str(tmp_path / "results/tiny-default/checkpoints")
    # the launch names the CPU path's values, in the order verl reads them (later wins)
    text = (tmp_path / "out/launch.sh").read_text()
    assert "    actor_rollout_ref.rollout.name=hf \\\n" in text
    assert "    model_engine=dp \\\n" in text and ".megatron." not in text


def test_without_the_cpu_path_the_default_plans_no_launch(verl, tmp_path):
    cfg = default_cfg(tmp_path)
    cfg["train"]["cpu"]["enable"] = False
    plan = plan_for(cfg, verl, tmp_path, bridge_check=None)
    assert plan.ok, plan.errors
    assert not plan.launched and plan.not_launched_reason == (
        "not launched: no GPU (cluster.gpu is false) and not the CPU path "
        "(train.cpu.enable is false)")
    assert plan.cpu_path is None
    assert rule(plan, "cpu_path").status == "not run"
    assert any(o.text == "model_engine=megatron" for o in plan.overrides)


@pytest.mark.parametrize("override, message", [
    ({"actor_rollout_ref.rollout.name": "vllm"},
     "actor_rollout_ref.rollout.name = 'vllm' but the CPU path needs 'hf'"),
    ({"trainer.device": "cuda"}, "trainer.device = 'cuda' but the CPU path needs 'cpu'"),
    ({"actor_rollout_ref.actor.strategy": "fsdp"},
     "actor_rollout_ref.actor.strategy = 'fsdp' but the CPU path needs 'fsdp2'"),
])
def test_the_cpu_path_refuses_an_override_that_moves_its_values(verl, tmp_path, override,
                                                                  message):
    cfg = default_cfg(tmp_path)
    cfg["train"]["verl_overrides"].update(override)
    plan = plan_for(cfg, verl, tmp_path, bridge_check=None)
    res = rule(plan, "cpu_path")
    assert res.status == "error" and not plan.ok, res
    assert any(m.startswith(message) for m in res.messages), res.messages


def test_the_cpu_path_refuses_ranks_that_do_not_divide_the_batch(verl, tmp_path):
    cfg = default_cfg(tmp_path)
    cfg["train"]["cpu"]["ranks"] = 3
    plan = plan_for(cfg, verl, tmp_path, bridge_check=None)
    res = rule(plan, "cpu_path")
    assert res.status == "error", res
    assert "data.train_batch_size = 4 is not divisible by train.cpu.ranks = 3" in res.messages


def test_the_cpu_path_beside_gpus_is_refused_before_anything_runs(tmp_path):
    cfg = default_cfg(tmp_path)
    cfg["cluster"]["gpu"] = True
    with pytest.raises(ConfigError, match=r"train.cpu.enable: .* refused with cluster.gpu"):
        Config.from_dict(cfg)


def test_health_rule_naming_a_metric_verl_does_not_log_is_refused(verl, tmp_path):
    """train.health: a key verl does not log is refused by key, naming the keys verl logs;
    the rule cannot be waived."""
    cfg = paper_cfg(tmp_path)
    health = cfg["train"]["health"]
    health["drift"]["metric"] = "training/rollout_prob_diff_mean"  # misspelt
    health["nonfinite"]["metrics"] = ["actor/pg_loss", "actor/gradnorm"]
    plan = plan_for(cfg, verl, tmp_path)
    res = rule(plan, "health_metrics")
    assert res.status == "error" and not plan.ok, res
    assert len(res.messages) == 2, res.messages
    assert res.messages[0].startswith(
        "train.health.nonfinite.metrics[1]: 'actor/gradnorm' is not a metric verl logs; "
        "verl logs actor/pg_loss, actor/grad_norm, actor/entropy, ")
    assert res.messages[1].startswith("train.health.drift.metric: "
                                      "'training/rollout_prob_diff_mean' is not a metric")
    assert "training/rollout_probs_diff_mean" in res.messages[1]
    assert "val-core/<data_source>/<variable>/mean@<n>" in res.messages[1]
    assert "health_metrics" in pf.NOT_WAIVABLE
    # the other refusals (a line the clone lacks, no rollout log-probs): tests/test_health.py


def test_health_rules_over_what_the_composed_config_switches_off_are_refused(verl, tmp_path):
    """Issue 41, through preflight: bypass_mode composed true refuses the rules over
    actor/entropy and training/rollout_probs_diff_*; a validation key whose data source
    the data summary's validation set lacks is refused naming both."""
    cfg = paper_cfg(tmp_path)
    cfg["train"]["verl_overrides"] = {
        **(cfg["train"].get("verl_overrides") or {}),
        "+algorithm.rollout_correction.bypass_mode": True}
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"val_n": 1, "splits": {
        "train": {"rows": 256, "data_sources": {"math_dapo": 256}},
        "val": {"rows": 960, "data_sources": {"aime2024": 960}}}}))
    plan = plan_for(cfg, verl, tmp_path, summary=summary)
    res = rule(plan, "health_metrics")
    assert res.status == "error" and not plan.ok, res
    keys = sorted(m.split(":")[0] for m in res.messages)
    assert keys == ["train.health.drift.metric", "train.health.entropy.metric",
                    "train.health.validation.metric"], res.messages
    assert any("bypass_mode=True" in m for m in res.messages)
    assert any("(data summary: aime2024)" in m for m in res.messages)


WANDB_CASES = {  # environment, netrc text (None: no file) -> status, message part
    "netrc login": ({}, "keep", "pass", None),
    "api key": ({"WANDB_API_KEY": FAKE_KEY}, None, "pass", None),
    "offline": ({"WANDB_MODE": "offline"}, None, "pass", None),
    "disabled": ({"WANDB_MODE": "disabled"}, None, "pass", None),
    "nothing": ({}, None, "error", "WANDB_API_KEY is not set, there is no {netrc}, and "
                "WANDB_MODE is not set. verl's wandb.init would fail when the trainer starts"),
    "online, no key": ({"WANDB_MODE": "online"}, None, "error", "WANDB_MODE is 'online'"),
    "misspelt mode": ({"WANDB_MODE": "ofline", "WANDB_API_KEY": FAKE_KEY}, None, "error",
                      "WANDB_MODE='ofline' is not a W&B mode"),
    "other server": ({"WANDB_BASE_URL": "https://wandb.example.org"}, "keep", "error",
                     "{netrc} has no key for wandb.example.org"),
    "other server's key": ({"WANDB_BASE_URL": "https://wandb.example.org"},
                           f"machine wandb.example.org login u password {FAKE_KEY}\n",
                           "pass", None),
    "broken netrc": ({}, f"machine api.wandb.ai\n{FAKE_KEY}\n", "error",  # key, no keyword
                     "{netrc} cannot be parsed (line 3)"),
    "empty key": ({}, "machine api.wandb.ai login u\n", "error", "{netrc} has no key for "
                  "api.wandb.ai"),
}


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("case", sorted(WANDB_CASES))
def test_wandb_rule(verl, tmp_path, monkeypatch, wandb_login, case):
    """Rule wandb on the paper plan (the script's loggers: console, wandb): verl calls
    wandb.init at the trainer's start, after the allocation; a job that cannot start W&B is
    refused before it."""
    environ, netrc_text, status, message = WANDB_CASES[case]
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if netrc_text is None:
        wandb_login.unlink()
    elif netrc_text != "keep":
        wandb_login.write_text(netrc_text)
    plan = plan_for(paper_cfg(tmp_path), verl, tmp_path)
    res = rule(plan, "wandb")
    assert res.status == status, res
    if message:
        assert message.format(netrc=wandb_login) in res.messages[0], res.messages
        assert not plan.ok and any(e.startswith("wandb: ") for e in plan.errors)
    assert FAKE_KEY not in json.dumps(res.messages)


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_wandb_rule_not_run_without_training_and_waivable(verl, tmp_path, wandb_login):
    wandb_login.unlink()  # no key anywhere
    cfg = default_cfg(tmp_path)
    cfg["train"]["cpu"]["enable"] = False  # no training at all
    cfg["train"]["loggers"] = []  # the script's console + wandb
    plan = plan_for(cfg, verl, tmp_path, bridge_check=None)
    assert rule(plan, "wandb").messages == ["not run: no GPU allocation (cluster.gpu is false)"]
    # the CPU path trains: W&B would fail there just the same; the default logs to console
    cfg["train"]["cpu"]["enable"] = True
    plan = plan_for(cfg, verl, tmp_path, name="cpu", bridge_check=None)
    assert rule(plan, "wandb").status == "error"
    plan = plan_for(default_cfg(tmp_path), verl, tmp_path, name="default", bridge_check=None)
    assert rule(plan, "wandb").status == "pass" and plan.resolved["trainer.logger"]["value"] \
        == "[console,file]"
    cfg = paper_cfg(tmp_path)
    cfg["train"]["loggers"] = ["console"]  # no wandb: nothing to start
    assert rule(plan_for(cfg, verl, tmp_path, name="console"), "wandb").status == "pass"
    cfg = paper_cfg(tmp_path)
    cfg["preflight"]["waive"] = ["disk", "wandb"]  # e.g. the training image carries the key
    plan = plan_for(cfg, verl, tmp_path, name="waived")
    assert rule(plan, "wandb").status == "waived" and plan.ok


def test_required_rollout_tp_table():
    # Hy3 BF16 weights, gpu_memory_utilization 0.65 (docs/formats/preflight.md table).
    assert pf.required_rollout_tp(HY3_BYTES, 96, 0.65) == 16   # H20
    assert pf.required_rollout_tp(HY3_BYTES, 80, 0.65) == 16   # H100
    assert pf.required_rollout_tp(HY3_BYTES, 141, 0.65) == 8   # H200
    assert pf.required_rollout_tp(10**9, 96, 0.65) == 1


# --------------------------------------------------------------------------- each rule


def _set(cfg: dict, env: dict | None = None, over: dict | None = None, **train) -> dict:
    cfg["train"]["env"].update(env or {})
    cfg["train"]["verl_overrides"].update(over or {})
    cfg["train"].update(train)
    return cfg


BUFFER_LEN = "++reward.reward_kwargs.overlong_buffer_cfg.len"  # as config/*.yaml set it

ERROR_CASES = {
    "hf_weights": (lambda c: _set(c, over={
        "actor_rollout_ref.actor.megatron.use_dist_checkpointing": True}),
        "add hf_model to actor_rollout_ref.actor.checkpoint.save_contents"),
    "gpus": (lambda c: _set(c, over={"trainer.nnodes": 4}),
             "verl's trainer.nnodes x trainer.n_gpus_per_node = 4 x 8 = 32 but the allocation "
             "is cluster.nodes x cluster.gpus_per_node = 16 x 8 = 128"),
    "actor_layout": (lambda c: _set(c, env={"ACTOR_PP": 3}),
                     "actor TP x PP x CP = 1 x 3 x 8 = 24 does not divide the 128 GPUs"),
    "ref_layout": (lambda c: _set(c, over={
        "actor_rollout_ref.ref.megatron.expert_model_parallel_size": 3}),
        "ref EP x ETP x PP = 3 x 1 x 16 = 48 does not divide the 128 GPUs"),
    "rollout_tp": (lambda c: _set(c, env={"ROLLOUT_TP": 8}),
                   "rollout TP = 8 is below the 16 needed: 597.6 GB of weights / (96 GB x "
                   "gpu_memory_utilization 0.65) = 9.58 GPUs"),
    "actor_token_budget": (lambda c: _set(c, env={"PPO_MAX_TOKEN_LEN_PER_GPU": 1000}),
                           "ppo_max_token_len_per_gpu x CP = 1000 x 8 = 8000 < "
                           "max_prompt_length + max_response_length = 2048 + 8192 = 10240"),
    "max_model_len": (lambda c: _set(c, env={"ROLLOUT_MAX_MODEL_LEN": 9000}),
                      "rollout.max_model_len = 9000 < max_prompt_length + max_response_length "
                      "= 2048 + 8192 = 10240"),
    "log_prob_token_budget": (lambda c: _set(c, env={"REF_LOG_PROB_MAX_TOKEN_LEN_PER_GPU": 1000}),
                              "ref.log_prob_max_token_len_per_gpu x CP = 1000 x 8 = 8000 < "
                              "2048 + 8192 = 10240"),
    "batch_divisible": (lambda c: _set(c, env={"TRAIN_BATCH_SIZE": 100, "PPO_MINI_BATCH_SIZE": 100,
                                               "ACTOR_PP": 1, "ACTOR_CP": 1}),
                        "train_batch_size x n = 100 x 16 = 1600 is not divisible by the actor's "
                        "data-parallel size 128 / (1) = 128"),
    "total_steps": (lambda c: _set(c, total_training_steps=0),
                    "trainer.total_training_steps = 0: set train.total_training_steps > 0"),
    "save_test_freq": (lambda c: _set(c, env={"SAVE_FREQ": 500}),
                       "trainer.save_freq = 500 > total_training_steps = 200"),
    "checkpoint_root": (lambda c: _set(c, checkpoint_root="relative/ckpt"),
                        "train.checkpoint_root = 'relative/ckpt' is relative"),
    "async_save": (lambda c: _set(c, over={"actor_rollout_ref.actor.checkpoint.async_save": True}),
                   "async_save = True: verl then does not write latest_checkpointed_iteration"),
    "segment_schedule": (lambda c: _set(c, segment_steps=50, over={
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 10}),
        "train.segment_steps = 50 needs a constant learning rate"),
    "overlong_buffer": (lambda c: _set(c, over={BUFFER_LEN: 10000}),
                        "reward.reward_kwargs.overlong_buffer_cfg.len = 10000 > "
                        "reward.reward_kwargs.max_resp_len = 8192: verl's DAPO reward manager "
                        "asserts max_resp_len >= overlong_buffer.len only at trainer setup"),
    "reward_max_resp_len": (lambda c: _set(c, over={"reward.reward_kwargs.max_resp_len": 6000}),
                            "reward.reward_kwargs.max_resp_len = 6000 != "
                            "data.max_response_length = 8192"),
    # the fake verl's ActorConfig.__post_init__ raises as verl's does
    "verl": (lambda c: _set(c, over={"actor_rollout_ref.actor.loss_agg_mode": "bogus"}),
             "actor_rollout_ref.actor: verl raised ValueError: Invalid loss_agg_mode: bogus "
             "(at verl/workers/config/__init__.py:"),
}


# The other failure mode of rules with several (the waiver is tested once per rule above).
MORE_ERROR_CASES = {
    "gpus/zero": (lambda c: c["cluster"].update(gpus_per_node=0) or c,
                  "cluster.gpu is true but cluster.nodes x cluster.gpus_per_node = 16 x 0 = 0"),
    "actor_layout/expert": (lambda c: _set(c, env={"ACTOR_EP": 3}),
                            "actor EP x ETP x PP = 3 x 1 x 16 = 48 does not divide the 128 GPUs"),
    "rollout_tp/divides": (lambda c: _set(c, env={"ROLLOUT_TP": 24}),
                           "rollout TP = 24 does not divide the 128 GPUs (ROLLOUT_TP)"),
    "max_model_len/batched_tokens": (lambda c: _set(c, env={
        "ROLLOUT_MAX_NUM_BATCHED_TOKENS": 9000}, over={
        "actor_rollout_ref.rollout.enable_chunked_prefill": False}),
        "rollout.max_num_batched_tokens = 9000 < 10240 with chunked prefill off"),
    "log_prob_token_budget/rollout": (lambda c: _set(c, env={
        "ROLLOUT_LOG_PROB_MAX_TOKEN_LEN_PER_GPU": 1000}),
        "rollout.log_prob_max_token_len_per_gpu x CP = 1000 x 8 = 8000 < 2048 + 8192 = 10240"),
    "batch_divisible/mini": (lambda c: _set(c, env={"TRAIN_BATCH_SIZE": 96}),
                             "data.train_batch_size = 96 is not a positive multiple of "
                             "actor.ppo_mini_batch_size = 128"),
    "save_test_freq/test": (lambda c: _set(c, env={"TEST_FREQ": 300}),
                            "trainer.test_freq = 300 > total_training_steps = 200"),
    "save_test_freq/no_save": (lambda c: _set(c, env={"SAVE_FREQ": -1}),
                               "trainer.save_freq = -1: no checkpoint would be saved"),
    "checkpoint_root/empty": (lambda c: _set(c, checkpoint_root=""),
                              "train.checkpoint_root is empty"),
    "compose/not_a_number": (lambda c: _set(c, env={"ACTOR_PP": "sixteen"}),
                             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size = "
                             "'sixteen' is not a number"),
    "segment_schedule/decay": (lambda c: _set(c, segment_steps=50, over={
        "actor_rollout_ref.actor.optim.lr_decay_style": "cosine",
        "actor_rollout_ref.actor.optim.min_lr": 0.0}),
        "lr_decay_style = cosine, lr = 1e-06, min_lr = 0"),
    "overlong_buffer/not_positive": (lambda c: _set(c, over={BUFFER_LEN: 0}),
                                     "reward.reward_kwargs.overlong_buffer_cfg.len = 0 with the "
                                     "buffer enabled: verl's DAPO reward manager asserts it is "
                                     "positive"),
    "overlong_buffer/no_max_resp_len": (lambda c: _set(c, over={
        "++reward.reward_kwargs.max_resp_len": None}),
        "reward.reward_kwargs.overlong_buffer_cfg is enabled (len = 4096) but "
        "reward.reward_kwargs.max_resp_len is not set"),
    "verl/post_init": (lambda c: _set(c, over={"actor_rollout_ref.rollout.mode": "sync"}),
                       "actor_rollout_ref.rollout: verl raised ValueError: Rollout mode 'sync' "
                       "has been removed. (at verl/workers/config/__init__.py:"),
}


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("case", sorted(MORE_ERROR_CASES))
def test_rule_other_failure_modes(verl, tmp_path, case):
    mutate, message = MORE_ERROR_CASES[case]
    name = case.split("/")[0]
    plan = plan_for(mutate(paper_cfg(tmp_path)), verl, tmp_path)
    res = rule(plan, name)
    assert res.status == "error", (res, plan.errors)
    assert any(message in m for m in res.messages), res.messages
    assert not plan.ok


def test_waivers(verl, tmp_path):
    # a waived warning shows as waived, with its message under `waived`
    cfg = paper_cfg(tmp_path)
    cfg["preflight"]["waive"] = ["disk", "val_on_resume"]
    plan = plan_for(cfg, verl, tmp_path)
    assert rule(plan, "val_on_resume").status == "waived"
    assert any(w.startswith("val_on_resume: ") for w in plan.waived)
    assert not any(w.startswith("val_on_resume: ") for w in plan.warnings)
    assert rule(plan, "ref_kl_zero").status == "warning"
    # compose cannot be waived; an unknown name is refused (by the schema) before anything runs
    for bad, msg in ((["compose"], "preflight.waive.0: 'compose' is not one of"),
                     (["disk", "dsik"], "preflight.waive.1: 'dsik' is not one of")):
        cfg["preflight"]["waive"] = bad
        with pytest.raises(cfgmod.ConfigError, match=msg):
            plan_for(cfg, verl, tmp_path, name="bad")
        assert not (tmp_path / "bad").exists()
    # the config schema lists exactly the waivable rules, so a typo fails at load time
    schema = cfgmod._load_yaml(REPO / "config/schema/preflight.schema.yaml")
    assert schema["properties"]["waive"]["items"]["enum"] == [
        n for n in pf.RULES if n not in pf.NOT_WAIVABLE]
    with pytest.raises(cfgmod.ConfigError, match="dsik"):
        cfgmod.validate({**cfgmod.load(REPO / "config/config.yaml"),
                         "preflight": {"waive": ["dsik"]}})


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_each_rule_fails_with_its_numbers(verl, tmp_path, name):
    mutate, message = ERROR_CASES[name]
    plan = plan_for(mutate(paper_cfg(tmp_path)), verl, tmp_path)
    res = rule(plan, name)
    assert res.status == "error", (res, plan.errors)
    assert any(message in m for m in res.messages), res.messages
    assert not plan.ok and any(e.startswith(f"{name}: ") for e in plan.errors)
    # waiving it turns it into "waived" (and the plan passes when nothing else fails)
    cfg = mutate(paper_cfg(tmp_path))
    cfg["preflight"]["waive"] = ["disk", name]
    waived = plan_for(cfg, verl, tmp_path, name="waived")
    assert rule(waived, name).status == "waived"
    assert not any(e.startswith(f"{name}: ") for e in waived.errors)


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_disk_rule_uses_free_space(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    cfg["preflight"]["waive"] = []
    cfg["preflight"]["model_bytes"] = 10**15  # 1 PB of weights: never fits
    cfg["cluster"]["gpu_memory_gb"] = 10**6  # keep the rollout rule quiet
    cfg["train"]["checkpoint_keep"] = 2
    # eval.steps of the paper: 20 and 100 are kept beyond the newest 2 (180, 200)
    cfg["eval"]["steps"] = [180, 20, 100]
    plan = plan_for(cfg, verl, tmp_path)
    res = rule(plan, "disk")
    assert res.status == "error"
    assert ("(keep 2 + 2 kept for eval.steps [20, 100] + 1 being written) x 7000.000 TB"
            in res.messages[0]), res.messages
    assert plan.checkpoint["bytes_needed"] == 5 * 7 * 10**15
    assert plan.checkpoint["kept_for_eval"] == [20, 100]
    assert 0 < plan.checkpoint["free_bytes"] < plan.checkpoint["bytes_needed"]
    # a size that fits passes, and the plan records what it measured
    cfg["preflight"]["model_bytes"] = 10**6
    small = plan_for(cfg, verl, tmp_path, name="small")
    assert rule(small, "disk").status == "pass"
    assert small.checkpoint["bytes_per_checkpoint"] == 7 * 10**6


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_disk_rule_counts_what_the_checkpoint_directory_holds(verl, tmp_path, ckpt_writer):
    """Issue 19, 9: complete checkpoints already there hold their space; leftovers the job
    removes at its start (older incomplete saves, an interrupted retention) count as free."""
    cfg = paper_cfg(tmp_path)
    cfg["preflight"]["waive"] = []
    cfg["preflight"]["model_bytes"] = 10**6
    cfg["cluster"]["gpu_memory_gb"] = 10**6
    cfg["train"]["checkpoint_keep"] = 2
    cfg["eval"]["steps"] = [200]
    first = plan_for(cfg, verl, tmp_path)
    assert first.checkpoint["checkpoints_there"] == 0
    assert first.checkpoint["bytes_needed"] == 3 * 7 * 10**6
    ckpt = Path(first.checkpoint["dir"])
    for step in (20, 40):
        ckpt_writer(ckpt, step)
    for k in (3, 4):  # two incomplete saves moved aside: the older is removed at the start
        aside = ckpt / f"global_step_60.incomplete-{k}"
        aside.mkdir()
        (aside / "shard").write_bytes(b"x" * 1000)
    (ckpt / ".pruning-global_step_10").mkdir()
    (ckpt / ".pruning-global_step_10" / "shard").write_bytes(b"y" * 500)
    again = plan_for(cfg, verl, tmp_path, name="again")
    assert again.checkpoint["checkpoints_there"] == 2
    assert again.checkpoint["bytes_needed"] == 1 * 7 * 10**6  # only the one being written
    assert again.checkpoint["reclaimable_bytes"] == 1500
    assert rule(again, "disk").status == "pass"


def test_kept_for_eval():
    assert pf.kept_for_eval([20, 100, 180], 20, 200, 2) == [20, 100]
    assert pf.kept_for_eval([25, 210], 20, 210, 1) == []  # 25 never saved; 210 the newest
    assert pf.kept_for_eval([200], 20, 210, 1) == [200]
    assert pf.kept_for_eval([5], -1, 10, 2) == []
    assert pf.kept_for_eval([50, 60], 20, 200, 2, segment=50) == [50, 60]  # 50 ends a segment


def test_verl_pin_and_checkpoint_checks(verl, tmp_path):
    lock = write_lock(tmp_path / "other-lock.json", verl.path, "0" * 40)
    check = tmp_path / "checkpoint.json"
    check.write_text(json.dumps({"checks": [{"name": "index", "status": "pass"},
                                            {"name": "hy3_expert_bias", "status": "fail"},
                                            {"name": "bridge", "status": "not run"}]}))
    plan = plan_for(paper_cfg(tmp_path), verl, tmp_path, lock=lock, checkpoint_check=check)
    assert rule(plan, "verl_pin").status == "error"
    assert f"is at {verl.commit}, deps/lock.json says {'0' * 40}" in rule(
        plan, "verl_pin").messages[0]
    assert rule(plan, "checkpoint_checks").messages == [
        "checks/checkpoint.json has failed checks: hy3_expert_bias"]


WARNING_CASES = {
    "ref_kl_zero": (lambda c: c, "use_kl_loss=True with kl_loss_coef=0"),
    "val_on_resume": (lambda c: c, "re-runs on every start, including each resume"),
    "oom_actor_memory": (lambda c: _set(c, env={"ALL_OFFLOAD": False, "ACTOR_PP": 1}),
                         "per GPU (9 x 597.6 GB / PP x max(TP, EP x ETP) = 8) vs 96 GB GPUs "
                         "without offload: set ALL_OFFLOAD=True or raise ACTOR_PP / ACTOR_EP"),
    "oom_rollout_memory": (lambda c: c["cluster"].update(gpu_memory_gb=60) or c,
                           "little KV cache left: raise ROLLOUT_TP or ROLLOUT_GPU_MEM_UTIL"),
    "oom_micro_batch": (lambda c: _set(c, env={"ACTOR_PPO_MICRO_BATCH_SIZE_PER_GPU": 32}, over={
        "actor_rollout_ref.actor.use_dynamic_bsz": False}),
        "static micro batches of 32 x 10240 tokens / CP 8 = 40960 tokens per GPU exceed the "
        "30720-token budget: lower ACTOR_PPO_MICRO_BATCH_SIZE_PER_GPU"),
    "overlong_buffer_window": (lambda c: _set(c, over={BUFFER_LEN: 6144}),
                               "reward.reward_kwargs.overlong_buffer_cfg.len / max_resp_len = "
                               "6144 / 8192 = 0.75 (over 1/2): every response longer than "
                               "8192 - 6144 = 2048 tokens is penalised"),
    "runtime_tag": (lambda c: c,  # the paper config runs the guide's image by its tag
                    "train.runtime.prefix names the image docker://verlai/verl:vllm023.dev1 "
                    "by tag 'vllm023.dev1': a tag can move"),
}


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("name", sorted(WARNING_CASES))
def test_each_warning_names_its_cost_or_knob(verl, tmp_path, name):
    mutate, message = WARNING_CASES[name]
    plan = plan_for(mutate(paper_cfg(tmp_path)), verl, tmp_path)
    res = rule(plan, name)
    assert res.status == "warning", (res, plan.errors)
    assert any(message in m for m in res.messages), res.messages
    assert any(w.startswith(f"{name}: ") for w in plan.warnings)


def test_prompts_over_max_from_data_summary(verl, tmp_path):
    summary = tmp_path / "data/summary.json"
    summary.parent.mkdir()
    summary.write_text(json.dumps({  # docs/formats/data.md
        "format": "hy3rl.data.summary/1", "max_prompt_length": 2048, "val_n": 32,
        "splits": {
            "train": {"rows": 1791700, "prompt_tokens": {"mean": 180.5},
                      "over_max_prompt_length": {"rows": 3, "unique_prompts": 1}},
            "val": {"rows": 30, "over_max_prompt_length": {"rows": 0}}}}))
    plan = plan_for(paper_cfg(tmp_path), verl, tmp_path, summary=summary)
    assert "3 training prompts exceed max_prompt_length = 2048" in rule(
        plan, "prompts_over_max").messages[0]
    # val_n from the summary becomes VAL_N (30 deduplicated problems x 32 samples)
    assert plan.knobs["VAL_N"] == {"value": "32", "from": "data/summary.json val_n",
                                   "source": "config"}
    assert plan.effective["actor_rollout_ref.rollout.val_kwargs.n"] == 32
    assert "30 x 32 generations" in rule(plan, "val_on_resume").messages[0]
    val_h = 2 * 21e9 * 30 * 32 * (180.5 + 4096) / (148e12 * 0.05) / 3600
    assert rule(plan, "val_on_resume").messages[0].endswith(
        f"; cost ~{round(val_h, 1):g} GPU-hours per start (estimate)")
    assert plan.estimate["inputs"]["mean_prompt_tokens"] == 180.5


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_cli_lists_all_errors_and_refuses_bad_inputs(verl, tmp_path, capsys):
    cfg = _set(paper_cfg(tmp_path), env={"ROLLOUT_MAX_MODEL_LEN": 9000, "SAVE_FREQ": -1})
    cfg["data"]["heldout"] = cfg["eval"]["select"] = None  # no held-out file written here
    layout = Layout.from_config(cfg)
    rc = hy3rl_preflight(cfg, tmp_path, verl.lock)
    captured = capsys.readouterr()
    err = captured.err
    assert rc == 1 and "max_model_len: rollout.max_model_len = 9000" in err
    assert "save_test_freq: trainer.save_freq = -1" in err and "2 error(s)" in err
    assert "Traceback" not in err
    assert "WARNING ref_kl_zero: " in captured.out  # the summary: warnings and waivers
    assert json.loads(Path(layout.preflight_refused).read_text())["ok"] is False  # to read
    assert not Path(layout.preflight_plan).exists()  # a refusal writes no plan.json
    # an unknown waiver: the config is refused before anything runs
    bad = paper_cfg(tmp_path)
    bad["preflight"]["waive"] = ["dsik"]
    bad["run"]["name"] = "bad-waiver"
    assert hy3rl_preflight(bad, tmp_path, verl.lock) == 2
    err = capsys.readouterr().err
    assert "preflight.waive.0: 'dsik' is not one of" in err and "Traceback" not in err
    assert not Path(Layout.from_config(bad).preflight_plan).exists()
    # no lock: a clear message naming the file, exit 1, nothing written
    cfg["run"]["name"] = "no-lock"
    assert hy3rl_preflight(cfg, tmp_path, None) == 1
    err = capsys.readouterr().err
    no_lock = Layout.from_config(cfg)
    assert f"hy3rl preflight: error: {no_lock.deps_lock}: missing (run rule deps)" in err
    assert "Traceback" not in err and not Path(no_lock.preflight_dir).exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_rendered_launch_drives_the_train_stage_double(fake_verl_repo, tmp_path):
    """Contract check with the train stage: the real launch.sh, run in the verl dir with
    VERL_FILE_LOGGER_PATH, drives the trainer double (tests/fixtures/trainer_double.py) to
    write checkpoints in the planned directory and the per-attempt metrics log."""
    from fixtures.trainer_double import MAIN_PPO_DOUBLE

    verl = fake_verl_repo(extra_files={"verl/trainer/main_ppo.py": MAIN_PPO_DOUBLE})
    cfg = default_cfg(tmp_path)
    cfg["train"].update(checkpoint_root=str(tmp_path / "ckpt"), total_training_steps=3,
                        loggers=["console"])
    plan = plan_for(cfg, verl, tmp_path)
    assert plan.ok, plan.errors
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python3").chmod(0o755)
    log = tmp_path / "attempts/attempt-1.metrics.jsonl"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path),
           "VERL_FILE_LOGGER_PATH": str(log), "HY3RL_DOUBLE_STEP_S": "0.01"}
    subprocess.run(["bash", plan.launch["path"]], cwd=verl.path, env=env, check=True,
                   capture_output=True, text=True, timeout=300)
    ckpt = Path(plan.checkpoint["dir"])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps[-1] == 3


def test_paper_config_undoes_every_tiny_knob():
    """config/paper.yaml is applied on top of config/config.yaml (mappings merge), so every
    knob and verl override the tiny default sets must be set back explicitly in the paper
    config."""
    tiny = yaml.safe_load((REPO / "config/config.yaml").read_text())["train"]
    paper = yaml.safe_load((REPO / "config/paper.yaml").read_text())["train"]
    for key in ("env", "verl_overrides"):
        assert sorted(set(tiny[key]) - set(paper[key])) == [], key


# --------------------------------------------------------------------------- verl's own checks

WORKERS_CONFIG = "verl/workers/config/__init__.py"
DAPO = "verl/experimental/reward_loop/reward_manager/dapo.py"


def test_post_init_error_reaches_plan_json_with_verl_message_and_line(verl, tmp_path):
    """The fake verl's RolloutConfig.__post_init__ raises: the error reaches plan.json (rule
    verl and verl_checks) with verl's message and the file:line inside the clone."""
    cfg = _set(default_cfg(tmp_path), over={"actor_rollout_ref.rollout.mode": "sync"})
    plan_for(cfg, verl, tmp_path, bridge_check=None)
    doc = json.loads((tmp_path / "out/refused.json").read_text())
    line = line_of(verl.path / WORKERS_CONFIG, "has been removed")
    got = {c["name"]: c for c in doc["verl_checks"]["checks"]}
    rollout = got["actor_rollout_ref.rollout"]
    assert (rollout["status"], rollout["message"], rollout["where"], rollout["exception"]) == (
        "fail", "Rollout mode 'sync' has been removed.", f"{WORKERS_CONFIG}:{line}", "ValueError")
    assert "engine_workers.py" in rollout["verl_call"]
    assert doc["verl_checks"]["counts"] == {"pass": 7, "fail": 1, "not run": 0}
    assert doc["ok"] is False and doc["errors"] == [
        f"verl: actor_rollout_ref.rollout: verl raised ValueError: Rollout mode 'sync' has been "
        f"removed. (at {WORKERS_CONFIG}:{line})"]
    assert {r["name"]: r["status"] for r in doc["rules"]}["verl"] == "error"


def test_dapo_assert_of_the_old_default_caught_by_our_rule_and_verls(verl, tmp_path):
    """The embedded default with the script's buffer of 4096 (MAX_RESPONSE_LENGTH 64): our
    rule and verl's own assert both stop it, before any allocation."""
    cfg = _set(default_cfg(tmp_path), over={BUFFER_LEN: 4096})
    plan = plan_for(cfg, verl, tmp_path, bridge_check=None)
    assert rule(plan, "overlong_buffer").messages[0].startswith(
        "reward.reward_kwargs.overlong_buffer_cfg.len = 4096 > reward.reward_kwargs.max_resp_len "
        "= 64: ")
    line = line_of(verl.path / DAPO, "assert self.max_resp_len >=")
    assert rule(plan, "verl").messages == [
        f"reward_manager: verl raised AssertionError: max_resp_len must be larger than "
        f"overlong_buffer.len (at {DAPO}:{line})"]
    assert not plan.ok and len(plan.errors) == 2


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_a_verl_check_that_cannot_run_is_an_error_unless_waived(fake_verl_repo, tmp_path):
    verl = fake_verl_repo(extra_files={
        "verl/utils/config.py": "import hy3rl_absent_requirement  # noqa: F401\n"})
    cfg = paper_cfg(tmp_path)
    plan = plan_for(cfg, verl, tmp_path)
    res = rule(plan, "verl")
    assert res.status == "error" and len(res.messages) == 7  # all but reward_manager
    assert res.messages[0] == (
        "validate_config: not run: ModuleNotFoundError: No module named "
        "'hy3rl_absent_requirement' (at verl/utils/config.py:1); what this verl check catches "
        "would surface only after the allocation: install verl's requirements (./install.sh), "
        "or write `preflight.waive: [verl]` to go without it")
    cfg["preflight"]["waive"] = ["disk", "verl"]
    waived = plan_for(cfg, verl, tmp_path, "waived")
    assert waived.ok, waived.errors
    assert rule(waived, "verl").status == "waived"
    assert sum(w.startswith("verl: ") for w in waived.waived) == 7
    # the checks stay in the plan, with why they did not run
    counts = waived.verl_checks["counts"]
    assert counts == {"pass": 1, "fail": 0, "not run": 7}
    assert all("hy3rl_absent_requirement" in c["reason"] for c in waived.verl_checks["checks"]
               if c["status"] == "not run")


# --------------------------------------------------------------------------- GPU-only checks


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_bridge_not_run_in_a_runtime_without_transformer_engine_stops_the_launch(
        verl, tmp_path, bridge_repo_factory, capsys):
    """check_bridge run for real through a train.runtime prefix whose python has no
    Transformer Engine (this one): every check `not run`, the job succeeds; preflight then
    refuses the GPU run and names the waiver, and launches with it (`waived`)."""
    from fixtures.common import make_config
    from hy3rl import bridge as br

    report = tmp_path / "checks" / "bridge.json"
    rt = make_config(train={"runtime": {"prefix": "env HY3RL_IN_RUNTIME=1",
                                        "python": sys.executable}})
    br.run(rt.checks.bridge, rt.model, rt.train.runtime, lock=bridge_repo_factory()[2],
           out=report)
    doc = json.loads(report.read_text())
    assert {c["status"] for c in doc["checks"]} == {"not run"} and doc["ok"] is True
    capsys.readouterr()

    cfg = paper_cfg(tmp_path)
    plan = plan_for(cfg, verl, tmp_path, bridge_check=report)
    res = rule(plan, "bridge")
    assert res.status == "error" and not plan.ok
    (msg,) = res.messages
    assert msg.startswith(f"{report}: {len(doc['checks'])} of {len(doc['checks'])} bridge checks "
                          f"did not pass: mapping_table_agreement")
    assert "not run (" in msg
    assert msg.endswith("or write `preflight.waive: [bridge]` to launch without it")
    assert plan.errors == [f"bridge: {msg}"]

    cfg["preflight"]["waive"] = ["disk", "bridge"]
    waived = plan_for(cfg, verl, tmp_path, "waived", bridge_check=report)
    assert waived.ok and waived.launched, waived.errors
    assert rule(waived, "bridge").status == "waived"
    assert f"bridge: {msg}" in waived.waived
    on_disk = json.loads((tmp_path / "waived/plan.json").read_text())
    assert {r["name"]: r["status"] for r in on_disk["rules"]}["bridge"] == "waived"


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_bridge_report_missing_or_failed_stops_the_launch(verl, tmp_path):
    cfg = paper_cfg(tmp_path)
    missing = tmp_path / "no-checks" / "bridge.json"
    plan = plan_for(cfg, verl, tmp_path, bridge_check=missing)
    assert rule(plan, "bridge").messages == [
        f"{missing} is missing: a GPU run needs the report of the bridge check (rule "
        f"check_bridge, run in the training runtime); or write `preflight.waive: [bridge]` to "
        f"launch without it"]
    failed = bridge_report(tmp_path / "failed" / "bridge.json", "fail", "cosine 0.91 < 0.9999")
    plan = plan_for(cfg, verl, tmp_path, "failed", bridge_check=failed)
    assert rule(plan, "bridge").status == "error"
    assert ("5 of 5 bridge checks did not pass: mapping_table_agreement, "
            "tiny/roundtrip_tensors, tiny/expert_bias, tiny/logits, tiny/bridge_warnings fail "
            "(cosine 0.91 < 0.9999)") in rule(plan, "bridge").messages[0]
    # the same `not run` report as the runtime without Transformer Engine writes
    not_run = bridge_report(tmp_path / "te" / "bridge.json", "not run", TE_MISSING)
    plan = plan_for(cfg, verl, tmp_path, "te", bridge_check=not_run)
    assert ("tiny/bridge_warnings not run (no Transformer Engine in this runtime (import "
            "transformer_engine failed))") in rule(plan, "bridge").messages[0]


@pytest.mark.parametrize("prefix, status", [
    ("apptainer exec --nv docker://verlai/verl@sha256:" + "a" * 64, "pass"),
    ("apptainer exec --nv /shared/images/verl-vllm023.dev1.sif", "pass"),
    ("", "pass"),
    ("apptainer exec --nv docker://registry.example:5000/verl", "warning"),
])
@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_runtime_tag(verl, tmp_path, prefix, status):
    cfg = paper_cfg(tmp_path)
    cfg["train"]["runtime"]["prefix"] = prefix
    plan = plan_for(cfg, verl, tmp_path)
    assert rule(plan, "runtime_tag").status == status
    if status == "warning":
        assert rule(plan, "runtime_tag").messages[0].startswith(
            "train.runtime.prefix names the image docker://registry.example:5000/verl by no tag "
            "(Docker's implicit 'latest'): a tag can move")
        assert "docker://registry.example:5000/verl@sha256:<digest>" in plan.warnings[-1]


# --------------------------------------------------------------------------- through SLURM


@pytest.mark.slurm
def test_preflight_errors_stop_the_workflow_on_the_slurm_cluster(
        verl, slurm_profile_args, tmp_path):
    """`snakemake --profile profiles/slurm` (+ the test override) on the real test cluster:
    rule preflight (a localrule: CPU seconds on the submit host) fails, its errors (each with
    its numbers) reach the user through Snakemake's failed-job report, and after the fix the
    rerun makes a good plan.
    The upstream outputs preflight reads are written here; only preflight may run."""
    from fixtures.common import run_snakemake

    work = tmp_path / "work"
    res = work / "results" / "tiny-default"
    write_lock(res / "deps" / "lock.json", verl.path, verl.commit)
    (res / "data").mkdir(parents=True)
    (res / "data" / "summary.json").write_text(json.dumps({"splits": {}}))
    for name in ("train.parquet", "val.parquet"):
        (res / "data" / name).write_bytes(b"")
    (res / "checks").mkdir()
    (res / "checks" / "checkpoint.json").write_text(json.dumps({"checks": []}))
    bridge_report(res / "checks" / "bridge.json")  # passed (the bridge rule reads it)
    model = tmp_path / "model"  # what verl's checks read (the fake verl: a directory)
    model.mkdir()
    (model / "config.json").write_text("{}")
    from hy3rl import hub  # the model rule's manifest (an input of preflight)

    hub.run(str(model), None, "", manifest=res / "model" / "manifest.json", progress=False)
    site = tmp_path / "site.yaml"
    train = {"checkpoint_root": str(tmp_path / "ckpt"),
             "env": {"ROLLOUT_MAX_MODEL_LEN": 100, "SAVE_FREQ": 50, "ACTOR_PP": 3}}
    # no held-out file written here; no checkpoint evaluated (the SAVE_FREQ error is alone)
    no_heldout = {"data": {"heldout": None}, "eval": {"select": None, "steps": []}}
    site.write_text(json.dumps({"train": train, "model": {"source": str(model)}, **no_heldout}))
    args = ["results/tiny-default/preflight/plan.json", *slurm_profile_args, str(site),
            "--allowed-rules", "preflight"]

    bad = run_snakemake(args, work, check=False, timeout=600)
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0, out[-3000:]
    assert re.search(r"localrule preflight:", out), out[-3000:]  # on the submit host
    assert "rule_preflight" not in out  # no sbatch job
    assert "Error in rule preflight" in out, out[-3000:]
    for msg in ("actor_layout: actor TP x PP x CP = 1 x 3 x 1 = 3 does not divide the 4 GPUs",
                "max_model_len: rollout.max_model_len = 100 < max_prompt_length + "
                "max_response_length",
                "save_test_freq: trainer.save_freq = 50 > total_training_steps = 2",
                "6 error(s) (plan: results/tiny-default/preflight/plan.refused.json)"):
        assert msg in out, f"{msg!r} not in Snakemake's output:\n{out[-4000:]}"
    assert not (res / "preflight" / "launch.sh").exists()
    assert not (res / "preflight" / "plan.json").exists()
    assert not json.loads((res / "preflight" / "plan.refused.json").read_text())["ok"]

    train["env"] = {}
    site.write_text(json.dumps({"train": train, "model": {"source": str(model)}, **no_heldout}))
    good = run_snakemake(args, work, check=False, timeout=600)
    out = good.stdout + good.stderr
    assert good.returncode == 0, out[-4000:]
    plan = json.loads((res / "preflight" / "plan.json").read_text())
    assert plan["ok"] and plan["launched"], plan["errors"]
    assert not (res / "preflight" / "plan.refused.json").exists()
    assert plan["effective"]["trainer.nnodes"] == 2
    assert plan["effective"]["trainer.n_gpus_per_node"] == 2
    assert "WARNING ref_kl_zero:" in (res / "logs" / "preflight.log").read_text()


# ---- the held-out set and the selection rule (issue 20) ----


def _selection(cfg: dict, heldout: Path | None, val: Path, train: Path):
    from hy3rl.preflight import heldout as ho
    from hy3rl.preflight.rules import _Rules

    r = _Rules()
    ho.check(r, Config.from_dict(cfg), heldout=heldout, val=val, train=train)
    return r.results.get("selection")


def test_selection_set_must_be_held_out_from_the_test_and_training_sets(tmp_path):
    from fixtures.data import aime_rows, dapo_rows, write_parquet

    cfg = cfgmod.load(REPO / "config/config.yaml")
    val = write_parquet(tmp_path / "val.parquet", aime_rows(repeats=2))
    train = write_parquet(tmp_path / "train.parquet", dapo_rows(20)[2:])
    held = write_parquet(tmp_path / "held.parquet", dapo_rows(20)[:2])  # carved: not in train
    assert _selection(cfg, held, val, train) is None  # no error, no warning
    # the test set itself (same bytes), or the same problems in another file and order
    same = _selection(cfg, val, val, train)
    assert same.status == "error" and "same content as the test set" in same.messages[0]
    shuffled = write_parquet(tmp_path / "shuffled.parquet", aime_rows(repeats=1)[::-1])
    res = _selection(cfg, shuffled, val, train)
    assert res.status == "error" and "the same problems as the test set" in res.messages[0]
    # one problem shared with the test set (another id, case and spacing changed), one with
    # the training set: both named
    rows = dapo_rows(20)[:2]
    aime = aime_rows(repeats=1)[0]
    text = aime["extra_info"]["raw_problem"]
    rows.append({**aime, "prompt": [{"role": "user", "content": "  " + text.upper() + " "}],
                 "extra_info": {"index": "h-1"}})
    rows.append(dapo_rows(20)[5])
    mixed = write_parquet(tmp_path / "mixed.parquet", rows)
    res = _selection(cfg, mixed, val, train)
    msgs = " | ".join(res.messages)
    assert res.status == "error" and len(res.messages) == 2, msgs
    assert "1 of its 4 problems are also in the test set" in msgs
    pid = aime["extra_info"]["index"]
    val_row = [r["extra_info"]["index"] for r in aime_rows(repeats=2)].index(pid)
    assert f"h-1 (row 2) = the test set {pid} (row {val_row})" in msgs
    assert "1 of its 4 problems are also in the training set" in msgs
    train_id = dapo_rows(20)[5]["extra_info"]["index"]
    assert f"{train_id} (row 3) = the training set {train_id} (row 3)" in msgs


# issue 27, item 6: the same problem written another way is still the same problem
BASE_PROBLEM = ("Let $x$ be a real number such that $x^2 = 4$. Find the sum of all real "
                "values of $x$ that satisfy this equation.")
TWINS = {  # case -> (the held-out set's text, the test set's text)
    "dropped_trailing_period": (BASE_PROBLEM, BASE_PROBLEM[:-1]),
    "paren_vs_dollar_delimiters": (BASE_PROBLEM.replace("$x$", r"\(x\)").replace(
        "$x^2 = 4$", r"\(x^2 = 4\)"), BASE_PROBLEM),
    "dapo_wrapper_vs_other_template": (
        DAPO_PREFIX + BASE_PROBLEM + DAPO_SUFFIX,
        BASE_PROBLEM + " Let's think step by step and output the final answer within "
        "\\boxed{}."),
    "dapo_wrapper_vs_bare": (DAPO_PREFIX + BASE_PROBLEM + DAPO_SUFFIX, BASE_PROBLEM),
    "unicode_superscript": (BASE_PROBLEM.replace("x^2", "x²"), BASE_PROBLEM),
    "spaces_around_operators": (BASE_PROBLEM.replace("x^2 = 4", "x^2=4"), BASE_PROBLEM),
}


@pytest.fixture(scope="module")
def embedded_cfg() -> dict:
    """The embedded default config (read once; the tests do not change it)."""
    return cfgmod.load(REPO / "config/config.yaml")


def _one_problem_files(tmp_path: Path, held_text: str, test_text: str
                       ) -> tuple[Path, Path, Path]:
    """A held-out set of 3 problems (one of them ``held_text``), a test set of 30 AIME
    problems with ``test_text`` as its problem 7, a training set of 18 DAPO problems."""
    from fixtures.data import aime_rows, dapo_rows, write_parquet

    def row(text: str, pid: str) -> dict:
        return {**dapo_rows(1)[0], "prompt": [{"role": "user", "content": text}],
                "extra_info": {"index": pid}}

    val_rows = aime_rows(repeats=1)
    val_rows[7] = {**val_rows[7], "prompt": [{"role": "user", "content": test_text}]}
    held = write_parquet(tmp_path / "held.parquet",
                         [*dapo_rows(20)[:2], row(held_text, "h-twin")])
    return (held, write_parquet(tmp_path / "val.parquet", val_rows),
            write_parquet(tmp_path / "train.parquet", dapo_rows(20)[2:]))


@pytest.mark.parametrize("case", sorted(TWINS))
def test_the_same_problem_written_another_way_is_refused(case, tmp_path, embedded_cfg):
    held, val, train = _one_problem_files(tmp_path, *TWINS[case])
    res = _selection(embedded_cfg, held, val, train)
    pid = pq.read_table(val).to_pylist()[7]["extra_info"]["index"]
    assert res is not None and res.status == "error", res
    assert len(res.messages) == 1, res.messages
    assert res.messages[0].startswith(
        f"data.heldout 'dapo_heldout': 1 of its 3 problems are also in the test set "
        f"(data.val) ({val}): h-twin (row 2) = the test set {pid} (row 7): a held-out set "
        "shares no problem with it"), res.messages[0]


def test_a_different_problem_passes(tmp_path, embedded_cfg):
    other = ("Let $y$ be a positive integer such that $y^3 = 27$. Find the product of all "
             "real values of $y$ that satisfy this equation.")
    held, val, train = _one_problem_files(tmp_path, other, BASE_PROBLEM)
    assert _selection(embedded_cfg, held, val, train) is None


def test_a_near_duplicate_is_a_warning_with_both_texts(tmp_path, embedded_cfg):
    from hy3rl.problems import problem

    near = BASE_PROBLEM.replace("Find the sum", "Find the product")  # another question
    held, val, train = _one_problem_files(tmp_path, near, DAPO_PREFIX + BASE_PROBLEM
                                          + DAPO_SUFFIX)
    a, b = problem(near, "a", 0), problem(BASE_PROBLEM, "b", 0)
    jaccard = len(a.ngrams & b.ngrams) / len(a.ngrams | b.ngrams)
    assert a.key != b.key and jaccard >= 0.7
    res = _selection(embedded_cfg, held, val, train)
    pid = pq.read_table(val).to_pylist()[7]["extra_info"]["index"]
    assert res is not None and res.status == "warning" and len(res.messages) == 1, res
    assert res.messages[0] == (
        f"data.heldout 'dapo_heldout': 1 of its 3 problems are near-duplicates of problems "
        f"in the test set (data.val) ({val}) (word 3-gram Jaccard >= 0.7, not equal after "
        f"normalisation): h-twin (row 2) ~ the test set {pid} (row 7), Jaccard "
        f"{jaccard:.2f}: {near!r} / {BASE_PROBLEM!r}: check that they are different "
        "problems")


def test_a_refused_problem_is_not_also_listed_as_a_near_duplicate(tmp_path, embedded_cfg):
    from fixtures.data import write_parquet

    held, val, train = _one_problem_files(tmp_path, BASE_PROBLEM, BASE_PROBLEM + " ")
    rows = pq.read_table(val).to_pylist()
    rows[8] = {**rows[8], "prompt": [{"role": "user", "content": BASE_PROBLEM.replace(
        "Find the sum", "Find the product")}]}
    res = _selection(embedded_cfg, held, write_parquet(val, rows), train)
    assert res.status == "error" and len(res.messages) == 1, res.messages
    assert "h-twin (row 2) = the test set" in res.messages[0]


def test_problem_is_the_last_user_message_and_rows_without_an_id_are_named_by_row(
        tmp_path, embedded_cfg):
    """A system message before the problem and an assistant turn after it, no
    extra_info.index: the problem is still found and named ``row <i>``."""
    from fixtures.data import dapo_rows, write_parquet

    held, val, train = _one_problem_files(tmp_path, "unused", BASE_PROBLEM)
    rows = [{**r, "extra_info": {"other": "x"}} for r in dapo_rows(20)[:2]]
    rows.append({**rows[0], "prompt": [
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user", "content": "An earlier question."},
        {"role": "assistant", "content": "An earlier answer."},
        {"role": "user", "content": BASE_PROBLEM.upper()},
        {"role": "assistant", "content": "Let me think."}]})
    held = write_parquet(tmp_path / "held-noid.parquet", rows)
    res = _selection(embedded_cfg, held, val, train)
    pid = pq.read_table(val).to_pylist()[7]["extra_info"]["index"]
    assert res.status == "error" and len(res.messages) == 1, res
    assert f"row 2 (row 2) = the test set {pid} (row 7)" in res.messages[0], res.messages


def test_near_duplicate_index_finds_what_all_pairs_find():
    """The 3-gram index against every pair: for each held-out problem the same best match
    at or above the threshold, none for an equal key, nothing below it."""
    import random

    from hy3rl.problems import NEAR_DUPLICATE_JACCARD, NgramIndex, problem

    rng = random.Random(3)
    vocab = [f"w{i}" for i in range(12)]
    base = [" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 14))) for _ in range(20)]
    others = [problem(t, f"o{i}", i) for i, t in enumerate(
        base + [b + " " + rng.choice(vocab) for b in base] + [b.upper() + "." for b in base])]
    held = [problem(t, f"h{i}", i) for i, t in enumerate(base[:8] + [
        " ".join(rng.choice(vocab) for _ in range(10)) for _ in range(8)])]
    found = {d.mine.pid: (d.theirs.pid, d.jaccard) for d in NgramIndex(held).near(others)}
    expected = {}
    for h in held:
        scored = [(len(h.ngrams & o.ngrams) / len(h.ngrams | o.ngrams), -j, o.pid)
                  for j, o in enumerate(others) if o.key != h.key]
        best = max(scored)
        if best[0] >= NEAR_DUPLICATE_JACCARD:
            expected[h.pid] = (best[2], best[0])
    assert expected and found == expected


def test_selection_keys_are_checked_by_name(tmp_path):
    from fixtures.data import aime_rows, dapo_rows, write_parquet

    val = write_parquet(tmp_path / "val.parquet", aime_rows(repeats=2))
    train = write_parquet(tmp_path / "train.parquet", dapo_rows(20)[2:])
    held = write_parquet(tmp_path / "held.parquet", dapo_rows(20)[:2])
    cfg = cfgmod.load(REPO / "config/config.yaml")
    cfg["eval"]["select"]["set"] = "aime2025"
    res = _selection(cfg, held, val, train)
    assert res.status == "error" and res.messages[0].startswith(
        "eval.select.set: no held-out set named 'aime2025' (data.heldout.name is "
        "'dapo_heldout')")
    cfg = cfgmod.load(REPO / "config/config.yaml")
    cfg["data"]["heldout"] = None
    res = _selection(cfg, None, val, train)
    assert res.status == "error" and "eval.select.set: names 'dapo_heldout' but no held-out " \
        "set is configured" in res.messages[0]
    cfg = cfgmod.load(REPO / "config/config.yaml")
    cfg["eval"]["select"].update(metric="pass", k=3)  # n = 4: pass@k for k in 1, 2, 4
    res = _selection(cfg, held, val, train)
    assert res.status == "error" and res.messages[0].startswith("eval.select.k = 3: pass@k")
    cfg["eval"]["select"]["k"] = 2
    assert _selection(cfg, held, val, train) is None
    cfg = cfgmod.load(REPO / "config/config.yaml")
    assert _selection(cfg, tmp_path / "absent.parquet", val, train).messages[0].startswith(
        "data.heldout 'dapo_heldout': ")
    assert _selection(cfg, None, val, train).status == "not run"


def test_an_evaluation_step_that_is_not_a_save_step_is_refused(verl, tmp_path):
    cfg = paper_cfg(tmp_path)  # SAVE_FREQ 20, total 200
    cfg["eval"]["steps"] = [20, 30]
    plan = plan_for(cfg, verl, tmp_path)
    res = rule(plan, "eval_steps_saved")
    assert res.status == "error", plan.errors
    assert res.messages[0].startswith("eval.steps [30]: verl saves no checkpoint at this step "
                                      "(trainer.save_freq = 20")
    assert plan.selection["key"] == "math_dapo avg@32" and plan.selection["tie"] == \
        "earliest step"


def test_a_run_whose_checkpoints_hold_no_hf_weights_is_refused_when_they_are_read(verl,
                                                                                  tmp_path):
    """hf_weights: evaluating checkpoints and releasing read each checkpoint's HF weights.
    Megatron dist checkpointing without hf_model in save_contents writes none: refused before
    the allocation, naming both keys; hf_model, or nothing reading them, passes."""
    cfg = paper_cfg(tmp_path)  # eval.steps, eval.final, the releases; strategy megatron
    assert rule(plan_for(cfg, verl, tmp_path, "default"), "hf_weights").status == "pass"
    cfg["train"]["verl_overrides"][rules.DIST_CKPT] = True
    res = rule(plan_for(cfg, verl, tmp_path, "dist"), "hf_weights")
    assert res.status == "error", res
    assert res.messages[0].startswith("eval.steps [")
    assert ("eval.final, release.tags ['selected', 'final'] read each checkpoint's Hugging "
            "Face weights") in res.messages[0]
    assert (f"{rules.SAVE_CONTENTS} = ['model', 'optimizer', 'extra'] and {rules.DIST_CKPT} "
            "= true") in res.messages[0]
    cfg["train"]["verl_overrides"][rules.SAVE_CONTENTS] = ["model", "optimizer", "extra",
                                                           "hf_model"]
    assert rule(plan_for(cfg, verl, tmp_path, "hf"), "hf_weights").status == "pass"
    cfg["train"]["verl_overrides"][rules.SAVE_CONTENTS] = ["model", "optimizer", "extra"]
    cfg["eval"].update(steps=[], final=False, select=None)
    cfg["release"] = {"tags": []}
    assert rule(plan_for(cfg, verl, tmp_path, "none"), "hf_weights").status == "pass"


def test_which_verl_settings_write_hf_weights():
    w = rules.writes_hf_weights
    assert w("megatron", ["model"], False) and not w("megatron", ["model"], True)
    assert w("megatron", ["model", "hf_model"], True) and w("fsdp", ["hf_model"], False)
    assert not w("fsdp", ["model", "optimizer"], False)


# --------------------------------------------------------------------------- run identity


def trajectory_of(cfg: dict, verl, tmp_path: Path) -> dict:
    """plan.json ``identity`` of ``cfg`` as preflight computes it (resolve + run_identity: the
    resolved overrides of the fake pinned script, the lock's pins), without verl's checks."""
    from hy3rl.preflight.resolve import resolve

    typed = Config.from_dict(cfg)
    res = resolve(typed, verl.path, train_files=tmp_path / "data/train.parquet",
                  val_files=tmp_path / "data/val.parquet", val_n=None,
                  checkpoint_dir=Layout.from_config(cfg).checkpoint_dir,
                  reward_fn=tmp_path / "out/reward_fn.py")
    return pf.run_identity(typed, res, json.loads(verl.lock.read_text()), None, None, None)


def test_overrides_of_owned_paths_and_checkpoint_locations_are_refused(verl, tmp_path):
    """Issue 27 items 1 and 2: what verl reads from a workflow-owned path, and where it reads
    and writes checkpoints, is the workflow's: an override of one is refused, each named with
    the key to set instead or why."""
    cfg = paper_cfg(tmp_path)
    cfg["train"]["verl_overrides"].update({
        "data.train_files": "/other/data.parquet",
        "actor_rollout_ref.model.path": "/other/model",
        "++reward.custom_reward_function.path": "/other/reward.py",
        "trainer.default_local_dir": "/other/ckpt",
        "trainer.resume_mode": "disable",
        "+trainer.resume_from_path": "/other/ckpt/global_step_2",
        "+trainer.max_actor_ckpt_to_keep": 1,
    })
    with pytest.raises(pf.PreflightError) as err:
        trajectory_of(cfg, verl, tmp_path)
    msg = str(err.value)
    for key, why in (("data.train_files", "set data.train.source instead"),
                     ("actor_rollout_ref.model.path", "set model.source instead"),
                     ("++reward.custom_reward_function.path",
                      "set train.reward_function.path instead"),
                     ("trainer.default_local_dir", "a checkpoint location key"),
                     ("trainer.resume_mode", "a checkpoint location key"),
                     ("+trainer.resume_from_path", "a checkpoint location key"),
                     ("+trainer.max_actor_ckpt_to_keep", "retention is the workflow's")):
        line = next((ln for ln in msg.splitlines() if f"train.verl_overrides.{key}:" in ln), "")
        assert why in line, (key, msg)
    assert not (tmp_path / "out").exists()  # refused before anything is written
    # the same paths through the launch script's knobs: rule `knobs`, naming the key to set
    from hy3rl.preflight.resolve import knob_env

    cfg["train"]["env"].update(DATA_DIR="/other", MODEL_PATH="/other/model")
    _, problems = knob_env(Config.from_dict(cfg), tmp_path / "t.parquet",
                           tmp_path / "v.parquet", list(cfg["train"]["env"]))
    assert problems == ["train.env.DATA_DIR: set data.train.source / data.val.source instead",
                        "train.env.MODEL_PATH: set model.source / model.dir instead"]


def complete_checkpoint(root: Path, step: int) -> None:
    """verl's marks of a finished save (docs/formats/train.md): the actor's manifest, a whole
    data.pt archive, the tracker; no weights (hy3rl.ckptdir reads only these)."""
    import zipfile

    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    with zipfile.ZipFile(actor.parent / "data.pt", "w") as zf:
        zf.writestr("data/data.pkl", b"dataloader state")
    (actor / "ckpt_contents.json").write_text(json.dumps({"global_step": step}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def test_memory_knobs_and_number_spellings_keep_the_trajectory(verl, tmp_path):
    """Issue 27 item 8: an OOM fixed mid-run (vLLM's memory share, token budgets, micro
    batches, offload) and the learning rate written as a YAML float keep the trajectory, so
    a finished run's checkpoints resume."""
    from hy3rl import ckptdir

    cfg = paper_cfg(tmp_path)
    first = trajectory_of(cfg, verl, tmp_path)
    ckpt = Layout.from_config(cfg).checkpoint_dir
    for step in (2, 4):
        complete_checkpoint(ckpt, step)
    d = ckptdir.decide_identity(ckpt, first["trajectory"], 4, "refuse")
    ckptdir.apply_identity(ckpt, d, first["trajectory"], 4, 0)
    cfg["train"]["env"].update(ROLLOUT_GPU_MEM_UTIL=0.5, PPO_MAX_TOKEN_LEN_PER_GPU=20480,
                               ROLLOUT_LOG_PROB_MAX_TOKEN_LEN_PER_GPU=20480,
                               REF_LOG_PROB_MAX_TOKEN_LEN_PER_GPU=20480,
                               ROLLOUT_MAX_NUM_BATCHED_TOKENS=8192, ALL_OFFLOAD=False,
                               ACTOR_PPO_MICRO_BATCH_SIZE_PER_GPU=1)
    cfg["train"]["verl_overrides"]["actor_rollout_ref.actor.optim.lr"] = 1.0e-6  # YAML float
    fixed = trajectory_of(cfg, verl, tmp_path)
    assert fixed["trajectory"]["id"] == first["trajectory"]["id"]
    assert ckptdir.decide_identity(ckpt, fixed["trajectory"], 4, "refuse").action == "same"
    lr = "actor_rollout_ref.actor.optim.lr"
    assert first["trajectory"]["values"][lr] == 1e-6  # typed, as verl reads it
    changed = {**fixed["trajectory"], "values": {**fixed["trajectory"]["values"], lr: 2e-6}}
    assert ckptdir.decide_identity(ckpt, changed, 4, "refuse").action == "refuse"


def test_every_knob_and_resolved_key_has_a_kind(verl, tmp_path):
    """Issue 27's key table: every knob of the launch script and every key of the paper
    plan's `resolved` has an explicit kind in hy3rl.identity (none left to the default)."""
    from hy3rl import identity
    from hy3rl.preflight.resolve import DEFAULT_SCRIPT, resolve, script_knobs

    knobs = script_knobs((verl.path / DEFAULT_SCRIPT).read_text())
    assert knobs and [k for k in knobs if k not in identity.KNOBS] == []
    cfg = Config.from_dict(paper_cfg(tmp_path))
    res = resolve(cfg, verl.path, train_files=tmp_path / "t.parquet",
                  val_files=tmp_path / "v.parquet", val_n=None,
                  checkpoint_dir=tmp_path / "ckpt", reward_fn=tmp_path / "r.py")
    keys = {o.key for o in res.overrides}
    assert len(keys) > 80
    assert sorted(k for k in keys if identity.verl_entry(k) is None) == []


@pytest.mark.parametrize("eff, why", [
    ({"actor_rollout_ref.actor.optim.lr_scheduler_type": "constant"}, None),
    ({"actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine"},
     "lr_warmup_steps = -1, lr_warmup_steps_ratio = 0.0, lr_scheduler_type = cosine, lr = 1e-06"),
    ({"actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
      "actor_rollout_ref.actor.optim.lr_warmup_steps": 5},
     "lr_warmup_steps = 5, lr_warmup_steps_ratio = 0.0, lr_scheduler_type = constant, "
     "lr = 1e-06"),
    ({"actor_rollout_ref.actor.optim.warmup_style": "cosine",
      "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant"},
     "lr_warmup_steps = -1, lr_warmup_steps_ratio = 0.0, lr_scheduler_type = cosine, lr = 1e-06"),
])
def test_the_fsdp_engines_schedule_is_read_by_its_own_keys(eff, why):
    """verl's FSDP optimizer (the CPU path) names its schedule lr_scheduler_type (warmup_style
    before it), not Megatron's lr_decay_style: a constant one resumes on one schedule."""
    base = {"actor_rollout_ref.actor.strategy": "fsdp2",
            "actor_rollout_ref.actor.optim.lr": 1e-6,
            "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0}
    assert rules.non_constant_schedule({**base, **eff}) == why


def test_a_pinned_clone_with_local_changes_is_refused_or_counted(verl, tmp_path):
    """Issue 40, pinned trees: a line of the verl clone patched in place and an untracked
    recipe file added run as the Ray job's working directory while HEAD is still the pin.
    Preflight refuses them (rule pins_clean, not waivable), naming each file; with
    deps.allow_local_changes they run, counted: the diff's sha256 joins the pin in the
    trajectory (another diff, another trajectory), and the plan keeps the diff for the
    report. A training attempt refuses a clone edited after preflight."""
    from types import SimpleNamespace

    from hy3rl.train import Job, TrainError

    cfg = paper_cfg(tmp_path)
    clean = plan_for(cfg, verl, tmp_path, "clean")
    assert clean.ok and rule(clean, "pins_clean").status == "pass"
    assert clean.pins["verl"]["changes"] == [] and clean.pins["verl"]["diff_sha256"] is None
    assert clean.identity["trajectory"]["values"]["pin.verl"] == verl.commit

    (verl.path / "verl/__init__.py").write_text("WEIGHT_DECAY = 0.5  # patched in place\n")
    (verl.path / "recipe/mine.py").write_text("print('an added recipe')\n")
    cfg["preflight"]["waive"] = ["disk", "pins_clean"]  # not waivable: the schema refuses it
    with pytest.raises(ConfigError, match="pins_clean"):
        Config.from_dict(cfg)
    cfg["preflight"]["waive"] = ["disk"]
    dirty = plan_for(cfg, verl, tmp_path, "dirty")
    assert not dirty.ok
    (msg,) = rule(dirty, "pins_clean").messages
    assert rule(dirty, "pins_clean").status == "error"
    assert f"verl: {verl.path} differs from its pin {verl.commit}" in msg, msg
    assert "M verl/__init__.py" in msg and "?? recipe/mine.py" in msg, msg
    assert "deps.allow_local_changes" in msg
    assert not (tmp_path / "dirty" / "plan.json").exists()

    cfg["deps"]["allow_local_changes"] = True
    counted = plan_for(cfg, verl, tmp_path, "counted")
    assert counted.ok and rule(counted, "pins_clean").status == "warning"
    pin = counted.identity["trajectory"]["values"]["pin.verl"]
    sha = counted.pins["verl"]["diff_sha256"]
    assert pin == f"{verl.commit}+local:{sha}", pin
    assert "+WEIGHT_DECAY = 0.5" in counted.pins["verl"]["diff"]
    assert "untracked: recipe/mine.py" in counted.pins["verl"]["diff"]
    assert counted.identity["trajectory"]["id"] != clean.identity["trajectory"]["id"]
    (verl.path / "recipe/mine.py").write_text("print('another recipe')\n")
    other = plan_for(cfg, verl, tmp_path, "other")
    assert other.identity["trajectory"]["id"] != counted.identity["trajectory"]["id"]

    # the attempt's own check: the clone as preflight saw it, or a refusal naming it
    job = SimpleNamespace(plan={"pins": other.pins})
    Job.check_clones(job)
    (verl.path / "verl/__init__.py").write_text("WEIGHT_DECAY = 0.9  # patched again\n")
    with pytest.raises(TrainError, match="pinned clone verl .* changed since preflight"):
        Job.check_clones(job)
