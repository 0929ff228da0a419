"""One W&B run per training run, across every attempt and job.

verl@220e903 calls ``wandb.init(project=..., name=..., entity=..., config=...)`` without an
id (verl issue #2783), so each attempt would open a new W&B run. W&B reads the id and the
resume mode from the environment instead: the launcher passes :func:`env`'s
``WANDB_RUN_ID`` (:func:`run_id`: ``<run.name>-<first 8 hex of train_hash>``) and
``WANDB_RESUME=allow`` to the Ray job, so every attempt of the same training logs into one
run. The hash covers the config keys that re-run training (``hy3rl.settings.RETRAIN_KEYS``)
and nothing else: a new evaluation or report setting keeps the W&B run, a new training
starts a new one.

A resumed W&B run drops the steps it already has, so the steps an attempt redoes after a
crash keep their first values there; ``train/metrics.jsonl`` (the merge of every attempt's
log, the later attempt winning) stays the authoritative record.

:func:`url_from_log` finds the run's page in the trainer's output (W&B prints it when
online; offline runs print none), :func:`record` is the attempt record's ``wandb`` field.
No key is read or written here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hy3rl.settings import RETRAIN_KEYS
from hy3rl.smk import triggers

ID_MAX = 64  # W&B run ids: letters, digits, "-" and "_", at most 64 characters
HASH_CHARS = 8
_NOT_ID = re.compile(r"[^A-Za-z0-9_-]+")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# wandb 0.31 (sdk/wandb_run.py): the header "View run at <url>", the footer
# "View run <name> at: <url>"; lines prefixed "wandb: ", the URL maybe coloured.
_RUN_URL = re.compile(r"View run\b.*?\bat:?\s+(https?://\S+/runs/[A-Za-z0-9_-]+)")


def train_hash(raw_config: Mapping[str, Any]) -> str:
    """sha256 (hex) of the values of :data:`~hy3rl.settings.RETRAIN_KEYS` in ``raw_config``
    (the validated mapping, ``Config.raw``): the same ``key=value`` leaves the train rule's
    params hold (:func:`hy3rl.smk.triggers`; an absent key reads as null), so the hash
    changes exactly when Snakemake re-runs training for a config change."""
    leaves = sorted(triggers(raw_config, *RETRAIN_KEYS).values())
    return hashlib.sha256("\n".join(leaves).encode()).hexdigest()


def run_id(run_name: str, train_hash: str) -> str:
    """``<run name>-<first 8 hex of train_hash>``, the name made a valid W&B id (each run
    of other characters becomes ``-``) and cut so the whole stays within 64 characters."""
    if not re.fullmatch(rf"[0-9a-f]{{{HASH_CHARS},}}", train_hash):
        raise ValueError(f"train_hash {train_hash!r} is not a hex digest")
    name = _NOT_ID.sub("-", run_name).strip("-") or "run"
    return f"{name[:ID_MAX - HASH_CHARS - 1]}-{train_hash[:HASH_CHARS]}"


def enabled(loggers: Sequence[str]) -> bool:
    """W&B is on: ``wandb`` is among the effective loggers (preflight's plan.json
    ``loggers.list``: ``train.loggers``, or the launch script's own when that is empty)."""
    return "wandb" in loggers


def env(run_name: str, train_hash: str, loggers: Sequence[str]) -> dict[str, str]:
    """The Ray job's W&B variables: ``WANDB_RUN_ID`` and ``WANDB_RESUME=allow`` when W&B is
    on, else none."""
    if not enabled(loggers):
        return {}
    return {"WANDB_RUN_ID": run_id(run_name, train_hash), "WANDB_RESUME": "allow"}


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
