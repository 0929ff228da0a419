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
# (`-n 2 --dist loadgroup`, pyproject.toml) they all run on one worker, one after another,
# while the other worker takes the unit tests. They are the longest stretch of the suite,
# so they come first (the scheduler hands out work in collection order).
CLUSTER_MARKS = ("slurm", "ray")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if (any(item.get_closest_marker(m) for m in CLUSTER_MARKS)
                or "slurm_cluster" in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("cluster"))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
