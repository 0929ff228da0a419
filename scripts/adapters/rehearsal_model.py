# Adapter of rule rehearsal_model (rules/rehearsal.smk) -> hy3rl.model.run with the
# rehearsal's sizes. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import model
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    model.run(cfg.rehearsal.model, out=Path(snakemake.output[0]))
