# Adapter of rule rehearsal_model (rules/rehearsal.smk) -> hy3rl.model.run with the
# rehearsal's sizes (rehearsal.shape small), or hy3rl.stage.run (shape stage: one pipeline
# stage of the real model at the run's plan). `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import model, stage
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    out = Path(snakemake.output[0])
    if cfg.rehearsal.shape == "stage":
        stage.run(cfg, out=out, plan=Path(snakemake.input.plan), threads=snakemake.threads)
    else:
        model.run(cfg.rehearsal.model, out=out)
