# Input functions, paths, rerun triggers and wildcard constraints shared by every stage
# (style: stage files hold rules only). Every path comes from hy3rl.layout (LAYOUT); every
# value from the typed config (CFG, built in the Snakefile). Rules run their stage through
# a `script:` adapter under scripts/adapters/ (hy3rl.smk.rule_job). Nothing here has a side
# effect while the DAG is built: no environment edits, no cluster queries (onstart below).
from hy3rl.layout import TAG_PATTERN, TINY_MODEL_DIR, Layout
from hy3rl.smk import triggers as _triggers

LAYOUT = Layout.from_config(CFG)
LOGS = f"{LAYOUT.results}/logs"


wildcard_constraints:
    tag=TAG_PATTERN,


def triggers(*keys):
    """The rule's params: one `key=value` string per config leaf under `keys`, so that
    changing one of them (and nothing else) re-runs the rule, and Snakemake's reason names
    it. Usage: `params: **triggers("deps")`."""
    return _triggers(config, *keys)


def gpu_enabled():
    return CFG.cluster.gpu


def all_inputs():
    """Targets of `rule all`, by stage; the GPU stages only when cluster.gpu is true."""
    targets = [LAYOUT.deps_lock, LAYOUT.deps_runtime_env, LAYOUT.data_summary]
    for extra in STAGE_TARGETS:
        targets.extend(extra())
    return targets


# Stage files register a function returning their `all` targets here.
STAGE_TARGETS = []


# ---- model ----
def model_dir():
    """The model directory: rule tiny_model's output for the embedded default; any other
    model.path is an existing checkpoint, never re-checked because its mtime changed."""
    path = CFG.model.path
    return path if path == TINY_MODEL_DIR else ancient(path)


# ---- data ----
def data_inputs(wildcards):
    """The model directory (tokenizer + chat template) and the local source files; hub
    sources are fetched by the job itself."""
    from hy3rl.data import local_source_path

    inputs = {"model": CFG.model.path}
    for split in ("train", "val"):
        local = local_source_path(getattr(CFG.data, split).source)
        if local is not None:
            inputs[split] = local
    return inputs


# ---- checks ----
def checks_targets():
    targets = [LAYOUT.checks_checkpoint]
    if gpu_enabled():
        targets.append(LAYOUT.checks_bridge)
    return targets


def bridge_check_input():
    """check_bridge's report when cluster.gpu is true (preflight waits for it), else none."""
    return [LAYOUT.checks_bridge] if gpu_enabled() else []


def bridge_job_resources():
    """One node, one GPU (gres per node), as a SLURM job of the executor plugin."""
    c, b = CFG.cluster, CFG.checks.bridge
    res = {
        "nodes": 1,
        "gres": f"gpu:{c.gpu_type}:1" if c.gpu_type else "gpu:1",
        "cpus_per_task": b.cpus,
        "mem_mb": b.mem_mb,
        "runtime": b.runtime_min,
    }
    if c.constraint:
        res["constraint"] = c.constraint
    return res


# ---- cluster ----
def gpu_job_resources(nodes, gpus_per_node, runtime_min):
    """Resources of a multi-node GPU job for snakemake-executor-plugin-slurm 2.8:
    `--nodes=<nodes>`, `--gres=gpu[:<cluster.gpu_type>]:<gpus_per_node>` (per node; the
    plugin's `gpu` resource is a per-job total and breaks multi-node jobs), one task per
    node and the nodes exclusive (`slurm_extra`), `--cpus-per-task=<cluster.cpus_per_node>`,
    `--mem=<cluster.mem_mb_per_node>` (per node), `-t <runtime_min>`, `-C <constraint>` if
    set. Training, the cluster probe and vLLM evaluation use this shape."""
    c = CFG.cluster
    res = {
        "nodes": int(nodes),
        "gres": (
            f"gpu:{c.gpu_type}:{gpus_per_node}" if c.gpu_type else f"gpu:{gpus_per_node}"
        ),
        "cpus_per_task": c.cpus_per_node,
        "mem_mb": c.mem_mb_per_node,
        "runtime": int(runtime_min),
        "slurm_extra": "--ntasks-per-node=1 --exclusive",
    }
    if c.constraint:
        res["constraint"] = c.constraint
    return res


def cluster_probe_targets():
    """rule cluster_probe's `all` target when cluster.gpu is true."""
    return [LAYOUT.cluster_probe] if gpu_enabled() else []


# ---- train ----
def train_base_inputs():
    """Inputs of every training job (ancient: a re-rendered but unchanged plan never
    retrains; what should retrain is in the rule's params)."""
    return {
        "plan": ancient(LAYOUT.preflight_plan),
        "launch": ancient(LAYOUT.preflight_launch),
        "runtime_env": ancient(LAYOUT.deps_runtime_env),
    }


def train_segment_ends():
    """train.segment_steps > 0: the last steps of the chained jobs before the final one."""
    seg, total = CFG.train.segment_steps, CFG.train.total_training_steps
    return list(range(seg, total, seg)) if seg > 0 else []


def train_inputs(wildcards):
    """Inputs of the train rule: the base ones, plus the last segment's sentinel."""
    inputs = train_base_inputs()
    ends = train_segment_ends()
    if ends:
        inputs["previous"] = LAYOUT.segment_sentinel(ends[-1])
    return inputs


def train_segment_inputs(wildcards):
    """Inputs of the train_segment rule: the base ones, plus the previous segment's."""
    inputs = train_base_inputs()
    previous = int(wildcards.end) - CFG.train.segment_steps
    if previous > 0:
        inputs["previous"] = LAYOUT.segment_sentinel(previous)
    return inputs


# ---- eval ----


# ---- report ----


onstart:
    # Before anything is submitted (never during a dry run): refuse when a live trainer
    # holds the checkpoint directory's lock (a relaunch after the controller was killed).
    if gpu_enabled():
        from hy3rl.train import LockHeld, check_lock_free

        try:
            check_lock_free(LAYOUT.checkpoint_dir)
        except LockHeld as exc:
            raise WorkflowError(str(exc))
