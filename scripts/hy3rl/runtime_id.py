"""The training runtime, named exactly: what each attempt record (``runtime.identity``,
docs/formats/train.md) and the report's provenance say the trainer ran in.

:func:`identify` on ``train.runtime`` as the nodes run it (``hy3rl.launch.resolve_runtime``):

- an apptainer / singularity prefix naming a registry image (``docker://...``, ``oras://``,
  ``library://``, ...): with ``@sha256:<digest>``, the digest; with a tag, the tag and a
  note that a tag can move (preflight's ``runtime_tag`` warning says so before the run);
- an apptainer / singularity prefix naming a local ``.sif`` / ``.simg`` file: its sha256,
  streamed, cached by path + size + mtime in ``cache`` (a 20 GB image is hashed once, not
  at every attempt);
- anything else (no prefix, ``conda run``, a wrapper, a sandbox directory): the runtime's
  interpreter (path and version) and a ``pip freeze`` of it, run through the prefix, with
  the sha256 of the freeze (``importlib.metadata`` when the runtime has no pip).

Never raises: an identification that fails is ``{"kind": "unknown", "reason": ...}``.
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_json_atomic

CONTAINER_TOOLS = ("apptainer", "singularity")
IMAGE_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")  # docker://, oras://, library://, shub://
SIF_SUFFIXES = (".sif", ".simg")
TAG_NOTE = ("a tag can move: the image it names may differ between attempts and nodes; pin "
            "@sha256:<digest> or a local .sif (preflight warns: runtime_tag)")
MARKER = "HY3RL_RUNTIME_ID "
CHUNK = 8 << 20

# Runs inside the runtime (``<prefix> <python> -c PROBE``): its interpreter, version and
# installed distributions, as one marked JSON line (a prefix may print banners of its own).
PROBE = r"""
import json, platform, subprocess, sys
out = {"python": sys.executable, "python_version": platform.python_version()}
try:
    p = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"],
                       capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        raise RuntimeError(p.stderr.strip()[-300:] or f"exit {p.returncode}")
    out["freeze"] = [ln for ln in p.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    out["freeze_method"] = "pip freeze --all"
except Exception as exc:
    from importlib import metadata
    names = {}
    for d in metadata.distributions():
        name = d.metadata["Name"]
        if name:
            names.setdefault(name.lower(), f"{name}=={d.version}")
    out["freeze"] = sorted(names.values(), key=str.lower)
    out["freeze_method"] = f"importlib.metadata (no pip: {exc})"
print("HY3RL_RUNTIME_ID " + json.dumps(out), flush=True)
"""


def unknown(reason: str) -> dict[str, Any]:
    return {"kind": "unknown", "id": f"unknown: {reason}", "reason": reason}


def identify(prefix: str, python: str, *, cache: Path | None = None,
             timeout: float = 300) -> dict[str, Any]:
    """The identity of the runtime ``<prefix> <python>`` (see the module doc). ``cache``: the
    JSON file of SIF hashes (``Layout.runtime_id_cache``); None hashes every time."""
    try:
        tokens = shlex.split(prefix)
        image = container_image(tokens)
        if image is not None:
            if IMAGE_URI.match(image):
                return registry_image(image)
            if image.endswith(SIF_SUFFIXES):
                return sif_image(Path(image), cache)
        return interpreter(tokens, python, timeout)
    except Exception as exc:  # never fatal: the attempt records why
        return unknown(f"{type(exc).__name__}: {exc}")


def container_image(tokens: list[str]) -> str | None:
    """The image an apptainer / singularity prefix runs: the first token after the tool that
    is a registry URI or a ``.sif`` / ``.simg`` file; None for another prefix or an image of
    another shape (a sandbox directory: identified by its interpreter)."""
    for i, tok in enumerate(tokens):
        if os.path.basename(tok) in CONTAINER_TOOLS:
            for t in tokens[i + 1:]:
                if IMAGE_URI.match(t) or t.endswith(SIF_SUFFIXES):
                    return t
            return None
    return None


def registry_image(image: str) -> dict[str, Any]:
    ref = image.split("://", 1)[1]
    if "@" in ref:
        digest = ref.rsplit("@", 1)[1]
        return {"kind": "image", "id": image, "image": image, "digest": digest,
                "pinned": True}
    last = ref.rsplit("/", 1)[-1]
    tag = last.rsplit(":", 1)[1] if ":" in last else "latest (implicit)"
    return {"kind": "image", "id": image, "image": image, "tag": tag, "pinned": False,
            "note": TAG_NOTE}


def sif_image(path: Path, cache: Path | None) -> dict[str, Any]:
    path = Path(os.path.abspath(path))
    if not path.is_file():
        return unknown(f"image file {path} not found on this host")
    st = path.stat()
    digest, how = cached_sha256(path, cache)
    return {"kind": "sif", "id": f"{path} sha256:{digest}", "image": str(path),
            "sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "pinned": True, "sha256_from": how}


def cached_sha256(path: Path, cache: Path | None) -> tuple[str, str]:
    """The sha256 of file ``path`` and how it was had (``cache`` or ``hashed``): from the JSON
    file ``cache`` when it holds an entry for the path with the file's current size, mtime
    and inode, else by reading the file, the entry then written (atomically; two writers
    lose at worst an entry, which is hashed again). A file touched or copied (same bytes, a
    new mtime) is hashed again and gives the same digest; a file rewritten in place within
    one mtime tick at the same size is not seen (as by ``make``)."""
    st = path.stat()
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    entries = _read_cache(cache)
    hit = entries.get(str(path))
    if isinstance(hit, dict) and all(hit.get(k) == v for k, v in key.items() if k in hit) \
            and {"size", "mtime_ns"} <= hit.keys() and hit.get("sha256"):
        return hit["sha256"], "cache"
    digest = sha256_file(path)
    if cache is not None:
        entries = _read_cache(cache)  # as it is now: another writer's entries are kept
        entries[str(path)] = {**key, "sha256": digest}
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(cache), entries)
    return digest, "hashed"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _read_cache(cache: Path | None) -> dict[str, Any]:
    if cache is None:
        return {}
    try:
        data = json.loads(Path(cache).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def interpreter(tokens: list[str], python: str, timeout: float) -> dict[str, Any]:
    cmd = [*tokens, python, "-c", PROBE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return unknown(f"{cmd[0]} not found on PATH")
    except subprocess.TimeoutExpired:
        return unknown(f"{shlex.join(cmd[:-2])} -c <probe> did not answer in {timeout:g}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-300:]
        return unknown(f"{shlex.join(cmd[:-2])} -c <probe> exited {proc.returncode}: {tail}")
    got = json.loads(lines[-1][len(MARKER):])
    freeze = [str(x) for x in got["freeze"]]
    digest = hashlib.sha256(("\n".join(freeze) + "\n").encode()).hexdigest()
    return {"kind": "interpreter",
            "id": f"python {got['python_version']} {got['python']}, freeze sha256:{digest} "
                  f"({len(freeze)} packages)",
            "python": got["python"], "python_version": got["python_version"],
            "freeze_sha256": digest, "freeze_method": got["freeze_method"], "freeze": freeze}
