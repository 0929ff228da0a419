# Stage `rehearsal` (GPU runs, unless preflight.waive names it): the real stack on one node
# before the training allocation (hy3rl.rehearsal; docs/formats/rehearsal.md). A small Hy3 of
# the real layer kinds (rule rehearsal_model) is trained with the run's own plan scaled to
# one node (rule rehearsal_plan: preflight itself on it), through the training launcher:
# two steps saved, a kill, a resume for one more step, a generation with eval.backend in
# the training runtime, verl's reward manager probed on a training prompt (data/train.parquet)
# in that runtime; then its records and checkpoints are checked. The train jobs take rehearsal.json
# (written only when every check passed) as an input: a failed rehearsal stops the run
# before the training job is submitted.
#
# What re-runs the rehearsal: the training runtime (rule rehearsal_runtime, which has no
# input, so Snakemake never masks it, snakemake#4166); nothing else (its other inputs are
# ancient). The train job compares the full runtime identity with the rehearsal's and
# refuses a runtime the rehearsal did not pass in.


STAGE_TARGETS.append(rehearsal_targets)


if rehearsal_enabled():

    # shape small: a small Hy3 built on the submit host. shape stage: one real pipeline
    # stage (hy3rl.stage, ~40 GB of random weights for Hy3) from the real checkpoint's config
    # and headers and the run's plan (its PP), written shard by shard in a cluster job.
    rule rehearsal_model:
        input:
            **rehearsal_model_inputs(),
        output:
            directory(LAYOUT.rehearsal_model),
        log:
            LAYOUT.log("rehearsal/model"),
        localrule: CFG.rehearsal.shape == "small"
        threads: 1 if CFG.rehearsal.shape == "small" else 8
        resources:
            mem_mb=4000 if CFG.rehearsal.shape == "small" else 16000,
            runtime=10 if CFG.rehearsal.shape == "small" else 120,
        params:
            **rehearsal_model_triggers(),
        script:
            "../scripts/adapters/rehearsal_model.py"

    # What the DAG can see of train.runtime without running it (hy3rl.rehearsal.
    # runtime_fingerprint: the declared prefix and python, a SIF's size and mtime, a local
    # interpreter's site-packages); no input, so never masked.
    rule rehearsal_runtime:
        output:
            runtime=LAYOUT.rehearsal_runtime,
        log:
            LAYOUT.log("rehearsal/runtime"),
        localrule: True
        threads: 1
        resources:
            mem_mb=500,
            runtime=1,
        params:
            fingerprint=rehearsal_fingerprint,
        script:
            "../scripts/adapters/rehearsal_runtime.py"

    # Preflight on the rehearsal's config (every rule, verl's own checks), with the
    # reductions against the run's plan listed in it.
    rule rehearsal_plan:
        input:
            lock=LAYOUT.deps_lock,
            summary=LAYOUT.data_summary,
            train=LAYOUT.data_train,
            val=LAYOUT.data_val,
            checkpoint_check=LAYOUT.checks_checkpoint,
            bridge_check=LAYOUT.checks_bridge,
            model=LAYOUT.rehearsal_model,
            main_plan=LAYOUT.preflight_plan,
        output:
            plan=REHEARSAL_LAYOUT.preflight_plan,
            launch=REHEARSAL_LAYOUT.preflight_launch,
        log:
            LAYOUT.log("rehearsal/plan"),
        localrule: True
        threads: 1
        resources:
            mem_mb=2000,
            runtime=10,
        script:
            "../scripts/adapters/rehearsal_plan.py"

    rule rehearsal:
        input:
            runtime=LAYOUT.rehearsal_runtime,
            plan=ancient(REHEARSAL_LAYOUT.preflight_plan),
            launch=ancient(REHEARSAL_LAYOUT.preflight_launch),
            model=ancient(LAYOUT.rehearsal_model),
            val=ancient(LAYOUT.data_val),
            train=ancient(LAYOUT.data_train),
            runtime_env=ancient(LAYOUT.deps_runtime_env),
        output:
            record=LAYOUT.rehearsal_record,
        log:
            LAYOUT.log("rehearsal/rehearsal"),
        retries: 0
        threads: 1
        resources:
            **rehearsal_job_resources(),
        script:
            "../scripts/adapters/rehearsal.py"
