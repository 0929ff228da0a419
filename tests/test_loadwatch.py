"""Issue 44: model-load progress read on a node (hy3rl.loadwatch). A real process replays
Megatron-Bridge's load loop at the pin (model_bridge.py ``_with_progress_tracking``: a rich
Progress with its columns, over the tensors of a real safetensors file read memory-mapped,
tensor by tensor), with TTY_COMPATIBLE=1 and its output in a file as a Ray worker's is, and
hangs midway: the node agent sees page faults, the mapped shard and the bar advance, then
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hy3rl import loadwatch as lw
from safetensors.numpy import save_file

LOADER = textwrap.dedent("""
    import sys, threading, time
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from safetensors import safe_open

    path, hang_after, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with safe_open(path, framework="numpy") as f:
        names = sorted(f.keys())
        # Megatron-Bridge@df0852c, model_bridge.py _with_progress_tracking
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                      TextColumn("[progress.percentage]{task.percentage:>3.0f}%"),
                      TimeRemainingColumn(), TextColumn("({task.completed}/{task.total})"),
                      TextColumn("{task.fields[bridge]}")) as progress:
            task = progress.add_task(f"Loading from /models/hy3", total=len(names),
                                     bridge="HYV3Bridge")
            for i, name in enumerate(names):
                if i == hang_after:
                    open(marker, "w").close()  # (rich's Live redirects stderr too)
                    threading.Event().wait()  # a collective that never returns
                float(f.get_tensor(name).sum())
                progress.update(task, advance=1)
                time.sleep(0.1)
""")


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "model-00001-of-00002.safetensors"
    save_file({f"model.layers.{i}.mlp.weight": rng.standard_normal(512 * 1024,
                                                                    dtype=np.float32)
               for i in range(40)}, str(path))  # 40 tensors of 2 MiB
    return path


def test_a_load_that_hangs_midway_stops_progressing(tmp_path: Path, shard: Path) -> None:
    out = tmp_path / "worker-01-02.out"
    err = tmp_path / "worker-01-02.err"
    env = {**os.environ, **lw.ENV}
    with open(out, "wb") as o, open(err, "wb") as e:
        child = subprocess.Popen([sys.executable, "-c", LOADER, str(shard), "20",
                                  str(tmp_path / "hung")], stdout=o, stderr=e, env=env)
    try:
        watch = lw.LoadWatch("n1", lambda: [child.pid], lambda: [out, err])
        reports = [watch.sample()]
        loading = []
        deadline = time.monotonic() + 120
        while not (tmp_path / "hung").exists():
            assert child.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "the loader never reached its hang"
            time.sleep(0.5)
            reports.append(watch.sample())
            loading.append(reports[-1]["last_progress"] == reports[-1]["t"])
        # progress seen while it loads (a sample may straddle the hang, and on a loaded
        # machine the loader may not run between two samples: not every one)
        assert sum(loading) >= 2, reports
        why = " ".join(r["why"] for r in reports)
        assert "page faults a minute" in why and "loading bar" in why, why
        assert any(r["shards"] == [shard.name] for r in reports), reports
        time.sleep(0.6)
        watch.sample()  # the tensors and the bar drawn up to the hang
        hung = []
        for _ in range(4):
            time.sleep(0.5)
            hung.append(watch.sample())
        assert all(r["last_progress"] == hung[0]["last_progress"] for r in hung), hung
        assert hung[-1]["t"] - hung[-1]["last_progress"] >= 1.5, hung
        assert hung[-1]["bar"] == [20, 40] and hung[-1]["faults_per_min"] < lw.FAULTS_PER_MIN
        # the report as the supervisor reads it: one file a node, replaced whole
        report = watch.write(tmp_path / "progress" / "n1.json")
        assert lw.read_reports(tmp_path / "progress") == {"n1": report}
        assert json.loads((tmp_path / "progress" / "n1.json").read_text())["node"] == "n1"
    finally:
        child.kill()
        child.wait()
    gone = watch.sample()  # the process is gone: nothing read, nothing raised
    assert gone["processes"] == 0 and gone["last_progress"] == hung[-1]["last_progress"]


def test_the_bar_is_read_from_the_newest_redraw(tmp_path: Path) -> None:
    a, b = tmp_path / "worker-a.out", tmp_path / "worker-b.out"
    a.write_text("\r\x1b[2KLoading from /m \x1b[38m━━━\x1b[0m  10% 0:01:00 (4/40) HYV3Bridge"
                 "\r\x1b[2KLoading from /m ━━━━━  12% 0:00:59 (5/40) HYV3Bridge")
    b.write_text("(pid=1) some other line\n")
    assert lw.last_bar([a, b]) == ("/m", 5, 40)
    assert lw.last_bar([b]) is None and lw.last_bar([tmp_path / "missing"]) is None


def test_reports_that_are_not_reports_are_left_out(tmp_path: Path) -> None:
    d = tmp_path / "progress"
    d.mkdir()
    (d / "n1.json").write_text('{"node": "n1", "t": 10, "last_progress": 5}')
    (d / "n2.json").write_text("{half")
    (d / "n3.json").write_text('{"node": "n3", "t": "x", "last_progress": 5}')
    assert list(lw.read_reports(d)) == ["n1"]
    assert lw.read_reports(tmp_path / "none") == {}
