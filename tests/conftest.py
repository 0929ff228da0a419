"""Shared pytest setup; the package `hy3rl` is imported as ./install.sh installed it.
Stage-specific fixtures live in tests/fixtures/<stage>.py and are
loaded here as plugins, so each stage's fixtures stay in its own file."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))

pytest_plugins = sorted(
    f"fixtures.{p.stem}" for p in (REPO_ROOT / "tests" / "fixtures").glob("*.py")
    if p.stem != "__init__"
) + ["suite_timing"]
