# Adapter of rule rehearsal (rules/rehearsal.smk) -> hy3rl.rehearsal.run, on one node of the
# training partition. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import rehearsal
from hy3rl.layout import Layout
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    rehearsal.run(cfg, Layout.from_config(cfg), runtime_env=Path(snakemake.input.runtime_env),
                  val=Path(snakemake.input.val), out=Path(snakemake.output.record),
                  train=Path(snakemake.input.train))
