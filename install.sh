#!/usr/bin/env bash
# Create ./.venv with the workflow and its exact pins.
#   ./install.sh          the workflow (snakemake, the SLURM plugin, stage code)
#   ./install.sh --test   plus the test/lint tools, and the Debian packages the tests
#                         start for real (SLURM, munge, Chromium); needs root/apt.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, exactly: the CPU wheel; a range would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
    .venv/bin/python -m pip install -q -e ".[test]"
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v chromium >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq slurmctld slurmd slurm-client munge chromium >/dev/null
    fi
else
    .venv/bin/python -m pip install -q -e .
fi
echo "installed into $(pwd)/.venv"
