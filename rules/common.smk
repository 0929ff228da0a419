# Input functions, paths, rerun triggers and wildcard constraints shared by every stage
# (style: stage files hold rules only). Every path comes from hy3rl.layout (LAYOUT); every
# value from the typed config (CFG, built in the Snakefile). Rules run their stage through
# a `script:` adapter under scripts/adapters/ (hy3rl.smk.rule_job). Nothing here has a side
# effect while the DAG is built (no environment edits, no cluster queries: onstart below)
# but one: the run's content cache of local files' sha256 (Layout.content_sha_cache).
import functools

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


def training_enabled():
    """Whether the run trains: on GPUs, or on the CPU path (train.cpu, hy3rl.verl_cpu)."""
    return CFG.trains


def all_inputs():
    """Targets of `rule all`, by stage; the GPU stages only when cluster.gpu is true."""
    targets = [LAYOUT.deps_lock, LAYOUT.deps_runtime_env, LAYOUT.data_summary]
    for extra in STAGE_TARGETS:
        targets.extend(extra())
    return targets


# Stage files register a function returning their `all` targets here.
STAGE_TARGETS = []


# ---- model ----
def builds_tiny_model():
    """Whether tiny_model is in the DAG: model.source is the embedded default's
    TINY_MODEL_DIR (another local directory is an existing checkpoint, used as is)."""
    return CFG.model.is_local and CFG.model.path == TINY_MODEL_DIR


def model_targets():
    """The manifest of rule model, the stage's `all` target."""
    return [LAYOUT.model_manifest]


def model_rule_inputs(wildcards):
    """Rule model's input: tiny_model's output for the embedded default; another local
    directory as it is (ancient: its mtime changing re-runs nothing; check_checkpoint
    compares the files with the manifest); none for a hub source (it downloads)."""
    if not CFG.model.is_local:
        return {}
    if builds_tiny_model():
        return {"model": TINY_MODEL_DIR}
    return {"model": ancient(CFG.model.path)}


def model_local_files():
    """Params of the model rule for a local model.source other than the embedded default's
    tiny model (built by the tiny_model rule), each file's size and mtime
    (hy3rl.hub.local_file_stats, a stat per file while the DAG is built), so that a
    directory changed in place re-runs the model rule and the run identity follows; none
    for a hub source."""
    from hy3rl.hub import local_file_stats

    if not CFG.model.is_local or builds_tiny_model():
        return {}
    return local_file_stats(CFG.model.path)


def hub_model_in_place():
    """A hub model.dir against its manifest while the DAG is built (hy3rl.hub.
    in_place_problems: every file's size, the small files by the hub's hash): a file
    edited in place under an unchanged repo@commit is refused before any job, naming it.
    Nothing is read for a local source (model_local_files re-runs rule model instead).
    """
    from hy3rl.hub import in_place_problems

    if CFG.model.is_local:
        return
    problems = in_place_problems(
        LAYOUT.model_manifest, CFG.model.path, CFG.model.source, CFG.model.revision
    )
    if problems:
        raise WorkflowError(
            f"model.dir {CFG.model.path} no longer holds {CFG.model.source}@"
            f"{CFG.model.revision} as its manifest {LAYOUT.model_manifest} records it (a file "
            "edited in place would change what every start reads under the same identity):\n  "
            + "\n  ".join(problems[:20])
            + "\nRestore the files (delete each one named and "
            "run `snakemake -R model`: it fetches them again, checked against the hub's "
            "hashes), or use a local directory as model.source for an edited model"
        )


def model_manifest():
    """Rule model's manifest, the input of every job reading the model directory
    (CFG.model.path), so the model is there, complete, before any of them runs."""
    return LAYOUT.model_manifest


def rehearsal_model_inputs():
    """Rule rehearsal_model's inputs: none for the small model; for ``rehearsal.shape:
    stage`` the real model (its manifest) and the run's plan (its pipeline size), ancient:
    preflight re-plans on many changes that leave the stage as it is (the rule's params
    name the pipeline size: hy3rl.smk.stage_triggers); a stage that no longer matches the
    run's plan is refused by rule rehearsal_plan, naming the figure."""
    if CFG.rehearsal.shape != "stage":
        return {}
    return {"manifest": model_manifest(), "plan": ancient(LAYOUT.preflight_plan)}


def rehearsal_model_triggers():
    """What rebuilds the rehearsal's model: its sizes and shape; for a stage also the run's
    pipeline size, which decides its layers (hy3rl.smk.stage_triggers), and no other knob.
    """
    from hy3rl.smk import stage_triggers

    out = triggers("rehearsal.model", "rehearsal.shape")
    if CFG.rehearsal.shape == "stage":
        out.update(stage_triggers(config))
    return out


# ---- data ----
def data_local_sources():
    """Split -> the local source file of data.<split> (hub sources: none)."""
    from hy3rl.data import local_source_path

    out = {}
    for split in ("train", "val", "heldout"):
        src = getattr(CFG.data, split)
        local = local_source_path(src.source) if src and src.source else None
        if local is not None:
            out[split] = local
    return out


def data_inputs(wildcards):
    """The model's manifest (the tokenizer + chat template are read from CFG.model.path)
    and the local source files, ancient: a source re-runs rule data by its content
    (data_source_params), not by its mtime, so a file only touched or copied back with the
    same bytes rewrites nothing downstream. Hub sources are fetched by the job itself.
    """
    inputs = {"model_manifest": model_manifest()}
    inputs.update({k: ancient(v) for k, v in data_local_sources().items()})
    return inputs


def data_source_params():
    """Rule data's params: the sha256 of each local source file's content, from the run's
    content cache (hy3rl.runtime_id.cached_sha256: read again only when the file's size,
    mtime or inode changed), so new bytes under the same path re-run rule data."""
    import os
    from pathlib import Path
    from hy3rl.runtime_id import cached_sha256

    out = {}
    for split, path in data_local_sources().items():
        if Path(path).is_file():
            out[f"source_{split}_sha256"] = cached_sha256(
                Path(os.path.realpath(path)), Path(LAYOUT.content_sha_cache)
            )[0]
    return out


def data_outputs():
    """Rule data's outputs: train, val and the summary, plus the held-out set when
    data.heldout is set (output lists are fixed when the Snakefile is parsed)."""
    outputs = {"train": LAYOUT.data_train, "val": LAYOUT.data_val}
    if CFG.data.heldout is not None:
        outputs["heldout"] = LAYOUT.data_heldout
    outputs["summary"] = LAYOUT.data_summary
    return outputs


def heldout_input():
    """{"heldout": data/heldout.parquet} when data.heldout is set (preflight checks it
    against the test and training sets), else nothing."""
    return {"heldout": LAYOUT.data_heldout} if CFG.data.heldout else {}


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
            f"gpu:{c.gpu_type}:{gpus_per_node}"
            if c.gpu_type
            else f"gpu:{gpus_per_node}"
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


# ---- preflight ----
def preflight_targets():
    """The plan of rule preflight, the stage's `all` target (also in the CPU-only DAG)."""
    return [LAYOUT.preflight_plan]


def override_path_inputs():
    """The files that train.verl_overrides and train.env name for trajectory keys
    (hy3rl.identity.override_paths): the identity counts them by content, so an edited one
    re-runs preflight."""
    from hy3rl.identity import override_paths

    return {f"override_path_{i}": path for i, path in enumerate(override_paths(config))}


def reward_function_input():
    """{"reward_function": train.reward_function.path} when it is set: preflight copies it
    (content addressed) and hashes it into the run identity, so an edited reward re-runs
    preflight; else nothing."""
    path = CFG.train.reward_function.path
    return {"reward_function": path} if path else {}


# ---- train ----
# The config values that re-run a training job (trajectory, extent and location keys,
# hy3rl.identity) and what it reads from files under an unchanged path (the reward's
# sha256, the stats of a local data source, model directory or override file) name its keys
# record (Layout.train_keys), an output of the job and a target of `all`: new values re-run
# it in the same invocation (a missing target is found even behind a preflight that must
# run, snakemake#4166), restored ones re-run nothing, and an operational change (loggers,
# watchdog, retention, resources, train.on_config_change...) changes no name.
from hy3rl.identity import content_triggers, eval_request_digest, eval_request_params

# The file contents' part of the training keys, stat'ed (and the reward hashed) once per
# DAG build: every digest below uses it.
TRAIN_CONTENT = content_triggers(config)


def train_keys_digest(final):
    """The digest in the name of the keys record of the final training job, or of every
    segment, a pure function of the config and the files' stats (hy3rl.train.keys_digest).
    """
    from hy3rl.train import keys_digest

    return keys_digest(config, final, TRAIN_CONTENT)


@functools.cache
def train_adopted():
    """Stretch -> hy3rl.train.Adoption for each training job whose sentinel was written under
    the current training keys before their record existed (records of older code): rule
    train_adopt writes its record instead of submitting a job that would train nothing.
    The final job on its own; the segments all or none (one rule makes every segment's
    outputs). Files read, nothing written."""
    from hy3rl.train import adoption, launch_of

    if not training_enabled():
        return {}
    launch = launch_of(LAYOUT, config)  # composed once, when a stretch's adoption asks
    out = {}
    final = adoption(LAYOUT, "final", config, TRAIN_CONTENT, launch)
    if final:
        out["final"] = final
    segments = {
        f"step{end}": adoption(LAYOUT, f"step{end}", config, TRAIN_CONTENT, launch)
        for end in train_segment_ends()
    }
    if segments and all(segments.values()):
        out.update(segments)
    return out


def train_outputs():
    """Rule train's outputs: done.json, metrics.jsonl and, unless rule train_adopt writes it
    (train_adopted), the final job's keys record."""
    out = {"done": LAYOUT.train_done, "metrics": LAYOUT.train_metrics}
    if "final" not in train_adopted():
        out["train_keys"] = LAYOUT.train_keys("final", train_keys_digest(final=True))
    return out


def train_segment_outputs():
    """Rule train_segment's outputs: the sentinel and, unless rule train_adopt writes them
    (train_adopted), the keys record."""
    out = {"sentinel": LAYOUT.segment_sentinel("{end}")}
    if not any(s != "final" for s in train_adopted()):
        out["train_keys"] = LAYOUT.train_keys(
            "step{end}", train_keys_digest(final=False)
        )
    return out


def train_adopt_constraints():
    """Rule train_adopt's wildcards: the adopted stretches and their records' digests."""
    stretches = sorted(train_adopted())
    digests = {train_keys_digest(final=s == "final") for s in stretches}
    return {"stretch": "|".join(stretches), "digest": "|".join(sorted(digests))}


def train_adopt_inputs(wildcards):
    """The inputs of the job rule train_adopt stands in for (train_inputs,
    train_segment_inputs): Snakemake records them with the keys record, and the job that
    makes it later must find the same set (its `input` rerun trigger)."""
    if wildcards.stretch == "final":
        return train_inputs(wildcards)
    return _segment_inputs(int(wildcards.stretch.removeprefix("step")))


def train_targets():
    """The `all` targets of the train stage when cluster.gpu is true: done.json and the
    keys records of the final job and of every segment (missing after a keys change)."""
    if not training_enabled():
        return []
    segments = train_keys_digest(final=False)
    return [
        LAYOUT.train_done,
        LAYOUT.train_keys("final", train_keys_digest(final=True)),
        *(LAYOUT.train_keys(f"step{end}", segments) for end in train_segment_ends()),
    ]


def train_job_resources():
    """The training job: cluster.nodes x cluster.gpus_per_node, cluster.train_time_min;
    its slurm_extra is train_slurm_extra, evaluated before each submission. On the CPU
    path (train.cpu): one node, no GPU."""
    c = CFG.cluster
    if c.gpu:
        res = gpu_job_resources(c.nodes, c.gpus_per_node, c.train_time_min)
    else:
        res = {
            "nodes": 1,
            "cpus_per_task": c.cpus_per_node,
            "mem_mb": c.mem_mb_per_node,
            "runtime": int(c.train_time_min),
        }
    res["slurm_extra"] = train_slurm_extra
    return res


# ---- train: resubmission (hy3rl.resubmit) ----
from hy3rl.timefmt import utc_now

# When this controller started: attempt records and job-exit.json files older than this
# belong to earlier invocations, and never refuse or restrict this one's submissions.
CONTROLLER_STARTED = utc_now()


def train_retries():
    """`retries` of rules train and train_segment: train.max_submissions - 1 failed
    submissions of a job per invocation, plus planned ones (a time limit or a preemption
    that added a checkpoint), which hy3rl.resubmit.decide counts apart; the global
    `retries: 0` stays. Only the
    controller retries: the job's own Snakemake (exec mode remote, inside the allocation)
    gets 0, or it would rerun the rule in the same allocation, bypassing
    train.restarts_per_job, the guard and the time limit."""
    from hy3rl.resubmit import PLANNED_CAP, Retries

    if not workflow.is_main_process:
        return 0
    return Retries(CFG.train.max_submissions - 1 + PLANNED_CAP, train_resubmit)


# Decisions made when Snakemake asked whether to resubmit (train_resubmit), by submission
# number; train_slurm_extra applies the newest one's node exclusions.
RESUBMIT_DECISIONS = {}


def train_resubmit(attempt):
    """Whether the failed training job is resubmitted as submission `attempt`
    (hy3rl.resubmit.Retries asks it when the job fails): hy3rl.resubmit.decide on the
    failed job's records. A stop (a crash loop, a refused job, the budget spent) is written
    to train/state.json (the evaluation waits read it) and logged with its reason; the job
    then fails as any job does, before sbatch, so no GPU node is allocated."""
    from snakemake.logging import logger
    from hy3rl.evalckpt import write_train_state
    from hy3rl.resubmit import ResubmitError, decide

    try:
        decision = decide(
            LAYOUT, attempt, CONTROLLER_STARTED, max_failed=CFG.train.max_submissions
        )
    except ResubmitError as exc:
        stop = str(exc)
    else:
        RESUBMIT_DECISIONS[attempt] = decision
        stop = f"{decision.stop}; not resubmitted" if decision.stop else None
    if stop:
        write_train_state(LAYOUT, "stopped", stop)
        logger.error(f"Training job not resubmitted: {stop}")
        return False
    return True


def train_slurm_extra(wildcards, attempt):
    """slurm_extra of submission `attempt` of a training job. Snakemake evaluates it when it
    selects the job (never while building the DAG nor in a dry run, where attempt is 1),
    again before each resubmission. Attempt 1: gpu_job_resources' flags. Later: the same
    plus `--exclude=<nodes>` when the decision train_resubmit made names nodes. (Should
    Snakemake not have asked train_resubmit, the decision is made here, and a stop is a
    WorkflowError: the workflow stops before sbatch, so no GPU node is allocated.) The job's own Snakemake (exec mode
    remote, on the compute node) decides nothing and gets the flags."""
    c = CFG.cluster
    base = gpu_job_resources(c.nodes, c.gpus_per_node, c.train_time_min)["slurm_extra"]
    if not workflow.is_main_process:
        return base
    from hy3rl.evalckpt import write_train_state
    from hy3rl.resubmit import ResubmitError, decide, with_exclude

    decision = RESUBMIT_DECISIONS.get(attempt) if attempt >= 2 else None
    if decision is not None and not decision.stop:
        return with_exclude(base, decision.exclude)
    try:
        decision = decide(
            LAYOUT, attempt, CONTROLLER_STARTED, max_failed=CFG.train.max_submissions
        )
    except ResubmitError as exc:
        write_train_state(LAYOUT, "stopped", str(exc))
        raise WorkflowError(str(exc))
    if decision.stop:
        # The evaluation steps' waits of this controller read it and fail, naming it.
        write_train_state(LAYOUT, "stopped", f"{decision.stop}; not resubmitted")
        raise WorkflowError(f"{decision.stop}; not resubmitted")
    return with_exclude(base, decision.exclude)


def recorded_inputs(path):
    """The inputs Snakemake recorded for the job that made `path` (its metadata; None when
    it has none, or when no persistence is set up, as in a lint)."""
    from snakemake.io import IOFile

    persistence = getattr(workflow, "persistence", None)
    return persistence.input(IOFile(path)) if persistence is not None else None


def train_base_inputs(stretch):
    """Inputs of every training job, all ancient (a re-rendered but unchanged plan never
    retrains; what should retrain is the job's missing keys record, an output). With the
    rehearsal on, its record (ancient: a rehearsal re-run for a new runtime retrains
    nothing, but a training job to run waits for it). The older rule train_keys' file of
    job `stretch` while Snakemake's record of the job's sentinel lists it as an input
    (hy3rl.train.legacy_keys_input): the input set stays the one recorded, so the `input`
    rerun trigger does not re-run a finished job.
    """
    inputs = {
        "plan": ancient(LAYOUT.train_plan),
        "launch": ancient(LAYOUT.train_launch),
        "runtime_env": ancient(LAYOUT.deps_runtime_env),
    }
    if rehearsal_enabled():
        inputs["rehearsal"] = ancient(LAYOUT.rehearsal_record)
    from hy3rl.train import legacy_keys_input

    legacy = legacy_keys_input(
        LAYOUT, stretch, recorded_inputs(LAYOUT.stretch_sentinel(stretch))
    )
    inputs.update({k: ancient(v) for k, v in legacy.items()})
    return inputs


def train_segment_ends():
    """train.segment_steps > 0: the last steps of the chained jobs before the final one."""
    seg, total = CFG.train.segment_steps, CFG.train.total_training_steps
    return list(range(seg, total, seg)) if seg > 0 else []


def train_inputs(wildcards):
    """Inputs of the train rule: the base ones, plus the last segment's sentinel."""
    inputs = train_base_inputs("final")
    ends = train_segment_ends()
    if ends:
        inputs["previous"] = LAYOUT.segment_sentinel(ends[-1])
    return inputs


def train_segment_inputs(wildcards):
    """Inputs of the train_segment rule: the base ones, plus the previous segment's."""
    return _segment_inputs(int(wildcards.end))


def _segment_inputs(end):
    """The inputs of the segment job ending at step `end`."""
    inputs = train_base_inputs(f"step{end}")
    previous = end - CFG.train.segment_steps
    if previous > 0:
        inputs["previous"] = LAYOUT.segment_sentinel(previous)
    return inputs


# ---- rehearsal ----
REHEARSAL_LAYOUT = LAYOUT.rehearsal_layout()


def rehearsal_enabled():
    """The one-node rehearsal runs in GPU runs unless preflight.waive names it."""
    from hy3rl.rehearsal import enabled

    return enabled(CFG)


def rehearsal_targets():
    """The rehearsal's record when it is enabled."""
    return [LAYOUT.rehearsal_record] if rehearsal_enabled() else []


def rehearsal_fingerprint(wildcards):
    """The training runtime as seen without running it (hy3rl.rehearsal)."""
    from hy3rl.rehearsal import runtime_fingerprint

    return runtime_fingerprint(CFG.train.runtime)


def rehearsal_job_resources():
    """One node of the training partition, its GPUs, rehearsal.runtime_min."""
    c = CFG.cluster
    return gpu_job_resources(1, c.gpus_per_node, CFG.rehearsal.runtime_min)


# ---- eval ----
def eval_targets():
    """The summary of rule evaluate over the tags, and each tag's request, the stage's
    `all` targets. A request is a direct input of `all` so that a new tag's missing request
    is found from `all` even when everything behind preflight is masked (snakemake#4166:
    a masked job's missing output is found only from a job that runs), and its generation
    follows in the same invocation."""
    from hy3rl.evaluate import eval_tags

    return [LAYOUT.eval_summary, *(eval_request(tag) for tag in eval_tags(CFG))]


def eval_wait_resources():
    """A waiting local job: it holds no core a generation could use (threads 0 would be
    refused by Snakemake; 1 is the least), little memory."""
    return {"mem_mb": 300, "runtime": CFG.cluster.train_time_min}


def eval_val(tag):
    """The problems of a tag: the held-out set for ``heldout/<tag>``, else data.val."""
    return LAYOUT.eval_problems(tag)


def eval_generate_inputs(wildcards):
    """The tag's problems (eval_val) and request; the tag's model: the model's manifest for
    base (the weights are CFG.model.path); for step<N> the step's wait (the output of
    eval_checkpoint, once the checkpoint is complete, so the generation runs while training
    goes on); for final train/done.json (ancient: the checkpoints are not outputs, and a
    finished training that is rerun re-evaluates nothing; hy3rl.evaluate.model_for_tag
    finds the weights) and the final training job's keys record (new keys: a new record,
    so the new final checkpoint is evaluated); for vLLM, the Ray runtime env written by deps (a multi-node engine
    starts Ray with it; ancient, as for training: a rewritten deps output re-evaluates
    nothing)."""
    from hy3rl.layout import split_tag

    tag = wildcards.tag
    model, _ = split_tag(tag)
    inputs = {"val": eval_val(tag), "request": eval_request(tag)}
    if model == "base":
        inputs["model_manifest"] = model_manifest()
    elif model == "final":
        inputs["train_done"] = ancient(LAYOUT.train_done)
        # not ancient: training keys that changed name a new record, written by the training
        # job that ran for them, so the final checkpoint it made is evaluated again
        inputs["train_keys"] = LAYOUT.train_keys("final", train_keys_digest(final=True))
    else:
        inputs["ready"] = LAYOUT.eval_ready(model)
    if CFG.eval.backend == "vllm":
        inputs["runtime_env"] = ancient(LAYOUT.deps_runtime_env)
    return inputs


def eval_checkpoint_inputs(wildcards):
    """The wait of step<N>: both its requests (not ancient: a request that changes, e.g.
    after a config change that retrains, waits again for the new run's checkpoint) and the
    plan the training job runs (ancient: a plan re-rendered unchanged waits for nothing;
    its presence means preflight passed, so a failed preflight never starts a wait). With
    the rehearsal on, its record too (ancient): a failed rehearsal starts no wait for a
    training job that will not be submitted."""
    from hy3rl.layout import heldout_tag

    tag = f"step{wildcards.step}"
    inputs = {"request": eval_request(tag), "plan": ancient(LAYOUT.train_plan)}
    if rehearsal_enabled():
        inputs["rehearsal"] = ancient(LAYOUT.rehearsal_record)
    if CFG.data.heldout:
        inputs["heldout_request"] = eval_request(heldout_tag(tag))
    return inputs


# The settings of a generation (params of eval_generate; with a checkpoint tag's training
# keys, what names the tag's request: hy3rl.identity.eval_request_digest).
from hy3rl.identity import EVAL_GENERATION_KEYS


def eval_request(tag):
    """The tag's request, named by the digest of what it asks (Layout.eval_request): values
    never seen name a missing request, restored ones the request still in place."""
    return LAYOUT.eval_request(tag, eval_request_digest(config, tag, TRAIN_CONTENT))


def eval_request_inputs(wildcards):
    """A checkpoint tag's request waits for the plan preflight passed (ancient: an unchanged
    plan re-rendered asks for nothing; rule eval_request's comment says why); base's asks for
    nothing."""
    from hy3rl.layout import split_tag

    if training_enabled() and split_tag(wildcards.tag)[0] != "base":
        return {"plan": ancient(LAYOUT.train_plan)}
    return {}


def eval_request_param(wildcards):
    """Rule eval_request's param: the tag, its generation settings and, for a checkpoint
    tag, the training keys (final: with the total, hy3rl.identity.eval_request_params).
    """
    return eval_request_params(config, wildcards.tag, TRAIN_CONTENT)


def eval_generate_threads():
    """transformers: 2 (the tiny model on CPU); vLLM: a whole node's CPUs."""
    return 2 if CFG.eval.backend == "transformers" else CFG.cluster.cpus_per_node


def eval_generate_resources():
    """vLLM: the training job's shape (nodes x GPUs per node, eval.vllm.time_min);
    transformers: one small CPU job."""
    if CFG.eval.backend == "vllm":
        v = CFG.eval.vllm
        return gpu_job_resources(v.nodes, v.gpus_per_node, v.time_min)
    return {"mem_mb": 8000, "runtime": 120}


def eval_metrics_inputs(wildcards):
    """The tag's scores and their meta, its samples' meta (the step a checkpoint tag
    evaluated); a checkpoint tag also its set's base scores (vs_base)."""
    from hy3rl.layout import heldout_tag, split_tag

    tag = wildcards.tag
    model, held = split_tag(tag)
    inputs = {
        "scores": LAYOUT.eval_scores(tag),
        "meta": LAYOUT.eval_scores_meta(tag),
        "samples_meta": LAYOUT.eval_samples_meta(tag),
    }
    if model != "base":
        inputs["base"] = LAYOUT.eval_scores(heldout_tag("base") if held else "base")
    return inputs


def eval_summary_inputs():
    """metrics.json of every test-set tag (hy3rl.evaluate.eval_tags), in tag order: the
    summary's rows; the held-out ones and the selection."""
    from hy3rl.evaluate import eval_tags
    from hy3rl.layout import heldout_tag

    tags = eval_tags(CFG, heldout=False)
    inputs = {"metrics": [LAYOUT.eval_metrics(tag) for tag in tags]}
    if CFG.data.heldout:
        inputs["heldout"] = [LAYOUT.eval_metrics(heldout_tag(tag)) for tag in tags]
    if selection_enabled():
        inputs["selected"] = LAYOUT.eval_selected
    return inputs


def selection_enabled():
    """Rule eval_select is in the DAG (hy3rl.selection.selects)."""
    from hy3rl.selection import selects

    return selects(CFG)


def eval_select_inputs(wildcards):
    """The held-out metrics of every candidate (the selection) and the test set's metrics of
    base, the candidates (the selected one's AIME-2024 figures, selected vs final), and the
    plan holding the selection fixed before training (ancient, as the training jobs read it).
    """
    from hy3rl.layout import heldout_tag
    from hy3rl.selection import candidate_tags

    tags = candidate_tags(CFG)
    return {
        "heldout": [LAYOUT.eval_metrics(heldout_tag(t)) for t in tags],
        "test": [LAYOUT.eval_metrics(t) for t in ["base", *tags]],
        "plan": ancient(LAYOUT.train_plan),
    }


# ---- release ----
def release_targets():
    """release.json of every release tag (hy3rl.release.release_tags: refused, by key, when
    a tag's evaluation is not in the DAG); none without training."""
    from hy3rl.release import ReleaseError, release_tags

    try:
        tags = release_tags(CFG)
    except ReleaseError as exc:
        raise WorkflowError(str(exc))
    return [LAYOUT.release_record(tag) for tag in tags]


def release_page_targets():
    """`all`'s release targets: every release record, and the page that shows them
    (report/releases.html, written once every release passed)."""
    targets = release_targets()
    return [*targets, LAYOUT.releases_page] if targets else []


def release_inputs(wildcards):
    """The records a release reads: the evaluation summary (after every generation, so the
    tag's samples.meta.json with its weights' hashes is there), the selection for
    `selected`, the problems it answers, and, ancient (a rewrite that changes nothing
    releases nothing again), the plan (the recipe, the bias update rate), train/done.json
    (the final step), the deps lock, the data summary and the rehearsal record for the card,
    and the report, copied beside the card (ancient: a report rendered again releases
    nothing again; the release waits for a report this invocation renders).
    """
    inputs = {
        "val": LAYOUT.data_val,
        "summary": LAYOUT.eval_summary,
        "plan": ancient(LAYOUT.train_plan),
        "train_done": ancient(LAYOUT.train_done),
        "lock": ancient(LAYOUT.deps_lock),
        "data_summary": ancient(LAYOUT.data_summary),
        "model_manifest": ancient(model_manifest()),
        "report": ancient(LAYOUT.report_html),
    }
    if selection_enabled():
        inputs["selected"] = LAYOUT.eval_selected
    if rehearsal_enabled():
        inputs["rehearsal"] = ancient(LAYOUT.rehearsal_record)
    if CFG.eval.backend == "vllm":  # the generates check's engine: Ray's runtime env
        inputs["runtime_env"] = ancient(LAYOUT.deps_runtime_env)
    return inputs


def release_job_resources():
    """Copying, comparing and hashing the weights (release.runtime_min) and the generates
    check's load of the release: with transformers one small job; with vLLM the
    evaluation's job shape (eval.vllm's nodes x GPUs; hy3rl.evaluate.run starts its engine
    there, Ray over the nodes when more than one)."""
    if CFG.eval.backend == "vllm":
        v = CFG.eval.vllm
        return gpu_job_resources(v.nodes, v.gpus_per_node, CFG.release.runtime_min)
    # never more than the node cluster.* describes (SLURM refused a release of 16 GB / 4
    # CPUs on the test cluster's nodes after the whole run had trained: issue 42)
    return {
        "mem_mb": min(16000, CFG.cluster.mem_mb_per_node),
        "runtime": CFG.release.runtime_min,
    }


def release_trigger_keys():
    """The config a release re-runs for: release, and the generates check's backend
    settings."""
    return (
        "release",
        "eval.vllm" if CFG.eval.backend == "vllm" else "eval.transformers",
    )


def release_threads():
    """release.threads, at most the node's CPUs (cluster.cpus_per_node); with vLLM a whole
    node's CPUs (as eval_generate)."""
    if CFG.eval.backend == "vllm":
        return CFG.cluster.cpus_per_node
    return min(CFG.release.threads, CFG.cluster.cpus_per_node)


# ---- report ----
def report_targets():
    """The page of rule report, the stage's `all` target."""
    return [LAYOUT.report_html]


def report_inputs(wildcards):
    """Every other target of `all` but the releases: the report comes last and sees all of
    them; a release hangs off the evaluation beside it, so that a refused release never
    withholds the report."""
    own = (f"{LAYOUT.report_dir}/", f"{LAYOUT.results}/release/")
    return [t for t in all_inputs() if not t.startswith(own)]


def report_outputs():
    """hy3rl.layout.REPORT_FILES as report() items named by report_key, captions
    report/captions/<stem>.rst: `snakemake --report` gives the same record."""
    from hy3rl.layout import REPORT_FILES, report_key

    return {
        report_key(name): report(
            LAYOUT.report_file(name),
            caption=f"../report/captions/{name.split('.')[0]}.rst",
            category=category,
        )
        for name, category in REPORT_FILES
    }


# train.notify_command's watcher in this controller (hy3rl.notify.Watcher), when onstart
# started one; onsuccess/onerror stop it with a last pass.
NOTIFY_WATCHERS = []


onstart:
    # Before anything is submitted (never during a dry run): when a training job is to run,
    # refuse while a live trainer holds the checkpoint directory's lock (a relaunch after
    # the controller was killed), and watch the attempt records for train.notify_command.
    # Jobs' own Snakemake runs with --no-hooks.
    # The evaluation steps' waits read train/state.json: whether this invocation trains.
    training = training_enabled() and any(
        job.rule.name in ("train", "train_segment")
        for job in workflow.dag.needrun_jobs()
    )
    if training_enabled():
        from hy3rl.evalckpt import write_train_state

        write_train_state(
            LAYOUT,
            "scheduled" if training else "not_scheduled",
            (
                "a training job is part of this invocation"
                if training
                else "no training job in this invocation"
            ),
        )
    if training:
        from hy3rl.ckptdir import LockHeld, check_lock_free

        try:
            check_lock_free(LAYOUT.checkpoint_dir)
        except LockHeld as exc:
            raise WorkflowError(str(exc))
        if CFG.train.notify_command:
            from hy3rl.notify import Watcher

            watcher = Watcher(CFG.train.notify_command, LAYOUT)
            NOTIFY_WATCHERS.append(watcher.start())


onsuccess:
    # train.notify_command: the attempts that ended since the watcher's last poll.
    for watcher in NOTIFY_WATCHERS:
        watcher.stop()


onerror:
    for watcher in NOTIFY_WATCHERS:
        watcher.stop()
