"""hy3rl.jobenv and the launcher's runtime env: the job's secrets reach it through a
private file (read by the job's entrypoint and Ray's worker setup hook), never through the
runtime env that Ray logs. (The planted-key grep over a real Ray head's temp dir:
tests/test_train_ray.py::test_no_secret_in_rays_files.)"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import yaml
from hy3rl import jobenv, launch

SCRIPTS = str(Path(jobenv.__file__).resolve().parents[1])


def launcher_for(tmp_path: Path, passthrough: list[str]) -> launch.Launcher:
    base = tmp_path / "runtime_env.yaml"
    base.write_text("working_dir: /deps/verl\nexcludes: ['.git']\nenv_vars:\n"
                    "  CUDA_DEVICE_MAX_CONNECTIONS: '1'\n  SITE_PASSWORD: 'pa ss$word'\n"
                    f"  PYTHONPATH: /deps/{'ab12' * 10}/src\n  LOG_SINK: wandb_v1_{'x' * 20}\n")
    return launch.Launcher(launch.LaunchSpec(
        submission_id="r-1-1", launch_script=tmp_path / "launch.sh", runtime_env=base,
        log_dir=tmp_path / "attempt-1", passthrough_env=passthrough,
        env_vars={"VERL_FILE_LOGGER_PATH": "/results/r/attempt-1.metrics.jsonl",
                  "WANDB_RUN_ID": "r-0123"}))


def test_the_rendered_runtime_env_holds_no_secret(tmp_path: Path, monkeypatch,
                                                  caplog) -> None:
    caplog.set_level(logging.INFO, logger="hy3rl")
    key, token = secrets.token_hex(20), "hf_" + secrets.token_hex(16)
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("WANDB_MODE", "offline")
    launcher = launcher_for(tmp_path, ["WANDB_API_KEY", "HF_TOKEN", "WANDB_MODE"])
    submitted = launcher.merged_runtime_env()
    job_env = tmp_path / "attempt-1" / ".job-env"
    rendered = yaml.safe_load(submitted.read_text())
    assert rendered["env_vars"] == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": f"/deps/{'ab12' * 10}/src",
        "VERL_FILE_LOGGER_PATH":
        "/results/r/attempt-1.metrics.jsonl", "WANDB_RUN_ID": "r-0123",
        "WANDB_MODE": "offline", "HY3RL_JOB_ENV": str(job_env),
        "TTY_COMPATIBLE": "1", "COLUMNS": "400"}  # hy3rl.loadwatch.ENV: the loading bar
    assert rendered["worker_process_setup_hook"] == "hy3rl.jobenv.export"
    assert rendered["working_dir"] == "/deps/verl"
    kept = tmp_path / "attempt-1" / "runtime_env.yaml"
    for text in (submitted.read_text(), kept.read_text(), caplog.text):
        assert key not in text and token not in text and "ss$word" not in text
    assert "secrets ['HF_TOKEN', 'LOG_SINK', 'SITE_PASSWORD', 'WANDB_API_KEY'] through" in \
        caplog.text
    assert job_env.stat().st_mode & 0o777 == 0o600
    assert jobenv.read(job_env) == {"WANDB_API_KEY": key, "HF_TOKEN": token,
                                    "SITE_PASSWORD": "pa ss$word",
                                    "LOG_SINK": f"wandb_v1_{'x' * 20}"}

    # The job's entrypoint (bash sources the file, then execs launch.sh) sees them, run as
    # Ray runs it: `ray job submit -- <args>` joins them (shlex.join), a shell runs that...
    env = {"PATH": os.environ["PATH"], "HY3RL_JOB_ENV": str(job_env)}
    entry = jobenv.entrypoint(["sh", "-c", 'printf "%s|%s" "$WANDB_API_KEY" "$SITE_PASSWORD"'])
    shown = subprocess.run(["sh", "-c", shlex.join(entry)], env=env, capture_output=True,
                           text=True, check=True).stdout
    assert shown == f"{key}|pa ss$word"
    # ... and so does a Ray worker: the hook, resolved the way Ray resolves the name
    hook = subprocess.run(
        [sys.executable, "-c", "import os; from ray._common.utils import load_class; "
         f"load_class({jobenv.HOOK!r})(); print(os.environ['HF_TOKEN'])"],
        env={**env, "PYTHONPATH": SCRIPTS}, capture_output=True, text=True, check=True)
    assert hook.stdout.strip() == token

    launcher.teardown()
    assert not job_env.exists() and not submitted.exists()


def test_without_secrets_no_file_and_no_hook(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    launcher = launcher_for(tmp_path, ["WANDB_API_KEY"])
    (tmp_path / "runtime_env.yaml").write_text("env_vars: {A: '1'}\n")
    rendered = yaml.safe_load(launcher.merged_runtime_env().read_text())
    assert "worker_process_setup_hook" not in rendered and "HY3RL_JOB_ENV" not in \
        rendered["env_vars"]
    assert launcher.job_env is None and not (tmp_path / "attempt-1" / ".job-env").exists()
    launcher.teardown()


def test_a_bad_line_in_the_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / ".job-env"
    path.write_text("export A=1\nrm -rf /\n")
    try:
        jobenv.read(path)
    except ValueError as exc:
        assert str(exc) == f"{path}:2: not an `export NAME=value` line"
    else:
        raise AssertionError("a bad line was read")


def test_a_users_verl_plugins_load_beside_the_launchs_own(tmp_path: Path, monkeypatch) -> None:
    """verl's plugin hook takes a list: the user's modules passed through are added to the
    CPU path's ``hy3rl.verl_cpu``, which stays first; without passthrough the launch's stand."""
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my_plugin, hy3rl.verl_cpu,other")
    launcher = launcher_for(tmp_path, ["VERL_USE_EXTERNAL_MODULES"])
    launcher.spec.env_vars["VERL_USE_EXTERNAL_MODULES"] = "hy3rl.verl_cpu"
    env = yaml.safe_load(launcher.merged_runtime_env().read_text())["env_vars"]
    assert env["VERL_USE_EXTERNAL_MODULES"] == "hy3rl.verl_cpu,my_plugin,other"
    launcher.teardown()
    (tmp_path / "b").mkdir()
    alone = launcher_for(tmp_path / "b", [])
    alone.spec.env_vars["VERL_USE_EXTERNAL_MODULES"] = "hy3rl.verl_cpu"
    env = yaml.safe_load(alone.merged_runtime_env().read_text())["env_vars"]
    assert env["VERL_USE_EXTERNAL_MODULES"] == "hy3rl.verl_cpu"
    alone.teardown()
