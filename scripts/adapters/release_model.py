# Adapter of rule release_model (rules/release.smk) -> hy3rl.release.run. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import release
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    release.run(cfg, snakemake.wildcards.rtag, inputs=dict(snakemake.input.items()),
                out=Path(snakemake.output.record), threads=snakemake.threads)
