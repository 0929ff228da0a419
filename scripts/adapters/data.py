# Adapter of rule data (rules/data.smk) -> hy3rl.data.run. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import data
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    heldout = snakemake.output.get("heldout")  # only with data.heldout (data_outputs)
    data.run(cfg.data, tokenizer=cfg.model.path,
             train=Path(snakemake.output.train), val=Path(snakemake.output.val),
             summary=Path(snakemake.output.summary),
             heldout=Path(heldout) if heldout else None)
