# Adapter of rule deps (rules/deps.smk) -> hy3rl.deps.run. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import deps
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    deps.run(cfg.deps, lock=Path(snakemake.output.lock),
             runtime_env=Path(snakemake.output.runtime_env))
