# Stage `evaluate`: AIME generation per model tag (base, step<N>, final), two graders,
# metrics, and a summary over tags. Formats: docs/formats/eval.md. The tag logic lives in
# hy3rl.evaluate (eval_tags, model_for_tag) so it is unit-tested; the input functions are
# in rules/common.smk (eval section). With data.heldout, every tag is evaluated on the
# held-out set too (tag heldout/<tag>); with eval.select, rule eval_select picks the
# checkpoint to report on it. A step's generations start as soon as its checkpoint is
# complete (rule eval_checkpoint), while training goes on on its own allocation.


STAGE_TARGETS.append(eval_targets)


# What a tag is asked to evaluate (an input of its generation), named by the digest of its
# values (eval_request in rules/common.smk; hy3rl.identity.eval_request_params): its
# settings, for a checkpoint tag the training keys, for `final` with the total. A direct
# input of `all` (eval_targets), so a missing request is found even while everything behind
# preflight is masked (snakemake#4166): new values name a missing request, made (and the tag
# evaluated) in the same invocation; values restored after a refused change name the request
# still in place, and nothing is evaluated again. A checkpoint tag's request is made only
# once preflight passed (the plan, ancient: eval_request_inputs): made by an invocation that
# preflight refused, it would stand for an evaluation that never ran, and the invocation
# that trains would find it in place and, masked, evaluate nothing. The generation removes
# the tag's other requests, so returning to older values evaluates again.
rule eval_request:
    input:
        unpack(eval_request_inputs),
    output:
        request=LAYOUT.eval_request("{tag}", "{digest}"),
    log:
        LAYOUT.log("eval/{tag}.request.{digest}"),
    wildcard_constraints:
        digest=r"[0-9a-f]{16}",
    localrule: True
    threads: 1
    resources:
        mem_mb=500,
        runtime=1,
    params:
        request=eval_request_param,
    script:
        "../scripts/adapters/eval_request.py"


if training_enabled():

    # Waits, on the submit host, until step N's checkpoint is complete under this run's
    # identity (or fails when training ended or was given up before it: hy3rl.evalckpt).
    # threads 0: the waits hold none of the local cores the other local jobs need.
    rule eval_checkpoint:
        input:
            unpack(eval_checkpoint_inputs),
        output:
            ready=LAYOUT.eval_ready("step{step}"),
        log:
            LAYOUT.log("eval/step{step}.wait"),
        wildcard_constraints:
            step=r"\d+",
        localrule: True
        threads: 0
        resources:
            mem_mb=300,
        script:
            "../scripts/adapters/eval_checkpoint.py"


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
        **triggers(*EVAL_GENERATION_KEYS),
    script:
        "../scripts/adapters/eval_generate.py"


# Scoring, metrics, the selection and the summary take seconds: they run on the submit host
# (localrule), never as a cluster job queued behind the training allocation; only the
# generations (eval_generate) are cluster jobs.
rule eval_score:
    input:
        samples=LAYOUT.eval_samples("{tag}"),
        val=lambda wildcards: eval_val(wildcards.tag),
        lock=LAYOUT.deps_lock,
    output:
        scores=LAYOUT.eval_scores("{tag}"),
        meta=LAYOUT.eval_scores_meta("{tag}"),
    log:
        LAYOUT.log("eval/{tag}.score"),
    localrule: True
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
    localrule: True
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        **triggers("eval.bootstrap"),
    script:
        "../scripts/adapters/eval_metrics.py"


if selection_enabled():

    # The checkpoint eval.select picks on the held-out set (the rule from the plan the
    # training ran with), and its AIME-2024 figures against base and final.
    rule eval_select:
        input:
            unpack(eval_select_inputs),
        output:
            selected=LAYOUT.eval_selected,
        log:
            LAYOUT.log("eval/select"),
        localrule: True
        threads: 1
        resources:
            mem_mb=1000,
        params:
            **triggers("eval.select", "eval.bootstrap"),
        script:
            "../scripts/adapters/eval_select.py"


rule evaluate:
    input:
        **eval_summary_inputs(),
    output:
        summary=LAYOUT.eval_summary,
    log:
        LAYOUT.log("eval/summary"),
    localrule: True
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    script:
        "../scripts/adapters/evaluate.py"
