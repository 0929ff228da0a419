# Adapter of rule release_page (rules/release.smk) -> hy3rl.report.releases.run. `snakemake`
# is Snakemake's object.
from pathlib import Path

from hy3rl.layout import Layout
from hy3rl.release import release_tags
from hy3rl.report import releases
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    releases.run(cfg, release_tags(cfg), layout=Layout.from_config(cfg),
                 out=Path(snakemake.output[0]))
