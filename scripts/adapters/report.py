# Adapter of rule report (rules/report.smk) -> hy3rl.report.run. `snakemake` is Snakemake's
# object; the outputs are named by hy3rl.layout.report_key.
from pathlib import Path

from hy3rl import report
from hy3rl.layout import REPORT_FILES, Layout, report_key
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    report.run(cfg, results=Layout.from_config(cfg),
               outputs={n: Path(getattr(snakemake.output, report_key(n))) for n, _ in REPORT_FILES})
