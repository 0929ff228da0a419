"""Reruns that tell the truth (issue 18), through `snakemake --profile profiles/local` on the
GPU DAG (`cluster.gpu: true`) with verl's trainer replaced by the test double, as a user
changes the config of one run. Each change is ONE invocation:

1. a run of 2 steps (SAVE_FREQ 1), after the one-node rehearsal passed;
2. total 2 -> 4: training resumes from global_step_2 to 4, `final` is evaluated at step 4,
   one W&B run id; then a dry run has nothing to do;
3. eval.steps [1] -> [1, 3]: step 3 is evaluated, nothing trains;
4. operational changes (watchdog, loggers, retention): a dry run plans no training and no
   rehearsal; a changed training runtime plans the rehearsal again, and no training;
5. a learning-rate change: refused by preflight naming the key with both values, no
   training job;
6. the same change with `on_config_change: resume` and total 5: continued from step 4, the
   change recorded in the identity and shown in the report at step 4;
7. the total lowered below the newest checkpoint: refused;
8. another learning rate with `on_config_change: fresh`: the old checkpoints moved aside
   (nothing deleted), training from step 0; the curves hold only the new lineage.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from fixtures.gpu_dag import attempt, double_sources, snakemake, workflow_copy

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RUN = "rerun"
IDENTITY = "hy3rl-run-identity.json"


def _base(tmp: Path) -> dict:
    return {
        "run": {"name": RUN},
        **double_sources(tmp),
        "cluster": {"gpu": True, "nodes": 1, "gpus_per_node": 1, "cpus_per_node": 1},
        "train": {
            "checkpoint_root": str(tmp / "ckpt"), "total_training_steps": 2,
            "checkpoint_keep": 2, "prune_interval_s": 1, "restarts_per_job": 0,
            "max_submissions": 1,
            "ray": {"register_timeout_s": 120, "head_timeout_s": 120},
        },
        "eval": {"n_samples": 1, "max_tokens": 4, "num_problems": 2, "steps": [1]},
        "preflight": {"waive": ["bridge"]},
    }


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
            # the rehearsal's step 3 takes seconds: its planned kill lands during it
            "HY3RL_DOUBLE_FAULTS": str(tmp / "faults.json"), "HY3RL_DOUBLE_SLOW_S": "3",
        }
        (tmp / "faults.json").write_text(json.dumps({"rehearsal": {"slow_from": 3}}))

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

    # (1) a first run of 2 steps
    code, out = run()
    assert code == 0, out[-6000:]
    done = run.done()
    assert done["final_step"] == 2 and done["this_job"]["attempts"] == [1], done
    traj = done["trajectory_id"]
    assert traj and run.identity()["trajectory"]["id"] == traj
    reh = json.loads((run.res / "rehearsal" / "rehearsal.json").read_text())
    assert reh["ok"] and reh["finished"] < attempt(run.res, 1)["started_at"], reh
    assert run.eval_step("final") == 2
    wandb_id = attempt(run.res, 1)["wandb"]["run_id"]
    assert wandb_id == f"{RUN}-{traj[:8]}"

    # (2) extension 2 -> 4, in one invocation
    run.cfg["train"]["total_training_steps"] = 4
    code, out = run()
    assert code == 0, out[-6000:]
    assert run.attempts() == [1, 2]
    a2 = attempt(run.res, 2)
    assert (a2["start_step"], a2["end_step"], a2["identity_action"]) == (2, 4, "extend"), a2
    assert a2["wandb"]["run_id"] == wandb_id and a2["trajectory_id"] == traj
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
    assert not _ran(out, "train") and run.attempts() == [1, 2]
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
    assert not _ran(out, "train") and not _ran(out, "train_keys"), out[-3000:]
    assert not _ran(out, "rehearsal") and not _ran(out, "rehearsal_runtime"), out[-3000:]
    assert _ran(out, "preflight"), out[-3000:]
    del run.cfg["train"]["env"]
    # ... but another training runtime is rehearsed again, in the same invocation
    run.cfg["train"]["runtime"] = {"prefix": "env", "python": sys.executable}
    code, out = run("-n")
    assert code == 0, out[-3000:]
    assert _ran(out, "rehearsal_runtime") and _ran(out, "rehearsal"), out[-3000:]
    assert not _ran(out, "train") and not _ran(out, "train_keys"), out[-3000:]
    del run.cfg["train"]["runtime"]

    # (5) a learning-rate change on existing checkpoints: refused before any training job
    run.cfg["train"]["env"] = {"ACTOR_LR": 5e-6}
    code, out = run()
    assert code != 0
    log = (run.res / "logs" / "preflight.log").read_text()
    assert "actor_rollout_ref.actor.optim.lr" in log and "1e-6" in log and "5e-06" in log, log
    assert "on_config_change" in log
    assert not _ran(out, "train") and run.attempts() == [1, 2]

    # (6) the same change, continued on purpose, with two more steps
    run.cfg["train"].update(on_config_change="resume", total_training_steps=5)
    code, out = run()
    assert code == 0, out[-6000:]
    assert run.attempts() == [1, 2, 3]
    a3 = attempt(run.res, 3)
    assert (a3["start_step"], a3["end_step"]) == (4, 5) and a3["trajectory_id"] != traj
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
    assert run.attempts() == [1, 2, 3]

    # (8) another learning rate, started afresh: nothing deleted, a new lineage
    run.cfg["train"].update(on_config_change="fresh", total_training_steps=2,
                            env={"ACTOR_LR": 2e-5})
    code, out = run()  # step 3 is no longer within the total: refused, nothing moved
    assert code != 0
    assert "eval.steps [3]: beyond train.total_training_steps = 2" in (
        run.res / "logs" / "preflight.log").read_text()
    assert not [p for p in run.ckpt.iterdir() if p.name.startswith("superseded-")]
    run.cfg["eval"]["steps"] = [1]
    code, out = run()
    assert code == 0, out[-6000:]
    a4 = attempt(run.res, 4)
    assert (a4["start_step"], a4["end_step"], a4["identity_action"]) == (0, 2, "fresh"), a4
    aside = [p for p in run.ckpt.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "global_step_5").is_dir()
    done = run.done()
    assert done["final_step"] == 2 and done["superseded_attempts"] == [1, 2, 3], done
    steps = [json.loads(x)["step"] for x in
             (run.res / "train" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2, steps
    assert run.eval_step("final") == 2
