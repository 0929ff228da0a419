"""The whole GPU DAG (`cluster.gpu: true`) through `snakemake --profile profiles/local` on
this CPU machine, with verl's GPU trainer replaced by the test double
(tests/fixtures/trainer_double.py) in a fake verl repo that rule deps clones for real.

Everything else is real: deps clones local git repos, data reads local parquet, the tiny
Hy3 is built, both checkpoint checks run (check_bridge: `not run` without a GPU), preflight
renders the launch, train starts a single-node Ray (one GPU declared to Ray, faked through
CUDA_VISIBLE_DEVICES; torch stays on CPU) and submits launch.sh, evaluation loads the
double's HF checkpoints (copies of the tiny Hy3) with the transformers backend, the report
renders. Sequence: the trainer crashes at a step -> the run fails; the same command again
resumes training from the last save, reruns nothing upstream, evaluates and reports; then
nothing is left to do, also after a comment is added to rules/train.smk. The workflow runs
from a copy of the repository's workflow files (so that the rules can be edited there)."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from fixtures.gpu_dag import attempt as _attempt
from fixtures.gpu_dag import double_sources
from fixtures.gpu_dag import mtimes as _mtimes
from fixtures.gpu_dag import snakemake as _snakemake
from fixtures.gpu_dag import workflow_copy as _workflow_copy
from fixtures.trainer_double import leftover_ray as leftover

pytestmark = [pytest.mark.ray, pytest.mark.slow]

VENV_BIN = str(Path(sys.executable).parent)
RUN = "gpu-double"
TOTAL, SAVE_FREQ, CRASH_AT = 4, 2, 4  # attempt 1 saves step 2, logs step 3, dies at 4


def _override(tmp: Path) -> Path:
    override = {
        "run": {"name": RUN},
        **double_sources(tmp),
        "cluster": {"gpu": True, "nodes": 1, "gpus_per_node": 1, "cpus_per_node": 1},
        "train": {
            "checkpoint_root": str(tmp / "ckpt"), "total_training_steps": TOTAL,
            "env": {"SAVE_FREQ": SAVE_FREQ, "TEST_FREQ": SAVE_FREQ},
            "checkpoint_keep": 1, "prune_interval_s": 1,
            # a person's rerun after a failure: no restart, no resubmission (the unattended
            # path is tests/test_train_slurm.py's)
            "restarts_per_job": 0, "max_submissions": 1,
            "ray": {"register_timeout_s": 120, "head_timeout_s": 120},
        },
        "eval": {"n_samples": 2, "max_tokens": 8, "num_problems": 5, "steps": [SAVE_FREQ]},
        # No GPU here: the bridge round trip is `not run`, which preflight refuses unless
        # waived (issue 11: a GPU check is never skipped silently).
        # the one-node rehearsal runs in tests/test_eval_slurm.py and test_rerun_identity.py
        "preflight": {"waive": ["bridge", "rehearsal"]},
    }
    path = tmp / "gpu-double.yaml"
    path.write_text(yaml.safe_dump(override))
    return path


def test_gpu_dag_crash_resume_evaluate_report(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    override = _override(tmp_path)
    wf = tmp_path / "wf"
    snakefile = _workflow_copy(wf)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    res = work / "results" / RUN
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"crash_at": CRASH_AT}))
    env = {
        "PATH": VENV_BIN + os.pathsep + os.environ["PATH"],
        "HY3RL_DOUBLE_FAULTS": str(faults), "HY3RL_DOUBLE_STEP_S": "0.2",
        "HY3RL_DOUBLE_HF_SOURCE": str(work / "resources" / "tiny-hy3"),
        "CUDA_VISIBLE_DEVICES": "0",  # one GPU declared to Ray; torch here is CPU-only
        # The script's loggers include wandb (the double calls wandb.init as verl does):
        # offline, as a site without a W&B key runs it.
        "WANDB_MODE": "offline",
    }
    args = ["--profile", str(wf / "profiles" / "local"), "--configfile",
            str(wf / "config" / "config.yaml"), str(override)]

    # (1) The trainer crashes: the run fails, the checkpoint of step 2 stays.
    code, out1 = _snakemake(snakefile, args, work, env)
    assert code != 0, out1[-4000:]
    assert "Error in rule train" in out1, out1[-4000:]
    a1 = _attempt(res, 1)
    assert a1["exit_reason"].startswith("trainer failed"), a1
    assert (a1["start_step"], a1["end_step"]) == (0, SAVE_FREQ), a1
    assert not (res / "train" / "done.json").exists()
    assert json.loads(faults.read_text()) == {}  # the fault fired
    assert not leftover(f"{RUN}-local-1"), "Ray processes left after attempt 1"
    upstream = ["deps/lock.json", "deps/runtime_env.yaml", "data/train.parquet",
                "data/val.parquet", "data/summary.json", "checks/checkpoint.json",
                "checks/bridge.json", "preflight/plan.json", "preflight/launch.sh"]
    before = _mtimes(res, upstream)

    bridge = json.loads((res / "checks" / "bridge.json").read_text())
    statuses = {c["name"]: c["status"] for c in bridge["checks"]}
    assert statuses and set(statuses.values()) == {"not run"}, statuses

    # (2) The same command again: training resumes, nothing upstream reruns.
    code, out2 = _snakemake(snakefile, args, work, env)
    assert code == 0, out2[-6000:]
    assert _mtimes(res, upstream) == before
    for rule in ("deps", "data", "tiny_model", "check_checkpoint", "check_bridge",
                 "preflight"):
        assert f"rule {rule}:" not in out2 and f"localrule {rule}:" not in out2, rule
    a2 = _attempt(res, 2)
    assert a2["exit_reason"] == "succeeded", a2
    assert (a2["start_step"], a2["end_step"]) == (SAVE_FREQ, TOTAL), a2
    assert 0 < a1["steps_lost"] <= SAVE_FREQ, a1
    assert f"Resuming from {tmp_path / 'ckpt' / RUN / f'global_step_{SAVE_FREQ}'}" in (
        res / "train" / "attempts" / "attempt-2" / "driver.log").read_text()
    done = json.loads((res / "train" / "done.json").read_text())
    assert done["final_step"] == TOTAL
    assert [a["attempt"] for a in done["attempts"]] == [1, 2]
    assert not leftover(f"{RUN}-local-2"), "Ray processes left after attempt 2"
    steps = [json.loads(x)["step"] for x in
             (res / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(0, TOTAL + 1))

    # Evaluation of base, step2 and final on the double's (loadable) HF checkpoints.
    for tag in ("base", f"step{SAVE_FREQ}", "final"):
        meta = json.loads((res / "eval" / tag / "samples.meta.json").read_text())
        assert meta["backend"] == "transformers", meta
        samples = (res / "eval" / tag / "samples.jsonl").read_text().splitlines()
        assert len(samples) == 5 * 2, (tag, len(samples))
        assert json.loads((res / "eval" / tag / "metrics.json").read_text())["tag"] == tag
    final_meta = json.loads((res / "eval" / "final" / "samples.meta.json").read_text())
    assert f"global_step_{TOTAL}" in final_meta["model_path"], final_meta

    # The report: training curves over both attempts with the resume point; the bridge
    # check shown as not run, never as a pass.
    report = res / "report"
    page = (report / "index.html").read_text()
    with open(report / "attempts.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["attempt"], r["start_step"], r["end_step"]) for r in rows] == \
        [("1", "0", str(SAVE_FREQ)), ("2", str(SAVE_FREQ), str(TOTAL))], rows
    assert rows[0]["exit_reason"].startswith("trainer failed"), rows
    assert rows[1]["exit_reason"] == "succeeded", rows
    assert f"1 resume(s): attempt 2 resumed at step {SAVE_FREQ}" in page
    assert "resume points" in page
    assert 'id="training-not-run"' not in page
    assert (report / "fig_training_published.png").stat().st_size > 0
    with open(report / "stages.csv", newline="") as fh:
        stages = {r["stage"]: r for r in csv.DictReader(fh)}
    assert stages["check_bridge"]["status"] == "not run", stages["check_bridge"]
    assert stages["train"]["status"] == "done", stages["train"]
    assert '<td>check_bridge</td><td class="status-not-run">not run</td>' in page

    # (3) Nothing left to do, also after a comment is added to the train rules (the profile
    # does not rerun on code changes).
    code, out3 = _snakemake(snakefile, [*args, "-n"], work, env)
    assert code == 0 and "Nothing to be done" in out3, out3[-3000:]
    with open(wf / "rules" / "train.smk", "a") as fh:
        fh.write("# a comment: must not retrain\n")
    code, out4 = _snakemake(snakefile, [*args, "-n"], work, env)
    assert code == 0 and "Nothing to be done" in out4, out4[-3000:]
