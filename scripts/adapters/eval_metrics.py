# Adapter of rule eval_metrics (rules/eval.smk) -> hy3rl.metrics.run. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import metrics
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    base = snakemake.input.get("base")
    metrics.run(cfg.eval.bootstrap, tag=snakemake.wildcards.tag,
                scores=Path(snakemake.input.scores), scores_meta=Path(snakemake.input.meta),
                base_scores=Path(base) if base else None, out=Path(snakemake.output.metrics),
                samples_meta=Path(snakemake.input.samples_meta))
