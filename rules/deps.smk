# Stage `deps`: clone verl, Megatron-Bridge and TransferQueue at full pinned SHAs, verify
# HEAD, write the lock file and the Ray runtime_env.yaml (hy3rl.deps.run).
# Format: docs/formats/deps.md


# Runs on the submitting host, not as a SLURM job: it needs the network (compute nodes
# often have none), takes seconds, and the clones land on shared storage (deps.dir).
localrules:
    deps,


rule deps:
    output:
        lock=LAYOUT.deps_lock,
        runtime_env=LAYOUT.deps_runtime_env,
    log:
        LAYOUT.log("deps"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    params:
        **triggers("deps"),
    script:
        "../scripts/adapters/deps.py"
