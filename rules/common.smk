# Input functions, paths and wildcard constraints shared by every stage (style: stage
# files hold rules only).
import json
import os
import sys

from hy3rl.data import local_source_path

# Jobs (local or SLURM) find this interpreter (the workflow's venv) first on PATH.
_BIN = os.path.dirname(sys.executable)
os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

RUN = config["run"]["name"]
RESULTS = f"{config['run']['results_root']}/{RUN}"
LOGS = f"{RESULTS}/logs"
# Each stage is one module of scripts/hy3rl with a CLI: python -m hy3rl.<stage> ...


wildcard_constraints:
    tag=r"base|final|step\d+",


def section_json(*sections):
    """The config sections a rule depends on, as canonical JSON (a rule param, so that
    changing one of them, and nothing else, re-runs the rule)."""
    return json.dumps({s: config[s] for s in sections}, sort_keys=True)


def gpu_enabled():
    return bool(config["cluster"]["gpu"])


def all_inputs():
    """Targets of `rule all`, by stage; the GPU stages only when cluster.gpu is true."""
    targets = [
        f"{RESULTS}/deps/lock.json",
        f"{RESULTS}/deps/runtime_env.yaml",
        f"{RESULTS}/data/summary.json",
    ]
    for extra in STAGE_TARGETS:
        targets.extend(extra())
    return targets


# Stage files register a function returning their `all` targets here.
STAGE_TARGETS = []


# ---- data ----
def data_inputs(wildcards):
    """The model directory (tokenizer + chat template) and the local source files; hub
    sources are fetched by the job itself."""
    inputs = {"model": config["model"]["path"]}
    for split in ("train", "val"):
        local = local_source_path(config["data"][split]["source"])
        if local is not None:
            inputs[split] = local
    return inputs


# ---- checks ----
def checks_targets():
    targets = [f"{RESULTS}/checks/checkpoint.json"]
    if gpu_enabled():
        targets.append(f"{RESULTS}/checks/bridge.json")
    return targets


def bridge_check_input():
    """check_bridge's report when cluster.gpu is true (preflight waits for it), else none."""
    return [f"{RESULTS}/checks/bridge.json"] if gpu_enabled() else []


def checkpoint_dir():
    """The model directory: rule tiny_model's output for the default path; any other
    model.path is an existing checkpoint, never re-checked because its mtime changed."""
    path = config["model"]["path"]
    return path if path == TINY_MODEL_PATH else ancient(path)


def bridge_job_resources():
    """One node, one GPU (gres per node), as a SLURM job of the executor plugin."""
    c, b = config["cluster"], config["checks"]["bridge"]
    gres = f"gpu:{c['gpu_type']}:1" if c["gpu_type"] else "gpu:1"
    res = {
        "nodes": 1,
        "gres": gres,
        "cpus_per_task": b["cpus"],
        "mem_mb": b["mem_mb"],
        "runtime": b["runtime_min"],
    }
    if c["constraint"]:
        res["constraint"] = c["constraint"]
    return res


# ---- cluster ----
def gpu_job_resources(
    nodes,
    gpus_per_node,
    runtime_min,
    gpu_type=None,
    constraint=None,
    cpus_per_node=None,
    mem_mb_per_node=None,
):
    """Resources of a multi-node GPU job for snakemake-executor-plugin-slurm 2.8:
    `--nodes=<nodes>`, `--gres=gpu[:<gpu_type>]:<gpus_per_node>` (per node; the plugin's
    `gpu` resource is a per-job total and breaks multi-node jobs), one task per node and
    the nodes exclusive (`slurm_extra`), `--cpus-per-task=<cpus_per_node>`,
    `--mem=<mem_mb_per_node>` (per node), `-t <runtime_min>`, `-C <constraint>` if set.
    Unset keyword arguments come from config["cluster"]. Use as
    `resources: **gpu_job_resources(config["cluster"]["nodes"], ..., 60)`; training uses
    the same shape."""
    c = config["cluster"]
    gpu_type = c["gpu_type"] if gpu_type is None else gpu_type
    constraint = c["constraint"] if constraint is None else constraint
    gres = f"gpu:{gpu_type}:{gpus_per_node}" if gpu_type else f"gpu:{gpus_per_node}"
    res = {
        "nodes": int(nodes),
        "gres": gres,
        "cpus_per_task": int(
            c["cpus_per_node"] if cpus_per_node is None else cpus_per_node
        ),
        "mem_mb": int(
            c["mem_mb_per_node"] if mem_mb_per_node is None else mem_mb_per_node
        ),
        "runtime": int(runtime_min),
        "slurm_extra": "--ntasks-per-node=1 --exclusive",
    }
    if constraint:
        res["constraint"] = constraint
    return res


def cluster_probe_targets():
    """rule cluster_probe's `all` target when cluster.gpu is true."""
    return [f"{RESULTS}/cluster/probe.json"] if gpu_enabled() else []


# ---- train ----
def train_checkpoint_dir():
    """<train.checkpoint_root>/<run.name>, absolute (hy3rl.train.checkpoint_dir): the
    checkpoint directory, never an output; it reaches the train job through params."""
    from hy3rl.train import checkpoint_dir as train_ckpt_dir

    return str(train_ckpt_dir(config))


def train_base_inputs():
    """Inputs of every training job (ancient: a re-rendered but unchanged plan never
    retrains); first refuses, before anything is submitted, when a live trainer holds the
    checkpoint directory's lock (e.g. a relaunch after the controller was killed)."""
    from pathlib import Path

    from hy3rl.train import LockHeld, check_lock_free

    try:
        check_lock_free(Path(train_checkpoint_dir()))
    except LockHeld as exc:
        raise WorkflowError(str(exc))
    return {
        "plan": ancient(f"{RESULTS}/preflight/plan.json"),
        "launch": ancient(f"{RESULTS}/preflight/launch.sh"),
        "runtime_env": ancient(f"{RESULTS}/deps/runtime_env.yaml"),
    }


def train_segment_ends():
    """train.segment_steps > 0: the last steps of the chained jobs before the final one."""
    seg = int(config["train"].get("segment_steps", 0) or 0)
    total = int(config["train"].get("total_training_steps", 0) or 0)
    return list(range(seg, total, seg)) if seg > 0 else []


def train_segment_sentinel(end):
    return f"{RESULTS}/train/segments/step{end}.json"


def train_inputs(wildcards):
    """Inputs of the train rule: the base ones, plus the last segment's sentinel."""
    inputs = train_base_inputs()
    ends = train_segment_ends()
    if ends:
        inputs["previous"] = train_segment_sentinel(ends[-1])
    return inputs


def train_segment_inputs(wildcards):
    """Inputs of the train_segment rule: the base ones, plus the previous segment's."""
    inputs = train_base_inputs()
    previous = int(wildcards.end) - int(config["train"]["segment_steps"])
    if previous > 0:
        inputs["previous"] = train_segment_sentinel(previous)
    return inputs
