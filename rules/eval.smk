# Stage `evaluate`: AIME generation per model tag (base, step<N>, final), two graders,
# metrics, and a summary over tags. Formats: docs/formats/eval.md. The tag logic lives in
# hy3rl.evaluate (eval_tags, model_args) so it is unit-tested.
from hy3rl.evaluate import eval_tags, model_args

TRAIN_DONE = f"{RESULTS}/train/done.json"
VLLM = config["eval"]["backend"] == "vllm"
# vLLM on several nodes starts Ray with the training launcher: it needs the cluster section
# and the runtime env written by deps.
GEN_CFG = section_json("eval", "cluster") if VLLM else section_json("eval")
GEN_RUNTIME_ENV = {"runtime_env": f"{RESULTS}/deps/runtime_env.yaml"} if VLLM else {}
GEN_THREADS = (
    2
    if config["eval"]["backend"] == "transformers"
    else config["cluster"]["cpus_per_node"]
)

# vLLM jobs take the training job's shape (rules/common.smk): nodes x GPUs per node.
_V = config["eval"]["vllm"]
GEN_RESOURCES = (
    gpu_job_resources(_V["nodes"], _V["gpus_per_node"], _V["time_min"])
    if VLLM
    else {"mem_mb": 8000, "runtime": 120}
)

STAGE_TARGETS.append(lambda: [f"{RESULTS}/eval/summary.json"])


rule eval_generate:
    input:
        unpack(
            lambda wc: (
                {"model": config["model"]["path"]}
                if wc.tag == "base"
                else {"train_done": ancient(TRAIN_DONE)}
            )
        ),
        **GEN_RUNTIME_ENV,
        val=f"{RESULTS}/data/val.parquet",
    output:
        samples=f"{RESULTS}/eval/{{tag}}/samples.jsonl",
        meta=f"{RESULTS}/eval/{{tag}}/samples.meta.json",
    log:
        f"{LOGS}/eval/{{tag}}.generate.log",
    conda:
        "../envs/workflow.yaml"
    threads: GEN_THREADS
    resources:
        **GEN_RESOURCES,
    params:
        cfg=GEN_CFG,
        model=lambda wc: model_args(config, wc.tag, TRAIN_DONE),
        runtime_env=lambda wc, input: (
            f"--runtime-env {input.runtime_env}" if VLLM else ""
        ),
    shell:
        "python -m hy3rl.evaluate --config-json {params.cfg:q} --tag {wildcards.tag}"
        " {params.model} {params.runtime_env} --val {input.val} --out {output.samples}"
        " --meta {output.meta}"
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
    threads: config["eval"]["graders"]["workers"]
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
        base=lambda wc: (
            [] if wc.tag == "base" else [f"{RESULTS}/eval/base/scores.jsonl"]
        ),
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
        [f"{RESULTS}/eval/{tag}/metrics.json" for tag in eval_tags(config)],
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
