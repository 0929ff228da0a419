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
