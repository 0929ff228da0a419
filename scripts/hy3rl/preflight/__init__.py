"""Preflight: resolve the exact verl launch and check it before any GPU is allocated.

:func:`run` reads the inputs (the deps lock, the data summary, the checkpoint checks), then

1. resolves the launch (:mod:`.resolve`): the pinned script's exact overrides, the
   corrections of upstream traps, the composition with the pinned verl's Hydra config;
2. runs verl's own validation of the composed config in a subprocess with the pinned clone
   on the path (:mod:`hy3rl.verl_checks`), with the model directory (``cfg.model.path``:
   model.source, or model.dir for a hub source);
3. checks the coupling rules on the composed values, verl's results and, for a GPU run, the
   bridge check's report (:mod:`.rules`; each rule has a stable name and can be waived by
   name) and estimates the GPU-hours (:mod:`.estimate`);
4. renders ``plan.json`` (every value with its source) and ``launch.sh`` (:mod:`.render`).

It raises :class:`PreflightError` (a StageError: exit 1) for an unusable input, before
writing anything, and :class:`RulesFailed` when a rule is in error, after writing the plan
to the refused-plan path only: a refusal never touches plan.json, launch.sh or a reward
copy, the files an approved launch reads.
Formats: docs/formats/preflight.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from hy3rl.atomic import write_json_atomic
from hy3rl.layout import Layout
from hy3rl.preflight.estimate import NOT_COMPOSED, add_costs, estimate_gpu_hours
from hy3rl.preflight.heldout import selection_record
from hy3rl.preflight.render import Plan, build_plan, render_launch, write_outputs
from hy3rl.preflight.resolve import Override, PreflightError, resolve
from hy3rl.preflight.rules import (
    NOT_WAIVABLE,
    RULES,
    RuleResult,
    check_health_metrics,
    check_pins_clean,
    check_rules,
    check_verl_pin,
    effective_values,
    kept_for_eval,
    not_composed,
    required_rollout_tp,
)
from hy3rl.settings import Config
from hy3rl.verl_checks import FAIL, NOT_RUN, PASS, RUNNER, VerlCheck, run_verl_checks

__all__ = ["NOT_WAIVABLE", "RULES", "Override", "Plan", "PreflightError", "RuleResult",
           "RulesFailed", "kept_for_eval", "launch_trajectory", "required_rollout_tp", "run"]

log = logging.getLogger(__name__)


class RulesFailed(PreflightError):
    """Rules are in error; the plan (``.plan``) is written to the refused-plan path, the
    message lists the errors."""

    def __init__(self, plan: Plan, plan_path: Path) -> None:
        self.plan = plan
        super().__init__(f"{len(plan.errors)} error(s) (plan: {plan_path}):\n  "
                         + "\n  ".join(plan.errors))


# --------------------------------------------------------------------------- inputs


def read_json(path: Path | None, what: str) -> dict[str, Any] | None:
    """A JSON input, or None when ``path`` is None or absent."""
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PreflightError(f"{path}: not valid JSON ({what}): {exc}") from exc


def verl_from_lock(lock: Mapping[str, Any], lock_path: Path) -> tuple[Path, str]:
    try:
        entry = lock["repos"]["verl"]
        return Path(entry["path"]), str(entry.get("head") or entry["commit"])
    except (KeyError, TypeError) as exc:
        raise PreflightError(f"{lock_path}: no repos.verl.path/commit ({exc})") from exc


def git_head(path: Path) -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def model_bytes(cfg: Config) -> tuple[int | None, str]:
    """Bytes of the policy's weights: preflight.model_bytes, else the checkpoint's index."""
    if cfg.preflight.model_bytes > 0:
        return cfg.preflight.model_bytes, "preflight.model_bytes"
    mpath = Path(cfg.model.path)
    index = mpath / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return int(total), f"{index} metadata.total_size"
    shards = sorted(mpath.glob("*.safetensors")) if mpath.is_dir() else []
    if shards:
        return sum(p.stat().st_size for p in shards), f"size of {len(shards)} shards in {mpath}"
    return None, f"unknown (no preflight.model_bytes and no safetensors under {mpath})"


def summary_facts(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """Numbers preflight uses from data/summary.json (format: docs/formats/data.md)."""
    if not summary:
        return {}
    splits = summary.get("splits") or {}
    train, val = splits.get("train") or {}, splits.get("val") or {}
    over = train.get("over_max_prompt_length")
    return {
        "train_rows": train.get("rows"),
        "val_rows": val.get("rows"),
        "val_n": summary.get("val_n"),
        "prompts_over_max": over.get("rows") if isinstance(over, Mapping) else over,
        "mean_prompt_tokens": (train.get("prompt_tokens") or {}).get("mean"),
    }


NOT_COMPOSED_VERL = "not composed: verl's checks need the composed config"


def verl_record(checks: list[VerlCheck], model_dir: Path) -> dict[str, Any]:
    """plan.json ``verl_checks``: which of verl's own checks ran, passed, failed or could not
    run, and why (docs/formats/preflight.md)."""
    return {
        "python": sys.executable,
        "model_dir": str(model_dir.absolute()),
        "counts": {status: sum(c.status == status for c in checks)
                   for status in (PASS, FAIL, NOT_RUN)},
        "checks": [asdict(c) for c in checks],
    }


# --------------------------------------------------------------------------- the stage


def clone_trees(lock_doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each locked clone's :func:`hy3rl.deps.tree_state` (its ``path`` added); a clone that
    is missing or no git repository is left out (rule verl_pin, and rule deps, name it)."""
    from hy3rl.deps import DepsError, tree_state

    out = {}
    for name, entry in sorted((lock_doc.get("repos") or {}).items()):
        path = Path(str(entry.get("path") or ""))
        if not entry.get("path") or not (path / ".git").exists():
            continue
        try:
            out[name] = {"path": str(path), **tree_state(path)}
        except (DepsError, OSError, subprocess.CalledProcessError) as exc:
            raise PreflightError(f"deps: cannot read the state of the clone {path} ({exc})"
                                 ) from None
    return out


def pins_of(lock_doc: Mapping[str, Any], trees: Mapping[str, Mapping[str, Any]]
            ) -> dict[str, str]:
    """The run identity's pins: each clone's commit, with ``+local:<diff sha256>`` when it
    runs local changes (:func:`clone_trees`)."""
    pins = {}
    for name, entry in sorted((lock_doc.get("repos") or {}).items()):
        pin = str(entry.get("head") or entry.get("commit"))
        diff = (trees.get(name) or {}).get("diff_sha256")
        pins[name] = f"{pin}+local:{diff}" if diff else pin
    return pins


def run_identity(cfg: Config, res: Any, lock_doc: Mapping[str, Any],
                 summary: Mapping[str, Any] | None, model_manifest: Path | None,
                 reward_sha: str | None,
                 trees: Mapping[str, Mapping[str, Any]] | None = None) -> dict:
    """plan.json ``identity``: the trajectory of this launch, the extent and
    ``train.on_config_change``. The trajectory is that of the configuration verl runs with
    (:func:`hy3rl.identity.composed_trajectory` over the composed, resolved config's leaves),
    with the pins of deps/lock.json, the training data's sha256 from the data summary, the
    model's identity from its manifest and the custom reward function's content
    (``reward_sha``, the sha256 of the bytes copied). A launch that does not compose (its
    plan is refused) gets the trajectory of its override list (:func:`..trajectory`)."""
    from hy3rl import identity

    pins = pins_of(lock_doc, trees or {})
    train_sha = (((summary or {}).get("splits") or {}).get("train") or {}).get("sha256")
    manifest = read_json(model_manifest, "model manifest")
    model = identity.model_identity(manifest) if manifest else None
    if res.leaves is None:
        resolved = {o.key: {"value": o.value, "origin": o.origin} for o in res.overrides}
        traj = identity.trajectory(resolved=resolved, pins=pins, train_sha256=train_sha,
                                   model=model, reward_fn_sha256=reward_sha)
    else:
        owned = {str(res.owned[key][0]): name for key, name in (
            ("data.train_files", "data.train.sha256"), ("actor_rollout_ref.model.path",
                                                        "model.identity"),
            ("reward.custom_reward_function.path", "reward_function.sha256"))
            if res.owned.get(key, (None,))[0]}
        spelled = [(o.key, o.origin) for o in res.overrides]
        origins = {key: origin for key in res.leaves
                   if (origin := identity.origin_of(key, spelled))}
        traj = identity.composed_trajectory(res.leaves, pins=pins, owned=owned,
                                            train_sha256=train_sha, model=model,
                                            reward_fn_sha256=reward_sha, origins=origins)
    return {"trajectory": traj,
            "total_training_steps": cfg.train.total_training_steps,
            "segment_steps": cfg.train.segment_steps,
            "on_config_change": cfg.train.on_config_change}


def launch_trajectory(cfg: Config, layout: Layout) -> dict | None:
    """The trajectory preflight would give the launch now (:func:`run_identity`), computed on
    the submit host while the DAG is built from the run's files as they are (deps/lock.json,
    the data summary, the model manifest, the reward function's bytes) and the pinned verl's
    composition, nothing written: what lets a training job whose configuration is only
    spelled another way go unsubmitted (hy3rl.train.adoption). None when an input is
    missing, does not parse or the launch does not compose (the job is planned, and its
    own preflight says why)."""
    lock_path = Path(layout.deps_lock)
    try:
        lock_doc = read_json(lock_path, "deps lock")
        summary = read_json(Path(layout.data_summary), "data summary")
        if lock_doc is None or summary is None or not Path(layout.model_manifest).is_file():
            return None
        verl_dir, _ = verl_from_lock(lock_doc, lock_path)
        if not verl_dir.is_dir():
            return None
        reward = reward_copy(cfg, layout.preflight_reward_fn)
        res = resolve(cfg, verl_dir, train_files=Path(layout.data_train).absolute(),
                      val_files=Path(layout.data_val).absolute(),
                      val_n=summary_facts(summary).get("val_n"),
                      checkpoint_dir=layout.checkpoint_dir,
                      reward_fn=reward[1] if reward else Path(os.devnull))
    except (PreflightError, OSError, ValueError, KeyError, TypeError) as exc:
        log.info("launch trajectory not computed on the submit host: %s", exc)
        return None
    if res.leaves is None:
        return None
    ident = run_identity(cfg, res, lock_doc, summary, Path(layout.model_manifest),
                         hashlib.sha256(reward[0]).hexdigest() if reward else None,
                         clone_trees(lock_doc))
    return ident["trajectory"]


def run(cfg: Config, *, lock: Path, data_summary: Path | None, train_files: Path,
        val_files: Path, checkpoint_check: Path | None, bridge_check: Path | None,
        plan: Path, launch: Path, refused: Path, reward_fn: Callable[[str], str | Path],
        model_manifest: Path | None = None, heldout: Path | None = None,
        checkpoint_dir: Path | None = None) -> Plan:
    """Resolve, compose, check; when no rule is in error, write ``plan`` (plan.json),
    ``launch`` (launch.sh) and, with ``train.reward_function.path``, its copy at
    ``reward_fn(<sha256 of its bytes>)`` (``Layout.preflight_reward_fn``: content addressed,
    so a launch already running keeps reading its own copy); when one is, write the plan to
    ``refused`` only and raise :class:`RulesFailed`. ``data_summary`` and
    ``checkpoint_check`` may be None or absent (their rules are then `not run`).
    ``bridge_check`` is checks/bridge.json: read when ``cluster.gpu`` is true, where None or
    absent is an error (rule ``bridge``) unless waived. The checkpoint directory is the
    layout's; the eval steps retention keeps are ``cfg.eval_keep_steps``. Returns the plan.
    ``heldout``:
    data/heldout.parquet (data.heldout), checked against the test and training sets and
    hashed into the selection rule (plan ``selection``). ``checkpoint_dir``: where the
    launch saves (default: the run layout's; the rehearsal passes its own)."""
    lock_doc = read_json(lock, "deps lock")
    if lock_doc is None:
        raise PreflightError(f"{lock}: missing (run rule deps)")
    verl_dir, commit = verl_from_lock(lock_doc, lock)
    if not verl_dir.is_dir():
        raise PreflightError(f"{lock}: repos.verl.path {verl_dir} is not a directory")
    summary = read_json(data_summary, "data summary")
    facts = summary_facts(summary)
    ckpt_check = read_json(checkpoint_check, "checkpoint checks")
    bridge = read_json(bridge_check, "bridge checks") if cfg.cluster.gpu else None
    reward = reward_copy(cfg, reward_fn)
    res = resolve(cfg, verl_dir, train_files=train_files.absolute(),
                  val_files=val_files.absolute(), val_n=facts.get("val_n"),
                  checkpoint_dir=checkpoint_dir or Layout.from_config(cfg).checkpoint_dir,
                  reward_fn=reward[1] if reward else Path(os.devnull))
    head = git_head(verl_dir)
    weights, weights_from = model_bytes(cfg)

    model_dir = Path(cfg.model.path)
    trees = clone_trees(lock_doc)
    ident = run_identity(cfg, res, lock_doc, summary, model_manifest,
                         hashlib.sha256(reward[0]).hexdigest() if reward else None, trees)
    if res.composed is None:
        eff: dict[str, Any] = {}
        verl_checks = [VerlCheck(RUNNER, NOT_RUN, reason=NOT_COMPOSED_VERL)]
        rules = not_composed(res)
        ck: dict[str, Any] = {"dir": res.checkpoint_dir}
        estimate: dict[str, Any] = dict(NOT_COMPOSED)
    else:
        eff = effective_values(res.composed)
        verl_checks = run_verl_checks(verl_dir, res.composed, model_dir,
                                      reward_fn=reward[0] if reward else None)
        rules, ck = check_rules(cfg, res, eff, facts, ckpt_check, weights, weights_from,
                                verl_checks=verl_checks, bridge=bridge,
                                bridge_path=bridge_check, identity=ident,
                                data_files={"train": train_files, "val": val_files,
                                            "heldout": heldout})
        check_health_metrics(rules, cfg, verl_dir, eff, summary)
        estimate = estimate_gpu_hours(cfg, eff, facts, weights)
        add_costs(rules, estimate)
    check_verl_pin(rules, verl_dir, head, commit, cfg.preflight.waive)
    check_pins_clean(rules, trees, cfg.deps.allow_local_changes)

    launch_text = render_launch(res, cfg.run.name, commit)
    result = build_plan(run=cfg.run.name, trains=cfg.trains, res=res, commit=commit,
                        head=head, effective=eff, rules=rules, checkpoint=ck,
                        verl_checks=verl_record(verl_checks, model_dir),
                        estimate=estimate, launch=launch, launch_text=launch_text,
                        identity=ident, selection=selection_record(cfg, heldout))
    result.pins = {name: {k: tree[k] for k in ("path", "head", "changes", "diff_sha256", "diff")}
                   for name, tree in trees.items()}
    if result.errors:
        write_json_atomic(refused, asdict(result), default=str)
        _log_summary(result, refused)
        raise RulesFailed(result, refused)
    write_outputs(result, plan_path=plan, launch=launch, launch_text=launch_text,
                  reward=reward)
    Path(refused).unlink(missing_ok=True)
    _log_summary(result, plan)
    return result


def reward_copy(cfg: Config, reward_fn: Callable[[str], str | Path]) -> tuple[bytes, Path] | None:
    """``train.reward_function.path``'s bytes, read once, and the content-addressed path of
    their copy (``reward_fn(sha256)``); None without one, or when the path is not a file
    (resolve refuses it, naming the key)."""
    if not cfg.train.reward_function.path:
        return None
    src = Path(cfg.train.reward_function.path)
    if not src.is_file():
        return None
    data = src.read_bytes()
    return data, Path(reward_fn(hashlib.sha256(data).hexdigest())).absolute()


def _log_summary(result: Plan, plan: Path) -> None:
    """The plan in a few lines, then every warning and waiver (the errors go with the
    RulesFailed message)."""
    print(yaml.safe_dump({"plan": str(plan), "launched": result.launched,
                          "not_launched_reason": result.not_launched_reason,
                          "gpu_hours": result.estimate.get("gpu_hours"),
                          "overrides": len(result.overrides),
                          "verl_checks": result.verl_checks["counts"]},
                         sort_keys=False).rstrip())
    for line in result.warnings:
        print(f"WARNING {line}")
    for line in result.waived:
        print(f"WAIVED  {line}")
