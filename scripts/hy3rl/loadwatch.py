"""Model-load progress on one node, read from its processes (issue 44): what the node
agent (``hy3rl.raynode``, beside ``ray start`` on every node) reports to the supervisor.

Inside the Megatron model load nothing in the trainer's output moves: Megatron-Bridge's
loading bar is drawn only at its end when its output is not a terminal, and Ray, vLLM and
NCCL go on printing whether the load progresses or not. Two signals do move, on the
processes of the node's Ray scope (``HY3RL_RAY_SCOPE``, :func:`hy3rl.nodelogs.
scope_processes`):

- **the kernel's counters** of the job's processes (the scope less Ray's daemons,
  :func:`job_pids`): Megatron-Bridge reads the HF shards memory-mapped
  (safetensors), so a load shows as page faults (``/proc/<pid>/stat`` fields 10 and 12,
  minor and major) and as the shard files mapped (``/proc/<pid>/maps``); ``rchar`` and file
  offsets do not move, ``read_bytes`` (``/proc/<pid>/io``) only on a cold local disk. An idle
  Ray actor adds about 200 faults a minute: a process counts as progressing above
  :data:`FAULTS_PER_MIN`.
- **the loading bar** (``model_bridge.py`` ``_with_progress_tracking`` at the pin: a rich
  Progress ``Loading from <model> ... (<done>/<total>) <Bridge>`` on rank 0), printed as it
  advances when the job's environment has ``TTY_COMPATIBLE=1`` (the launcher sets it), in
  the Ray worker's output file on the node (``<temp>/session_latest/logs/worker-*.out``,
  which Ray forwards to the driver only line by line: the bar redraws with ``\\r``).

:class:`LoadWatch` samples both every ``every_s`` seconds and writes ``<out>`` (one JSON
object, replaced whole): ``{"node", "t", "last_progress", "why", "processes", "faults_per_min",
"shards", "bar"}``; ``t`` and ``last_progress`` are this node's clock (epoch seconds), so
``t - last_progress`` (how long nothing progressed here) does not depend on the clocks of
the other hosts. ``hy3rl.watchdog.Monitor`` reads the files of every node: the model load
is hung when no node progressed for its limit, and the node that stopped first is the
evidence for its exclusion (``hy3rl.train.after_attempt``).

Standard library and ``psutil`` only (it runs inside the training runtime, beside Ray).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_text_atomic

FAULTS_PER_MIN = 2000.0  # a process faulting faster is progressing (an idle actor: ~200)
READ_BYTES_STEP = 16 << 20  # or reading this much from disk between two samples
BAR = re.compile(r"Loading from (\S+).*?\((\d+)/(\d+)\)")
BAR_TAIL = 64 << 10  # bytes of a worker's output read for the bar
# What makes rich draw the bar through a pipe (set on the job): a terminal, and one wide
# enough that the bar's count is not elided (rich's default 80 columns cut it to "…").
ENV = {"TTY_COMPATIBLE": "1", "COLUMNS": "400"}
# Ray's own daemons in the scope: not the job's processes (gcs_server alone faults about
# 2,000 times a minute on an idle head: counted, no load would ever look hung)
RAY_DAEMONS = ("gcs_server", "/raylet", "ray/dashboard/", "ray-dashboard-", "log_monitor",
               "ray/autoscaler/", "ray.util.client.server", "ray/_private/monitor",
               "ray::DashboardAgent", "ray::RuntimeEnvAgent", "runtime_env/agent")
PROGRESS_DIR = "progress"  # in the attempt's log folder: <node>.json, each node's report


@dataclass(frozen=True)
class ProcState:
    """One process's counters at a sample."""

    faults: int
    read_bytes: int | None
    shards: frozenset[str]


def proc_state(pid: int, proc: Path = Path("/proc")) -> ProcState | None:
    """A process's page faults (minor + major), the bytes it read from disk (None: not
    readable) and the ``*.safetensors`` files it maps; None when it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        maps = (proc / str(pid) / "maps").read_text()
    except (OSError, ValueError):
        return None
    # after "(comm)": state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
    rest = stat[stat.rindex(")") + 2:].split()
    faults = int(rest[7]) + int(rest[9])
    shards = frozenset(line.split(None, 5)[5] for line in maps.splitlines()
                       if line.endswith(".safetensors") and len(line.split(None, 5)) == 6)
    read = None
    try:
        for line in (proc / str(pid) / "io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                read = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return ProcState(faults, read, shards)


def last_bar(paths: Iterable[Path]) -> tuple[str, int, int] | None:
    """The newest state of Megatron-Bridge's loading bar in these output files: (model,
    done, total) from the last redraw in the newest file that has one."""
    best: tuple[float, tuple[str, int, int]] | None = None
    for path in paths:
        try:
            st = path.stat()
            with open(path, "rb") as fh:
                fh.seek(max(0, st.st_size - BAR_TAIL))
                text = fh.read().decode(errors="replace")
        except OSError:
            continue
        for segment in reversed(re.split(r"[\r\n]", text)):
            m = BAR.search(segment)
            if m:
                if best is None or st.st_mtime > best[0]:
                    best = (st.st_mtime, (m.group(1), int(m.group(2)), int(m.group(3))))
                break
    return best[1] if best else None


def job_pids(scope: str) -> list[int]:
    """The processes of the node's Ray scope that are the job's (its driver and workers):
    the scope's less Ray's daemons (:data:`RAY_DAEMONS`)."""
    from hy3rl.nodelogs import scope_processes

    pids = []
    for p in scope_processes(scope):
        try:
            cmd = " ".join(p.cmdline())
        except Exception:  # noqa: BLE001 - gone or unreadable: not counted
            continue
        if not any(d in cmd for d in RAY_DAEMONS):
            pids.append(p.pid)
    return pids


def worker_outputs(temp_dir: Path) -> list[Path]:
    """The Ray workers' output files of the node's newest session."""
    logs = temp_dir / "session_latest" / "logs"
    try:
        return sorted(p for p in logs.iterdir()
                      if p.name.startswith("worker-") and p.suffix in (".out", ".err"))
    except OSError:
        return []


class LoadWatch:
    """Samples the scope's processes and the loading bar; :meth:`sample` says whether
    anything progressed since the previous sample and returns the node's report."""

    def __init__(self, node: str, pids: Callable[[], list[int]],
                 outputs: Callable[[], list[Path]] = lambda: [],
                 clock: Callable[[], float] = time.time,
                 proc: Path = Path("/proc")) -> None:
        self.node, self.pids, self.outputs, self.clock, self.proc = (node, pids, outputs,
                                                                     clock, proc)
        self.seen: dict[int, ProcState] = {}
        self.at: float | None = None
        self.bar: tuple[str, int, int] | None = None
        self.last_progress: float | None = None
        self.why = "started"

    def sample(self) -> dict[str, Any]:
        now = self.clock()
        dt_min = max(1e-6, (now - self.at) / 60) if self.at is not None else None
        states = {pid: s for pid in self.pids()
                  if (s := proc_state(pid, self.proc)) is not None}
        why, rate = [], 0.0
        for pid, s in states.items():
            before = self.seen.get(pid)
            if before is None:  # its baseline (Ray starts and retires idle workers)
                continue
            faults = (s.faults - before.faults) / dt_min if dt_min else 0.0
            rate += max(0.0, faults)
            if faults >= FAULTS_PER_MIN:
                why.append(f"process {pid}: {faults:.0f} page faults a minute")
            if s.shards - before.shards:
                names = sorted(os.path.basename(x) for x in s.shards - before.shards)
                why.append(f"process {pid} mapped {', '.join(names)}")
            if s.read_bytes is not None and before.read_bytes is not None \
                    and s.read_bytes - before.read_bytes >= READ_BYTES_STEP:
                why.append(f"process {pid} read {(s.read_bytes - before.read_bytes) >> 20} MiB")
        bar = last_bar(self.outputs())
        if bar is not None and (self.bar is None or bar[1] != self.bar[1] or bar[0] != self.bar[0]):
            why.append(f"loading bar {bar[1]}/{bar[2]}")
        if bar is not None:
            self.bar = bar
        if self.at is None or why:
            self.last_progress = now
            self.why = "; ".join(why) or "started"
        self.seen, self.at = states, now
        shards = sorted({os.path.basename(x) for s in states.values() for x in s.shards})
        return {"node": self.node, "t": round(now, 1),
                "last_progress": round(self.last_progress or now, 1), "why": self.why,
                "processes": len(states), "faults_per_min": round(rate),
                "shards": shards[:16], "bar": list(self.bar[1:]) if self.bar else None}

    def write(self, out: Path) -> dict[str, Any]:
        report = self.sample()
        write_text_atomic(out, json.dumps(report))
        return report


def run_agent(watch: LoadWatch, out: Path, every_s: float, stop: threading.Event) -> None:
    """Until ``stop``: a report every ``every_s`` seconds (errors logged in the report's
    place, never raised: the node's Ray goes on whatever the agent does)."""
    while not stop.is_set():
        try:
            watch.write(out)
        except Exception as exc:  # noqa: BLE001 - the agent must not take the node down
            try:
                write_text_atomic(out.with_suffix(".error"), f"{type(exc).__name__}: {exc}\n")
            except OSError:
                pass
        stop.wait(every_s)


def read_reports(directory: Path) -> dict[str, dict[str, Any]]:
    """Every node's newest report in ``directory`` (``<node>.json``); a file that cannot
    be read or is not a report is left out."""
    out: dict[str, dict[str, Any]] = {}
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return out
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and all(isinstance(doc.get(k), (int, float))
                                         for k in ("t", "last_progress")):
            out[str(doc.get("node") or path.stem)] = doc
    return out
