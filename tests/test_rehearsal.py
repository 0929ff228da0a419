"""The one-node rehearsal (issue 21), without a cluster: its derived config, its plan's
reductions, the checks on its records (each way they fail), the launcher's decision after
the planned kill, the train job's runtime-identity gate, the runtime fingerprint that
re-runs it, and the rehearsal plan composed against the pinned verl (fixture real_verl).

The rehearsal itself runs for real through profiles/slurm in tests/test_eval_slurm.py and
through profiles/local in tests/test_rerun_identity.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from fixtures.common import REPO_ROOT, make_config
from fixtures.verl import write_lock
from hy3rl import rehearsal as rh
from hy3rl.layout import Layout
from hy3rl.settings import Runtime
from hy3rl.train import Job, TrainError, after_attempt

# --------------------------------------------------------------------------- the config


def test_derive_scales_the_run_to_one_node_and_lists_nothing_it_hides(tmp_path: Path) -> None:
    cfg = make_config(
        run={"name": "paper", "results_root": str(tmp_path / "results")},
        cluster={"gpu": True, "nodes": 16, "gpus_per_node": 8},
        train={"checkpoint_root": str(tmp_path / "ckpt"), "total_training_steps": 200,
               "env": {"ACTOR_PP": 16, "ROLLOUT_N": 16, "SAVE_FREQ": 20},
               "verl_overrides": {"actor_rollout_ref.actor.optim.lr": 2e-6,
                                  "++reward.reward_kwargs.overlong_buffer_cfg.len": 4096},
               "watchdog": {"startup_min": 150, "poll_s": 30}},
        rehearsal={"env": {"ACTOR_PP": 1, "ROLLOUT_N": 4}},
        preflight={"waive": ["disk", "rehearsal"]})
    layout = Layout.from_config(cfg)
    r = rh.derive(cfg, layout)
    assert (r.cluster.nodes, r.cluster.gpus_per_node) == (1, 8)
    assert r.train.total_training_steps == rh.TOTAL == 3
    # the shape's knobs over the run's, the rehearsal's over the shape's
    assert cfg.rehearsal.shape == "small" and cfg.rehearsal.env == {"ACTOR_PP": 1,
                                                                     "ROLLOUT_N": 4}
    small = rh.SHAPE_ENV["small"]
    assert small["TRAIN_BATCH_SIZE"] == 16 and small["MAX_RESPONSE_LENGTH"] == 512
    assert r.train.env == {**cfg.train.env, **small, **cfg.rehearsal.env, "SAVE_FREQ": 1,
                           "TEST_FREQ": 3}
    # the run's own overrides stay, the rehearsal's win on a shared key; the actor's lr is
    # the rehearsal's raised one (ACTOR_LR) even where the run sets it by an override
    assert small["ACTOR_LR"] == 1e-4
    assert r.train.verl_overrides == {"actor_rollout_ref.actor.optim.lr": 1e-4,
                                      "trainer.experiment_name": "paper-rehearsal",
                                      "++reward.reward_kwargs.overlong_buffer_cfg.len": 256}
    own = make_config(train={"verl_overrides": {"++actor_rollout_ref.actor.optim.lr": 2e-6}},
                      rehearsal={"verl_overrides": {"actor_rollout_ref.actor.optim.lr": 3e-5}})
    assert rh.derive(own, Layout.from_config(own)).train.verl_overrides[
        "++actor_rollout_ref.actor.optim.lr"] == 2e-6  # the rehearsal's own override decides
    assert r.model.path == os.path.abspath(layout.rehearsal_model)
    assert r.train.on_config_change == "fresh" and r.train.restarts_per_job == 0
    assert r.train.watchdog.poll_s == 1.0 and r.train.watchdog.startup_min == 30.0
    assert r.train.watchdog.startup_floor_min == 30.0
    assert r.preflight.waive == ["disk"]
    assert (r.eval.num_problems, r.eval.n_samples, r.eval.steps) == (4, 2, [])
    assert r.eval.vllm.tensor_parallel_size == 1 and r.data.heldout is None
    rl = layout.rehearsal_layout()
    assert rl.checkpoint_dir == tmp_path / "ckpt" / "paper-rehearsal"
    assert rl.preflight_plan == f"{layout.results}/rehearsal/preflight/plan.json"
    assert rl.train_done == f"{layout.results}/rehearsal/train/done.json"


def test_off_a_gpu_every_check_is_not_run_with_its_reason(tmp_path: Path) -> None:
    cfg = make_config(run={"results_root": str(tmp_path / "results")})
    layout = Layout.from_config(cfg)
    out = Path(layout.rehearsal_record)
    with pytest.raises(rh.RehearsalError, match=r"not run: no GPU allocation"):
        rh.run(cfg, layout, runtime_env=tmp_path / "env.yaml", val=tmp_path / "v", out=out)
    doc = json.loads(Path(layout.rehearsal_checks).read_text())
    assert {c["status"] for c in doc["checks"]} == {"not run"} and not doc["ok"]
    assert [c["name"] for c in doc["checks"]] == list(rh.CHECKS)
    assert not out.exists()


def test_reductions_list_every_value_that_differs() -> None:
    main = {"resolved": {"a": {"value": "1"}, "b": {"value": "x"}, "gone": {"value": "2"}}}
    reh = {"resolved": {"a": {"value": "1"}, "b": {"value": "y"}, "new": {"value": "3"}}}
    assert rh.reductions(main, reh) == [
        {"key": "b", "run": "x", "rehearsal": "y"},
        {"key": "gone", "run": "2", "rehearsal": None},
        {"key": "new", "run": None, "rehearsal": "3"}]


# --------------------------------------------------------------------------- the checks

# verl@220e903's actor keys as the trainer double logs them (tests/fixtures/trainer_double.py)
KEYS = {**{k: 0.5 for k in rh.STEP_KEYS}, "response_length/mean": 2001.0,
        "response_length/max": 8192.0, "response_length/clip_ratio": 0.05,
        "response_length/min": 640.0, "response/aborted_ratio": 0.0, "critic/score/min": -1.0,
        "actor/entropy": 0.45, "actor/pg_loss": -0.01, "actor/grad_norm": 0.3,
        "actor/perf/max_memory_allocated_gb": 60.0, "actor/perf/max_memory_reserved_gb": 64.0,
        "actor/perf/cpu_memory_used_gb": 120.0}


def _line(step: int, **data) -> dict:
    d = {**KEYS, **data}
    if step % 1 == 0:
        d["timing_s/save_checkpoint"] = 0.25
    return {"step": step, "data": d}


def _sample(i: int, finish_reason: str | None, num_tokens: int) -> dict:
    """A samples.jsonl line (docs/formats/eval.md) of problem p<i // 2>."""
    return {"problem_id": f"p{i // 2}", "sample_index": i % 2, "seed": 1000 + i,
            "prompt_hash": "9f2c", "response": "x" * num_tokens, "num_tokens": num_tokens,
            "finish_reason": finish_reason}


# What read_state gives for a good rehearsal (weight_changes, data_position, optimizer_steps
# on real checkpoints: the tests at the end of this file), and a reward probe that passed.
GOOD_STATE = {
    "weights": {"model": "m", "before": "b", "after": "a", "problems": [], "tensors": {
        "model.embed_tokens.weight": {"kind": "trained", "numel": 8, "ndim": 2,
                                      "vs_before": 6, "vs_input": 8, "sq_before": 4.0,
                                      "sq_after": 9.0},
        "model.layers.1.mlp.expert_bias": {"kind": "fixed", "numel": 4, "ndim": 1,
                                           "vs_before": 0, "vs_input": 0},
        "model.norm.weight": {"kind": "trained", "numel": 2, "ndim": 1, "vs_before": 0,
                              "vs_input": 2},
        "model.layers.3.eh_proj.weight": {"kind": "mtp", "numel": 4, "ndim": 2,
                                          "vs_before": 0, "vs_input": 0}}},
    "data": {2: 2, 3: 3}, "optimizer": {2: 2, 3: 3}}
GOOD_REWARD = {"status": "pass", "detail": "training row 0 (math_dapo, ground truth '34') "
               "through DAPORewardManager (dapo): correct 1 (acc True), wrong -1 (acc False)"}


def _records(**change) -> rh.Records:
    """The records of a rehearsal that passed (attempt 1 killed after step 2's save, attempt
    2 resumed for step 3, eight samples); ``change`` replaces fields."""
    val = {"step": 0, "data": {"val-core/math_dapo/acc/mean@1": 0.1}}
    a1 = {"attempt": 1, "outcome": "planned_kill", "start_step": 0, "end_step": 2,
          "exit_reason": "killed after the save of step 2", "timing": {"startup_s": 120.0}}
    a2 = {"attempt": 2, "outcome": "succeeded", "start_step": 2, "end_step": 3,
          "exit_reason": "succeeded", "timing": {"startup_s": 95.0}}
    lines1 = [val, _line(1), _line(2)]
    lines2 = [{"step": 2, "data": {"val-core/math_dapo/acc/mean@1": 0.1}}, _line(3)]
    base = dict(
        plan={"ok": True, "rehearsal": {"reductions": [{"key": "k"}]},
              "effective": {"data.max_response_length": 8192}},
        attempts=[a1, a2], attempt_lines={1: lines1, 2: lines2},
        merged=[val, _line(1), _line(2), _line(3)], done={"final_step": 3},
        complete={1: (True, ""), 2: (True, ""), 3: (True, "")},
        driver_logs={1: "step:1 - critic/rewards/mean:0.0\n", 2: ""},
        samples=[_sample(i, "length" if i % 3 else "stop", 4 if i % 3 else 2)
                 for i in range(8)],
        samples_meta={"status": "complete", "backend": "vllm", "seconds": 41.0},
        expected_samples=8, state=GOOD_STATE, reward_path=GOOD_REWARD, gpu_memory_gb=96.0,
        memory_headroom=0.9)
    base.update(change)
    return rh.Records(**base)


def _status(rec: rh.Records) -> dict[str, str]:
    return {c.name: c.status for c in rh.check_records(rec)}


def test_records_of_a_good_rehearsal_pass_every_check() -> None:
    rec = _records()
    assert _status(rec) == dict.fromkeys(rh.CHECKS, "pass")
    times = rh.phase_times(rec)
    assert times["startup"] == 120.0 and times["resume"] == 95.0
    assert times["step"] == 0.25 and times["save"] == 0.25 and times["evaluation"] == 41.0


def test_a_resume_from_step_one_fails_the_resumed_check() -> None:
    rec = _records(attempt_lines={1: [_line(1), _line(2)], 2: [_line(1), _line(2), _line(3)]})
    checks = {c.name: c for c in rh.check_records(rec)}
    assert checks["resumed"].status == "fail"
    assert "attempt 2's first step was 1, not 3" in checks["resumed"].detail


def test_an_attempt_one_that_trained_past_the_kill_fails_the_killed_check() -> None:
    """Issue 43: attempt 1's newest complete checkpoint at the kill is step 2 but it went on
    to train step 3 (its save unfinished): the resume then redoes a step the first attempt
    logged, and the rehearsal did not test the kill it plans. Its last logged step says so,
    from the attempt record or, where the record lacks it, the attempt's own metrics."""
    rec = _records()
    a1 = {**rec.attempts[0], "last_logged_step": 3}
    assert _failed(_records(attempts=[a1, rec.attempts[1]])) == {
        "killed": "attempt 1's last logged training step was 3, not 2"}
    lines = {1: [*rec.attempt_lines[1], _line(3)], 2: rec.attempt_lines[2]}
    assert _failed(_records(attempt_lines=lines)) == {
        "killed": "attempt 1's last logged training step was 3, not 2"}


def test_a_crash_fails_with_the_phase_and_the_trainers_error_line() -> None:
    a1 = {"attempt": 1, "outcome": "failed", "start_step": 0, "end_step": 1,
          "exit_reason": "trainer failed (FAILED, exit 1)",
          "error": "RuntimeError: CUDA error: no kernel image is available",
          "timing": {"startup_s": 80.0, "phase": "step+save"}}
    rec = _records(attempts=[a1], attempt_lines={1: [_line(1)]}, merged=[_line(1)], done=None,
                   complete={1: (True, ""), 2: (False, "absent"), 3: (False, "absent")},
                   samples=None, samples_meta=None)
    status = _status(rec)
    assert {k for k, v in status.items() if v == "fail"} == {
        "trained", "steps_logged", "checkpoints", "killed", "resumed", "evaluation",
        "generated", "finish_reasons", "phases"}
    fail = rh.failure_of(rec)
    assert fail == {"phase": "step+save", "attempt": 1,
                    "error": "RuntimeError: CUDA error: no kernel image is available",
                    "exit_reason": "trainer failed (FAILED, exit 1)"}
    doc = {"checks": [vars(c) for c in rh.check_records(rec)], "failure": fail}
    msg = rh.failure_message(doc, Path("rehearsal/checks.json"))
    assert "died in phase step+save (attempt 1): RuntimeError: CUDA error" in msg
    assert msg.count("|") == 8 and "preflight.waive: [rehearsal]" in msg
    # a resumed attempt that dies before its first line died in the resume
    a2 = {**a1, "attempt": 2, "timing": {"phase": "startup"}}
    killed = {**a1, "outcome": "planned_kill"}
    assert rh.failure_of(_records(attempts=[killed, a2]))["phase"] == "resume"


def test_missing_metric_keys_reward_errors_and_incomplete_samples_fail() -> None:
    merged = [{"step": 0, "data": {"val-core/math_dapo/acc/mean@1": 0.1}}, _line(1),
              {"step": 2, "data": {k: v for k, v in _line(2)["data"].items()
                                   if k != "rollout_corr/k3_kl"}}, _line(3)]
    checks = {c.name: c for c in rh.check_records(_records(merged=merged))}
    assert checks["steps_logged"].detail == "step 2 lacks rollout_corr/k3_kl"
    nan = [m if m["step"] != 3 else _line(3, **{"critic/score/mean": float("nan")})
           for m in merged]
    checks = {c.name: c for c in rh.check_records(_records(merged=nan))}
    assert "step 3: critic/score/mean not a finite number" in checks["reward"].detail
    logs = {1: "", 2: "  File reward_fn.py, in compute_score\nValueError: math_dapo failed"}
    checks = {c.name: c for c in rh.check_records(_records(driver_logs=logs))}
    assert checks["reward"].status == "fail" and "attempt 2" in checks["reward"].detail
    not_run = {"status": "not run", "reason": "no module named vllm", "backend": "vllm"}
    checks = {c.name: c for c in rh.check_records(_records(samples=None,
                                                           samples_meta=not_run))}
    assert checks["evaluation"].detail == "no samples (not run: no module named vllm)"
    no_val = [m for m in merged if m["step"]]
    assert _status(_records(merged=no_val))["steps_logged"] == "fail"


# --------------------------------------------------------------------------- the launcher


def test_the_planned_kill_restarts_without_a_restart_left() -> None:
    rec = {"attempt": 1, "outcome": "planned_kill",
           "exit_reason": "killed after the save of step 2"}
    step = after_attempt(rec, [rec], restarts_left=0, lost=[], allocation=["n1"],
                         nodes_needed=1, time_left=None, interval=None)
    assert step.restart and step.retry
    crash = {**rec, "outcome": "failed", "exit_reason": "trainer failed"}
    assert not after_attempt(crash, [crash], restarts_left=0, lost=[], allocation=["n1"],
                             nodes_needed=1, time_left=None, interval=None).restart


def test_the_planned_kill_lands_after_step_two_however_fast_the_trainer(
        train_setup, monkeypatch) -> None:
    """The kill is not a race (issue 28): the trainer double's 10 ms steps finish all three
    steps long before the launcher's first look at them (polls 0.5 s apart), yet attempt 1
    ends at step 2 with global_step_2 its newest checkpoint and never logs step 3 (verl's
    own schedule ends it there: trainer.total_training_steps=2), and attempt 2 resumes from
    it with step 3. Under a kill that waited for a poll to see step 2's save the first
    attempt trained to step 3 and was never killed."""
    import torch  # noqa: F401  (the double's saves need it; imported once before the fork)
    from fixtures.trainer_double import local_launch
    from hy3rl import launch, runtime_id, train

    setup = train_setup(total=3, save_freq=1, keep=3, step_s=0.01)
    setup.config["train"]["watchdog"] = {"poll_s": 0.5}
    monkeypatch.setattr(launch, "launch", local_launch(setup))
    monkeypatch.setattr(runtime_id, "identify", lambda prefix, python, cache=None: {
        "id": "test-runtime", "kind": "test"})
    cfg, layout = setup.cfg(), setup.layout()
    train.run(cfg.train, cfg.cluster, layout, keep_steps=range(1, 4), kill_after=2,
              **setup.run_paths())
    attempts = [train.load_attempt(layout, k) for k in train.attempt_numbers(layout)]
    assert [(a["outcome"], a["end_step"]) for a in attempts] == [
        ("planned_kill", 2), ("succeeded", 3)], attempts
    first, second = attempts
    assert (first["outcome"], first["end_step"], first["last_logged_step"]) == (
        "planned_kill", 2, 2), first
    assert "planned kill" in first["exit_reason"]
    steps = [ln["step"] for ln in rh._train_lines(rh.read_metrics(
        Path(layout.attempt_metrics(2))))]
    assert (second["outcome"], second["start_step"], second["end_step"], steps) == (
        "succeeded", 2, 3, [3]), second
    records = rh.Records(plan={}, attempts=[first, second],
                         attempt_lines={2: rh.read_metrics(Path(layout.attempt_metrics(2)))},
                         merged=[], done=None, complete={}, driver_logs={}, samples=None,
                         samples_meta=None, expected_samples=0)
    assert _status(records)["killed"] == "pass" and _status(records)["resumed"] == "pass"


def test_a_trainer_that_fails_in_its_teardown_after_the_planned_last_step_is_the_kill(
        train_setup, monkeypatch) -> None:
    """Issue 43: attempt 1's trainer ends at its planned last step (2) with global_step_2
    complete, then exits with an error in its teardown before the watchdog's stop lands (the
    double raises after its last step): the attempt is the planned kill, its error kept in
    the record, and attempt 2 resumes from step 2; before, it was recorded as failed and
    the rehearsal ended there. A trainer that fails before its planned last step's save is
    complete stays failed (the crash tests)."""
    import torch  # noqa: F401  (the double's saves need it; imported once before the fork)
    from fixtures.trainer_double import local_launch
    from hy3rl import launch, runtime_id, train

    setup = train_setup(total=3, save_freq=1, keep=3, step_s=0.01)
    setup.config["train"]["watchdog"] = {"poll_s": 0.5}
    setup.faults.write_text(json.dumps({"fail_at_exit": 2}))
    monkeypatch.setattr(launch, "launch", local_launch(setup))
    monkeypatch.setattr(runtime_id, "identify", lambda prefix, python, cache=None: {
        "id": "test-runtime", "kind": "test"})
    cfg, layout = setup.cfg(), setup.layout()
    train.run(cfg.train, cfg.cluster, layout, keep_steps=range(1, 4), kill_after=2,
              **setup.run_paths())
    first, second = (train.load_attempt(layout, k) for k in train.attempt_numbers(layout))
    assert (first["outcome"], first["end_step"], first["last_logged_step"]) == (
        "planned_kill", 2, 2), first
    assert first["trainer_exit"]["exit_code"] != 0, first
    assert first["exit_reason"].endswith(f"; the trainer then exited with an error "
                                         f"({first['trainer_exit']['reason']})"), first
    assert (second["outcome"], second["start_step"], second["end_step"]) == (
        "succeeded", 2, 3), second
    records = rh.Records(plan={}, attempts=[first, second],
                         attempt_lines={2: rh.read_metrics(Path(layout.attempt_metrics(2)))},
                         merged=[], done=None, complete={}, driver_logs={}, samples=None,
                         samples_meta=None, expected_samples=0)
    assert _status(records)["killed"] == "pass" and _status(records)["resumed"] == "pass"


def test_the_train_job_refuses_a_runtime_the_rehearsal_did_not_pass_in(tmp_path) -> None:
    cfg = make_config(cluster={"gpu": True})
    job = Job(cfg.train, cfg.cluster, Layout.from_config(cfg), {}, 3, 3, [], tmp_path,
              tmp_path, tmp_path, rehearsed={"id": "image docker://verl@sha256:aaa"})
    job.check_rehearsed({"id": "image docker://verl@sha256:aaa"})
    with pytest.raises(TrainError, match=r"differs from the one the rehearsal passed in"):
        job.check_rehearsed({"id": "image docker://verl@sha256:bbb"})
    Job(cfg.train, cfg.cluster, Layout.from_config(cfg), {}, 3, 3, [], tmp_path, tmp_path,
        tmp_path).check_rehearsed({"id": "anything"})  # waived: no record, no check
    bad = tmp_path / "rehearsal.json"
    bad.write_text(json.dumps({"ok": False}))
    with pytest.raises(rh.RehearsalError, match="not a passed rehearsal"):
        rh.passed_identity(bad)
    assert rh.passed_identity(None) is None
    # `hy3rl train` by hand keeps the gate: no record, no training (unless waived)
    gpu = make_config(cluster={"gpu": True}, run={"results_root": str(tmp_path / "r")})
    with pytest.raises(rh.RehearsalError, match="no passed rehearsal"):
        rh.gate(gpu, Layout.from_config(gpu))
    waived = make_config(cluster={"gpu": True}, preflight={"waive": ["rehearsal"]})
    assert rh.gate(waived, Layout.from_config(waived)) is None


def test_runtime_fingerprint_sees_a_changed_sif_and_a_changed_environment(tmp_path) -> None:
    sif = tmp_path / "verl.sif"
    sif.write_bytes(b"x" * 10)
    rt = Runtime(prefix=f"apptainer exec --nv {sif}", python="python3")
    before = rh.runtime_fingerprint(rt)
    assert "sif size=10" in before
    assert rh.runtime_fingerprint(rt) == before  # stat only: stable
    sif.write_bytes(b"y" * 11)
    assert rh.runtime_fingerprint(rt) != before
    image = Runtime(prefix="apptainer exec docker://verlai/verl@sha256:abc", python="python3")
    assert rh.runtime_fingerprint(image).startswith(
        "prefix='apptainer exec docker://verlai/verl@sha256:abc'")
    env = tmp_path / "env"
    sp = env / "lib" / "python3.12" / "site-packages"
    sp.mkdir(parents=True)
    (env / "bin").mkdir()
    (env / "bin" / "python").symlink_to("/usr/bin/env")
    local = Runtime(prefix="", python=str(env / "bin" / "python"))
    first = rh.runtime_fingerprint(local)
    assert "python3.12/site-packages mtime_ns=" in first
    time.sleep(0.01)
    (sp / "newpkg-1.0.dist-info").mkdir()  # a package installed
    assert rh.runtime_fingerprint(local) != first


# --------------------------------------------------------------------------- real verl

@pytest.mark.slow  # verl's own validators in a subprocess (torch, verl)
def test_rehearsal_plan_of_the_paper_run_against_real_pinned_verl(tmp_path: Path,
                                                                  tiny_hy3_dir: Path,
                                                                  monkeypatch,
                                                                  real_verl: Path) -> None:
    """The paper config's rehearsal plan, composed over the pinned verl's Hydra config and
    checked by verl's own validators on the rehearsal's model: every rule and check passes,
    and the plan lists the reductions against the paper plan."""
    from hy3rl import preflight
    from hy3rl.config import deep_merge, load
    from hy3rl.model import build_tiny_model
    from hy3rl.settings import Config

    monkeypatch.setenv("WANDB_MODE", "offline")  # the paper's loggers include wandb
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=real_verl, capture_output=True,
                          text=True).stdout.strip()
    lock = write_lock(tmp_path / "lock.json", real_verl, head)
    raw = deep_merge(load(REPO_ROOT / "config/config.yaml", REPO_ROOT / "config/paper.yaml"), {
        "run": {"results_root": str(tmp_path / "results")},
        "model": {"source": str(tiny_hy3_dir), "revision": None, "dir": ""},
        "data": {"heldout": None}, "eval": {"select": None},
        "train": {"checkpoint_root": str(tmp_path / "ckpt")},
        "preflight": {"waive": ["disk"]},
        # the small shape (the paper's is stage: its plan over the fake verl is in
        # test_stage.py; a stage of the tiny fixture's 3 layers does not split into 16)
        "rehearsal": {"shape": "small", "env": {"ACTOR_EP": 8}, "model": {"num_experts": 8}}})
    cfg = Config.from_dict(raw)
    layout = Layout.from_config(cfg)
    build_tiny_model(layout.rehearsal_model, cfg.rehearsal.model)
    bridge = tmp_path / "bridge.json"
    bridge.write_text(json.dumps({"ok": True, "checks": [
        {"name": "tiny/logits", "status": "pass"}]}))
    data = {"train_files": tmp_path / "data/train.parquet",
            "val_files": tmp_path / "data/val.parquet"}
    main = tmp_path / "main" / "plan.json"
    preflight.run(cfg, lock=lock, data_summary=None, checkpoint_check=None,
                  bridge_check=bridge, plan=main, launch=main.with_name("launch.sh"),
                  refused=main.with_name("refused.json"),
                  reward_fn=lambda sha: main.with_name(f"{sha}.py"), **data)
    rh.plan(cfg, layout, lock=lock, data_summary=tmp_path / "none.json",
            checkpoint_check=None, bridge_check=bridge, main_plan=main, **data)
    doc = json.loads(Path(layout.rehearsal_layout().preflight_plan).read_text())
    assert doc["ok"], doc["errors"]
    assert doc["verl_checks"]["counts"] == {"pass": 8, "fail": 0, "not run": 0}, \
        doc["verl_checks"]["checks"]
    red = {r["key"]: (r["run"], r["rehearsal"]) for r in doc["rehearsal"]["reductions"]}
    assert red["trainer.nnodes"] == ("16", "1")
    assert red["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"] == ("16", "1")
    assert red["actor_rollout_ref.rollout.tensor_model_parallel_size"] == ("16", "1")
    assert red["reward.reward_kwargs.overlong_buffer_cfg.len"] == ("4096", "256")
    # raised so that one step moves bf16 weights (check updated), listed as a reduction
    assert red["actor_rollout_ref.actor.optim.lr"] == ("1e-6", "0.0001")
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size" not in red  # EP 8
    assert doc["effective"]["trainer.total_training_steps"] == 3
    assert doc["effective"]["trainer.save_freq"] == 1
    # issue 43: the memory of every stage of the paper run, from the values the pinned verl
    # composes (the launch script's full recompute, verl's distributed optimizer and
    # max_num_seqs) and the real Hy3's config: the hand table's stage 1 (63.2 GB) the
    # heaviest, vLLM's 25.5 GB and 256 requests an engine; the tiny stand-in's 3 layers do
    # not split into 16 stages: not run, said so
    from hy3rl import stage_memory as sm
    from test_stage import HY3, HY3_BYTES

    eff = json.loads(main.read_text())["effective"]
    rc = eff["actor_rollout_ref.actor.megatron.override_transformer_config"]
    assert (rc["recompute_granularity"], rc["recompute_method"], rc["recompute_num_layers"]) \
        == ("full", "uniform", 1)
    assert eff["actor_rollout_ref.actor.megatron.use_distributed_optimizer"] is True
    run = sm.stages(HY3, eff, 128)
    assert run["worst"] == 1 and run["stages"][1]["peak_gb"] == pytest.approx(63.2, rel=0.05)
    roll = sm.rollout(HY3, eff, gpus=128, gpu_memory_gb=96, model_bytes=HY3_BYTES)
    assert roll["kv_budget_gb"] == pytest.approx(25.5, abs=0.05)
    assert (roll["requests_per_engine"], roll["max_num_seqs"]) == (256, 1024)
    assert doc["rehearsal"]["per_gpu"]["memory"]["not_run"] == (
        "not run: num_hidden_layers 3 does not split into PP 16 stages")
    # the reward probe (check reward_path) through the pinned verl's own reward manager, as
    # the plan configures it, with the rehearsal model's tokenizer: DAPO, math_dapo's scorer
    import sys

    from hy3rl import reward_probe

    res = reward_probe.probe(doc, model_dir=Path(layout.rehearsal_model),
                             train_files=_train_parquet(tmp_path / "probe.parquet"),
                             python=[sys.executable])
    assert res["status"] == "pass", res
    assert res["detail"] == ("training row 0 (math_dapo, ground truth '34') through "
                             "DAPORewardManager (dapo): correct 1 (acc True), wrong -1 (acc "
                             "False)")


def test_the_reports_row_says_what_the_rehearsal_did() -> None:
    from hy3rl.report.read import rehearsal_status

    gpu = make_config(cluster={"gpu": True})
    passed = {"checks": [{"name": n, "status": "pass"} for n in rh.CHECKS]}
    assert rehearsal_status(gpu, passed) == ("pass", f"{len(rh.CHECKS)} checks passed")
    failed = {"checks": [{"name": "resumed", "status": "fail"}, {"name": "plan",
                                                                 "status": "pass"}]}
    assert rehearsal_status(gpu, failed) == ("fail", "1 of 2 checks failed: resumed")
    assert rehearsal_status(gpu, None)[0] == "missing"
    waived = make_config(cluster={"gpu": True}, preflight={"waive": ["rehearsal"]})
    assert rehearsal_status(waived, passed)[0] == "waived"
    assert rehearsal_status(make_config(), None)[0] == "not run"
    not_run = {"checks": [{"name": n, "status": "not run", "detail": "not run: no GPU"}
                          for n in rh.CHECKS]}
    assert rehearsal_status(gpu, not_run) == ("not run", "not run: no GPU")


# ---------------------------------------------------------------- the silent failures (issue 28)


def _failed(rec: rh.Records) -> dict[str, str]:
    return {c.name: c.detail for c in rh.check_records(rec) if c.status != "pass"}


def _merged_with(step: int, **data) -> list[dict]:
    """The good records' merged lines with ``data`` over step ``step``'s line."""
    return [m if m["step"] != step else _line(step, **data) for m in _records().merged]


def test_good_records_record_the_figures_of_the_silent_failure_checks() -> None:
    checks = {c.name: c for c in rh.check_records(_records())}
    assert checks["generated"].detail == (
        "response_length/mean: step 1 2001 (min 640, aborted 0), step 2 2001 (min 640, "
        "aborted 0), step 3 2001 (min 640, aborted 0); evaluation: 8 samples, mean 3.25 "
        "tokens, 0 empty")
    assert checks["finish_reasons"].detail == '"stop": 3, "length": 5'
    assert checks["finite"].detail == ("steps 1, 2, 3: actor/pg_loss -0.01..-0.01, "
                                       "actor/grad_norm 0.3..0.3, actor/entropy 0.45..0.45")


def test_empty_generations_in_training_fail_the_generated_check() -> None:
    failed = _failed(_records(merged=_merged_with(2, **{"response_length/mean": 0.0})))
    assert set(failed) == {"generated"}
    assert failed["generated"] == ("step 2: response_length/mean 0: the rollouts generated "
                                   "nothing but the EOS token")


def test_empty_evaluation_samples_fail_the_generated_check() -> None:
    samples = [_sample(i, "stop", 0) for i in range(8)]
    failed = _failed(_records(samples=samples))
    assert set(failed) == {"generated"}
    assert failed["generated"] == (
        "evaluation: 8 samples, mean 0 tokens, 8 empty: more than 0.125 of the samples have "
        "no text (first: sample 0, problem 'p0', 0 token(s), finish reason 'stop')")
    # one empty sample of eight is a figure, not a failure (a model may stop at once); two
    # fail: the mean (here 2.25 tokens) no longer hides them
    some = [_sample(i, "stop", 0 if i == 0 else 3) for i in range(8)]
    detail = {c.name: c for c in rh.check_records(_records(samples=some))}["generated"]
    assert detail.status == "pass" and "mean 2.625 tokens, 1 empty" in detail.detail
    two = [_sample(i, "stop", 0 if i in (0, 5) else 3) for i in range(8)]
    assert _failed(_records(samples=two))["generated"].startswith(
        "evaluation: 8 samples, mean 2.25 tokens, 2 empty: more than 0.125 of the samples "
        "have no text (first: sample 0,")


def test_responses_that_never_reached_the_limit_fail_the_full_length_check() -> None:
    """The memory peaks of a rehearsal whose responses all ended early are not the run's
    full-length peak: no step with a response at the limit fails, naming the figures. As
    verl's v1 trainer logs it, clip_ratio is the share of the batch's longest responses,
    never 0: a clip_ratio above 0 with the longest response short of the limit fails."""
    plan = {"ok": True, "rehearsal": {"reductions": []},
            "effective": {"data.max_response_length": 8192}}
    good = {c.name: c for c in rh.check_records(_records(plan=plan))}["full_length"]
    assert (good.status, good.detail) == ("pass", (
        "responses at max_response_length 8192 in step(s) [1, 2, 3] (response_length/"
        "clip_ratio: step 1 0.05 (max 8192), step 2 0.05 (max 8192), step 3 0.05 (max 8192))"))
    short = {"response_length/clip_ratio": 0.0625, "response_length/max": 3000.0}
    merged = [_line(m["step"], **short) if m["step"] else m for m in _records().merged]
    assert _failed(_records(plan=plan, merged=merged)) == {"full_length": (
        "no step's responses reached max_response_length 8192 (response_length/clip_ratio: "
        "step 1 0.0625 (max 3000), step 2 0.0625 (max 3000), step 3 0.0625 (max 3000)): the "
        "memory peaks were measured below the run's full-length step")}
    # one full step is enough (the peak is the largest step's); a missing figure fails
    one = [_line(m["step"], **(short if m["step"] != 2 else {})) if m["step"] else m
           for m in _records().merged]
    assert "full_length" not in _failed(_records(plan=plan, merged=one))
    gone = [{"step": m["step"], "data": {k: v for k, v in m["data"].items()
                                         if k != "response_length/clip_ratio"}}
            if m["step"] == 3 else m for m in _records().merged]
    assert _failed(_records(plan=plan, merged=gone)) == {"full_length": (
        "step 3: response_length/clip_ratio missing or not a finite number (None)")}
    # without the plan's limit nothing says the responses reached it
    bare = {"ok": True, "rehearsal": {"reductions": []}}
    assert _failed(_records(plan=bare))["full_length"].startswith(
        "the plan names no data.max_response_length to compare response_length/max with")


@pytest.mark.parametrize(("key", "value", "says"), [
    ("actor/grad_norm", float("nan"), "step 2: actor/grad_norm = nan"),
    ("actor/pg_loss", float("inf"), "step 2: actor/pg_loss = inf"),
    ("actor/entropy", float("nan"), "step 2: actor/entropy = nan"),
    ("actor/loss", float("-inf"), "step 2: actor/loss = -inf")])
def test_a_non_finite_loss_gradient_or_entropy_fails_the_finite_check(key, value, says) -> None:
    failed = _failed(_records(merged=_merged_with(2, **{key: value})))
    assert failed == {"finite": says}


def test_a_missing_actor_key_fails_the_finite_check_as_missing() -> None:
    merged = [m if m["step"] != 3 else
              {"step": 3, "data": {k: v for k, v in m["data"].items() if k != "actor/grad_norm"}}
              for m in _records().merged]
    assert _failed(_records(merged=merged)) == {"finite": "step 3: actor/grad_norm missing"}


@pytest.mark.parametrize("reason", [None, "abort"])
def test_an_unfinished_or_aborted_sample_fails_the_finish_reasons_check(reason) -> None:
    samples = [_sample(i, reason if i == 5 else "length", 4) for i in range(8)]
    failed = _failed(_records(samples=samples))
    assert set(failed) == {"finish_reasons"}
    shown = "null" if reason is None else '"abort"'
    assert failed["finish_reasons"] == (
        f'1 of 8 sample(s) with a finish reason other than stop or length ("length": 7, '
        f"{shown}: 1); first: sample 5 (problem 'p2', index 1): {reason!r}")


@pytest.mark.slow  # verl's own code in two subprocesses (torch, verl)
def test_the_silent_failures_fail_by_name_as_verl_writes_them(tmp_path: Path,
                                                              real_verl: Path) -> None:
    """Issue 43: the records on disk as the pinned verl writes them, read by Records.read:
    the metrics of each step computed by verl's own compute_data_metrics on a batch built as
    its v1 trainer builds it (responses of nothing but the EOS token at step 2, three of four
    rollouts aborted at step 3, every response scored +1), written by verl's own FileLogger
    (orjson: NaN and ±inf as null) with a NaN gradient norm, an infinite loss and a NaN
    validation accuracy; samples.jsonl lines of hy3rl.evaluate's records where 7 of 8 samples
    are the EOS token alone (no text). Each check fails by name; before, verl's null was
    read as absent, a one-token response counted as generated and the scores went unjudged."""
    from dataclasses import asdict

    from fixtures.verl_records import data_metrics_like_verl, write_like_verl
    from hy3rl.atomic import write_jsonl_atomic
    from hy3rl.evaluate import Request, vllm_output_to_record

    cfg = make_config(run={"results_root": str(tmp_path / "results")})
    rl = Layout.from_config(cfg).rehearsal_layout()
    batches = {1: ([700, 900, 1200, 64], [1.0, 1.0, 1.0, 1.0]),
               2: ([1, 1, 1, 1], [1.0, 1.0, 1.0, 1.0]),     # EOS alone, "scored" right
               3: ([0, 0, 0, 500], [0.0, 0.0, 0.0, 1.0])}   # three of four aborted
    datas = [{"val-core/math_dapo/acc/mean@1": float("nan")}]
    for step, (lengths, scores) in batches.items():
        d = {**KEYS, **data_metrics_like_verl(real_verl, lengths, scores)}
        if step == 2:
            d.update({"actor/grad_norm": float("nan"), "actor/pg_loss": float("inf")})
        datas.append(d)
    metrics = Path(rl.train_metrics)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    write_like_verl(real_verl, metrics, datas, start_step=0)
    text = metrics.read_text()
    assert '"actor/grad_norm":null' in text and '"val-core/math_dapo/acc/mean@1":null' in text
    assert '"response_length/clip_ratio":1.0' in text  # verl's clip ratio of EOS-only responses
    reqs = [Request(f"p{i // 2}", i % 2, 1000 + i, "q", "9f2c", (("user", "q"),))
            for i in range(8)]
    outs = [("", [2], "stop") if i < 7 else ("x = 3", [87, 2], "stop") for i in range(8)]
    samples = Path(rl.eval_samples("final"))
    samples.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(samples, (asdict(vllm_output_to_record(r, *o))
                                 for r, o in zip(reqs, outs, strict=True)))
    checks = {c.name: c for c in rh.check_records(rh.Records.read(rl, 8))}
    null = "null (NaN or ±inf as verl's FileLogger writes them)"
    assert checks["finite"].status == "fail"
    assert checks["finite"].detail == (f"step 2: actor/pg_loss = {null}; step 2: "
                                       f"actor/grad_norm = {null}")
    assert checks["steps_logged"].status == "fail"
    assert checks["steps_logged"].detail.endswith(
        f"validation at step 0: val-core/math_dapo/acc/mean@1 {null}")
    assert checks["generated"].status == "fail"
    assert checks["generated"].detail == (
        "step 2: response_length/mean 1: the rollouts generated nothing but the EOS token; "
        "step 3: response/aborted_ratio 0.75: most rollouts were aborted (at most 0.25 "
        "expected); evaluation: 8 samples, mean 1.125 tokens, 7 empty: more than 0.125 of "
        "the samples have no text (first: sample 0, problem 'p0', 1 token(s), finish reason "
        "'stop')")
    assert checks["reward"].status == "fail"
    assert checks["reward"].detail == (
        "every response of every step scored above 0 (critic/score/min: step 1 1, step 2 1, "
        "step 3 1): all answers right, impossible for the rehearsal's random model; the "
        "reward does not judge the responses")


# --------------------------------------------------------------------------- memory (issue 28)


def test_good_records_record_each_phases_memory_peak_beside_the_device() -> None:
    checks = {c.name: c for c in rh.check_records(_records(merged=_merged_with(
        3, **{"actor/perf/max_memory_reserved_gb": 70.25})))}
    assert checks["memory_headroom"].status == "pass"
    assert checks["memory_headroom"].detail == (
        "phase update: actor/perf/max_memory_allocated_gb 60.0 GiB (step 1), "
        "actor/perf/max_memory_reserved_gb 70.2 GiB (step 3), actor/perf/cpu_memory_used_gb "
        "120.0 GiB (step 1): each GPU peak at most 0.9 of the 96 GB GPU (80.5 GiB)")
    peaks = rh.memory_peaks({ln["step"]: ln["data"] for ln in _records().merged if ln["step"]})
    assert peaks["update"]["max_memory_reserved_gb"] == {
        "key": "actor/perf/max_memory_reserved_gb", "peak": 64.0, "step": 1, "missing": []}


def test_a_peak_above_the_headroom_fails_naming_the_phase_step_peak_and_device() -> None:
    failed = _failed(_records(merged=_merged_with(
        2, **{"actor/perf/max_memory_reserved_gb": 85.0})))
    assert failed == {"memory_headroom": (
        "phase update: actor/perf/max_memory_reserved_gb 85.0 GiB at step 2 is above 0.9 of "
        "the 96 GB GPU (80.5 GiB) (one GPU's peak per data-parallel group, as verl logs it: "
        "the other context- and tensor-parallel ranks of the node are not recorded)")}
    # the same peak under a wider headroom, or on a larger card, passes
    assert not _failed(_records(merged=_merged_with(
        2, **{"actor/perf/max_memory_reserved_gb": 85.0}), memory_headroom=0.99))
    assert not _failed(_records(merged=_merged_with(
        2, **{"actor/perf/max_memory_reserved_gb": 85.0}), gpu_memory_gb=141.0))


def test_a_real_stage_predicted_above_the_headroom_from_the_measured_peak_fails() -> None:
    """Issue 43: the rehearsal's stage (the heaviest stage's five MoE layers with both ends'
    weights, 53.0 GB predicted) measured 72 GiB (77.3 GB), within the headroom of 80.5 GiB;
    the plan's prediction puts the run's stage 1 10.2 GB above it (14 more microbatches in
    flight, less the embedding and output): 87.5 GB, above 0.9 x 96 GB. The check fails
    naming that stage; stages 0 and 2 (85.4 and 86.2 GB) are within it."""
    from hy3rl import stage_memory as sm
    from hy3rl.stage import stage_config
    from test_stage import HY3, PAPER_EFF, _rehearsal_eff

    cfg, _ = stage_config(HY3, 16)
    memory = sm.plan_prediction(HY3, PAPER_EFF, cfg, _rehearsal_eff())
    plan = {**_records().plan, "rehearsal": {"reductions": [{"key": "k"}],
                                             "per_gpu": {"memory": memory}}}
    merged = [m if not m["step"] else _line(m["step"], **{
        "actor/perf/max_memory_allocated_gb": 66.0, "actor/perf/max_memory_reserved_gb": 72.0})
        for m in _records().merged]
    failed = _failed(_records(plan=plan, merged=merged))
    assert failed == {"memory_headroom": (
        "stage 1 of the run (5 MoE) predicted at 87.5 GB (the measured 77.3 GB plus its "
        "predicted difference from the rehearsal's stage), above 86.4 GB; the run's stages "
        "predicted from the measured 77.3 GB: stage 1 (5 MoE) 87.5 GB the largest")}, failed
    # a measured peak 10 GB lower leaves every stage within the headroom: a pass that says
    # which real stage is the largest
    low = [m if not m["step"] else _line(m["step"], **{
        "actor/perf/max_memory_allocated_gb": 45.0, "actor/perf/max_memory_reserved_gb": 50.0})
        for m in _records().merged]
    check = {c.name: c for c in rh.check_records(_records(plan=plan, merged=low))}[
        "memory_headroom"]
    assert check.status == "pass" and check.detail.endswith(
        "; the run's stages predicted from the measured 53.7 GB: stage 1 (5 MoE) 63.9 GB the "
        "largest"), check.detail


def _set(state: Path, text: str) -> None:
    """The stand-in's answer, replaced whole (it may read while the test writes)."""
    tmp = state.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, state)


def _fake_smi(tmp_path: Path, used: list[int]) -> tuple[str, Path]:
    """An ``nvidia-smi`` stand-in (no GPU here) answering the query as the real one does
    (csv, noheader, nounits: index, uuid, memory.used MiB, memory.total MiB) with the
    values of a file the test rewrites; exits 9 when the file says so."""
    state = tmp_path / "smi-used.txt"
    _set(state, " ".join(map(str, used)))
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   f'read -r line < "{state}"\n'
                   '[ "$line" = fail ] && { echo "NVIDIA-SMI has failed" >&2; exit 9; }\n'
                   "i=0\nfor u in $line; do\n"
                   '  echo "$i, GPU-0000000$i-aaaa, $u, 97871"\n  i=$((i+1))\ndone\n')
    smi.chmod(0o755)
    return str(smi), state


def test_every_gpu_of_the_node_is_sampled_and_judged(tmp_path: Path) -> None:
    """Issue 43: verl logs one GPU's peak a data-parallel group (the stage at CP 8: one of
    eight); hy3rl.gpu_memory samples every GPU of the node with nvidia-smi while the
    rehearsal runs and keeps each one's peak memory.used. A GPU whose peak is above the
    headroom fails memory_headroom by name, though verl's rank stayed within it."""
    import time as _time

    from hy3rl.gpu_memory import MIB, Sampler

    def after(sampler: Sampler, k: int) -> None:
        """Until ``k`` more samples were taken (the first may have read the state before)."""
        until, want = _time.monotonic() + 60, sampler.samples + k
        while sampler.samples < want and _time.monotonic() < until:
            _time.sleep(0.02)

    smi, state = _fake_smi(tmp_path, [1000] * 8)
    sampler = Sampler(0.05, smi=smi).start()
    after(sampler, 2)
    _set(state, " ".join(["62000"] * 7 + ["85000"]))  # GPU 7: 89.1 GB
    after(sampler, 2)
    _set(state, " ".join(["1000"] * 8))
    after(sampler, 2)
    node = sampler.stop()
    assert node["not_run"] is None and node["samples"] >= 6 and not node["errors"]
    assert [g["peak_mib"] for g in node["gpus"]] == [62000.0] * 7 + [85000.0]
    assert node["gpus"][7]["uuid"] == "GPU-00000007-aaaa" and node["gpus"][7]["peak_s"] > 0
    failed = _failed(_records(node_gpus=node))
    assert list(failed) == ["memory_headroom"]
    assert failed["memory_headroom"].startswith(
        f"GPU 7 of the node (GPU-00000007-aaaa) peaked at {85000 * MIB / 1e9:.1f} GB at "), failed
    assert "above 86.4 GB; the node's 8 GPUs (nvidia-smi memory.used, " in \
        failed["memory_headroom"]
    # within the headroom: a pass that names the largest GPU
    low = {**node, "gpus": [{**g, "peak_mib": 62000.0} for g in node["gpus"]]}
    check = {c.name: c for c in rh.check_records(_records(node_gpus=low))}["memory_headroom"]
    assert check.status == "pass" and "; the node's 8 GPUs (nvidia-smi memory.used, " in \
        check.detail and check.detail.endswith("GPU 0 the largest at 65.0 GB")
    # nvidia-smi failing, or absent: nothing sampled, said so; verl's figure alone judged
    _set(state, "fail")
    broken = Sampler(0.05, smi=smi).start()
    until = _time.monotonic() + 60
    while broken.error_count < 2 and _time.monotonic() < until:
        _time.sleep(0.02)
    rec = broken.stop()
    assert rec["samples"] == 0 and rec["not_run"].startswith(
        "not run: no sample: " + f"{smi} exited 9: NVIDIA-SMI has failed")
    check = {c.name: c for c in rh.check_records(_records(node_gpus=rec))}["memory_headroom"]
    assert check.status == "pass" and "; the node's GPUs not sampled (not run: no sample: " \
        in check.detail
    absent = Sampler(0.05, smi=None)
    absent.smi = None
    assert absent.start().stop()["not_run"] == "not run: nvidia-smi not found on this node"


@pytest.mark.parametrize("value", ["absent", None, float("nan")])
def test_a_missing_memory_metric_is_not_run_naming_it_never_a_pass(value) -> None:
    merged = [m if m["step"] != 3 else {"step": 3, "data": {
        **{k: v for k, v in m["data"].items() if k != "actor/perf/max_memory_allocated_gb"},
        **({} if value == "absent" else {"actor/perf/max_memory_allocated_gb": value})}}
        for m in _records().merged]
    checks = {c.name: c for c in rh.check_records(_records(merged=merged))}
    assert (checks["memory_headroom"].status, checks["memory_headroom"].detail) == (
        "not run", "not run: actor/perf/max_memory_allocated_gb not logged at step(s) 3")
    assert _failed(_records(merged=merged)).keys() == {"memory_headroom"}


def test_the_doubles_memory_fault_fails_memory_headroom_as_read_back(tmp_path, monkeypatch) -> None:
    """The trainer double's lines (its metrics and the ``memory_over_from`` fault, written as
    its file logger writes them) read back with verl_log.read_metrics."""
    from fixtures.trainer_double import double_module

    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"memory_over_from": 3}))
    monkeypatch.setenv("HY3RL_DOUBLE_FAULTS", str(faults))
    mod = double_module()
    lines = [{"step": s, "data": {**mod.metrics(s, 3), **mod.collapse(s), "timing_s/step": 1.0}}
             for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    rec = _records(merged=rh.read_metrics(path))
    check = {c.name: c for c in rh.check_records(rec)}["memory_headroom"]
    assert (check.status, check.detail) == ("fail", (
        "phase update: actor/perf/max_memory_allocated_gb 100.0 GiB at step 3 is above 0.9 of "
        "the 96 GB GPU (80.5 GiB); phase update: actor/perf/max_memory_reserved_gb 100.0 GiB "
        "at step 3 is above 0.9 of the 96 GB GPU (80.5 GiB) (" + rh.ONE_RANK + ")"))


def test_the_doubles_short_responses_fail_full_length_as_read_back(tmp_path, monkeypatch) -> None:
    from fixtures.trainer_double import double_module

    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"short_responses": True}))
    monkeypatch.setenv("HY3RL_DOUBLE_FAULTS", str(faults))
    mod = double_module()
    lines = [{"step": s, "data": {**mod.metrics(s, 3), **mod.collapse(s), "timing_s/step": 1.0}}
             for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    plan = {"ok": True, "rehearsal": {"reductions": []},
            "effective": {"data.max_response_length": 8192}}
    check = {c.name: c for c in rh.check_records(_records(
        plan=plan, merged=rh.read_metrics(path)))}["full_length"]
    assert check.status == "fail" and check.detail.startswith(
        "no step's responses reached max_response_length 8192 (response_length/clip_ratio: "
        "step 1 0.0625 (max 3000)")


def test_without_the_gpus_memory_the_headroom_check_is_not_run_naming_the_key() -> None:
    checks = {c.name: c for c in rh.check_records(_records(gpu_memory_gb=0.0))}
    assert checks["memory_headroom"].status == "not run"
    assert "cluster.gpu_memory_gb = 0.0" in checks["memory_headroom"].detail
    assert make_config().rehearsal.memory_headroom == 0.9  # the schema's default


# ------------------------------------------- the update, the resume's state, the reward path


def test_good_records_record_the_figures_of_the_state_and_reward_checks() -> None:
    checks = {c.name: c for c in rh.check_records(_records())}
    assert checks["updated"].detail == (
        "step 3's export: against step 2 1 of 1 trained matrices changed (75.0% of their "
        "elements); against the input 1 of 1 trained matrices changed (100.0% of their "
        "elements); distance from the input 2 at step 2, 3 at step 3 (1.5 x); 1-D 0 of 1 and "
        "MTP 0 of 1 changed against step 2; 1 of 1 expert biases bit-identical")
    assert checks["resumed_data"].detail == (
        "train batches the dataloader had yielded (verl's data.pt, the StatefulDataLoader "
        "state): global_step_2 2, global_step_3 3 (1 a step)")
    assert checks["resumed_optimizer"].detail.startswith(
        "optimizer steps (lr_scheduler.num_steps in the optimizer checkpoint's common.pt): "
        "global_step_2 2, global_step_3 3")
    assert checks["reward_path"].detail == GOOD_REWARD["detail"]


def _double_saves(tmp_path: Path, monkeypatch, source: Path, faults: dict | None = None,
                  resumed_at: int = 0, mtp: bool = False) -> Layout:
    """Steps 2 and 3 saved by the trainer double (its HF export "trained" from ``source``,
    data.pt, the optimizer's common.pt) in a rehearsal layout's checkpoint directory; step 3
    by an attempt resumed at ``resumed_at`` (0: the same attempt); ``faults`` its fault file.
    ``mtp``: MTP trained (actor_rollout_ref.model.mtp.enable), else the export has no MTP
    layer, as the pinned stack's."""
    from fixtures.trainer_double import double_module

    cfg = make_config(run={"results_root": str(tmp_path / "results")})
    rl = Layout.from_config(cfg).rehearsal_layout()
    faults_file = tmp_path / "faults.json"
    faults_file.write_text(json.dumps(faults or {}))
    monkeypatch.setenv("HY3RL_DOUBLE_FAULTS", str(faults_file))
    monkeypatch.setenv("HY3RL_DOUBLE_HF_SOURCE", str(source))
    mod = double_module()
    mod.MTP_ENABLE = mtp
    mod.save_checkpoint(str(rl.checkpoint_dir), 2)
    mod.save_checkpoint(str(rl.checkpoint_dir), 3, start=resumed_at)
    return rl


def _state_failed(rl: Layout, model: Path) -> dict[str, str]:
    return _failed(_records(state=rh.read_state(rl, model)))


def test_the_doubles_good_checkpoints_pass_the_state_checks(tmp_path, monkeypatch,
                                                            tiny_hy3_dir) -> None:
    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir, resumed_at=2)
    state = rh.read_state(rl, tiny_hy3_dir)
    assert state["data"] == {2: 2, 3: 3} and state["optimizer"] == {2: 2, 3: 3}
    kinds = {v["kind"] for v in state["weights"]["tensors"].values()}
    assert kinds == {"trained", "fixed"}  # no MTP layer exported (MTP not trained)
    assert len(state["weights"]["mtp_absent"]) == 29
    checks = {c.name: c for c in rh.check_records(_records(state=state))}
    assert {n: checks[n].status for n in ("updated", "resumed_data", "resumed_optimizer")} == \
        dict.fromkeys(("updated", "resumed_data", "resumed_optimizer"), "pass")
    assert "expert biases bit-identical" in checks["updated"].detail


def _not_farther(ratio: str) -> str:
    """The pattern of updated's problem when step 3 is not farther from the input."""
    return (r"step 3 is not farther from the input than step 2 \(distance from the input "
            rf"[\d.]+ at step 2, [\d.]+ at step 3 \({ratio} x\); at least 1\.1 x expected\): "
            r"the resume did not continue from step 2's weights \(step 3 was trained from the "
            r"input model or an older checkpoint\)")


def test_weights_unchanged_at_step_three_fail_the_updated_check(tmp_path, monkeypatch,
                                                                tiny_hy3_dir) -> None:
    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir, {"weights_unchanged": 3})
    failed = _state_failed(rl, tiny_hy3_dir)
    assert set(failed) == {"updated"}
    assert re.fullmatch(r"(\d+) of \1 trained matrices unchanged at step 3 against step 2; "
                        r"largest: lm_head\.weight \(\d+ elements\), \S+ \(\d+ elements\), "
                        r"\S+ \(\d+ elements\); " + _not_farther("1"), failed["updated"]), failed


@pytest.mark.parametrize("lost", ["input", "step 1"])
def test_a_resume_that_did_not_load_the_weights_fails_the_updated_check(
        tmp_path, monkeypatch, tiny_hy3_dir, lost) -> None:
    """Issue 43: attempt 2 resumed at step 2 restored the data order and the optimizer but
    trained step 3 from the input model (or from step 1's weights): every trained matrix
    still changed against step 2 and the input, so only the distance tells: a healthy step 3
    lies farther from the input than step 2, this one does not."""
    # from step 1: step 3 = step 1's weights and one update, step 2's distance again
    at = {"input": 2, "step 1": 1}[lost]
    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir, {"weights_not_loaded": at},
                       resumed_at=at)
    failed = _state_failed(rl, tiny_hy3_dir)
    assert list(failed) == ["updated"], failed
    ratio = "0.5" if lost == "input" else "1"
    # the double's update is the same every step: step 1 + one update is step 2 bit for bit
    # (named as unchanged too); a real step from step 1's weights differs from step 2's at
    # the same distance from the input (~1 x), which only this figure tells
    assert re.fullmatch(r"(\d+ of \d+ trained matrices unchanged .*; )?" + _not_farther(ratio),
                        failed["updated"]), failed


def test_an_expert_bias_that_moved_fails_the_updated_check(tmp_path, monkeypatch,
                                                           tiny_hy3_dir) -> None:
    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir, {"bias_moved": 3})
    failed = _state_failed(rl, tiny_hy3_dir)
    assert set(failed) == {"updated"}
    assert failed["updated"].startswith(
        "model.layers.1.mlp.expert_bias (fixed: expert bias at update rate 0) moved: 4 of 4 "
        "elements against step 2, 4 against the input; model.layers.2.mlp.expert_bias")


def test_an_export_unlike_the_input_fails_the_updated_check(tmp_path, monkeypatch,
                                                            tiny_hy3_dir) -> None:
    from safetensors.torch import load_file, save_file

    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir)
    hf = rl.checkpoint_hf_model(3)
    for name, change in (("model.norm.weight", "float"), ("model.layers.0.mlp.down_proj.weight",
                                                          "drop")):
        shard = next(p for p in sorted(hf.glob("*.safetensors")) if name in load_file(p))
        tensors = load_file(shard)
        if change == "float":
            tensors[name] = tensors[name].float()
        else:
            del tensors[name]
        save_file(tensors, shard)
    detail = _state_failed(rl, tiny_hy3_dir)["updated"]
    assert "step 3's export lacks 1 tensor(s): model.layers.0.mlp.down_proj.weight" in detail
    assert re.search(r"model\.norm\.weight: input \(\d+,\) torch\.bfloat16, step 3: \(\d+,\) "
                     r"torch\.float32", detail), detail
    for shard in hf.glob("*.safetensors"):  # step 3's export gone: named, not a pass
        shard.unlink()
    assert _state_failed(rl, tiny_hy3_dir)["updated"] == f"{hf}: no safetensors file"


def test_exports_without_the_mtp_layer_pass_the_updated_check(tmp_path, monkeypatch,
                                                               tiny_hy3_dir) -> None:
    """verl@220e903 builds no MTP layer unless actor_rollout_ref.model.mtp.enable (the
    paper's recipe leaves it off): its HF export lacks the MTP tensors (the double exports
    the same way), and that is no failure; a missing tensor elsewhere is (test above). With
    MTP trained the export keeps the layer, counted as MTP."""
    from safetensors import safe_open

    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir)
    layers = json.loads((tiny_hy3_dir / "config.json").read_text())["num_hidden_layers"]
    mtp = set()
    for shard in sorted(tiny_hy3_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as fh:
            mtp |= {k for k in fh.keys() if k.startswith(f"model.layers.{layers}.")}
    exported = json.loads((rl.checkpoint_hf_model(3) / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == 0 and mtp
    checks = {c.name: c for c in rh.check_records(_records(state=rh.read_state(
        rl, tiny_hy3_dir)))}
    assert checks["updated"].status == "pass", checks["updated"].detail
    assert f"; {len(mtp)} MTP tensors of the input not exported (verl builds no MTP layer " \
        "without actor_rollout_ref.model.mtp.enable); " in checks["updated"].detail
    (tmp_path / "mtp").mkdir()
    trained = _double_saves(tmp_path / "mtp", monkeypatch, tiny_hy3_dir, mtp=True)
    state = rh.read_state(trained, tiny_hy3_dir)
    assert {v["kind"] for v in state["weights"]["tensors"].values()} == {
        "trained", "fixed", "mtp"} and not state["weights"]["mtp_absent"]


def test_a_data_order_restarted_at_the_resume_fails_resumed_data(tmp_path, monkeypatch,
                                                                 tiny_hy3_dir) -> None:
    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir, {"data_restart": 1}, resumed_at=2)
    assert _state_failed(rl, tiny_hy3_dir) == {"resumed_data": (
        "train batches the dataloader had yielded (verl's data.pt, the StatefulDataLoader "
        "state): global_step_2 2, global_step_3 1: the data order restarted at the resume")}


def test_an_optimizer_reset_at_the_resume_fails_resumed_optimizer(tmp_path, monkeypatch,
                                                                  tiny_hy3_dir) -> None:
    rl = _double_saves(tmp_path, monkeypatch, tiny_hy3_dir, {"optimizer_reset": 1},
                       resumed_at=2)
    assert _state_failed(rl, tiny_hy3_dir) == {"resumed_optimizer": (
        "optimizer steps (lr_scheduler.num_steps in the optimizer checkpoint's common.pt): "
        "global_step_2 2, global_step_3 1: the optimizer's step count restarted at the "
        "resume")}


def test_data_position_reads_both_dataloader_state_shapes_and_names_a_foreign_one(
        tmp_path: Path) -> None:
    import torch

    path = tmp_path / "data.pt"
    torch.save({"_num_yielded": 5, "_sampler_iter_yielded": 5, "_iterator_finished": False},
               path)  # a StatefulDataLoader without worker processes
    assert rh.data_position(path) == 5
    torch.save({"_snapshot": {"_snapshot_step": 4, "_main_snapshot": {}},
                "_steps_since_snapshot": 2, "_iterator_finished": False}, path)
    assert rh.data_position(path) == 6
    torch.save({"dataloader_state": {"consumed": 3}}, path)
    with pytest.raises(rh.RehearsalError, match=r"data\.pt: not a StatefulDataLoader state "
                       r"\(keys: \['dataloader_state'\]\)"):
        rh.data_position(path)
    state = {**GOOD_STATE, "data": {2: {"error": f"{path}: absent"}, 3: 3}}
    assert _failed(_records(state=state)) == {"resumed_data": f"global_step_2: {path}: absent"}
    odd = {**GOOD_STATE, "optimizer": {2: 3, 3: 5}}
    assert "did not advance it by a whole, positive amount a step" in _failed(
        _records(state=odd))["resumed_optimizer"]


# the reward path through the fake verl's reward manager (tests/fixtures/fake_verl.py)


def _train_parquet(path: Path, ground_truth: str = "34") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{
        "data_source": "math_dapo", "ability": "MATH",
        "prompt": [{"role": "user", "content": "What is 30 + 4? End with Answer: $N$."}],
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {"index": 0}}]), path)
    return path


def _probe_plan(verl: Path, *overrides: str) -> dict:
    return {"verl": {"path": str(verl), "config_dir": str(verl / "verl/trainer/config"),
                     "config_name": "ppo_trainer"},
            "overrides": [{"text": t} for t in ("reward.reward_manager.name=dapo", *overrides)]}


@pytest.fixture
def reward_in_process(fake_verl_pkg, tmp_path, monkeypatch):
    """``score(*overrides)``: hy3rl.reward_probe's payload prepared from a plan over the fake
    verl clone, its runner's code (``_run``) run in this process with the clone on the path
    (the runtime's subprocess would spend its time importing torch), judged as probe does."""
    import sys

    from hy3rl import reward_probe

    verl = fake_verl_pkg().path
    monkeypatch.syspath_prepend(str(verl))
    train = _train_parquet(tmp_path / "train.parquet")

    def score(*overrides: str) -> dict:
        payload, row = reward_probe.prepare(_probe_plan(verl, *overrides), model_dir=tmp_path,
                                            train_files=train)
        lines: list[dict] = []
        reward_probe._run(json.loads(json.dumps(payload)), lines.append)
        return reward_probe.judge(lines, "", row)

    yield score
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]


def test_the_reward_path_scores_through_verls_reward_manager(reward_in_process) -> None:
    res = reward_in_process()
    assert res["status"] == "pass", res
    assert res["detail"] == ("training row 0 (math_dapo, ground truth '34') through "
                             "DAPORewardManager (dapo): correct 1 (acc True), wrong -1 (acc "
                             "False)")
    assert [c["pred"] for c in res["cases"]] == ["34", "35"]


@pytest.mark.parametrize(("score", "says"), [
    (-1.0, "correct -1 (acc -1.0), wrong -1 (acc -1.0): the correct response was scored "
           "wrong; the correct response did not score above the wrong one"),
    (1.0, "correct 1 (acc 1.0), wrong 1 (acc 1.0): the wrong response was scored correct; "
          "the correct response did not score above the wrong one")])
def test_a_reward_that_never_or_always_scores_correct_fails_reward_path(
        reward_in_process, tmp_path, score, says) -> None:
    """The plan's custom reward function (reward.custom_reward_function) is what verl loads;
    a number it returns is verl's acc too."""
    fn = tmp_path / "reward_fn.py"
    fn.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None,"
                  f" **kw):\n    return {score}\n")
    res = reward_in_process(f"reward.custom_reward_function.path={fn}",
                            "reward.custom_reward_function.name=compute_score")
    failed = _failed(_records(reward_path=res))
    assert set(failed) == {"reward_path"}
    assert failed["reward_path"] == ("training row 0 (math_dapo, ground truth '34') through "
                                     f"DAPORewardManager (dapo): {says}")


def test_verls_reward_raising_fails_reward_path(reward_in_process) -> None:
    res = reward_in_process("+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                            "+reward.reward_kwargs.overlong_buffer_cfg.len=4096",
                            "+reward.reward_kwargs.max_resp_len=512")
    assert res["status"] == "fail"
    assert res["detail"].startswith("verl's reward path raised: AssertionError: max_resp_len "
                                    "must be larger than overlong_buffer.len at "), res


def test_the_reward_path_is_not_run_where_verl_does_not_import(fake_verl_pkg, tmp_path) -> None:
    """The probe as the rehearsal runs it (the runner in a subprocess of the runtime's python,
    the plan's verl first on its path), where that path holds no verl."""
    import sys

    from hy3rl import reward_probe

    plan = _probe_plan(fake_verl_pkg().path)
    plan["verl"]["path"] = str(tmp_path / "no-verl")
    res = reward_probe.probe(plan, model_dir=tmp_path, train_files=_train_parquet(
        tmp_path / "train.parquet"), python=[sys.executable])
    assert res["status"] == "not run"
    assert res["detail"].startswith("not run: verl's reward path does not import here "
                                    "(ModuleNotFoundError: No module named 'omegaconf'") or \
        res["detail"].startswith("not run: verl's reward path does not import here "
                                 "(ModuleNotFoundError: No module named 'verl"), res
    checks = {c.name: c for c in rh.check_records(_records(reward_path=res))}
    assert checks["reward_path"].status == "not run"  # never a pass: the rehearsal fails
    absent = {c.name: c for c in rh.check_records(_records(reward_path=None))}["reward_path"]
    assert (absent.status, absent.detail) == (
        "not run", "not run: the rehearsal did not reach the reward probe")
