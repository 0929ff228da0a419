# Hy3 GRPO reproduction: deps -> data -> model -> check_checkpoint -> preflight -> train
# -> evaluate -> report. Run: snakemake --profile profiles/slurm   (README.md)
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

min_version("9.27")

sys.path.insert(0, f"{workflow.basedir}/scripts")
from hy3rl.config import ConfigError, validate  # noqa: E402


configfile: "config/config.yaml"


envvars:
    "PATH",


try:
    _resolved = validate(config)
except ConfigError as exc:
    raise WorkflowError(str(exc))
config.clear()
config.update(_resolved)


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/deps.smk"
include: "rules/data.smk"
include: "rules/model.smk"
include: "rules/checks.smk"
include: "rules/cluster.smk"
include: "rules/preflight.smk"
include: "rules/train.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        all_inputs(),
