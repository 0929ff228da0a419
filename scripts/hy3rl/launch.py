"""The Ray-on-SLURM launcher run inside the training job (also on one machine, no SLURM).

``launch(spec)``:

1. finds the allocation's nodes (``squeue -h -j $SLURM_JOB_ID -o %N`` + ``scontrol show
   hostnames``: inside the job step the other ``SLURM_*`` variables are scrubbed) and checks
   the configured CPUs/GPUs per node against the allocation (``scontrol show job -d``);
2. derives every Ray port from the job id (GCS, dashboard, client server, node manager,
   object manager, dashboard agent, metrics, runtime-env agent, worker port range), per node
   sharing a host, and a node-local per-job ``--temp-dir``;
3. starts the Ray head in its own ``srun --overlap -N1 -n1 -w <node>`` step
   (``hy3rl.raynode``, the node side, wrapping ``ray start --block``), waits until its GCS
   answers, checks that the job client's Ray (this env's) is the cluster's (the version the
   runtime's python imports on the head, published in ``head.json``; a mismatch refuses,
   naming both), then starts one worker per other node (retried with backoff), and polls
   until every node and GPU is registered (hard deadline; the error names the missing
   nodes);
4. submits ``bash <launch.sh>`` as a Ray job and supervises it until Ray's job status is
   terminal (``hy3rl.rayjob``: the output streamed into ``driver.log`` and this process's
   stdout, the stream re-attached when Ray ends it early), polling the watchdog meanwhile;
   every Ray process of the launch requires a per-launch token (``hy3rl.rayjob.AuthToken``):
   the cluster is closed to other users;
5. watches every node step: a node's Ray dying tears everything down instead of hanging;
   SIGTERM / SIGINT / SIGUSR1 (time limit, scancel) stop the Ray job and Ray on every node.
   Each node's wrapper kills exactly the processes it started (marked through the
   environment variable ``HY3RL_RAY_SCOPE``), never another job's Ray (``ray stop`` would).

Logs (``spec.log_dir``): ``launcher.log`` (timestamped phases), ``driver.log``,
``node-<name>.log``, ``ray.json`` (nodes, head, ports), ``runtime_env.yaml`` (a copy of the
runtime env submitted, which holds no secret: the job's secrets reach it through
``.job-env``, 0600, removed at the teardown, ``hy3rl.jobenv``; secrets redacted in every log
by ``hy3rl.redact``, as ``[REDACTED]``).

Runtime (``spec.runtime``, from ``train.runtime``): every node process runs as
``[srun ...] <prefix> env PYTHONPATH=<this workflow's scripts/> <python> -m hy3rl.raynode node
...`` where ``prefix`` is e.g. ``apptainer exec --nv --bind /shared docker://<image>`` or
``conda run -n verl``; with a prefix the node's ``ray`` is the one on the runtime's PATH, so
Ray (and verl, in the Ray job) come from the runtime. The node mode needs only the standard
library, ``psutil`` and ``ray`` there (so this module imports only standard-library parts
of ``hy3rl`` at its top). The driver side (``ray job submit``) stays on this interpreter's Ray
and reaches the head's dashboard over HTTP; Ray promises no compatibility between client
and cluster versions, so the two must be equal (:meth:`Launcher.check_ray`).

``Ray`` settings (``spec.ray``) and the runtime (``spec.runtime``) are the typed sections
``train.ray`` and ``train.runtime`` (hy3rl.settings); left out, the schema's defaults.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hy3rl import jobenv
from hy3rl.atomic import write_json_atomic, write_text_atomic
from hy3rl.errors import StageError
from hy3rl.loadwatch import ENV as LOAD_BAR_ENV
from hy3rl.loadwatch import PROGRESS_DIR
from hy3rl.rayjob import TERMINAL, AuthToken, JobRun, without_auth
from hy3rl.raynode import RAY, Ports, redact_files
from hy3rl.redact import REDACTED, Redactor, is_secret_key, make_redactor
from hy3rl.watchdog import StopRequest

if TYPE_CHECKING:
    from hy3rl.settings import Ray, Runtime
    from hy3rl.watchdog import Monitor

log = logging.getLogger("hy3rl.launch")

SCRIPTS_DIR = Path(__file__).resolve().parents[1]  # holds the hy3rl package


def resolve_runtime(runtime: Runtime | None) -> dict[str, str]:
    """``train.runtime`` as the nodes run it: ``prefix`` stripped, ``python`` ``python3`` (the
    runtime's, on its PATH) when a prefix is set and none is given, else this interpreter.
    None (a launch without a runtime, e.g. evaluation's) is the workflow's own env."""
    prefix = (runtime.prefix if runtime else "").strip()
    python = runtime.python if runtime else ""
    try:
        shlex.split(prefix)
    except ValueError as exc:
        raise LaunchError(f"train.runtime.prefix {prefix!r}: {exc}") from None
    if not python:
        python = "python3" if prefix else sys.executable
    return {"prefix": prefix, "python": python}


def default_ray() -> Ray:
    """The schema's defaults of ``train.ray`` (for a launch given no Ray settings)."""
    from hy3rl.settings import Config

    return Config.from_dict({}).train.ray


# --------------------------------------------------------------------------- one Ray

RAY_PROBE = "import ray; print('HY3RL_RAY_VERSION', ray.__version__)"
# verl's plugin hook (verl/__init__.py: a comma-separated list of modules imported in every
# process of verl)
PLUGINS = "VERL_USE_EXTERNAL_MODULES"


def join_modules(*lists: str) -> str:
    """Comma-separated module lists joined, in order, each module once."""
    out: list[str] = []
    for text in lists:
        out += [m.strip() for m in text.split(",") if m.strip() and m.strip() not in out]
    return ",".join(out)


def client_ray_version() -> str | None:
    """The Ray of the job client: ``ray job submit`` (``RAY``) and the JobSubmissionClient
    run from this interpreter's environment (its ``ray`` distribution); a ``ray`` taken from
    PATH instead answers ``ray --version``. None when it cannot be told."""
    if RAY == str(Path(sys.executable).with_name("ray")):
        from importlib import metadata

        try:
            return metadata.version("ray")
        except metadata.PackageNotFoundError:
            return None
    try:
        out = subprocess.run([RAY, "--version"], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version\s+(\S+)", out)
    return m.group(1) if m else None


def runtime_desc(runtime: Runtime | None) -> str:
    rt = resolve_runtime(runtime)
    if rt["prefix"]:
        return f"train.runtime `{rt['prefix']} {rt['python']}`"
    return f"the workflow env's {rt['python']} (no train.runtime.prefix)"


def runtime_ray_version(runtime: Runtime | None, timeout: float = 300) -> str:
    """The Ray the runtime's python imports: ``<prefix> <python> -c "import ray; ..."`` run
    here (the launcher's node; the cluster's Ray when the head's ``head.json`` does not say).
    Raises LaunchError naming the command when it cannot be told."""
    rt = resolve_runtime(runtime)
    cmd = [*shlex.split(rt["prefix"]), rt["python"], "-c", RAY_PROBE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"{shlex.join(cmd)}: {exc}") from None
    for line in proc.stdout.splitlines():
        if line.startswith("HY3RL_RAY_VERSION "):
            return line.split(None, 1)[1].strip()
    tail = (proc.stderr.strip() or proc.stdout.strip())[-500:]
    raise LaunchError(f"{shlex.join(cmd)} exited {proc.returncode} without a Ray version: "
                      f"{tail}")


def ray_versions(client: str | None, cluster: str | None) -> dict[str, Any]:
    """``{"client", "cluster", "match"}`` (``match`` None when either is unknown)."""
    match = None if client is None or cluster is None else client == cluster
    return {"client": client, "cluster": cluster, "match": match}


def refuse_mismatch(versions: dict[str, Any], runtime: Runtime | None) -> None:
    """One Ray on both sides: Ray promises no compatibility between a job client and a
    cluster of other versions, so a mismatch refuses the submission, naming both."""
    if versions.get("match") is not False:
        return
    client, cluster = versions["client"], versions["cluster"]
    raise LaunchError(
        f"Ray version mismatch: the job client (`{RAY} job submit`, this workflow's env) has "
        f"Ray {client}, the cluster ({runtime_desc(runtime)}) runs Ray {cluster}; Ray does not "
        f"promise compatibility between client and cluster versions, so nothing was "
        f"submitted. Use one Ray on both sides: install ray[default]=={cluster} in the "
        f"workflow's env (the job client), or give train.runtime a runtime whose Ray is "
        f"{client}", f"ray version mismatch (client {client}, cluster {cluster})",
        outcome="refused")


class LaunchError(StageError):
    """The launch failed before or outside the trainer; the message names the node/file.
    ``outcome``: the attempt record's outcome (docs/formats/train.md); ``lost_nodes``: nodes
    whose Ray died or did not start (not reused by a restart, excluded by a resubmission)."""

    def __init__(self, message: str, reason: str | None = None,
                 outcome: str = "launcher_error", lost_nodes: list[str] | None = None):
        super().__init__(message)
        self.reason = reason or message
        self.outcome = outcome
        self.lost_nodes = list(lost_nodes or [])


@dataclass
class LaunchSpec:
    submission_id: str
    launch_script: Path
    runtime_env: Path
    log_dir: Path
    env_vars: dict[str, str] = field(default_factory=dict)
    passthrough_env: list[str] = field(default_factory=list)
    launch_args: list[str] = field(default_factory=list)  # appended: bash launch.sh <args>
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int = 1
    ray: Ray | None = None  # train.ray; None: the schema's defaults
    runtime: Runtime | None = None  # train.runtime; None: the workflow's own env
    exclude: list[str] = field(default_factory=list)  # allocation nodes not to use (lost)
    monitor: Monitor | None = None  # hy3rl.watchdog: hangs and the time limit
    poll_s: float = 5.0  # seconds between two monitor polls
    progress_every_s: float = 30.0  # the node agents' reports (hy3rl.loadwatch)
    node_logs_mb: float = 0.0  # per node: Ray logs copied to <log_dir>/nodes/<node>/
    # The CPU path (hy3rl.verl_cpu, plan cpu_path): Ray's logical CPUs (verl's actors each
    # ask for one, whatever the cores), and gpus_per_node are logical GPUs (trainer ranks
    # on the host), not devices the allocation is checked for. None: a GPU run.
    ray_cpus: int | None = None


@dataclass
class LaunchResult:
    exit_code: int
    reason: str
    nodes: list[str]
    job_status: str | None = None
    ray_versions: dict[str, Any] = field(default_factory=dict)  # see ray_versions()
    outcome: str = "launcher_error"  # the attempt record's outcome (docs/formats/train.md)
    lost_nodes: list[str] = field(default_factory=list)
    stop_step: int | None = None  # the last logged step when the watchdog stopped the job
    diagnostics: dict[str, Any] | None = None  # what the watchdog collected (hy3rl.nodelogs)


@dataclass
class Node:
    name: str
    host: str  # NodeHostName: several SLURM nodes may share one host (test clusters)
    cpus: int | None = None
    gpus: int | None = None


@dataclass
class Outage:
    """The dashboard not answering while the Ray job runs: ridden out for ``limit_s``
    seconds (``train.ray.dashboard_outage_s``; 0: for ever) while the watchdog goes on
    watching the trainer's own progress (its log lines, the checkpoint's bytes), which alone
    decides whether a trainer is healthy. Logged when it starts and when it ends."""

    limit_s: float
    since: float | None = None

    def unanswered(self, now: float, address: str | None) -> bool:
        """A status that did not come; whether the outage is past its limit."""
        if self.since is None:
            self.since = now
            log.warning("Ray's dashboard at %s does not answer: the job's status is unknown; "
                        "%s while the watchdog watches the trainer's progress", address,
                        f"riding it out for up to {self.limit_s:g}s" if self.limit_s > 0
                        else "riding it out (train.ray.dashboard_outage_s: 0, no limit)")
        return self.limit_s > 0 and now - self.since > self.limit_s

    def answered(self, now: float, address: str | None) -> None:
        if self.since is not None:
            log.warning("Ray's dashboard at %s answers again after %.0fs", address,
                        now - self.since)
        self.since = None

    def message(self, submission_id: str, address: str | None) -> str:
        return (f"ray job status of {submission_id} unavailable for {self.limit_s:g}s: the "
                f"dashboard at {address} did not answer (train.ray.dashboard_outage_s)")


# --------------------------------------------------------------------------- allocation


def _run(cmd: list[str], timeout: float = 60) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LaunchError(f"{cmd[0]} not found on PATH") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{shlex.join(cmd)} did not answer within {timeout:g}s") from None
    if proc.returncode != 0:
        raise LaunchError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _count_ids(spec: str) -> int:
    n = 0
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            n += int(b) - int(a) + 1
        elif part:
            n += 1
    return n


def parse_job_detail(text: str) -> dict[str, tuple[int | None, int | None]]:
    """``scontrol show job -d`` -> {node list expression: (cpus per node, gpus per node)}
    from its per-node lines ``Nodes=n[1-2] CPU_IDs=0-1 Mem=... GRES=gpu:2(IDX:0-1)``."""
    out = {}
    for m in re.finditer(r"^\s*Nodes=(\S+)\s+CPU_IDs=(\S+)(.*)$", text, re.M):
        rest = m.group(3)
        g = re.search(r"GRES=(\S*)", rest)
        gpus = 0
        if g:
            for item in re.finditer(r"gpu(?::[^:(,]+)?:(\d+)", g.group(1)):
                gpus += int(item.group(1))
        out[m.group(1)] = (_count_ids(m.group(2)), gpus)
    return out


def slurm_nodes(job_id: str) -> list[Node]:
    expr = _run(["squeue", "-h", "-j", job_id, "-o", "%N"]).strip()
    if not expr:
        raise LaunchError(f"squeue shows no nodes for job {job_id}")
    names = _run(["scontrol", "show", "hostnames", expr]).split()
    detail = parse_job_detail(_run(["scontrol", "show", "job", "-d", job_id]))
    per_node: dict[str, tuple[int | None, int | None]] = {}
    for group, vals in detail.items():
        for n in _run(["scontrol", "show", "hostnames", group]).split():
            per_node[n] = vals
    hosts = {}
    for block in _run(["scontrol", "show", "node", ",".join(names)]).split("\n\n"):
        m = re.search(r"NodeName=(\S+)", block)
        h = re.search(r"NodeHostName=(\S+)", block)
        if m:
            hosts[m.group(1)] = h.group(1) if h else m.group(1)
    return [Node(n, hosts.get(n, n), *per_node.get(n, (None, None))) for n in names]


def local_gpus() -> int | None:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip()])
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(LaunchError):
            return len(_run(["nvidia-smi", "-L"]).strip().splitlines())
    return None


def check_allocation(nodes: list[Node], spec: LaunchSpec) -> None:
    if len(nodes) != spec.nodes:
        names = ", ".join(n.name for n in nodes)
        raise LaunchError(f"the allocation has {len(nodes)} node(s) ({names}) but "
                          f"cluster.nodes is {spec.nodes}")
    for n in nodes:
        if n.cpus is not None and spec.cpus_per_node > n.cpus:
            raise LaunchError(f"node {n.name}: cluster.cpus_per_node={spec.cpus_per_node} "
                              f"but the allocation gives {n.cpus} CPUs there (Ray would "
                              "over-subscribe and hang)")
        if spec.ray_cpus is None and n.gpus is not None and n.gpus != spec.gpus_per_node:
            raise LaunchError(f"node {n.name}: cluster.gpus_per_node={spec.gpus_per_node} "
                              f"but the allocation gives {n.gpus} GPUs there")


def port_plan(job_key: int, nodes: list[Node], ray: Ray) -> dict[str, Ports]:
    """Every Ray port of every node, derived from the job id. Nodes sharing a host get
    disjoint blocks; jobs land in ``port_span / block`` slots (job id modulo)."""
    stride = 10 + ray.worker_ports
    per_host: dict[str, int] = {}
    index = {}
    for n in nodes:
        index[n.name] = per_host.get(n.host, 0)
        per_host[n.host] = index[n.name] + 1
    block = stride * max(per_host.values())
    slots = max(1, ray.port_span // block)
    base = ray.port_base + (job_key % slots) * block
    if base + block > 65535:
        raise LaunchError(f"train.ray ports {base}..{base + block} exceed 65535")
    out = {}
    for n in nodes:
        b = base + index[n.name] * stride
        out[n.name] = Ports(b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6, b + 7, b + 8,
                            b + 10, b + 10 + ray.worker_ports - 1)
    return out


# --------------------------------------------------------------------------- node wrapper


class NodeProc:
    def __init__(self, node: Node, role: str, cmd: list[str], logfile: Path,
                 env: dict[str, str] | None = None):
        self.node, self.role, self.cmd, self.logfile = node, role, cmd, logfile
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        fh = open(self.logfile, "ab")
        # The rule's step environment describes that one-node step (SLURM_NNODES=1, ...):
        # drop it, so that srun takes the job's shape from slurmctld (--jobid names it).
        env = {k: v for k, v in without_auth(dict(os.environ)).items()
               if not k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}
        env.update(self.extra_env)
        self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=env)
        fh.close()
        self.started = time.monotonic()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.logfile.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + ln for ln in lines[-n:])


class Launcher:
    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.ray = spec.ray if spec.ray is not None else default_ray()
        self.job_id = os.environ.get("SLURM_JOB_ID") or None
        self.nodes: list[Node] = []
        self.procs: dict[str, NodeProc] = {}
        self.stop_reason: str | None = None
        self.stop_event = threading.Event()
        self.job: JobRun | None = None  # hy3rl.rayjob: the Ray job, once submitted
        self.auth: AuthToken | None = None  # the launch's Ray token (hy3rl.rayjob)
        self.dashboard: str | None = None
        self.submitted = False
        self.redactor = Redactor()  # the passed-through secrets, once known
        self.job_done = False
        self.on_stop: Callable[[str], None] | None = None
        self.on_ray: Callable[[dict[str, Any]], None] | None = None
        self.ray_versions: dict[str, Any] = {}
        self.watch: StopRequest | None = None  # the watchdog's stop, when it stopped the job
        self.secret_files: list[Path] = []  # removed in the teardown
        self.job_env: Path | None = None  # the job's secrets (hy3rl.jobenv), once written
        self.diagnostics: dict[str, Any] | None = None
        self.t0 = time.monotonic()

    # ---- helpers
    def ray_env(self) -> dict[str, str]:
        """What a Ray process of this launch (a node, the CLI) adds to its environment:
        the launch's token (hy3rl.rayjob.AuthToken)."""
        return self.auth.env() if self.auth else {}

    def headers(self) -> dict[str, str]:
        return self.auth.headers() if self.auth else {}

    def phase(self, msg: str, *a: Any) -> None:
        log.info("[+%7.1fs] " + msg, time.monotonic() - self.t0, *a)

    def request_stop(self, reason: str) -> None:
        first = self.stop_reason is None
        if first:
            self.stop_reason = reason
            self.phase("stop requested: %s", reason)
        self.stop_event.set()
        if first and self.on_stop:
            try:
                self.on_stop(reason)
            except Exception as exc:  # recording must not prevent the teardown
                log.warning("on_stop: %s", exc)

    def check_stop(self) -> None:
        if self.stop_reason:
            raise LaunchError(self.stop_reason)
        for name, np_ in self.procs.items():
            code = np_.poll()
            if code is not None:
                if self.submitted:
                    what, reason, outcome = "died", f"ray node {name} died", "node_lost"
                else:
                    what, reason, outcome = ("failed to start", f"ray failed to start on {name}",
                                             "ray_failed")
                raise LaunchError(
                    f"Ray on node {name} ({np_.role}) {what}: its step exited {code}; "
                    f"{np_.logfile}:\n{np_.tail()}", reason, outcome, [name])

    def scope(self, node: Node) -> str:
        """The node's Ray scope: unique per launch (the SLURM job, else this launcher's pid:
        two local runs of the same run name on one host must not kill each other's Ray)."""
        return f"{self.job_id or f'local{os.getpid()}'}-{node.name}-{self.spec.submission_id}"

    def entry(self) -> list[str]:
        """``<prefix> env PYTHONPATH=<scripts> <python>``: this workflow's package run by the
        runtime's python (inside the runtime, only this workflow's package is added, nothing
        of the host venv), or this interpreter without a prefix."""
        rt = resolve_runtime(self.spec.runtime)
        if rt["prefix"]:
            return [*shlex.split(rt["prefix"]), "env", f"PYTHONPATH={SCRIPTS_DIR}",
                    rt["python"]]
        return [rt["python"]]

    def on_node(self, node: Node, inner: list[str]) -> list[str]:
        """``inner`` run on ``node``: its own ``srun --overlap`` step inside the job."""
        if not self.job_id:
            return inner
        return ["srun", "--overlap", f"--jobid={self.job_id}", "--nodes=1", "--ntasks=1",
                f"--nodelist={node.name}", "--kill-on-bad-exit=1", "--export=ALL", *inner]

    def node_cmd(self, node: Node, role: str, ports: Ports, head_address: str | None) -> list[str]:
        scope = self.scope(node)
        temp = Path(self.ray.temp_root) / f"hy3rl-ray-{self.job_id or os.getpid()}-{node.name}"
        rt = resolve_runtime(self.spec.runtime)
        inner = [*self.entry(), "-m", "hy3rl.raynode", "node", "--name", node.name,
                 "--role", role, "--temp-dir", str(temp), "--scope", scope,
                 "--ports", json.dumps(asdict(ports)),
                 "--num-cpus", str(self.spec.ray_cpus or self.spec.cpus_per_node),
                 "--num-gpus", str(self.spec.gpus_per_node),
                 "--grace", str(self.ray.stop_grace_s),
                 "--setup", self.ray.node_setup]
        if role == "head":
            inner += ["--publish", str(self.spec.log_dir / "head.json")]
        else:
            inner += ["--head-address", str(head_address)]
        if rt["prefix"]:
            inner += ["--ray-cli", "ray"]
        inner += ["--progress-out", str(self.spec.log_dir / PROGRESS_DIR / f"{node.name}.json"),
                  "--progress-every", f"{self.spec.progress_every_s:g}"]
        if self.spec.node_logs_mb > 0:
            inner += ["--logs-out", str(self.spec.log_dir / "nodes" / node.name),
                      "--logs-cap-mb", f"{self.spec.node_logs_mb:g}"]
        return self.on_node(node, inner)

    def diagnose(self, timeout: float = 120) -> dict[str, Any]:
        """While a hung attempt still runs: on every node at once (its own step, inside the
        runtime), ``hy3rl.nodelogs diagnose`` writes ``ray stack``, the driver's stack, the
        GPU list and the scope's processes to ``<log_dir>/hang/<node>/``. Returns what was
        and was not collected; a node whose step does not finish in ``timeout`` is named."""
        out = self.spec.log_dir / "hang"
        ray_cli = "ray" if resolve_runtime(self.spec.runtime)["prefix"] else RAY
        procs = {}
        for n in self.nodes:
            (out / n.name).mkdir(parents=True, exist_ok=True)
            cmd = self.on_node(n, [*self.entry(), "-m", "hy3rl.nodelogs", "diagnose",
                                   "--scope", self.scope(n), "--out", str(out / n.name),
                                   "--ray-cli", ray_cli, "--timeout", str(timeout / 2)])
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}
            env["HY3RL_NODE"] = n.name
            with open(out / n.name / "step.log", "ab") as fh:
                procs[n.name] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, env=env,
                                                 start_new_session=True)
        deadline = time.monotonic() + timeout
        result: dict[str, Any] = {"dir": str(out), "collected": {}, "not_collected": {}}
        for name, proc in procs.items():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
            try:
                found = json.loads((out / name / "diagnostics.json").read_text())
            except (OSError, ValueError):
                why = ("timed out" if code is None else f"its step exited {code}")
                result["not_collected"][f"{name}/all"] = f"diagnostics on {name} {why}; " \
                    f"see {out / name / 'step.log'}"
                continue
            result["collected"][name] = list(found.get("collected") or [])
            for what, why in (found.get("not_collected") or {}).items():
                result["not_collected"][f"{name}/{what}"] = why
        redact_files(make_redactor(dict(os.environ), []),
                     [f for f in out.rglob("*") if f.is_file()])
        self.phase("hang diagnostics in %s: collected %s; not collected %s", out,
                   result["collected"], result["not_collected"])
        return result

    # ---- phases
    def discover(self) -> None:
        if self.job_id:
            self.nodes = slurm_nodes(self.job_id)
        else:
            self.nodes = [Node(socket.gethostname(), socket.gethostname(),
                               os.cpu_count(), local_gpus())]
        check_allocation(self.nodes, self.spec)
        lost = [n.name for n in self.nodes if n.name in self.spec.exclude]
        if lost:
            usable = [n for n in self.nodes if n.name not in self.spec.exclude]
            if len(usable) < self.spec.nodes:
                raise LaunchError(
                    f"node(s) {', '.join(lost)} lost earlier in this job: {len(usable)} usable "
                    f"node(s) left, the layout needs cluster.nodes={self.spec.nodes}; the job "
                    "ends for a resubmission without them",
                    f"layout does not fit without lost node(s) {' '.join(lost)}",
                    "node_lost", lost)
            self.nodes = usable[:self.spec.nodes]
            self.phase("not using node(s) lost earlier in this job: %s", ", ".join(lost))
        self.phase("nodes: %s (job %s)", ", ".join(n.name for n in self.nodes),
                   self.job_id or "local")

    def start_head(self, ports: Ports) -> dict[str, Any]:
        head = self.nodes[0]
        np_ = NodeProc(head, "head", self.node_cmd(head, "head", ports, None),
                       self.spec.log_dir / f"node-{head.name}.log", self.ray_env())
        self.procs[head.name] = np_
        np_.start()
        published = self.spec.log_dir / "head.json"
        deadline = time.monotonic() + self.ray.head_timeout_s
        info = None
        while time.monotonic() < deadline:
            self.check_stop()
            if info is None and published.exists():
                info = json.loads(published.read_text())
            if info is not None:
                addr = f"{info['ip']}:{info['gcs_port']}"
                try:
                    hc = subprocess.run([RAY, "health-check", "--address", addr],
                                        capture_output=True, timeout=60,
                                        stdin=subprocess.DEVNULL,
                                        env={**without_auth(dict(os.environ)), **self.ray_env()})
                except subprocess.TimeoutExpired:
                    hc = None  # not alive yet: asked again until head_timeout_s
                if hc is not None and hc.returncode == 0:
                    self.phase("head GCS alive at %s", addr)
                    return info
            self.stop_event.wait(1.0)
        raise LaunchError(f"Ray head on {head.name} not alive after "
                          f"{self.ray.head_timeout_s:g}s; {np_.logfile}:\n{np_.tail()}",
                          f"ray failed to start on {head.name}", "ray_failed", [head.name])

    def check_ray(self, info: dict[str, Any]) -> None:
        """One Ray on both sides, before any worker starts or anything is submitted: the job
        client's Ray (this env) against the cluster's (published by the head in head.json;
        else probed through the runtime). Recorded (``on_ray``) before a mismatch refuses."""
        cluster, source = info.get("ray_version"), "head.json"
        if not cluster:
            try:
                cluster, source = runtime_ray_version(self.spec.runtime), "runtime probe"
            except LaunchError as exc:
                cluster, source = None, f"unknown: {exc}"
        self.ray_versions = {**ray_versions(client_ray_version(), cluster),
                             "client_cli": RAY, "cluster_from": source}
        self.phase("ray versions: job client %s (%s), cluster %s (%s)",
                   self.ray_versions["client"], RAY, cluster, source)
        if self.ray_versions["match"] is None:
            log.warning("cannot compare the Ray versions of the job client and the cluster "
                        "(client %s, cluster %s): submitting anyway",
                        self.ray_versions["client"], cluster)
        if self.on_ray:
            try:
                self.on_ray(dict(self.ray_versions))
            except Exception as exc:  # recording must not stop the launch
                log.warning("on_ray: %s", exc)
        refuse_mismatch(self.ray_versions, self.spec.runtime)

    def start_workers(self, plan: dict[str, Ports], address: str) -> None:
        for n in self.nodes[1:]:
            np_ = NodeProc(n, "worker", self.node_cmd(n, "worker", plan[n.name], address),
                           self.spec.log_dir / f"node-{n.name}.log", self.ray_env())
            self.procs[n.name] = np_
            np_.start()

    def registered(self, client_nodes: list) -> tuple[list[str], float]:
        alive = [n for n in client_nodes if n.state == "ALIVE"]
        seen = set()
        gpus = 0.0
        for n in alive:
            res = n.resources_total or {}
            gpus += res.get("GPU", 0)
            for key in res:
                if key.startswith("hy3rl_node_"):
                    seen.add(key[len("hy3rl_node_"):])
        missing = [n.name for n in self.nodes if n.name not in seen]
        return missing, gpus

    def list_nodes(self) -> list:
        """The cluster's nodes (Ray's state API, with the launch's token)."""
        from ray.util.state.api import StateApiClient
        from ray.util.state.common import ListApiOptions, StateResource

        client = StateApiClient(address=self.dashboard, headers=self.headers())
        return client.list(StateResource.NODES, ListApiOptions(detail=True, limit=10000,
                                                               timeout=10),
                           raise_on_missing_output=False)

    def wait_registered(self) -> None:
        want_gpus = self.spec.gpus_per_node * len(self.nodes)
        deadline = time.monotonic() + self.ray.register_timeout_s
        retries = {n.name: 0 for n in self.nodes[1:]}
        missing = [n.name for n in self.nodes]
        gpus = 0.0
        while time.monotonic() < deadline:
            # Retry workers whose step ended before registering (backoff), up to the limit.
            for name, np_ in self.procs.items():
                code = np_.poll()
                if code is not None and np_.role == "worker" and name in missing \
                        and retries[name] < self.ray.worker_start_retries:
                    retries[name] += 1
                    wait = 2 ** retries[name]
                    self.phase("worker %s exited %s before registering; retry %d in %ds:\n%s",
                               name, code, retries[name], wait, np_.tail(5))
                    self.stop_event.wait(wait)
                    np_.start()
            self.check_stop()
            try:
                missing, gpus = self.registered(self.list_nodes())
            except Exception as exc:  # dashboard still starting
                log.debug("list_nodes: %s", exc)
            if not missing and gpus >= want_gpus:
                self.phase("all %d node(s) and %d GPU(s) registered", len(self.nodes), gpus)
                return
            self.stop_event.wait(1.0)
        raise LaunchError(
            f"after {self.ray.register_timeout_s:g}s, node(s) not registered with Ray: "
            f"{', '.join(missing) or 'none'}; GPUs registered {gpus:g} of {want_gpus}. "
            f"Node logs in {self.spec.log_dir}", f"nodes not registered: {' '.join(missing)}",
            "ray_failed", missing)

    def merged_runtime_env(self) -> Path:
        """The runtime env ``ray job submit`` reads: deps' runtime env with this launch's
        ``env_vars``, less every secret (hy3rl.redact's one policy), which goes through a
        0600 file instead (hy3rl.jobenv: Ray writes a runtime env's ``env_vars`` in its
        logs); the runtime env names that file and Ray's ``worker_process_setup_hook`` that
        reads it in every worker of the job."""
        import yaml

        try:
            base = yaml.safe_load(self.spec.runtime_env.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise LaunchError(f"{self.spec.runtime_env}: cannot read the runtime env: {exc}")\
                from None
        env = {str(k): str(v) for k, v in (base.get("env_vars") or {}).items()}
        # Megatron-Bridge's loading bar drawn as it advances (hy3rl.loadwatch); a runtime
        # env or the launch may set it otherwise
        env = {**LOAD_BAR_ENV, **env}
        env.update({k: str(v) for k, v in self.spec.env_vars.items()})
        env.update({n: os.environ[n] for n in self.spec.passthrough_env if n in os.environ})
        # verl's plugin hook takes a list of modules: one passed through from the user's
        # environment is loaded beside the launch's own (the CPU path's), never instead of it
        if PLUGINS in self.spec.passthrough_env and PLUGINS in self.spec.env_vars:
            env[PLUGINS] = join_modules(self.spec.env_vars[PLUGINS], env[PLUGINS])
        # hy3rl.redact's one policy: values under secret-looking names, known token shapes.
        self.redactor = make_redactor(env, [])
        # A secret: under a secret-looking name, or a value that is a token as a whole (a
        # path holding a hex component stays: workers read PYTHONPATH before any hook runs).
        secrets = {k: v for k, v in env.items()
                   if is_secret_key(k) or (v and self.redactor.text(v).strip() == REDACTED)}
        public = {k: v for k, v in env.items() if k not in secrets}
        merged = {**base, "env_vars": public}
        self.job_env = None
        if secrets:
            if base.get("worker_process_setup_hook"):
                raise LaunchError(f"{self.spec.runtime_env}: a worker_process_setup_hook "
                                  f"({base['worker_process_setup_hook']!r}) cannot be combined "
                                  f"with the launch's secrets ({', '.join(sorted(secrets))}), "
                                  "which reach the job through hy3rl.jobenv's hook")
            self.job_env = jobenv.write(self.spec.log_dir, secrets)
            self.secret_files.append(self.job_env)
            public[jobenv.ENV_VAR] = str(self.job_env)
            merged["worker_process_setup_hook"] = jobenv.HOOK
        # No secret in it; a private temp file all the same (0600), removed in the teardown;
        # the attempt's folder keeps a copy, redacted.
        fd, name = tempfile.mkstemp(prefix="hy3rl-runtime-env-", suffix=".yaml")
        with os.fdopen(fd, "w") as fh:
            fh.write(yaml.safe_dump(merged, sort_keys=False))
        self.secret_files.append(Path(name))
        kept = self.spec.log_dir / "runtime_env.yaml"
        write_text_atomic(kept, yaml.safe_dump(self.redactor(merged), sort_keys=False))
        self.phase("runtime env %s (from %s; copy %s): env_vars %s; secrets %s through %s "
                   "(0600)", name, self.spec.runtime_env, kept, self.redactor(public),
                   sorted(secrets) or "none", self.job_env or "-")
        return Path(name)

    def run_job(self, runtime_env: Path) -> tuple[int, str, str]:
        """Submit the Ray job and supervise it until Ray says it ended (a terminal status:
        hy3rl.rayjob); the watchdog is polled meanwhile. Returns (exit code, reason, Ray's
        status)."""
        self.job = job = JobRun(
            self.dashboard, self.spec.submission_id, RAY, self.spec.log_dir / "driver.log",
            env={**without_auth(dict(os.environ)), **self.ray_env()}, headers=self.headers(),
            redact=self.redactor.text, timeout_s=self.ray.dashboard_timeout_s)
        command = ["bash", str(self.spec.launch_script), *self.spec.launch_args]
        cmd = job.submit(runtime_env, jobenv.entrypoint(command) if self.job_env else command)
        self.submitted = True
        self.phase("submitted: %s", shlex.join(cmd))
        monitor = self.spec.monitor
        if monitor is not None:
            monitor.start()
        status_every = max(1.0, min(self.spec.poll_s, 10.0))
        next_poll = next_status = time.monotonic()
        status = None
        outage = Outage(self.ray.dashboard_outage_s)
        while True:
            self.check_stop()
            now = time.monotonic()
            if monitor is not None and now >= next_poll:
                next_poll = now + self.spec.poll_s
                request = monitor.poll()
                if request is not None:
                    self.watchdog_stop(request)
            if now >= next_status:
                status = job.status()  # bounded: None within train.ray.dashboard_timeout_s
                now = time.monotonic()
                next_status = now + status_every
                if status in TERMINAL:
                    break
                if status is None:
                    if monitor is not None:
                        monitor.blind()  # the log stream is down with the dashboard
                    failed = job.submit_failed()
                    if failed:
                        raise LaunchError(failed, "ray job submit failed")
                    if job.unregistered:
                        pass  # the dashboard answered; the submission is on its way
                    elif outage.unanswered(now, self.dashboard):
                        # Past the ride-out: most likely the head died; let a node's step
                        # end first (that names the lost node).
                        if self.procs:
                            self.stop_event.wait(15)
                        self.check_stop()
                        raise LaunchError(outage.message(self.spec.submission_id,
                                                         self.dashboard),
                                          "ray job status unavailable")
                    else:
                        # While it does not answer, ask less often: the loop stays free for
                        # the watchdog and the signals.
                        next_status = now + max(status_every, 3 * job.timeout_s)
                else:
                    outage.answered(now, self.dashboard)
                    if not job.stream_open():
                        job.reattach()
            self.stop_event.wait(min(0.5, self.spec.poll_s))
        self.job_done = True
        job.close()
        self.check_stop()
        try:
            info = job.info()
        except Exception as exc:  # the status said how it ended: its exit code is unknown
            log.warning("ray job info of %s unavailable: %s", self.spec.submission_id, exc)
            info = None
        code = getattr(info, "driver_exit_code", None)
        self.phase("ray job %s: %s (driver exit code %s; log stream re-attached %d time(s)) "
                   "%s", self.spec.submission_id, status, code, job.reattached,
                   getattr(info, "message", None) or "")
        if status == "SUCCEEDED":
            return 0, "succeeded", status
        exit_code = int(code) if isinstance(code, int) and code != 0 else 1
        if status == "STOPPED":
            return exit_code, "trainer stopped (STOPPED)", status
        return exit_code, f"trainer failed ({status}, exit {code})", status

    def watchdog_stop(self, request: StopRequest) -> None:
        """End the attempt for the watchdog: a hang is diagnosed first (while its processes
        still live); the teardown then stops the Ray job and Ray on every node."""
        self.phase("watchdog: %s", request.message)
        self.watch = request
        if request.diagnose:
            try:
                self.diagnostics = self.diagnose()
            except Exception as exc:  # diagnostics must never keep a hung job alive
                log.warning("hang diagnostics failed: %s", exc)
                self.diagnostics = {"dir": str(self.spec.log_dir / "hang"), "collected": {},
                                    "not_collected": {"all": f"diagnostics failed: {exc}"}}
        raise LaunchError(request.message, request.message, request.outcome)

    def teardown(self) -> None:
        self.phase("teardown")
        if self.job is not None:
            if self.submitted and not self.job_done:
                # Bounded: SLURM's KillWait after a SIGTERM may be a few seconds only.
                self.job.stop()
            self.job.close()
        # Workers first, the head last. Under srun, SIGUSR1 is forwarded to the node wrapper
        # (which stops Ray and its scope, then exits); SIGTERM would make srun cancel the
        # step at once and leave no time for that. Then SIGTERM, then SIGKILL.
        order = list(reversed(list(self.procs.values())))
        polite = signal.SIGUSR1 if self.job_id else signal.SIGTERM
        grace = self.ray.stop_grace_s + 10
        for sig, wait in ((polite, grace), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            running = [np_ for np_ in order if np_.proc and np_.proc.poll() is None]
            if not running:
                break
            if sig != polite:
                self.phase("node(s) %s did not stop in time: %s",
                           ", ".join(np_.node.name for np_ in running), sig.name)
            for np_ in running:
                with contextlib.suppress(ProcessLookupError):
                    np_.proc.send_signal(sig)
            deadline = time.monotonic() + wait
            for np_ in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    np_.proc.wait(max(0.1, deadline - time.monotonic()))
        self.phase("Ray stopped on %d node(s)", len(order))
        for path in self.secret_files:
            path.unlink(missing_ok=True)

    def run(self, on_nodes: Callable[[list[str]], None] | None = None) -> LaunchResult:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.log_dir / "head.json").unlink(missing_ok=True)
        code, reason, status = 1, "launcher error", None
        outcome, lost = "launcher_error", []
        try:
            self.discover()
            self.auth = AuthToken.create(self.spec.log_dir)
            self.secret_files.append(self.auth.path)
            rt = resolve_runtime(self.spec.runtime)
            self.phase("runtime: prefix %r, python %s", rt["prefix"], rt["python"])
            if on_nodes:
                on_nodes([n.name for n in self.nodes])
            key = int(self.job_id) if self.job_id and self.job_id.isdigit() else os.getpid()
            plan = port_plan(key, self.nodes, self.ray)
            write_json_atomic(self.spec.log_dir / "ray.json", {
                "job_id": self.job_id, "nodes": [asdict(n) for n in self.nodes],
                "ports": {k: asdict(v) for k, v in plan.items()}})
            info = self.start_head(plan[self.nodes[0].name])
            self.check_ray(info)
            self.dashboard = f"http://{info['ip']}:{info['dashboard_port']}"
            self.start_workers(plan, f"{info['ip']}:{info['gcs_port']}")
            self.wait_registered()
            runtime_env = self.merged_runtime_env()
            code, reason, status = self.run_job(runtime_env)
            outcome = "succeeded" if code == 0 else "failed"
        except LaunchError as exc:
            (log.info if exc.outcome == "planned_kill" else log.error)("%s", exc)
            code, reason, outcome, lost = 1, exc.reason, exc.outcome, exc.lost_nodes
            if outcome == "succeeded":  # the watchdog stopped a trainer done but not exiting
                code = 0
            if self.stop_reason:
                code, reason = 128 + _SIGNUMS.get(self.stop_reason, 15), self.stop_reason
                outcome, lost = "signal", []
        finally:
            self.teardown()
        self.phase("exit %d: %s", code, reason)
        return LaunchResult(code, reason, [n.name for n in self.nodes], status,
                            dict(self.ray_versions), outcome, lost,
                            self.watch.step if self.watch else None, self.diagnostics)


_SIGNUMS = {f"signal {s.name}": s.value for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}


def launch(spec: LaunchSpec, on_nodes: Callable[[list[str]], None] | None = None,
           on_stop: Callable[[str], None] | None = None,
           on_ray: Callable[[dict[str, Any]], None] | None = None) -> LaunchResult:
    """Run one training job on Ray (see the module docstring). Signal handlers for SIGTERM,
    SIGINT and SIGUSR1 are installed for the duration (main thread only); ``on_stop(reason)``
    is called at the first one, before the teardown (to record it while there is time).
    ``on_ray(versions)``: the job client's and the cluster's Ray versions, once the head
    runs (:func:`ray_versions` plus ``client_cli``, ``cluster_from``), before a mismatch
    refuses the submission."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(spec.log_dir / "launcher.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logging.getLogger("hy3rl").addHandler(handler)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("hy3rl").setLevel(logging.INFO)
    launcher = Launcher(spec)
    launcher.on_stop = on_stop
    launcher.on_ray = on_ray
    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            old[s] = signal.signal(s, lambda n, _f: launcher.request_stop(
                f"signal {signal.Signals(n).name}"))
    try:
        return launcher.run(on_nodes)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        logging.getLogger("hy3rl").removeHandler(handler)
        handler.close()
