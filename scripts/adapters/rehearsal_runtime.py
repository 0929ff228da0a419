# Adapter of rule rehearsal_runtime (rules/rehearsal.smk) -> hy3rl.smk.write_keys: the
# runtime fingerprint the rehearsal re-runs on. `snakemake` is Snakemake's object.
from hy3rl.smk import write_keys

write_keys(snakemake)
