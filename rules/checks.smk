# Stage `checks`: rule check_checkpoint (CPU, safetensors headers + Megatron-Bridge HYV3
# mapping coverage on names) runs before preflight; rule check_bridge (HF -> Megatron -> HF
# on one GPU node) only when cluster.gpu is true. Outputs: docs/formats/checkpoint.md.


STAGE_TARGETS.append(checks_targets)


rule check_checkpoint:
    input:
        model=checkpoint_dir(),
        lock=f"{RESULTS}/deps/lock.json",
    output:
        f"{RESULTS}/checks/checkpoint.json",
    log:
        f"{LOGS}/check_checkpoint.log",
    conda:
        "../envs/workflow.yaml"
    threads: config["checks"]["checkpoint"]["threads"]
    resources:
        mem_mb=4000,
        runtime=config["checks"]["checkpoint"]["runtime_min"],
    params:
        cfg=section_json("checks"),
    shell:
        "python -m hy3rl.checkpoint --model-path {input.model:q} --lock {input.lock}"
        " --config-json {params.cfg:q} --threads {threads} --out {output} > {log} 2>&1"


if gpu_enabled():

    rule check_bridge:
        input:
            checkpoint_check=f"{RESULTS}/checks/checkpoint.json",
            lock=f"{RESULTS}/deps/lock.json",
        output:
            f"{RESULTS}/checks/bridge.json",
        log:
            f"{LOGS}/check_bridge.log",
        container:
            config["checks"]["bridge"]["container"]
        threads: config["checks"]["bridge"]["cpus"]
        resources:
            **bridge_job_resources(),
        params:
            cfg=section_json("model", "checks"),
            python=config["checks"]["bridge"]["python"],
        shell:
            # The workflow's own package; not a param, so a moved checkout reruns nothing.
            f"PYTHONPATH={workflow.basedir}/scripts${{{{PYTHONPATH:+:$PYTHONPATH}}}}"
            " {params.python} -m hy3rl.bridge check --config-json {params.cfg:q}"
            " --lock {input.lock} --out {output} > {log} 2>&1"
