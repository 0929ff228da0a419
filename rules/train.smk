# Stage `train`: one multi-node SLURM job (or one machine with profiles/local) that starts
# Ray over its nodes, submits the rendered verl launch with `ray job submit`, and resumes
# from verl's own checkpoints (hy3rl.train.run; docs/formats/train.md). Only when
# cluster.gpu is true.
#
# The checkpoint directory is NOT an output (Snakemake deletes outputs before a job and
# after a failure): the job takes it from the layout (Layout.checkpoint_dir, the path
# preflight rendered as trainer.default_local_dir). The output is a sentinel written last.
# The expensive inputs are ancient() (rules/common.smk): a re-rendered but unchanged plan
# never retrains. The params are the config values that do retrain (a Ray timeout, the
# retention or the time limit do not); retention keeps eval.steps but choosing other
# evaluation steps never retrains. Force a retrain after other changes with `-R train`.
# A relaunch while a live trainer holds the checkpoint directory stops in `onstart:`.
#
# Both rules are resubmitted without a person (train_retries(): up to train.max_submissions
# submissions of a job per invocation; the profile's global `retries: 0` stays for every
# other rule): a segment job is one stretch of the same run and meets the same failures.
# Before each resubmission, train_slurm_extra (rules/common.smk, hy3rl.resubmit) reads the
# failed job's records: it adds `--exclude` for lost nodes, and stops the workflow before
# sbatch when resubmitting cannot help (a crash loop, a refused job).


STAGE_TARGETS.append(train_targets)


if gpu_enabled() and train_segment_ends():

    rule train_segment:
        input:
            unpack(train_segment_inputs),
        output:
            sentinel=LAYOUT.segment_sentinel("{end}"),
        log:
            LAYOUT.log("train_segment_step{end}"),
        wildcard_constraints:
            end=r"\d+",
        retries: train_retries()
        threads: 1
        resources:
            **train_job_resources(),
        params:
            **triggers(*TRAIN_TRIGGERS),
        script:
            "../scripts/adapters/train_segment.py"


if gpu_enabled():

    rule train:
        input:
            unpack(train_inputs),
        output:
            done=LAYOUT.train_done,
            metrics=LAYOUT.train_metrics,
        log:
            LAYOUT.log("train"),
        retries: train_retries()
        threads: 1
        resources:
            **train_job_resources(),
        params:
            **triggers(*TRAIN_TRIGGERS),
        script:
            "../scripts/adapters/train.py"
