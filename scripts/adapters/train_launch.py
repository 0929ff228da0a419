# Adapter of rule train_launch (rules/train.smk) -> hy3rl.train.stage_launch. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import train
from hy3rl.smk import rule_job

with rule_job(snakemake):
    train.stage_launch(Path(snakemake.input.plan), Path(snakemake.input.launch),
                       Path(snakemake.output.plan), Path(snakemake.output.launch))
