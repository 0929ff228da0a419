# Adapter of rule train_keys (rules/train.smk) -> hy3rl.smk.write_keys, then
# hy3rl.train.retire_sentinel: the job's sentinel no longer describes the configured
# training, so it is set aside and the job runs until it succeeds, in this invocation and,
# after a refusal, the next one. `snakemake` is Snakemake's object.
from pathlib import Path

from hy3rl import train
from hy3rl.layout import Layout
from hy3rl.settings import Config
from hy3rl.smk import write_keys

write_keys(snakemake)
layout, stretch = Layout.from_config(Config.from_dict(snakemake.config)), \
    snakemake.wildcards.stretch
train.retire_sentinel(Path(layout.train_done if stretch == "final"
                           else layout.segment_sentinel(stretch.removeprefix("step"))))
