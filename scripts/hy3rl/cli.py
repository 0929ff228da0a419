"""``hy3rl``: run one stage by hand, outside Snakemake, on the paths of the run's layout.

    hy3rl preflight --configfile config/config.yaml [--configfile site.yaml]
    hy3rl config --configfile config/paper.yaml      # print the resolved config
    hy3rl profile install                            # ~/.config/snakemake/slurm -> profiles/slurm

Each subcommand loads and validates the config files (merged in order, as Snakemake merges
``--configfile``), takes every input and output path from :class:`hy3rl.layout.Layout`, and
calls the stage's ``run(...)``, exactly what the rule's adapter (``scripts/adapters/``) does
with Snakemake's paths. Errors print their message and exit 1.
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


STAGES: dict[str, tuple[Stage, str]] = {
    "config": (_config, "validate the config files and print the resolved config"),
    "deps": (_deps, "clone and verify the pinned repositories (deps/lock.json)"),
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
        p.add_argument("--configfile", action="append", type=Path, default=None,
                       help="config file(s), merged in order (default: config/config.yaml)")
        p.add_argument("--tag", default="base", help="evaluation tag (evaluate, score, "
                       "metrics): base, step<N> or final")
    args = ap.parse_args(argv)
    try:
        cfg = Config.load(*(args.configfile or [Path("config/config.yaml")]))
    except ConfigError as exc:
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
