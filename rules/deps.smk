# Stage `deps`: clone verl, Megatron-Bridge and TransferQueue at full pinned SHAs, verify
# HEAD, write the lock file and the Ray runtime_env.yaml.


rule deps:
    output:
        lock=f"{RESULTS}/deps/lock.json",
        runtime_env=f"{RESULTS}/deps/runtime_env.yaml",
    params:
        cfg=section_json("deps"),
    log:
        f"{LOGS}/deps.log",
    conda:
        "../envs/workflow.yaml"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    shell:
        "{PY} hy3rl.deps --config-json {params.cfg:q} --lock {output.lock}"
        " --runtime-env {output.runtime_env} > {log} 2>&1"
