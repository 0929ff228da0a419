"""The one adapter between a Snakemake ``script:`` and a stage's ``run(...)``.

Every adapter under ``scripts/adapters/`` is three lines::

    with rule_job(snakemake) as cfg:
        deps.run(cfg.deps, lock=snakemake.output.lock, ...)

``rule_job`` sends the job's stdout and stderr (its subprocesses' too) to the rule's log,
prints the rerun triggers the rule ran with (its ``params``), builds the typed config from
``snakemake.config``, and turns a :class:`~hy3rl.errors.StageError` into its message and
exit status 1 (any other exception keeps its traceback).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hy3rl.config import ConfigError
from hy3rl.errors import StageError
from hy3rl.redact import is_secret_key
from hy3rl.settings import Config


def _redirect(log_path: str) -> None:
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@contextmanager
def rule_job(snakemake: Any) -> Iterator[Config]:
    """Run a stage inside a Snakemake ``script:`` job (see the module doc)."""
    if snakemake.log:
        _redirect(str(snakemake.log[0]))
    setup_logging()
    triggers = sorted(str(v) for k, v in snakemake.params.items())
    print(f"rule {snakemake.rule}: {len(triggers)} rerun trigger(s)", flush=True)
    for t in triggers:
        print(f"  {t}", flush=True)
    try:
        yield Config.from_dict(snakemake.config)
    except (StageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


def _leaves(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping) and value:
        for k in sorted(value):
            yield from _leaves(value[k], f"{key}.{k}")
    else:
        yield key, value


def triggers(config: Mapping[str, Any], *keys: str) -> dict[str, str]:
    """Rule ``params`` that re-run the rule when, and only when, one of the config values at
    ``keys`` (dotted; a mapping counts by each of its leaves) changes. Each param is the
    string ``key=<JSON value>``, so Snakemake's rerun reason names the key. A secret-looking
    key stores no value (its change still shows, by a short hash)."""
    import hashlib

    out: dict[str, str] = {}
    for key in keys:
        value: Any = config
        for part in key.split("."):
            # The validator fills no null defaults: an absent optional key is null.
            value = value.get(part) if isinstance(value, Mapping) else None
        for leaf, v in _leaves(value, key):
            text = json.dumps(v, sort_keys=True)
            if any(is_secret_key(p) for p in leaf.split(".")):
                text = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:12]
            name = "t_" + "".join(c if c.isalnum() else "_" for c in leaf)
            out[name] = f"{leaf}={text}"
    return out


PP_KEY = "pipeline_model_parallel_size"  # the only figure of the launch a stage's layers use


def stage_triggers(config: Mapping[str, Any]) -> dict[str, str]:
    """Rule ``rehearsal_model``'s params for ``rehearsal.shape: stage`` beyond the model (an
    input) and ``rehearsal.model``: what decides the stage's layers, the run's pipeline size
    (``train.env.ACTOR_PP``, and a ``train.verl_overrides`` leaf setting
    ``...pipeline_model_parallel_size``), never the other knobs (issue 40: any
    ``train.env`` change, a project name or the rollout's memory, rebuilt the 40 GB stage
    in a 120-min cluster job). A pipeline size reached another way is refused by rule
    rehearsal_plan, which compares the stage with the run's plan."""
    out = triggers(config, "train.env.ACTOR_PP")
    over = (config.get("train") or {}).get("verl_overrides") if isinstance(config, Mapping) \
        else None
    for leaf, value in _leaves(over or {}, "train.verl_overrides"):
        if leaf.endswith(PP_KEY):
            name = "t_" + "".join(c if c.isalnum() else "_" for c in leaf)
            out[name] = f"{leaf}={json.dumps(value, sort_keys=True)}"
    return out


def write_keys(snakemake: Any) -> None:
    """Rules eval_request and rehearsal_runtime: write the rule's one param (the config
    values that re-run the job downstream, one ``key=value`` a line) as JSON to its output.
    Those rules have no input, so Snakemake never masks them behind an upstream job that
    must run (snakemake#4166): their output, a non-ancient input of the generation job,
    re-runs that job in the same invocation, and only when the values change (the profiles'
    rerun triggers leave out code)."""
    from hy3rl.atomic import write_json_atomic

    with rule_job(snakemake):
        name = next(iter(snakemake.params.keys()))
        write_json_atomic(Path(snakemake.output[0]), {
            "rule": snakemake.rule, "wildcards": dict(snakemake.wildcards.items()),
            "values": str(snakemake.params[name]).splitlines()})
