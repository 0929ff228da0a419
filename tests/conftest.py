"""Shared pytest setup; the package `hy3rl` is imported as ./install.sh installed it.
Stage-specific fixtures live in tests/fixtures/<stage>.py and are
loaded here as plugins, so each stage's fixtures stay in its own file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))

pytest_plugins = sorted(
    f"fixtures.{p.stem}" for p in (REPO_ROOT / "tests" / "fixtures").glob("*.py")
    if p.stem != "__init__"
) + ["suite_timing"]

# Tests that start real clusters (the SLURM test cluster, Ray on this machine, Ray inside
# SLURM jobs) share the machine's daemons, ports and 2 x 2 fake GPUs: under pytest-xdist
# (`-n 2`, pyproject.toml) they all run on one worker, one after another, while the other
# worker takes the unit tests (ClusterScope below: one scope for all of them; xdist's own
# `--dist loadgroup` cannot group under pytest 9, whose node ids ignore the group suffix it
# sets). They are the longest stretch of the suite, so they come first. The scheduler runs in
# the controller, which sees node ids only: the cluster tests are named here by file or by
# test, and every worker's collection checks that each test marked slurm or ray (or using
# the cluster fixture) is among them.
CLUSTER_MARKS = ("slurm", "ray")
CLUSTER_FILES = {
    "tests/test_eval_slurm.py", "tests/test_rerun_identity.py", "tests/test_train_ray.py",
    "tests/test_train_slurm.py",
}
CLUSTER_TESTS = {
    "tests/test_nodelogs.py::test_real_ray_stack_processes_and_logs",
    "tests/test_preflight.py::test_preflight_errors_stop_the_workflow_on_the_slurm_cluster",
    "tests/test_slurm.py::test_a_cluster_that_cannot_start_is_retried_once_then_fails_with_its_log_tail",
    "tests/test_slurm.py::test_cluster_state_is_discoverable_and_joined",
    "tests/test_slurm.py::test_cpu_rule_and_two_node_gpu_probe_run_as_sbatch_jobs",
    "tests/test_slurm.py::test_failed_cancelled_and_timed_out_jobs_are_reported_then_rerun",
}


def in_cluster_scope(nodeid: str) -> bool:
    test = nodeid.split("[")[0]
    return test.split("::")[0] in CLUSTER_FILES or test in CLUSTER_TESTS


def pytest_collection_modifyitems(config, items):
    stray = [item.nodeid for item in items
             if (any(item.get_closest_marker(m) for m in CLUSTER_MARKS)
                 or "slurm_cluster" in getattr(item, "fixturenames", ()))
             and not in_cluster_scope(item.nodeid)]
    if stray:
        raise pytest.UsageError("tests that start clusters but are not in tests/conftest.py's "
                                "CLUSTER_FILES or CLUSTER_TESTS: " + ", ".join(stray))
    items.sort(key=lambda item: not in_cluster_scope(item.nodeid))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ClusterScope(LoadScopeScheduling):
        """Each test its own unit of work, but the cluster tests one unit together."""

        def _split_scope(self, nodeid: str) -> str:
            return "cluster" if in_cluster_scope(nodeid) else nodeid

    return ClusterScope(config, log)
