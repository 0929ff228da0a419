# Stage `cluster_probe`, and the resource shape of every multi-node GPU job
# (docs/formats/cluster.md).


def gpu_job_resources(
    nodes,
    gpus_per_node,
    runtime_min,
    gpu_type=None,
    constraint=None,
    cpus_per_node=None,
    mem_mb_per_node=None,
):
    """Resources of a multi-node GPU job for snakemake-executor-plugin-slurm 2.8:
    `--nodes=<nodes>`, `--gres=gpu[:<gpu_type>]:<gpus_per_node>` (per node; the plugin's
    `gpu` resource is a per-job total and breaks multi-node jobs), one task per node and
    the nodes exclusive (`slurm_extra`), `--cpus-per-task=<cpus_per_node>`,
    `--mem=<mem_mb_per_node>` (per node), `-t <runtime_min>`, `-C <constraint>` if set.
    Unset keyword arguments come from config["cluster"]. Use as
    `resources: **gpu_job_resources(config["cluster"]["nodes"], ..., 60)`; training uses
    the same shape."""
    c = config["cluster"]
    gpu_type = c["gpu_type"] if gpu_type is None else gpu_type
    constraint = c["constraint"] if constraint is None else constraint
    gres = f"gpu:{gpu_type}:{gpus_per_node}" if gpu_type else f"gpu:{gpus_per_node}"
    res = {
        "nodes": int(nodes),
        "gres": gres,
        "cpus_per_task": int(
            c["cpus_per_node"] if cpus_per_node is None else cpus_per_node
        ),
        "mem_mb": int(
            c["mem_mb_per_node"] if mem_mb_per_node is None else mem_mb_per_node
        ),
        "runtime": int(runtime_min),
        "slurm_extra": "--ntasks-per-node=1 --exclusive",
    }
    if constraint:
        res["constraint"] = constraint
    return res


def probe_target():
    return [f"{RESULTS}/cluster/probe.json"] if gpu_enabled() else []


STAGE_TARGETS.append(probe_target)


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
