# Adapter of rule eval_select (rules/eval.smk) -> hy3rl.selection.run. `snakemake` is
# Snakemake's object.
import json
from pathlib import Path

from hy3rl import selection
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    inp = snakemake.input
    rule = json.loads(Path(inp.plan).read_text()).get("selection")
    selection.run_rule(cfg, rule, heldout=[Path(p) for p in inp.heldout],
                       test=[Path(p) for p in inp.test], out=Path(snakemake.output.selected))
