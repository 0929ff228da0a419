"""One W&B run per training run, across every attempt and job.

verl@220e903 calls ``wandb.init(project=..., name=..., entity=..., config=...)`` without an
id (verl issue #2783), so each attempt would open a new W&B run. W&B reads the id and the
resume mode from the environment instead: the launcher passes :func:`env`'s
``WANDB_RUN_ID`` (:func:`run_id`: ``<run.name>-<first 8 hex of the trajectory id>``) and
``WANDB_RESUME=allow`` to the Ray job, so every attempt of the same training logs into one
run. The trajectory id (``hy3rl.identity``, in preflight's plan.json) covers what changes
the weights and nothing else: an extension, an operational, evaluation or report setting
keeps the W&B run; another trajectory starts a new one.

A resumed W&B run drops the steps it already has, so the steps an attempt redoes after a
crash keep their first values there; ``train/metrics.jsonl`` (the merge of every attempt's
log, the later attempt winning) stays the authoritative record.

:func:`url_from_log` finds the run's page in the trainer's output (W&B prints it when
online; offline runs print none), :func:`record` is the attempt record's ``wandb`` field.
No key is read or written here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

ID_MAX = 64  # W&B run ids: letters, digits, "-" and "_", at most 64 characters
HASH_CHARS = 8
_NOT_ID = re.compile(r"[^A-Za-z0-9_-]+")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# wandb 0.31 (sdk/wandb_run.py): the header "View run at <url>", the footer
# "View run <name> at: <url>"; lines prefixed "wandb: ", the URL maybe coloured.
_RUN_URL = re.compile(r"View run\b.*?\bat:?\s+(https?://\S+/runs/[A-Za-z0-9_-]+)")


def run_id(run_name: str, trajectory_id: str) -> str:
    """``<run name>-<first 8 hex of trajectory_id>`` (the plan's trajectory id), the name
    made a valid W&B id (each run of other characters becomes ``-``) and cut so the whole
    stays within 64 characters."""
    if not re.fullmatch(rf"[0-9a-f]{{{HASH_CHARS},}}", trajectory_id):
        raise ValueError(f"trajectory_id {trajectory_id!r} is not a hex digest")
    name = _NOT_ID.sub("-", run_name).strip("-") or "run"
    return f"{name[:ID_MAX - HASH_CHARS - 1]}-{trajectory_id[:HASH_CHARS]}"


def enabled(loggers: Sequence[str]) -> bool:
    """W&B is on: ``wandb`` is among the effective loggers (preflight's plan.json
    ``loggers.list``: ``train.loggers``, or the launch script's own when that is empty)."""
    return "wandb" in loggers


def env(run_name: str, trajectory_id: str, loggers: Sequence[str]) -> dict[str, str]:
    """The Ray job's W&B variables: ``WANDB_RUN_ID`` and ``WANDB_RESUME=allow`` when W&B is
    on, else none."""
    if not enabled(loggers):
        return {}
    return {"WANDB_RUN_ID": run_id(run_name, trajectory_id), "WANDB_RESUME": "allow"}


def url_from_log(text: str) -> str | None:
    """The W&B run page printed in the trainer's output (the last one), None when there is
    none (W&B off or offline)."""
    found = _RUN_URL.findall(_ANSI.sub("", text))
    return found[-1] if found else None


def record(job_env: Mapping[str, str], project: str | None, output: str) -> dict | None:
    """The attempt record's ``wandb`` field: ``{"run_id", "project", "url"}`` when
    ``job_env`` (what :func:`env` gave the Ray job) names a run, else None. ``project``:
    ``trainer.project_name``; ``output``: the trainer's output, for the URL."""
    if "WANDB_RUN_ID" not in job_env:
        return None
    return {"run_id": job_env["WANDB_RUN_ID"], "project": project, "url": url_from_log(output)}
