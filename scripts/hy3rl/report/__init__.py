"""Stage `report`: one self-contained HTML page of everything a run produced.

Reads whatever exists in the run's layout (lock file, data summary, checks, preflight plan,
training attempts and their verl logs, evaluation metrics) and writes the files of
:data:`hy3rl.layout.REPORT_FILES`: ``index.html`` (figures embedded as base64 PNG, no
external URL), the figures as PNG, the tables as CSV and the resolved config
(docs/formats/report.md). A stage that did not run is shown as such, with the reason; when
training did not run at all the page says so once, with how to run it.

:mod:`.read` reads the other stages' files, :mod:`.figures` draws, :mod:`.page` renders the
tables and the page. Every string rendered anywhere goes through one
:class:`~hy3rl.redact.Redactor`, and the bytes of every output are checked for the known
secret values before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from hy3rl.atomic import write_bytes_atomic
from hy3rl.errors import StageError
from hy3rl.layout import REPORT_FILES, Layout
from hy3rl.redact import make_redactor
from hy3rl.report.figures import (
    fig_eval_checkpoints,
    fig_eval_curves,
    fig_extra,
    fig_heatmap,
    fig_notice,
    fig_published,
    fig_step_time,
)
from hy3rl.report.page import render, training_notice, training_reason
from hy3rl.report.read import (
    ReportInputError,
    gather,
    pick_key,
    resume_points,
    selection_view,
    series,
)
from hy3rl.settings import Config

__all__ = ["ReportInputError", "build", "fig_published", "gather", "pick_key",
           "resume_points", "run", "series"]


def build(cfg: Config, results: Layout, env: Mapping[str, str]) -> dict[str, bytes]:
    """Render every file of the report in memory: {file name: bytes}. Nothing is written."""
    found = gather(cfg, results)
    opts = cfg.report
    redact = make_redactor(env, [cfg.raw, *found.docs.values(), *[a.raw for a in found.attempts]],
                           opts.redact_env)
    eval_reason = found.stage("evaluate").detail
    notice = training_notice(found)
    figs: dict[str, bytes] = {}
    if notice:  # one small notice instead of eleven empty panels
        small = fig_notice("No training curves", notice.text, redact, opts.dpi)
        panel_keys: list[str] = []
        for name in ("fig_training_published.png", "fig_training_extra.png",
                     "fig_step_time.png"):
            figs[name] = small
    else:
        reason = training_reason(found)
        figs["fig_training_published.png"], panel_keys = fig_published(
            found, redact, opts.dpi, opts.reference_curves, opts.drift_threshold, reason)
        figs["fig_training_extra.png"] = fig_extra(found, redact, opts.dpi, reason)
        figs["fig_step_time.png"] = fig_step_time(found, redact, opts.dpi, reason)
    figs["fig_eval_checkpoints.png"] = fig_eval_checkpoints(found, redact, opts.dpi, eval_reason)
    figs["fig_eval_heatmap.png"] = fig_heatmap(found, redact, opts.dpi, eval_reason)
    selection = selection_view(found)
    figs["fig_eval_curves.png"] = fig_eval_curves(found, selection, redact, opts.dpi,
                                                  eval_reason)
    files = {**figs, **render(found, redact, env, figs, panel_keys, selection)}
    for name, blob in files.items():
        redact.check_bytes(name, blob)
    return files


def run(cfg: Config, *, results: Layout, outputs: Mapping[str, Path],
        env: Mapping[str, str] | None = None) -> None:
    """Read the run at ``results`` and write every report file to ``outputs`` (file name of
    :data:`~hy3rl.layout.REPORT_FILES` -> path), each atomically, ``index.html`` last.
    ``env``: the environment listed in the provenance (default: this process's)."""
    names = [n for n, _ in REPORT_FILES]
    if sorted(outputs) != sorted(names):
        raise StageError(f"report: outputs {sorted(outputs)} are not the report's files {names}")
    files = build(cfg, results, dict(os.environ) if env is None else env)
    for name in sorted(files, key=lambda n: n == "index.html"):
        write_bytes_atomic(Path(outputs[name]), files[name])
    page = Path(outputs["index.html"])
    print(f"report: wrote {len(files)} files to {page.parent} (page: {page})", flush=True)
