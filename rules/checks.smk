# Stage `checks`: rule check_checkpoint (CPU, safetensors headers + Megatron-Bridge HYV3
# mapping coverage on names) runs before preflight; rule check_bridge (HF -> Megatron -> HF
# on one GPU node) only when cluster.gpu is true. Outputs: docs/formats/checkpoint.md.


def checks_targets():
    targets = [f"{RESULTS}/checks/checkpoint.json"]
    if gpu_enabled():
        targets.append(f"{RESULTS}/checks/bridge.json")
    return targets


STAGE_TARGETS.append(checks_targets)


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
        "{PY} hy3rl.checkpoint --model-path {input.model:q} --lock {input.lock}"
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
            scripts=f"{workflow.basedir}/scripts",
        shell:
            "PYTHONPATH={params.scripts:q}${{PYTHONPATH:+:$PYTHONPATH}}"
            " {params.python} -m hy3rl.bridge check --config-json {params.cfg:q}"
            " --lock {input.lock} --out {output} > {log} 2>&1"
