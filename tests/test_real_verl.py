"""The real-trainer tier: the pinned verl (220e903) training GRPO on this CPU through the CPU
path (hy3rl.verl_cpu), driven by the workflow exactly as a user runs it: README's first
command's `snakemake --profile profiles/local` on the embedded default, offline (the pinned
verl and TransferQueue cloned by rule deps from local mirrors, the datasets from local
parquet; fixtures.deps.real_upstreams). Then a rerun that extends the run resumes from
verl's own checkpoint. Every check reads what verl itself wrote: its file logger's lines,
its driver log, its FSDP checkpoints and HF weights.

One run of the pipeline (``real_run``, module scope) feeds every test here; the extension
runs once after it (``extended``). The tests run in their own scope (tests/conftest.py
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
from hy3rl.verl_log import read_metrics
from hy3rl.watchdog import SAVE_LINE, STARTUP_MARKS

pytestmark = [pytest.mark.slow, pytest.mark.real]

RUN = "tiny-default"
# Ray outside SLURM for this scope: below the SLURM lanes' ranges and apart from the Ray
# scope's (fixtures.trainer_double.LOCAL_RAY_PORTS 9000-17000, fixtures.slurm 18000-32000).
REAL_RAY_PORTS = {"port_base": 17000, "port_span": 1000}


class Real:
    """The workdir of the real run and where its records are."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work = root / "work"
        self.results = self.work / "results" / RUN
        self.ckpt = self.results / "checkpoints"
        self.configfiles = [str(REPO_ROOT / "config/config.yaml"), str(root / "offline.yaml")]

    def snakemake(self, *extra: str, check: bool = True, configfiles: list[str] | None = None):
        args = ["--profile", str(REPO_ROOT / "profiles/local"), "--configfile",
                *(configfiles or self.configfiles), *extra]
        return run_snakemake(args, self.work, check=check, timeout=1500)

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
        "train": {"ray": REAL_RAY_PORTS, "watchdog": {"poll_s": 1}},
    }))
    real = Real(root)
    real.work.mkdir()
    real.snakemake()
    return real


@pytest.fixture(scope="module")
def extended(real_run: Real) -> Real:
    """The same run extended from 2 to 3 steps: verl resumes from global_step_2."""
    more = real_run.root / "three.yaml"
    more.write_text(yaml.safe_dump({"train": {"total_training_steps": 3}}))
    real_run.snakemake(configfiles=[*real_run.configfiles, str(more)])
    real_run.configfiles.append(str(more))
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


# ---- a rerun that extends the run resumes from verl's checkpoint ----------------------------


def test_an_extension_resumes_from_the_newest_checkpoint_and_trains_one_step(extended: Real):
    res = extended.results
    attempts = extended.attempts()
    assert len(attempts) == 2, attempts
    second = attempts[1]
    assert second["outcome"] == "succeeded" and second["start_step"] == 2
    assert second["end_step"] == 3 and second["steps_lost"] == 0
    log = extended.driver_log(2)
    assert re.search(r"Resuming from \S*global_step_2", log), log[-3000:]
    assert "Training from scratch" not in log
    # verl truncates its file logger at every start: each attempt has its own file, and the
    # merge keeps each step once (the resumed attempt validates step 2 again first)
    first_lines = read_metrics(res / "train/attempts/attempt-1.metrics.jsonl")
    assert [r["step"] for r in first_lines] == [0, 1, 2]
    merged = [r["step"] for r in read_metrics(res / "train/metrics.jsonl")]
    assert merged == sorted(set(merged)) and merged[-1] == 3 and 1 in merged
    done = json.loads((res / "train/done.json").read_text())
    assert done["final_step"] == 3
    assert check_complete(extended.ckpt / "global_step_3", 3) == (True, "")
    ident = read_identity(extended.ckpt)
    assert ident["history"][-1]["total_training_steps"] == 3


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
                "response_length/clip_ratio", "actor/grad_norm", "actor/entropy"):
        assert key in real and key in ours, key
    assert double["response_length/clip_ratio"] > 0
