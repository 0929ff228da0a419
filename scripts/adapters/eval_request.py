# Adapter of rule eval_request (rules/eval.smk) -> hy3rl.smk.write_keys. `snakemake` is
# Snakemake's object.
from hy3rl.smk import write_keys

write_keys(snakemake)
