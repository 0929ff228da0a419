"""The node side of the Ray-on-SLURM launcher: what runs on each node, in its own
``srun --overlap`` step inside ``train.runtime`` (``python -m hy3rl.raynode node ...``, built
by ``hy3rl.launch.Launcher.node_cmd``; not a user command).

:func:`node_main` wraps ``ray start --block`` with the ports the launcher planned, in a
scope: every process it starts carries ``HY3RL_RAY_SCOPE=<scope>`` in its environment, and
exactly that scope is killed on exit or on a signal (never ``ray stop``, which would kill
other jobs' Ray on a shared host). The head publishes its address and Ray version in
``head.json``. Beside Ray, the node agent (``--progress-out``, :mod:`hy3rl.loadwatch`)
reports the model-load progress of the scope's processes every ``--progress-every``
seconds. Before the node's temp dir is removed, its Ray logs are copied (capped) to the
attempt's folder and redacted.

Needs only the standard library, ``psutil`` and ``ray`` in the runtime (so it imports only
standard-library parts of ``hy3rl`` at its top).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from hy3rl.atomic import write_text_atomic
from hy3rl.redact import Redactor, make_redactor

log = logging.getLogger("hy3rl.raynode")

SCOPE_VAR = "HY3RL_RAY_SCOPE"
# The Ray CLI of this interpreter's environment, else the one on PATH (the driver side, and
# the node side without a train.runtime prefix; with one the node uses --ray-cli on PATH).
RAY = str(Path(sys.executable).with_name("ray")) \
    if Path(sys.executable).with_name("ray").exists() else "ray"


@dataclass
class Ports:
    gcs: int
    dashboard: int
    client_server: int
    node_manager: int
    object_manager: int
    agent_grpc: int
    agent_listen: int
    metrics: int
    runtime_env_agent: int
    min_worker: int
    max_worker: int


def scope_processes(scope: str) -> list:
    """Processes (of any name: Ray retitles its workers) whose environment carries
    ``HY3RL_RAY_SCOPE=<scope>``, and their descendants, excluding this process
    (hy3rl.nodelogs.scope_processes: the one definition of a node's scope)."""
    from hy3rl.nodelogs import scope_processes as in_scope

    return in_scope(scope)


def kill_scope(scope: str, grace: float) -> int:
    """SIGTERM every process of the scope, SIGKILL what is left after ``grace`` seconds."""
    import psutil

    procs = scope_processes(scope)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


def redact_files(redactor: Redactor, paths: list[Path]) -> int:
    """Rewrite the files (copied logs, diagnostics) whose text holds a secret, with it
    ``[REDACTED]``; returns how many changed. Unreadable files are left as they are."""
    changed = 0
    for path in paths:
        try:
            text = path.read_bytes().decode(errors="surrogateescape")
            clean = redactor.text(text)
            if clean != text:
                write_text_atomic(path, clean.encode(errors="surrogateescape")
                                  .decode(errors="replace"))
                changed += 1
        except OSError as exc:
            log.warning("%s: not redacted: %s", path, exc)
    return changed


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def node_main(args: argparse.Namespace) -> int:
    """Runs on one node (in its own srun step): ``ray start --block`` with the given ports,
    in a scope that is killed completely on exit or signal."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"%(asctime)s node {args.name} %(levelname)s: %(message)s")
    ports = Ports(**json.loads(args.ports))
    temp = Path(args.temp_dir)
    killed = kill_scope(args.scope, 2)  # leftovers of an earlier start with this scope
    if killed:
        log.info("cleaned up %d leftover process(es) of scope %s", killed, args.scope)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True, exist_ok=True)
    os.environ[SCOPE_VAR] = args.scope
    os.environ["HY3RL_NODE"] = args.name
    if not args.ray_cli:
        # No train.runtime prefix: Ray, its workers and the Ray job (launch.sh's `python3`)
        # run in this interpreter's environment, whose bin directory goes first on PATH.
        os.environ["PATH"] = os.pathsep.join(
            p for p in (str(Path(sys.executable).parent), os.environ.get("PATH", "")) if p)
    ray_cli = RAY
    if args.ray_cli:
        ray_cli = shutil.which(args.ray_cli) or ""
        if not ray_cli:
            log.error("%r not found on this runtime's PATH (%s): train.runtime must provide "
                      "Ray", args.ray_cli, os.environ.get("PATH", ""))
            return 3
    log.info("runtime: python %s, ray CLI %s", sys.executable, ray_cli)
    cmd = [ray_cli, "start", "--block", "--disable-usage-stats", f"--temp-dir={temp}",
           f"--num-cpus={args.num_cpus}", f"--num-gpus={args.num_gpus}",
           f"--node-manager-port={ports.node_manager}",
           f"--object-manager-port={ports.object_manager}",
           f"--dashboard-agent-grpc-port={ports.agent_grpc}",
           f"--dashboard-agent-listen-port={ports.agent_listen}",
           f"--metrics-export-port={ports.metrics}",
           f"--runtime-env-agent-port={ports.runtime_env_agent}",
           f"--min-worker-port={ports.min_worker}", f"--max-worker-port={ports.max_worker}",
           "--resources=" + json.dumps({f"hy3rl_node_{args.name}": 1})]
    if args.role == "head":
        busy = [p for p in (ports.gcs, ports.dashboard, ports.client_server)
                if not _port_free(p)]
        if busy:
            log.error("port(s) %s already in use on %s: another Ray? (train.ray.port_base)",
                      busy, socket.gethostname())
            return 4
        import ray
        import ray.util

        ip = ray.util.get_node_ip_address()
        cmd += ["--head", f"--node-ip-address={ip}", f"--port={ports.gcs}",
                "--include-dashboard=true", f"--dashboard-host={ip}",
                f"--dashboard-port={ports.dashboard}",
                f"--ray-client-server-port={ports.client_server}"]
        # The cluster's Ray: the version this (the runtime's) interpreter imports; the
        # launcher compares it with its job client's before submitting.
        write_text_atomic(Path(args.publish), json.dumps(
            {"node": args.name, "ip": ip, "gcs_port": ports.gcs,
             "dashboard_port": ports.dashboard, "ray_version": ray.__version__,
             "python": sys.executable, "python_version": platform.python_version()}))
    else:
        cmd += [f"--address={args.head_address}"]
    setup = args.setup or ":"
    full = ["bash", "-c", f"set -e\n{setup}\nexec \"$@\"", "hy3rl-node-setup", *cmd]
    log.info("starting: %s", shlex.join(cmd))
    sys.stdout.flush()
    child = subprocess.Popen(full, start_new_session=True)
    stopping = threading.Event()
    agent_stop = threading.Event()
    if args.progress_out:
        # the node agent: model-load progress of this node's processes (hy3rl.loadwatch)
        from hy3rl.loadwatch import LoadWatch, job_pids, run_agent, worker_outputs

        watch = LoadWatch(args.name, lambda: job_pids(args.scope), lambda: worker_outputs(temp))
        threading.Thread(target=run_agent, daemon=True, name="loadwatch",
                         args=(watch, Path(args.progress_out), args.progress_every,
                               agent_stop)).start()
    grace = [float(args.grace)]

    def on_signal(signum, _frame):
        if not stopping.is_set():
            stopping.set()
            if signum == signal.SIGTERM:
                # From SLURM itself (time limit, scancel): SIGKILL follows after KillWait
                # (5 s on the test cluster), so stop fast. SIGUSR1 is the launcher's polite stop.
                grace[0] = min(grace[0], 2.0)
            log.info("%s: stopping Ray on this node", signal.Signals(signum).name)
            with contextlib.suppress(ProcessLookupError):
                child.terminate()

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(s, on_signal)
    code = None
    while code is None:
        try:
            code = child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if stopping.is_set():
                try:
                    code = child.wait(timeout=grace[0])
                except subprocess.TimeoutExpired:
                    child.kill()
                    code = child.wait()
    agent_stop.set()
    n = kill_scope(args.scope, min(2.0, grace[0]))
    log.info("ray start exited %s; %d process(es) of the scope stopped", code, n)
    if args.logs_out:
        # The node's Ray logs outlive its temp dir (capped, each file's tail kept).
        try:
            from hy3rl.nodelogs import copy_ray_logs

            copied = copy_ray_logs(temp, Path(args.logs_out), int(args.logs_cap_mb * 2**20))
            # Ray logs the runtime env (passed-through keys included): redact the copies
            # with the one policy, knowing this step's environment (the launcher's).
            redact_files(make_redactor(dict(os.environ), []),
                         [Path(args.logs_out) / f for f in copied["files"]])
            log.info("Ray logs: %d file(s), %d bytes copied to %s", len(copied["files"]),
                     copied["bytes"], args.logs_out)
        except Exception as exc:  # the teardown goes on without them
            log.warning("Ray logs not copied to %s: %s", args.logs_out, exc)
    shutil.rmtree(temp, ignore_errors=True)
    return 0 if stopping.is_set() else (code or 1)


# --------------------------------------------------------------------------- launcher


def main(argv: list[str] | None = None) -> int:
    """``python -m hy3rl.raynode node ...``: the internal entry point each node's step runs
    (inside ``train.runtime``; built by :meth:`Launcher.node_cmd`), not a user command."""
    ap = argparse.ArgumentParser(prog="hy3rl.raynode", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    nd = sub.add_parser("node", help="(internal) run Ray on this node until stopped")
    nd.add_argument("--name", required=True)
    nd.add_argument("--role", choices=["head", "worker"], required=True)
    nd.add_argument("--temp-dir", required=True)
    nd.add_argument("--scope", required=True)
    nd.add_argument("--ports", required=True)
    nd.add_argument("--num-cpus", type=int, required=True)
    nd.add_argument("--num-gpus", type=int, required=True)
    nd.add_argument("--grace", type=float, required=True)
    nd.add_argument("--setup", default="")
    nd.add_argument("--publish")
    nd.add_argument("--head-address")
    nd.add_argument("--logs-out", default="",
                    help="copy this node's Ray logs there before removing its temp dir")
    nd.add_argument("--logs-cap-mb", type=float, default=0.0)
    nd.add_argument("--progress-out", default="",
                    help="the node agent's report of model-load progress (hy3rl.loadwatch)")
    nd.add_argument("--progress-every", type=float, default=30.0)
    nd.add_argument("--ray-cli", default="",
                    help="Ray CLI name resolved on this (runtime's) PATH; default: the one "
                         "next to this interpreter, else PATH")
    return node_main(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
