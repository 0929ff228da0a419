"""The train stage with a real Ray cluster on this machine (the profiles/local path): the
launcher starts a single-node Ray, submits launch.sh with `ray job submit`, and the trainer
double writes verl's checkpoint layout and logs. The stage runs as `hy3rl train` (the
console script) or through Snakemake's rules (their `script:` adapters). Few launches: Ray
is slow on 2 cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.common import REPO_ROOT, run_snakemake
from fixtures.trainer_double import leftover_ray as leftover
from hy3rl import ckptdir, train
from hy3rl.watchdog import FIRST_LINE_PART, POLL_KEY, STARTUP_MARKS

pytestmark = [pytest.mark.ray, pytest.mark.slow]

VENV_BIN = str(Path(sys.executable).parent)


def train_env(setup) -> dict[str, str]:
    env = {**os.environ, **setup.env(), "PATH": VENV_BIN + os.pathsep + os.environ["PATH"]}
    env.pop("SLURM_JOB_ID", None)
    return env


def run_train(setup, timeout=300) -> subprocess.CompletedProcess:
    """`hy3rl train --configfile config/config.yaml --configfile <setup's>`."""
    return subprocess.run(setup.cli(), cwd=setup.root, env=train_env(setup),
                          capture_output=True, text=True, timeout=timeout)


def run_rules(setup, *rules: str) -> None:
    """Snakemake with profiles/local on the setup's config, only ``rules`` allowed."""
    run_snakemake([f"results/{setup.run}/train/done.json", "--profile",
                   str(REPO_ROOT / "profiles" / "local"), "--configfile",
                   str(REPO_ROOT / "config" / "config.yaml"), str(setup.config_file()),
                   "--allowed-rules", *rules], setup.root, env=train_env(setup),
                  timeout=300)


def attempt(setup, k: int) -> dict:
    return json.loads((setup.results / "train" / "attempts" / f"attempt-{k}.json").read_text())


def test_die_mid_save_then_resume_to_done(train_setup) -> None:
    setup = train_setup(total=6, save_freq=2, keep=1)
    setup.config["eval"] = {"steps": [2]}  # retention keeps eval.steps (Config.eval_keep_steps)
    setup.config["train"]["restarts_per_job"] = 0  # a person's rerun (no restart in the job)
    setup.set_faults(die_mid_save=4)

    first = run_train(setup)
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    assert "error: trainer failed (FAILED, exit 1); no restart left in this job: ends for a " \
        "resubmission; newest complete checkpoint 2" in first.stderr, first.stderr[-3000:]
    a1 = attempt(setup, 1)
    assert a1["exit_reason"].startswith("trainer failed (FAILED"), a1
    assert a1["outcome"] == "failed" and a1["failed_at_step"] == 4, a1
    assert (a1["start_step"], a1["end_step"], a1["last_logged_step"], a1["steps_lost"]) == \
        (0, 2, 3, 1)
    assert a1["nodes"] and a1["slurm_job_id"] is None
    assert ckptdir.read_tracker(setup.ckpt) == 2
    assert not ckptdir.check_complete(setup.ckpt / "global_step_4", 4)[0]
    assert not (setup.results / "train" / "done.json").exists()
    assert not (setup.ckpt / ckptdir.LOCK_NAME).exists()
    logs = setup.results / "train" / "attempts" / "attempt-1"
    assert "dying in the middle of saving step 4" in (logs / "driver.log").read_text()
    assert "all 1 node(s)" in (logs / "launcher.log").read_text()
    assert not leftover("t-local-1"), "Ray processes left after attempt 1"

    # The rerun goes through Snakemake with profiles/local: the same launcher, one machine.
    run_rules(setup, "train")
    a2 = attempt(setup, 2)
    assert a2["exit_reason"] == "succeeded"
    assert a2["start_step"] == 2 and a2["end_step"] == 6 and a2["steps_lost"] == 0
    assert any("global_step_4" in a and "aside" in a for a in a2["resume_actions"]), a2
    assert (setup.ckpt / "global_step_4.incomplete-2").is_dir()  # moved aside, not deleted
    assert "Resuming from" in (setup.results / "train" / "attempts" / "attempt-2" /
                               "driver.log").read_text()

    done = json.loads((setup.results / "train" / "done.json").read_text())
    assert done["final_step"] == 6 and done["checkpoint"].endswith("global_step_6")
    assert done["kept_checkpoints"] == [2, 6]  # keep 1 + eval step 2; step 4 pruned
    assert [a["attempt"] for a in done["attempts"]] == [1, 2]
    assert done["steps_lost_total"] == 1

    merged = [json.loads(x) for x in
              (setup.results / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in merged] == list(range(0, 7))
    logs2 = {json.loads(x)["step"]: json.loads(x) for x in
             (setup.results / "train" / "attempts" / "attempt-2.metrics.jsonl")
             .read_text().splitlines()}
    assert merged[3] == logs2[3]  # redone step: the later attempt's line
    assert "critic/rewards/mean" in merged[2]["data"]  # resume validation merged in, not
    assert "val-core/math_dapo/acc/mean@1" in merged[2]["data"]  # replacing training keys
    # what re-runs training: the keys its record is named by (the rule has no params)
    assert "rule train: 0 rerun trigger(s)" in (setup.results / "logs" / "train.log").read_text()
    (record,) = (setup.results / "train" / "keys").glob("final.*.json")
    keys = "\n".join(json.loads(record.read_text())["values"])
    assert f"train.checkpoint_root={json.dumps(str(setup.ckpt_root))}" in keys
    assert "train.ray." not in keys and "train.checkpoint_keep" not in keys
    assert not leftover("t-local-2")


def test_sigterm_stops_job_and_ray(train_setup) -> None:
    setup = train_setup(total=50, save_freq=2)
    setup.set_faults(hang_at=3)
    out = open(setup.root / "train.log", "w")
    proc = subprocess.Popen(setup.cli(), cwd=setup.root, env=train_env(setup), stdout=out,
                            stderr=subprocess.STDOUT)
    metrics = setup.results / "train" / "attempts" / "attempt-1.metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:  # val + steps 1, 2
            break
        time.sleep(1)
    assert proc.poll() is None, (setup.root / "train.log").read_text()[-3000:]
    assert (setup.ckpt / ckptdir.LOCK_NAME).exists()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    out.close()
    log = (setup.root / "train.log").read_text()
    assert code == 1, log[-3000:]
    # outside SLURM a signal is a cancellation: no restart, no resubmission
    assert "error: signal SIGTERM; newest complete checkpoint 2; logs in " in log, log[-3000:]
    assert "; not resubmitted" in log
    a1 = attempt(setup, 1)
    assert a1["exit_reason"] == "signal SIGTERM" and a1["outcome"] == "cancelled", a1
    assert train.attempt_numbers(setup.layout()) == [1]
    assert a1["end_step"] == 2
    assert "ray job stop t-local-1" in log
    assert not (setup.ckpt / ckptdir.LOCK_NAME).exists()
    assert not leftover("t-local-1"), "Ray processes left after SIGTERM"


def test_segments_chain_to_done(train_setup) -> None:
    """train.segment_steps, through the rules: train_segment stops at its segment's end
    (verl saves at its last step, though save_freq is 3), rule train resumes there."""
    setup = train_setup(total=4, save_freq=3)
    setup.config["train"].update(segment_steps=2, total_training_steps=4)
    run_rules(setup, "train_segment", "train")
    seg = setup.results / "train" / "segments" / "step2.json"
    assert json.loads(seg.read_text())["final_step"] == 2
    a1, a2 = attempt(setup, 1), attempt(setup, 2)
    assert (a1["start_step"], a1["end_step"], a1["exit_reason"]) == (0, 2, "succeeded")
    assert "trainer.total_training_steps=2" in (
        setup.results / "train" / "attempts" / "attempt-1" / "launcher.log").read_text()
    done = json.loads((setup.results / "train" / "done.json").read_text())
    assert done["final_step"] == 4 and a2["start_step"] == 2
    assert done["kept_checkpoints"] == [3, 4]  # step 2 (complete, resumed from) then pruned
    assert [m["step"] for m in map(json.loads, (setup.results / "train" / "metrics.jsonl")
                                   .read_text().splitlines())] == [0, 1, 2, 3, 4]
    (record,) = (setup.results / "train" / "keys").glob("step2.*.json")
    keys = json.loads(record.read_text())
    assert "train.segment_steps=2" in keys["values"] and "segment_end=step2" in keys["values"]
    assert not any(v.startswith("train.total_training_steps") for v in keys["values"])


def test_runtime_prefix_wraps_node_and_uses_its_ray(train_setup) -> None:
    """train.runtime.prefix: each node process runs under the prefix (a real wrapper that
    marks the environment and puts its own `ray` first on PATH); Ray starts from there."""
    setup = train_setup(total=1, save_freq=1)
    rt = setup.root / "runtime"
    (rt / "bin").mkdir(parents=True)
    shim_log = rt / "ray-shim.log"
    shim = rt / "bin" / "ray"
    shim.write_text(f'#!/bin/bash\necho "ray-shim: $*" >> {shim_log}\n'
                    f'exec {VENV_BIN}/ray "$@"\n')
    wrap = rt / "wrap.sh"
    wrap.write_text(f'#!/bin/bash\nexport HY3RL_TEST_RUNTIME=wrapped\n'
                    f'export PATH={rt / "bin"}:$PATH\n'
                    'echo "wrap.sh: runtime marker $HY3RL_TEST_RUNTIME"\nexec "$@"\n')
    for f in (shim, wrap):
        f.chmod(0o755)
    setup.config["train"]["runtime"] = {"prefix": str(wrap), "python": sys.executable}
    res = run_train(setup)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a1 = attempt(setup, 1)
    rt = a1["runtime"]
    assert (rt["prefix"], rt["python"]) == (str(wrap), sys.executable)
    # Named exactly: no image in the prefix, so the runtime's python and its pip freeze,
    # run through the prefix; one Ray on both sides (the head's, published in head.json).
    assert rt["identity"]["kind"] == "interpreter" and rt["identity"]["python"] == sys.executable
    assert len(rt["identity"]["freeze_sha256"]) == 64 and rt["identity"]["freeze"]
    from importlib import metadata

    ray_version = metadata.version("ray")
    assert rt["ray"] == {"client": ray_version, "cluster": ray_version, "match": True,
                         "client_cli": str(Path(sys.executable).with_name("ray")),
                         "cluster_from": "head.json"}
    logs = setup.results / "train" / "attempts" / "attempt-1"
    assert f"ray versions: job client {ray_version}" in (logs / "launcher.log").read_text()
    node_log = "".join(p.read_text() for p in logs.glob("node-*.log"))
    assert "wrap.sh: runtime marker wrapped" in node_log
    assert f"ray CLI {shim}" in node_log
    assert "ray-shim: start --block" in shim_log.read_text()
    assert not leftover("t-local-1")


def test_log_stream_ended_early_and_the_cluster_closed_to_others(train_setup) -> None:
    """Ray's log tail ending while the job runs (the double kills the `ray job submit`
    client at step 3) neither stops nor fails the job: its end comes from Ray's job status,
    the stream is re-attached and driver.log holds every line once. Meanwhile the jobs API
    refuses a request without the launch's token (0600, removed at the teardown)."""
    import urllib.error
    import urllib.request

    setup = train_setup(total=8, save_freq=2, step_s=1.0)
    setup.set_faults(close_log_stream=3)
    out = open(setup.root / "train.log", "w")
    proc = subprocess.Popen(setup.cli(), cwd=setup.root, env=train_env(setup), stdout=out,
                            stderr=subprocess.STDOUT)
    logs = setup.results / "train" / "attempts" / "attempt-1"
    metrics = setup.results / "train" / "attempts" / "attempt-1.metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, (setup.root / "train.log").read_text()[-3000:]
    head = json.loads((logs / "head.json").read_text())
    url = f"http://{head['ip']}:{head['dashboard_port']}/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    assert refused.value.code == 401
    token_file = logs / ".ray-auth-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    req = urllib.request.Request(url, headers={"Authorization":
                                               f"Bearer {token_file.read_text()}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and "t-local-1" in resp.read().decode()
    code = proc.wait(timeout=240)
    out.close()
    log = (setup.root / "train.log").read_text()
    assert code == 0, log[-3000:]
    a1 = attempt(setup, 1)
    assert a1["outcome"] == "succeeded" and a1["end_step"] == 8, a1
    assert "killed 1 log stream client(s)" in (logs / "driver.log").read_text()
    driver = (logs / "driver.log").read_text()
    for step in range(1, 9):
        assert driver.count(f"step:{step} - ") == 1, (step, driver[-3000:])
    assert "re-attached (1) from character" in (logs / "launcher.log").read_text()
    assert not token_file.exists()
    assert a1["timing"]["startup_s"] is not None and a1["timing"]["phase"] == "shutdown"
    # verl's startup lines (the double prints them) each ended its sub-phase, in order
    marks = dict(a1["timing"]["startup_marks"])
    assert marks.pop(POLL_KEY) > 0, marks  # the longest gap between polls: each mark's error
    assert list(marks) == [n for n, _ in STARTUP_MARKS] + [FIRST_LINE_PART], marks
    assert list(marks.values()) == sorted(marks.values()), marks


def test_no_secret_in_rays_files(train_setup) -> None:
    """A planted W&B key and HF token reach the job (the driver and a Ray worker process of
    the job see the key: the sha256 the double prints) through the launch's 0600 file
    (hy3rl.jobenv), never through the runtime env: while the trainer runs, no file under
    Ray's temp dir holds either, nor the jobs API's answer, nor any output; the file is
    removed at the teardown."""
    import hashlib
    import secrets
    import shutil
    import tempfile
    import urllib.request

    key, token = secrets.token_hex(20), "hf_" + secrets.token_hex(16)
    planted = [key.encode(), token.encode()]
    temp_root = Path(tempfile.mkdtemp(prefix="h3s", dir="/tmp"))  # Ray's socket paths: short
    try:
        setup = train_setup(total=4, save_freq=2)
        setup.config["train"]["ray"]["temp_root"] = str(temp_root)
        release = setup.root / "release"
        setup.set_faults(pause_at=2, report_env=1)
        env = {**train_env(setup), "WANDB_API_KEY": key, "HF_TOKEN": token,
               "HY3RL_DOUBLE_RELEASE": str(release)}
        out = open(setup.root / "train.log", "w")
        proc = subprocess.Popen(setup.cli(), cwd=setup.root, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        logs = setup.results / "train" / "attempts" / "attempt-1"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            driver = logs / "driver.log"
            if driver.exists() and "(ray worker)" in driver.read_text():
                break
            time.sleep(0.5)
        assert proc.poll() is None, (setup.root / "train.log").read_text()[-3000:]
        job_env = logs / ".job-env"
        assert job_env.stat().st_mode & 0o777 == 0o600
        assert key in job_env.read_text()

        def holders(root: Path) -> list[str]:
            found = []
            for f in root.rglob("*"):
                if f == job_env or not f.is_file() or f.is_symlink():
                    continue
                try:
                    data = f.read_bytes()
                except OSError:
                    continue
                found += [f"{f}: {p[:6]!r}..." for p in planted if p in data]
            return found

        ray_files = [f for f in temp_root.rglob("*") if f.is_file()]
        assert any("runtime_env" in f.name for f in ray_files), "Ray's agent log not found"
        assert not holders(temp_root), holders(temp_root)
        head = json.loads((logs / "head.json").read_text())
        req = urllib.request.Request(
            f"http://{head['ip']}:{head['dashboard_port']}/api/jobs/",
            headers={"Authorization": f"Bearer {(logs / '.ray-auth-token').read_text()}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer = resp.read()
        assert b"t-local-1" in answer and not any(p in answer for p in planted)
        release.write_text("go")
        code = proc.wait(timeout=240)
        out.close()
        log = (setup.root / "train.log").read_text()
        assert code == 0, log[-3000:]
        digest = hashlib.sha256(key.encode()).hexdigest()
        driver = (logs / "driver.log").read_text()
        assert f"WANDB_API_KEY sha256 {digest} (driver)" in driver, driver[-3000:]
        assert f"WANDB_API_KEY sha256 {digest} (ray worker)" in driver, driver[-3000:]
        assert not job_env.exists()
        assert not holders(setup.root), holders(setup.root)
        assert not leftover("t-local-1")
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)


def test_a_model_load_that_hangs_midway_is_caught_by_the_node_agent(train_setup,
                                                                      tmp_path: Path) -> None:
    """Issue 44: the trainer double loads a real safetensors shard as Megatron-Bridge does
    (its loading bar over the tensors, each read memory-mapped) in a Ray worker of the job,
    and hangs midway while the job's processes go on living. The node agent beside Ray
    (hy3rl.raynode -> hy3rl.loadwatch) saw the load progress and stop; the supervisor ends
    the startup after load_quiet_min without progress on any node, long before the
    sub-phase's limit (none learned: the whole startup's, 270 min)."""
    import numpy as np
    from safetensors.numpy import save_file

    shard = tmp_path / "model-00001-of-00001.safetensors"
    rng = np.random.default_rng(0)
    save_file({f"model.layers.{i}.mlp.experts.weight": rng.standard_normal(
        512 * 1024, dtype=np.float32) for i in range(40)}, str(shard))  # 40 x 2 MiB
    setup = train_setup(total=2, save_freq=2)
    setup.config["train"]["restarts_per_job"] = 0
    setup.config["train"]["watchdog"].update(load_quiet_min=0.25, node_report_s=1)
    setup.set_faults(hang_in_load=20)
    began = time.monotonic()
    proc = subprocess.run(setup.cli(), cwd=setup.root, capture_output=True, text=True,
                          timeout=300, env={**train_env(setup),
                                            "HY3RL_DOUBLE_LOAD_SHARD": str(shard)})
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    a1 = attempt(setup, 1)
    assert a1["outcome"] == "hung" and a1["last_logged_step"] is None, a1
    assert "no model-load progress on any of 1 node(s) for " in a1["exit_reason"], a1
    assert "its limit 0.25 min" in a1["exit_reason"], a1
    (node,) = a1["nodes"]
    timing = a1["timing"]
    assert set(timing["node_quiet_s"]) == {node} and timing["node_quiet_s"][node] >= 15
    assert timing["node_loading"] == [node]
    logs = setup.results / "train" / "attempts" / "attempt-1"
    # the agent's last report (written on through the teardown): the bar stopped at 20 of 40
    report = json.loads((logs / "progress" / f"{node}.json").read_text())
    assert report["bar"] == [20, 40], report
    assert "loaded" not in (logs / "driver.log").read_text()
    # one node: no evidence against it, nothing excluded; a new allocation is asked for
    assert "none excluded" in proc.stderr, proc.stderr[-2000:]
    assert took < 200, took
    assert not leftover("t-local-1")
