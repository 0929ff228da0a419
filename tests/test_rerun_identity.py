"""Reruns that tell the truth (issue 18), through `snakemake --profile profiles/local` on the
GPU DAG (`cluster.gpu: true`) with verl's trainer replaced by the test double
(tests/fixtures/trainer_double.py) in a fake verl repo that rule deps clones for real, as a
user changes the config of one run. Everything else is real: deps clones local git repos,
data reads local parquet, the tiny Hy3 is built, both checkpoint checks run (check_bridge:
`not run` without a GPU, waived), preflight renders the launch, train starts a single-node
Ray (one GPU declared to Ray through CUDA_VISIBLE_DEVICES; torch stays on CPU), evaluation
loads the double's HF checkpoints (copies of the tiny Hy3) with the transformers backend, the
report renders. The workflow runs from a copy of the repository's workflow files (so that a
rule can be edited there). Each change is ONE invocation:

0. the trainer crashes at step 2 after saving step 1: the run fails; the same command again
   resumes from global_step_1, reruns nothing upstream, evaluates and reports;
1. so a run of 2 steps (SAVE_FREQ 1); then nothing is left to do, also after a comment is
   added to rules/train.smk;
2. total 2 -> 4: training resumes from global_step_2 to 4, `final` is evaluated at step 4,
   one W&B run id; then a dry run has nothing to do;
3. eval.steps [1] -> [1, 3]: step 3 is evaluated, nothing trains;
4. operational changes (watchdog, loggers, retention): a dry run plans no training;
5. a learning-rate change: refused by preflight naming the key with both values, no
   training job;
6. the same change with `on_config_change: resume` and total 5: continued from step 4, the
   change recorded in the identity and shown in the report at step 4;
7. the total lowered below the newest checkpoint: refused;
8. another learning rate with `on_config_change: fresh`: the old checkpoints moved aside
   (nothing deleted), training from step 0; the curves hold only the new lineage; step 1
   evaluated again on the new lineage (the invocation refused just before left no request of
   the new values behind); the final model released (issue 31): its checks pass, its weights
   are the ones evaluated; then nothing is left to do;
9. the same learning rate moved from the script's knob to a verl override: the finished
   job's keys record adopted on the submit host, nothing trains.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from fixtures.gpu_dag import attempt, double_sources, mtimes, snakemake, workflow_copy
from fixtures.trainer_double import LOCAL_RAY_PORTS, TEST_WATCHDOG, leftover_ray

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              # one scenario of many invocations (about 10 minutes alone; each invocation
              # has its own timeout): pytest's 900 s would fail it on a loaded machine
              pytest.mark.timeout(1800)]

RUN = "rerun"
IDENTITY = "hy3rl-run-identity.json"


def _base(tmp: Path) -> dict:
    cfg = {
        "run": {"name": RUN},
        **double_sources(tmp),
        "cluster": {"gpu": True, "nodes": 1, "gpus_per_node": 1, "cpus_per_node": 1},
        "train": {
            "checkpoint_root": str(tmp / "ckpt"), "total_training_steps": 2,
            "cpu": {"enable": False}, "loggers": [],  # the script's loggers: W&B too
            "checkpoint_keep": 2, "prune_interval_s": 1, "restarts_per_job": 0,
            "max_submissions": 1, "watchdog": dict(TEST_WATCHDOG),
            "ray": {"register_timeout_s": 120, "head_timeout_s": 120, **LOCAL_RAY_PORTS},
        },
        # no held-out set and no selection: what re-runs is decided the same way for both
        # sets' generations, and the held-out set, the selection and the one-node rehearsal
        # run for real in tests/test_eval_slurm.py (each generation here is a process that
        # loads torch and transformers: about 12 CPU-seconds)
        "eval": {"n_samples": 1, "max_tokens": 4, "num_problems": 2, "steps": [1],
                 "select": None},
        "preflight": {"waive": ["bridge", "rehearsal"]},
        "report": {"dpi": 50},
        "release": {"tags": []},  # released in the last invocation only (8)
    }
    cfg["data"]["heldout"] = None
    return cfg


class Runner:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.cfg = _base(tmp)
        self.snakefile = workflow_copy(tmp / "wf")
        self.work = tmp / "work"
        self.work.mkdir(exist_ok=True)
        self.res = self.work / "results" / RUN
        self.ckpt = tmp / "ckpt" / RUN
        self.env = {
            "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
            "HY3RL_DOUBLE_STEP_S": "0.1",
            "HY3RL_DOUBLE_HF_SOURCE": str(self.work / "resources" / "tiny-hy3"),
            "CUDA_VISIBLE_DEVICES": "0", "WANDB_MODE": "offline",
            "HY3RL_DOUBLE_FAULTS": str(tmp / "faults.json"),
        }

    def __call__(self, *extra: str) -> tuple[int, str]:
        override = self.tmp / "override.yaml"
        override.write_text(yaml.safe_dump(self.cfg))
        wf = self.snakefile.parent
        return snakemake(self.snakefile, ["--profile", str(wf / "profiles" / "local"),
                                          "--configfile", str(wf / "config" / "config.yaml"),
                                          str(override), *extra], self.work, self.env)

    def attempts(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in
                      (self.res / "train" / "attempts").glob("attempt-*.json"))

    def done(self) -> dict:
        return json.loads((self.res / "train" / "done.json").read_text())

    def identity(self) -> dict:
        return json.loads((self.ckpt / IDENTITY).read_text())

    def eval_step(self, tag: str) -> int | None:
        return json.loads((self.res / "eval" / tag / "samples.meta.json").read_text())["step"]


def _ran(out: str, rule: str) -> bool:
    return f"rule {rule}:" in out.replace(f"localrule {rule}:", f"rule {rule}:")


def test_each_change_is_one_invocation_that_does_the_right_thing(tmp_path: Path,
                                                                 monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = Runner(tmp_path)

    # (0) the trainer crashes at step 2: the run fails, the checkpoint of step 1 stays
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"crash_at": 2}))
    code, out = run()
    assert code != 0 and "Error in rule train" in out, out[-4000:]
    a1 = attempt(run.res, 1)
    assert a1["exit_reason"].startswith("trainer failed"), a1
    assert (a1["start_step"], a1["end_step"]) == (0, 1), a1
    assert json.loads(faults.read_text()) == {}  # the fault fired
    assert not (run.res / "train" / "done.json").exists()
    assert not leftover_ray(f"{RUN}-local-1"), "Ray processes left after attempt 1"
    upstream = ["deps/lock.json", "deps/runtime_env.yaml", "data/train.parquet",
                "data/val.parquet", "data/summary.json", "checks/checkpoint.json",
                "checks/bridge.json", "preflight/plan.json", "preflight/launch.sh"]
    before = mtimes(run.res, upstream)

    # ... the same command again: training resumes, nothing upstream reruns
    code, out = run()
    assert code == 0, out[-6000:]
    assert mtimes(run.res, upstream) == before
    for rule in ("deps", "data", "tiny_model", "check_checkpoint", "check_bridge",
                 "preflight"):
        assert not _ran(out, rule), rule
    a2 = attempt(run.res, 2)
    assert (a2["start_step"], a2["end_step"], a2["exit_reason"]) == (1, 2, "succeeded"), a2
    assert f"Resuming from {run.ckpt / 'global_step_1'}" in (
        run.res / "train" / "attempts" / "attempt-2" / "driver.log").read_text()
    assert not leftover_ray(f"{RUN}-local-2"), "Ray processes left after attempt 2"
    # the report: both attempts, the resume point, the bridge check not run (never a pass)
    page = (run.res / "report" / "index.html").read_text()
    with open(run.res / "report" / "attempts.csv", newline="") as fh:
        rows = [(r["attempt"], r["start_step"], r["end_step"]) for r in csv.DictReader(fh)]
    assert rows == [("1", "0", "1"), ("2", "1", "2")], rows
    assert "1 resume(s): attempt 2 resumed at step 1" in page
    assert '<td>check_bridge</td><td class="status-not-run">not run</td>' in page
    assert '<td>rehearsal</td><td class="status-waived">waived</td>' in page

    # (1) so a run of 2 steps
    done = run.done()
    assert done["final_step"] == 2 and done["this_job"]["attempts"] == [2], done
    traj = done["trajectory_id"]
    assert traj and run.identity()["trajectory"]["id"] == traj
    assert run.eval_step("final") == 2
    wandb_id = attempt(run.res, 1)["wandb"]["run_id"]
    assert wandb_id == f"{RUN}-{traj[:8]}" == attempt(run.res, 2)["wandb"]["run_id"]
    # nothing left to do, also after a comment is added to the train rules (the profile
    # does not rerun on code changes)
    with open(run.snakefile.parent / "rules" / "train.smk", "a") as fh:
        fh.write("# a comment: must not retrain\n")
    code, out = run("-n")
    assert code == 0 and "Nothing to be done" in out, out[-3000:]

    # (2) extension 2 -> 4, in one invocation
    run.cfg["train"]["total_training_steps"] = 4
    code, out = run()
    assert code == 0, out[-6000:]
    assert run.attempts() == [1, 2, 3]
    a3 = attempt(run.res, 3)
    assert (a3["start_step"], a3["end_step"], a3["identity_action"]) == (2, 4, "extend"), a3
    assert a3["wandb"]["run_id"] == wandb_id and a3["trajectory_id"] == traj
    done = run.done()
    assert (done["final_step"], done["total_training_steps"]) == (4, 4)
    assert done["this_job"]["note"] == "trained steps 3-4", done["this_job"]
    assert run.eval_step("final") == 4
    assert [e["total_training_steps"] for e in run.identity()["extents"]] == [2, 4]
    code, out = run("-n")
    assert code == 0 and "Nothing to be done" in out, out[-3000:]

    # (3) a new evaluation step: evaluated, nothing trains
    run.cfg["eval"]["steps"] = [1, 3]
    code, out = run()
    assert code == 0, out[-6000:]
    assert not _ran(out, "train") and run.attempts() == [1, 2, 3]
    assert run.eval_step("step3") == 3
    assert "step3" in json.loads((run.res / "eval" / "summary.json").read_text())["tags"]

    # ... a step whose checkpoint retention removed is refused before anything runs
    run.cfg["eval"]["steps"] = [1, 2, 3]
    code, out = run()
    assert code != 0 and "eval.steps [2]" in (run.res / "logs" / "preflight.log").read_text()
    run.cfg["eval"]["steps"] = [1, 3]

    # (4) operational changes: nothing to train
    run.cfg["train"].update(checkpoint_keep=3, watchdog={"stall_min": 45},
                            loggers=["console", "file"])
    run.cfg["train"]["env"] = {"SAVE_FREQ": 2}
    code, out = run("-n")
    assert code == 0, out[-3000:]
    assert not _ran(out, "train"), out[-3000:]
    assert _ran(out, "preflight"), out[-3000:]
    # ... the learning rate set to the value verl already reads (issue 40): the training
    # keys change, the trajectory verl composes does not; decided on the submit host, the
    # finished job's record is adopted (rule train_adopt), no training job is planned. The
    # training data source only touched: its content is the same, so neither rule data nor
    # a training key changes.
    run.cfg["train"]["env"] = {"ACTOR_LR": "1.0e-6"}
    source = Path(run.cfg["data"]["train"]["source"])
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    code, out = run("-n")
    assert code == 0, out[-3000:]
    assert not _ran(out, "train") and _ran(out, "train_adopt"), out[-3000:]
    assert not _ran(out, "data"), out[-3000:]
    del run.cfg["train"]["env"]

    # (5) a learning-rate change on existing checkpoints: refused before any training job
    done_bytes = (run.res / "train" / "done.json").read_bytes()
    run.cfg["train"]["env"] = {"ACTOR_LR": 5e-6}
    code, out = run()
    assert code != 0
    log = (run.res / "logs" / "preflight.log").read_text()
    assert "actor_rollout_ref.actor.optim.lr" in log and "1e-06 -> 5e-06" in log, log
    assert "on_config_change" in log
    assert not _ran(out, "train") and run.attempts() == [1, 2, 3]
    # ... which changed no record (issue 27): done.json is as it was; the old value restored
    # plans no training job (its keys record is still in place)
    assert (run.res / "train" / "done.json").read_bytes() == done_bytes
    del run.cfg["train"]["env"]
    code, out = run("-n")
    assert code == 0 and not _ran(out, "train"), out[-3000:]
    # ... and evaluates nothing again (the checkpoint tags' requests are still in place)
    for rule in ("eval_request", "eval_checkpoint", "eval_generate"):
        assert not _ran(out, rule), (rule, out[-3000:])
    run.cfg["train"]["env"] = {"ACTOR_LR": 5e-6}

    # (6) the same change, continued on purpose, with two more steps
    run.cfg["train"].update(on_config_change="resume", total_training_steps=5)
    code, out = run()
    assert code == 0, out[-6000:]
    assert run.attempts() == [1, 2, 3, 4]
    a4 = attempt(run.res, 4)
    assert (a4["start_step"], a4["end_step"]) == (4, 5) and a4["trajectory_id"] != traj
    last = run.identity()["history"][-1]
    assert (last["action"], last["at_step"]) == ("resume_changed", 4)
    assert last["changes"][0]["key"] == "actor_rollout_ref.actor.optim.lr"
    page = (run.res / "report" / "index.html").read_text()
    assert "step 4: training continued under a changed configuration" in page
    assert "attempts of different trajectories" in page

    # (7) a total below the newest checkpoint: refused
    run.cfg["train"]["total_training_steps"] = 3
    code, out = run()
    assert code != 0
    log = (run.res / "logs" / "preflight.log").read_text()
    assert "total_training_steps = 3" in log and "step 5" in log, log
    assert run.attempts() == [1, 2, 3, 4]

    # (8) another learning rate, started afresh: nothing deleted, a new lineage
    run.cfg["train"].update(on_config_change="fresh", total_training_steps=2,
                            env={"ACTOR_LR": 2e-5})
    requests = sorted((run.res / "eval" / "step1").glob("request.*.json"))
    code, out = run()  # step 3 is no longer within the total: refused, nothing moved
    assert code != 0
    assert "eval.steps [3]: beyond train.total_training_steps = 2" in (
        run.res / "logs" / "preflight.log").read_text()
    assert not [p for p in run.ckpt.iterdir() if p.name.startswith("superseded-")]
    # ... and no request of the new values stands for an evaluation that never ran
    assert sorted((run.res / "eval" / "step1").glob("request.*.json")) == requests
    run.cfg["eval"]["steps"] = [1]
    run.cfg["release"]["tags"] = ["final"]  # issue 31: the release, through the workflow
    code, out = run()
    assert code == 0, out[-6000:]
    a5 = attempt(run.res, 5)
    assert (a5["start_step"], a5["end_step"], a5["identity_action"]) == (0, 2, "fresh"), a5
    aside = [p for p in run.ckpt.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "global_step_5").is_dir()
    done = run.done()
    assert done["final_step"] == 2 and done["superseded_attempts"] == [1, 2, 3, 4], done
    steps = [json.loads(x)["step"] for x in
             (run.res / "train" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2, steps
    assert run.eval_step("final") == 2
    # step 1 is evaluated again, on the new lineage's checkpoint (its wait names the new
    # trajectory), in this invocation
    assert _ran(out, "eval_checkpoint") and _ran(out, "eval_generate"), out[-3000:]
    ready = json.loads((run.res / "eval" / "step1" / "checkpoint.json").read_text())
    assert ready["trajectory_id"] == a5["trajectory_id"], (ready, a5["trajectory_id"])
    # ... and the final model released from the new lineage: every check passes, its weight
    # files are the ones the final evaluation loaded (their sha256), the card parses
    from huggingface_hub import ModelCard

    assert _ran(out, "release_model"), out[-3000:]
    rel = json.loads((run.res / "release" / "final" / "release.json").read_text())
    checks = json.loads((run.res / "release" / "final" / "checks.json").read_text())
    assert checks["ok"], checks
    assert {c["name"]: c["status"] for c in checks["checks"]} == {n: "pass" for n in (
        "tokenizer", "config", "encodings", "index", "headers", "index_vs_shards",
        "inventory", "fixed_tensors", "generates", "report", "card", "evaluated")}, \
        checks["checks"]
    meta = json.loads((run.res / "eval" / rel["evaluated_tag"] / "samples.meta.json")
                      .read_text())
    assert meta["weights"] == {k: v["sha256"] for k, v in rel["files"].items()
                               if k.endswith(".safetensors")}, (meta["weights"], rel["files"])
    assert rel["step"] == 2 and "superseded-" not in rel["source"], rel
    assert ModelCard.load(Path(rel["dir"]) / "README.md").data.eval_results
    # ... with the run's report beside its card, as rendered in this invocation (it shows
    # the final evaluation at step 2 of the new lineage)
    assert (Path(rel["dir"]) / "report" / "index.html").read_bytes() == (
        run.res / "report" / "index.html").read_bytes()
    # ... and shown with its checks on the releases' page, which the report links
    assert _ran(out, "release_page"), out[-3000:]
    page = (run.res / "report" / "releases.html").read_text()
    assert 'id="release-final"' in page and rel["dir"] in page
    assert page.count('<td class="status-pass">pass</td>') == 12  # 12 checks a release
    assert 'href="releases.html"' in (run.res / "report" / "index.html").read_text()
    code, out = run("-n")
    assert code == 0 and "Nothing to be done" in out, out[-3000:]

    # (9) the learning rate moved from the launch script's knob to a verl override, same value
    # (issue 40): another spelling, the same composed configuration. Nothing trains: the
    # record is adopted on the submit host, after preflight's decision says `same`.
    run.cfg["train"]["env"] = {}
    run.cfg["train"]["verl_overrides"] = {"actor_rollout_ref.actor.optim.lr": 2e-5}
    run.cfg["release"]["tags"] = []  # released above
    code, out = run()
    assert code == 0, out[-6000:]
    assert _ran(out, "train_adopt") and not _ran(out, "train"), out[-3000:]
    assert run.attempts() == [1, 2, 3, 4, 5]
    record = next((run.res / "train" / "keys").glob("final.*.json"))
    adopted = json.loads(record.read_text())
    assert adopted["origin"] == "adopted", adopted
    assert adopted["adopted"]["trajectory_id"] == a5["trajectory_id"], adopted
    assert adopted["adopted"]["identity_decision"]["action"] == "same", adopted
