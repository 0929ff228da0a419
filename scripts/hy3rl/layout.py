"""Every path of a run, defined once (docs/formats/README.md lists them for users).

The rules (through ``rules/common.smk``), the stage code, the ``hy3rl`` CLI and the report
all take their paths from a :class:`Layout`; no module spells an output name itself.
Paths under ``results/<run>/`` are relative strings, as Snakemake matches them; the
checkpoint directory is absolute (it lives on shared storage and is never an output).
Methods taking a tag, step or attempt also accept a ``"{wildcard}"`` string, so rules use
them as patterns (``layout.eval_samples("{tag}")``). Standard library only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Evaluation tags: the base model, a training step's checkpoint, the final one.
TAG_PATTERN = r"(?:heldout/)?(?:base|final|step\d+)"
# A tag evaluated on the held-out set (data.heldout) is ``heldout/<tag>``: its files live
# under ``eval/heldout/<tag>/`` beside the test set's ``eval/<tag>/``.
HELDOUT_PREFIX = "heldout/"


def heldout_tag(tag: str) -> str:
    """The held-out twin of test-set tag ``tag`` (``step20`` -> ``heldout/step20``)."""
    return tag if tag.startswith(HELDOUT_PREFIX) else HELDOUT_PREFIX + tag


def split_tag(tag: str) -> tuple[str, bool]:
    """(model tag, on the held-out set): ``heldout/step20`` -> (``step20``, True)."""
    if tag.startswith(HELDOUT_PREFIX):
        return tag[len(HELDOUT_PREFIX):], True
    return tag, False

# The report's files, in the order of rules/report.smk: (name, report category).
REPORT_FILES: tuple[tuple[str, str], ...] = (
    ("index.html", "1. Report"),
    ("config.resolved.yaml", "5. Provenance"),
    ("fig_training_published.png", "2. Training"),
    ("fig_training_extra.png", "2. Training"),
    ("fig_step_time.png", "2. Training"),
    ("fig_eval_checkpoints.png", "4. Evaluation"),
    ("fig_eval_heatmap.png", "4. Evaluation"),
    ("fig_eval_curves.png", "4. Evaluation"),
    ("stages.csv", "1. Report"),
    ("attempts.csv", "2. Training"),
    ("claims.csv", "3. Claims"),
    ("eval_headline.csv", "4. Evaluation"),
    ("eval_per_problem.csv", "4. Evaluation"),
    ("eval_paired.csv", "4. Evaluation"),
    ("provenance.csv", "5. Provenance"),
)
REPORT_FIGURES = tuple(n for n, _ in REPORT_FILES if n.endswith(".png"))
REPORT_TABLES = tuple(n for n, _ in REPORT_FILES if n.endswith(".csv"))

ATTEMPT_RE = re.compile(r"^attempt-(\d+)\.json$")
ATTEMPT_METRICS_RE = re.compile(r"^attempt-(\d+)\.metrics\.jsonl$")


def report_key(name: str) -> str:
    """The rule output name of a report file: ``fig_step_time.png`` -> ``fig_step_time``,
    ``index.html`` -> ``html``, ``config.resolved.yaml`` -> ``config``."""
    return {"index.html": "html", "config.resolved.yaml": "config"}.get(name, name.split(".")[0])


@dataclass(frozen=True)
class Layout:
    """The paths of one run: ``<results_root>/<run>/...`` plus the checkpoint directory."""

    results_root: str
    run: str
    checkpoint_root: str = ""
    checkpoint_name: str = ""  # the checkpoint directory's name, when not ``run``
    release_root: str = ""  # release.dir: where the released model directories live

    @classmethod
    def from_config(cls, cfg: Any) -> Layout:
        """From a :class:`hy3rl.settings.Config` or the validated config mapping."""
        if isinstance(cfg, dict):
            return cls(cfg["run"]["results_root"], cfg["run"]["name"],
                       cfg["train"]["checkpoint_root"],
                       release_root=cfg.get("release", {}).get("dir", ""))
        return cls(cfg.run.results_root, cfg.run.name, cfg.train.checkpoint_root,
                   release_root=cfg.release.dir)

    @classmethod
    def of_results(cls, results: str | Path, checkpoint_root: str = "") -> Layout:
        """The layout whose run directory is ``results`` (``<results_root>/<run>``)."""
        p = Path(results)
        return cls(str(p.parent), p.name, checkpoint_root)

    # ---- the run directory and logs
    @property
    def results(self) -> str:
        return f"{self.results_root}/{self.run}"

    def _p(self, rel: str) -> str:
        return f"{self.results}/{rel}"

    def log(self, name: str) -> str:
        """``logs/<name>.log`` (name may contain a sub-directory: ``eval/base.score``)."""
        return self._p(f"logs/{name}.log")

    # ---- deps
    @property
    def deps_lock(self) -> str:
        return self._p("deps/lock.json")

    @property
    def deps_runtime_env(self) -> str:
        return self._p("deps/runtime_env.yaml")

    # ---- data
    @property
    def data_train(self) -> str:
        return self._p("data/train.parquet")

    @property
    def data_val(self) -> str:
        return self._p("data/val.parquet")

    @property
    def data_heldout(self) -> str:
        """``data/heldout.parquet``: data.heldout, when configured."""
        return self._p("data/heldout.parquet")

    @property
    def data_summary(self) -> str:
        return self._p("data/summary.json")

    # ---- model
    @property
    def model_manifest(self) -> str:
        """Rule ``model``'s output: the checkpoint's files, sizes and hashes, and where it
        came from (docs/formats/model.md)."""
        return self._p("model/manifest.json")

    # ---- checks and cluster
    @property
    def checks_checkpoint(self) -> str:
        return self._p("checks/checkpoint.json")

    @property
    def checks_bridge(self) -> str:
        return self._p("checks/bridge.json")

    @property
    def cluster_probe(self) -> str:
        return self._p("cluster/probe.json")

    # ---- preflight
    @property
    def preflight_dir(self) -> str:
        return self._p("preflight")

    @property
    def preflight_plan(self) -> str:
        return self._p("preflight/plan.json")

    @property
    def preflight_launch(self) -> str:
        return self._p("preflight/launch.sh")

    @property
    def preflight_refused(self) -> str:
        """``preflight/plan.refused.json``: the plan of a preflight whose rules refused the
        launch (written instead of plan.json and launch.sh, which a refusal never touches;
        removed by the next passing preflight)."""
        return self._p("preflight/plan.refused.json")

    def preflight_reward_fn(self, sha256: str) -> str:
        """``preflight/reward/<sha256>.py``: the copy of ``train.reward_function.path`` the
        launch points at, named by its content (only when set; written by a passing
        preflight; not a rule output). An older copy stays: a running launch reads its own."""
        return self._p(f"preflight/reward/{sha256}.py")

    # ---- train
    @property
    def train_dir(self) -> str:
        return self._p("train")

    @property
    def train_done(self) -> str:
        return self._p("train/done.json")

    @property
    def train_state(self) -> str:
        """``train/state.json``: written by the controller when it stops resubmitting a
        training job (hy3rl.resubmit); evaluation waits read it."""
        return self._p("train/state.json")

    @property
    def train_metrics(self) -> str:
        return self._p("train/metrics.jsonl")

    @property
    def train_attempts(self) -> str:
        return self._p("train/attempts")

    def attempt_record(self, k: int | str) -> str:
        return f"{self.train_attempts}/attempt-{k}.json"

    def attempt_metrics(self, k: int | str) -> str:
        return f"{self.train_attempts}/attempt-{k}.metrics.jsonl"

    def attempt_logs(self, k: int | str) -> str:
        """The folder of an attempt's launcher, driver and per-node logs."""
        return f"{self.train_attempts}/attempt-{k}"

    def attempt_node_logs(self, k: int | str, node: str) -> str:
        """A node's Ray logs (raylet, gcs, workers), copied before its temp dir is removed."""
        return f"{self.attempt_logs(k)}/nodes/{node}"

    def attempt_diagnostics(self, k: int | str) -> str:
        """What the watchdog collected before tearing down a hung attempt (per node)."""
        return f"{self.attempt_logs(k)}/hang"

    @property
    def train_job_exit(self) -> str:
        """Written by each training job as it ends: whether a resubmission may help, and the
        nodes to exclude (read by the controller before it resubmits; hy3rl.resubmit)."""
        return f"{self.train_attempts}/job-exit.json"

    @property
    def train_submissions(self) -> str:
        """One line per resubmission decision of the controller (hy3rl.resubmit)."""
        return f"{self.train_attempts}/submissions.jsonl"

    @property
    def train_notified(self) -> str:
        """The attempts train.notify_command was already run for (hy3rl.notify)."""
        return f"{self.train_attempts}/notified.json"

    @property
    def content_sha_cache(self) -> str:
        """The sha256 of the local files the training keys count by content, by path + size
        + mtime + inode (hy3rl.identity.content_stats; written while the DAG is built, not a
        rule output)."""
        return self._p("train/content_sha256_cache.json")

    @property
    def runtime_id_cache(self) -> str:
        """The sha256 of a local runtime image (.sif), by path + size + mtime
        (hy3rl.runtime_id; not a rule output)."""
        return self._p("train/runtime_id_cache.json")

    @property
    def train_plan(self) -> str:
        """``train/launch/plan.json``: the copy of preflight's plan a training job reads
        (rule train_launch, written only after preflight succeeded)."""
        return self._p("train/launch/plan.json")

    @property
    def train_launch(self) -> str:
        """``train/launch/launch.sh``: the copy of preflight's launch a training job runs."""
        return self._p("train/launch/launch.sh")

    def train_keys(self, stretch: str, digest: str) -> str:
        """``train/keys/<stretch>.<digest>.json`` (``final`` or ``step<N>`` of a segment):
        the training keys job ``stretch`` trained under, named by their digest
        (hy3rl.train.keys_digest, record_keys): an output of that job and a target of
        ``all``, so new keys (a missing record) run the job and restored ones run nothing."""
        return self._p(f"train/keys/{stretch}.{digest}.json")

    def train_keys_legacy(self, stretch: str) -> str:
        """``train/keys/<stretch>.json``: the keys file the older rule train_keys wrote
        before each training job (its values, one ``key=value`` a line; read by
        hy3rl.train.adoption, never written now)."""
        return self._p(f"train/keys/{stretch}.json")

    def stretch_sentinel(self, stretch: str) -> str:
        """The sentinel of training job ``stretch``: done.json for ``final``, else the
        segment's (``step<N>``)."""
        return self.train_done if stretch == "final" else self.segment_sentinel(
            stretch.removeprefix("step"))

    def segment_sentinel(self, end: int | str) -> str:
        return self._p(f"train/segments/step{end}.json")

    @property
    def checkpoint_dir(self) -> Path:
        """``<train.checkpoint_root>/<run>``, absolute; an empty root means
        ``<results_root>/<run>/checkpoints`` under the current directory. The one place
        this is computed: preflight renders it as verl's ``trainer.default_local_dir``,
        train locks and resumes from it, evaluation reads checkpoints from it."""
        root = self.checkpoint_root
        name = self.checkpoint_name or self.run
        path = Path(root) / name if root else Path(self.results) / "checkpoints"
        return Path(os.path.abspath(path))

    def checkpoint_hf_model(self, step: int) -> Path:
        """The HF weights verl saves with a checkpoint (docs/formats/train.md): Megatron's
        ``actor/model/huggingface``, or, for a checkpoint in the FSDP layout (the CPU path,
        hy3rl.ckptdir.is_fsdp), ``actor/huggingface``."""
        from hy3rl.ckptdir import is_fsdp

        step_dir = self.checkpoint_dir / f"global_step_{step}"
        if is_fsdp(step_dir):
            return step_dir / "actor" / "huggingface"
        return step_dir / "actor" / "model" / "huggingface"

    def checkpoint_data_state(self, step: int) -> Path:
        """verl's train dataloader state at a save (``torch.save`` of the StatefulDataLoader's
        ``state_dict()``, verl/trainer/ppo/ray_trainer.py)."""
        return self.checkpoint_dir / f"global_step_{step}" / "data.pt"

    def checkpoint_optimizer_common(self, step: int) -> Path:
        """The non-sharded part of the actor's optimizer checkpoint: Megatron's
        dist_checkpointing writes it as ``common.pt`` (``torch.save``), the LR scheduler's
        ``state_dict()`` (``num_steps``) among it."""
        return (self.checkpoint_dir / f"global_step_{step}" / "actor" / "optimizer" / "dist_ckpt"
                / "common.pt")

    # ---- rehearsal
    # The one-node rehearsal (rules/rehearsal.smk) lives under ``rehearsal/``, itself laid
    # out as a run (:meth:`rehearsal_layout`).
    @property
    def rehearsal_model(self) -> str:
        """``rehearsal/model``: the small Hy3 the rehearsal trains (rule rehearsal_model)."""
        return self._p("rehearsal/model")

    @property
    def rehearsal_checks(self) -> str:
        """``rehearsal/checks.json``: every check of the last rehearsal, passed or not (not
        a rule output: a failed rehearsal keeps it)."""
        return self._p("rehearsal/checks.json")

    @property
    def rehearsal_runtime(self) -> str:
        """``rehearsal/runtime.json``: the training runtime as the DAG sees it (rule
        rehearsal_runtime); its change re-runs the rehearsal."""
        return self._p("rehearsal/runtime.json")

    @property
    def rehearsal_record(self) -> str:
        """``rehearsal/rehearsal.json``: rule rehearsal's output, written only when every
        check passed; the train jobs' input (the gate)."""
        return self._p("rehearsal/rehearsal.json")

    def rehearsal_layout(self) -> Layout:
        """The rehearsal's own run layout: its preflight, train and eval files under
        ``rehearsal/``, its checkpoints in ``<train.checkpoint_root>/<run>-rehearsal``."""
        return Layout(self.results, "rehearsal", self.checkpoint_root,
                      f"{self.run}-rehearsal" if self.checkpoint_root else "")

    # ---- eval
    @property
    def eval_dir(self) -> str:
        return self._p("eval")

    def eval_request(self, tag: str, digest: str) -> str:
        """``eval/<tag>/request.<digest>.json``: what the tag is asked to evaluate (rule
        eval_request), named by the digest of its values
        (hy3rl.identity.eval_request_digest): an input of its generation, so new values (a
        missing request) evaluate again and restored ones (their request still in place)
        evaluate nothing. The generation removes its tag's other requests
        (hy3rl.evalckpt.keep_only_request)."""
        return self._p(f"eval/{tag}/request.{digest}.json")

    def eval_samples(self, tag: str) -> str:
        return self._p(f"eval/{tag}/samples.jsonl")

    def eval_samples_meta(self, tag: str) -> str:
        return self._p(f"eval/{tag}/samples.meta.json")

    def eval_scores(self, tag: str) -> str:
        return self._p(f"eval/{tag}/scores.jsonl")

    def eval_scores_meta(self, tag: str) -> str:
        return self._p(f"eval/{tag}/scores.meta.json")

    def eval_metrics(self, tag: str) -> str:
        return self._p(f"eval/{tag}/metrics.json")

    def eval_ray_dir(self, tag: str) -> str:
        """vLLM on several nodes: the Ray job's files and hy3rl.launch's logs (not an output)."""
        return self._p(f"eval/{tag}/ray")

    @property
    def eval_summary(self) -> str:
        return self._p("eval/summary.json")

    def eval_problems(self, tag: str) -> str:
        """The problems tag ``tag`` is evaluated on: data/heldout.parquet for
        ``heldout/<tag>``, else data/val.parquet (the test set)."""
        return self.data_heldout if split_tag(tag)[1] else self.data_val

    def eval_ready(self, tag: str) -> str:
        """``eval/<step tag>/checkpoint.json``: the step's checkpoint is complete and made by
        this run's configuration (rule eval_checkpoint); an input of its generations."""
        return self._p(f"eval/{tag}/checkpoint.json")

    @property
    def eval_selected(self) -> str:
        """``eval/selected.json``: the checkpoint eval.select picks (rule eval_select)."""
        return self._p("eval/selected.json")

    # ---- release
    def release_checks(self, tag: str) -> str:
        """``release/<tag>/checks.json``: every check of the last release of ``tag``
        (``selected`` or ``final``), passed or not (not a rule output: a refusal keeps it)."""
        return self._p(f"release/{tag}/checks.json")

    def release_record(self, tag: str) -> str:
        """``release/<tag>/release.json``: rule release_model's output, written last and only
        when every check passed: the release's directory, files and their sha256."""
        return self._p(f"release/{tag}/release.json")

    def release_model(self, tag: str) -> Path:
        """The released HF model directory of ``tag``: ``<release.dir>/<run>/<tag>``,
        absolute; an empty ``release.dir`` means ``<results_root>/<run>/release/<tag>/model``
        under the current directory. Never a rule output (a rerun must not delete it); it is
        written under a temporary name beside it and renamed last."""
        root = self.release_root
        path = (Path(root) / self.run / tag if root
                else Path(self.results) / "release" / tag / "model")
        return Path(os.path.abspath(path))

    # ---- report
    @property
    def report_dir(self) -> str:
        return self._p("report")

    def report_file(self, name: str) -> str:
        if name not in dict(REPORT_FILES):
            raise KeyError(f"{name!r} is not a report file ({', '.join(dict(REPORT_FILES))})")
        return f"{self.report_dir}/{name}"

    @property
    def report_html(self) -> str:
        return self.report_file("index.html")

    @property
    def releases_page(self) -> str:
        """``report/releases.html``: rule release_page's output (GPU runs), beside the
        report's files but not one of them (the report does not wait for the releases)."""
        return f"{self.report_dir}/releases.html"


# The embedded default's model.source: rule tiny_model builds it here (outside results/,
# shared by runs); any other local model.source is an existing checkpoint used in place.
TINY_MODEL_DIR = "resources/tiny-hy3"
