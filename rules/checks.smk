# Stage `checks`: rule check_checkpoint (CPU: the files against the model manifest, sizes
# always and hashes with checks.checkpoint.sha256; safetensors headers + Megatron-Bridge
# HYV3 mapping coverage on names; hy3rl.checkpoint) runs before preflight; rule check_bridge
# (HF -> Megatron -> HF on one GPU node; hy3rl.bridge) only when cluster.gpu is true. Its
# adapter runs on the job's host and starts the check in the training runtime
# (train.runtime), so the GPU image or environment is declared once. Outputs:
# docs/formats/checkpoint.md.


STAGE_TARGETS.append(checks_targets)


rule check_checkpoint:
    input:
        manifest=model_manifest(),
        lock=LAYOUT.deps_lock,
    output:
        report=LAYOUT.checks_checkpoint,
    log:
        LAYOUT.log("check_checkpoint"),
    threads: CFG.checks.checkpoint.threads
    resources:
        mem_mb=4000,
        runtime=CFG.checks.checkpoint.runtime_min,
    params:
        **triggers(
            "checks.checkpoint.sha256",
            "model.source",
            "model.revision",
            "model.dir",
        ),
    script:
        "../scripts/adapters/check_checkpoint.py"


if gpu_enabled():

    rule check_bridge:
        input:
            checkpoint_check=LAYOUT.checks_checkpoint,
            manifest=model_manifest(),
            lock=LAYOUT.deps_lock,
        output:
            report=LAYOUT.checks_bridge,
        log:
            LAYOUT.log("check_bridge"),
        threads: CFG.checks.bridge.cpus
        resources:
            **bridge_job_resources(),
        params:
            **triggers(
                "checks.bridge.real_layers",
                "checks.bridge.logits_cosine_min",
                "model.source",
                "model.revision",
                "model.dir",
                "train.runtime",
            ),
        script:
            "../scripts/adapters/check_bridge.py"
