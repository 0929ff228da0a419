# Stage `preflight`: resolve the verl launch from the pinned script, compose it with the
# pinned verl's Hydra config and check it on CPU before any GPU is allocated
# (hy3rl.preflight.run). Format: docs/formats/preflight.md. Also part of the default (CPU)
# DAG: there the plan is made and checked but says "not launched: no GPU".

STAGE_TARGETS.append(preflight_targets)


# CPU seconds on the submit host (no queue wait before the big job); its `disk` rule sees the
# checkpoint root as the submit host does (waive `disk` where that is not the cluster's view).
localrules:
    preflight,


# Params: every config value preflight reads (cluster.gpu..gpu_memory_gb: the allocation
# rules and the estimate; eval.steps: the checkpoints retention keeps, for the disk rule;
# train.runtime: the runtime_tag warning; eval.select and the samples per problem: the
# selection rule written into the plan; data.heldout is read through its file, and
# train.reward_function.path too: editing the reward re-runs preflight, which copies it to
# preflight/reward/<sha256>.py, a path of its own; so do the files that overrides name for
# trajectory keys, which the identity counts by content). Outputs are written only when no rule
# refuses (a refusal's plan goes to preflight/plan.refused.json, not an output).
# With cluster.gpu, check_bridge's report is read:
# a bridge check that is `not run` or `fail` stops the launch unless `preflight.waive: [bridge]`.
rule preflight:
    input:
        **heldout_input(),
        **reward_function_input(),
        **override_path_inputs(),
        lock=LAYOUT.deps_lock,
        summary=LAYOUT.data_summary,
        train=LAYOUT.data_train,
        val=LAYOUT.data_val,
        checkpoint_check=LAYOUT.checks_checkpoint,
        bridge_check=bridge_check_input(),
        model_manifest=model_manifest(),
    output:
        plan=LAYOUT.preflight_plan,
        launch=LAYOUT.preflight_launch,
    log:
        LAYOUT.log("preflight"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        **triggers(
            "run",
            "cluster.gpu",
            "cluster.nodes",
            "cluster.gpus_per_node",
            "cluster.gpu_type",
            "cluster.gpu_memory_gb",
            "model.source",
            "model.revision",
            "model.dir",
            "data.max_prompt_length",
            "train.reward_mode",
            "train.total_training_steps",
            "train.env",
            "train.loggers",
            "train.algorithm",
            "train.reward_function",
            "train.launch_script",
            "train.runtime.prefix",
            "train.verl_overrides",
            "train.checkpoint_root",
            "train.checkpoint_keep",
            "train.segment_steps",
            "train.on_config_change",
            "preflight",
            "eval.steps",
            "eval.select",
            "eval.n_samples",
            "eval.preset",
        ),
    script:
        "../scripts/adapters/preflight.py"
