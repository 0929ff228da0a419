# Adapter of rule cluster_probe (rules/cluster.smk) -> hy3rl.cluster.run. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import cluster
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    cluster.run(cfg.cluster, out=Path(snakemake.output.probe))
