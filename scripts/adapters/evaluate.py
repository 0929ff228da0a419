# Adapter of rule evaluate (rules/eval.smk) -> hy3rl.metrics.run_summary. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import metrics
from hy3rl.smk import rule_job

with rule_job(snakemake):
    inp = snakemake.input
    metrics.run_summary(metrics=[Path(p) for p in inp.metrics],
                        heldout=[Path(p) for p in inp.get("heldout", [])],
                        selected=Path(inp.selected) if inp.get("selected") else None,
                        out=Path(snakemake.output.summary))
