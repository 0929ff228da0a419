# Stage `deps`: clone verl, Megatron-Bridge and TransferQueue at full pinned SHAs, verify
# HEAD, write the lock file and the Ray runtime_env.yaml. Format: docs/formats/deps.md


# Runs on the submitting host, not as a SLURM job: it needs the network (compute nodes
# often have none), takes seconds, and the clones land on shared storage (deps.dir).
localrules:
    deps,


rule deps:
    output:
        lock=f"{RESULTS}/deps/lock.json",
        runtime_env=f"{RESULTS}/deps/runtime_env.yaml",
    log:
        f"{LOGS}/deps.log",
    conda:
        "../envs/workflow.yaml"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    params:
        cfg=section_json("deps"),
    shell:
        "python -m hy3rl.deps --config-json {params.cfg:q} --lock {output.lock}"
        " --runtime-env {output.runtime_env} > {log} 2>&1"
