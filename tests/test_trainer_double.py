"""The trainer double's own behaviour that the train stage's tests rely on
(tests/fixtures/trainer_double.py): measured step and save times, a persistent crash, slow
steps. Run as a plain script (``run_double``), without Ray."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fixtures.trainer_double import run_double
from hy3rl.watchdog import SAVE_LINE


def _lines(work: Path) -> dict[int, dict]:
    return {r["step"]: r["data"] for r in map(json.loads,
                                               (work / "metrics.jsonl").read_text().splitlines())}


def test_step_and_save_times_are_measured(tmp_path: Path):
    """timing_s/step is the step's wall time with its save (verl's marked_timer("step")
    wraps the save); timing_s/save_checkpoint only on save steps, as long as the save took;
    slow_from makes the steps from k on take $HY3RL_DOUBLE_SLOW_S. As each save starts, the
    double logs verl@220e903's v1 line ``Saving checkpoint to <dir>/global_step_<N>``
    through verl's logging (stderr, ``INFO:<time>:``), as the watchdog reads it
    (hy3rl.watchdog.SAVE_LINE), so the slurm tests exercise the save phase."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"slow_from": 3}))
    proc = run_double(tmp_path / "w", total=3, save_freq=2, env={
        "HY3RL_DOUBLE_STEP_S": "0.05", "HY3RL_DOUBLE_SAVE_S": "0.4",
        "HY3RL_DOUBLE_SLOW_S": "0.6", "HY3RL_DOUBLE_FAULTS": str(faults)})
    assert proc.returncode == 0, proc.stderr
    data = _lines(tmp_path / "w")
    assert "timing_s/save_checkpoint" not in data[1]
    assert 0.05 <= data[1]["timing_s/step"] < 0.4
    assert data[2]["timing_s/save_checkpoint"] >= 0.4  # step 2 saves (save_freq)
    assert data[2]["timing_s/step"] >= data[2]["timing_s/save_checkpoint"] + 0.05
    # step 3: slow (0.6 s) and saved (the last step)
    assert data[3]["timing_s/step"] >= 0.6 + data[3]["timing_s/save_checkpoint"]
    assert json.loads(faults.read_text()) == {"slow_from": 3}  # persistent
    saves = [ln for ln in proc.stderr.splitlines() if SAVE_LINE.search(ln)]
    ckpt = tmp_path / "w" / "ckpt"
    assert [re.sub(r"^INFO:.*?:\d\d,\d+:", "", ln) for ln in saves] == [
        f"Saving checkpoint to {ckpt / f'global_step_{s}'}" for s in (2, 3)]
    assert [int(SAVE_LINE.search(ln).group(1)) for ln in saves] == [2, 3]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_crash_always_at_crashes_every_attempt_at_the_same_step(tmp_path: Path):
    """crash_always_at stays in the faults file: each attempt resumes from step 1's save
    and crashes at step 2 with the same error; a one-shot crash_at is gone after firing."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"crash_always_at": 2, "crash_at": 3}))
    env = {"HY3RL_DOUBLE_STEP_S": "0", "HY3RL_DOUBLE_FAULTS": str(faults)}
    errors = []
    for _ in range(2):
        proc = run_double(tmp_path / "w", total=4, save_freq=1, env=env)
        assert proc.returncode != 0
        errors.append(proc.stderr.strip().splitlines()[-1])
    assert errors == ["RuntimeError: main_ppo double: injected crash at step 2"] * 2
    assert json.loads(faults.read_text()) == {"crash_always_at": 2, "crash_at": 3}
    assert (tmp_path / "w" / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"

