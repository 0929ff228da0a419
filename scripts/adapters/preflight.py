# Adapter of rule preflight (rules/preflight.smk) -> hy3rl.preflight.run.
# `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import preflight
from hy3rl.layout import Layout
from hy3rl.smk import rule_job

# checks/bridge.json: an input only with cluster.gpu (common.smk bridge_check_input)
bridge = snakemake.input.get("bridge_check", None) or []
bridge = [bridge] if isinstance(bridge, str) else list(bridge)

with rule_job(snakemake) as cfg:
    layout = Layout.from_config(cfg)
    preflight.run(cfg, lock=Path(snakemake.input.lock),
                  data_summary=Path(snakemake.input.summary),
                  train_files=Path(snakemake.input.train), val_files=Path(snakemake.input.val),
                  checkpoint_check=Path(snakemake.input.checkpoint_check),
                  bridge_check=Path(bridge[0]) if bridge else None,
                  plan=Path(snakemake.output.plan), launch=Path(snakemake.output.launch),
                  refused=Path(layout.preflight_refused), reward_fn=layout.preflight_reward_fn,
                  model_manifest=Path(snakemake.input.model_manifest),
                  heldout=Path(snakemake.input.heldout) if snakemake.input.get("heldout")
                  else None)
