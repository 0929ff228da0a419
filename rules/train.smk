# Stage `train`: one multi-node SLURM job (or one machine with profiles/local) that starts
# Ray over its nodes, submits the rendered verl launch with `ray job submit`, and resumes
# from verl's own checkpoints (hy3rl.train.run; docs/formats/train.md). Only when the
# run trains: cluster.gpu, or the CPU path (train.cpu, one host, real verl on FSDP2/gloo).
#
# The checkpoint directory is NOT an output (Snakemake deletes outputs before a job and
# after a failure): the job takes it from the layout (Layout.checkpoint_dir, the path
# preflight rendered as trainer.default_local_dir). The output is a sentinel written last.
# The expensive inputs are ancient() (rules/common.smk): a re-rendered but unchanged plan
# never retrains. What does re-run a training job is its keys record,
# train/keys/<stretch>.<digest>.json: an output named by the digest of the job's training
# keys (trajectory, extent and location keys: hy3rl.identity; train_keys_digest), written
# by the job once it succeeded, and a target of `all`. New keys name a missing record, which
# Snakemake finds from `all` in this invocation and, after a refusal, in the next one (a
# missing target is never masked behind preflight, snakemake#4166); keys restored after a
# refused change name the record still there, so nothing is submitted and no record has
# changed. The keys count what the job reads from files under an unchanged path too (the
# reward function's sha256, the stats of a local data source, model directory or override
# file): a file replaced in place names a new record. An operational change (a Ray timeout,
# loggers, names, retention, the watchdog, the time limit, a memory-only knob, a
# repository's url, the validation set, train.on_config_change) or other evaluation steps
# never retrain. A sentinel written under the current keys by code that wrote no record of
# them (the older rule train_keys, or an older set of keys) is adopted by rule train_adopt,
# on the submit host, instead of submitting a job that would train nothing. The job itself then checks the checkpoint
# directory's run identity (hy3rl.ckptdir): same trajectory resumes or extends, another is
# refused unless train.on_config_change says fresh or resume.
# A relaunch while a live trainer holds the checkpoint directory stops in `onstart:`.
#
# Both rules are resubmitted without a person (train_retries(): up to train.max_submissions
# submissions of a job per invocation; the profile's global `retries: 0` stays for every
# other rule): a segment job is one stretch of the same run and meets the same failures.
# Before each resubmission, train_slurm_extra (rules/common.smk, hy3rl.resubmit) reads the
# failed job's records: it adds `--exclude` for lost nodes, and stops the workflow before
# sbatch when resubmitting cannot help (a crash loop, a refused job).


STAGE_TARGETS.append(train_targets)


if training_enabled():

    # Preflight's plan and launch, copied once preflight succeeded: the training jobs'
    # (ancient) inputs, which a failed preflight never deletes (hy3rl.train.stage_launch).
    rule train_launch:
        input:
            plan=LAYOUT.preflight_plan,
            launch=LAYOUT.preflight_launch,
        output:
            plan=LAYOUT.train_plan,
            launch=LAYOUT.train_launch,
        log:
            LAYOUT.log("train/launch"),
        localrule: True
        threads: 1
        resources:
            mem_mb=500,
            runtime=1,
        script:
            "../scripts/adapters/train_launch.py"


if training_enabled() and train_segment_ends():

    rule train_segment:
        input:
            unpack(train_segment_inputs),
        output:
            **train_segment_outputs(),
        log:
            LAYOUT.log("train_segment_step{end}"),
        wildcard_constraints:
            end=r"\d+",
        retries: train_retries()
        threads: 1
        resources:
            **train_job_resources(),
        script:
            "../scripts/adapters/train_segment.py"


if training_enabled():

    rule train:
        input:
            unpack(train_inputs),
        output:
            **train_outputs(),
        log:
            LAYOUT.log("train"),
        retries: train_retries()
        threads: 1
        resources:
            **train_job_resources(),
        script:
            "../scripts/adapters/train.py"


if training_enabled() and train_adopted():

    # The keys record of a training job whose sentinel was written under the current
    # training keys before their record existed (hy3rl.train.adopt: origin adopted, after
    # preflight's run identity decision says `same` at the job's end), on the submit host;
    # the job's own rule then leaves the record out of its outputs for this invocation.
    # Its inputs are the job's: Snakemake records them with the record.
    rule train_adopt:
        input:
            unpack(train_adopt_inputs),
        output:
            train_keys=LAYOUT.train_keys("{stretch}", "{digest}"),
        log:
            LAYOUT.log("train/adopt_{stretch}.{digest}"),
        wildcard_constraints:
            **train_adopt_constraints(),
        localrule: True
        threads: 1
        resources:
            mem_mb=500,
            runtime=1,
        script:
            "../scripts/adapters/train_adopt.py"
