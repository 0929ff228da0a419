"""Stage `deps`: clone verl, Megatron-Bridge and TransferQueue at exact commits.

Each repository is cloned into ``<deps.dir>/<name>`` at its pinned full 40-hex SHA (short
SHAs, tags and branch names are refused: they move or are ambiguous), fetching only that
commit (``git fetch --depth 1 <url> <sha>``; a full fetch of branches and tags if the server
refuses requests for a bare SHA), checked out detached and verified (``HEAD == pin``).

A clone already at its pin with a clean tree is left alone (no fetch, no network), so a
second run is a no-op that works offline. A clean clone at another commit is moved to the
pin (fetching only when the commit is not there yet). A clone with local changes is never
touched: the run stops and says which files changed. A ``fcntl`` lock on the deps
directory serialises concurrent runs.

Outputs: ``lock.json`` (what was pinned and verified, per repository) and a Ray
``runtime_env.yaml`` for ``ray job submit`` (working dir = the verl clone, ``.git`` and
caches excluded, ``PYTHONPATH`` with Megatron-Bridge's ``src`` and the TransferQueue clone),
built on the pinned verl's own ``verl/trainer/runtime_env.yaml``. Formats:
docs/formats/deps.md.

Entry point: :func:`run` (rule ``deps`` through ``scripts/adapters/deps.py``; by hand,
``hy3rl deps --configfile ...``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hy3rl.atomic import write_json_atomic, write_text_atomic
from hy3rl.errors import StageError
from hy3rl.pins import sha_problem
from hy3rl.settings import Deps, Repos
from hy3rl.timefmt import utc_now

log = logging.getLogger("hy3rl.deps")

SCHEMA_VERSION = 1
REPO_NAMES = tuple(f.name for f in dataclasses.fields(Repos))
LOCK_FILE = ".hy3rl-deps.lock"

# Paths each clone is expected to hold at its pin (name, path, why). A missing one is a
# warning in the log and in lock.json, not an error: a user may pin a fork on purpose.
EXPECTED_PATHS: dict[str, list[tuple[str, str, str]]] = {
    "verl": [
        ("hy3_script", "examples/grpo_trainer/run_hy_v3_megatron.sh",
         "the published Hy3 GRPO recipe (its overrides drive preflight and train)"),
        ("trainer_config", "verl/trainer/config",
         "Hydra config of verl.trainer.main_ppo (preflight composes it)"),
        ("runtime_env", "verl/trainer/runtime_env.yaml",
         "verl's Ray runtime env, the base of runtime_env.yaml"),
    ],
    "megatron_bridge": [
        ("src", "src", "goes on PYTHONPATH"),
        ("hy_v3_bridge", "src/megatron/bridge/models/hy_v3/hy_v3_bridge.py",
         "HYV3Bridge, the Hy3 HF<->Megatron mapping"),
    ],
    "transfer_queue": [
        ("package", "transfer_queue/__init__.py",
         "the `transfer_queue` package imported by verl (clone root goes on PYTHONPATH)"),
    ],
}

# Excluded from the working_dir upload (gitignore-style patterns relative to working_dir);
# Ray also honours the clone's own .gitignore.
RUNTIME_ENV_EXCLUDES = [".git", "__pycache__", "*.pyc"]
# Set by the Hy3 script itself (`export CUDA_DEVICE_MAX_CONNECTIONS=1`); the script's
# exports reach only the driver, the runtime env carries them to every Ray worker.
HY3_SCRIPT_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


class DepsError(StageError):
    """A pin, a clone or a fetch is wrong; the message names the repository and key."""


@dataclass(frozen=True)
class RepoPin:
    name: str
    url: str
    commit: str

    @property
    def key(self) -> str:
        return f"deps.repos.{self.name}"


@dataclass
class PathCheck:
    name: str
    path: str
    present: bool
    why: str


@dataclass
class RepoLock:
    name: str
    url: str
    commit: str  # the pin from the config
    head: str  # `git rev-parse HEAD` of the clone after checkout (== commit)
    path: str  # absolute path of the clone
    action: str  # cloned | unchanged | checked_out
    fetched: bool  # whether this run fetched anything from url
    fetch_mode: str | None  # shallow-sha | full | None (nothing fetched)
    shallow: bool
    verified_at: str
    submodules: list[dict[str, str]] = field(default_factory=list)
    checks: list[PathCheck] = field(default_factory=list)


@dataclass
class Lock:
    schema_version: int
    created: str
    git_version: str
    host: str
    deps_dir: str
    repos: dict[str, RepoLock]
    runtime_env: dict[str, Any]
    warnings: list[str]


# --------------------------------------------------------------------------- pins


def pins_of(deps: Deps) -> list[RepoPin]:
    """The pins of ``deps.repos``, each re-checked before it reaches git's command line.

    The schema has refused bad pins already (a full lowercase 40-hex SHA); this defensive
    check covers a section built by hand, and says why a short SHA or a ref is refused."""
    pins = [RepoPin(name, repo.url, repo.commit) for name, repo in deps.repos.items()]
    errors = [f"{pin.key}.commit: {problem}" for pin in pins
              if (problem := commit_problem(pin.commit))]
    if errors:
        raise DepsError("invalid deps configuration:\n  " + "\n  ".join(errors))
    return pins


def commit_problem(commit: str) -> str | None:
    """Why ``commit`` is not an acceptable pin, or None when it is a full 40-hex SHA."""
    return sha_problem(commit, what="commit SHA", lowercase_as="`git rev-parse`",
                       full_from="`git ls-remote <url> <ref>` or `git rev-parse <short>` in a "
                                 "clone prints it")


# --------------------------------------------------------------------------- git


def _git_env() -> dict[str, str]:
    # Never prompt for credentials (a batch job would hang); English messages in errors.
    return {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "LANG": "C"}


def git(*args: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["git", *args]
    log.debug("+ %s (in %s)", " ".join(cmd), cwd)
    proc = subprocess.run(cmd, cwd=cwd, env=_git_env(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise DepsError(f"`{' '.join(cmd)}` failed in {cwd} ({proc.returncode}):\n"
                        f"{proc.stderr.strip()}")
    return proc


def git_version() -> str:
    try:
        return git("--version").stdout.strip()
    except FileNotFoundError as exc:
        raise DepsError("git is not installed (needed to clone the pinned repositories)") from exc


def has_commit(repo: Path, sha: str) -> bool:
    return git("cat-file", "-e", f"{sha}^{{commit}}", cwd=repo, check=False).returncode == 0


def head_of(repo: Path) -> str | None:
    proc = git("rev-parse", "--verify", "-q", "HEAD", cwd=repo, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def local_changes(repo: Path) -> list[str]:
    """Modified, staged, deleted and untracked (not ignored) paths of a clone."""
    out = git("status", "--porcelain=v1", "--untracked-files=normal", cwd=repo).stdout
    return [line for line in out.splitlines() if line.strip()]


DIFF_SHOWN_BYTES = 200_000  # of a clone's diff, kept in the plan for the report


def tree_state(repo: Path) -> dict[str, Any]:
    """What a pinned clone runs, against its HEAD: ``head``; ``changes``, the porcelain lines
    of every modified, staged, deleted and untracked (not ignored) path; ``diff_sha256``, the
    sha256 of the binary diff against HEAD and of each untracked file's path and bytes (None
    when clean); ``diff``, that diff as text (untracked files listed; at most
    :data:`DIFF_SHOWN_BYTES`, cut with a note). The Ray job uploads the clone as its
    working directory: this is the code that would run."""
    import hashlib

    changes = local_changes(repo)
    state: dict[str, Any] = {"head": head_of(repo), "changes": changes, "diff_sha256": None,
                             "diff": ""}
    if not changes:
        return state
    digest = hashlib.sha256()
    diff = subprocess.run(["git", "diff", "--binary", "HEAD"], cwd=repo, env=_git_env(),
                          capture_output=True, check=True).stdout
    digest.update(diff)
    untracked = [p for p in git("ls-files", "--others", "--exclude-standard", "-z",
                                cwd=repo).stdout.split("\0") if p]
    for rel in sorted(untracked):
        path = repo / rel
        digest.update(b"\0untracked\0" + rel.encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() and not path.is_symlink()
                      else os.readlink(path).encode() if path.is_symlink() else b"")
    text = diff.decode(errors="replace") + "".join(f"untracked: {rel}\n" for rel in untracked)
    if len(text) > DIFF_SHOWN_BYTES:
        text = text[:DIFF_SHOWN_BYTES] + f"\n... (cut at {DIFF_SHOWN_BYTES} bytes)\n"
    state.update(diff_sha256=digest.hexdigest(), diff=text)
    return state


def is_clone_root(path: Path) -> bool:
    proc = git("rev-parse", "--show-toplevel", cwd=path, check=False)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == path.resolve()


def fetch_commit(repo: Path, pin: RepoPin) -> str:
    """Fetch ``pin.commit`` from ``pin.url`` into ``repo``; return the mode that worked.

    First only that commit, shallow (servers that allow requests for reachable SHAs, which
    includes GitHub and any local path or mirror with protocol v2). If that is refused, all
    branches and tags (unshallowing a shallow clone, else an older pin stays out of reach).
    """
    git("remote", "remove", "origin", cwd=repo, check=False)
    git("remote", "add", "origin", pin.url, cwd=repo)
    shallow = git("fetch", "--depth", "1", "--no-tags", "origin", pin.commit, cwd=repo,
                  check=False)
    if shallow.returncode == 0 and has_commit(repo, pin.commit):
        return "shallow-sha"
    log.info("%s: shallow fetch of %s refused (%s); fetching all branches and tags",
             pin.name, pin.commit, _last_line(shallow.stderr))
    args = ["fetch", "--no-tags", "origin", "+refs/heads/*:refs/remotes/origin/*",
            "+refs/tags/*:refs/tags/*"]
    if git("rev-parse", "--is-shallow-repository", cwd=repo).stdout.strip() == "true":
        args.insert(1, "--unshallow")
    full = git(*args, cwd=repo, check=False)
    if full.returncode != 0:
        raise DepsError(
            f"{pin.key}: cannot fetch from {pin.url!r} (repo {pin.name}, commit {pin.commit}):\n"
            f"  shallow fetch: {_last_line(shallow.stderr)}\n"
            f"  full fetch:    {_last_line(full.stderr)}\n"
            "  check the URL, the network or the mirror path (deps.repos.*.url)"
        )
    if not has_commit(repo, pin.commit):
        kind = git("cat-file", "-t", pin.commit, cwd=repo, check=False).stdout.strip()
        what = f"is a {kind}, not a commit" if kind else "is not in any branch or tag there"
        raise DepsError(
            f"{pin.key}.commit: commit {pin.commit} {what} at {pin.url!r} (repo {pin.name}): "
            "mistyped, or force-pushed away upstream? Check it with "
            f"`git ls-remote {pin.url}` or pin a commit that exists"
        )
    return "full"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def checkout(repo: Path, pin: RepoPin) -> str:
    git("-c", "advice.detachedHead=false", "checkout", "-q", "--detach", pin.commit, cwd=repo)
    head = head_of(repo)
    if head != pin.commit:
        raise DepsError(f"{pin.key}: after checkout HEAD of {repo} is {head}, not the pin "
                        f"{pin.commit}")
    return head


def submodules(repo: Path) -> list[dict[str, str]]:
    """Submodules recorded at HEAD (path and commit). They are not fetched."""
    out = git("ls-files", "-s", cwd=repo).stdout
    subs = []
    for line in out.splitlines():
        meta, _, path = line.partition("\t")
        mode, sha, *_ = meta.split()
        if mode == "160000":
            subs.append({"path": path, "commit": sha})
    return subs


def ensure_clone(pin: RepoPin, dest: Path) -> RepoLock:
    """Make ``dest`` a clean clone of ``pin.url`` with ``HEAD == pin.commit``."""
    dest = dest.absolute()
    if dest.exists() and dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()  # an empty directory (e.g. made by hand) counts as absent
    fetched_mode: str | None = None
    if not dest.exists():
        action = "cloned"
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            git("init", "-q", cwd=tmp)
            fetched_mode = fetch_commit(tmp, pin)
            checkout(tmp, pin)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    else:
        if not dest.is_dir() or not is_clone_root(dest):
            raise DepsError(f"{pin.key}: {dest} exists but is not a git clone; move it away "
                            "(or set deps.dir elsewhere) and rerun")
        changes = local_changes(dest)
        if changes:
            shown = "\n    ".join(changes[:20]) + ("\n    ..." if len(changes) > 20 else "")
            raise DepsError(
                f"{pin.key}: the clone {dest} has local changes; refusing to touch it (and a "
                f"run from it would not be the pinned code):\n    {shown}\n"
                "  commit or save them elsewhere, then `git -C <clone> checkout -- . && git "
                "clean -fd` or delete the clone, and rerun"
            )
        if head_of(dest) == pin.commit:
            action = "unchanged"
        else:
            action = "checked_out"
            if not has_commit(dest, pin.commit):
                fetched_mode = fetch_commit(dest, pin)
            checkout(dest, pin)
    head = head_of(dest)
    if head != pin.commit:  # belt and braces: never record an unverified HEAD
        raise DepsError(f"{pin.key}: HEAD of {dest} is {head}, not the pin {pin.commit}")
    checks = [PathCheck(n, p, (dest / p).exists(), why) for n, p, why in EXPECTED_PATHS[pin.name]]
    shallow = git("rev-parse", "--is-shallow-repository", cwd=dest).stdout.strip() == "true"
    return RepoLock(
        name=pin.name, url=pin.url, commit=pin.commit, head=head, path=str(dest),
        action=action, fetched=fetched_mode is not None, fetch_mode=fetched_mode,
        shallow=shallow, verified_at=utc_now(), submodules=submodules(dest), checks=checks,
    )


# --------------------------------------------------------------------------- locking


@contextlib.contextmanager
def dir_lock(deps_dir: Path) -> Iterator[None]:
    """Exclusive fcntl lock on ``<deps_dir>/.hy3rl-deps.lock`` for the whole update."""
    deps_dir.mkdir(parents=True, exist_ok=True)
    path = deps_dir / LOCK_FILE
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            log.warning("waiting for the lock %s held by %s", path, holder)
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {utc_now()}\n")
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fh.flush()
            fcntl.flock(fh, fcntl.LOCK_UN)


def remove_stale_tmp(deps_dir: Path) -> None:
    """Temporary clones left by a killed run (only ours: `.<name>.tmp-*`; call under lock)."""
    for name in REPO_NAMES:
        for tmp in deps_dir.glob(f".{name}.tmp-*"):
            log.info("removing the unfinished clone %s of an interrupted run", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- outputs


def build_runtime_env(repos: Mapping[str, RepoLock]) -> tuple[dict[str, Any], str | None]:
    """The Ray runtime env for ``ray job submit --runtime-env``; also where its base came from.

    Base: the pinned verl's ``verl/trainer/runtime_env.yaml`` (what verl's multinode docs
    pass to ``ray job submit``). Then: working_dir = the verl clone (absolute), excludes
    extended, PYTHONPATH = Megatron-Bridge ``src`` + the TransferQueue clone (Ray itself puts
    working_dir first and appends the cluster's PYTHONPATH), and the Hy3 script's export.
    """
    verl = Path(repos["verl"].path)
    base_file = verl / "verl/trainer/runtime_env.yaml"
    env: dict[str, Any] = {}
    source = None
    if base_file.is_file():
        loaded = yaml.safe_load(base_file.read_text()) or {}
        if not isinstance(loaded, dict):
            raise DepsError(f"{base_file}: expected a mapping (Ray runtime env)")
        env = loaded
        source = str(base_file)
    excludes = list(env.get("excludes") or [])
    for pattern in RUNTIME_ENV_EXCLUDES:
        if pattern not in excludes:
            excludes.append(pattern)
    env_vars = {str(k): str(v) for k, v in (env.get("env_vars") or {}).items()}
    env_vars.update(HY3_SCRIPT_ENV)
    env_vars["PYTHONPATH"] = os.pathsep.join(
        [str(Path(repos["megatron_bridge"].path) / "src"), repos["transfer_queue"].path]
    )
    env["working_dir"] = str(verl)
    env["excludes"] = excludes
    env["env_vars"] = env_vars
    return env, source


def run(deps: Deps, *, lock: Path, runtime_env: Path) -> Lock:
    """Bring every clone of ``deps.repos`` to its pin under ``deps.dir``, then write
    ``lock`` (lock.json) and ``runtime_env`` (runtime_env.yaml); returns the lock."""
    pins = pins_of(deps)
    deps_dir = Path(deps.dir).absolute()
    version = git_version()
    repos: dict[str, RepoLock] = {}
    warnings: list[str] = []
    with dir_lock(deps_dir):
        remove_stale_tmp(deps_dir)
        for pin in pins:
            rl = ensure_clone(pin, deps_dir / pin.name)
            log.info("%s: %s at %s (%s)", pin.name, rl.action, rl.head, rl.path)
            for check in rl.checks:
                if not check.present:
                    msg = (f"{pin.name}@{pin.commit[:12]}: {check.path} is missing ({check.why})")
                    log.warning(msg)
                    warnings.append(msg)
            repos[pin.name] = rl
        env, source = build_runtime_env(repos)
        if source is None:
            msg = ("verl: verl/trainer/runtime_env.yaml is missing; runtime_env.yaml holds only "
                   "working_dir, excludes, PYTHONPATH and the Hy3 script's env")
            log.warning(msg)
            warnings.append(msg)
        record = Lock(
            schema_version=SCHEMA_VERSION, created=utc_now(), git_version=version,
            host=socket.gethostname(), deps_dir=str(deps_dir), repos=repos,
            runtime_env={"path": str(Path(runtime_env).absolute()), "base": source},
            warnings=warnings,
        )
        header = ("# Ray runtime env for `ray job submit --runtime-env` (written by hy3rl.deps;\n"
                  f"# base: {source or 'none'}). Format: docs/formats/deps.md\n")
        write_text_atomic(Path(runtime_env), header + yaml.safe_dump(env, sort_keys=False))
        write_json_atomic(Path(lock), asdict(record))
    return record
