"""Evaluation while training goes on (issue 20), through `snakemake --profile profiles/slurm`
(+ the test override) on the real 2-node SLURM test cluster: the whole GPU DAG, training on
one node with the trainer double (tests/fixtures/trainer_double.py) in a fake verl repo
that rule deps clones for real, evaluation on the other node with the transformers backend
on the double's checkpoints (copies of the tiny Hy3), both sets (AIME-like test set and the
held-out set carved out of the training data), the selection, the report.

First the one-node rehearsal (issue 21) fails twice, each time stopping the run before
the training job is submitted and naming the failed check: the rehearsal's double crashes at
step 2; then it ignores the checkpoint after the kill (a resume that starts from step 1).

Then one invocation with --keep-going: the rehearsal passes (a one-node SLURM job: two
steps, the kill, the resume, a transformers generation) and training waits for it; the
double pauses at step 3 (after saving step 2) until
the test releases it; meanwhile step 2 is evaluated on both sets and `hy3rl report --out`
shows that evaluation with training running. Released, the double crashes at step 5: the
wait for step 6 fails naming the step and the training state; the rest of the DAG goes on
and a report of what exists renders. A second invocation resumes training from step 4,
evaluates step 6, selects on the held-out set and reports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from fixtures.common import REPO_ROOT, SNAKEMAKE
from fixtures.gpu_dag import double_sources

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              # one scenario of many invocations (about 10 minutes alone; each invocation
              # has its own timeout): pytest's 900 s would fail it on a loaded machine
              pytest.mark.timeout(1800)]

RUN = "eval-beside"
TOTAL, SAVE_FREQ = 8, 2
VENV_BIN = str(Path(sys.executable).parent)


def _override(tmp: Path) -> Path:
    override = {
        "run": {"name": RUN},
        **double_sources(tmp),
        # training takes one node (exclusive); the evaluations run on the other one; the
        # rehearsal's memory_headroom holds the double's logged peaks (64 GiB) against 96 GB
        "cluster": {"nodes": 1, "gpu_memory_gb": 96},
        "train": {
            "checkpoint_root": str(tmp / "ckpt"), "total_training_steps": TOTAL,
            "env": {"SAVE_FREQ": SAVE_FREQ, "TEST_FREQ": -1},
            "checkpoint_keep": 1, "prune_interval_s": 1, "keep_eval_checkpoints": "selected",
            "restarts_per_job": 0, "max_submissions": 1, "time_limit_margin_min": 0.5,
            "ray": {"register_timeout_s": 120, "head_timeout_s": 120},
        },
        "eval": {"n_samples": 2, "max_tokens": 4, "num_problems": 3, "steps": [2, 6],
                 "final": False, "wait_poll_s": 1, "bootstrap": {"resamples": 200}},
        # the bridge check (not run without a GPU) as a job the test cluster can hold
        "checks": {"bridge": {"cpus": 1, "mem_mb": 1000, "runtime_min": 10}},
        "preflight": {"waive": ["bridge"]},
        "report": {"dpi": 50},
        # the release runs through the workflow in tests/test_rerun_identity.py
        "release": {"tags": []},
    }
    override["data"]["heldout"] = {"limit": 6}
    path = tmp / "override.yaml"
    path.write_text(yaml.safe_dump(override))
    return path


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"snakemake ended ({proc.returncode}) before {what}:\n"
                                 f"{out[-6000:]}")
        time.sleep(1)
    proc.kill()
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _ts(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _report_now(cfgs: list[str], out: Path, work: Path, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "hy3rl.cli", "report",
                           *[a for c in cfgs for a in ("--configfile", c)], "--out", str(out)],
                          cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (out / "index.html").read_text()


def test_step_evaluated_while_training_runs_failure_keep_going_then_resume(
        slurm_profile_args, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    override = _override(tmp_path)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    res = work / "results" / RUN
    faults, release = tmp_path / "faults.json", tmp_path / "release"
    env = {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ["PATH"],
           "HY3RL_DOUBLE_FAULTS": str(faults), "HY3RL_DOUBLE_RELEASE": str(release),
           "HY3RL_DOUBLE_STEP_S": "0.5", "HY3RL_DOUBLE_SLOW_S": "3",
           "HY3RL_DOUBLE_HF_SOURCE": str(work / "resources" / "tiny-hy3"),
           "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO_ROOT / "scripts")}
    cfgs = [str(REPO_ROOT / "config/config.yaml"), str(REPO_ROOT / "tests/slurm/config.yaml"),
            str(override)]
    args = [*SNAKEMAKE, "--snakefile", str(REPO_ROOT / "Snakefile"), "--directory", str(work),
            *slurm_profile_args, str(override)]

    # (0) Rehearsals that fail: the run stops before the training job is submitted. The
    # second also moves the expert bias in step 3's export (issue 28: check updated) in the
    # same rehearsal, so it costs no run of its own.
    for fault, names, says in (
            ({"crash_at": 2}, {"trained"}, ["injected crash at step 2"]),
            ({"ignore_resume": 1, "bias_moved": 3}, {"resumed", "updated"},
             ["attempt 2's first step was 1, not 3",
              "updated: model.layers.1.mlp.expert_bias (fixed: expert bias at update rate 0) "
              "moved"])):
        faults.write_text(json.dumps({"rehearsal": fault}))
        out0 = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
        text = out0.stdout + out0.stderr
        assert out0.returncode != 0, text[-6000:]
        log0 = (res / "logs" / "rehearsal" / "rehearsal.log").read_text()
        assert "rehearsal failed" in log0 and all(x in log0 for x in says), log0[-4000:]
        checks = json.loads((res / "rehearsal" / "checks.json").read_text())
        failed = {c["name"] for c in checks["checks"] if c["status"] != "pass"}
        assert names <= failed, checks["checks"]
        assert not (res / "train" / "attempts").exists(), "training was submitted"
        assert not (res / "rehearsal" / "rehearsal.json").exists()
    assert checks["failure"] is None and "killed" not in failed, checks  # the second one
    faults.write_text(json.dumps({"pause_at": 3, "crash_at": 5,
                                  # the kill lands while step 3 runs
                                  "rehearsal": {"slow_from": 3}}))

    # (1) One invocation; step 2 is evaluated on both sets while the trainer waits at step 3.
    proc = subprocess.Popen([*args, "--keep-going"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        step2 = [res / "eval" / "step2" / "metrics.json",
                 res / "eval" / "heldout" / "step2" / "metrics.json"]
        _wait_for(lambda: all(p.exists() for p in step2), 480, "step 2's metrics", proc)
        attempt = json.loads((res / "train" / "attempts" / "attempt-1.json").read_text())
        assert attempt["exit_reason"] == "running", attempt
        assert attempt["selection"]["set"] == "dapo_heldout", attempt
        page = _report_now(cfgs, tmp_path / "report-now", work, env)
        assert 'id="running"' in page and "is running" in page
        assert "step2" in page and 'id="selection"' in page
        ready = json.loads((res / "eval" / "step2" / "checkpoint.json").read_text())
        finished = json.loads((res / "eval" / "step2" / "samples.meta.json").read_text())
        assert _ts(ready["complete_at"]) <= _ts(finished["started"])
        release.write_text("go")
        out1, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out1[-4000:]
    a1 = json.loads((res / "train" / "attempts" / "attempt-1.json").read_text())
    assert a1["exit_reason"].startswith("trainer failed"), a1
    # the rehearsal passed, as a one-node SLURM job, before the training job started
    reh = json.loads((res / "rehearsal" / "rehearsal.json").read_text())
    assert reh["ok"] and [a["outcome"] for a in reh["attempts"]] == ["planned_kill", "succeeded"]
    assert reh["attempts"][1]["start_step"] == 2 and reh["attempts"][0]["slurm_job_id"]
    assert len(reh["attempts"][0]["nodes"]) == 1, reh["attempts"]
    assert all(isinstance(v, float) for v in reh["phases_s"].values()), reh["phases_s"]
    assert _ts(reh["finished"]) < _ts(a1["started_at"]), (reh["finished"], a1["started_at"])
    assert reh["runtime"]["identity"]["id"] == a1["runtime"]["identity"]["id"]
    # step 2's evaluation finished while training was still running: before the attempt ended
    assert _ts(finished["finished"]) < _ts(a1["ended_at"]), (finished, a1)
    wait_log = (res / "logs" / "eval" / "step6.wait.log").read_text()
    assert "step 6: training stopped before step 6" in wait_log, wait_log[-2000:]
    assert "newest complete checkpoint step 4" in wait_log, wait_log[-2000:]
    assert "Error in rule eval_checkpoint" in out1, out1[-4000:]
    # the controller's stop was an ordinary job failure: the scheduler went on (--keep-going)
    assert "Training job not resubmitted: " in out1 and "InputFunctionException" not in out1
    for tag in ("base", "heldout/base", "step2", "heldout/step2"):
        assert (res / "eval" / tag / "metrics.json").is_file(), tag
    assert not (res / "eval" / "step6" / "checkpoint.json").exists()
    page = _report_now(cfgs, tmp_path / "report-failed", work, env)
    assert "selection so far" in page

    # (2) A resuming invocation: training continues from step 4, step 6 is evaluated, the
    # selection is made on the held-out set, the report renders.
    out2 = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert out2.returncode == 0, (out2.stdout + out2.stderr)[-6000:]
    # scoring, metrics, the selection and the summary ran on the submit host, the
    # generations as SLURM jobs
    text2 = out2.stdout + out2.stderr
    for rule in ("eval_score", "eval_metrics", "eval_select", "evaluate"):
        assert f"localrule {rule}:" in text2, (rule, text2[-4000:])
    assert re.search(r"^rule eval_generate:", text2, re.M), text2[-4000:]
    a2 = json.loads((res / "train" / "attempts" / "attempt-2.json").read_text())
    assert (a2["start_step"], a2["end_step"]) == (4, TOTAL), a2
    for tag in ("step6", "heldout/step6"):
        assert (res / "eval" / tag / "metrics.json").is_file(), tag
    sel = json.loads((res / "eval" / "selected.json").read_text())
    assert sel["selected"]["tag"] in ("step2", "step6"), sel
    summary = json.loads((res / "eval" / "summary.json").read_text())
    assert summary["heldout"]["tags"] and summary["selected"], summary.keys()
    page = (res / "report" / "index.html").read_text()
    assert 'id="selection"' in page and 'id="rehearsal-checks"' in page
    # retention (checkpoint_keep 1, keep_eval_checkpoints selected): the evaluation steps
    # were kept until both their evaluations had read them; now only the newest and the
    # selected one remain
    kept = sorted(int(p.name.split("_")[-1]) for p in (tmp_path / "ckpt" / RUN).glob(
        "global_step_*"))
    assert TOTAL in kept and sel["selected"]["step"] in kept, kept

    # (3) What re-runs the rehearsal: another training runtime does, in the same invocation,
    # and nothing trains; an operational change (the watchdog, the report) does not.
    cfg = yaml.safe_load(override.read_text())
    for change, rehearsed in (({"train": {"watchdog": {"stall_min": 45}},
                                "report": {"dpi": 60}}, False),
                              ({"train": {"runtime": {"prefix": "env"}}}, True)):
        changed = {**cfg, **{k: {**cfg.get(k, {}), **v} for k, v in change.items()}}
        override.write_text(yaml.safe_dump(changed))
        dry = subprocess.run([*args, "-n"], capture_output=True, text=True, env=env, timeout=300)
        text = dry.stdout + dry.stderr
        assert dry.returncode == 0, text[-4000:]
        planned = set(re.findall(r"^(?:local)?rule (\w+):", text, re.M))
        assert ({"rehearsal", "rehearsal_runtime"} <= planned) is rehearsed, (change, planned)
        assert not planned & {"train", "train_keys", "rehearsal_model"}, (change, planned)
