"""Stage `model`: the checkpoint at a pinned hub revision (or a local directory), and its
manifest; and :func:`verify`, the manifest check that ``check_checkpoint`` runs.

``model.source`` is a hub repository id or a local directory:

- **Hub.** ``model.revision`` must be a full 40-hex commit SHA (a branch, tag or short SHA
  is refused: they move or are ambiguous). The revision's file list, with each file's size
  and the hub's own hash (sha256 of LFS files, git blob id of small files), comes from
  ``HfApi.model_info(files_metadata=True)``. The free disk at ``model.dir`` is checked
  against the bytes still to fetch before any download. Files are then fetched in
  parallel into ``model.dir``, each one hashed as it arrives and compared with the hub's
  hash before it is moved into place. A file interrupted mid-way (connection lost, job
  killed) is kept as ``.cache/hy3rl/partial/<path>.<hash>.part`` and continued with an
  HTTP Range request, in the same run or the next one: nothing is fetched twice.
  Finished files carry a marker (``.cache/hy3rl/done/<path>.json``), so a rerun fetches
  nothing that is already there; a file found without a marker (a copy made by hand) is
  hashed and adopted when it matches.
- **Local directory.** The manifest is written from the files themselves (size and
  sha256 of every file, hashed in parallel); the directory is used in place.

Why not ``snapshot_download``: in huggingface_hub 1.33 it downloads each file to a
process-unique ``*.incomplete`` file and deletes it when the download fails
(huggingface_hub PR #4228), so a rerun after an interruption starts every unfinished file
over, and a killed job leaves those files behind. This module uses huggingface_hub's own
building blocks instead (``model_info``, ``hf_hub_url``, ``get_session``,
``build_hf_headers``, ``hf_raise_for_status``): same endpoints, headers, token handling,
proxies and offline switch; plain HTTP (with Range) rather than Xet transfers.

``HF_ENDPOINT`` picks a mirror and ``HF_HUB_OFFLINE`` forbids the network, as
huggingface_hub documents them (this module reads both when :func:`run` is called, so a
value set after import counts too). ``HF_TOKEN`` (``token_env``) is sent when set and is
never written to the manifest, the markers or any message.

Output: the manifest (``results/<run>/model/manifest.json``; format in :class:`Manifest`
and docs/formats/model.md). Entry point: :func:`run`; check: :func:`verify`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from hy3rl.atomic import write_json_atomic
from hy3rl.errors import StageError
from hy3rl.layout import TINY_MODEL_DIR
from hy3rl.pins import sha_problem
from hy3rl.redact import Redactor
from hy3rl.timefmt import utc_now

log = logging.getLogger("hy3rl.hub")

SCHEMA_VERSION = 1
HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Under model.dir: our partial files, completion markers and lock (never in the manifest).
CACHE_DIR = ".cache/hy3rl"
# Top-level names of a model directory that are not part of the checkpoint (Snakemake
# marks a directory() output such as rule tiny_model's with .snakemake_timestamp).
IGNORED_TOP = frozenset({".cache", ".git", ".snakemake_timestamp"})
HASH_CHUNK = 4 << 20
# In-run retries of one file after a lost connection or a 5xx/429 answer (each resumes with
# a Range request); the count restarts whenever bytes arrive.
RETRIES = 5
RETRY_BACKOFF_S = 1.0


class HubError(StageError):
    """The `model` stage stopped; the message names the config key at fault."""


class RevisionError(HubError):
    """``model.revision`` is not a full commit SHA."""


class OfflineError(HubError):
    """The hub cannot be reached (offline mode, or the endpoint does not answer)."""


class DiskSpaceError(HubError):
    """Too little free disk at ``model.dir`` for what is still to download."""


class ManifestError(HubError):
    """A manifest file is missing or malformed."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class FileEntry:
    """One file of the checkpoint: its path (relative, ``/``-separated), size and hash:
    ``sha256`` (hub LFS files, and every file of a local source) or ``git_blob`` (the git
    blob id the hub gives for small files: sha1 of ``"blob <size>\\0"`` + content)."""

    path: str
    size: int
    sha256: str | None = None
    git_blob: str | None = None
    # A local source described cheaply (checks.checkpoint.sha256 false): the modification
    # time in ns instead of a hash; a changed file still changes it.
    mtime_ns: int | None = None

    @property
    def kind(self) -> str:
        return "sha256" if self.sha256 else "git_blob" if self.git_blob else "mtime_ns"

    @property
    def digest(self) -> str:
        return self.sha256 or self.git_blob or ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "size": self.size}
        out[self.kind] = self.mtime_ns if self.kind == "mtime_ns" else self.digest
        return out


@dataclass(frozen=True)
class Source:
    """Where the checkpoint came from. ``kind`` "hub": ``repo_id``, the revision asked for
    and the commit the hub resolved it to, and the endpoint; ``kind`` "local": ``path``."""

    kind: str
    repo_id: str | None = None
    requested_revision: str | None = None
    resolved_revision: str | None = None
    endpoint: str | None = None
    path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: what the checkpoint directory ``dir`` must hold.

    ``{"schema_version": 1, "source": {...}, "dir": "/abs/model/dir", "created": "<UTC>",
    "file_count": N, "total_size": BYTES, "files": [{"path", "size", "sha256" | "git_blob"}]}``
    (files sorted by path)."""

    source: Source
    dir: str
    created: str
    files: list[FileEntry] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "source": self.source.to_dict(),
                "dir": self.dir, "created": self.created, "file_count": len(self.files),
                "total_size": self.total_size, "files": [f.to_dict() for f in self.files]}

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> Manifest:
        try:
            if doc["schema_version"] != SCHEMA_VERSION:
                raise ValueError(f"schema_version {doc['schema_version']!r}, expected "
                                 f"{SCHEMA_VERSION}")
            files = []
            for n, f in enumerate(doc["files"]):
                mtime = f.get("mtime_ns")
                entry = FileEntry(str(f["path"]), int(f["size"]), f.get("sha256"),
                                  f.get("git_blob"), None if mtime is None else int(mtime))
                if sum(map(bool, (entry.sha256, entry.git_blob, mtime is not None))) != 1:
                    raise ValueError(f"files[{n}] ({entry.path}): needs exactly one of "
                                     "sha256, git_blob, mtime_ns")
                files.append(entry)
            src = doc["source"]
            source = Source(**{k: src.get(k) for k in Source.__dataclass_fields__})
            return cls(source, str(doc["dir"]), str(doc["created"]), files)
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where}: not a model manifest ({type(exc).__name__}: "
                                f"{exc})") from None


def read_manifest(path: str | Path) -> Manifest:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read the model manifest ({exc})") from None
    return Manifest.from_dict(doc, str(path))


def provenance(path: str | Path) -> dict[str, str]:
    """The report's provenance rows for the checkpoint: source, revision, manifest hash."""
    m = read_manifest(path)
    src = m.source
    where = src.repo_id if src.kind == "hub" else src.path
    return {"model.source": f"{src.kind}: {where}",
            "model.revision": src.resolved_revision or "(local directory)",
            "model.manifest_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
            "model.files": f"{len(m.files)} files, {m.total_size} bytes"}


# --------------------------------------------------------------------------- hashing


def _hasher(kind: str, size: int) -> Any:
    if kind == "sha256":
        return hashlib.sha256()
    if kind == "git_blob":
        return hashlib.sha1(b"blob %d\0" % size)
    raise ValueError(f"unknown hash kind {kind!r}")


def file_digest(path: Path, kind: str, advance: Callable[[int], None] | None = None) -> str:
    """``kind`` ("sha256" or "git_blob") of ``path``, reading it once, sequentially."""
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        h = _hasher(kind, os.fstat(fh.fileno()).st_size)
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := fh.readinto(buf):
            h.update(view[:n])
            if advance:
                advance(n)
    return h.hexdigest()


@contextlib.contextmanager
def _progress(enabled: bool, desc: str, total: int, completed: int = 0
              ) -> Iterator[Callable[[int], None]]:
    """A rich byte progress bar on stderr; yields a thread-safe ``advance(n)``."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), disable=not enabled) as bar:
        task = bar.add_task(desc, total=total, completed=completed)
        yield lambda n: bar.advance(task, n)


def hash_files(jobs: Iterable[tuple[Path, str]], threads: int, *, progress: bool = True,
               desc: str = "hashing") -> dict[Path, str]:
    """Digest of every ``(path, kind)``, ``threads`` files at a time (largest first), each
    file read once; a progress bar over all bytes."""
    todo = sorted(jobs, key=lambda j: j[0].stat().st_size, reverse=True)
    if not todo:
        return {}
    total = sum(p.stat().st_size for p, _ in todo)
    out: dict[Path, str] = {}
    with _progress(progress, f"{desc} {len(todo)} files", total) as advance, \
            ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
        futures = {pool.submit(file_digest, p, kind, advance): p for p, kind in todo}
        for fut, p in futures.items():
            out[p] = fut.result()
    return out


# --------------------------------------------------------------------------- verify


def list_files(root: Path) -> list[str]:
    """Every regular file under ``root`` (symlinks to files followed), as sorted relative
    ``/`` paths, leaving out the top-level names of ``IGNORED_TOP``."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        top = rel == Path(".")
        if top:
            dirnames[:] = [d for d in dirnames if d not in IGNORED_TOP]
        dirnames.sort()
        for name in filenames:
            if not (top and name in IGNORED_TOP) and (Path(dirpath) / name).is_file():
                out.append((rel / name).as_posix())
    return sorted(out)


def local_file_stats(root: str | Path) -> dict[str, str]:
    """Rule model's params for a local ``model.source``: one per file of ``root``
    (:func:`list_files`), ``"<path>: <size> bytes, mtime_ns <mtime>"``, keyed by a name made
    from the path. A stat of each file, nothing read: cheap enough to run every time the DAG
    is built, and free of side effects. A file replaced, rewritten, added or removed in
    place changes a value, so Snakemake re-runs rule model (the manifest, and with it the
    run identity, follow the directory) and its reason names each such file with its size
    and mtime before and now. A file ``root`` gives its own entry (a local data source file in
    the training keys: hy3rl.identity.content_stats); empty when ``root`` is neither (rule
    model names it)."""
    root = Path(root).expanduser()
    if root.is_file():
        root, names = root.parent, [root.name]
    elif root.is_dir():
        names = list_files(root)
    else:
        return {}
    out = {}
    for rel in names:
        st = (root / rel).stat()
        key = "file_" + hashlib.sha1(rel.encode(), usedforsecurity=False).hexdigest()[:16]
        out[key] = f"{rel}: {st.st_size} bytes, mtime_ns {st.st_mtime_ns}"
    return out


def verify(manifest_path: str | Path, model_dir: str | Path, *, sha256: bool, threads: int,
           progress: bool = True, hash_up_to: int | None = None) -> list[str]:
    """Problems of ``model_dir`` against the manifest (empty: it matches).

    Sizes are always compared, and files missing or not in the manifest reported. With
    ``sha256``, every file whose size matches (of at most ``hash_up_to`` bytes, when given)
    is hashed (``threads`` in parallel, each read once) and compared: sha256 entries by
    sha256, git-blob entries by their git blob id. A mismatch names the file and both
    hashes."""
    m = read_manifest(manifest_path)
    root = Path(model_dir)
    if not root.is_dir():
        return [f"{root}: the model directory does not exist (manifest {manifest_path})"]
    problems: list[str] = []
    to_hash: list[FileEntry] = []
    for e in m.files:
        p = root / e.path
        if not p.is_file():
            problems.append(f"{e.path}: missing from {root} (the manifest lists {e.size} "
                            "bytes)")
            continue
        st = p.stat()
        if st.st_size != e.size:
            problems.append(f"{e.path}: size {st.st_size} bytes != manifest {e.size}")
        elif e.mtime_ns is not None:
            if st.st_mtime_ns != e.mtime_ns:
                problems.append(f"{e.path}: modified after the manifest was written (mtime "
                                f"{st.st_mtime_ns} != {e.mtime_ns} ns): rerun rule model")
        elif sha256 and (hash_up_to is None or e.size <= hash_up_to):
            to_hash.append(e)
    listed = {e.path for e in m.files}
    problems += [f"{rel}: in {root} but not in the manifest {manifest_path}"
                 for rel in list_files(root) if rel not in listed]
    got = hash_files([(root / e.path, e.kind) for e in to_hash], threads, progress=progress,
                     desc="verifying")
    for e in to_hash:
        digest = got[root / e.path]
        if digest != e.digest:
            problems.append(f"{e.path}: {e.kind} {digest} (on disk) != {e.digest} (manifest)")
    return problems


# The files hashed while the DAG is built: the config, the tokenizer, the chat template,
# the generation config (a weight shard is far larger).
SMALL_FILE_BYTES = 32 << 20


def in_place_problems(manifest_path: str | Path, model_dir: str | Path, repo_id: str,
                      revision: str | None) -> list[str]:
    """A hub checkpoint's directory against its manifest, cheap enough for every DAG build:
    every file's size, and the small files (at most :data:`SMALL_FILE_BYTES`: config,
    tokenizer, chat template, generation config) by the hub's hash. A hub model's identity
    is ``repo@commit``, so a file edited in place (the chat template in
    ``tokenizer_config.json``) would change what every start reads under the same identity.
    Empty when it matches, when there is no manifest or directory yet, or when the manifest
    is of another ``repo_id``/``revision`` (rule model runs again)."""
    path, root = Path(manifest_path), Path(model_dir)
    if not path.is_file() or not root.is_dir():
        return []
    src = read_manifest(path).source
    if src.kind != "hub" or (src.repo_id, src.requested_revision) != (repo_id, revision):
        return []
    return verify(path, root, sha256=True, threads=2, progress=False,
                  hash_up_to=SMALL_FILE_BYTES)


# --------------------------------------------------------------------------- run


def is_local_source(source: str) -> bool:
    """A path (absolute, ``./``, ``../``, ``~``, an existing directory, or the embedded
    default's tiny model directory, which rule ``tiny_model`` may not have built yet), not
    a repo id. ``hy3rl.settings.Model.path`` and the rules decide with this too."""
    s = source.strip()
    return (s == TINY_MODEL_DIR or s.startswith(("/", "./", "../", "~"))
            or Path(s).expanduser().is_dir())


def revision_problem(revision: str | None) -> str | None:
    """Why ``revision`` is not an acceptable pin, or None when it is a full 40-hex SHA."""
    return sha_problem(revision, what="commit SHA of the hub repository",
                       lowercase_as="the hub",
                       full_from="the repository's commit history on the hub shows it")


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` as set now, else huggingface_hub's endpoint."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or constants.ENDPOINT


def hub_offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(
        (v or "").strip().upper() in {"1", "ON", "YES", "TRUE"} for v in flags)


def run(source: str, revision: str | None, dest: str | Path, *, manifest: str | Path,
        token_env: str = "HF_TOKEN", threads: int = 4, progress: bool = True,
        hash_local: bool = True) -> Manifest:
    """Fetch (hub) or describe (local directory) the checkpoint; write ``manifest``
    atomically; return it. See the module doc. ``hash_local`` (``checks.checkpoint.sha256``):
    a local directory's files are hashed; else each is described by its size and
    modification time, the cheap identity of a local directory (seconds for 598 GB instead
    of minutes to hours), which a changed file still changes."""
    if is_local_source(source):
        return _run_local(Path(source).expanduser(), Path(manifest), threads, progress,
                          hash_local)
    token = os.environ.get(token_env) or None
    # Removes the token; keeps the commit and git blob ids (40-hex, allowed once known).
    redactor = Redactor([token] if token else [], [revision or ""])
    with redacted_logs(redactor):
        return _Download(source, revision, Path(dest), Path(manifest), token, threads,
                         progress, redactor).run()


class _RedactFilter(logging.Filter):
    def __init__(self, redactor: Redactor):
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.redactor.text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


@contextlib.contextmanager
def redacted_logs(redactor: Redactor) -> Iterator[None]:
    """While a transfer runs (this module's download, hy3rl.release's upload), every record
    reaching the root logger's handlers loses the token, whichever library logs it
    (httpcore's DEBUG records carry response headers)."""
    if not redactor.secrets:
        yield
        return
    filt = _RedactFilter(redactor)
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(filt)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(filt)


def _run_local(src: Path, manifest: Path, threads: int, progress: bool,
               hash_local: bool = True) -> Manifest:
    if not src.is_dir():
        raise HubError(f"model.source: {str(src)!r} is not a directory (a local source must "
                       "be an existing checkpoint directory; anything else is read as a hub "
                       "repository id such as 'org/name')")
    root = src.resolve()
    rels = list_files(root)
    if not rels:
        raise HubError(f"model.source: the local directory {root} holds no files")
    if hash_local:
        log.info("model.source is the local directory %s: hashing its %d files (used in "
                 "place)", root, len(rels))
        digests = hash_files([(root / r, "sha256") for r in rels], threads, progress=progress,
                             desc="sha256 of")
        files = [FileEntry(r, (root / r).stat().st_size, sha256=digests[root / r])
                 for r in rels]
    else:
        log.info("model.source is the local directory %s: its %d files by size and "
                 "modification time (checks.checkpoint.sha256 is false; used in place)",
                 root, len(rels))
        stats = {r: (root / r).stat() for r in rels}
        files = [FileEntry(r, stats[r].st_size, mtime_ns=stats[r].st_mtime_ns) for r in rels]
    m = Manifest(Source("local", path=str(root)), str(root), utc_now(), files)
    write_json_atomic(manifest, m.to_dict())
    log.info("wrote %s: %d files, %s", manifest, len(files), human(m.total_size))
    return m


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _safe_rel(path: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] in IGNORED_TOP:
        raise HubError(f"model.source: the hub lists an unsafe file path {path!r}; refusing")
    return p.as_posix()


def _disk_free(path: Path) -> int:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return shutil.disk_usage("/").free


class _HashingFile:
    """The partial file being downloaded: appends, hashes and reports progress as it
    writes; ``rewind`` (when a server ignores Range) restarts it."""

    def __init__(self, path: Path, kind: str, size: int, advance: Callable[[int], None]):
        self.kind, self.size, self.advance = kind, size, advance
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a+b", buffering=0)  # closed by close()
        have = os.fstat(self.fh.fileno()).st_size
        if have > size:
            self.fh.truncate(0)
            have = 0
        self.h = _hasher(kind, size)
        self.pos = 0
        self.fh.seek(0)
        while chunk := self.fh.read(HASH_CHUNK):  # the prefix kept by an earlier attempt
            self.h.update(chunk)
            self.pos += len(chunk)

    def write(self, data: bytes) -> None:
        if self.pos + len(data) > self.size:
            raise HubError(f"the server sent more than the {self.size} bytes the hub lists")
        view = memoryview(data)
        while view:  # a raw (unbuffered) write may take less than it is given
            view = view[self.fh.write(view):]
        self.h.update(data)
        self.pos += len(data)
        self.advance(len(data))

    def rewind(self) -> None:
        self.fh.truncate(0)
        self.advance(-self.pos)
        self.h = _hasher(self.kind, self.size)
        self.pos = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.fsync(self.fh.fileno())
        self.fh.close()


@dataclass
class _Download:
    repo_id: str
    revision: str | None
    dest: Path
    manifest: Path
    token: str | None
    threads: int
    progress: bool
    redact: Redactor

    def __post_init__(self) -> None:
        self.stop = threading.Event()  # set on Ctrl-C: running transfers end at their next chunk
        self.endpoint = hub_endpoint()
        self.dest = Path(os.path.abspath(self.dest.expanduser()))
        self.cache = self.dest / CACHE_DIR

    # ---- the revision
    def _where(self) -> str:
        return f"model.source {self.repo_id!r} at model.revision {self.revision!r}"

    def _offline(self, reason: str) -> OfflineError:
        return OfflineError(
            f"{self._where()}: cannot reach the hub ({self.redact.text(reason)}). Run the "
            f"`model` rule where {self.endpoint} is reachable (HF_ENDPOINT selects a mirror; "
            "unset HF_HUB_OFFLINE), or set model.source to a local directory that already "
            "holds the checkpoint (an absolute path): the rule then writes the manifest from "
            "the files themselves.")

    def list_revision(self) -> tuple[str, list[FileEntry]]:
        import httpx
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        if hub_offline():
            raise self._offline("HF_HUB_OFFLINE is set")
        api = HfApi(endpoint=self.endpoint, token=self.token)
        try:
            info = api.model_info(self.repo_id, revision=self.revision, files_metadata=True)
        except OfflineModeIsEnabled as exc:
            raise self._offline(f"offline mode: {exc}") from None
        except (httpx.TransportError, ConnectionError) as exc:
            raise self._offline(f"{type(exc).__name__}: {exc}") from None
        except RevisionNotFoundError:
            raise HubError(f"model.revision: {self.revision} is not a commit of "
                           f"{self.repo_id} on {self.endpoint}") from None
        except GatedRepoError as exc:
            raise HubError(f"model.source: {self.repo_id} is gated: accept its terms on the "
                           "hub and set HF_TOKEN to a token of that account "
                           f"({self.redact.text(str(exc).splitlines()[0])})") from None
        except RepositoryNotFoundError:
            raise HubError(f"model.source: repository {self.repo_id!r} not found on "
                           f"{self.endpoint} (or private: set HF_TOKEN)") from None
        except HfHubHTTPError as exc:
            raise HubError(f"{self._where()}: the hub refused the file list: "
                           f"{self.redact.text(str(exc))}") from None
        if info.sha != self.revision:
            raise HubError(f"model.revision: the hub resolved {self.revision} to "
                           f"{info.sha!r}; refusing")
        files = []
        for s in info.siblings or []:
            if s.size is None or (s.lfs is None and not s.blob_id):
                raise HubError(f"model.source: the hub gave no size or hash for "
                               f"{s.rfilename!r} of {self.repo_id}@{info.sha}")
            rel = _safe_rel(s.rfilename)
            if s.lfs is not None:
                files.append(FileEntry(rel, int(s.lfs.size), sha256=s.lfs.sha256.lower()))
            else:
                files.append(FileEntry(rel, int(s.size), git_blob=str(s.blob_id).lower()))
        if not files:
            raise HubError(f"{self._where()}: the revision lists no files")
        self.redact.allowed_hex.update(e.git_blob for e in files if e.git_blob)
        return str(info.sha), sorted(files, key=lambda f: f.path)

    # ---- local state
    def part_path(self, e: FileEntry) -> Path:
        return self.cache / "partial" / f"{e.path}.{e.digest[:16]}.part"

    def marker_path(self, e: FileEntry) -> Path:
        return self.cache / "done" / f"{e.path}.json"

    def is_done(self, e: FileEntry) -> bool:
        final = self.dest / e.path
        try:
            mark = json.loads(self.marker_path(e).read_text())
            st = final.stat()
        except (OSError, ValueError):
            return False
        return (mark.get(e.kind) == e.digest and mark.get("size") == e.size == st.st_size
                and mark.get("mtime_ns") == st.st_mtime_ns)

    def mark_done(self, e: FileEntry, sha: str) -> None:
        st = (self.dest / e.path).stat()
        write_json_atomic(self.marker_path(e), {e.kind: e.digest, "size": e.size,
                                                "mtime_ns": st.st_mtime_ns, "revision": sha})

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        try:
            self.cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HubError(f"model.dir: cannot create {self.cache}: {exc}") from None
        with open(self.cache / "lock", "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise HubError(f"model.dir: another download into {self.dest} is running "
                               f"(it holds {self.cache / 'lock'}); wait for it") from None
            yield

    def plan(self, sha: str, files: list[FileEntry]) -> list[FileEntry]:
        """Files still to fetch; adopts matching unmarked copies, removes stale partials."""
        todo = [e for e in files if not self.is_done(e)]
        unmarked = [e for e in todo if (self.dest / e.path).is_file()
                    and (self.dest / e.path).stat().st_size == e.size]
        if unmarked:
            log.info("%d files of the revision are already in %s without a marker: hashing "
                     "them", len(unmarked), self.dest)
            got = hash_files([(self.dest / e.path, e.kind) for e in unmarked], self.threads,
                             progress=self.progress, desc="checking")
            for e in unmarked:
                if got[self.dest / e.path] == e.digest:
                    self.mark_done(e, sha)
            todo = [e for e in todo if not self.is_done(e)]
        keep = {self.part_path(e) for e in todo}
        partial = self.cache / "partial"
        for stale in partial.rglob("*.part") if partial.is_dir() else ():
            if stale not in keep:
                log.info("removing %s (not a file of this revision)", stale)
                stale.unlink()
        return todo

    def remaining(self, e: FileEntry) -> int:
        part = self.part_path(e)
        have = part.stat().st_size if part.is_file() else 0
        return e.size - have if have <= e.size else e.size

    # ---- transfer
    def fetch(self, e: FileEntry, sha: str, advance: Callable[[int], None]) -> None:
        import httpx
        from huggingface_hub import hf_hub_url
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo_id, e.path, revision=sha, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token)
        headers["Accept-Encoding"] = "identity"
        part = self.part_path(e)
        out = _HashingFile(part, e.kind, e.size, advance)
        failures = 0
        try:
            while out.pos < e.size:
                start = out.pos
                h = {**headers, **({"Range": f"bytes={start}-"} if start else {})}
                try:
                    with get_session().stream("GET", url, headers=h, timeout=_timeout()) as r:
                        hf_raise_for_status(r)
                        if start and r.status_code != 206:
                            log.warning("%s: the server ignored the Range request; "
                                        "restarting the file", e.path)
                            out.rewind()
                        elif start and not r.headers.get("Content-Range", "").startswith(
                                f"bytes {start}-"):
                            raise HubError(f"{e.path}: asked for bytes {start}- and got "
                                           f"{r.headers.get('Content-Range')!r}")
                        for chunk in r.iter_bytes():
                            if self.stop.is_set():
                                raise HubError(f"{e.path}: interrupted at byte {out.pos}")
                            out.write(chunk)
                            failures = 0
                    if out.pos < e.size:
                        raise httpx.RemoteProtocolError(f"the body ended at byte {out.pos}")
                except (httpx.TransportError, HfHubHTTPError) as exc:
                    status = getattr(getattr(exc, "response", None), "status_code", None)
                    retry = status is None or status == 429 or status >= 500
                    if isinstance(exc, httpx.ProxyError) or not retry or failures >= RETRIES:
                        raise
                    failures += 1
                    wait_s = RETRY_BACKOFF_S * 2 ** (failures - 1)
                    log.warning("%s: %s at byte %d of %d; resuming in %.0f s (retry %d/%d)",
                                e.path, self.redact.text(f"{type(exc).__name__}: {exc}"),
                                out.pos, e.size, wait_s, failures, RETRIES)
                    time.sleep(wait_s)
            digest = out.h.hexdigest()
        finally:
            out.close()
        if digest != e.digest:
            part.unlink(missing_ok=True)
            raise HubError(f"{e.path}: downloaded {e.kind} {digest} != hub {e.digest}; the "
                           "partial file was removed, rerun to fetch it again")
        final = self.dest / e.path
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        self.mark_done(e, sha)

    def fetch_all(self, sha: str, todo: list[FileEntry]) -> None:
        total = sum(e.size for e in todo)
        have = total - sum(self.remaining(e) for e in todo)
        todo = sorted(todo, key=lambda e: e.size, reverse=True)
        failed: dict[str, str] = {}
        done = 0
        lock = threading.Lock()
        t0 = time.monotonic()

        def one(e: FileEntry, advance: Callable[[int], None]) -> None:
            nonlocal done
            try:
                self.fetch(e, sha, advance)
            except Exception as exc:  # reported together below
                with lock:
                    failed[e.path] = self.redact.text(f"{type(exc).__name__}: {exc}")
                raise
            with lock:
                done += 1
                log.info("fetched %s (%s) [%d/%d files]", e.path, human(e.size), done,
                         len(todo))

        with _progress(self.progress, f"{self.repo_id} ({len(todo)} files)", total,
                       have) as advance, ThreadPoolExecutor(max(1, self.threads)) as pool:
            futures: list[Future[None]] = [pool.submit(one, e, advance) for e in todo]
            try:
                first = wait(futures, return_when=FIRST_EXCEPTION)
                if first.not_done and any(f.exception() for f in first.done):
                    for f in first.not_done:  # stop starting files; running ones finish
                        f.cancel()
                wait(futures)
            except BaseException:  # Ctrl-C: keep what arrived, end every transfer now
                self.stop.set()
                for f in futures:
                    f.cancel()
                raise
        if failed:
            lines = "\n  ".join(f"{p}: {why}" for p, why in sorted(failed.items()))
            raise HubError(f"{self._where()}: {len(failed)} file(s) failed to download "
                           f"(what arrived is kept under {self.cache / 'partial'}; rerun to "
                           f"resume):\n  {lines}")
        dt = time.monotonic() - t0
        log.info("fetched %d files, %s in %.0f s (%s/s)", len(todo), human(total - have), dt,
                 human((total - have) / dt if dt else 0))

    def run(self) -> Manifest:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        if problem := revision_problem(self.revision):
            raise RevisionError(f"model.revision: {problem}")
        try:
            validate_repo_id(self.repo_id)
        except HFValidationError as exc:
            raise HubError(f"model.source: {self.repo_id!r} is neither an existing local "
                           f"directory nor a hub repository id ({exc})") from None
        sha, files = self.list_revision()
        size = sum(e.size for e in files)
        log.info("%s@%s on %s: %d files, %s", self.repo_id, sha, self.endpoint, len(files),
                 human(size))
        with self.locked():
            todo = self.plan(sha, files)
            need = sum(self.remaining(e) for e in todo)
            free = _disk_free(self.dest)
            if need > free:
                raise DiskSpaceError(
                    f"model.dir: {self.dest} has {human(free)} free ({free} bytes) but "
                    f"{self.repo_id}@{sha[:12]} needs {human(need)} more ({need} bytes; "
                    f"{len(todo)} of {len(files)} files still to fetch); free space there or "
                    "point model.dir at a larger filesystem")
            log.info("%d files (%s) to fetch into %s, %s free", len(todo), human(need),
                     self.dest, human(free))
            if todo:
                self.fetch_all(sha, todo)
            wrong = [f"{e.path}: {size} != hub {e.size} bytes" for e in files
                     if (size := _size(self.dest / e.path)) != e.size]
            if wrong:
                raise HubError("model.dir: after the download, files differ from the hub's "
                               "sizes:\n  " + "\n  ".join(wrong))
            extra = sorted(set(list_files(self.dest)) - {e.path for e in files})
            if extra:
                log.warning("%s holds %d files that are not in %s@%s (verify reports them): "
                            "%s", self.dest, len(extra), self.repo_id, sha, ", ".join(extra))
            m = Manifest(Source("hub", self.repo_id, self.revision, sha,
                                without_userinfo(self.endpoint)),
                         str(self.dest), utc_now(), files)
            text = json.dumps(m.to_dict(), indent=2) + "\n"
            if self.token and self.token in text:
                raise HubError("refusing to write the manifest: it would contain HF_TOKEN")
            write_json_atomic(self.manifest, m.to_dict())
        log.info("wrote %s (%d files, %s)", self.manifest, len(files), human(size))
        return m


def without_userinfo(url: str) -> str:
    """``url`` without a ``user:password@`` part (a mirror's credentials stay out of files)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def _size(path: Path) -> int | str:
    return path.stat().st_size if path.is_file() else "missing"


def _timeout() -> float:
    from huggingface_hub import constants

    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
