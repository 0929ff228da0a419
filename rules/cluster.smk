# Stage `cluster_probe` (docs/formats/cluster.md). The resource shape of every multi-node
# GPU job (gpu_job_resources) and this stage's `all` target live in rules/common.smk.


STAGE_TARGETS.append(cluster_probe_targets)


# A pre-training diagnostic with the training job's exact shape: srun --overlap on every
# node of the allocation; probe.json lists each node's name, host and visible GPUs.
rule cluster_probe:
    output:
        f"{RESULTS}/cluster/probe.json",
    log:
        f"{LOGS}/cluster_probe.log",
    conda:
        "../envs/workflow.yaml"
    threads: 1
    resources:
        **gpu_job_resources(
            config["cluster"]["nodes"], config["cluster"]["gpus_per_node"], 10
        ),
    params:
        nodes=config["cluster"]["nodes"],
        gpus=config["cluster"]["gpus_per_node"],
    shell:
        "python -m hy3rl.cluster probe --nodes {params.nodes} --gpus-per-node {params.gpus}"
        " --out {output} > {log} 2>&1"
