# Adapter of rule evaluate (rules/eval.smk) -> hy3rl.metrics.run_summary. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import metrics
from hy3rl.smk import rule_job

with rule_job(snakemake):
    metrics.run_summary(metrics=[Path(p) for p in snakemake.input.metrics],
                        out=Path(snakemake.output.summary))
