# Stage `model`: the tiny random Hy3 checkpoint (rule tiny_model). It exists in the DAG only
# when model.path is the embedded default; any other model.path is used as given.
TINY_MODEL_PATH = "resources/tiny-hy3"  # = hy3rl.model.TINY_DEFAULT_PATH


if config["model"]["path"] == TINY_MODEL_PATH:

    rule tiny_model:
        output:
            directory(TINY_MODEL_PATH),
        log:
            f"{LOGS}/tiny_model.log",
        conda:
            "../envs/workflow.yaml"
        threads: 1
        resources:
            mem_mb=2000,
            runtime=10,
        params:
            cfg=section_json("model"),
        shell:
            "python -m hy3rl.model --config-json {params.cfg:q} --out {output} > {log} 2>&1"
