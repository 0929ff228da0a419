# Hy3 GRPO reproduction: deps -> data -> model -> check_checkpoint -> preflight -> train
# -> evaluate -> report (+ release). Run: snakemake --profile profiles/slurm   (README.md)
# The stage code is the installed package `hy3rl` (./install.sh); nothing here edits
# sys.path, PATH or PYTHONPATH, and nothing queries the cluster while the DAG is built.
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

from hy3rl.config import ConfigError, refuse_placeholders
from hy3rl.settings import Config

min_version("9.27")


configfile: "config/config.yaml"


try:
    CFG = Config.from_dict(config)
    refuse_placeholders(CFG.raw, workflow.resource_settings.default_resources)
except ConfigError as exc:
    raise WorkflowError(str(exc))
config.clear()
config.update(CFG.raw)


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/deps.smk"
include: "rules/data.smk"
include: "rules/model.smk"
include: "rules/checks.smk"
include: "rules/cluster.smk"
include: "rules/preflight.smk"
include: "rules/rehearsal.smk"
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/release.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        all_inputs(),
