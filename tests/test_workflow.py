"""The workflow as users run it, through the real Snakemake CLI.

- The README's first command on the embedded default, offline, with our stand-in
  repositories (tests/fixtures/deps.py) and the CPU path off: every stage but training
  (deps, data, tiny model, checkpoint checks, preflight, evaluation, report) runs for real
  on this CPU-only machine, also where no mirror of the pinned verl is at hand. With the
  pinned verl the whole default, training included, runs in tests/test_real_verl.py.
- The paper configuration with the SLURM profile, dry run: every stage is in the DAG and
  the training job asks for 16 nodes x 8 H20.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fixtures.common import REPO_ROOT, run_snakemake
from fixtures.data import aime_rows, dapo_rows, write_parquet
from fixtures.deps import make_upstreams

pytestmark = pytest.mark.slow


def _offline_override(tmp: Path) -> Path:
    ups = make_upstreams(tmp / "upstream")
    train = write_parquet(tmp / "src" / "dapo-math-17k.parquet", dapo_rows(40, repeats=3))
    val = write_parquet(tmp / "src" / "aime-2024.parquet", aime_rows(repeats=2),
                        pandas_index=True)
    override = {
        "deps": ups.section(tmp / "work" / "deps"),
        "data": {"train": {"source": str(train)}, "val": {"source": str(val)}},
        "train": {"cpu": {"enable": False}},  # the stand-in verl cannot train
    }
    path = tmp / "offline.yaml"
    path.write_text(yaml.safe_dump(override))
    return path


def test_default_pipeline_runs_end_to_end_offline(tmp_path: Path):
    override = _offline_override(tmp_path)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    args = ["--profile", str(REPO_ROOT / "profiles/local"), "--configfile",
            str(REPO_ROOT / "config/config.yaml"), str(override)]
    run_snakemake(args, work, timeout=1500)
    res = work / "results" / "tiny-default"
    for rel in ["deps/lock.json", "deps/runtime_env.yaml", "data/train.parquet",
                "data/val.parquet", "data/summary.json", "checks/checkpoint.json"]:
        assert (res / rel).is_file(), f"missing {rel}"
    lock = json.loads((res / "deps/lock.json").read_text())
    assert "verl" in json.dumps(lock)
    checks = json.loads((res / "checks/checkpoint.json").read_text())
    statuses = {c["name"]: c["status"] for c in checks["checks"]}
    assert "fail" not in statuses.values(), statuses
    # The GPU-free default: preflight plans but does not launch, base is evaluated for real,
    # and the report says training did not run.
    plan = json.loads((res / "preflight/plan.json").read_text())
    assert plan, "empty plan"
    metrics = json.loads((res / "eval/base/metrics.json").read_text())
    assert metrics["tag"] == "base"
    samples = (res / "eval/base/samples.jsonl").read_text().splitlines()
    assert len(samples) >= 30
    page = (res / "report/index.html").read_text()
    assert 'id="training-not-run"' in page
    # Nothing left to do: a second invocation is a no-op.
    again = run_snakemake([*args, "-n"], work)
    assert "Nothing to be done" in again.stdout + again.stderr

    # Issue 40, end to end: what verl would read is checked, not how the config spells it.
    # A nested mapping that moves the checkpoint directory is refused by preflight, naming
    # the key, the value verl would read and the key to set; nothing downstream runs.
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"train": {"verl_overrides": {
        "trainer": {"default_local_dir": "/elsewhere/ckpt"}}}}))
    refused = run_snakemake([*args, str(nested)], work, check=False)
    log = (res / "logs/preflight.log").read_text()
    assert refused.returncode != 0, refused.stdout[-3000:]
    assert ("owned_keys: trainer.default_local_dir: verl would read '/elsewhere/ckpt'"
            in log), log[-3000:]
    assert "train.checkpoint_root / run.name" in log
    # A file patched into the pinned verl clone after rule deps is refused too (rule
    # pins_clean), naming it.
    (work / "deps/verl/patch.py").write_text("print('not the pinned code')\n")
    dirty = run_snakemake([*args, "--forcerun", "preflight", "--",
                           "results/tiny-default/preflight/plan.json"], work, check=False)
    log = (res / "logs/preflight.log").read_text()
    assert dirty.returncode != 0 and "pins_clean: verl: " in log, log[-3000:]
    assert "?? patch.py" in log and "deps.allow_local_changes" in log


def test_paper_config_dry_run_with_slurm_profile(tmp_path: Path, tiny_hy3_dir: Path):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({
        # a local copy: clears the paper file's hub revision and download dir placeholders
        "model": {"source": str(tiny_hy3_dir), "revision": None, "dir": ""},
        "data": {"heldout": {"revision": "b" * 40}},  # the held-out set's pin (AIME-2025)
        "train": {"checkpoint_root": str(tmp_path / "ckpt"), "runtime": {
            "prefix": "apptainer exec --nv --bind /shared docker://verlai/verl:vllm023.dev1"}},
    }))
    # The site's partition and account (profiles/slurm ships CHANGE_ME_ placeholders).
    proc = run_snakemake(
        ["-n", "--profile", str(REPO_ROOT / "profiles/slurm"), "--profile",
         str(REPO_ROOT / "tests/slurm/profile"), "--configfile",
         str(REPO_ROOT / "config/config.yaml"), str(REPO_ROOT / "config/paper.yaml"), str(site)],
        tmp_path,
    )
    out = proc.stdout + proc.stderr
    for rule in ["deps", "data", "model", "check_checkpoint", "check_bridge", "preflight",
                 "rehearsal_model", "rehearsal_runtime", "rehearsal_plan", "rehearsal", "train",
                 "eval_checkpoint", "eval_generate", "eval_score", "eval_metrics", "eval_select",
                 "evaluate", "release_model", "release_page", "report"]:
        assert f"rule {rule}:" in out or f"localrule {rule}:" in out, f"{rule} not in DAG"
    assert "rule tiny_model:" not in out  # model.source is an existing checkpoint
    # Both checkpoint checks gate preflight (and so the 128-GPU job).
    preflight_inputs = out.split("rule preflight:", 1)[1].split("\n", 2)[1]
    assert preflight_inputs.strip().startswith("input:"), preflight_inputs
    for report in ("checks/checkpoint.json", "checks/bridge.json"):
        assert f"results/hy3-grpo-paper/{report}" in preflight_inputs, preflight_inputs
    # rehearsal.shape stage: the stage is built in a cluster job from the real model (its
    # manifest) and the run's plan (its pipeline size)
    stage_inputs = out.split("rule rehearsal_model:", 1)[1].split("\n", 2)[1]
    assert "results/hy3-grpo-paper/model/manifest.json" in stage_inputs, stage_inputs
    assert "results/hy3-grpo-paper/preflight/plan.json" in stage_inputs, stage_inputs
    # The training job waits for the rehearsal's record (the gate).
    train_inputs = out.split("rule train:", 1)[1].split("\n", 2)[1]
    assert "results/hy3-grpo-paper/rehearsal/rehearsal.json" in train_inputs, train_inputs
