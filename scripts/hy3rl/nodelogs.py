"""What one training node keeps for debugging: its Ray logs before teardown, and a
snapshot of its processes when the watchdog declares the attempt hung.

Runs on each node inside the training runtime (``train.runtime``, e.g. an apptainer image),
called by the node wrapper (``hy3rl.raynode``) and by a per-node diagnostics step; so it
imports only the standard library, ``psutil`` and the standard-library-only
``hy3rl.atomic``. Neither function raises: both run while an attempt is being torn down, and
whatever they cannot do is recorded as a reason instead.

:func:`copy_ray_logs` copies ``<temp_dir>/session_latest/logs`` (the ``--temp-dir`` of
``ray start``; without ``session_latest``, the newest ``session_*/logs``) into ``out_dir``
under a byte cap, keeping each cut file's tail, and writes ``copied.json``:
``{"source", "cap_bytes", "bytes", "files", "truncated", "skipped", "left_out"}`` (plus
``"missing"`` when there is no logs dir). ``files`` are paths relative to ``out_dir``;
``skipped`` maps a file to why it could not be copied (vanished, unreadable, a symlink,
not a regular file); ``left_out`` counts the files, and their bytes, that found no room
under the cap (counted, not listed: a node may have thousands of worker logs).

:func:`collect_diagnostics` writes ``ray-stack.txt`` (``ray stack``: py-spy dumps of the
Ray workers on the node), ``driver-stack.txt`` (a py-spy dump of the Ray job's driver, the
trainer's main loop, which ``ray stack`` leaves out; on the node where it runs),
``gpus.txt`` (``nvidia-smi``) and ``processes.txt`` (the processes of the node's Ray scope,
``HY3RL_RAY_SCOPE``) into ``out_dir``, and ``diagnostics.json``: ``{"node", "collected":
[file names], "not_collected": {what: reason}}`` with ``what`` one of ``ray stack``,
``driver``, ``gpus``, ``processes``.

CLI (prints the JSON record, exits 0 whatever it could collect)::

    python -m hy3rl.nodelogs copy --temp-dir T --out DIR --cap-mb X
    python -m hy3rl.nodelogs diagnose --scope S --out DIR --ray-cli RAY [--timeout T]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fnmatch
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from hy3rl.atomic import write_json_atomic, write_text_atomic

SCOPE_VAR = "HY3RL_RAY_SCOPE"  # as hy3rl.raynode sets it on every process of a node's Ray

# --------------------------------------------------------------------------- Ray logs

# Copy order: what explains a node's failure first. A name (the file's own, in any
# subdirectory) takes the first group it matches; unmatched files come last.
PRIORITY = ("raylet.*", "gcs_server.*", "job-driver-*", "worker-*.err", "worker-*.out",
            "python-core-worker-*", "runtime_env*")
SHARE_DIVISOR = 8  # first pass: no file takes more than cap / 8 (see plan_copy)
MIN_SHARE = 64 * 1024
CHUNK = 1 << 20


@dataclass
class LogFile:
    """A regular file found under the logs dir (``rel``: its posix path there)."""

    rel: str
    size: int
    mtime: float


def marker(dropped: int, kept: int) -> bytes:
    """The first line of a copy that keeps only a file's tail."""
    return f"[hy3rl: first {dropped} bytes dropped; kept the last {kept}]\n".encode()


def find_logs_dir(temp_dir: Path) -> tuple[Path | None, str]:
    """``(logs dir, "")`` of a Ray ``--temp-dir``, or ``(None, why not)``.

    ``session_latest`` is Ray's symlink to the current ``session_<date>_<pid>``; it is used
    only when it stays inside ``temp_dir``. Otherwise the newest ``session_*`` (by its
    modification time, then its name, which starts with the date) that has ``logs/``."""
    try:
        root = temp_dir.resolve()
        if not root.is_dir():
            return None, f"{temp_dir} does not exist or is not a directory"
        latest = root / "session_latest"
        if latest.exists():
            logs = latest.resolve() / "logs"
            if logs.parent.parent == root and logs.is_dir() and not logs.is_symlink():
                return logs, ""
        sessions = []
        for entry in os.scandir(root):
            if entry.name.startswith("session_") and entry.name != "session_latest" \
                    and entry.is_dir(follow_symlinks=False):
                logs = Path(entry.path) / "logs"
                if logs.is_dir() and not logs.is_symlink():
                    sessions.append((entry.stat(follow_symlinks=False).st_mtime, entry.name,
                                     logs))
        if sessions:
            return max(sessions)[2], ""
        return None, f"no session_latest/logs or session_*/logs in {temp_dir}"
    except OSError as exc:
        return None, f"{temp_dir}: {exc}"


def scan_logs(logs_dir: Path) -> tuple[list[LogFile], dict[str, str]]:
    """Every regular file under ``logs_dir`` (symlinks are never followed), and the
    entries passed over with the reason (a symlink, a socket, an unreadable folder)."""
    files: list[LogFile] = []
    skipped: dict[str, str] = {}
    stack = [(logs_dir, "")]
    while stack:
        folder, prefix = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as exc:
            skipped[prefix or "."] = f"cannot list: {exc.strerror or exc}"
            continue
        for entry in entries:
            rel = prefix + entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as exc:
                skipped[rel] = f"vanished before it could be read: {exc.strerror or exc}"
                continue
            if stat.S_ISLNK(st.st_mode):
                skipped[rel] = "a symlink (not followed)"
            elif stat.S_ISDIR(st.st_mode):
                stack.append((Path(entry.path), rel + "/"))
            elif stat.S_ISREG(st.st_mode):
                files.append(LogFile(rel, st.st_size, st.st_mtime))
            else:
                skipped[rel] = "not a regular file"
    return files, skipped


def priority(f: LogFile) -> tuple[int, float, str]:
    """Sort key: the PRIORITY group of the file's name, newest first within a group."""
    name = f.rel.rsplit("/", 1)[-1]
    group = next((i for i, pat in enumerate(PRIORITY) if fnmatch.fnmatchcase(name, pat)),
                 len(PRIORITY))
    return group, -f.mtime, f.rel


def plan_copy(files: list[LogFile], cap_bytes: int) -> list[tuple[LogFile, int]]:
    """``[(file, bytes granted)]`` in copy order, the grants adding up to ``cap_bytes`` at
    most; a file granted less than its size is copied as its tail (see :func:`copy_file`).

    Fair in two passes over the files in PRIORITY order: first each file gets up to a share
    (``cap / 8``, at least 64 KiB), so that one huge worker log cannot starve raylet, gcs
    and the job driver behind it; then what is left tops up the cut files, again in
    priority order (a big raylet.out gets room before a big worker log). A file granted no
    more than the marker line's length gets nothing (it counts as left out); so do all
    files, empty ones too, when the cap is 0."""
    if cap_bytes <= 0:
        return []
    order = sorted(files, key=priority)
    share = min(cap_bytes, max(cap_bytes // SHARE_DIVISOR, MIN_SHARE))
    left = cap_bytes
    grant = {}
    for f in order:
        grant[f.rel] = min(f.size, share, left)
        left -= grant[f.rel]
    for f in order:
        extra = min(f.size - grant[f.rel], left)
        grant[f.rel] += extra
        left -= extra
    plan = []
    for f in order:
        g = grant[f.rel]
        if g == f.size or g > len(marker(f.size, f.size)):
            plan.append((f, g))
    return plan


def copy_file(src: Path, dst: Path, size: int, grant: int) -> tuple[int, bool]:
    """Copy ``src`` (``size`` bytes when scanned) into ``dst`` within ``grant`` bytes:
    whole when it fits, else its tail cut at a line start behind a :func:`marker` line.
    Returns (bytes written, cut). Opened without following a symlink put there since the
    scan; bytes appended since the scan are not copied (Ray may still be writing)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError("not a regular file")
        size = min(size, st.st_size)  # rotated or cut since the scan
        dst.parent.mkdir(parents=True, exist_ok=True)
        if grant >= size:
            return _copy_range(fh, dst, 0, size, b""), False
        room = grant - len(marker(size, size))
        start = size - room
        fh.seek(start - 1)
        head = fh.read(min(room + 1, CHUNK))
        if head[:1] != b"\n":  # start inside a line: skip to the next line start
            nl = head.find(b"\n", 1)
            if nl > 0 and start + nl < size:
                start += nl
        kept = size - start
        return _copy_range(fh, dst, start, kept, marker(start, kept)), True


def _copy_range(fh, dst: Path, start: int, length: int, prefix: bytes) -> int:
    """Write ``prefix`` then ``length`` bytes of ``fh`` from ``start`` (fewer if it shrank)."""
    fh.seek(start)
    written = 0
    with open(dst, "wb") as out:
        out.write(prefix)
        written += len(prefix)
        left = length
        while left > 0:
            chunk = fh.read(min(CHUNK, left))
            if not chunk:
                break
            out.write(chunk)
            written += len(chunk)
            left -= len(chunk)
    return written


def copy_planned(logs_dir: Path, out_dir: Path, plan: list[tuple[LogFile, int]],
                 record: dict[str, Any]) -> None:
    """Copy each planned file, adding to ``record``'s files/truncated/skipped/bytes."""
    for f, grant in plan:
        try:
            n, cut = copy_file(logs_dir / f.rel, out_dir / f.rel, f.size, grant)
        except FileNotFoundError:
            record["skipped"][f.rel] = "vanished before it could be read"
            continue
        except OSError as exc:
            record["skipped"][f.rel] = "a symlink (not followed)" if exc.errno == errno.ELOOP \
                else f"cannot be read: {exc.strerror or exc}"
            with contextlib.suppress(OSError):
                (out_dir / f.rel).unlink(missing_ok=True)
            continue
        record["files"].append(f.rel)
        record["bytes"] += n
        if cut:
            record["truncated"].append(f.rel)


def copy_ray_logs(temp_dir: Path, out_dir: Path, cap_bytes: int) -> dict:
    """Copy a node's Ray logs (``<temp_dir>/session_latest/logs``) into ``out_dir``, at most
    ``cap_bytes`` in all (0: none), most telling files first (:data:`PRIORITY`, shared out
    by :func:`plan_copy`), and write ``out_dir/copied.json`` (module docstring), which it
    returns. Call it before the temp dir is removed. Never raises: a missing logs dir is
    recorded as ``missing``, an unexpected failure as ``error``."""
    temp_dir, out_dir, cap_bytes = Path(temp_dir), Path(out_dir), max(0, int(cap_bytes))
    record: dict[str, Any] = {"source": str(temp_dir), "cap_bytes": cap_bytes, "bytes": 0,
                              "files": [], "truncated": [], "skipped": {},
                              "left_out": {"files": 0, "bytes": 0}}
    try:
        logs_dir, why = find_logs_dir(temp_dir)
        if logs_dir is None:
            record["missing"] = why
        else:
            record["source"] = str(logs_dir)
            files, record["skipped"] = scan_logs(logs_dir)
            plan = plan_copy(files, cap_bytes)
            planned = {f.rel for f, _ in plan}
            out = [f for f in files if f.rel not in planned]
            record["left_out"] = {"files": len(out), "bytes": sum(f.size for f in out)}
            out_dir.mkdir(parents=True, exist_ok=True)
            copy_planned(logs_dir, out_dir, plan, record)
    except Exception as exc:  # teardown must go on whatever happened here
        record["error"] = f"{type(exc).__name__}: {exc}"
    try:
        write_json_atomic(out_dir / "copied.json", record)
    except OSError as exc:
        record["error"] = f"cannot write {out_dir / 'copied.json'}: {exc}"
    return record


# --------------------------------------------------------------------------- diagnostics


def scope_processes(scope: str) -> list[psutil.Process]:
    """Processes whose environment carries ``HY3RL_RAY_SCOPE=<scope>``, and their
    descendants: Ray retitles some of its processes (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``) in a way that leaves ``/proc/<pid>/environ`` empty, so only
    their parentage (the raylet) ties them to the scope. This process is left out (the
    commands it runs do not carry the scope: :func:`run_bounded`)."""
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(SCOPE_VAR) == scope:
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    for p in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found.update({c.pid: c for c in p.children(recursive=True) if c.pid != me})
    return sorted(found.values(), key=lambda p: p.pid)


def _elapsed(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def process_table(scope: str, sample_s: float = 0.5) -> str | None:
    """processes.txt: one line a process of the scope (pid, ppid, status, CPU % over
    ``sample_s`` seconds, RSS, start time, elapsed, command line cut at 300 characters);
    None when the scope has no process on this node."""
    procs = scope_processes(scope)
    if not procs:
        return None
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
    time.sleep(sample_s)
    now = time.time()
    lines = [f"# processes with {SCOPE_VAR}={scope} (and their descendants) on "
             f"{node_name()} at {_iso(now)}",
             "pid\tppid\tstatus\tcpu%\trss_mb\tstarted\telapsed\tcmdline"]
    for p in procs:
        try:
            with p.oneshot():
                created = p.create_time()
                # One line: whitespace runs (newlines of `python -c`, the padding of a
                # retitled Ray process) become one space.
                cmd = " ".join(" ".join(p.cmdline()).split()) or p.name()
                lines.append("\t".join([
                    str(p.pid), str(p.ppid()), p.status(), f"{p.cpu_percent(None):.0f}",
                    f"{p.memory_info().rss / 2**20:.0f}", _iso(created),
                    _elapsed(now - created), cmd[:300]]))
        except psutil.Error as exc:
            lines.append(f"{p.pid}\t-\tgone ({type(exc).__name__})")
    return "\n".join(lines) + "\n"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="seconds")


def node_name() -> str:
    """This node as the launcher names it (``HY3RL_NODE``), else the host name."""
    return os.environ.get("HY3RL_NODE") or socket.gethostname()


def run_bounded(cmd: list[str], timeout: float,
                env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own session with output to a temporary file (a pipe would block
    on grandchildren that keep it open) for ``timeout`` seconds at most, then kill its whole
    process group. ``env`` (default: this one) loses ``HY3RL_RAY_SCOPE``: a diagnostic
    command is not one of the scope's processes. Returns (exit code, None if it timed out;
    stdout and stderr together). Raises OSError when it cannot start."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != SCOPE_VAR}
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            code: int | None = proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a finished one too
        if code is None:  # a process stuck in the kernel (a hung GPU) may outlive SIGKILL
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        out.seek(0)
        return code, out.read().decode(errors="replace")


def gpu_report(timeout: float) -> tuple[str | None, str]:
    """gpus.txt: ``nvidia-smi`` and its per-process memory query; (text, "") or
    (None, why not)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, "nvidia-smi not found on this node"
    deadline = time.monotonic() + timeout
    parts, errors = [], []
    for args in ([], ["--query-compute-apps=pid,process_name,used_memory", "--format=csv"]):
        cmd = [smi, *args]
        try:
            code, text = run_bounded(cmd, deadline - time.monotonic())
        except OSError as exc:
            code, text = -1, str(exc)
        if code is None:
            errors.append(f"`{' '.join(cmd)}` timed out after {timeout:g}s")
        elif code != 0:
            errors.append(f"`{' '.join(cmd)}` exited {code}: {_last_line(text)}")
        parts.append(f"$ {' '.join(cmd)}\n{text}" + ("" if code == 0 else
                                                     f"[{errors[-1]}]\n"))
    if len(errors) == 2:
        return None, "; ".join(errors)
    return "\n".join(parts), ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


# Ray's `ray stack` runs `sudo py-spy dump` for each worker: on a compute node a job has no
# (passwordless) sudo, and a refused sudo reports an incident to the site's admins. This
# stand-in runs py-spy as the job's own user, which may read the job's own processes.
SUDO_SHIM = '#!/bin/sh\n[ "$1" = true ] && exit 0\nexec "$@"\n'


def tool_path(cli: str | None) -> str:
    """PATH with the folder of the Ray CLI ``cli`` (when found) first: where Ray's own
    py-spy is installed."""
    path = os.environ.get("PATH", "")
    return os.pathsep.join([str(Path(cli).parent), path]) if cli else path


def ray_stack(ray_cli: str, timeout: float) -> tuple[str | None, str]:
    """ray-stack.txt: ``<ray_cli> stack`` (py-spy dumps of every Ray worker on this node),
    with the :data:`SUDO_SHIM` first on PATH and ``ray_cli``'s folder next (where Ray's own
    py-spy is installed); (text, "") or (None, why not). ``ray stack`` exits 0 whatever
    happened, so success is read from its output."""
    cli = shutil.which(ray_cli)
    if not cli:
        return None, f"{ray_cli!r} not found on this node's PATH"
    with tempfile.TemporaryDirectory(prefix="hy3rl-sudo-") as shim:
        sudo = Path(shim) / "sudo"
        sudo.write_text(SUDO_SHIM)
        sudo.chmod(0o755)
        path = os.pathsep.join([shim, tool_path(cli)])
        try:
            code, text = run_bounded([cli, "stack"], timeout, env={**os.environ, "PATH": path})
        except OSError as exc:
            return None, f"{cli} stack: {exc}"
    if code is None:
        return None, f"{cli} stack timed out after {timeout:g}s"
    if "pip install py-spy" in text:
        return None, f"py-spy not found (next to {cli} nor on PATH): `ray stack` needs it"
    workers = text.count("Stack dump for ")
    if code != 0 and not workers:
        return None, f"{cli} stack exited {code}: {_last_line(text)}"
    if not workers:
        return None, "ray stack found no Ray worker process on this node"
    if "\nThread " not in text:
        return None, f"py-spy could not dump any of {workers} Ray worker(s): " \
                     f"{_last_line(text)}"
    return text, ""


def job_drivers(scope: str) -> list[psutil.Process]:
    """The Ray job's driver on this node: the top-most Python processes below Ray's
    ``ray::JobSupervisor`` actor of the scope (it runs the entrypoint in a shell: ``sh -c``,
    ``bash launch.sh``, which execs ``python3 -m <entrypoint>``). Empty on other nodes."""

    def topmost_python(p: psutil.Process) -> list[psutil.Process]:
        found = []
        with contextlib.suppress(psutil.Error):
            for child in p.children():
                try:
                    is_python = child.name().startswith("python")
                except psutil.Error:
                    continue
                found += [child] if is_python else topmost_python(child)
        return found

    drivers = []
    for p in scope_processes(scope):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::JobSupervisor"):
            drivers += topmost_python(p)
    return drivers


def driver_stack(scope: str, ray_cli: str, timeout: float) -> tuple[str | None, str]:
    """driver-stack.txt: ``py-spy dump`` of each :func:`job_drivers` process (py-spy looked
    up next to ``ray_cli``, then on PATH, as for ``ray stack``), run as the job's user;
    (text, "") or (None, why not)."""
    drivers = job_drivers(scope)
    if not drivers:
        return None, ("no Ray job driver on this node (it runs below Ray's JobSupervisor, "
                      "on the head node)")
    pyspy = shutil.which("py-spy", path=tool_path(shutil.which(ray_cli)))
    if not pyspy:
        return None, f"py-spy not found (next to {ray_cli} nor on PATH)"
    parts, failures = [], []
    for p in drivers:
        try:
            cmd = " ".join(p.cmdline())[:300]
            code, text = run_bounded([pyspy, "dump", "--pid", str(p.pid)], timeout)
        except (psutil.Error, OSError) as exc:
            failures.append(f"pid {p.pid}: {exc}")
            continue
        if code != 0 or "\nThread " not in f"\n{text}":
            failures.append(f"py-spy dump --pid {p.pid} "
                            f"{'timed out' if code is None else f'exited {code}'}: "
                            f"{_last_line(text)}")
            continue
        parts.append(f"Stack dump for the Ray job's driver, pid {p.pid}: {cmd}\n{text}")
    if not parts:
        return None, "; ".join(failures)
    return "\n".join(parts + [f"not dumped: {f}" for f in failures]), ""


def collect_diagnostics(scope: str, out_dir: Path, ray_cli: str, timeout: float = 60) -> dict:
    """Collect ray-stack.txt, driver-stack.txt, gpus.txt and processes.txt for a hung
    attempt into ``out_dir`` while its processes still live, and write ``diagnostics.json``
    (module docstring), which it returns. The four run side by side, each external command
    bounded by ``timeout``, so the whole takes about ``timeout`` seconds at most. Never
    raises: what could not be collected has a reason."""
    out_dir = Path(out_dir)
    record: dict[str, Any] = {"node": node_name(), "collected": [], "not_collected": {}}
    jobs = {"ray stack": ("ray-stack.txt", lambda: ray_stack(ray_cli, timeout)),
            "driver": ("driver-stack.txt", lambda: driver_stack(scope, ray_cli, timeout)),
            "gpus": ("gpus.txt", lambda: gpu_report(timeout)),
            "processes": ("processes.txt", lambda: _processes(scope))}
    results: dict[str, tuple[str | None, str]] = {}

    def run(what: str, fn) -> None:
        try:
            results[what] = fn()
        except Exception as exc:  # a diagnostic must not stop the teardown
            results[what] = None, f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(what, fn), daemon=True)
               for what, (_, fn) in jobs.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 15
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    for what, (name, _) in jobs.items():
        text, why = results.get(what, (None, f"not done within {timeout + 15:g}s"))
        if text is None:
            record["not_collected"][what] = why
            continue
        try:
            write_text_atomic(out_dir / name, text)
            record["collected"].append(name)
        except OSError as exc:
            record["not_collected"][what] = f"cannot write {out_dir / name}: {exc}"
    try:
        write_json_atomic(out_dir / "diagnostics.json", record)
    except OSError as exc:
        record["error"] = f"cannot write {out_dir / 'diagnostics.json'}: {exc}"
    return record


def _processes(scope: str) -> tuple[str | None, str]:
    text = process_table(scope)
    if text is None:
        return None, f"no process on this node carries {SCOPE_VAR}={scope}"
    return text, ""


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m hy3rl.nodelogs copy|diagnose ...``: print the JSON record; exit 0."""
    ap = argparse.ArgumentParser(prog="hy3rl.nodelogs", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser("copy", help="copy this node's Ray logs under a cap")
    cp.add_argument("--temp-dir", required=True, type=Path, help="ray start --temp-dir")
    cp.add_argument("--out", required=True, type=Path)
    cp.add_argument("--cap-mb", required=True, type=float)
    dg = sub.add_parser("diagnose", help="collect ray stack, GPUs and processes of a scope")
    dg.add_argument("--scope", required=True, help=f"the {SCOPE_VAR} value of the node")
    dg.add_argument("--out", required=True, type=Path)
    dg.add_argument("--ray-cli", required=True, help="Ray's CLI on this node's PATH")
    dg.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args(argv)
    if args.cmd == "copy":
        rec = copy_ray_logs(args.temp_dir, args.out, int(args.cap_mb * 2**20))
    else:
        rec = collect_diagnostics(args.scope, args.out, args.ray_cli, args.timeout)
    print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
