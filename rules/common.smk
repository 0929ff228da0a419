# Input functions, paths and wildcard constraints shared by every stage (style: stage
# files hold rules only).
import json
import os
import sys

# Jobs (local or SLURM) find this interpreter's console scripts first.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

RUN = config["run"]["name"]
RESULTS = f"{config['run']['results_root']}/{RUN}"
LOGS = f"{RESULTS}/logs"
PY = "python -m"  # every rule calls one stage module's CLI: {PY} hy3rl.<stage> ...


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
