"""A real SLURM cluster on this machine, for the tests: munge, slurmctld and five logical
compute nodes (``slurmd -N n1`` ... ``slurmd -N n5``), each with 2 fake GPUs declared
through gres (character devices made with ``mknod``), no accounting. The nodes form
partitions, one per lane of the suite (:data:`PARTITIONS`): two of two nodes for the
SLURM lanes, one of one node for the real trainer's scope; the pytest workers run their
SLURM tests at the same time, each lane's jobs on its own nodes, so that none queues
behind another.

Everything but ``/etc/slurm/{slurm.conf,gres.conf}`` lives in a temporary state
directory; the SLURM clients find the configuration at its default path (jobs run with
``SLURM_*`` scrubbed, so ``SLURM_CONF`` cannot be used). Files already in ``/etc/slurm``
are backed up and restored when the cluster stops.

Several pytest sessions (several people on one machine) may use the cluster at once:
the first one starts it, later ones join it, and the last one out stops every daemon by
its pid and restores ``/etc/slurm`` (``session()`` below). A cluster started from the
command line (``start``) is persistent: sessions join it and leave it running until
``stop``.

    python tests/slurm_cluster.py start|stop|status
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

CONF_DIR = Path(os.environ.get("HY3RL_SLURM_CONF_DIR", "/etc/slurm"))
# Files this module writes into CONF_DIR (and backs up first). cgroup.conf is only
# backed up and moved aside: the cluster runs without cgroups (proctrack/linuxproc).
CONF_FILES = ("slurm.conf", "gres.conf", "cgroup.conf")
LOCK_DIR = Path(os.environ.get("HY3RL_SLURM_LOCK_DIR", "/tmp"))
START_LOCK = LOCK_DIR / "hy3rl-slurm.lock"  # held while starting or stopping
USERS_LOCK = LOCK_DIR / "hy3rl-slurm.users"  # shared by every session using the cluster
MARKER = "# hy3rl-test-cluster state="
STATE_ENV = "HY3RL_SLURM_STATE"  # set in every daemon's environment (see _alive)

PARTITION = "hy3rl"  # the default partition (lane "slurm")
ACCOUNT = "hy3rl-test"
# One partition of two nodes per lane of SLURM tests (tests/conftest.py, cluster_scope):
# lane "slurm" submits to the default partition, lane "slurm-b" to the second one; the
# real trainer's scope ("real", tests/test_real_verl.py) has a node of its own for its one
# run through SLURM (the CPU path trains on one node).
PARTITIONS = {PARTITION: ("n1", "n2"), "hy3rl-b": ("n3", "n4"), "hy3rl-r": ("n5",)}
LANE_PARTITIONS = {"slurm": PARTITION, "slurm-b": "hy3rl-b", "real": "hy3rl-r"}
NODES = tuple(n for nodes in PARTITIONS.values() for n in nodes)
GPU_TYPE = "fake"
GPUS_PER_NODE = 2
CPUS_PER_NODE = 2
REAL_MEMORY_MB = 8000
BASE_PORT = int(os.environ.get("HY3RL_SLURM_BASE_PORT", "17817"))
READY_TIMEOUT_S = 90
START_ATTEMPTS = 2  # a start that fails is tried once more, in a fresh state directory


class ClusterError(RuntimeError):
    """The test cluster could not be started, reached or stopped; says why."""


class DaemonDied(ClusterError):
    """A daemon of a cluster being started died (a fresh start may succeed)."""


@dataclass
class ClusterInfo:
    """What tests need to know about the running cluster (``<state_dir>/cluster.json``)."""

    state_dir: str
    conf_dir: str
    hostname: str
    partition: str = PARTITION
    account: str = ACCOUNT
    nodes: list[str] = field(default_factory=lambda: list(NODES))
    partitions: dict[str, list[str]] = field(
        default_factory=lambda: {p: list(n) for p, n in PARTITIONS.items()})
    gpu_type: str = GPU_TYPE
    gpus_per_node: int = GPUS_PER_NODE
    gres_per_node: str = f"gpu:{GPU_TYPE}:{GPUS_PER_NODE}"
    cpus_per_node: int = CPUS_PER_NODE
    real_memory_mb: int = REAL_MEMORY_MB
    slurmctld_port: int = 0
    slurmd_ports: dict[str, int] = field(default_factory=dict)
    munge_socket: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    # Each daemon's start time (/proc/<pid>/stat field 22), which tells our daemon from a
    # recycled pid.
    starts: dict[str, int] = field(default_factory=dict)
    persistent: bool = False
    backed_up: list[str] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return Path(self.state_dir) / "log"

    @property
    def gpu_devices(self) -> dict[str, list[str]]:
        dev = Path(self.state_dir) / "dev"
        return {
            n: [str(dev / f"fakegpu{i * self.gpus_per_node + k}")
                for k in range(self.gpus_per_node)]
            for i, n in enumerate(self.nodes)
        }

    def save(self) -> None:
        path = Path(self.state_dir) / "cluster.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: str | Path) -> ClusterInfo:
        doc = json.loads((Path(state_dir) / "cluster.json").read_text())
        # A cluster started by an earlier version of this file had one partition.
        doc.setdefault("partitions", {doc.get("partition", PARTITION):
                                      doc.get("nodes", list(NODES))})
        return cls(**doc)


# ---------------------------------------------------------------------------- helpers


def _run(cmd: list[str], timeout: float = 20, check: bool = True) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise ClusterError(f"{cmd[0]} not found: install SLURM (./install.sh --test)") from exc
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _port_free(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _free_ports(n: int, start: int = BASE_PORT) -> list[int]:
    """``n`` free TCP ports at or above ``start`` (below the ephemeral range)."""
    ports = []
    port = start
    while len(ports) < n:
        if port > start + 2000:
            raise ClusterError(f"no {n} free TCP ports in {start}..{start + 2000}")
        if _port_free(port):
            ports.append(port)
        port += 1
    return ports


def _start_time(pid: int) -> int | None:
    """The start time of live process ``pid`` (/proc/<pid>/stat field 22); None when it is
    gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _alive(info: ClusterInfo, name: str) -> bool:
    """Whether daemon ``name`` of ``info`` still runs: its pid lives and started when ours
    did, so that a recycled pid of an unrelated process is never mistaken for ours.

    Only /proc/<pid>/stat is read, which is always readable: an earlier check that read
    /proc/<pid>/environ once took a starting slurmctld for dead under a loaded full test
    run (the daemon went on running)."""
    pid = info.pids[name]
    started = _start_time(pid)
    if started is None:
        return False
    if name in info.starts:
        return started == info.starts[name]
    # A cluster.json written before start times were recorded: tell ours by environment.
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return f"{STATE_ENV}={info.state_dir}".encode() in environ


def _record(info: ClusterInfo, name: str, pid: int) -> None:
    info.pids[name] = pid
    started = _start_time(pid)
    if started is not None:
        info.starts[name] = started


def _ended(pid: int) -> str:
    """How a dead daemon that this process started ended (``killed by SIGSEGV``,
    ``exit 1``); '' when it is not our child or still runs."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return ""
    if got == 0:
        return ""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return f"({path} missing)"


@contextlib.contextmanager
def _flock(path: Path, mode: int, timeout: float) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"timed out after {timeout:.0f}s waiting for {path}"
                    ) from None
                time.sleep(0.5)
        yield fd
    finally:
        os.close(fd)


def _running_state_dir() -> Path | None:
    """The state dir named by our marker in CONF_DIR/slurm.conf, if any."""
    conf = CONF_DIR / "slurm.conf"
    try:
        first = conf.read_text().splitlines()[0]
    except (FileNotFoundError, IndexError):
        return None
    if first.startswith(MARKER):
        return Path(first[len(MARKER):].strip())
    return None


def _all_alive(info: ClusterInfo) -> bool:
    return bool(info.pids) and all(_alive(info, n) for n in info.pids)


# ---------------------------------------------------------------------------- config


def render_slurm_conf(info: ClusterInfo) -> str:
    s = info.state_dir
    lines = [
        f"{MARKER}{s}",
        "# Written by tests/slurm_cluster.py; restored from its backup when the cluster stops.",
        "ClusterName=hy3rltest",
        f"SlurmctldHost={info.hostname}(127.0.0.1)",
        f"SlurmctldPort={info.slurmctld_port}",
        f"SlurmdPort={info.slurmd_ports[info.nodes[0]]}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={info.munge_socket}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={s}/ctld",
        f"SlurmdSpoolDir={s}/spool/%n",
        f"SlurmctldPidFile={s}/run/slurmctld.pid",
        f"SlurmdPidFile={s}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={s}/log/slurmctld.log",
        f"SlurmdLogFile={s}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=5",
        "GresTypes=gpu",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        # Finished jobs stay visible to squeue/scontrol (the plugin's squeue status).
        "MinJobAge=600",
        "KillWait=5",
        "OverTimeLimit=0",
        "InactiveLimit=0",
        "Waittime=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "MessageTimeout=20",
    ]
    for n in info.nodes:
        lines.append(
            f"NodeName={n} NodeHostname={info.hostname} NodeAddr=127.0.0.1 "
            f"Port={info.slurmd_ports[n]} CPUs={info.cpus_per_node} "
            f"RealMemory={info.real_memory_mb} Gres={info.gres_per_node} State=UNKNOWN"
        )
    for name, nodes in info.partitions.items():
        default = "YES" if name == info.partition else "NO"
        lines.append(
            f"PartitionName={name} Nodes={','.join(nodes)} Default={default} "
            "MaxTime=INFINITE State=UP OverSubscribe=NO"
        )
    return "\n".join(lines) + "\n"


def render_gres_conf(info: ClusterInfo) -> str:
    lines = [f"{MARKER}{info.state_dir}", "AutoDetect=off"]
    for n, devices in info.gpu_devices.items():
        for dev in devices:
            lines.append(f"NodeName={n} Name=gpu Type={info.gpu_type} File={dev}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- start / stop


def _backup_conf(info: ClusterInfo) -> None:
    backup = Path(info.state_dir) / "backup"
    backup.mkdir(exist_ok=True)
    for name in CONF_FILES:
        src = CONF_DIR / name
        if src.exists():
            shutil.copy2(src, backup / name)
            info.backed_up.append(name)


def _restore_conf(info: ClusterInfo) -> None:
    """Put back what was in CONF_DIR before ``info``'s cluster started (only when the
    config there is still ours)."""
    if _running_state_dir() != Path(info.state_dir):
        return
    backup = Path(info.state_dir) / "backup"
    for name in CONF_FILES:
        dst = CONF_DIR / name
        if name in info.backed_up and (backup / name).exists():
            tmp = dst.with_name(f".{name}.hy3rl-restore")
            shutil.copy2(backup / name, tmp)
            os.replace(tmp, dst)
        else:
            dst.unlink(missing_ok=True)


def _start_munged(info: ClusterInfo) -> None:
    mdir = Path(info.state_dir) / "munge"
    mdir.mkdir(mode=0o755)
    shutil.chown(mdir, "munge", "munge")
    with open(Path(info.state_dir) / "log" / "munged.out", "ab") as log:
        proc = subprocess.Popen(
            ["munged", "-F", f"--socket={info.munge_socket}", f"--pid-file={mdir}/munged.pid",
             f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/munged.seed"],
            user="munge", group="munge", extra_groups=[], stdin=subprocess.DEVNULL,
            env={**os.environ, STATE_ENV: info.state_dir}, cwd=mdir,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    _record(info, "munged", proc.pid)
    deadline = time.monotonic() + 15
    while not Path(info.munge_socket).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ClusterError(
                f"munged did not start (exit {proc.poll()}):\n{_tail(mdir / 'munged.log')}\n"
                f"{_tail(Path(info.state_dir) / 'log' / 'munged.out')}"
            )
        time.sleep(0.2)


def _spawn(info: ClusterInfo, name: str, cmd: list[str]) -> None:
    with open(Path(info.state_dir) / "log" / f"{name}.out", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=info.state_dir, env={**os.environ, STATE_ENV: info.state_dir})
    _record(info, name, proc.pid)


def node_states() -> dict[str, str]:
    out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
    states = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def _usable(state: str, require_idle: bool) -> bool:
    if require_idle:
        return state == "idle"
    bad = ("down", "drain", "fail", "unk", "not_responding", "future", "inval")
    return bool(state) and not state.endswith("*") and not any(b in state for b in bad)


def wait_ready(info: ClusterInfo, timeout: float = READY_TIMEOUT_S,
               require_idle: bool = True) -> None:
    """Wait until every node is idle (a fresh cluster) or at least up and responding
    (``require_idle=False``: one that other sessions may be running jobs on); raise with
    the daemons' logs otherwise."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        dead = [n for n in info.pids if not _alive(info, n)]
        if dead:
            break
        states = node_states()
        if all(_usable(states.get(n, ""), require_idle) for n in info.nodes):
            return
        time.sleep(1)
    raise _failure(info, f"not ready after {timeout:.0f}s", states)


def _failure(info: ClusterInfo, what: str, states: dict[str, str] | None = None) -> ClusterError:
    """The error for a cluster that did not come up: :class:`DaemonDied` naming the dead
    daemons and how they ended when there are any, else ``what``; with the daemons' logs."""
    logs = "\n".join(
        f"--- {p.name}\n{_tail(p)}" for p in sorted(info.log_dir.glob("*"))
    )
    dead = {n: _ended(p) for n, p in info.pids.items() if not _alive(info, n)}
    if dead:
        what = f"daemons died: {', '.join(f'{n} ({e})' if e else n for n, e in dead.items())}"
    return (DaemonDied if dead else ClusterError)(
        f"SLURM test cluster {what}; node states {states or {}}; "
        f"state dir {info.state_dir}\n{logs}"
    )


def _wait_pidfile(info: ClusterInfo, name: str, pidfile: Path, timeout: float = 30) -> None:
    """Wait until daemon ``name`` has written ``pidfile`` (it is up and listening); raise
    :class:`DaemonDied` with how it ended and the logs if it dies first."""
    deadline = time.monotonic() + timeout
    while not pidfile.exists():
        if time.monotonic() > deadline:
            raise _failure(info, f"{name} wrote no {pidfile} within {timeout:.0f}s")
        if not _alive(info, name):
            raise DaemonDied(str(_failure(info, f"{name} died before writing {pidfile}")))
        time.sleep(0.1)


def _check_prerequisites() -> None:
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo",
                           "scontrol", "scancel") if shutil.which(b) is None]
    if missing:
        raise ClusterError(
            f"missing {', '.join(missing)}: install the Debian packages munge slurmctld "
            "slurmd slurm-client (./install.sh --test)"
        )
    if os.geteuid() != 0:
        raise ClusterError("the SLURM test cluster must be started as root (slurmd, mknod)")
    if not Path("/etc/munge/munge.key").exists():
        raise ClusterError("/etc/munge/munge.key is missing (Debian's munge package makes it)")


def _start_locked(persistent: bool) -> ClusterInfo:
    """Start a fresh cluster; the caller holds START_LOCK and checked the prerequisites."""
    CONF_DIR.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="hy3rl-slurm-", dir=os.environ.get("HY3RL_SLURM_TMP")))
    state.chmod(0o755)
    for sub in ("ctld", "spool", "run", "log", "dev"):
        (state / sub).mkdir()
    ports = _free_ports(1 + len(NODES))
    info = ClusterInfo(
        state_dir=str(state), conf_dir=str(CONF_DIR), hostname=socket.gethostname(),
        slurmctld_port=ports[0], slurmd_ports=dict(zip(NODES, ports[1:], strict=True)),
        munge_socket=str(state / "munge" / "munge.socket"), persistent=persistent,
    )
    try:
        for devices in info.gpu_devices.values():
            for dev in devices:
                # Character devices (gres rejects plain files): major 1 minor 3 = /dev/null.
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
        for n in info.nodes:
            (state / "spool" / n).mkdir()
        _backup_conf(info)
        info.save()
        conf = render_slurm_conf(info)
        gres = render_gres_conf(info)
        for name, text in (("gres.conf", gres), ("slurm.conf", conf)):
            tmp = CONF_DIR / f".{name}.hy3rl-new"
            tmp.write_text(text)
            os.replace(tmp, CONF_DIR / name)
        (CONF_DIR / "cgroup.conf").unlink(missing_ok=True)
        _start_munged(info)
        info.save()
        _spawn(info, "slurmctld", ["slurmctld", "-D", "-i", "-c"])
        info.save()
        _wait_pidfile(info, "slurmctld", state / "run" / "slurmctld.pid")
        # One slurmd at a time, each up (its pid file is written once it listens) before
        # the next starts.
        for n in info.nodes:
            _spawn(info, f"slurmd-{n}", ["slurmd", "-D", "-N", n])
            info.save()
            _wait_pidfile(info, f"slurmd-{n}", state / "run" / f"slurmd-{n}.pid")
        wait_ready(info)
    except BaseException:
        _stop_locked(info, keep_state=True)
        raise
    return info


def _start_fresh(persistent: bool) -> ClusterInfo:
    """:func:`_start_locked`, tried once more (in a new state dir, the failed one kept for
    its logs) when the start fails: a daemon that died, one that never wrote its pid file,
    nodes not ready, each bounded in time (never a wait until pytest's timeout). Seen here
    under full test runs only: a slurmd gone within its first 0.2 s, no line logged, and a
    slurmctld taken for dead while it ran (both when liveness still read
    /proc/<pid>/environ; see :func:`_alive`). Raises with every attempt's error, each with
    the daemons' log tails, if both fail; missing prerequisites are not retried."""
    _check_prerequisites()
    errors = []
    for _ in range(START_ATTEMPTS):
        try:
            return _start_locked(persistent)
        except ClusterError as exc:
            errors.append(str(exc))
    raise ClusterError(f"{START_ATTEMPTS} starts failed:\n" + "\n\n".join(errors))


def _stop_locked(info: ClusterInfo, keep_state: bool = False) -> None:
    """Cancel the jobs, stop every daemon by its pid, restore CONF_DIR, remove the state
    dir (kept when ``keep_state``, e.g. after a failed start, for its logs)."""
    if info.pids.get("slurmctld") and _alive(info, "slurmctld"):
        _run(["scancel", "--full", f"--partition={','.join(info.partitions)}"], check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            out = _run(["squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i"],
                       check=False)
            if not out.strip():
                break
            time.sleep(1)
    order = [f"slurmd-{n}" for n in info.nodes] + ["slurmctld", "munged"]
    for name in order:
        pid = info.pids.get(name)
        if not pid or not _alive(info, name):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _alive(info, name) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(info, name):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    _restore_conf(info)
    if not keep_state and not os.environ.get("HY3RL_SLURM_KEEP_STATE"):
        shutil.rmtree(info.state_dir, ignore_errors=True)


def _current_locked() -> ClusterInfo | None:
    """The cluster described by CONF_DIR, if all its daemons run; a dead or half-dead one
    is stopped and CONF_DIR restored."""
    state = _running_state_dir()
    if state is None:
        return None
    try:
        info = ClusterInfo.load(state)
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        # Our marker but no state: nothing to restore from; remove our files.
        for name in ("slurm.conf", "gres.conf"):
            (CONF_DIR / name).unlink(missing_ok=True)
        return None
    if _all_alive(info) and set(info.pids) >= {"munged", "slurmctld"}:
        return info
    _stop_locked(info)
    return None


def start(persistent: bool = True) -> ClusterInfo:
    """Start the cluster unless one of ours is already running; return its info."""
    with _flock(START_LOCK, fcntl.LOCK_EX, timeout=300):
        info = _current_locked()
        if info is None:
            return _start_fresh(persistent)  # waits until both nodes are idle
        if persistent and not info.persistent:
            info.persistent = True
            info.save()
        wait_ready(info, require_idle=False)
        return info


def stop(force: bool = False) -> bool:
    """Stop the running cluster (whoever started it). True if there was one. Refuses while
    a test session uses it, unless ``force``."""
    with contextlib.ExitStack() as stack:
        if not force:
            try:
                stack.enter_context(_flock(USERS_LOCK, fcntl.LOCK_EX, timeout=0))
            except ClusterError:
                raise ClusterError(
                    f"a test session is using the cluster ({USERS_LOCK} is locked); "
                    "it stops the cluster when it ends (or use --force)"
                ) from None
        with _flock(START_LOCK, fcntl.LOCK_EX, timeout=300):
            state = _running_state_dir()
            if state is None:
                return False
            try:
                info = ClusterInfo.load(state)
            except FileNotFoundError:
                _current_locked()
                return True
            _stop_locked(info)
            return True


def status() -> ClusterInfo | None:
    state = _running_state_dir()
    if state is None:
        return None
    try:
        info = ClusterInfo.load(state)
    except FileNotFoundError:
        return None
    return info if _all_alive(info) else None


@contextlib.contextmanager
def session(wait_s: float = 900) -> Iterator[ClusterInfo]:
    """Use the cluster for the duration of the ``with`` block: join a running one or start
    one; on exit, the last user stops a cluster that was not started persistently."""
    users_fd = os.open(USERS_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + wait_s
        while True:  # blocks while the last user of a previous cluster is stopping it
            try:
                fcntl.flock(users_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"timed out waiting for {USERS_LOCK}") from None
                time.sleep(0.5)
        info = start(persistent=False)
        try:
            yield info
        finally:
            # Last one out (no other session holds the users lock) stops the cluster.
            fcntl.flock(users_fd, fcntl.LOCK_UN)
            try:
                fcntl.flock(users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass  # another session still uses it; it will stop it
            else:
                with _flock(START_LOCK, fcntl.LOCK_EX, timeout=300):
                    current = status()
                    if current is not None and not current.persistent:
                        _stop_locked(current)
                    elif current is None:
                        _current_locked()
    finally:
        os.close(users_fd)


# ---------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--force", action="store_true",
                        help="stop even while a test session uses the cluster")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            info = start(persistent=True)
            print(json.dumps(asdict(info), indent=2))
            print(f"nodes: {node_states()}", file=sys.stderr)
        elif args.action == "stop":
            print("stopped" if stop(args.force) else "no test cluster running")
        else:
            info = status()
            if info is None:
                print("no test cluster running")
                return 1
            print(json.dumps(asdict(info), indent=2))
            print(f"nodes: {node_states()}", file=sys.stderr)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
