# Stage `model`: the policy checkpoint and its manifest (hy3rl.hub.run; format:
# docs/formats/model.md). model.source is a hub repository (downloaded at the pinned
# model.revision into model.dir, resumable, every file checked against the hub's hash) or a
# local directory (used in place; the manifest is written from its files). Rule tiny_model
# (hy3rl.model.run; docs/formats/checkpoint.md) exists only for the embedded default's
# model.source, hy3rl.layout's TINY_MODEL_DIR. Every rule that reads the model takes the
# manifest as an input (model_manifest, common.smk), never the directory itself.
# A local directory (other than the tiny model) is checked against what the manifest was
# made from at every invocation: each file's size and mtime are params of rule model
# (model_local_files: a stat per file while the DAG is built), so a file replaced or
# rewritten in place re-runs rule model, Snakemake's reason naming the file with its size
# and mtime before and now; the new manifest changes the run identity, which preflight and
# every training job check (a run trained on the old files is refused, docs/formats/train.md).
# A hub checkpoint is checked too, while the DAG is built (hub_model_in_place, common.smk):
# every file's size, and the small files (config, tokenizer, chat template) by the hub's
# hash; a file edited in place is refused before any job, naming it.

STAGE_TARGETS.append(model_targets)

# A hub checkpoint edited in place (its identity is repo@commit) is refused here, before any
# job: every file's size and the small files' hashes against the manifest.
hub_model_in_place()


# On the submit host: a hub download needs the network (compute nodes often have none).
localrules:
    model,


if builds_tiny_model():

    rule tiny_model:
        output:
            directory(TINY_MODEL_DIR),
        log:
            LAYOUT.log("tiny_model"),
        threads: 1
        resources:
            mem_mb=2000,
            runtime=10,
        params:
            **triggers("model.tiny"),
        script:
            "../scripts/adapters/tiny_model.py"


# Threads: parallel file transfers (hub) or hashes (local directory). runtime: Hy3's 598 GB
# at ~100 MB/s take under two hours; a rerun resumes what arrived.
rule model:
    input:
        unpack(model_rule_inputs),
    output:
        manifest=LAYOUT.model_manifest,
    log:
        LAYOUT.log("model"),
    threads: 8
    resources:
        mem_mb=4000,
        runtime=24 * 60,
    params:
        **triggers(
            "model.source", "model.revision", "model.dir", "checks.checkpoint.sha256"
        ),
        **model_local_files(),
    script:
        "../scripts/adapters/model.py"
