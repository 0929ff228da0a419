# Stage rules for the cluster probe (SLURM issue).
