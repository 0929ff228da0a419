"""One W&B run per training run (hy3rl.wandb_run): the id from run.name and the trajectory id
alone (hy3rl.identity), the Ray job's variables, the run URL in the trainer's output, and
the trainer double calling ``wandb.init`` as verl@220e903 does, with the real wandb package
offline: two attempts, one run id."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fixtures.common import make_config
from fixtures.trainer_double import run_double
from hy3rl import wandb_run


def _raw(**sections) -> dict:
    return make_config(**sections).raw


# ---- the id ----


def test_run_id_is_readable_valid_and_bounded():
    h = "0123456789abcdef" * 4
    assert wandb_run.run_id("hy3-grpo-paper", h) == "hy3-grpo-paper-01234567"
    assert wandb_run.run_id("my run/v2:try", h) == "my-run-v2-try-01234567"
    assert wandb_run.run_id("...", h) == "run-01234567"
    long = wandb_run.run_id("x" * 200, h)
    assert len(long) == 64 and long.endswith("-01234567")
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", wandb_run.run_id("ä b_c", h))
    with pytest.raises(ValueError, match="not a hex digest"):
        wandb_run.run_id("r", "xyz")


def test_env_only_when_wandb_is_a_logger():
    h = "89abcdef" * 8  # a trajectory id (plan.json identity.trajectory.id)
    assert wandb_run.env("r", h, ["console", "file"]) == {}
    assert wandb_run.env("r", h, ["console", "wandb", "file"]) == {
        "WANDB_RUN_ID": f"r-{h[:8]}", "WANDB_RESUME": "allow"}


# ---- the URL in the trainer's output, the record ----


def _wandb_printed(run_name: str, url: str) -> str:
    """What wandb 0.31 prints for an online run, through its own printer (header and
    footer; sdk/wandb_run.py)."""
    from wandb.sdk.lib import printer

    p = printer.new_printer()
    return (f"wandb: {p.emoji('rocket')} View run at {p.link(url)}\n"
            f"(TaskRunner pid=77) wandb: {p.emoji('rocket')} View run {p.name(run_name)} "
            f"at: {p.link(url)}\n"
            f"wandb: {p.emoji('star')} View project at: {p.link(url.rsplit('/runs/')[0])}\n")


def test_url_from_log_finds_the_run_page():
    url = "https://wandb.ai/lab/hy3rl/runs/hy3-grpo-paper-01234567"
    text = "step:1 - critic/rewards/mean:0.4\n" + _wandb_printed("double", url)
    assert wandb_run.url_from_log(text) == url
    coloured = f"wandb: View run \x1b[33mdouble\x1b[0m at: \x1b[34m\x1b[4m{url}\x1b[0m\n"
    assert wandb_run.url_from_log(coloured) == url
    assert wandb_run.url_from_log("wandb: View project at: https://wandb.ai/lab/hy3rl") is None
    assert wandb_run.url_from_log("wandb: You can sync this run to the cloud by running:\n"
                                  "wandb: wandb sync /x/wandb/offline-run-1-r") is None


def test_record_of_an_attempt():
    env = wandb_run.env("r", "ab" * 32, ["wandb"])
    url = "https://wandb.ai/lab/p/runs/r-abababab"
    assert wandb_run.record(env, "p", f"wandb: View run x at: {url}") == {
        "run_id": "r-abababab", "project": "p", "url": url}
    assert wandb_run.record(env, None, "offline") == {
        "run_id": "r-abababab", "project": None, "url": None}
    assert wandb_run.record({}, "p", "") is None


# ---- the trainer double with the real wandb, offline ----


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """Offline W&B, its settings and caches inside the test's folder; the double fast."""
    return {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path / "wb-config"),
            "WANDB_CACHE_DIR": str(tmp_path / "wb-cache"),
            "WANDB_DATA_DIR": str(tmp_path / "wb-data"), "HY3RL_DOUBLE_STEP_S": "0"}


def _run_ids(work: Path) -> list[str]:
    """The ids of the offline runs under ``work/wandb`` (``offline-run-<time>-<id>``, each
    with its ``run-<id>.wandb``), oldest first."""
    ids = []
    for d in sorted((work / "wandb").glob("offline-run-*")):
        run = re.fullmatch(r"offline-run-\d{8}_\d{6}-(.+)", d.name).group(1)
        assert (d / f"run-{run}.wandb").is_file(), d
        ids.append(run)
    return ids


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_two_attempts_of_the_double_log_into_one_wandb_run(tmp_path: Path):
    """Attempt 1 saves step 1 and crashes at step 2; attempt 2 resumes from step 1 and
    finishes. Both get env()'s variables, as the Ray job does: one W&B run id."""
    work = tmp_path / "verl"
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"crash_at": 2}))
    job_env = wandb_run.env("hy3 test", "0123abcd" * 8, ["console", "wandb"])
    env = {**_offline_env(tmp_path), **job_env, "HY3RL_DOUBLE_FAULTS": str(faults)}
    loggers = "['console','wandb','file']"

    first = run_double(work, total=3, save_freq=1, loggers=loggers, env=env)
    assert first.returncode != 0 and "injected crash at step 2" in first.stderr
    second = run_double(work, total=3, save_freq=1, loggers=loggers, env=env)
    assert second.returncode == 0, second.stderr
    assert "Resuming from" in second.stdout

    assert job_env["WANDB_RUN_ID"].startswith("hy3-test-")
    assert _run_ids(work) == [job_env["WANDB_RUN_ID"]] * 2
    steps = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # attempt 2's file log (val at the resumed step, then 2, 3)


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_without_the_variables_each_attempt_is_a_new_wandb_run(tmp_path: Path):
    """verl's wandb.init alone (no WANDB_RUN_ID): every attempt opens a run of its own."""
    work = tmp_path / "verl"
    for _ in range(2):
        proc = run_double(work, total=1, save_freq=-1, loggers="['console','wandb']",
                          env=_offline_env(tmp_path))
        assert proc.returncode == 0, proc.stderr
    ids = _run_ids(work)
    assert len(ids) == 2 and ids[0] != ids[1]
