# Stage `preflight`: resolve the verl launch from the pinned script, compose it with the
# pinned verl's Hydra config and check it on CPU before any GPU is allocated
# (docs/formats/preflight.md). Also part of the default (CPU) DAG: there the plan is made
# and checked but says "not launched: no GPU".

STAGE_TARGETS.append(lambda: [f"{RESULTS}/preflight/plan.json"])


# CPU seconds on the submit host (no queue wait before the big job); its `disk` rule sees the
# checkpoint root as the submit host does (waive `disk` where that is not the cluster's view).
localrules:
    preflight,


rule preflight:
    input:
        lock=f"{RESULTS}/deps/lock.json",
        summary=f"{RESULTS}/data/summary.json",
        train=f"{RESULTS}/data/train.parquet",
        val=f"{RESULTS}/data/val.parquet",
        checkpoint_check=f"{RESULTS}/checks/checkpoint.json",
        bridge_check=bridge_check_input(),
    output:
        plan=f"{RESULTS}/preflight/plan.json",
        launch=f"{RESULTS}/preflight/launch.sh",
    log:
        f"{LOGS}/preflight.log",
    conda:
        "../envs/workflow.yaml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        cfg=section_json("run", "cluster", "model", "data", "train", "preflight"),
        out_dir=lambda w, output: os.path.dirname(output.plan),
        # checkpoints retention keeps for evaluation (rule train --keep-steps): disk rule
        keep_steps=json.dumps(sorted(config["eval"].get("steps", []))),
    shell:
        "python -m hy3rl.preflight --config-json {params.cfg:q} --lock {input.lock}"
        " --data-summary {input.summary} --train-files {input.train} --val-files {input.val}"
        " --checkpoint-check {input.checkpoint_check} --keep-steps {params.keep_steps:q}"
        " --out-dir {params.out_dir} > {log} 2>&1"
