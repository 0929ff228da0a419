# Adapter of rule eval_checkpoint (rules/eval.smk) -> hy3rl.evalckpt.wait. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import evalckpt
from hy3rl.layout import Layout
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    evalckpt.wait(Layout.from_config(cfg), Path(snakemake.input.plan),
                  int(snakemake.wildcards.step), Path(snakemake.output.ready),
                  cfg.eval.wait_poll_s, unproven_polls=cfg.eval.wait_unproven_polls)
