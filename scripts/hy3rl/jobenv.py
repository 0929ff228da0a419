"""Secrets for a Ray job without a copy in Ray's files.

What a Ray job gets through its runtime env's ``env_vars`` is written by Ray where others
can read it: the runtime-env agent logs ``Creating runtime env: {... env_vars ...}`` in a
0644 file under the node's Ray temp dir, and the jobs API answers the runtime env of every
job. So the launcher (``hy3rl.launch``) passes every secret of the job (hy3rl.redact's one
policy: values under secret-looking names such as ``WANDB_API_KEY``, ``HF_TOKEN``, and
token-shaped values) through a file instead:

- :func:`write` puts them in ``<attempt log dir>/.job-env`` (0600, created exclusively, on
  the shared results storage so that every node reads it; removed at the launch's
  teardown), as shell ``export NAME='value'`` lines;
- the runtime env holds only that file's path (:data:`ENV_VAR`) and Ray's
  ``worker_process_setup_hook`` :data:`HOOK` (a module name, as the jobs API requires):
  every Ray worker process of the job (verl's ``TaskRunner``, which calls ``wandb.init``,
  and every worker: they do not inherit the driver's environment) runs :func:`export`
  before its first task;
- the job's entrypoint (:func:`entrypoint`) sources the file before it execs ``launch.sh``,
  so that the driver and what it starts have them too.

Standard library only: it is imported by every Ray worker of the job, inside the runtime.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "HY3RL_JOB_ENV"
FILE_NAME = ".job-env"
HOOK = "hy3rl.jobenv.export"


def write(directory: Path, values: Mapping[str, str]) -> Path:
    """``values`` as ``export NAME='value'`` lines in ``directory/.job-env`` (0600, created
    fresh); returns its path."""
    path = directory / FILE_NAME
    write_private(path, "".join(f"export {name}={shlex.quote(value)}\n"
                                for name, value in sorted(values.items())))
    return path


def write_private(path: Path, text: str) -> None:
    """``text`` in ``path``, readable by this user only (0600 from its creation: a file of
    that name before is removed, never reused)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def read(path: Path) -> dict[str, str]:
    """The values :func:`write` put in ``path``."""
    values = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = shlex.split(line)
        if len(words) != 2 or words[0] != "export" or "=" not in words[1]:
            raise ValueError(f"{path}:{n}: not an `export NAME=value` line")
        name, value = words[1].split("=", 1)
        values[name] = value
    return values


def export() -> None:
    """Ray's ``worker_process_setup_hook``: this worker process gets the job's secrets
    from the file named by ``$HY3RL_JOB_ENV`` (none named: nothing to do)."""
    path = os.environ.get(ENV_VAR)
    if path:
        os.environ.update(read(Path(path)))


def entrypoint(command: list[str]) -> list[str]:
    """``command`` run after the file named by ``$HY3RL_JOB_ENV`` is sourced (its
    ``export`` lines)."""
    return ["bash", "-c", f'. "${ENV_VAR}" && exec "$@"', "hy3rl-job-env", *command]
