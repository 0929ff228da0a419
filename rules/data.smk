# Stage `data`: DAPO-Math-17k and AIME-2024 (hub or local files) -> verified verl parquet
# and a summary (hy3rl.data.run). Format: docs/formats/data.md
# Inputs (the model's manifest: its directory holds the tokenizer; local source files):
# data_inputs, common.smk. Outputs (train, val, summary; heldout with data.heldout):
# data_outputs, common.smk.


# Runs on the submitting host like deps: hub sources need the network (compute nodes often
# have none), and the paper-size run takes under a minute and 3 GiB (benchmarks/bench_data.py).
localrules:
    data,


rule data:
    input:
        unpack(data_inputs),
    output:
        **data_outputs(),
    log:
        LAYOUT.log("data"),
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        **triggers("data", "model.source", "model.revision", "model.dir"),
        **data_source_params(),
    script:
        "../scripts/adapters/data.py"
