# Adapter of rule train (rules/train.smk) -> hy3rl.train.run. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import evalckpt, rehearsal, train
from hy3rl.layout import Layout
from hy3rl.smk import rule_job

with rule_job(snakemake) as cfg:
    inp, layout = snakemake.input, Layout.from_config(cfg)
    train.run(cfg.train, cfg.cluster, layout, keep_steps=evalckpt.protector(cfg, layout),
              plan=Path(inp.plan), launch_script=Path(inp.launch),
              runtime_env=Path(inp.runtime_env),
              rehearsed=rehearsal.passed_identity(inp.get("rehearsal")),
              sentinel=Path(snakemake.output.done),
              metrics=Path(snakemake.output.metrics))
    # no train_keys output while rule train_adopt writes the record (a forced rerun then)
    keys = snakemake.output.get("train_keys") or train.keys_record(layout, "final",
                                                                   snakemake.config)
    train.record_keys(layout, "final", Path(keys), snakemake.config)
