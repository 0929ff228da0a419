# Adapter of rule check_bridge (rules/checks.smk) -> hy3rl.bridge.run, which starts the check
# in the training runtime (train.runtime). `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import bridge
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    bridge.run(cfg.checks.bridge, cfg.model, cfg.train.runtime,
               lock=Path(snakemake.input.lock), out=Path(snakemake.output.report))
