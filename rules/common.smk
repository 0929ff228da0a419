# Input functions, paths and wildcard constraints shared by every stage (style: stage
# files hold rules only).
import json
import os
import sys

# Jobs (local or SLURM) find this interpreter (the workflow's venv) first on PATH.
_BIN = os.path.dirname(sys.executable)
os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

RUN = config["run"]["name"]
RESULTS = f"{config['run']['results_root']}/{RUN}"
LOGS = f"{RESULTS}/logs"
# Each stage is one module of scripts/hy3rl with a CLI: python -m hy3rl.<stage> ...


wildcard_constraints:
    tag=r"base|final|step\d+",


def section_json(*sections):
    """The config sections a rule depends on, as canonical JSON (a rule param, so that
    changing one of them, and nothing else, re-runs the rule)."""
    return json.dumps({s: config[s] for s in sections}, sort_keys=True)


def gpu_enabled():
    return bool(config["cluster"]["gpu"])


def all_inputs():
    """Targets of `rule all`, by stage; the GPU stages only when cluster.gpu is true."""
    targets = [
        f"{RESULTS}/deps/lock.json",
        f"{RESULTS}/deps/runtime_env.yaml",
        f"{RESULTS}/data/summary.json",
    ]
    for extra in STAGE_TARGETS:
        targets.extend(extra())
    return targets


# Stage files register a function returning their `all` targets here.
STAGE_TARGETS = []
PY = "python -m"  # deprecated alias; rules call python -m hy3rl.<stage> directly
