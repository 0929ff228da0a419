"""``hy3rl``: run one stage by hand, outside Snakemake, on the paths of the run's layout.

    hy3rl preflight --configfile config/config.yaml [--configfile site.yaml]
    hy3rl config --configfile config/config.yaml config/paper.yaml   # the resolved config
    hy3rl rewind --step 40 --configfile ...          # go on from step 40, a new lineage
    hy3rl profile install                            # ~/.config/snakemake/slurm -> profiles/slurm

Each subcommand loads and validates the config files (merged in order, as Snakemake merges
``--configfile``), takes every input and output path from :class:`hy3rl.layout.Layout`, and
calls the stage's ``run(...)``, exactly what the rule's adapter (``scripts/adapters/``) does
with Snakemake's paths. A stage's error prints its message and exits 1; an invalid config
exits 2, naming every key at fault.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from hy3rl.config import ConfigError
from hy3rl.errors import StageError
from hy3rl.layout import Layout
from hy3rl.settings import Config
from hy3rl.smk import setup_logging

Stage = Callable[[Config, Layout, argparse.Namespace], None]


# One function a stage: the stage's run(...) with the layout's paths. Keep each to a call.
def _config(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    yaml.safe_dump(cfg.raw, sys.stdout, sort_keys=False)


def _deps(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import deps

    deps.run(cfg.deps, lock=Path(layout.deps_lock), runtime_env=Path(layout.deps_runtime_env))


def _data(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import data

    data.run(cfg.data, tokenizer=cfg.model.path, train=Path(layout.data_train),
             val=Path(layout.data_val), summary=Path(layout.data_summary),
             heldout=Path(layout.data_heldout) if cfg.data.heldout else None)


def _tiny_model(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import model
    from hy3rl.layout import TINY_MODEL_DIR

    model.run(cfg.model.tiny, out=Path(TINY_MODEL_DIR))


def _model(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import hub

    hub.run(cfg.model.source, cfg.model.revision, cfg.model.dir,
            manifest=Path(layout.model_manifest), threads=args.threads,
            hash_local=cfg.checks.checkpoint.sha256)


def _check_checkpoint(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import checkpoint

    checkpoint.run(cfg.checks.checkpoint, model=Path(cfg.model.path),
                   manifest=Path(layout.model_manifest), lock=Path(layout.deps_lock),
                   out=Path(layout.checks_checkpoint), threads=cfg.checks.checkpoint.threads)


def _check_bridge(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import bridge

    bridge.run(cfg.checks.bridge, cfg.model, cfg.train.runtime, lock=Path(layout.deps_lock),
               out=Path(layout.checks_bridge))


def _preflight(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import preflight

    preflight.run(cfg, lock=Path(layout.deps_lock), data_summary=Path(layout.data_summary),
                  train_files=Path(layout.data_train), val_files=Path(layout.data_val),
                  checkpoint_check=Path(layout.checks_checkpoint),
                  bridge_check=Path(layout.checks_bridge) if cfg.cluster.gpu else None,
                  plan=Path(layout.preflight_plan), launch=Path(layout.preflight_launch),
                  refused=Path(layout.preflight_refused), reward_fn=layout.preflight_reward_fn,
                  heldout=Path(layout.data_heldout) if cfg.data.heldout else None)


def _cluster_probe(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import cluster

    cluster.run(cfg.cluster, out=Path(layout.cluster_probe))


def _rehearsal_plan(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import rehearsal

    rehearsal.plan(cfg, layout, lock=Path(layout.deps_lock),
                   data_summary=Path(layout.data_summary), train_files=Path(layout.data_train),
                   val_files=Path(layout.data_val),
                   checkpoint_check=Path(layout.checks_checkpoint),
                   bridge_check=Path(layout.checks_bridge),
                   main_plan=Path(layout.preflight_plan))


def _rehearsal(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import rehearsal

    rehearsal.run(cfg, layout, runtime_env=Path(layout.deps_runtime_env),
                  val=Path(layout.data_val), out=Path(layout.rehearsal_record))


def _train(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import evalckpt, rehearsal, train

    train.run(cfg.train, cfg.cluster, layout, keep_steps=evalckpt.protector(cfg, layout),
              plan=Path(layout.preflight_plan), launch_script=Path(layout.preflight_launch),
              runtime_env=Path(layout.deps_runtime_env), sentinel=Path(layout.train_done),
              metrics=Path(layout.train_metrics),
              rehearsed=rehearsal.passed_identity(rehearsal.gate(cfg, layout)))


def _rewind(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import ckptdir, train

    if args.step is None:
        raise ckptdir.CheckpointDirError("hy3rl rewind needs --step N (the last healthy "
                                         "checkpoint the health guard named)")
    ckptdir.rewind(layout.checkpoint_dir, args.step,
                   attempt=(train.attempt_numbers(layout) or [0])[-1] + 1)
    if Path(layout.train_attempts).is_dir():  # train/metrics.jsonl: the new lineage's steps
        train.write_merged(Path(layout.train_attempts), Path(layout.train_metrics),
                           ckptdir.lineage_first_attempt(layout.checkpoint_dir),
                           ckptdir.lineage_cuts(layout.checkpoint_dir))


def _evaluate(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import evaluate

    t = args.tag
    evaluate.run(cfg.eval, tag=t, model=evaluate.model_for_tag(cfg, t, layout.train_done),
                 val=Path(layout.eval_problems(t)), samples=Path(layout.eval_samples(t)),
                 meta=Path(layout.eval_samples_meta(t)),
                 runtime_env=Path(layout.deps_runtime_env), ray_dir=Path(layout.eval_ray_dir(t)),
                 cpus_per_node=cfg.cluster.cpus_per_node, runtime=cfg.train.runtime,
                 ray=cfg.train.ray)


def _score(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import graders

    t = args.tag
    graders.run(cfg.eval.graders, samples=Path(layout.eval_samples(t)),
                val=Path(layout.eval_problems(t)), lock=Path(layout.deps_lock),
                out=Path(layout.eval_scores(t)), meta=Path(layout.eval_scores_meta(t)))


def _metrics(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import metrics
    from hy3rl.layout import heldout_tag, split_tag

    t = args.tag
    metrics.run(cfg.eval.bootstrap, tag=t, scores=Path(layout.eval_scores(t)),
                scores_meta=Path(layout.eval_scores_meta(t)), out=Path(layout.eval_metrics(t)),
                samples_meta=Path(layout.eval_samples_meta(t)),
                base_scores=None if split_tag(t)[0] == "base"
                else Path(layout.eval_scores(heldout_tag("base") if split_tag(t)[1] else "base")))


def _report(cfg: Config, layout: Layout, args: argparse.Namespace) -> None:
    from hy3rl import report
    from hy3rl.layout import REPORT_FILES

    out = getattr(args, "out", None)
    report.run(cfg, results=layout,
               outputs={n: Path(out) / n if out else Path(layout.report_file(n))
                        for n, _ in REPORT_FILES})


STAGES: dict[str, tuple[Stage, str]] = {
    "config": (_config, "validate the config files and print the resolved config"),
    "deps": (_deps, "clone and verify the pinned repositories (deps/lock.json)"),
    "data": (_data, "build the train/val parquet and data/summary.json"),
    "tiny_model": (_tiny_model, "build the tiny random Hy3 checkpoint (resources/tiny-hy3)"),
    "model": (_model, "download model.source at model.revision into model.dir (hub), or "
              "describe a local model.source; write model/manifest.json"),
    "check_checkpoint": (_check_checkpoint, "check the model checkpoint on CPU "
                         "(checks/checkpoint.json)"),
    "check_bridge": (_check_bridge, "HF -> Megatron -> HF round trip in the training runtime "
                     "on this GPU node (checks/bridge.json)"),
    "preflight": (_preflight, "resolve, compose and check the verl launch on CPU "
                  "(preflight/plan.json, launch.sh)"),
    "cluster_probe": (_cluster_probe, "inside a SLURM job of the training shape: what every "
                      "node sees (cluster/probe.json)"),
    "rehearsal_plan": (_rehearsal_plan, "preflight on the rehearsal's config: the run's plan "
                       "scaled to one node (rehearsal/preflight/plan.json)"),
    "rehearsal": (_rehearsal, "on one GPU node: two steps, a kill, a resume, a generation, "
                  "then the checks (rehearsal/checks.json, rehearsal.json)"),
    "train": (_train, "train on this job's nodes (or this machine), resuming from the "
              "checkpoints (train/done.json)"),
    "rewind": (_rewind, "go on from the complete checkpoint --step N in a new lineage: the "
               "checkpoints after it move aside (after the health guard stopped a run)"),
    "evaluate": (_evaluate, "generate one tag's samples (eval/<tag>/samples.jsonl; --tag)"),
    "score": (_score, "grade one tag's samples with both graders (eval/<tag>/scores.jsonl)"),
    "metrics": (_metrics, "one tag's metrics (eval/<tag>/metrics.json; --tag)"),
    "report": (_report, "render whatever the run produced into report/index.html "
               "(+ figures, tables)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:
        from hy3rl import profile

        return profile.main(argv[1:])
    ap = argparse.ArgumentParser(prog="hy3rl", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    for name, (_, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--configfile", action="extend", nargs="+", type=Path, default=None,
                       help="config file(s), merged in order (default: config/config.yaml)")
        p.add_argument("--tag", default="base", help="evaluation tag (evaluate, score, "
                       "metrics): base, step<N> or final")
        if name == "report":
            p.add_argument("--out", type=Path, default=None, help="write the report files "
                           "there instead of results/<run>/report/: a report of a run still "
                           "going, which leaves the run's own outputs untouched")
        if name == "rewind":
            p.add_argument("--step", type=int, default=None, help="the checkpoint step to go "
                           "on from (the last healthy checkpoint the guard named)")
        if name == "model":
            p.add_argument("--threads", type=int, default=8, help="files transferred or "
                           "hashed in parallel (default 8, as the rule)")
    args = ap.parse_args(argv)
    try:
        cfg = Config.load(*(args.configfile or [Path("config/config.yaml")]))
    except (ConfigError, OSError) as exc:
        print(f"hy3rl: {exc}", file=sys.stderr)
        return 2
    if args.stage != "config":
        setup_logging()
    try:
        STAGES[args.stage][0](cfg, Layout.from_config(cfg), args)
    except StageError as exc:
        print(f"hy3rl {args.stage}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
