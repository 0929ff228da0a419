# Adapter of rule train_adopt (rules/train.smk) -> hy3rl.train.adopt: the keys record of a
# training job whose sentinel was written under the current training keys before their
# record existed, written (origin: adopted) in place of submitting a job that would train
# nothing. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import train
from hy3rl.layout import Layout
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    train.adopt(Layout.from_config(cfg), snakemake.wildcards.stretch,
                Path(snakemake.output.train_keys), snakemake.config,
                plan=Path(snakemake.input.plan))
