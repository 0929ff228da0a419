"""Shared pytest setup; the package `hy3rl` is imported as ./install.sh installed it.
Stage-specific fixtures live in tests/fixtures/<stage>.py and are
loaded here as plugins, so each stage's fixtures stay in its own file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One intra-op thread for torch (OpenMP, MKL) in the test processes and everything they
# start (Snakemake, the rules' scripts, the trainers, Ray's workers, which keep a value set
# here): four xdist workers share two cores, and a second thread per process only spins and
# contends there (benchmarks/bench_suite.py: the quick loop's CPU -8 %, its wall -15 %).
# Set before anything imports torch; a value the caller set is kept.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))

pytest_plugins = sorted(
    f"fixtures.{p.stem}" for p in (REPO_ROOT / "tests" / "fixtures").glob("*.py")
    if p.stem != "__init__"
) + ["suite_timing"]

# Tests that start real clusters share the machine's daemons and ports. Under pytest-xdist
# (`-n 4`, pyproject.toml) they run in four scopes, each on one worker, one test after
# another (ClusterScope below; xdist's own `--dist loadgroup` cannot group under pytest 9,
# whose node ids ignore the group suffix it sets):
# - "slurm" and "slurm-b": the tests of the real SLURM test cluster in two lanes, each
#   lane's jobs on a partition of its own (tests/slurm_cluster.py PARTITIONS: n1+n2 and
#   n3+n4, 2 fake GPUs each), so neither lane's jobs wait for the other's; the Ray clusters
#   inside their jobs take ports derived from SLURM job ids, each lane in a range of its
#   own (fixtures.slurm.LANE_RAY_PORTS: the blocks of two jobs running at once on this one
#   host can meet otherwise). A test that names its nodes (n1, n2) belongs to lane "slurm";
#   lane "slurm-b" gets its partition from the fixture `slurm_lane`;
# - "ray": the tests that start Ray on this machine outside SLURM; their Ray ports lie in
#   fixtures.trainer_double.LOCAL_RAY_PORTS, disjoint from the SLURM jobs' range and the
#   SLURM daemons' ports, and nothing they stop reaches another scope's processes
#   (everything is stopped by its HY3RL_RAY_SCOPE or its own submission id);
# - "real": the pinned verl's own trainer on this CPU (tests/test_real_verl.py): one
#   pipeline run outside SLURM shared by its tests, then its extension through the SLURM
#   test cluster on a partition of its own (node n5); Ray in ports of its own
#   (REAL_RAY_PORTS there) both times.
# The four scopes run at the same time, on four workers, while the unit tests fill in
# around them; they are the longest stretches of the suite, so they come first. The
# scheduler runs in the controller, which sees node ids only: the cluster tests are named
# here by file or by test, and every worker's collection checks that each test marked slurm,
# ray or real (or using the cluster fixture) is in its scope.
CLUSTER_MARKS = ("slurm", "ray", "real")
SLURM_FILES = {"tests/test_train_slurm.py"}
SLURM_TESTS = {
    "tests/test_slurm.py::test_a_cluster_that_cannot_start_is_retried_once_then_fails_with_its_log_tail",
    "tests/test_slurm.py::test_cluster_state_is_discoverable_and_joined",
    "tests/test_slurm.py::test_cpu_rule_and_two_node_gpu_probe_run_as_sbatch_jobs",
    "tests/test_slurm.py::test_failed_cancelled_and_timed_out_jobs_are_reported_then_rerun",
}
# Lane "slurm-b": chosen so that the two lanes take about as long (the durations that
# every run prints); none of these names a node.
SLURM_B_FILES = {"tests/test_eval_slurm.py"}
SLURM_B_TESTS = {
    "tests/test_preflight.py::test_preflight_errors_stop_the_workflow_on_the_slurm_cluster",
    "tests/test_train_slurm.py::test_time_limit_every_job_ends_right_after_a_save",
    "tests/test_train_slurm.py::test_slow_first_save_and_validation_no_false_hang_real_hangs_caught",
}
RAY_FILES = {"tests/test_rerun_identity.py", "tests/test_train_ray.py"}
# "real": the pinned verl's own trainer on this CPU (the CPU path), Ray ports of its own
# (tests/test_real_verl.py REAL_RAY_PORTS); one pipeline run shared by its tests.
REAL_FILES = {"tests/test_real_verl.py"}
RAY_TESTS = {"tests/test_nodelogs.py::test_real_ray_stack_processes_and_logs"}
SLURM_SCOPES = ("slurm", "slurm-b")


def cluster_scope(nodeid: str) -> str | None:
    """"slurm", "slurm-b", "ray", or None (a unit of its own)."""
    test = nodeid.split("[")[0]
    path = test.split("::")[0]
    if path in SLURM_B_FILES or test in SLURM_B_TESTS:
        return "slurm-b"
    if path in SLURM_FILES or test in SLURM_TESTS:
        return "slurm"
    if path in RAY_FILES or test in RAY_TESTS:
        return "ray"
    if path in REAL_FILES:
        return "real"
    return None


def in_cluster_scope(nodeid: str) -> bool:
    return cluster_scope(nodeid) is not None


def _out_of_scope(item) -> bool:
    """A test that starts a cluster outside its scope: any cluster test outside every
    scope, or a test of the SLURM cluster (its mark or fixture) in the Ray scope (the real
    trainer's scope has a partition of its own, tests/slurm_cluster.py PARTITIONS)."""
    slurm = bool(item.get_closest_marker("slurm")
                 or "slurm_cluster" in getattr(item, "fixturenames", ()))
    scope = cluster_scope(item.nodeid)
    if scope is None:
        return slurm or any(item.get_closest_marker(m) for m in CLUSTER_MARKS)
    return slurm and scope not in (*SLURM_SCOPES, "real")


def pytest_collection_modifyitems(config, items):
    stray = [item.nodeid for item in items if _out_of_scope(item)]
    if stray:
        raise pytest.UsageError("tests that start clusters but are not in their scope in "
                                "tests/conftest.py (SLURM_FILES / SLURM_TESTS for the SLURM "
                                "test cluster, RAY_FILES / RAY_TESTS for Ray outside SLURM): "
                                + ", ".join(stray))
    items.sort(key=lambda item: not in_cluster_scope(item.nodeid))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ClusterScope(LoadScopeScheduling):
        """Each test its own unit of work, but the tests of each cluster scope one unit
        together (the three largest units: xdist's loadscope reorder gives them one worker
        each first)."""

        def _split_scope(self, nodeid: str) -> str:
            return cluster_scope(nodeid) or nodeid

    return ClusterScope(config, log)
