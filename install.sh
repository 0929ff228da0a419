#!/usr/bin/env bash
# Create ./.venv with the workflow at its exact, hash-checked pins.
#   ./install.sh          the workflow (snakemake, the SLURM plugin, stage code):
#                         envs/requirements.lock
#   ./install.sh --test   plus the test/lint tools (envs/requirements-test.lock: the same pins
#                         and the `test` extra), and the Debian packages the tests start for
#                         real (SLURM, munge, Chromium); needs root/apt.
# The locks come from pyproject.toml's pins by `envs/lock.sh` (README "Installing"). pip
# checks every file against the lock's sha256 (--require-hashes). torch is the CPU wheel
# torch-2.13.0+cpu that this machine's pip finds in /opt/wheels (pip config find-links);
# the lock admits that file's hash only, so a CUDA build of torch is never installed.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
    "") LOCK=envs/requirements.lock ;;
    "--test") LOCK=envs/requirements-test.lock ;;
    *) echo "usage: ./install.sh [--test]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "install.sh: .venv runs $(.venv/bin/python -V); the locks are for Python 3.11" \
        "(remove .venv and set PYTHON=python3.11)" >&2
    exit 1
fi
PIP=(.venv/bin/python -m pip install -q --require-hashes)
# 1. The build backend, so that the two sdist-only pins (antlr4-python3-runtime,
#    connection-pool) and the package itself build with the locked setuptools
#    (--no-build-isolation) instead of an unpinned one fetched into a build env.
"${PIP[@]}" --no-deps -r envs/build.lock
# 2. Every dependency, exactly as locked (compiled in step 4, on every core).
"${PIP[@]}" --no-build-isolation --no-compile -r "$LOCK"
# 3. The package itself, editable; its dependencies are the lock above. Gives `hy3rl`.
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
# 4. The bytecode, once, in parallel (pip compiles one file after another): where
#    PYTHONDONTWRITEBYTECODE is set (this machine) every process would compile anew what
#    it imports. A dependency's file that does not compile (a package's test data) is left
#    as pip leaves it; the package's own (editable: never compiled by pip) must compile.
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q -j 0 \
    .venv/lib/python3.11/site-packages >/dev/null || true
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q -j 0 scripts >/dev/null
if [ "${1:-}" = "--test" ]; then
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v chromium >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq slurmctld slurmd slurm-client munge chromium >/dev/null
    fi
fi
echo "installed into $(pwd)/.venv"
