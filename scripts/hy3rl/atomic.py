"""Atomic writes for every stage: a temporary file in the destination's directory, flushed
and fsync'ed, then ``os.replace``d over the destination, so neither a reader nor a crash
ever leaves a half-written output. Standard library only (the train launcher's node mode
imports it inside the verl runtime)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# mkstemp creates 0600 files; outputs get the permissions open() would give them instead.
_UMASK = os.umask(0)
os.umask(_UMASK)


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically; ``mode`` sets the file's permissions
    (default: 0666 less the umask, as for a plain open())."""
    write_bytes_atomic(path, text.encode(), mode)


def write_bytes_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically (binary outputs: the report's PNGs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any, *, indent: int = 2, mode: int | None = None,
                      default: Callable[[Any], Any] | None = None) -> None:
    """One JSON document (``indent`` spaces, key order kept) and a final newline."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=default) + "\n", mode)


def write_jsonl_atomic(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object a line (UTF-8 kept as is)."""
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def remove_siblings(path: Path, pattern: str) -> list[Path]:
    """Remove the files of ``path``'s directory that match glob ``pattern`` other than
    ``path`` itself (the other digests of a digest-named record: hy3rl.train.record_keys,
    hy3rl.evalckpt.keep_only_request); returns them, sorted."""
    path = Path(path)
    gone = [p for p in sorted(path.parent.glob(pattern)) if p.name != path.name]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone
