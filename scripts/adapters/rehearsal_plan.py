# Adapter of rule rehearsal_plan (rules/rehearsal.smk) -> hy3rl.rehearsal.plan.
# `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import rehearsal
from hy3rl.layout import Layout
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    inp = snakemake.input
    rehearsal.plan(cfg, Layout.from_config(cfg), lock=Path(inp.lock),
                   data_summary=Path(inp.summary), train_files=Path(inp.train),
                   val_files=Path(inp.val), checkpoint_check=Path(inp.checkpoint_check),
                   bridge_check=Path(inp.bridge_check), main_plan=Path(inp.main_plan))
