#!/usr/bin/env bash
# Refresh the hashed locks from pyproject.toml's pins. Run it after changing a pin there and
# commit the locks with that change (tests/test_lint.py fails while they disagree):
#   envs/requirements.lock       [project.dependencies] + the build backend (setuptools)
#   envs/requirements-test.lock  the same pins (-c requirements.lock) plus the `test` extra
#   envs/build.lock              the build backend alone (its pin from requirements.lock):
#                                install.sh installs it first and builds with it, so no
#                                unpinned setuptools is fetched into an isolated build env
# pip-compile (pip-tools, pinned below, installed into ./.venv) resolves with this machine's
# pip configuration, so torch==2.13.0 resolves to the CPU wheel that pip installs here
# (find-links /opt/wheels: torch-2.13.0+cpu) and the lock holds that file's sha256 only.
# Every other file carries the hashes of all of its release's wheels and sdist.
# Transitive pins already in a lock are kept; `envs/lock.sh --upgrade` moves them to the
# newest releases that fit.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q "pip-tools==7.6.2"
export CUSTOM_COMPILE_COMMAND="envs/lock.sh"
compile=(.venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras
         --no-emit-index-url --no-emit-find-links --annotation-style line "$@")
"${compile[@]}" --build-deps-for editable -o envs/requirements.lock pyproject.toml
"${compile[@]}" --build-deps-for editable --extra test -c envs/requirements.lock \
    -o envs/requirements-test.lock pyproject.toml
"${compile[@]}" --build-deps-for editable --only-build-deps -c envs/requirements.lock \
    -o envs/build.lock pyproject.toml
