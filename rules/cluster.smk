# Stage `cluster_probe` (hy3rl.cluster.run; docs/formats/cluster.md). The resource shape of
# every multi-node GPU job (gpu_job_resources) and this stage's `all` target live in
# rules/common.smk.


STAGE_TARGETS.append(cluster_probe_targets)


# A pre-training diagnostic with the training job's exact shape: srun --overlap on every
# node of the allocation; probe.json lists each node's name, host and visible GPUs.
rule cluster_probe:
    output:
        probe=LAYOUT.cluster_probe,
    log:
        LAYOUT.log("cluster_probe"),
    threads: 1
    resources:
        **gpu_job_resources(CFG.cluster.nodes, CFG.cluster.gpus_per_node, 10),
    params:
        **triggers("cluster.nodes", "cluster.gpus_per_node"),
    script:
        "../scripts/adapters/cluster_probe.py"
