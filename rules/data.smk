# Stage `data`: DAPO-Math-17k and AIME-2024 (hub or local files) -> verified verl parquet
# and a summary (hy3rl.data.run). Format: docs/formats/data.md
# Inputs (the model's manifest: its directory holds the tokenizer; local source files):
# data_inputs, common.smk.


# Runs on the submitting host like deps: hub sources need the network (compute nodes often
# have none), and the paper-size run takes under a minute and 3 GiB (benchmarks/bench_data.py).
localrules:
    data,


rule data:
    input:
        unpack(data_inputs),
    output:
        train=LAYOUT.data_train,
        val=LAYOUT.data_val,
        summary=LAYOUT.data_summary,
    log:
        LAYOUT.log("data"),
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        **triggers("data", "model.source", "model.revision", "model.dir"),
    script:
        "../scripts/adapters/data.py"
