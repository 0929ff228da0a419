"""Install the repository's Snakemake profiles where `snakemake --profile <name>` finds them.

`snakemake --profile slurm` looks for a profile named `slurm` in the working directory,
then in Snakemake's user and site config directories (platformdirs: on Linux
`${XDG_CONFIG_HOME:-~/.config}/snakemake`, `/etc/xdg/snakemake`), never in `profiles/`.
`install` makes a symlink `<user config dir>/snakemake/<name> -> <repo>/profiles/<name>`,
so the literal `snakemake --profile slurm` works from the repository root, and edits to
`profiles/slurm` apply at once. It never replaces anything but an old symlink (`--force`).

    python -m hy3rl.profile install [--name slurm] [--force]
    python -m hy3rl.profile status  [--name slurm]
    python -m hy3rl.profile uninstall [--name slurm]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from platformdirs import user_config_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILES = REPO_ROOT / "profiles"


class ProfileError(RuntimeError):
    """The profile cannot be installed; the message names the path at fault."""


def config_dir() -> Path:
    """Snakemake's user config directory, computed exactly as Snakemake does."""
    return Path(user_config_dir("snakemake", "snakemake"))


def source(name: str) -> Path:
    src = PROFILES / name
    if not (src / "config.yaml").is_file():
        raise ProfileError(f"{src}/config.yaml: no such profile in this repository")
    return src


def status(name: str = "slurm") -> tuple[Path, str]:
    """The link path and one of: ``installed``, ``missing``, ``other`` (something else
    is there)."""
    link = config_dir() / name
    if link.is_symlink() and link.resolve() == source(name).resolve():
        return link, "installed"
    if link.is_symlink() or link.exists():
        return link, "other"
    return link, "missing"


def install(name: str = "slurm", force: bool = False) -> Path:
    """Symlink ``profiles/<name>`` into Snakemake's user config dir; idempotent."""
    src = source(name)
    link, state = status(name)
    if state == "installed":
        return link
    if state == "other":
        if not (force and link.is_symlink()):
            what = "a symlink to " + os.readlink(link) if link.is_symlink() else "a real path"
            raise ProfileError(
                f"{link} exists ({what}); not replacing it"
                + (" (use --force to replace an old symlink)" if link.is_symlink() else "")
            )
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{name}.hy3rl-tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(src.resolve(), target_is_directory=True)
    os.replace(tmp, link)
    return link


def uninstall(name: str = "slurm") -> bool:
    link, state = status(name)
    if state == "installed":
        link.unlink()
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("install", "status", "uninstall"))
    parser.add_argument("--name", default="slurm", help="profile under profiles/ (slurm)")
    parser.add_argument("--force", action="store_true", help="replace an old symlink")
    args = parser.parse_args(argv)
    try:
        if args.action == "install":
            link = install(args.name, args.force)
            print(f"{link} -> {os.readlink(link)}\nnow: snakemake --profile {args.name}")
        elif args.action == "status":
            link, state = status(args.name)
            print(f"{link}: {state}")
            return 0 if state == "installed" else 1
        else:
            link, _ = status(args.name)
            print(f"removed {link}" if uninstall(args.name) else f"{link}: not ours, left")
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
