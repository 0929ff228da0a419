"""train.notify_command (hy3rl.notify): real attempt records in a run folder, real hook
scripts (one writing its arguments to a file, one failing, one too slow), watchers in
threads and in separate processes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from hy3rl.atomic import write_json_atomic
from hy3rl.layout import Layout
from hy3rl.notify import Watcher, read_notified


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(str(tmp_path / "results"), "r")


def record(layout: Layout, k: int, outcome: str) -> Path:
    """An attempt record with the fields the watcher reads (docs/formats/train.md)."""
    path = Path(layout.attempt_record(k))
    write_json_atomic(path, {
        "attempt": k, "run": layout.run, "executor": "local", "slurm_job_id": None,
        "start_step": 0, "exit_reason": "running" if outcome == "running" else outcome,
        "outcome": outcome, "log_dir": f"attempt-{k}/"})
    return path


def hook(tmp_path: Path, body: str, name: str = "hook.sh") -> Path:
    """An executable shell script; ``$OUT`` in ``body`` is tmp_path/out.txt."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\nOUT={tmp_path / 'out.txt'}\n{body}\n")
    path.chmod(0o755)
    return path


def calls(tmp_path: Path) -> list[str]:
    out = tmp_path / "out.txt"
    return out.read_text().splitlines() if out.exists() else []


def notify_log(layout: Layout) -> str:
    return Path(layout.log("notify")).read_text()


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_each_closed_attempt_is_notified_once_with_its_record_path(tmp_path, layout):
    """The thread notifies a record that closes while it polls; a running one waits; the
    last pass (stop) notifies what closed since. The command is shlex-split, the record's
    absolute path its last argument."""
    script = hook(tmp_path, 'printf "%s|" "$@" >> "$OUT"; echo >> "$OUT"; echo hook says hi')
    watcher = Watcher(f"{script} --tag 'two words'", layout, poll_s=0.1).start()
    assert read_notified(layout) == []  # the first watcher of the run: nothing closed yet
    first = record(layout, 1, "failed")
    record(layout, 2, "running")
    wait_for(lambda: calls(tmp_path))
    time.sleep(0.3)  # a few more polls: attempt 2 still running, attempt 1 not repeated
    assert calls(tmp_path) == [f"--tag|two words|{first.resolve()}|"]
    # No more polls, then attempt 2 closes: only stop()'s last pass can notify it. (Closed
    # before the thread ended, a poll between the record and the stop could notify it.)
    watcher._stop.set()
    watcher._thread.join()
    second = record(layout, 2, "stopped_for_time_limit")
    assert watcher.stop() == [2]
    assert calls(tmp_path)[1] == f"--tag|two words|{second.resolve()}|"
    assert read_notified(layout) == [1, 2]
    log = notify_log(layout)
    assert log.count("hook says hi") == 2 and "exited 0" in log
    assert "two words" not in log  # the hook's arguments are not logged


def test_history_is_not_replayed_and_a_rerun_never_repeats(tmp_path, layout):
    """Records closed before the hook's first watcher are marked, not notified; a later
    controller (a rerun) notifies only attempts that ended since."""
    script = hook(tmp_path, 'echo "$1" >> "$OUT"')
    for k in (1, 2):
        record(layout, k, "time_limit")
    first = Watcher(str(script), layout, poll_s=60).start()
    assert read_notified(layout) == [1, 2]
    assert "attempts [1, 2] ended before" in notify_log(layout)
    third = record(layout, 3, "succeeded")
    assert first.stop() == [3]
    rerun = Watcher(str(script), layout, poll_s=60).start()
    assert rerun.stop() == []
    assert calls(tmp_path) == [str(third.resolve())]


def test_a_failing_hook_is_logged_and_never_raised(tmp_path, layout, caplog):
    script = hook(tmp_path, 'echo "cannot reach the mail server" >&2; exit 3')
    Watcher(str(script), layout, poll_s=60).start()
    record(layout, 1, "hung")
    caplog.set_level(logging.WARNING, logger="hy3rl.notify")
    assert Watcher(str(script), layout).stop() == [1]
    log = notify_log(layout)
    assert "cannot reach the mail server" in log and "exited 3" in log
    assert "attempt 1: " in caplog.text and "exited 3" in caplog.text
    # a program that does not exist, a command that does not split: logged the same way
    record(layout, 2, "failed")
    assert Watcher(str(tmp_path / "no-such-hook"), layout).stop() == [2]
    record(layout, 3, "failed")
    assert Watcher("mail -s 'unbalanced", layout).stop() == [3]
    log = notify_log(layout)
    assert "could not start" in log and "no-such-hook" in log
    assert "cannot be split into arguments" in log


def test_a_slow_hook_is_killed_with_its_children_at_the_timeout(tmp_path, layout):
    script = hook(tmp_path, 'sleep 60 & echo $! > "$OUT"; wait')
    Watcher(str(script), layout).start()
    record(layout, 1, "preempted")
    began = time.monotonic()
    assert Watcher(str(script), layout, timeout_s=1).stop() == [1]
    assert time.monotonic() - began < 10
    assert "timed out after 1 s: killed" in notify_log(layout)
    child = int(calls(tmp_path)[0])
    wait_for(lambda: not psutil.pid_exists(child)
             or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)


def test_two_watchers_in_one_process_never_notify_twice(tmp_path, layout):
    """Watcher A claims every closed record before its (slow) hooks run, so watcher B,
    passing meanwhile, finds nothing left: each record is notified once."""
    script = hook(tmp_path, 'sleep 0.5; echo "$1" >> "$OUT"')
    a = Watcher(str(script), layout, poll_s=60).start()
    for k in (1, 2, 3):
        record(layout, k, "failed")
    passing = threading.Thread(target=a.pass_once)
    passing.start()
    time.sleep(0.2)  # A runs its first hook now
    assert Watcher(str(script), layout).pass_once() == []
    passing.join()
    assert a.stop() == []
    assert sorted(calls(tmp_path)) == sorted(
        str(Path(layout.attempt_record(k)).resolve()) for k in (1, 2, 3))


WATCHER_PROCESS = """
import sys, time
from pathlib import Path
from hy3rl.layout import Layout
from hy3rl.notify import Watcher
layout = Layout(sys.argv[1], "r")
while not Path(sys.argv[3]).exists():
    time.sleep(0.001)
print(Watcher(sys.argv[2], layout).pass_once())
"""


def test_two_controllers_never_notify_twice(tmp_path, layout):
    """Two processes pass at the same moment over 20 closed records: each is notified
    by exactly one of them."""
    script = hook(tmp_path, 'echo "$1" >> "$OUT"')
    write_json_atomic(Path(layout.train_notified), [])
    for k in range(1, 21):
        record(layout, k, "failed")
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WATCHER_PROCESS, layout.results_root,
                               str(script), str(go)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ""})
             for _ in range(2)]
    time.sleep(1.0)  # both imported and waiting
    go.touch()
    claimed = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert sorted(claimed[0] + claimed[1]) == list(range(1, 21))
    assert len(calls(tmp_path)) == 20
    assert read_notified(layout) == list(range(1, 21))
