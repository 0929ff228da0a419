# Stage `train`: one multi-node SLURM job (or one machine with profiles/local) that starts
# Ray over its nodes, submits the rendered verl launch with `ray job submit`, and resumes
# from verl's own checkpoints (docs/formats/train.md). Only when cluster.gpu is true.
#
# The checkpoint directory is NOT an output (Snakemake deletes outputs before a job and
# after a failure): it reaches the job through params (the same path preflight rendered
# as trainer.default_local_dir). The output is a sentinel written last. The expensive
# inputs are ancient(): a re-rendered but unchanged plan never retrains; config changes of
# run/cluster/train do (params). Force a retrain after other changes with `-R train`.


STAGE_TARGETS.append(lambda: [f"{RESULTS}/train/done.json"] if gpu_enabled() else [])

# Retention keeps the checkpoints evaluation asks for. Deliberately not a param: choosing
# other evaluation steps must not retrain (the profiles do not rerun on code changes).
TRAIN_KEEP_STEPS = json.dumps(sorted(config["eval"].get("steps", [])))


if gpu_enabled() and train_segment_ends():

    rule train_segment:
        input:
            unpack(train_segment_inputs),
        output:
            f"{RESULTS}/train/segments/step{{end}}.json",
        log:
            f"{LOGS}/train_segment_step{{end}}.log",
        wildcard_constraints:
            end=r"\d+",
        conda:
            "../envs/workflow.yaml"
        threads: 1
        resources:
            **gpu_job_resources(
                config["cluster"]["nodes"],
                config["cluster"]["gpus_per_node"],
                config["cluster"]["train_time_min"],
            ),
        params:
            cfg=section_json("run", "cluster", "train"),
            checkpoint_dir=train_checkpoint_dir(),
            results=lambda wc, output: os.path.dirname(os.path.dirname(output[0])),
        shell:
            "python -m hy3rl.train --config-json {params.cfg:q} --plan {input.plan}"
            " --launch {input.launch} --runtime-env {input.runtime_env}"
            " --results-dir {params.results} --checkpoint-dir {params.checkpoint_dir:q}"
            " --until {wildcards.end} --sentinel {output}"
            f" --keep-steps '{TRAIN_KEEP_STEPS}' > {{log}} 2>&1"


if gpu_enabled():

    rule train:
        input:
            unpack(train_inputs),
        output:
            done=f"{RESULTS}/train/done.json",
            metrics=f"{RESULTS}/train/metrics.jsonl",
        log:
            f"{LOGS}/train.log",
        conda:
            "../envs/workflow.yaml"
        threads: 1
        resources:
            **gpu_job_resources(
                config["cluster"]["nodes"],
                config["cluster"]["gpus_per_node"],
                config["cluster"]["train_time_min"],
            ),
        params:
            cfg=section_json("run", "cluster", "train"),
            checkpoint_dir=train_checkpoint_dir(),
            results=lambda wc, output: os.path.dirname(output.done),
        shell:
            "python -m hy3rl.train --config-json {params.cfg:q} --plan {input.plan}"
            " --launch {input.launch} --runtime-env {input.runtime_env}"
            " --results-dir {params.results} --checkpoint-dir {params.checkpoint_dir:q}"
            f" --keep-steps '{TRAIN_KEEP_STEPS}' > {{log}} 2>&1"
