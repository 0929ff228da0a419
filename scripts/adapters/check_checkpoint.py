# Adapter of rule check_checkpoint (rules/checks.smk) -> hy3rl.checkpoint.run.
# `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import checkpoint
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    checkpoint.run(cfg.checks.checkpoint, model=Path(cfg.model.path),
                   manifest=Path(snakemake.input.manifest), lock=Path(snakemake.input.lock),
                   out=Path(snakemake.output.report), threads=snakemake.threads)
