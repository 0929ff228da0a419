# Stage `data`: DAPO-Math-17k and AIME-2024 (hub or local files) -> verified verl parquet
# and a summary (docs/formats/data.md).

STAGE_TARGETS.append(lambda: [f"{RESULTS}/data/summary.json"])


# Runs on the submitting host like deps: hub sources need the network (compute nodes often
# have none), and the paper-size run takes under a minute and 3 GiB (benchmarks/bench_data.py).
localrules:
    data,


rule data:
    input:
        unpack(data_inputs),
    output:
        train=f"{RESULTS}/data/train.parquet",
        val=f"{RESULTS}/data/val.parquet",
        summary=f"{RESULTS}/data/summary.json",
    log:
        f"{LOGS}/data.log",
    conda:
        "../envs/workflow.yaml"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        cfg=section_json("data"),
        tokenizer=config["model"]["path"],
    shell:
        "python -m hy3rl.data --config-json {params.cfg:q} --tokenizer {params.tokenizer:q}"
        " --train-out {output.train} --val-out {output.val} --summary {output.summary}"
        " > {log} 2>&1"
