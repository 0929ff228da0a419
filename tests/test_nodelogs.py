"""hy3rl.nodelogs on real files and real processes: a node's Ray logs copied under a cap
(tails kept, priority, symlinks never followed, unreadable and vanishing files skipped with a
reason) and the diagnostics of a hung attempt (the scope's processes, nvidia-smi, ray
stack), once against a real Ray on this machine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hy3rl import nodelogs
from hy3rl.nodelogs import SCOPE_VAR, collect_diagnostics, copy_ray_logs

SESSION = "session_2026-12-03_12-40-36_628360_3315"
MARK = re.compile(rb"\A\[hy3rl: first (\d+) bytes dropped; kept the last (\d+)\]\n")


def ray_temp(root: Path, files: dict[str, bytes], session: str = SESSION) -> Path:
    """A Ray --temp-dir as Ray lays it out: session_<date>_<pid>/logs/... and an absolute
    session_latest symlink to that session."""
    logs = root / session / "logs"
    for rel, data in files.items():
        (logs / rel).parent.mkdir(parents=True, exist_ok=True)
        (logs / rel).write_bytes(data)
    latest = root / "session_latest"
    latest.unlink(missing_ok=True)
    latest.symlink_to(root / session)
    return logs


def lines(n: int, tag: str = "line") -> bytes:
    return b"".join(f"{tag} {i:06d} some log text\n".encode() for i in range(n))


def copied(out: Path) -> dict:
    return json.loads((out / "copied.json").read_text())


def unmarked(data: bytes) -> tuple[int, int, bytes]:
    m = MARK.match(data)
    assert m, data[:120]
    return int(m.group(1)), int(m.group(2)), data[m.end():]


# --------------------------------------------------------------------------- copy_ray_logs


def test_tail_kept_behind_a_marker_line(tmp_path: Path) -> None:
    original = lines(2000)
    logs = ray_temp(tmp_path / "ray", {"raylet.out": original, "raylet.err": b""})
    out = tmp_path / "out"
    rec = copy_ray_logs(tmp_path / "ray", out, 10_000)

    assert rec == copied(out)
    assert rec["source"] == str(logs.resolve())
    assert sorted(rec["files"]) == ["raylet.err", "raylet.out"]
    assert rec["truncated"] == ["raylet.out"] and rec["skipped"] == {}
    data = (out / "raylet.out").read_bytes()
    dropped, kept, body = unmarked(data)
    assert dropped + kept == len(original) and kept == len(body)
    assert body == original[dropped:] and original[dropped - 1:dropped] == b"\n"
    assert body.endswith(b"line 001999 some log text\n")
    assert rec["bytes"] == len(data) <= 10_000
    assert len(data) > 10_000 - 2 * len(b"line 001999 some log text\n") - 60
    assert (out / "raylet.err").read_bytes() == b""


def test_raylet_and_gcs_kept_whole_when_worker_logs_are_huge(tmp_path: Path) -> None:
    files = {"raylet.out": lines(8000, "raylet"), "gcs_server.out": lines(6000, "gcs"),
             "job-driver-raysubmit_1.log": lines(100, "driver"),
             "worker-aa-01000000-11.err": lines(200_000, "err"),
             "worker-bb-01000000-12.out": lines(200_000, "out"),
             "python-core-worker-aa_11.log": lines(50_000, "core"),
             "dashboard.log": lines(3000, "dash"), "events/event_RAYLET.log": b""}
    ray_temp(tmp_path / "ray", files)
    cap = 1 << 20
    rec = copy_ray_logs(tmp_path / "ray", tmp_path / "out", cap)

    for name in ("raylet.out", "gcs_server.out", "job-driver-raysubmit_1.log", "dashboard.log",
                 "events/event_RAYLET.log"):
        assert (tmp_path / "out" / name).read_bytes() == files[name], name
    assert sorted(rec["truncated"]) == ["python-core-worker-aa_11.log",
                                        "worker-aa-01000000-11.err",
                                        "worker-bb-01000000-12.out"]
    sizes = {n: (tmp_path / "out" / n).stat().st_size for n in rec["files"]}
    assert rec["bytes"] == sum(sizes.values()) <= cap
    assert sizes["worker-aa-01000000-11.err"] > sizes["worker-bb-01000000-12.out"]
    assert rec["left_out"] == {"files": 0, "bytes": 0}


def test_scarce_room_goes_by_priority_then_newest(tmp_path: Path) -> None:
    files = {"gcs_server.out": lines(1000, "gcs"), "raylet.out": lines(1000, "raylet"),
             "worker-old-01000000-1.err": lines(5000, "old"),
             "worker-new-01000000-2.err": lines(5000, "new"),
             "monitor.log": lines(5000, "monitor")}
    logs = ray_temp(tmp_path / "ray", files)
    os.utime(logs / "worker-old-01000000-1.err", (1e9, 1e9))
    cap = 2 * len(lines(1000, "raylet")) + 30_000
    rec = copy_ray_logs(tmp_path / "ray", tmp_path / "out", cap)

    assert rec["files"] == ["raylet.out", "gcs_server.out", "worker-new-01000000-2.err"]
    assert rec["truncated"] == ["worker-new-01000000-2.err"]
    assert rec["left_out"] == {"files": 2, "bytes": len(files["worker-old-01000000-1.err"]) +
                               len(files["monitor.log"])}
    assert rec["bytes"] <= cap
    assert not (tmp_path / "out" / "monitor.log").exists()


def test_cap_zero_copies_nothing(tmp_path: Path) -> None:
    ray_temp(tmp_path / "ray", {"raylet.out": lines(10), "raylet.err": b""})
    rec = copy_ray_logs(tmp_path / "ray", tmp_path / "out", 0)
    assert (rec["files"], rec["bytes"], rec["cap_bytes"]) == ([], 0, 0)
    assert rec["left_out"] == {"files": 2, "bytes": len(lines(10))}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["copied.json"]
    assert copied(tmp_path / "out") == rec


def test_missing_logs_dir_is_recorded_not_raised(tmp_path: Path) -> None:
    rec = copy_ray_logs(tmp_path / "gone", tmp_path / "out1", 1000)
    assert rec["files"] == [] and f"{tmp_path / 'gone'} does not exist" in rec["missing"]
    assert copied(tmp_path / "out1") == rec

    (tmp_path / "empty" / "session_x").mkdir(parents=True)  # a session without logs/
    rec = copy_ray_logs(tmp_path / "empty", tmp_path / "out2", 1000)
    assert rec["missing"] == f"no session_latest/logs or session_*/logs in {tmp_path / 'empty'}"

    # The CLI, as the node step runs it: the same record on stdout, exit 0.
    proc = subprocess.run([sys.executable, "-m", "hy3rl.nodelogs", "copy", "--temp-dir",
                           str(tmp_path / "gone"), "--out", str(tmp_path / "out3"),
                           "--cap-mb", "0.5"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == copied(tmp_path / "out3")
    assert json.loads(proc.stdout)["cap_bytes"] == 512 * 1024


def test_session_latest_symlink_and_newest_session(tmp_path: Path) -> None:
    root = tmp_path / "ray"
    ray_temp(root, {"raylet.out": b"new session\n"}, "session_2026-12-03_10-00-00_1_2")
    old = ray_temp(root, {"raylet.out": b"old session\n"}, "session_2026-12-02_10-00-00_1_1")
    os.utime(old.parent, (1e9, 1e9))
    # session_latest names the session Ray says is current, even an older one.
    rec = copy_ray_logs(root, tmp_path / "a", 1000)
    assert rec["source"] == str(old.resolve())
    assert (tmp_path / "a" / "raylet.out").read_bytes() == b"old session\n"

    (root / "session_latest").unlink()  # none: the newest session_*
    rec = copy_ray_logs(root, tmp_path / "b", 1000)
    assert (tmp_path / "b" / "raylet.out").read_bytes() == b"new session\n", rec

    elsewhere = ray_temp(tmp_path / "other", {"raylet.out": b"not ours\n"})
    (root / "session_latest").symlink_to(elsewhere.parent)  # out of the temp dir: ignored
    rec = copy_ray_logs(root, tmp_path / "c", 1000)
    assert (tmp_path / "c" / "raylet.out").read_bytes() == b"new session\n", rec


def test_symlinks_and_special_files_are_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the logs dir\n")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "raylet.out").write_text("outside too\n")
    logs = ray_temp(tmp_path / "ray", {"raylet.out": b"ok\n"})
    (logs / "worker-x-01000000-1.err").symlink_to(secret)
    (logs / "old").symlink_to(tmp_path / "outdir")
    os.mkfifo(logs / "runtime_env_agent.out")
    rec = copy_ray_logs(tmp_path / "ray", tmp_path / "out", 10_000)

    assert rec["files"] == ["raylet.out"]
    assert rec["skipped"] == {"worker-x-01000000-1.err": "a symlink (not followed)",
                              "old": "a symlink (not followed)",
                              "runtime_env_agent.out": "not a regular file"}
    names = {p.relative_to(tmp_path / "out").as_posix()
             for p in (tmp_path / "out").rglob("*")}
    assert names == {"raylet.out", "copied.json"}


def _as_nobody(fn) -> None:
    """Run ``fn`` in a child process as uid/gid 65534 when this is root (root reads any
    file), else here; the child only uses modules already imported."""
    if os.geteuid() != 0:
        fn()
        return
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_unreadable_file_is_skipped_with_reason() -> None:
    base = Path(tempfile.mkdtemp(prefix="hy3rl-nodelogs-"))  # outside root's 0700 tmp
    try:
        base.chmod(0o755)
        logs = ray_temp(base / "ray", {"raylet.out": lines(5), "gcs_server.out": b"x\n"})
        for d in (logs, logs.parent, base / "ray"):
            d.chmod(0o755)
        (logs / "gcs_server.out").chmod(0)
        out = base / "out"
        out.mkdir(mode=0o777)
        out.chmod(0o777)
        _as_nobody(lambda: copy_ray_logs(base / "ray", out, 10_000))
        rec = copied(out)
        assert rec["files"] == ["raylet.out"]
        assert rec["skipped"] == {"gcs_server.out": "cannot be read: Permission denied"}
        assert not (out / "gcs_server.out").exists()
    finally:
        shutil.rmtree(base)


def test_file_vanishing_or_relinked_after_the_scan_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("not a log\n")
    logs = ray_temp(tmp_path / "ray", {"raylet.out": lines(5), "worker-a-01-1.out": b"a\n",
                                       "worker-b-01-2.out": b"b\n"})
    files, skipped = nodelogs.scan_logs(logs)
    plan = nodelogs.plan_copy(files, 10_000)
    (logs / "worker-a-01-1.out").unlink()  # a worker's log removed while we copy
    (logs / "worker-b-01-2.out").unlink()  # ... or replaced by a symlink
    (logs / "worker-b-01-2.out").symlink_to(tmp_path / "secret")
    rec = {"files": [], "truncated": [], "skipped": skipped, "bytes": 0}
    nodelogs.copy_planned(logs, tmp_path / "out", plan, rec)
    assert rec["files"] == ["raylet.out"]
    assert rec["skipped"] == {"worker-a-01-1.out": "vanished before it could be read",
                              "worker-b-01-2.out": "a symlink (not followed)"}
    assert not (tmp_path / "out" / "worker-b-01-2.out").exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_thousands_of_files_are_quick(tmp_path: Path) -> None:
    files = {f"worker-{i:040x}-01000000-{i}.out": lines(20, f"w{i}") for i in range(3000)}
    files["raylet.out"] = lines(100_000)
    ray_temp(tmp_path / "ray", files)
    t0 = time.monotonic()
    rec = copy_ray_logs(tmp_path / "ray", tmp_path / "out", 1 << 20)
    took = time.monotonic() - t0
    assert took < 10, took
    assert rec["files"][0] == "raylet.out" and rec["bytes"] <= 1 << 20
    assert rec["left_out"]["files"] > 0 and len(rec["files"]) + rec["left_out"]["files"] == 3001


# --------------------------------------------------------------------------- diagnostics


def _start(scope: str, *cmd: str) -> subprocess.Popen:
    return subprocess.Popen(list(cmd), env={**os.environ, SCOPE_VAR: scope},
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        os.killpg(p.pid, 9)
        p.wait(10)


def _child_running(pid: int, cmdline: list[str]) -> int:
    """The pid of ``pid``'s child once it runs ``cmdline`` (after bash's fork and exec)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for c in nodelogs.psutil.Process(pid).children():
            with contextlib.suppress(nodelogs.psutil.Error):
                if c.cmdline() == cmdline:
                    return c.pid
        time.sleep(0.05)
    raise AssertionError(f"no child of {pid} runs {cmdline}")


def test_processes_of_the_scope_only(tmp_path: Path, monkeypatch) -> None:
    scope = f"t-nodelogs-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("HY3RL_NODE", "node-a")
    ours = _start(scope, "bash", "-c", "env -u HY3RL_RAY_SCOPE sleep 61 &\n\twait")
    other = _start(scope + "-other", "sleep", "62")
    try:
        child = _child_running(ours.pid, ["sleep", "61"])  # no scope: the retitled-Ray case
        rec = collect_diagnostics(scope, tmp_path / "hang", "/nonexistent/ray", timeout=10)
    finally:
        _stop(ours, other)

    assert rec == json.loads((tmp_path / "hang" / "diagnostics.json").read_text())
    assert rec["node"] == "node-a" and "processes.txt" in rec["collected"]
    assert rec["not_collected"]["ray stack"] == "'/nonexistent/ray' not found on this node's PATH"
    assert not (tmp_path / "hang" / "ray-stack.txt").exists()
    rows = (tmp_path / "hang" / "processes.txt").read_text().splitlines()
    assert rows[0].startswith(f"# processes with {SCOPE_VAR}={scope} (and their descendants)")
    assert len(rows) == 4 and all(len(r.split("\t")) == 8 for r in rows[1:]), rows
    pids = {int(r.split("\t")[0]) for r in rows[2:]}
    assert pids == {ours.pid, child}, rows
    row = next(r for r in rows[2:] if r.startswith(f"{ours.pid}\t"))
    assert row.endswith("\tbash -c env -u HY3RL_RAY_SCOPE sleep 61 & wait"), rows
    row = next(r.split("\t") for r in rows[2:] if r.startswith(f"{child}\t"))
    assert row[1] == str(ours.pid) and row[7] == "sleep 61"
    assert re.fullmatch(r"\d+:\d\d:\d\d", row[6]) and row[5].endswith("+00:00")


def test_no_process_no_nvidia_smi(tmp_path: Path, monkeypatch) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    rec = collect_diagnostics("t-nodelogs-nobody", tmp_path / "hang", "ray", timeout=10)
    assert rec["collected"] == []
    assert rec["not_collected"] == {
        "ray stack": "'ray' not found on this node's PATH",
        "driver": "no Ray job driver on this node (it runs below Ray's JobSupervisor, on the "
                  "head node)",
        "gpus": "nvidia-smi not found on this node",
        "processes": f"no process on this node carries {SCOPE_VAR}=t-nodelogs-nobody"}
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == ["diagnostics.json"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="not run: no nvidia-smi here")
def test_gpus_listed_where_nvidia_smi_runs(tmp_path: Path) -> None:
    rec = collect_diagnostics("t-nodelogs-gpus", tmp_path / "hang", "ray", timeout=30)
    assert "gpus.txt" in rec["collected"], rec
    text = (tmp_path / "hang" / "gpus.txt").read_text()
    assert "NVIDIA-SMI" in text and "\npid, process_name, used_gpu_memory [MiB]\n" in text


def test_commands_are_bounded_with_their_children(tmp_path: Path) -> None:
    marker = f"hy3rl-nodelogs-{time.time_ns()}"
    t0 = time.monotonic()
    code, out = nodelogs.run_bounded(
        ["bash", "-c", f"echo started; exec -a {marker} sleep 30 & sleep 30"], 1.0)
    assert code is None and "started" in out and time.monotonic() - t0 < 8
    time.sleep(0.2)
    left = [p.pid for p in nodelogs.psutil.process_iter(["cmdline"])
            if marker in " ".join(p.info["cmdline"] or [])]
    assert left == []


# --------------------------------------------------------------------------- a real Ray

DRIVER = """
import sys, time, ray
ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1])

@ray.remote
class Sleeper:
    def hello(self):
        print("sleeper says hi", flush=True)
        return 1

s = Sleeper.remote()
ray.get(s.hello.remote())
open(sys.argv[2], "w").write("ready")
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.ray
def test_real_ray_stack_processes_and_logs(tmp_path: Path) -> None:
    """A local Ray (ray.init in a subprocess: OS-chosen ports, workers below train.ray's
    port_base; RAY_AUTH_MODE=disabled, so no token lands in ~/.ray) in a scope of its own,
    which is all this test stops."""
    scope = f"t-nodelogs-ray-{os.getpid()}-{time.time_ns()}"
    temp = Path(tempfile.mkdtemp(prefix="hy3rl-nl-", dir="/tmp"))  # Ray's socket paths
    ready, log = tmp_path / "ready", tmp_path / "driver.log"
    env = {**os.environ, SCOPE_VAR: scope, "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "wb") as fh:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(temp), str(ready)],
                                  env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ready.exists(), log.read_text()[-3000:]
        ray_cli = str(Path(sys.executable).with_name("ray"))
        diag = collect_diagnostics(scope, tmp_path / "hang", ray_cli, timeout=90)
        rec = copy_ray_logs(temp, tmp_path / "nodes" / "n1", 2 << 20)
    finally:
        procs = nodelogs.scope_processes(scope)
        for p in procs:
            p.kill()
        nodelogs.psutil.wait_procs(procs, timeout=10)
        driver.wait(10)
        shutil.rmtree(temp, ignore_errors=True)
    assert not nodelogs.scope_processes(scope)

    assert {"ray-stack.txt", "processes.txt"} <= set(diag["collected"]), diag
    stack = (tmp_path / "hang" / "ray-stack.txt").read_text()
    assert re.search(r"Stack dump for .*ray::Sleeper", stack), stack[:2000]
    assert "\nThread " in stack and "sudo: not found" not in stack
    table = (tmp_path / "hang" / "processes.txt").read_text()
    for name in ("raylet", "gcs_server", "ray::Sleeper", "ray::DashboardAgent"):
        assert name in table, table
    assert f"\n{driver.pid}\t" in table

    assert rec["source"].startswith(str(temp.resolve())) and rec["bytes"] <= 2 << 20
    out = tmp_path / "nodes" / "n1"
    for name in ("raylet.out", "gcs_server.out", "copied.json"):
        assert (out / name).is_file(), rec
    assert rec["files"][:2] == ["raylet.out", "raylet.err"] or \
        rec["files"][:2] == ["raylet.err", "raylet.out"], rec["files"]
    assert any("sleeper says hi" in (out / n).read_text() for n in rec["files"]
               if n.startswith("worker-") and n.endswith(".out")), rec["files"]
