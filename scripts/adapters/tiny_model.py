# Adapter of rule tiny_model (rules/model.smk) -> hy3rl.model.run. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import model
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    model.run(cfg.model.tiny, out=Path(snakemake.output[0]))
