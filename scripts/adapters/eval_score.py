# Adapter of rule eval_score (rules/eval.smk) -> hy3rl.graders.run. `snakemake` is
# Snakemake's object.
from pathlib import Path

from hy3rl import graders
from hy3rl.smk import rule_job

# The guard: the grader pool's workers are spawned, and spawn re-runs this file (as
# `__mp_main__`, without Snakemake's `snakemake` object) in every worker.
if __name__ == "__main__":
    with rule_job(snakemake) as cfg:
        graders.run(cfg.eval.graders, samples=Path(snakemake.input.samples),
                    val=Path(snakemake.input.val), lock=Path(snakemake.input.lock),
                    out=Path(snakemake.output.scores), meta=Path(snakemake.output.meta))
