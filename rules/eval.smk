# Stage `evaluate`: AIME generation per model tag (base, step<N>, final), two graders,
# metrics, and a summary over tags. Formats: docs/formats/eval.md. The tag logic lives in
# hy3rl.evaluate (eval_tags, model_for_tag) so it is unit-tested; the input functions are
# in rules/common.smk (eval section).


STAGE_TARGETS.append(eval_targets)


rule eval_generate:
    input:
        unpack(eval_generate_inputs),
    output:
        samples=LAYOUT.eval_samples("{tag}"),
        meta=LAYOUT.eval_samples_meta("{tag}"),
    log:
        LAYOUT.log("eval/{tag}.generate"),
    threads: eval_generate_threads()
    resources:
        **eval_generate_resources(),
    params:
        **triggers(
            "eval.backend",
            "eval.preset",
            "eval.temperature",
            "eval.top_p",
            "eval.n_samples",
            "eval.max_tokens",
            "eval.num_problems",
            "eval.seed",
            "eval.transformers",
            "eval.vllm.tensor_parallel_size",
            "eval.vllm.data_parallel_size",
            "eval.vllm.nodes",
            "eval.vllm.gpus_per_node",
            "eval.vllm.gpu_memory_utilization",
            "eval.vllm.max_model_len",
            "eval.vllm.enforce_eager",
            "model.source",
            "model.revision",
            "model.dir",
        ),
    script:
        "../scripts/adapters/eval_generate.py"


rule eval_score:
    input:
        samples=LAYOUT.eval_samples("{tag}"),
        val=LAYOUT.data_val,
        lock=LAYOUT.deps_lock,
    output:
        scores=LAYOUT.eval_scores("{tag}"),
        meta=LAYOUT.eval_scores_meta("{tag}"),
    log:
        LAYOUT.log("eval/{tag}.score"),
    threads: CFG.eval.graders.workers
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        **triggers("eval.graders.timeout_s"),
    script:
        "../scripts/adapters/eval_score.py"


rule eval_metrics:
    input:
        unpack(eval_metrics_inputs),
    output:
        metrics=LAYOUT.eval_metrics("{tag}"),
    log:
        LAYOUT.log("eval/{tag}.metrics"),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        **triggers("eval.bootstrap"),
    script:
        "../scripts/adapters/eval_metrics.py"


rule evaluate:
    input:
        metrics=eval_summary_inputs(),
    output:
        summary=LAYOUT.eval_summary,
    log:
        LAYOUT.log("eval/summary"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    script:
        "../scripts/adapters/evaluate.py"
