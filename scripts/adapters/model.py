# Adapter of rule model (rules/model.smk) -> hy3rl.hub.run. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import hub
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    hub.run(cfg.model.source, cfg.model.revision, cfg.model.dir,
            manifest=Path(snakemake.output.manifest), threads=snakemake.threads,
            hash_local=cfg.checks.checkpoint.sha256)
