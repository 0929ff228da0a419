# Stage `evaluate`: AIME generation per model tag (base, step<N>, final), two graders,
# metrics, and a summary over tags. Formats: docs/formats/eval.md.
import os

EVAL = config["eval"]


def eval_tags():
    """base always; step<N> and final only when training is in the DAG (cluster.gpu)."""
    tags = ["base"]
    if gpu_enabled():
        tags += [f"step{s}" for s in EVAL["steps"]]
        if EVAL["final"]:
            tags.append("final")
    return tags


def eval_checkpoint_dir():
    """<train.checkpoint_root>/<run.name> (empty root: <working dir>/checkpoints)."""
    root = config.get("train", {}).get("checkpoint_root") or os.path.join(
        os.getcwd(), "checkpoints"
    )
    return os.path.join(root, RUN)


def eval_model_input(wildcards):
    if wildcards.tag == "base":
        return {"model": config["model"]["path"]}
    return {"train_done": ancient(f"{RESULTS}/train/done.json")}


def eval_model_args(wildcards):
    """--model for base and step<N> (verl's HF weights of that checkpoint); final reads
    its checkpoint from train/done.json at run time."""
    if wildcards.tag == "base":
        return f"--model {config['model']['path']}"
    if wildcards.tag == "final":
        return f"--train-done {RESULTS}/train/done.json"
    step = int(wildcards.tag[len("step") :])
    return f"--model {eval_checkpoint_dir()}/global_step_{step}/actor/model/huggingface"


def eval_gpu_resources():
    if EVAL["backend"] != "vllm":
        return {"mem_mb": 8000, "runtime": 120}
    v = EVAL["vllm"]
    res = {
        "nodes": v["nodes"],
        "gres": f"gpu:{v['gpus_per_node']}",
        "mem_mb": config["cluster"]["mem_mb_per_node"],
        "runtime": v["time_min"],
        "cpus_per_task": config["cluster"]["cpus_per_node"],
    }
    if v["nodes"] > 1:
        res["slurm_extra"] = "'--ntasks-per-node=1 --exclusive'"
    return res


def eval_base_scores(wildcards):
    return [] if wildcards.tag == "base" else [f"{RESULTS}/eval/base/scores.jsonl"]


STAGE_TARGETS.append(lambda: [f"{RESULTS}/eval/summary.json"])


rule eval_generate:
    input:
        unpack(eval_model_input),
        val=f"{RESULTS}/data/val.parquet",
    output:
        samples=f"{RESULTS}/eval/{{tag}}/samples.jsonl",
        meta=f"{RESULTS}/eval/{{tag}}/samples.meta.json",
    log:
        f"{LOGS}/eval/{{tag}}.generate.log",
    conda:
        "../envs/workflow.yaml"
    threads: 2 if EVAL["backend"] == "transformers" else config["cluster"]["cpus_per_node"]
    resources:
        **eval_gpu_resources(),
    params:
        cfg=section_json("eval"),
        model=eval_model_args,
    shell:
        "python -m hy3rl.evaluate --config-json {params.cfg:q} --tag {wildcards.tag}"
        " {params.model} --val {input.val} --out {output.samples} --meta {output.meta}"
        " > {log} 2>&1"


rule eval_score:
    input:
        samples=f"{RESULTS}/eval/{{tag}}/samples.jsonl",
        val=f"{RESULTS}/data/val.parquet",
        lock=f"{RESULTS}/deps/lock.json",
    output:
        scores=f"{RESULTS}/eval/{{tag}}/scores.jsonl",
        meta=f"{RESULTS}/eval/{{tag}}/scores.meta.json",
    log:
        f"{LOGS}/eval/{{tag}}.score.log",
    conda:
        "../envs/workflow.yaml"
    threads: EVAL["graders"]["workers"]
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        cfg=section_json("eval"),
    shell:
        "python -m hy3rl.graders --config-json {params.cfg:q} --samples {input.samples}"
        " --val {input.val} --lock {input.lock} --out {output.scores} --meta {output.meta}"
        " > {log} 2>&1"


rule eval_metrics:
    input:
        scores=f"{RESULTS}/eval/{{tag}}/scores.jsonl",
        meta=f"{RESULTS}/eval/{{tag}}/scores.meta.json",
        base=eval_base_scores,
    output:
        f"{RESULTS}/eval/{{tag}}/metrics.json",
    log:
        f"{LOGS}/eval/{{tag}}.metrics.log",
    conda:
        "../envs/workflow.yaml"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        cfg=section_json("eval"),
        base=lambda wc, input: f"--base-scores {input.base}" if input.base else "",
    shell:
        "python -m hy3rl.metrics compute --config-json {params.cfg:q} --tag {wildcards.tag}"
        " --scores {input.scores} --scores-meta {input.meta} {params.base} --out {output}"
        " > {log} 2>&1"


rule evaluate:
    input:
        [f"{RESULTS}/eval/{tag}/metrics.json" for tag in eval_tags()],
    output:
        f"{RESULTS}/eval/summary.json",
    log:
        f"{LOGS}/eval/summary.log",
    conda:
        "../envs/workflow.yaml"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    shell:
        "python -m hy3rl.metrics summarize --metrics {input} --out {output} > {log} 2>&1"
