"""Stage `cluster_probe`: prove the shape of a multi-node GPU allocation before training.

Run inside the SLURM job of rule ``cluster_probe`` (same resource shape as training:
``--nodes=N``, gres ``gpu[:type]:G`` per node, one task per node, exclusive). It finds the
job's nodes (``squeue``; the rule's own step sees only its node because the SLURM plugin
scrubs ``SLURM_*``), runs one ``srun --overlap`` task on every node, and writes what each
node reports (logical node name, hostname, ``CUDA_VISIBLE_DEVICES``, GPUs) to
``probe.json`` (docs/formats/cluster.md). Exit 1 if the allocation does not have the
expected nodes and GPUs per node.

:func:`run` is the stage (rule ``cluster_probe``; ``hy3rl cluster_probe``). Each node's task
runs this module's internal entry point ``python -m hy3rl.cluster node-report``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hy3rl.atomic import write_json_atomic
from hy3rl.errors import StageError
from hy3rl.timefmt import utc_now

if TYPE_CHECKING:
    from hy3rl.settings import Cluster


class ProbeFailed(StageError):
    """The allocation does not have the expected nodes and GPUs per node."""


@dataclass
class NodeReport:
    """What one node of the allocation says about itself (one srun task)."""

    node: str  # SLURMD_NODENAME: the SLURM node name (several logical nodes may share a host)
    hostname: str
    cuda_visible_devices: str
    gpus: int  # number of entries in CUDA_VISIBLE_DEVICES
    job_gpus: str  # SLURM_JOB_GPUS / SLURM_STEP_GPUS as SLURM set them


@dataclass
class ProbeResult:
    """probe.json: the allocation SLURM gave and what every node saw."""

    status: str  # "pass", "fail", or "not run"
    reason: str
    job_id: str
    expected_nodes: int
    expected_gpus_per_node: int
    allocation: list[str] = field(default_factory=list)
    nodes: list[NodeReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    created: str = field(default_factory=utc_now)


def node_report(env: dict[str, str] | None = None) -> NodeReport:
    env = dict(os.environ if env is None else env)
    cvd = env.get("CUDA_VISIBLE_DEVICES", "")
    return NodeReport(
        node=env.get("SLURMD_NODENAME", ""),
        hostname=socket.gethostname(),
        cuda_visible_devices=cvd,
        gpus=len([d for d in cvd.split(",") if d.strip()]),
        job_gpus=env.get("SLURM_STEP_GPUS", env.get("SLURM_JOB_GPUS", "")),
    )


def allocation_nodes(job_id: str) -> list[str]:
    """The node names of job ``job_id`` (expanded), asked from slurmctld."""
    nodelist = _slurm(["squeue", "-h", "-j", job_id, "-o", "%N"]).strip()
    if not nodelist:
        raise ProbeFailed(f"squeue shows no nodes for job {job_id}")
    return _slurm(["scontrol", "show", "hostnames", nodelist]).split()


def _slurm(cmd: list[str], timeout_s: float = 60) -> str:
    """stdout of a SLURM command; ProbeFailed naming it when it fails or does not answer
    within ``timeout_s``."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"{' '.join(cmd)} did not answer within {timeout_s:g}s") from None
    if proc.returncode != 0:
        raise ProbeFailed(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def evaluate(result: ProbeResult) -> ProbeResult:
    """Fill ``problems`` and ``status`` from the expected shape and the node reports."""
    problems = []
    if len(result.allocation) != result.expected_nodes:
        problems.append(
            f"allocation has {len(result.allocation)} nodes {result.allocation}, "
            f"expected {result.expected_nodes}"
        )
    seen = [r.node for r in result.nodes]
    if sorted(seen) != sorted(result.allocation):
        problems.append(f"nodes that answered {seen} != allocation {result.allocation}")
    for r in result.nodes:
        if r.gpus != result.expected_gpus_per_node:
            problems.append(
                f"node {r.node}: {r.gpus} GPUs visible (CUDA_VISIBLE_DEVICES="
                f"{r.cuda_visible_devices!r}), expected {result.expected_gpus_per_node}"
            )
    result.problems = problems
    result.status = "fail" if problems else "pass"
    result.reason = "; ".join(problems) if problems else "every node answered with its GPUs"
    return result


def probe(job_id: str, nodes: int, gpus_per_node: int, timeout_s: int = 120) -> ProbeResult:
    """Run one ``srun --overlap`` task per node of job ``job_id`` and collect reports."""
    result = ProbeResult(status="fail", reason="", job_id=job_id, expected_nodes=nodes,
                         expected_gpus_per_node=gpus_per_node)
    result.allocation = allocation_nodes(job_id)
    n = len(result.allocation)
    # --overlap: the rule's own step already holds the CPUs; without it the nested step
    # would wait forever. SLURM_* were scrubbed, so name the job and the shape explicitly.
    cmd = ["srun", "--overlap", f"--jobid={job_id}", f"--nodes={n}", f"--ntasks={n}",
           "--ntasks-per-node=1", "--kill-on-bad-exit=1", f"--time={max(1, timeout_s // 60)}",
           sys.executable, "-m", "hy3rl.cluster", "node-report"]
    # The rule's step environment describes that one-node step (SLURM_NNODES=1, ...):
    # drop it so that srun takes the shape of the whole job from slurmctld.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        result.problems = [f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}"]
        result.reason = result.problems[0]
        return result
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            result.nodes.append(NodeReport(**json.loads(line)))
    result.nodes.sort(key=lambda r: r.node)
    return evaluate(result)


def run(cluster: Cluster, *, out: Path) -> None:
    """Probe the allocation of the current SLURM job against ``cluster.nodes`` x
    ``cluster.gpus_per_node`` and write ``out`` (probe.json, docs/formats/cluster.md); its
    JSON is also printed (Snakemake removes ``out`` when the job fails). Outside a SLURM job
    the result is ``not run``. Raises :class:`ProbeFailed` when the shape is wrong."""
    out = Path(out)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id:
        result = ProbeResult(status="not run", reason="not inside a SLURM job (no SLURM_JOB_ID);"
                             " run with --profile slurm", job_id="",
                             expected_nodes=cluster.nodes,
                             expected_gpus_per_node=cluster.gpus_per_node)
        write_json_atomic(out, asdict(result))
        print(f"cluster probe: not run: {result.reason}", flush=True)
        return
    result = probe(job_id, cluster.nodes, cluster.gpus_per_node)
    write_json_atomic(out, asdict(result))
    print(json.dumps(asdict(result), indent=2), flush=True)
    if result.status != "pass":
        raise ProbeFailed(f"cluster probe FAILED: {result.reason}")


if __name__ == "__main__":  # the per-node task of probe(): print this node's report
    if sys.argv[1:] != ["node-report"]:
        sys.exit("usage: python -m hy3rl.cluster node-report (internal; use hy3rl cluster_probe)")
    print(json.dumps(asdict(node_report())), flush=True)
