# Stage `release` (GPU runs, after `evaluate`): each of release.tags (`selected`, `final`)
# as a Hugging Face model directory under <release.dir>/<run>/<tag>/ (never an output: a
# rerun must not delete a release), verified against the base model and against the weights
# its evaluation loaded, with a model card written from the records (hy3rl.release,
# docs/formats/release.md). Its output is release/<tag>/release.json, written only when
# every check passed; release/<tag>/checks.json holds the checks, passed or not. It runs
# beside the report, not before it (a refused release never withholds the report). The
# input functions are in rules/common.smk (release section).


if gpu_enabled():

    STAGE_TARGETS.append(release_targets)

    rule release_model:
        input:
            unpack(release_inputs),
        output:
            record=LAYOUT.release_record("{rtag}"),
        log:
            LAYOUT.log("release/{rtag}"),
        wildcard_constraints:
            rtag="selected|final",
        threads: CFG.release.threads
        resources:
            **release_job_resources(),
        params:
            **triggers("release", "eval.transformers"),
        script:
            "../scripts/adapters/release_model.py"

    # The target users type: every release of release.tags.
    rule release:
        input:
            release_targets(),
        localrule: True
