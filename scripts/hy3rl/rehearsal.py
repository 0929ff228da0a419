"""The one-node rehearsal of the real stack before the training allocation (rules
rehearsal_model, rehearsal_plan, rehearsal; docs/formats/rehearsal.md).

What preflight cannot prove on a CPU (vLLM starting ``hy_v3``, the Ray workers, the reward
importing and scoring inside the image, a GRPO step end to end, a Megatron save and above
all a resume by the real verl, the evaluation backend) is run once on one node of the
training partition, in ``train.runtime``, through the training launcher itself
(:func:`hy3rl.train.run`: the same Ray bring-up, ``ray job submit``, attempt records,
watchdog):

1. :func:`derive`: the run's own config scaled to one node and the model of
   ``rehearsal.shape`` (built by rule rehearsal_model): a small Hy3 of the real layer kinds
   (``small``, ``rehearsal.model``) or one real pipeline stage of the run's model at the
   run's per-GPU layout and lengths (``stage``, hy3rl.stage); ``cluster.nodes`` 1, the
   shape's knobs (:data:`SHAPE_ENV`) and ``rehearsal.env`` over ``train.env``,
   ``rehearsal.verl_overrides`` over ``train.verl_overrides``, :data:`TOTAL` steps saved at
   every step, the actor's learning rate raised (``ACTOR_LR``) so that the update shows in
   bf16 weights;
2. :func:`plan` (rule rehearsal_plan): preflight itself on that config, verl's validators and
   every rule included, into ``rehearsal/preflight/``; the plan lists each reduction against
   the run's own plan (``rehearsal.reductions``) and both plans' per-GPU figures
   (``rehearsal.per_gpu``; a ``stage`` whose figures differ from the run's is refused);
3. :func:`run` (rule rehearsal, one node): trains steps 1 and 2 with a save at each (the
   first attempt's trainer is launched with ``trainer.total_training_steps=2``, so verl's own
   schedule ends it there: the kill's step is the product's, never a race between a fast
   trainer and the watchdog's poll), kills it once step 2's line is logged and its
   checkpoint complete (the watchdog's planned kill; a trainer that exits first ends the
   same way), resumes in a new attempt for step 3, then generates with ``eval.backend`` in
   the training runtime on step 3's HF weights and probes verl's reward manager there
   (hy3rl.reward_probe); then :func:`check_records` checks the records and what the
   checkpoints hold (:func:`read_state`: the update, the resumed data position and optimizer
   step count), not the exit codes: ``rehearsal/checks.json`` always,
   ``rehearsal/rehearsal.json`` (the gate of the train jobs) only when every check passed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_json_atomic
from hy3rl.errors import StageError
from hy3rl.gpu_memory import Sampler
from hy3rl.gpu_memory import judge as judge_node
from hy3rl.layout import Layout
from hy3rl.preflight.rules import to_int
from hy3rl.settings import Config, Runtime
from hy3rl.timefmt import utc_now
from hy3rl.verl_log import finite_number, read_metrics

log = logging.getLogger("hy3rl.rehearsal")

TOTAL = 3  # steps: two, the kill, one more after the resume
KILL_AFTER = 2
POLL_S = 1.0  # the watchdog looks every second (the kill's step does not depend on it)
WATCHDOG_MIN = 30.0  # startup / first step limits: a rehearsal fails within minutes
# The paper's per-step metric keys (the published curves and the reward), verl@220e903's v1
# trainer names; a validation key of the published form is needed at least once.
STEP_KEYS = ("critic/score/mean", "critic/rewards/mean", "response_length/mean",
             "training/rollout_probs_diff_mean", "rollout_corr/k3_kl", "timing_s/step")
VAL_KEY = re.compile(r"^val-core/.+/acc/mean@\d+$")
# A reward or grader error in the trainer's output (the reward function runs inside it).
REWARD_ERROR = re.compile(
    r"(reward|compute_score|math_dapo|grader|score_fn)[^\n]{0,200}(Error|Exception|Traceback)"
    r"|(Error|Exception)[^\n]{0,200}(reward|compute_score|math_dapo|grader)", re.I)
# The silent failures (issue 28): verl's keys at the pin for the generated length and the
# actor's loss, gradient norm and entropy (``actor/loss`` is checked when a step logs it).
LENGTH_KEY = "response_length/mean"
CLIP_KEY = "response_length/clip_ratio"  # share of responses cut at max_response_length
MAX_LENGTH_KEY = "response_length/max"
MIN_LENGTH_KEY = "response_length/min"
ABORTED_KEY = "response/aborted_ratio"  # share of responses of length 0 (metric_utils at the pin)
# The most of a step's rollouts that may be aborted (verl: a response of length 0), and of the
# evaluation's samples that may be empty (no text: nothing but the EOS token). A rehearsal's
# model is random (rehearsal.shape small or stage): with the real 120,832-token vocabulary it
# ends a response at once with odds ~1e-5, and the synchronous v1 trainer aborts no request;
# the shares leave room for one early stop among eight samples, not for a silent engine.
MAX_ABORTED = 0.25
MAX_EMPTY_SHARE = 0.125
# Scores: the recipe's DAPO reward scores a wrong answer -1 and a right one +1 (less at most
# the overlong penalty); a random model cannot answer every problem right, so every response
# of every step scored above 0 says the reward does not judge the responses.
SCORE_MIN_KEY = "critic/score/min"
# The resume loaded step 2's weights: step 3's distance from the input (the L2 norm of the
# trained matrices' change) at least this many times step 2's. Adam moves each element about
# the learning rate a step: three steps from the input lie ~sqrt(3/2) = 1.22 (unrelated
# directions) to 3/2 (one direction) times two steps' distance; a step 3 trained from the
# input lies ~0.7 times it, one trained from step 1's weights ~1.0.
MIN_GROWTH = 1.1
FINITE_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy")
FINITE_OPTIONAL = ("actor/loss",)
# The finish reasons vLLM reports for a finished request (None while unfinished, "abort").
FINISHED = ("stop", "length")
PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
CHECKS = ("plan", "trained", "steps_logged", "checkpoints", "killed", "resumed", "reward",
          "evaluation", "generated", "finish_reasons", "finite", "updated", "resumed_data",
          "resumed_optimizer", "reward_path", "memory_headroom", "full_length", "phases")
# Tensors the recipe never moves: the MoE expert bias at moe_router_bias_update_rate=0 (the
# HF checkpoint's inner name ``mlp.expert_bias``, transformers' hy_v3 buffer
# ``mlp.e_score_correction_bias``).
FIXED_TENSOR = re.compile(r"\.(mlp\.expert_bias|e_score_correction_bias)$")
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
SHOWN = 3  # the largest unchanged tensors named in a failure
LR_KEY = "actor_rollout_ref.actor.optim.lr"  # the launch script's ACTOR_LR
# Memory as verl@220e903 logs it, once a step, from the actor's update
# (workers/engine_workers.py _postprocess_output; the v1 trainer's _update_actor prefixes
# "actor/"): torch's peaks since the worker process started (its log-prob passes before the
# update included; verl resets them nowhere on this path), the largest over the data-parallel
# ranks (reduce_metrics takes the max of a key naming "max"), and the node's used host memory
# (psutil, averaged over the ranks). Phase -> its keys' prefix; verl logs no other phase's.
MEMORY_PHASES = {"update": "actor/perf/"}
GPU_MEMORY = ("max_memory_allocated_gb", "max_memory_reserved_gb")  # judged
HOST_MEMORY = "cpu_memory_used_gb"  # recorded
GIB = 2**30  # verl's "_gb" figures are bytes / 1024**3
# Each shape's knobs over train.env (rehearsal.env over them). `small`: one node and a small
# model at reduced lengths. `stage` (hy3rl.stage): one real pipeline stage at the run's
# per-GPU layout and lengths: PP 1 (the stage is one PP stage of the run), rollout TP 1 (the
# stage's weights per GPU are about the run's at TP 16), every other parallel size and token
# limit the run's; vLLM's memory fraction is derived (stage_mem_util) so that each GPU keeps
# the run's KV-cache budget. Both raise ACTOR_LR so that one step moves bf16 weights.
SHAPE_ENV: dict[str, dict[str, Any]] = {
    "small": {"ACTOR_TP": 1, "ACTOR_PP": 1, "ACTOR_CP": 1, "ACTOR_EP": 1, "ACTOR_ETP": 1,
              "ROLLOUT_TP": 1, "TRAIN_BATCH_SIZE": 16, "PPO_MINI_BATCH_SIZE": 16,
              "ROLLOUT_N": 4, "MAX_RESPONSE_LENGTH": 512, "PPO_MAX_TOKEN_LEN_PER_GPU": 5120,
              "ROLLOUT_MAX_MODEL_LEN": 2560, "ROLLOUT_MAX_NUM_BATCHED_TOKENS": 2560,
              "ACTOR_LR": 1.0e-4},
    "stage": {"ACTOR_PP": 1, "ROLLOUT_TP": 1, "TRAIN_BATCH_SIZE": 8,
              "PPO_MINI_BATCH_SIZE": 8, "ACTOR_LR": 1.0e-4},
}
# the small shape halves the DAPO overlong buffer to its reduced response length (the
# paper's 4096 is half of 8192); the stage keeps the run's lengths, so its buffer
SHAPE_OVERRIDES: dict[str, dict[str, Any]] = {
    "small": {"++reward.reward_kwargs.overlong_buffer_cfg.len": 256},
    "stage": {},
}
NODE_SAMPLE_S = 1.0  # every GPU of the node sampled this often (hy3rl.gpu_memory)
MEM_UTIL_KNOB = "ROLLOUT_GPU_MEM_UTIL"
MEM_UTIL_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"


class RehearsalError(StageError):
    """An input of the rehearsal is unusable."""


class RehearsalFailed(StageError):
    """A rehearsal check failed; the message names each failed check and, when the trainer
    died, the phase and its error line. ``rehearsal/checks.json`` is written."""


# --------------------------------------------------------------------------- the config


def derive(cfg: Config, layout: Layout) -> Config:
    """The rehearsal's config: ``cfg`` scaled to one node (module doc, step 1). Checked by
    the schema like any config."""
    raw = copy.deepcopy(cfg.raw)
    reh = cfg.rehearsal
    rl = layout.rehearsal_layout()
    raw["run"]["name"] = f"{cfg.run.name}-rehearsal"
    raw["cluster"]["nodes"] = 1
    raw["cluster"]["train_time_min"] = reh.runtime_min
    raw["model"]["source"] = os.path.abspath(layout.rehearsal_model)
    raw["model"]["revision"] = None
    raw["model"]["dir"] = ""
    raw["preflight"]["model_bytes"] = 0  # the rehearsal model's own size, from its index
    tr = raw["train"]
    env = {**SHAPE_ENV[reh.shape], **reh.env}
    if reh.shape == "stage":
        run = _run_rollout(cfg, layout)  # the run's plan and vLLM figures, read once
        if MEM_UTIL_KNOB not in reh.env:
            util = stage_mem_util(cfg, layout, run)
            if util is not None:
                env[MEM_UTIL_KNOB] = util
        if not {"TRAIN_BATCH_SIZE", "PPO_MINI_BATCH_SIZE"} & set(reh.env):
            env.update(stage_batch(cfg, run) or {})
    # saved at every step; validated before training and at the last step (as verl does)
    tr["env"] = {**tr["env"], **env, "SAVE_FREQ": 1, "TEST_FREQ": TOTAL}
    # its own experiment name (W&B run name, verl's logs) unless the rehearsal sets one
    own = {**SHAPE_OVERRIDES[reh.shape], **reh.verl_overrides}
    overrides = {**tr["verl_overrides"], "trainer.experiment_name": f"{cfg.run.name}-rehearsal",
                 **own}
    # the raised learning rate (ACTOR_LR) also where the run sets the actor's lr by an
    # override, which would beat the knob, unless the rehearsal's overrides set it
    if "ACTOR_LR" in env and not any(k.lstrip("+~") == LR_KEY for k in own):
        overrides.update({k: env["ACTOR_LR"] for k in tr["verl_overrides"]
                          if k.lstrip("+~") == LR_KEY})
    tr["verl_overrides"] = overrides
    tr["total_training_steps"] = TOTAL
    tr["segment_steps"] = 0
    tr["checkpoint_keep"] = TOTAL
    tr["checkpoint_root"] = str(rl.checkpoint_dir.parent) if cfg.train.checkpoint_root else ""
    tr["on_config_change"] = "fresh"  # disposable checkpoints of a random model
    tr["restarts_per_job"] = 0  # the planned kill restarts; any other failure ends it
    tr["max_submissions"] = 1
    wd = tr["watchdog"]
    wd["poll_s"] = min(float(wd["poll_s"]), POLL_S)
    wd["startup_min"] = min(float(wd["startup_min"]), WATCHDOG_MIN)
    wd["startup_floor_min"] = min(float(wd["startup_floor_min"]), WATCHDOG_MIN)
    wd["first_step_min"] = min(float(wd["first_step_min"]), WATCHDOG_MIN)
    ev = raw["eval"]
    ev.update(num_problems=reh.eval.num_problems, n_samples=reh.eval.n_samples,
              max_tokens=reh.eval.max_tokens, steps=[], final=True, select=None,
              batch_size=reh.eval.num_problems * reh.eval.n_samples)
    ev["vllm"].update(tensor_parallel_size=1, data_parallel_size=1, nodes=1, gpus_per_node=1,
                      max_model_len=None)
    raw["data"]["heldout"] = None
    raw["preflight"]["waive"] = [w for w in raw["preflight"]["waive"] if w != "rehearsal"]
    rcfg = Config.from_dict(raw)
    # The checkpoint directory is the rehearsal layout's (Layout.from_config would name it
    # after the derived run): callers pass rl.checkpoint_dir explicitly.
    return rcfg


def _run_rollout(cfg: Config, layout: Layout) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The run's plan's effective values and its vLLM figures (hy3rl.stage_memory.rollout);
    None while the plan or the model's config is not on disk."""
    from hy3rl.preflight import model_bytes
    from hy3rl.stage_memory import MemoryModelError, rollout

    eff = (read_record(layout.preflight_plan) or {}).get("effective")
    model_cfg = read_record(Path(cfg.model.path) / "config.json")
    if not eff or not model_cfg:
        return None
    gpus = to_int(eff.get("trainer.nnodes"), 0) * to_int(eff.get("trainer.n_gpus_per_node"), 0)
    run_bytes, _ = model_bytes(cfg)
    try:
        return eff, rollout(model_cfg, eff, gpus=gpus, gpu_memory_gb=cfg.cluster.gpu_memory_gb
                            or None, model_bytes=run_bytes)
    except MemoryModelError:
        return None


def _stage_rollout_tp(cfg: Config) -> int:
    """The rollout TP of the ``stage`` shape's rehearsal (rehearsal.env over SHAPE_ENV)."""
    return int({**SHAPE_ENV["stage"], **cfg.rehearsal.env}["ROLLOUT_TP"])


def stage_mem_util(cfg: Config, layout: Layout,
                   run: tuple[dict[str, Any], dict[str, Any]] | None) -> float | None:
    """``shape: stage``: vLLM's memory fraction that gives each engine of the rehearsal (one
    GPU at the shape's rollout TP) the KV capacity in tokens each engine of the run will
    have (hy3rl.stage_memory.matching_utilization: the run's tokens at the stage's bytes a
    token, plus the stage's weights as vLLM loads them, without the MTP layer), from the
    run's plan and model (``run``: :func:`_run_rollout`) and the built stage; None while one
    of them is not on disk yet (before rule rehearsal_model)."""
    from hy3rl.stage_memory import MemoryModelError, matching_utilization

    stage_cfg = read_record(Path(layout.rehearsal_model) / "config.json")
    stage_index = read_record(Path(layout.rehearsal_model) / "model.safetensors.index.json")
    stage_total = ((stage_index or {}).get("metadata") or {}).get("total_size")
    gmem = cfg.cluster.gpu_memory_gb
    if run is None or not stage_cfg or not stage_total or not gmem:
        return None
    eff, figures = run
    rtp = _stage_rollout_tp(cfg)
    try:
        return matching_utilization(
            figures, stage_cfg,
            {**eff, "actor_rollout_ref.rollout.tensor_model_parallel_size": rtp}, float(gmem),
            model_bytes=int(stage_total))
    except MemoryModelError:
        return None


def stage_batch(cfg: Config, run: tuple[dict[str, Any], dict[str, Any]] | None
                ) -> dict[str, int] | None:
    """``shape: stage``: the batch (``TRAIN_BATCH_SIZE``, ``PPO_MINI_BATCH_SIZE`` in the
    run's proportion) that gives each vLLM engine of the rehearsal (its node's GPUs at the
    shape's rollout TP) the requests a step each engine of the run serves (``run``:
    :func:`_run_rollout`); None before the run's plan exists or where no whole batch does."""
    if run is None or not run[1].get("requests_per_engine"):
        return None
    eff, figures = run
    n = to_int(eff.get("actor_rollout_ref.rollout.n"), 0)
    engines = cfg.cluster.gpus_per_node // _stage_rollout_tp(cfg)
    batch = figures["requests_per_engine"] * engines / n if n else 0
    run_batch = to_int(eff.get("data.train_batch_size"), 0)
    run_mini = to_int(eff.get("actor_rollout_ref.actor.ppo_mini_batch_size"), 0)
    if not batch or batch != int(batch) or not run_batch or not run_mini:
        return None
    mini = batch * run_mini / run_batch
    return {"TRAIN_BATCH_SIZE": int(batch),
            "PPO_MINI_BATCH_SIZE": int(mini) if mini == int(mini) and mini >= 1 else int(batch)}


def per_gpu_figures(cfg: Config, layout: Layout, main: Mapping[str, Any],
                    rehearsal: Mapping[str, Any]) -> dict[str, Any]:
    """The per-GPU shapes and lengths of the run's plan and the rehearsal's side by side
    (hy3rl.stage.per_gpu), and the figures that differ (hy3rl.stage.SAME)."""
    from hy3rl.preflight import model_bytes
    from hy3rl.stage import compare, per_gpu
    from hy3rl.stage_memory import plan_prediction

    def config(path: Path) -> dict[str, Any]:
        return read_record(path / "config.json") or {}

    rmodel = Path(layout.rehearsal_model)
    index = read_record(rmodel / "model.safetensors.index.json") or {}
    run_bytes, _ = model_bytes(cfg)
    gmem = cfg.cluster.gpu_memory_gb or None
    run = per_gpu(config(Path(cfg.model.path)), main.get("effective") or {},
                  gpu_memory_gb=gmem, model_bytes=run_bytes)
    reh = per_gpu(config(rmodel), rehearsal.get("effective") or {}, gpu_memory_gb=gmem,
                  model_bytes=(index.get("metadata") or {}).get("total_size"))
    return {"run": run, "rehearsal": reh, "differ": compare(run, reh),
            "memory": plan_prediction(config(Path(cfg.model.path)), main.get("effective")
                                      or {}, config(rmodel), rehearsal.get("effective") or {})}


def runtime_fingerprint(runtime: Runtime) -> str:
    """What the rehearsal's rerun trigger sees of the training runtime without running it
    (stat calls only, as a DAG build may): the declared prefix and python, plus a local
    SIF's size and mtime, or the site-packages folders' mtimes of a python found on this
    host. A change there reruns the rehearsal in the same invocation; a change it cannot
    see (inside a registry image by tag, behind a wrapper) is caught by the train job, which
    compares the full identity (hy3rl.runtime_id) with the rehearsal's and refuses."""
    from hy3rl.launch import LaunchError, resolve_runtime
    from hy3rl.runtime_id import IMAGE_URI, SIF_SUFFIXES, container_image

    try:
        rt = resolve_runtime(runtime)
    except LaunchError as exc:
        return f"unusable: {exc}"
    parts = [f"prefix={rt['prefix']!r}", f"python={rt['python']!r}"]
    tokens = shlex.split(rt["prefix"])
    image = container_image(tokens)
    if image is not None and not IMAGE_URI.match(image) and image.endswith(SIF_SUFFIXES):
        try:
            st = os.stat(image)
            parts.append(f"sif size={st.st_size} mtime_ns={st.st_mtime_ns}")
        except OSError:
            parts.append("sif absent on this host")
    elif not tokens:
        exe = shutil.which(rt["python"])
        if exe:
            env = Path(os.path.abspath(exe)).parent.parent
            for sp in sorted(env.glob("lib/python*/site-packages")):
                parts.append(f"{sp.parent.name}/site-packages mtime_ns={sp.stat().st_mtime_ns}")
    return " ".join(parts)


# --------------------------------------------------------------------------- the plan


def reductions(main: Mapping[str, Any], rehearsal: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every resolved verl value of the rehearsal plan that differs from the run's plan
    (``plan.json`` ``resolved``), with both values; keys only one plan has are listed too."""
    a, b = main.get("resolved") or {}, rehearsal.get("resolved") or {}
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = (a.get(key) or {}).get("value"), (b.get(key) or {}).get("value")
        if va != vb:
            out.append({"key": key, "run": va, "rehearsal": vb})
    return out


def plan(cfg: Config, layout: Layout, *, lock: Path, data_summary: Path, train_files: Path,
         val_files: Path, checkpoint_check: Path | None, bridge_check: Path | None,
         main_plan: Path, model_manifest: Path | None = None) -> None:
    """Rule rehearsal_plan: preflight (hy3rl.preflight.run, every rule and verl's own
    checks) on :func:`derive`'s config into ``rehearsal/preflight/``; then the plan gets
    ``rehearsal``: the reductions against ``main_plan`` (the run's preflight/plan.json),
    the steps and the planned kill. Raises preflight's errors as they are."""
    from hy3rl import preflight
    from hy3rl.runtime_id import sha256_file
    from hy3rl.stage_memory import refusal

    rl = layout.rehearsal_layout()
    rcfg = derive(cfg, layout)
    try:
        main = json.loads(Path(main_plan).read_text())
    except (OSError, ValueError) as exc:
        raise RehearsalError(f"{main_plan}: the run's plan is unreadable ({exc})") from None
    out = Path(rl.preflight_plan)
    preflight.run(rcfg, lock=lock, data_summary=data_summary, train_files=train_files,
                  val_files=val_files, checkpoint_check=checkpoint_check,
                  bridge_check=bridge_check, plan=out, launch=Path(rl.preflight_launch),
                  refused=Path(rl.preflight_refused), reward_fn=rl.preflight_reward_fn,
                  model_manifest=model_manifest,
                  checkpoint_dir=rl.checkpoint_dir)
    doc = json.loads(out.read_text())
    doc["rehearsal"] = {
        "of_plan": str(main_plan), "of_plan_sha256": sha256_file(Path(main_plan)),
        "model": (asdict(cfg.rehearsal.model) if cfg.rehearsal.shape == "small"
                  else read_record(Path(layout.rehearsal_model) / "stage-hy3.json")),
        "nodes": 1,
        "gpus_per_node": cfg.cluster.gpus_per_node, "total_training_steps": TOTAL,
        "save_freq": 1, "kill_after": KILL_AFTER,
        "reductions": reductions(main, doc),
        "shape": cfg.rehearsal.shape,
        "per_gpu": per_gpu_figures(cfg, layout, main, doc),
    }
    differ = doc["rehearsal"]["per_gpu"]["differ"]
    too_big = refusal(doc["rehearsal"]["per_gpu"]["memory"], cfg.cluster.gpu_memory_gb or None,
                      cfg.rehearsal.memory_headroom)
    if too_big:
        out.unlink(missing_ok=True)
        raise RehearsalError(f"{too_big}: lower the stored activations (ACTOR_PP, "
                             "PPO_MAX_TOKEN_LEN_PER_GPU, recompute) or the static memory "
                             "(ACTOR_EP, more GPUs) before any GPU job")
    if cfg.rehearsal.shape == "stage" and differ:
        out.unlink(missing_ok=True)
        raise RehearsalError(
            "rehearsal.shape stage: the rehearsal's per-GPU figures differ from the run's, so "
            "its memory peaks would not be the run's: " + "; ".join(
                f"{d['key']}: run {d['run']}, rehearsal {d['rehearsal']}" for d in differ)
            + " (rehearsal.env may not change the run's per-GPU layout or lengths with this "
            "shape; set rehearsal.shape: small to rehearse reduced)")
    write_json_atomic(out, doc)
    log.info("rehearsal plan %s: %d reductions against %s", out,
             len(doc["rehearsal"]["reductions"]), main_plan)


# --------------------------------------------------------------------------- the job


@dataclass
class Check:
    name: str
    status: str
    detail: str

    @classmethod
    def of(cls, name: str, problems: Sequence[str], ok: str) -> Check:
        return cls(name, FAIL, "; ".join(problems)) if problems else cls(name, PASS, ok)


@dataclass
class Records:
    """What the rehearsal left (read back from disk; every check reads these only)."""

    plan: dict[str, Any]
    attempts: list[dict[str, Any]]
    attempt_lines: dict[int, list[dict[str, Any]]]
    merged: list[dict[str, Any]]
    done: dict[str, Any] | None
    complete: dict[int, tuple[bool, str]]
    driver_logs: dict[int, str]
    samples: list[dict[str, Any]] | None
    samples_meta: dict[str, Any] | None
    expected_samples: int
    failure: dict[str, Any] | None = None  # the phase and error a run ended on
    extra: dict[str, Any] = field(default_factory=dict)
    # the checkpoints' state (:func:`read_state`) and the reward probe's result
    # (hy3rl.reward_probe.probe); absent: those checks fail as not read / not run
    state: dict[str, Any] = field(default_factory=dict)
    reward_path: dict[str, Any] | None = None
    # one GPU's memory (cluster.gpu_memory_gb) and the share of it a peak may reach
    # (rehearsal.memory_headroom); None: not given, the check memory_headroom is not run
    gpu_memory_gb: float | None = None
    memory_headroom: float | None = None
    # every GPU of the node sampled while the rehearsal ran (hy3rl.gpu_memory.Sampler's
    # record); None: not sampled
    node_gpus: dict[str, Any] | None = None

    @classmethod
    def read(cls, rl: Layout, expected_samples: int,
             failure: dict[str, Any] | None = None, model: Path | None = None,
             reward_path: dict[str, Any] | None = None, gpu_memory_gb: float | None = None,
             memory_headroom: float | None = None,
             node_gpus: dict[str, Any] | None = None) -> Records:
        from hy3rl.ckptdir import check_complete
        from hy3rl.train import attempt_numbers, load_attempt

        ks = attempt_numbers(rl)
        attempts = [load_attempt(rl, k) for k in ks]
        lines = {}
        for k in ks:
            try:
                lines[k] = read_metrics(Path(rl.attempt_metrics(k)))
            except StageError as exc:
                lines[k] = []
                log.warning("%s", exc)
        logs = {}
        for k in ks:
            p = Path(rl.attempt_logs(k)) / "driver.log"
            logs[k] = p.read_text(errors="replace")[-2**20:] if p.is_file() else ""
        ckpt = rl.checkpoint_dir
        complete = {s: check_complete(ckpt / f"global_step_{s}", s) for s in range(1, TOTAL + 1)}
        samples = None
        spath = Path(rl.eval_samples("final"))
        if spath.is_file():
            samples = [json.loads(ln) for ln in spath.read_text().splitlines() if ln.strip()]
        try:
            merged = read_metrics(Path(rl.train_metrics))
        except StageError:
            merged = []
        return cls(plan=read_record(rl.preflight_plan) or {}, attempts=attempts,
                   attempt_lines=lines,
                   merged=merged, done=read_record(rl.train_done), complete=complete,
                   driver_logs=logs, samples=samples,
                   samples_meta=read_record(rl.eval_samples_meta("final")),
                   expected_samples=expected_samples, failure=failure,
                   state=read_state(rl, model), reward_path=reward_path,
                   gpu_memory_gb=gpu_memory_gb, memory_headroom=memory_headroom,
                   node_gpus=node_gpus)


def _train_lines(lines: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Lines of training steps (a validation-only line, e.g. before training, has no
    ``timing_s/step``)."""
    return [ln for ln in lines if "timing_s/step" in (ln.get("data") or {})]


def phase_times(rec: Records) -> dict[str, float | None]:
    """Seconds of each phase (docs/formats/rehearsal.md): ``startup`` (submission to the
    first line, attempt 1), ``step`` (the slowest step without its save), ``save`` (the
    slowest save), ``resume`` (submission to the first line after the kill: Ray, the model
    loads and the checkpoint load), ``evaluation`` (the generation), ``total``."""
    def startup(a: Mapping[str, Any] | None) -> float | None:
        return finite_number(((a or {}).get("timing") or {}).get("startup_s"))

    first = rec.attempts[0] if rec.attempts else None
    second = rec.attempts[1] if len(rec.attempts) > 1 else None
    steps, saves = [], []
    for ln in _train_lines(rec.merged):
        d = ln["data"]
        save = finite_number(d.get("timing_s/save_checkpoint"))
        step = finite_number(d.get("timing_s/step"))
        if save is not None:
            saves.append(save)
        if step is not None:
            steps.append(step - (save or 0.0))
    meta = rec.samples_meta or {}
    return {"startup": startup(first), "step": max(steps) if steps else None,
            "save": max(saves) if saves else None, "resume": startup(second),
            "evaluation": finite_number(meta.get("seconds")),
            "total": rec.extra.get("total_s")}


# --------------------------------------------------------------------------- the state read back


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> its safetensors file in an HF directory (headers only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RehearsalError(f"{folder}: no safetensors file")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                out[name] = f
    return out


def tensor_bits(t: Any) -> Any:
    """The tensor's elements as integers of its width (bit-exact comparison, NaN included)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().reshape(-1).view(ints[t.element_size()])


def squared_distance(x: Any, y: Any, chunk: int = 1 << 24) -> float:
    """``sum((x - y)**2)`` in float64, a chunk of elements at a time (a stage's embedding
    holds ~10^9 elements: no float64 copy of it whole); NaN when either holds NaN."""
    import torch

    a, b = x.reshape(-1), y.reshape(-1)
    total = 0.0
    for i in range(0, a.numel(), chunk):
        d = a[i:i + chunk].to(torch.float64) - b[i:i + chunk].to(torch.float64)
        total += float(torch.dot(d, d))
    return total


def weight_changes(model: Path, before: Path, after: Path) -> dict[str, Any]:
    """The input model, step 2's and step 3's HF exports compared tensor by tensor (lazily,
    one tensor of each at a time, with safetensors): the inventory problems (a name missing
    or extra, a shape or dtype unlike the input's) and per tensor of the input its ``kind``
    (``fixed``: :data:`FIXED_TENSOR`; ``mtp``: a layer at or past the config's
    ``num_hidden_layers``, which verl trains only with MTP enabled; ``trained``), ``numel``,
    ``ndim``, the elements that differ bitwise from step 2's (``vs_before``) and from the
    input's (``vs_input``), and step 2's and step 3's squared distance from the input
    (``sq_before``, ``sq_after``: :func:`squared_distance`). Raises
    :class:`RehearsalError` for a directory it cannot read."""
    from contextlib import ExitStack

    from safetensors import SafetensorError, safe_open

    try:
        layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
        files = {k: _tensor_files(Path(d)) for k, d in
                 (("input", model), ("before", before), ("after", after))}
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise RehearsalError(f"cannot read the weights to compare: {exc}") from None
    def is_mtp(name: str) -> bool:
        m = LAYER_INDEX.match(name)
        return bool(m) and int(m.group(1)) >= layers

    problems = []
    # verl@220e903 (megatron_utils.check_mtp_config) builds no MTP layer unless
    # actor_rollout_ref.model.mtp.enable: the exports may lack the input's MTP tensors
    mtp_absent = sorted({n for n in files["input"] if is_mtp(n)
                         and not all(n in files[w] for w in ("before", "after"))})
    for which, step in (("before", KILL_AFTER), ("after", TOTAL)):
        missing = sorted(set(files["input"]) - set(files[which]) - set(mtp_absent))
        extra = sorted(set(files[which]) - set(files["input"]))
        for what, names in (("lacks", missing), ("has, unlike the input,", extra)):
            if names:
                problems.append(f"step {step}'s export {what} {len(names)} tensor(s): "
                                f"{', '.join(names[:SHOWN])}")
    tensors: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def tensor(which: str, name: str) -> Any:
            path = files[which][name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            return handles[path].get_tensor(name)

        for name in files["input"]:
            if not all(name in files[w] for w in ("before", "after")):
                continue
            ref, b, a = tensor("input", name), tensor("before", name), tensor("after", name)
            unlike = [f"step {s}: {tuple(t.shape)} {t.dtype}" for s, t in
                      ((KILL_AFTER, b), (TOTAL, a)) if (t.shape, t.dtype) != (ref.shape, ref.dtype)]
            if unlike:
                problems.append(f"{name}: input {tuple(ref.shape)} {ref.dtype}, "
                                + ", ".join(unlike))
                continue
            kind = ("fixed" if FIXED_TENSOR.search(name) else
                    "mtp" if is_mtp(name) else "trained")
            tensors[name] = {"kind": kind, "numel": ref.numel(), "ndim": ref.dim(),
                             "vs_before": int((tensor_bits(a) != tensor_bits(b)).sum()),
                             "vs_input": int((tensor_bits(a) != tensor_bits(ref)).sum()),
                             "sq_before": squared_distance(b, ref),
                             "sq_after": squared_distance(a, ref)}
    return {"model": str(model), "before": str(before), "after": str(after),
            "problems": problems, "tensors": tensors, "mtp_absent": mtp_absent}


def data_position(path: Path) -> int:
    """Batches the train dataloader had yielded at a save, from verl's ``data.pt``: a
    StatefulDataLoader's ``state_dict()`` (torchdata): ``_num_yielded`` (no workers) or
    ``_snapshot._snapshot_step + _steps_since_snapshot`` (worker processes, verl's default)."""
    sd = _torch_load(path)
    if isinstance(sd, dict) and "_num_yielded" in sd:
        return int(sd["_num_yielded"])
    if isinstance(sd, dict) and isinstance(sd.get("_snapshot"), dict):
        try:
            return int(sd["_snapshot"]["_snapshot_step"]) + int(sd["_steps_since_snapshot"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RehearsalError(f"{path}: a dataloader snapshot without {exc}") from None
    raise RehearsalError(f"{path}: not a StatefulDataLoader state (keys: "
                         f"{sorted(sd) if isinstance(sd, dict) else type(sd).__name__})")


def optimizer_steps(path: Path) -> int:
    """The optimizer's step count at a save: ``lr_scheduler.num_steps`` in the actor's
    optimizer checkpoint's ``common.pt`` (Megatron's OptimizerParamScheduler state, which the
    resume restores; plain values, read without Megatron)."""
    sd = _torch_load(path)
    try:
        return int(sd["lr_scheduler"]["num_steps"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RehearsalError(f"{path}: no lr_scheduler.num_steps ({exc!r})") from None


def _torch_load(path: Path) -> Any:
    import pickle

    import torch

    if not Path(path).is_file():
        raise RehearsalError(f"{path}: absent")
    try:  # plain containers and tensors only
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, OSError, EOFError):
        pass
    try:  # as verl and Megatron load them (the trainer wrote them for this run)
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a class only the training runtime has, a truncated file
        raise RehearsalError(f"{path}: unreadable ({type(exc).__name__}: "
                             f"{(str(exc).splitlines() or [''])[0][:200]})") from None


def read_state(rl: Layout, model: Path | None) -> dict[str, Any]:
    """What the checks ``updated``, ``resumed_data`` and ``resumed_optimizer`` read of the
    checkpoints: ``weights`` (:func:`weight_changes` of ``model``, step 2 and step 3),
    ``data`` and ``optimizer`` (step -> :func:`data_position` / :func:`optimizer_steps`);
    what could not be read is an ``error`` string in its place."""
    def attempt(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RehearsalError as exc:
            return {"error": str(exc)}

    steps = (KILL_AFTER, TOTAL)
    return {
        "weights": (attempt(weight_changes, model, rl.checkpoint_hf_model(KILL_AFTER),
                            rl.checkpoint_hf_model(TOTAL)) if model is not None
                    else {"error": "no input model given"}),
        "data": {s: attempt(data_position, rl.checkpoint_data_state(s)) for s in steps},
        "optimizer": {s: attempt(optimizer_steps, rl.checkpoint_optimizer_common(s))
                      for s in steps},
    }


def _largest(names: Sequence[str], tensors: Mapping[str, Mapping[str, Any]]) -> str:
    top = sorted(names, key=lambda n: -tensors[n]["numel"])[:SHOWN]
    return ", ".join(f"{n} ({tensors[n]['numel']} elements)" for n in top)


def _check_updated(state: Mapping[str, Any]) -> Check:
    """Step 3's export against step 2's and the input's: the input's inventory (names, shapes,
    dtypes); every trained matrix (``ndim`` >= 2, not fixed, not MTP) changed against both;
    every fixed tensor (the expert bias) bit-identical to both. 1-D trained tensors (norm
    weights near 1.0, where one bf16 step is 2^-8) and MTP tensors are counted, not required;
    MTP tensors may be absent from the exports (counted)."""
    w = state.get("weights") or {"error": "not read"}
    if "error" in w:
        return Check.of("updated", [str(w["error"])], "")
    t = w["tensors"]
    problems = list(w["problems"])
    fixed = [n for n, v in t.items() if v["kind"] == "fixed"]
    moved = [n for n in fixed if t[n]["vs_before"] or t[n]["vs_input"]]
    for n in moved:
        problems.append(f"{n} (fixed: expert bias at update rate 0) moved: "
                        f"{t[n]['vs_before']} of {t[n]['numel']} elements against step "
                        f"{KILL_AFTER}, {t[n]['vs_input']} against the input")
    required = [n for n, v in t.items() if v["kind"] == "trained" and v["ndim"] >= 2]
    figures = []
    for key, against in (("vs_before", f"step {KILL_AFTER}"), ("vs_input", "the input")):
        same = [n for n in required if not t[n][key]]
        if same:
            problems.append(f"{len(same)} of {len(required)} trained matrices unchanged at step "
                            f"{TOTAL} against {against}; largest: {_largest(same, t)}")
        elements = sum(t[n]["numel"] for n in required)
        changed = sum(t[n][key] for n in required)
        figures.append(f"against {against} {len(required) - len(same)} of {len(required)} "
                       f"trained matrices changed ({100 * changed / max(elements, 1):.1f}% of "
                       "their elements)")
    if required:
        farther, figure = _farther(t, required)
        figures.append(figure)
        if not farther:
            problems.append(f"step {TOTAL} is not farther from the input than step "
                            f"{KILL_AFTER} ({figure}; at least {MIN_GROWTH:g} x expected): "
                            f"the resume did not continue from step {KILL_AFTER}'s weights "
                            "(step 3 was trained from the input model or an older "
                            "checkpoint)")
    else:
        problems.append("no trained matrix in the input's inventory")
    if not fixed:
        problems.append("no expert bias (mlp.expert_bias / e_score_correction_bias) in the "
                        "input's inventory")
    vectors = [n for n, v in t.items() if v["kind"] == "trained" and v["ndim"] < 2]
    mtp = [n for n, v in t.items() if v["kind"] == "mtp"]
    figures.append(f"1-D {sum(1 for n in vectors if t[n]['vs_before'])} of {len(vectors)} and "
                   f"MTP {sum(1 for n in mtp if t[n]['vs_before'])} of {len(mtp)} changed "
                   f"against step {KILL_AFTER}")
    if w.get("mtp_absent"):
        figures.append(f"{len(w['mtp_absent'])} MTP tensors of the input not exported (verl "
                       "builds no MTP layer without actor_rollout_ref.model.mtp.enable)")
    figures.append(f"{len(fixed) - len(moved)} of {len(fixed)} expert biases bit-identical")
    return Check.of("updated", problems, f"step {TOTAL}'s export: " + "; ".join(figures))


def _farther(t: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> tuple[bool, str]:
    """Whether step 3's trained matrices lie at least :data:`MIN_GROWTH` times farther from
    the input than step 2's (the L2 norm of their change), and the figure."""
    import math

    before = math.sqrt(sum(float(t[n].get("sq_before", math.nan)) for n in names))
    after = math.sqrt(sum(float(t[n].get("sq_after", math.nan)) for n in names))
    ratio = after / before if before > 0 else math.nan
    ok = math.isfinite(ratio) and ratio >= MIN_GROWTH
    return ok, (f"distance from the input {before:.4g} at step {KILL_AFTER}, {after:.4g} at "
                f"step {TOTAL} ({ratio:.3g} x)")


def _check_continued(state: Mapping[str, Any], name: str, key: str, what: str,
                     source: str, lost: str) -> Check:
    """Step 3's count (``state[key]``) continues steps 1-2's: step 2's count is
    ``KILL_AFTER`` x a positive per-step increment and step 3's is one increment more."""
    got = state.get(key) or {}
    problems = [f"global_step_{s}: {(got.get(s) or {}).get('error', 'not read')}"
                for s in (KILL_AFTER, TOTAL) if not isinstance(got.get(s), int)]
    if problems:
        return Check.of(name, problems, "")
    before, after = got[KILL_AFTER], got[TOTAL]
    per_step, rest = divmod(before, KILL_AFTER)
    figure = (f"{what} ({source}): global_step_{KILL_AFTER} {before}, global_step_{TOTAL} "
              f"{after}")
    if per_step <= 0 or rest:
        problems.append(f"{figure}: steps 1-{KILL_AFTER} did not advance it by a whole, "
                        f"positive amount a step")
    elif after != before + per_step:
        why = lost if after == per_step else f"expected {before + per_step}"
        problems.append(f"{figure}: {why}")
    return Check.of(name, problems, f"{figure} ({per_step} a step)")


def memory_peaks(by_step: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The memory record (``checks.json`` ``memory``): per phase of :data:`MEMORY_PHASES`,
    per metric (:data:`GPU_MEMORY`, :data:`HOST_MEMORY`), its ``peak`` over the logged
    training steps and the ``step`` it was logged at, or None, and the steps that lack it
    (``missing``: a missing or non-finite value)."""
    out: dict[str, Any] = {}
    for phase, prefix in MEMORY_PHASES.items():
        figures = {}
        for name in (*GPU_MEMORY, HOST_MEMORY):
            key = prefix + name
            values = {s: finite_number(d.get(key)) for s, d in sorted(by_step.items())}
            seen = {s: v for s, v in values.items() if v is not None}
            top = max(seen, key=lambda s: seen[s]) if seen else None
            figures[name] = {"key": key, "peak": None if top is None else seen[top],
                             "step": top, "missing": [s for s, v in values.items() if v is None]}
        out[phase] = figures
    return out


def _check_memory(rec: Records, by_step: Mapping[int, Mapping[str, Any]]) -> Check:
    """Every peak of GPU memory verl logged (:func:`memory_peaks`, :data:`GPU_MEMORY`) at most
    ``rec.memory_headroom`` of one GPU (``rec.gpu_memory_gb`` x 1e9 bytes). A peak above it
    fails, naming the phase, the metric, the step, the peak and the device; a metric missing
    at a logged step, no logged step, or no device memory configured: ``not run``, naming
    what is missing (never a pass)."""
    name = "memory_headroom"
    device, share = rec.gpu_memory_gb, rec.memory_headroom
    if not device or device <= 0 or share is None:
        return Check(name, NOT_RUN, f"not run: no GPU memory to hold the peaks against "
                     f"(cluster.gpu_memory_gb = {device!r}: set it to one GPU's memory, e.g. "
                     "96 for an H20)")
    if not by_step:
        return Check(name, NOT_RUN, "not run: no training step logged")
    limit = share * device * 1e9 / GIB
    of = f"{share:g} of the {device:g} GB GPU ({limit:.1f} GiB)"
    problems, missing, shown = [], [], []
    for phase, figures in memory_peaks(by_step).items():
        parts = []
        for metric in (*GPU_MEMORY, HOST_MEMORY):
            f = figures[metric]
            if f["missing"] and metric in GPU_MEMORY:
                missing.append(f"{f['key']} not logged at step(s) "
                               f"{', '.join(map(str, f['missing']))}")
            if f["peak"] is None:
                continue
            if metric in GPU_MEMORY and f["peak"] > limit:
                problems.append(f"phase {phase}: {f['key']} {f['peak']:.1f} GiB at step "
                                f"{f['step']} is above {of}")
            parts.append(f"{f['key']} {f['peak']:.1f} GiB (step {f['step']})")
        shown.append(f"phase {phase}: {', '.join(parts) or 'no figure'}")
    if problems:  # verl's own figures: one rank a data-parallel group
        problems[-1] += f" ({ONE_RANK})"
    predicted, figure = _predicted_stages(rec, by_step, share * device)
    node, node_figure = judge_node(rec.node_gpus, share * device)
    problems += predicted + node
    figure += node_figure
    if problems:
        return Check(name, FAIL, "; ".join(problems + missing) + figure)
    if missing:
        return Check(name, NOT_RUN, "not run: " + "; ".join(missing))
    return Check(name, PASS, f"{'; '.join(shown)}: each GPU peak at most {of}{figure}")


# whose peak verl logs: its metrics come from one rank (the last pipeline stage's tensor-
# and context-parallel rank 0 of each data-parallel group, the max over those groups)
ONE_RANK = ("one GPU's peak per data-parallel group, as verl logs it: the other context- "
            "and tensor-parallel ranks of the node are not recorded")


def _predicted_stages(rec: Records, by_step: Mapping[int, Mapping[str, Any]],
                      limit_gb: float) -> tuple[list[str], str]:
    """Every real pipeline stage's peak predicted from the rehearsal's measured one
    (hy3rl.stage_memory.from_measured, with the plan's ``rehearsal.per_gpu.memory``): the
    problems (a stage above ``limit_gb``, named) and the figure; nothing without the plan's
    prediction or a measured peak."""
    from hy3rl.stage_memory import from_measured

    memory = (((rec.plan or {}).get("rehearsal") or {}).get("per_gpu") or {}).get("memory")
    peaks = [f["peak"] for phase in memory_peaks(by_step).values()
             for m, f in phase.items() if m in GPU_MEMORY and f["peak"] is not None]
    if not memory or "run" not in memory or not peaks:
        return [], ""
    measured = max(peaks) * GIB / 1e9
    rows = from_measured(measured, memory["run"], memory["rehearsal"])
    top = max(rows, key=lambda r: r["peak_gb"])
    over = [r for r in rows if r["peak_gb"] > limit_gb]
    figure = (f"; the run's stages predicted from the measured {measured:.1f} GB: stage "
              f"{top['stage']} ({top['mix']}) {top['peak_gb']:.1f} GB the largest")
    return [f"stage {r['stage']} of the run ({r['mix']}) predicted at {r['peak_gb']:.1f} GB "
            f"(the measured {measured:.1f} GB plus its predicted difference from the "
            f"rehearsal's stage), above {limit_gb:.1f} GB" for r in over], figure


def check_records(rec: Records) -> list[Check]:
    """Every check of the rehearsal on its records (module doc; docs/formats/rehearsal.md)."""
    out: list[Check] = []
    rp = rec.plan.get("rehearsal") or {}
    out.append(Check.of("plan", [] if rp and rec.plan.get("ok") else
                        ["the rehearsal plan is missing, not ok, or lacks its reductions"],
                        f"{len(rp.get('reductions') or [])} reductions listed"))
    done = rec.done or {}
    out.append(Check.of("trained", [] if done.get("final_step") == TOTAL else
                        [f"training did not reach step {TOTAL} (done.json: "
                         f"{done.get('final_step') if rec.done else 'absent'})"],
                        f"steps 1-{TOTAL} trained, done.json written"))

    by_step: dict[int, Mapping[str, Any]] = {ln["step"]: ln["data"]
                                             for ln in _train_lines(rec.merged)}
    problems = []
    for s in range(1, TOTAL + 1):
        if s not in by_step:
            problems.append(f"step {s} not logged")
            continue
        missing = [k if k not in by_step[s] else f"{k} ({_logged(by_step[s], k)})"
                   for k in STEP_KEYS if finite_number(by_step[s].get(k)) is None]
        if missing:
            problems.append(f"step {s} lacks {', '.join(missing)}")
    vals = [(ln.get("step"), k, v) for ln in rec.merged
            for k, v in (ln.get("data") or {}).items() if VAL_KEY.match(k)]
    if not vals:
        problems.append("no validation metric val-core/<source>/acc/mean@<n> logged")
    for step, k, v in vals:
        if finite_number(v) is None:
            problems.append(f"validation at step {step}: {k} "
                            f"{_logged({k: v}, k)}")
    out.append(Check.of("steps_logged", problems,
                        f"steps 1-{TOTAL} logged with {', '.join(STEP_KEYS)} and a "
                        "validation accuracy"))

    problems = [f"global_step_{s}: {why}" for s in (KILL_AFTER, TOTAL)
                for ok, why in [rec.complete.get(s, (False, "not checked"))] if not ok]
    out.append(Check.of("checkpoints", problems,
                        f"global_step_{KILL_AFTER} and global_step_{TOTAL} complete by verl's "
                        "manifest"))

    first = rec.attempts[0] if rec.attempts else {}
    problems = []
    if first.get("outcome") != "planned_kill":
        problems.append(f"attempt 1 did not end at its planned kill after step "
                        f"{KILL_AFTER}'s save (outcome {first.get('outcome')!r}: "
                        f"{first.get('exit_reason')})")
    elif first.get("end_step") != KILL_AFTER:
        problems.append(f"attempt 1's newest complete checkpoint at the kill was "
                        f"{first.get('end_step')}, not {KILL_AFTER}")
    trained = [ln["step"] for ln in _train_lines(rec.attempt_lines.get(first.get("attempt"),
                                                                        []))]
    last = first.get("last_logged_step", max(trained, default=None))
    if first and last != KILL_AFTER:
        problems.append(f"attempt 1's last logged training step was {last}, not {KILL_AFTER}")
    out.append(Check.of("killed", problems,
                        f"attempt 1 ended at step {KILL_AFTER} with global_step_{KILL_AFTER} "
                        f"complete: {first.get('exit_reason')}"))

    problems = []
    second = rec.attempts[1] if len(rec.attempts) > 1 else None
    if second is None:
        problems.append("no attempt after the kill")
    else:
        if second.get("start_step") != KILL_AFTER:
            problems.append(f"attempt 2 was prepared from step {second.get('start_step')}, "
                            f"not {KILL_AFTER}")
        steps = [ln["step"] for ln in _train_lines(rec.attempt_lines.get(second["attempt"], []))]
        if not steps:
            problems.append("attempt 2 logged no training step")
        elif steps[0] != KILL_AFTER + 1:
            problems.append(f"attempt 2's first step was {steps[0]}, not {KILL_AFTER + 1}: the "
                            f"trainer did not resume from global_step_{KILL_AFTER}")
        if second.get("outcome") != "succeeded":
            problems.append(f"attempt 2 ended {second.get('outcome')!r}: "
                            f"{second.get('exit_reason')}")
    out.append(Check.of("resumed", problems,
                        f"attempt 2 resumed from global_step_{KILL_AFTER}: first step "
                        f"{KILL_AFTER + 1}"))

    problems = [f"step {s}: critic/score/mean {_logged(by_step[s], 'critic/score/mean')}"
                for s in sorted(by_step)
                if finite_number(by_step[s].get("critic/score/mean")) is None]
    lows = {s: finite_number(by_step[s].get(SCORE_MIN_KEY)) for s in sorted(by_step)}
    if lows and all(v is not None and v > 0 for v in lows.values()):
        problems.append(f"every response of every step scored above 0 ({SCORE_MIN_KEY}: "
                        + ", ".join(f"step {s} {v:g}" for s, v in lows.items())
                        + "): all answers right, impossible for the rehearsal's random "
                        "model; the reward does not judge the responses")
    for k, text in sorted(rec.driver_logs.items()):
        m = REWARD_ERROR.search(text)
        if m:
            problems.append(f"attempt {k}'s driver log: {m.group(0)[:200]!r}")
    if not by_step:
        problems.append("no step scored")
    out.append(Check.of("reward", problems,
                        "every step scored (finite critic/score/mean), no reward or grader "
                        "error in the trainer's output"))

    meta = rec.samples_meta or {}
    problems = []
    if rec.samples is None:
        problems.append("no samples" + (f" ({meta.get('status')}: {meta.get('reason')})"
                                        if meta.get("status") else ""))
    else:
        if len(rec.samples) != rec.expected_samples:
            problems.append(f"{len(rec.samples)} samples, expected {rec.expected_samples}")
        if meta.get("status") != "complete":
            problems.append(f"samples.meta.json status {meta.get('status')!r}")
    out.append(Check.of("evaluation", problems,
                        f"{rec.expected_samples} samples ({meta.get('backend')})"))
    out += [_check_generated(rec, by_step), _check_finish_reasons(rec),
            _check_finite(by_step), _check_updated(rec.state),
            _check_continued(rec.state, "resumed_data", "data",
                             "train batches the dataloader had yielded",
                             "verl's data.pt, the StatefulDataLoader state",
                             "the data order restarted at the resume"),
            _check_continued(rec.state, "resumed_optimizer", "optimizer", "optimizer steps",
                             "lr_scheduler.num_steps in the optimizer checkpoint's common.pt",
                             "the optimizer's step count restarted at the resume")]
    rp = rec.reward_path or {"status": NOT_RUN, "detail": "not run: the rehearsal did not "
                             "reach the reward probe"}
    out.append(Check("reward_path", rp["status"], rp["detail"]))
    out.append(_check_memory(rec, by_step))
    out.append(_check_full_length(rec, by_step))

    times = phase_times(rec)
    missing = [p for p in ("startup", "step", "save", "resume", "evaluation")
               if times.get(p) is None]
    out.append(Check.of("phases", [f"no time recorded for {', '.join(missing)}"] if missing
                        else [], ", ".join(f"{p} {v:.1f}s" for p, v in times.items()
                                           if v is not None)))
    return out


def _is_empty(sample: Mapping[str, Any]) -> bool:
    """A sample with no text: nothing generated, or nothing but the EOS token (vLLM counts
    the EOS among a response's token ids and leaves it out of the text)."""
    text = sample.get("response")
    return not (isinstance(text, str) and text.strip())


def _check_generated(rec: Records, by_step: Mapping[int, Mapping[str, Any]]) -> Check:
    """Tokens were generated, as verl@220e903 counts them (trainer/ppo/metric_utils.py: a
    response's length is its token count, EOS included; one of length 0 is aborted): at every
    logged training step ``response_length/mean`` above 1 (more than the EOS token a
    response) and ``response/aborted_ratio`` at most :data:`MAX_ABORTED`; every evaluation
    sample judged on its text, at most :data:`MAX_EMPTY_SHARE` of them empty
    (:func:`_is_empty`: no text, e.g. the EOS token alone)."""
    problems, shown = [], []
    for s in sorted(by_step):
        data = by_step[s]
        v = finite_number(data.get(LENGTH_KEY))
        if v is None:
            problems.append(f"step {s}: {LENGTH_KEY} {_logged(data, LENGTH_KEY)}")
            continue
        if v <= 1:
            problems.append(f"step {s}: {LENGTH_KEY} {v:g}: the rollouts generated nothing "
                            "but the EOS token")
        aborted = finite_number(data.get(ABORTED_KEY))
        if ABORTED_KEY in data and aborted is None:
            problems.append(f"step {s}: {ABORTED_KEY} {_logged(data, ABORTED_KEY)}")
        elif aborted is not None and aborted > MAX_ABORTED:
            problems.append(f"step {s}: {ABORTED_KEY} {aborted:g}: most rollouts were "
                            f"aborted (at most {MAX_ABORTED:g} expected)")
        low = finite_number(data.get(MIN_LENGTH_KEY))
        extra = ([] if low is None else [f"min {low:g}"]) + (
            [] if aborted is None else [f"aborted {aborted:g}"])
        shown.append(f"step {s} {v:g}" + (f" ({', '.join(extra)})" if extra else ""))
    if not by_step:
        problems.append("no training step logged")
    evaluation = "no evaluation samples"
    if rec.samples is None:
        problems.append(evaluation)
    else:
        counts = [finite_number(s.get("num_tokens")) for s in rec.samples]
        bad = [i for i, n in enumerate(counts) if n is None]
        if bad:
            problems.append(f"{len(bad)} evaluation sample(s) without a token count (sample "
                            f"{bad[0]}: {rec.samples[bad[0]].get('num_tokens')!r})")
        numbers = [n for n in counts if n is not None]
        mean = sum(numbers) / len(numbers) if numbers else 0.0
        empty = [i for i, s in enumerate(rec.samples) if _is_empty(s)]
        evaluation = (f"evaluation: {len(rec.samples)} samples, mean {mean:g} tokens, "
                      f"{len(empty)} empty")
        if not rec.samples:
            problems.append(f"{evaluation}: the evaluation generated nothing")
        elif len(empty) > MAX_EMPTY_SHARE * len(rec.samples):
            first = rec.samples[empty[0]]
            problems.append(
                f"{evaluation}: more than {MAX_EMPTY_SHARE:g} of the samples have no text "
                f"(first: sample {empty[0]}, problem {first.get('problem_id')!r}, "
                f"{first.get('num_tokens')!r} token(s), finish reason "
                f"{first.get('finish_reason')!r})")
    return Check.of("generated", problems, f"{LENGTH_KEY}: {', '.join(shown)}; {evaluation}")


def _logged(data: Mapping[str, Any], key: str) -> str:
    """How a metric that is not a finite number was logged: missing, or null (verl's
    FileLogger writes NaN and ±inf so, orjson at the pin), or the value itself."""
    if key not in data:
        return "missing"
    if data[key] is None:
        return "null (NaN or ±inf as verl's FileLogger writes them)"
    return f"not a finite number ({data[key]!r})"


def _check_full_length(rec: Records, by_step: Mapping[int, Mapping[str, Any]]) -> Check:
    """The memory peaks were met at full length: some training step's responses reached the
    plan's ``data.max_response_length`` (verl's ``response_length/max``; its
    ``response_length/clip_ratio``, shown beside it, is measured by the v1 trainer against
    the batch's longest response, not the limit, so it is never 0 and says nothing of the
    limit: verl/trainer/ppo/v1/trainer_base.py at the pin). A model that ended
    every response early measured smaller activations than the run's longest step; with
    ``shape: stage`` the random weights of the real 120,832-token vocabulary end a response
    by EOS with odds ~1/120,832 a token, so nearly every response runs to the limit."""
    limit_f = finite_number(((rec.plan or {}).get("effective") or {}).get(
        "data.max_response_length"))
    limit = None if limit_f is None else int(limit_f)
    problems, shown, full = [], [], []
    for s in sorted(by_step):
        clip = finite_number(by_step[s].get(CLIP_KEY))
        top = finite_number(by_step[s].get(MAX_LENGTH_KEY))
        if clip is None:
            problems.append(f"step {s}: {CLIP_KEY} missing or not a finite number "
                            f"({by_step[s].get(CLIP_KEY)!r})")
            continue
        shown.append(f"step {s} {clip:g} (max {top if top is None else f'{top:g}'})")
        if limit is not None and top is not None and top >= limit:
            full.append(s)
    if limit is None:
        problems.append("the plan names no data.max_response_length to compare "
                        f"{MAX_LENGTH_KEY} with")
    if not by_step:
        problems.append("no training step logged")
    elif not problems and not full:
        problems.append(f"no step's responses reached max_response_length {limit} "
                        f"({CLIP_KEY}: {', '.join(shown)}): the memory peaks were measured "
                        "below the run's full-length step")
    return Check.of("full_length", problems, f"responses at max_response_length {limit} in "
                    f"step(s) {full} ({CLIP_KEY}: {', '.join(shown)})")


def _check_finish_reasons(rec: Records) -> Check:
    """Every evaluation sample finished as vLLM reports a finished request (:data:`FINISHED`);
    ``None`` (unfinished) or ``"abort"`` fail, with their count and the first such sample."""
    if rec.samples is None:
        return Check.of("finish_reasons", ["no evaluation samples"], "")
    counts: dict[str, int] = {}
    for s in rec.samples:
        key = json.dumps(s.get("finish_reason"))
        counts[key] = counts.get(key, 0) + 1
    bad = [(i, s) for i, s in enumerate(rec.samples) if s.get("finish_reason") not in FINISHED]
    problems = []
    if bad:
        i, s = bad[0]
        problems.append(
            f"{len(bad)} of {len(rec.samples)} sample(s) with a finish reason other than "
            f"{' or '.join(FINISHED)} ({', '.join(f'{k}: {n}' for k, n in counts.items())}); "
            f"first: sample {i} (problem {s.get('problem_id')!r}, index "
            f"{s.get('sample_index')}): {s.get('finish_reason')!r}")
    return Check.of("finish_reasons", problems,
                    ", ".join(f"{k}: {n}" for k, n in counts.items()) or "no samples")


def _check_finite(by_step: Mapping[int, Mapping[str, Any]]) -> Check:
    """The actor's loss, gradient norm and entropy (:data:`FINITE_KEYS`, and
    :data:`FINITE_OPTIONAL` where logged) are finite numbers at every logged training step."""
    problems, ranges = [], {}
    for s in sorted(by_step):
        data = by_step[s]
        for k in (*FINITE_KEYS, *(k for k in FINITE_OPTIONAL if k in data)):
            if k not in data:
                problems.append(f"step {s}: {k} missing")
                continue
            v = finite_number(data[k])
            if v is None:
                problems.append(f"step {s}: {k} = {data[k]!r}" if data[k] is not None
                                else f"step {s}: {k} = {_logged(data, k)}")
            else:
                lo, hi = ranges.get(k, (v, v))
                ranges[k] = (min(lo, v), max(hi, v))
    if not by_step:
        problems.append("no training step logged")
    return Check.of("finite", problems,
                    f"steps {', '.join(map(str, sorted(by_step)))}: " + ", ".join(
                        f"{k} {lo:g}..{hi:g}" for k, (lo, hi) in ranges.items()))


def failure_of(rec: Records) -> dict[str, Any] | None:
    """The phase and error line of the attempt that failed (not the planned kill)."""
    for a in rec.attempts:
        if a.get("outcome") in ("succeeded", "planned_kill"):
            continue
        phase = ((a.get("timing") or {}).get("phase") or "startup")
        if a.get("attempt") != (rec.attempts[0].get("attempt")) and phase == "startup":
            phase = "resume"
        return {"phase": phase, "attempt": a.get("attempt"),
                "error": a.get("error") or a.get("exit_reason"),
                "exit_reason": a.get("exit_reason")}
    return rec.failure


def _clear_previous(rl: Layout) -> list[str]:
    """A rehearsal starts from nothing: the previous one's records move to
    ``rehearsal/previous/`` (replacing the one before) and its checkpoint directory (a
    random model's, disposable) to ``<dir>.previous``."""
    done = []
    prev = Path(rl.results) / "previous"
    shutil.rmtree(prev, ignore_errors=True)
    for name in ("train", "eval"):
        src = Path(rl.results) / name
        if src.exists():
            prev.mkdir(parents=True, exist_ok=True)
            os.replace(src, prev / name)
            done.append(f"moved {src} to {prev / name}")
    ckpt = rl.checkpoint_dir
    if ckpt.exists():
        from hy3rl.ckptdir import check_lock_free

        check_lock_free(ckpt)
        old = ckpt.with_name(ckpt.name + ".previous")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(ckpt, old)
        done.append(f"moved {ckpt} to {old}")
    return done


def generate(cfg: Config, rl: Layout, *, model: Path, val: Path) -> None:
    """The generation on ``model`` with ``eval.backend`` in the training runtime (the
    runtime's python runs hy3rl.evaluate's entry point on a job file, as a Ray job of a
    multi-node evaluation does): vLLM has to start ``hy_v3`` inside the image."""
    from hy3rl.bridge import BridgeCheckFailed, runtime_command
    from hy3rl.evaluate import EvalError
    from hy3rl.launch import SCRIPTS_DIR

    samples, meta = Path(rl.eval_samples("final")), Path(rl.eval_samples_meta("final"))
    job = {"eval": asdict(cfg.eval), "tag": "final", "model": str(model), "val": str(val),
           "samples": str(samples.resolve()), "meta": str(meta.resolve())}
    job_file = Path(rl.eval_ray_dir("final")) / "job.json"
    write_json_atomic(job_file, job, indent=1)
    try:
        interpreter = runtime_command(cfg.train.runtime)
    except BridgeCheckFailed as exc:
        raise EvalError(str(exc)) from None
    cmd = [*interpreter, "-m", "hy3rl.evaluate", str(job_file.resolve())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SCRIPTS_DIR), os.environ.get("PYTHONPATH", "")) if p)}
    out_log = job_file.parent / "generate.log"
    print(f"rehearsal: {shlex.join(cmd)} (log {out_log})", flush=True)
    with open(out_log, "w") as fh:
        code = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = out_log.read_text(errors="replace").strip().splitlines()[-5:]
        raise EvalError(f"the generation exited {code} in the training runtime "
                        f"({shlex.join(interpreter)}): {' | '.join(tail)}")


def probe_reward(rcfg: Config, rl: Layout, *, train: Path) -> dict[str, Any]:
    """The check ``reward_path``'s result: hy3rl.reward_probe.probe in the training runtime
    on the rehearsal plan's composed config, its model's tokenizer and a training prompt."""
    from hy3rl.bridge import BridgeCheckFailed, runtime_command
    from hy3rl.reward_probe import probe

    plan_doc = read_record(rl.preflight_plan)
    if not plan_doc or "overrides" not in plan_doc or "verl" not in plan_doc:
        return {"status": FAIL, "detail": f"{rl.preflight_plan}: no rehearsal plan with its "
                "overrides to compose the reward from"}
    try:
        interpreter = runtime_command(rcfg.train.runtime)
    except BridgeCheckFailed as exc:
        return {"status": FAIL, "detail": str(exc)}
    return probe(plan_doc, model_dir=Path(rcfg.model.path), train_files=Path(train),
                 python=interpreter)


def run(cfg: Config, layout: Layout, *, runtime_env: Path, val: Path, out: Path,
        train: Path | None = None) -> None:
    """Rule rehearsal (one node; module doc, step 3). Writes ``rehearsal/checks.json``
    always and ``out`` (rehearsal/rehearsal.json) only when every check passed; raises
    :class:`RehearsalFailed` naming the failed checks otherwise. ``train``: the training
    parquet the reward probe takes its prompt from (default: the layout's)."""
    from hy3rl import train as training  # `train` is the parameter
    from hy3rl.evaluate import EvalError, final_step
    from hy3rl.launch import resolve_runtime
    from hy3rl.runtime_id import identify

    started, t0 = utc_now(), time.monotonic()
    if not cfg.cluster.gpu:  # `hy3rl rehearsal` by hand on a CPU config: nothing is a pass
        why = "not run: no GPU allocation (cluster.gpu is false)"
        write_json_atomic(Path(layout.rehearsal_checks), {
            "schema_version": 1, "run": cfg.run.name, "ok": False, "started": started,
            "finished": utc_now(), "failure": None,
            "checks": [asdict(Check(name, NOT_RUN, why)) for name in CHECKS]})
        raise RehearsalError(f"rehearsal {why}")
    rl = layout.rehearsal_layout()
    rl = dataclasses.replace(rl, results_root=os.path.abspath(rl.results_root))
    rcfg = derive(cfg, layout)
    Path(out).unlink(missing_ok=True)
    moved = _clear_previous(rl)
    for line in moved:
        log.info("rehearsal: %s", line)
    failure: dict[str, Any] | None = None
    # every GPU of the node, beside verl's one rank a data-parallel group (hy3rl.gpu_memory)
    sampler = Sampler(NODE_SAMPLE_S).start()
    try:
        training.run(rcfg.train, rcfg.cluster, rl, keep_steps=range(1, TOTAL + 1),
                  plan=Path(rl.preflight_plan), launch_script=Path(rl.preflight_launch),
                  runtime_env=Path(runtime_env), sentinel=Path(rl.train_done),
                  metrics=Path(rl.train_metrics), kill_after=KILL_AFTER)
    except StageError as exc:
        failure = {"phase": "train", "error": str(exc)}
        log.error("rehearsal: training failed: %s", exc)
    if failure is None:
        try:
            step = final_step(Path(rl.train_done))
            generate(rcfg, rl, model=rl.checkpoint_hf_model(step), val=Path(val))
        except EvalError as exc:
            failure = {"phase": "evaluation", "error": str(exc)}
            log.error("rehearsal: evaluation failed: %s", exc)
    node_gpus = sampler.stop()
    log.info("rehearsal: node GPUs: %d sample(s)%s", node_gpus["samples"],
             f" ({node_gpus['not_run']})" if node_gpus["not_run"] else "")
    reward_path = probe_reward(rcfg, rl, train=Path(train or layout.data_train))
    log.info("rehearsal: reward path %s: %s", reward_path["status"], reward_path["detail"])
    expected = rcfg.eval.num_problems * rcfg.eval.n_samples
    rec = Records.read(rl, expected, failure, model=Path(rcfg.model.path),
                       reward_path=reward_path, gpu_memory_gb=rcfg.cluster.gpu_memory_gb,
                       memory_headroom=cfg.rehearsal.memory_headroom, node_gpus=node_gpus)
    rec.extra["total_s"] = round(time.monotonic() - t0, 1)
    if rec.samples is not None:
        # the test set may hold fewer problems than asked for
        problems = {s.get("problem_id") for s in rec.samples}
        rec.expected_samples = min(expected, len(problems) * rcfg.eval.n_samples)
    checks = check_records(rec)
    runtime = (rec.attempts[0].get("runtime") or {}) if rec.attempts else {}
    identity = runtime.get("identity")
    if not identity:  # no attempt started: name the runtime here, as an attempt would
        rt = resolve_runtime(rcfg.train.runtime)
        identity = identify(rt["prefix"], rt["python"], cache=Path(layout.runtime_id_cache))
    failed = [c for c in checks if c.status != PASS]
    doc = {
        "schema_version": 1, "run": cfg.run.name, "ok": not failed,
        "started": started, "finished": utc_now(),
        "runtime": {"identity": {k: v for k, v in identity.items() if k != "freeze"},
                    "ray": runtime.get("ray"),
                    "prefix": runtime.get("prefix"), "python": runtime.get("python")},
        "fingerprint": runtime_fingerprint(cfg.train.runtime),
        "phases_s": phase_times(rec),
        "memory": {"gpu_memory_gb": rec.gpu_memory_gb, "headroom": rec.memory_headroom,
                   "phases": memory_peaks({ln["step"]: ln["data"]
                                           for ln in _train_lines(rec.merged)}),
                   "node_gpus": node_gpus},
        "failure": failure_of(rec),
        "checks": [asdict(c) for c in checks],
        "plan": rl.preflight_plan, "checkpoint_dir": str(rl.checkpoint_dir),
        "attempts": [{k: a.get(k) for k in ("attempt", "outcome", "start_step", "end_step",
                                           "exit_reason", "slurm_job_id", "nodes")}
                     for a in rec.attempts],
        "evaluation": {k: (rec.samples_meta or {}).get(k) for k in
                       ("backend", "status", "num_samples", "truncated", "seconds", "reason")},
        "previous": moved,
    }
    write_json_atomic(Path(layout.rehearsal_checks), doc)
    for c in checks:
        log.info("rehearsal check %-12s %-7s %s", c.name, c.status, c.detail)
    if failed:
        raise RehearsalFailed(failure_message(doc, Path(layout.rehearsal_checks)))
    write_json_atomic(Path(out), doc)


def failure_message(doc: Mapping[str, Any], path: Path) -> str:
    parts = [f"{c['name']}: {c['detail']}" for c in doc.get("checks") or []
             if c.get("status") != PASS]
    fail = doc.get("failure") or {}
    where = ""
    if fail:
        where = (f"; the rehearsal died in phase {fail.get('phase')}"
                 + (f" (attempt {fail['attempt']})" if fail.get("attempt") else "")
                 + f": {fail.get('error')}")
    return (f"rehearsal failed ({path}): {len(parts)} check(s) failed: " + " | ".join(parts)
            + where + "; the train job is not submitted (fix it and rerun, or set "
            "preflight.waive: [rehearsal])")


def enabled(cfg: Config) -> bool:
    """The rehearsal runs, and gates training, in GPU runs unless preflight.waive names it
    (rules/common.smk's rehearsal_enabled, :func:`gate`, the report's row)."""
    return cfg.cluster.gpu and "rehearsal" not in cfg.preflight.waive


def gate(cfg: Config, layout: Layout) -> Path | None:
    """``hy3rl train`` by hand: the rehearsal record the train rule would take as its input
    (None when the rehearsal is off: no GPU, or waived)."""
    if not enabled(cfg):
        return None
    path = Path(layout.rehearsal_record)
    if not path.is_file():
        raise RehearsalError(f"{path}: no passed rehearsal; run `hy3rl rehearsal` (or the "
                             "workflow) first, or set preflight.waive: [rehearsal]")
    return path


def passed_identity(path: str | Path | None) -> dict[str, Any] | None:
    """The runtime identity a passed rehearsal ran in (``rehearsal.json``), for the train
    job's check; None without a rehearsal (waived). A record that is not a pass raises."""
    if not path:
        return None
    doc = read_record(path)
    if doc is None or not doc.get("ok"):
        raise RehearsalError(f"{path}: not a passed rehearsal's record")
    return ((doc.get("runtime") or {}).get("identity")) or {}


def read_record(path: str | Path) -> dict[str, Any] | None:
    """A rehearsal record (rehearsal.json or checks.json), or None when absent/unreadable."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None

