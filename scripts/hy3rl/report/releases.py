"""Rule release_page: ``report/releases.html``, every release of ``release.tags`` with its
checks, beside the report and linked from it (docs/formats/release.md).

The report runs beside the releases, not after them (a refused release never withholds the
report), so the releases get their own page, written by the `release` target once every
release passed: for each tag its directory (and hub commit when uploaded), the checkpoint and
evaluation it came from, every check of ``release/<tag>/checks.json`` with its details, the
file manifest of ``release.json`` and the greedy answers of its ``generates`` check.

The page claims no more than the records hold, and checks them against each other first:
``checks.json`` must be the passing run of that very ``release.json`` (``ok``, the same
counts; a later refused attempt of the tag leaves a failing ``checks.json`` beside an older
record), and every file of the manifest must still be in the release directory at its
recorded size (a cheap ``stat``; the sha256 are on the page for a full ``sha256sum -c``).
A mismatch is refused with :class:`ReleasePageError` naming the file: no page is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from hy3rl import timefmt
from hy3rl.atomic import write_bytes_atomic
from hy3rl.errors import StageError
from hy3rl.redact import make_redactor

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
SHOWN_ANSWERS = 3  # greedy answers shown per release (all are in release.json)
ANSWER_CHARS = 600  # of each answer


class ReleasePageError(StageError):
    """The release records disagree with each other or with the release directory."""


def _load(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReleasePageError(f"{path}: missing ({what})") from None
    except (OSError, ValueError) as exc:
        raise ReleasePageError(f"{path}: unreadable ({what}): {exc}") from None
    if not isinstance(doc, dict):
        raise ReleasePageError(f"{path}: not a JSON object ({what})")
    return doc


def missing_files(folder: Path, files: Mapping[str, Any]) -> list[str]:
    """The manifest's files not in ``folder`` at their recorded size, each named."""
    out = []
    for name, meta in sorted(files.items()):
        size = meta.get("size") if isinstance(meta, Mapping) else None
        try:
            st = os.stat(folder / name)
        except OSError:
            out.append(f"{name}: missing")
            continue
        if size != st.st_size:
            out.append(f"{name}: {st.st_size} bytes, recorded {size}")
    return out


def release_view(tag: str, record_path: Path, checks_path: Path
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One release as the page shows it, and its record, after checking its records against
    each other and its directory (:class:`ReleasePageError` naming the file at fault)."""
    rec = _load(record_path, f"release {tag}")
    checks = _load(checks_path, f"checks of release {tag}")
    if checks.get("ok") is not True:
        failed = [c.get("name") for c in checks.get("checks") or []
                  if isinstance(c, Mapping) and c.get("status") == "fail"]
        raise ReleasePageError(
            f"{checks_path}: a refused release attempt of {tag} (failed: "
            f"{', '.join(map(str, failed)) or 'none named'}), not the checks of "
            f"{record_path}: rerun `snakemake release` to release it again")
    if checks.get("counts") != rec.get("counts"):
        raise ReleasePageError(
            f"{checks_path}: counts {checks.get('counts')} differ from {record_path}'s "
            f"{rec.get('counts')}: the checks are not those of this release")
    files = rec.get("files")
    folder = rec.get("dir")
    if not isinstance(files, Mapping) or not files or not isinstance(folder, str):
        raise ReleasePageError(f"{record_path}: no `dir` or `files` manifest")
    gone = missing_files(Path(folder), files)
    if gone:
        raise ReleasePageError(
            f"{folder}: the release directory no longer holds what {record_path} records: "
            + "; ".join(gone[:5]) + (f" (and {len(gone) - 5} more)" if len(gone) > 5 else ""))
    answers = []
    for g in (rec.get("generated") or [])[:SHOWN_ANSWERS]:
        text = str(g.get("response", ""))
        answers.append({**g, "response": text[:ANSWER_CHARS]
                        + ("..." if len(text) > ANSWER_CHARS else "")})
    return {
        "tag": tag,
        "dir": folder,
        "step": rec.get("step"),
        "evaluated_tag": rec.get("evaluated_tag"),
        "source": rec.get("source"),
        "base": rec.get("base"),
        "created": rec.get("created"),
        "hub": rec.get("hub"),
        "record": str(record_path),
        "card": str(Path(folder) / "README.md"),
        "counts": rec.get("counts"),
        "size": rec.get("size") or {},
        "checks": [{"name": c.get("name"), "status": c.get("status"),
                    "details": c.get("details", ""), "problems": c.get("problems") or []}
                   for c in checks.get("checks") or [] if isinstance(c, Mapping)],
        "files": [{"name": n, "size": (m or {}).get("size"), "sha256": (m or {}).get("sha256")}
                  for n, m in sorted(files.items())],
        "answers": answers,
        "generated_count": len(rec.get("generated") or []),
    }, rec


def render(run: str, views: Sequence[Mapping[str, Any]], report: str) -> str:
    jenv = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True,
                       undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return jenv.get_template("releases.html.j2").render(
        run=run, generated=timefmt.utc_now(), releases=views, report=report)


def run(cfg: Any, tags: Sequence[str], *, layout: Any, out: Path,
        env: Mapping[str, str] | None = None) -> None:
    """Write ``out`` (report/releases.html) for ``tags``, each read from its
    ``release/<tag>/release.json`` and ``checks.json``; redacted as the report is."""
    read = [release_view(t, Path(layout.release_record(t)), Path(layout.release_checks(t)))
            for t in tags]
    views = [v for v, _ in read]
    # the records are sources too: their commit ids (the hub's) are no secrets
    redact = make_redactor(dict(os.environ) if env is None else env,
                           [cfg.raw, *(r for _, r in read)], cfg.report.redact_env)
    html = redact.text(render(cfg.run.name, views, os.path.relpath(layout.report_html,
                                                                   out.parent)))
    blob = html.encode()
    redact.check_bytes(out.name, blob)
    write_bytes_atomic(out, blob)
    print(f"release page: {len(views)} release(s) -> {out}", flush=True)
