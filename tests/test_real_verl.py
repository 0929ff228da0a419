"""The real-trainer tier: the pinned verl (220e903) training GRPO on this CPU through the CPU
path (hy3rl.verl_cpu), driven by the workflow exactly as a user runs it: README's first
command's `snakemake --profile profiles/local` on the embedded default, offline (the pinned
verl and TransferQueue cloned by rule deps from local mirrors, the datasets from local
parquet; fixtures.deps.real_upstreams), W&B offline. Then a rerun through the real SLURM
test cluster extends the run with faults injected into verl's own trainer
(tests/verl_faults.py: a death mid-save, a hang, a NaN loss). Every check reads what verl
itself wrote: its file logger's lines, its driver log, its FSDP checkpoints and HF weights.

One run of the pipeline (``real_run``, module scope) feeds every test here; the faulted
extension runs once after it (``faulted``). The tests run in their own scope (tests/conftest.py
REAL_FILES), one after another on one worker, with Ray ports of their own
(REAL_RAY_PORTS). Without the mirrors they are skipped, naming the variables."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from fixtures.common import REPO_ROOT, run_snakemake
from fixtures.data import aime_rows, dapo_rows, write_parquet
from fixtures.deps import real_upstreams
from hy3rl.ckptdir import check_complete, is_fsdp, read_identity, scan
from hy3rl.verl_log import merged_attempts, read_metrics
from hy3rl.watchdog import SAVE_LINE, STARTUP_MARKS

pytestmark = [pytest.mark.slow, pytest.mark.real,
              # the shared pipeline run is the first test's setup (about 3.5 min alone, 14
              # min in CI's busiest stretch): pytest's 900 s would fail all eleven tests on
              # a loaded machine; each Snakemake run has its own timeout (1500 s)
              pytest.mark.timeout(1800)]

RUN = "tiny-default"
# Ray outside SLURM for this scope: apart from the Ray scope's
# (fixtures.trainer_double.LOCAL_RAY_PORTS 9000-17000), the SLURM lanes'
# (fixtures.slurm.LANE_RAY_PORTS 18000-32000) and the SLURM daemons' (17817 up,
# tests/slurm_cluster.py BASE_PORT): one block (hy3rl.launch.port_plan: 410 ports with the
# default 400 worker ports), 17000-17409.
REAL_RAY_PORTS = {"port_base": 17000, "port_span": 800}
PASSTHROUGH = ["WANDB_MODE", "WANDB_API_KEY", "HY3RL_VERL_FAULTS", "VERL_USE_EXTERNAL_MODULES"]
SECRET = "hy3rl-test-wandb-key-0123456789abcdef0123456789"


class Real:
    """The workdir of the real run and where its records are."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work = root / "work"
        self.results = self.work / "results" / RUN
        self.ckpt = self.results / "checkpoints"
        self.configfiles = [str(REPO_ROOT / "config/config.yaml"), str(root / "offline.yaml")]

    def snakemake(self, *extra: str, check: bool = True, env: dict[str, str] | None = None,
                  profiles: list[Path] | None = None):
        profiles = profiles or [REPO_ROOT / "profiles/local"]
        args = [*(a for p in profiles for a in ("--profile", str(p))), "--configfile",
                *self.configfiles, *extra]
        return run_snakemake(args, self.work, check=check, timeout=1500,
                             env={"WANDB_MODE": "offline", **(env or {})})

    def attempts(self) -> list[dict]:
        return [json.loads(p.read_text())
                for p in sorted((self.results / "train/attempts").glob("attempt-*.json"),
                                key=lambda p: int(p.stem.split("-")[1]))]

    def driver_log(self, k: int) -> str:
        return (self.results / f"train/attempts/attempt-{k}/driver.log").read_text(
            errors="replace")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Real:
    """The embedded default, offline, through Snakemake with the real pinned verl."""
    root = tmp_path_factory.mktemp("real")
    ups = real_upstreams(root / "upstream")
    train = write_parquet(root / "src" / "dapo-math-17k.parquet", dapo_rows(40, repeats=3))
    val = write_parquet(root / "src" / "aime-2024.parquet", aime_rows(repeats=2),
                        pandas_index=True)
    (root / "offline.yaml").write_text(yaml.safe_dump({
        "deps": ups.section(root / "work" / "deps"),
        "data": {"train": {"source": str(train)}, "val": {"source": str(val)}},
        # W&B offline (verl's own wandb.init), and what the fault run passes to verl
        "train": {"ray": REAL_RAY_PORTS, "watchdog": {"poll_s": 1},
                  "loggers": ["console", "wandb"], "ray_env_passthrough": PASSTHROUGH},
    }))
    real = Real(root)
    real.work.mkdir()
    real.snakemake()
    return real


@pytest.fixture(scope="module")
def faulted(real_run: Real, slurm_cluster) -> Real:
    """The same run extended from 2 to 5 steps, now through the real SLURM test cluster
    (profiles/slurm and the test override, on the real scope's own node: rule train is one
    sbatch job, Ray started in srun steps on the node), with faults injected into verl's
    own trainer (tests/verl_faults.py, loaded through verl's plugin hook beside the CPU
    path), each met by the workflow in the same job (train.restarts_per_job 2): the trainer
    dies in the middle of step 3's save (attempt 2); the restart (attempt 3) resumes from
    global_step_2, saves step 3 and stops at the start of step 4, silent, its processes
    alive: the watchdog declares it hung within the limit it derived from the steps it saw
    (the floor lowered to a minute); the second restart (attempt 4) resumes from
    global_step_3 and computes a NaN policy loss: the health guard stops it on the nulls
    verl's file logger writes, and nothing is resubmitted."""
    from fixtures.slurm import lane_profile
    from slurm_cluster import LANE_PARTITIONS

    faults = real_run.root / "faults.json"
    faults.write_text(json.dumps({"die_mid_save": 3, "hang_at": 4, "nan_loss_from": 4}))
    more = real_run.root / "five.yaml"
    more.write_text(yaml.safe_dump({
        "train": {"total_training_steps": 5, "watchdog": {"stall_floor_min": 1}},
        "cluster": {"mem_mb_per_node": 6000, "train_time_min": 60}}))
    real_run.configfiles.append(str(more))
    lane = real_run.root / "lane"
    lane.mkdir()
    profile = lane_profile(slurm_cluster, LANE_PARTITIONS["real"], lane)
    real_run.result = real_run.snakemake(
        check=False, profiles=[REPO_ROOT / "profiles/slurm", profile], env={
            "HY3RL_VERL_FAULTS": str(faults), "VERL_USE_EXTERNAL_MODULES": "verl_faults",
            "PYTHONPATH": str(REPO_ROOT / "tests"), "WANDB_API_KEY": SECRET})
    return real_run


# ---- the embedded default trains for real ----------------------------------------------


def test_the_embedded_default_trains_with_the_pinned_verl(real_run: Real):
    res = real_run.results
    plan = json.loads((res / "preflight/plan.json").read_text())
    assert plan["launched"] and plan["cpu_path"]["engine"] == "dp"
    assert plan["verl"]["commit"] == "220e9039902c6db56860e2afd659803dc34ec005"
    done = json.loads((res / "train/done.json").read_text())
    assert done["final_step"] == 2 and done["total_training_steps"] == 2
    assert done["hf_model"].endswith("global_step_2/actor/huggingface")
    (attempt,) = real_run.attempts()
    assert attempt["outcome"] == "succeeded" and attempt["start_step"] == 0
    assert attempt["end_step"] == 2 and attempt["steps_lost"] == 0
    # verl's own file logger, one line a step (and the validation before training, step 0)
    lines = read_metrics(res / "train/attempts/attempt-1.metrics.jsonl")
    steps = [r["step"] for r in lines]
    assert steps == [0, 1, 2], steps
    assert [r["step"] for r in read_metrics(res / "train/metrics.jsonl")] == [0, 1, 2]
    trained = [r["data"] for r in lines if r["step"] >= 1]
    for data in trained:
        for key in ("critic/score/mean", "critic/rewards/mean", "actor/pg_loss",
                    "actor/grad_norm", "actor/entropy", "response_length/mean",
                    "response_length/clip_ratio", "training/rollout_probs_diff_mean",
                    "timing_s/step", "timing_s/save_checkpoint"):
            assert isinstance(data.get(key), float), (key, data.get(key))
    # GRPO learned something: a gradient flowed (the overlong penalty varies the rewards)
    assert any(d["actor/grad_norm"] > 0 for d in trained)
    # validation before training and at the last step (TEST_FREQ 2), AIME with VAL_N 1
    val = "val-core/math_dapo/acc/mean@1"
    assert val in lines[0]["data"] and val in lines[2]["data"]


def test_checkpoints_are_verls_fsdp_layout_and_hold_trained_weights(real_run: Real):
    from safetensors.torch import load_file

    ckpts = scan(real_run.ckpt)
    assert [(c.step, c.complete) for c in ckpts] == [(1, True), (2, True)], ckpts
    for c in ckpts:
        assert is_fsdp(c.path)
        assert (c.path / "actor/model_world_size_1_rank_0.pt").is_file()
    assert (real_run.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    ident = read_identity(real_run.ckpt)
    plan = json.loads((real_run.results / "preflight/plan.json").read_text())
    assert ident["trajectory"]["id"] == plan["identity"]["trajectory"]["id"]
    # the HF export verl writes with hf_model: loadable, and not the base weights any more
    base_dir = Path(json.loads((real_run.results / "model/manifest.json").read_text())["dir"])
    base = {}
    for shard in base_dir.glob("*.safetensors"):
        base.update(load_file(shard))
    step2 = load_file(real_run.ckpt / "global_step_2/actor/huggingface/model.safetensors")
    moved = [k for k, v in step2.items() if k in base and not (v.float() == base[k].float())
             .all()]
    assert moved, "global_step_2's weights equal the base model's: nothing was trained"


def test_evaluation_reads_the_trained_checkpoints_while_training_goes_on(real_run: Real):
    res = real_run.results
    ready = json.loads((res / "eval/step1/checkpoint.json").read_text())
    assert ready["hf_model"].endswith("global_step_1/actor/huggingface")
    for tag in ("base", "step1", "final"):
        meta = json.loads((res / f"eval/{tag}/samples.meta.json").read_text())
        assert meta["status"] == "complete", (tag, meta)
    final = json.loads((res / "eval/final/samples.meta.json").read_text())
    assert "global_step_2" in json.dumps(final)
    selected = json.loads((res / "eval/selected.json").read_text())
    assert selected["selected"]["tag"] in ("step1", "final")
    page = (res / "report/index.html").read_text()
    assert 'id="training-not-run"' not in page and 'id="fig-training-published"' in page
    # the embedded default's evaluation settings (30 problems x 4 samples x 32 tokens,
    # transformers on CPU), graded by the pinned verl's own math_dapo.py: real samples,
    # scores and metrics, on the test set and the held-out set; the report's headline
    # numbers are metrics.json's
    samples = [json.loads(x) for x in (res / "eval/base/samples.jsonl").read_text().splitlines()]
    assert len(samples) == 120 and len({s["problem_id"] for s in samples}) == 30
    assert all(s["num_tokens"] <= 32 for s in samples)
    m = json.loads((res / "eval/base/metrics.json").read_text())
    assert m["num_problems"] == 30 and m["n"] == 4 and len(m["per_problem"]) == 30
    assert set(m["by_grader"]["math_dapo"]["pass@k"]) == {"1", "2", "4"}
    assert m["graders"]["math_dapo"]["implementation"] == "pinned verl file"
    summary = json.loads((res / "eval/summary.json").read_text())
    assert sorted(summary["tags"]) == ["base", "final", "step1"], summary["tags"]
    assert "heldout/base" in summary["heldout"]["tags"]
    import csv

    with open(res / "report/eval_headline.csv", newline="") as fh:
        head = {(r["tag"], r["grader"].removesuffix(" (primary)")): r
                for r in csv.DictReader(fh)}
    for g in ("math_dapo", "math_verify"):
        bg = m["by_grader"][g]
        assert float(head["base", g]["avg@n"]) == pytest.approx(bg["avg@n"], abs=1e-6)
        assert float(head["base", g]["pass@n"]) == pytest.approx(bg["pass@k"]["4"], abs=1e-6)
    # nothing left to do: a second invocation is a no-op (nothing retrains)
    again = real_run.snakemake("-n")
    assert "Nothing to be done" in again.stdout + again.stderr


# ---- what verl writes: the forms every check reads -----------------------------------------


def test_verls_driver_log_has_the_lines_the_watchdog_keys_on(real_run: Real):
    log = real_run.driver_log(1)
    for name, pattern in STARTUP_MARKS:
        assert pattern.search(log), f"startup mark {name!r} ({pattern.pattern}) not in verl's log"
    assert sorted(int(s) for s in SAVE_LINE.findall(log)) == [1, 2]
    assert "Training from scratch" in log
    attempt = real_run.attempts()[0]
    marks = attempt["timing"]["startup_marks"]
    assert [m for m in marks if m in dict(STARTUP_MARKS)] == [n for n, _ in STARTUP_MARKS]


def test_clip_ratio_is_measured_against_the_longest_response_of_the_batch(real_run: Real):
    """verl's v1 trainer: response_length/clip_ratio is the share of responses as long as
    the batch's longest, never 0 (upstream-facts.md, "Record forms")."""
    for rec in read_metrics(real_run.results / "train/attempts/attempt-1.metrics.jsonl"):
        data = rec["data"]
        if "response_length/clip_ratio" not in data:
            continue
        assert data["response_length/clip_ratio"] > 0, rec
        assert data["response_length/max"] <= 64


def test_the_file_logger_writes_nan_as_null(real_run: Real):
    """verl's FileLogger (orjson): NaN and inf become null, which every reader must take for
    a non-finite value, never an absent one (hy3rl.verl_log.NONFINITE)."""
    from fixtures.verl_records import write_like_verl
    from hy3rl.verl_log import NONFINITE, metric_value

    out = real_run.root / "nan.jsonl"
    write_like_verl(real_run.work / "deps/verl", out,
                    [{"actor/grad_norm": math.nan, "actor/pg_loss": math.inf, "x": 1.0}])
    (rec,) = read_metrics(out)
    assert rec["data"]["actor/grad_norm"] is None and rec["data"]["actor/pg_loss"] is None
    assert metric_value(rec["data"], "actor/grad_norm") is NONFINITE
    assert metric_value(rec["data"], "absent") is None
    # the health guard's nonfinite rule (stop) fires on it, by name, for both metrics
    from hy3rl.health import Watcher
    from hy3rl.settings import Config

    health = Config.load(REPO_ROOT / "config/config.yaml").train.health
    events = Watcher(health).feed(rec)
    assert [(e.rule, e.action, e.metric) for e in events] == [
        ("nonfinite", "stop", "actor/pg_loss"), ("nonfinite", "stop", "actor/grad_norm")]
    assert "logged as null" in events[0].message


def test_the_rehearsals_record_checks_pass_the_real_trainers_healthy_records(real_run: Real):
    """Issue 43: the rehearsal's checks on what real verl writes pass its healthy records,
    so the failures they are fed elsewhere (tests/test_rehearsal.py, in verl's own forms)
    are failures of the trainer, not of the reading: every step's actor values finite,
    responses of more than the EOS token with none aborted, scores not all right, and the
    distance rule of `updated` on the real Adam's weights: step 2 lies farther from the
    input model than step 1 by at least the ratio the rule asks of step 3 against step 2
    (two steps against one: ~1.41 x for unrelated directions, 2 x for one)."""
    from hy3rl import rehearsal as rh

    lines = read_metrics(real_run.results / "train/metrics.jsonl")
    by_step = {r["step"]: r["data"] for r in rh._train_lines(lines)}
    assert sorted(by_step) == [1, 2]
    assert rh._check_finite(by_step).status == "pass"
    gen = rh._check_generated(rh.Records(
        plan={}, attempts=[], attempt_lines={}, merged=lines, done=None, complete={},
        driver_logs={}, samples=[{"response": "a", "num_tokens": 2}], samples_meta=None,
        expected_samples=1), by_step)
    assert gen.status == "pass", gen.detail
    assert all(d["response/aborted_ratio"] == 0 for d in by_step.values())
    assert not all(d["critic/score/min"] > 0 for d in by_step.values())
    # the CPU path's FSDP export is float32 (the input bf16), unlike the Megatron export the
    # rehearsal reads, so the rule's figure is computed here on the matrices themselves
    from safetensors.torch import load_file

    base = Path(json.loads((real_run.results / "model/manifest.json").read_text())["dir"])
    start = {}
    for shard in base.glob("*.safetensors"):
        start.update(load_file(shard))
    one, two = (load_file(real_run.ckpt / f"global_step_{s}/actor/huggingface/"
                          "model.safetensors") for s in (1, 2))
    tensors = {n: {"sq_before": rh.squared_distance(one[n].float(), t.float()),
                   "sq_after": rh.squared_distance(two[n].float(), t.float())}
               for n, t in start.items()
               if t.dim() >= 2 and n in one and n in two and not rh.FIXED_TENSOR.search(n)}
    assert len(tensors) > 20
    farther, figure = rh._farther(tensors, sorted(tensors))
    assert farther, figure
    print(f"real verl's Adam, two steps against one: {figure}")


# ---- faults injected into the real trainer ---------------------------------------------


@pytest.mark.slurm
def test_a_death_mid_save_leaves_no_checkpoint_and_the_restart_resumes_before_it(
        faulted: Real):
    res = faulted.results
    attempts = faulted.attempts()
    assert [a["start_step"] for a in attempts] == [0, 2, 2, 3], attempts
    # the first attempt on this host, the three others in one SLURM job on the real scope's
    # node: the in-job restarts, no resubmission
    assert attempts[0]["slurm_job_id"] is None, attempts[0]
    jobs = {(a["executor"], a["slurm_job_id"], tuple(a["nodes"])) for a in attempts[1:]}
    assert len(jobs) == 1 and next(iter(jobs))[1] and next(iter(jobs))[2] == ("n5",), jobs
    # the extension is the same trajectory, extended; its checkpoints carry that identity
    assert attempts[1]["identity_action"] == "extend", attempts[1]
    assert len({a["trajectory_id"] for a in attempts}) == 1, attempts
    ident = read_identity(faulted.ckpt)
    assert [e["total_training_steps"] for e in ident["extents"]] == [2, 5], ident
    died = attempts[1]
    assert "die_mid_save 3" in faulted.driver_log(2)
    assert died["outcome"] == "failed" and died["end_step"] == 2, died
    # verl wrote step 3's actor shards, not its data.pt nor its tracker: the workflow took
    # no checkpoint 3 for complete, verl resumed from 2, as the restart's record says
    assert re.search(r"Resuming from \S*global_step_2", faulted.driver_log(3))
    assert "Training from scratch" not in faulted.driver_log(3)
    # verl truncates its file logger at every start: each attempt has its own file, and the
    # merge keeps each step once (a resumed attempt validates its first step again)
    first = read_metrics(res / "train/attempts/attempt-1.metrics.jsonl")
    assert [r["step"] for r in first] == [0, 1, 2]
    # (the failed job's train/metrics.jsonl is Snakemake's to delete: merge the attempts')
    merged = [r["step"] for r in merged_attempts(res / "train/attempts")]
    assert merged == sorted(set(merged)) and 1 in merged and merged[-1] == 4, merged
    assert check_complete(faulted.ckpt / "global_step_3", 3) == (True, "")
    # one W&B run across the four attempts (verl's own wandb.init, offline)
    ids = {a["wandb"]["run_id"] for a in attempts}
    assert len(ids) == 1 and next(iter(ids)).startswith(f"{RUN}-"), ids
    run_id = ids.pop()
    runs = sorted((res / "train/wandb").glob("wandb/offline-run-*"))
    assert len(runs) == 4 and all(p.name.endswith(f"-{run_id}") for p in runs), runs
    # the W&B key reached verl (passed through) but nothing the run wrote holds it: the
    # records, logs and node logs of the hang, Snakemake's and SLURM's logs
    for path in faulted.work.rglob("*"):
        if path.is_file() and not path.is_symlink() and "deps" not in path.parts:
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.slurm
def test_a_silent_trainer_is_declared_hung_in_its_phase_and_the_restart_resumes(
        faulted: Real):
    hung = faulted.attempts()[2]
    assert "hang_at 4" in faulted.driver_log(3)
    assert hung["outcome"] == "hung", hung
    assert hung["exit_reason"].startswith("hung at step 4 (step for "), hung
    # the limit is derived from the steps this run saw, floored at the minute set here
    limit = float(re.search(r"its limit ([\d.]+) min", hung["exit_reason"]).group(1))
    assert 1 <= limit < 30, hung["exit_reason"]
    assert hung["last_logged_step"] == 3 and hung["end_step"] == 3, hung
    assert hung["timing"]["model"]["step"]["learned"], hung["timing"]
    # the hung trainer was stopped (the restart could start), and the restart resumed from
    # the checkpoint the hung attempt had saved
    log = faulted.driver_log(4)
    assert re.search(r"Resuming from \S*global_step_3", log), log[-3000:]
    assert "Training from scratch" not in log


@pytest.mark.slurm
def test_a_nan_loss_logged_as_null_stops_the_run_at_the_last_healthy_checkpoint(
        faulted: Real):
    from safetensors.torch import load_file

    assert faulted.result.returncode != 0
    res = faulted.results
    stopped = faulted.attempts()[3]
    assert stopped["outcome"] == "unhealthy", stopped
    stop = stopped["health_stop"]
    assert (stop["rule"], stop["action"], stop["step"]) == ("nonfinite", "stop", 4), stop
    assert stop["metric"] in ("actor/pg_loss", "actor/grad_norm")
    assert "logged as null" in stop["event_message"]
    assert stop["last_healthy_step"] == 3, stop
    # what verl wrote: its file logger's null, and the engine skipped the update (a
    # non-finite gradient norm): step 4's weights are step 3's, nothing NaN saved
    text = (res / "train/attempts/attempt-4.metrics.jsonl").read_text()
    line = next(json.loads(t) for t in text.splitlines() if json.loads(t)["step"] == 4)
    assert line["data"]["actor/pg_loss"] is None and '"actor/pg_loss":null' in text
    four, three = (load_file(faulted.ckpt / f"global_step_{s}/actor/huggingface/"
                             "model.safetensors") for s in (4, 3))
    assert all((four[k] == three[k]).all() for k in three)
    assert not (faulted.ckpt / "global_step_5").exists()
    done = res / "train/done.json"
    assert not done.exists() or json.loads(done.read_text())["final_step"] != 5


# ---- the trainer double held to the real trainer (conformance) ----------------------------


def test_the_double_writes_its_metrics_byte_for_byte_as_verls_file_logger(real_run: Real,
                                                                         monkeypatch):
    """The same values (NaN, ±inf, numpy float32, ints) through verl's FileLogger and the
    double's Tracking give the same bytes."""
    import numpy as np
    from fixtures.trainer_double import double_module
    from fixtures.verl_records import write_like_verl

    datas = [{"actor/grad_norm": math.nan, "actor/pg_loss": -math.inf, "a": math.inf,
              "b": np.float32(0.25), "c": 3, "d": 0.1},
             {"actor/grad_norm": 0.5, "x": np.float32(math.nan)}]
    ours = write_like_verl(real_run.work / "deps/verl", real_run.root / "verl.jsonl", datas)
    path = real_run.root / "double.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracking = double_module().Tracking({}, ["file"])
    for i, data in enumerate(datas, 1):
        tracking.log(data, i)
    tracking.file.close()
    assert path.read_bytes() == ours.read_bytes()


def test_the_doubles_metric_keys_are_verls(real_run: Real, monkeypatch, tmp_path):
    """Every key the double logs a step (but its own double/*) is one the real trainer logs,
    and the keys every check reads are in both; the double's clip_ratio is never 0, as in
    verl's v1 trainer, faults included."""
    from fixtures.trainer_double import double_module

    real = set()
    for rec in read_metrics(real_run.results / "train/attempts/attempt-1.metrics.jsonl"):
        if rec["step"] >= 1:
            real |= set(rec["data"])
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"short_responses": True}))
    monkeypatch.setenv("HY3RL_DOUBLE_FAULTS", str(faults))
    mod = double_module()
    double = {**mod.metrics(1, 2), **mod.collapse(1)}
    ours = {k for k in double if not k.startswith("double/")}
    # the double logs the Megatron engine's memory keys; verl's FSDP engine on a CPU logs the
    # same names (actor/perf/max_memory_*), the rest is the v1 trainer's
    assert ours - real == set(), sorted(ours - real)
    for key in ("training/rollout_probs_diff_mean", "critic/score/mean", "response_length/max",
                "response_length/clip_ratio", "actor/grad_norm", "actor/entropy",
                # the rehearsal's checks of issue 43 (generated, reward)
                "response_length/min", "response/aborted_ratio", "critic/score/min"):
        assert key in real and key in ours, key
    assert double["response_length/clip_ratio"] > 0
