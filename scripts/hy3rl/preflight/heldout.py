"""Preflight's checks of the held-out set and the selection rule (issue 20), and the rule's
record in plan.json (``selection``), written before the first training step.

A selection set must be held out twice: from the reported test set (data.val, AIME-2024),
or the winner is picked on the test set itself, and from the training set. Problems are
compared by their normalised text (:mod:`hy3rl.problems`: the last user message, the
instruction wrappers of the templates in use removed, math delimiters, whitespace,
unicode super/subscripts and end punctuation folded), so that the same problem under
another id, row order, file or template still counts; near-duplicates (word 3-gram
Jaccard at or above :data:`hy3rl.problems.NEAR_DUPLICATE_JACCARD`) are warned about.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hy3rl.problems import (
    NEAR_DUPLICATE_JACCARD,
    NGRAM,
    NgramIndex,
    Problem,
    problem,
    shown,
)
from hy3rl.runtime_id import sha256_file
from hy3rl.settings import Config

TIE_RULE = "earliest step"
SHOWN = 3  # pairs named in a message


def _user_texts(batch: pa.RecordBatch) -> tuple[np.ndarray, pa.Array]:
    """The rows of ``batch`` with a user message and the last one's content of each (in
    Arrow: a repeated prompt's text reaches Python once)."""
    prompt = batch.column("prompt")
    flat = pc.list_flatten(prompt)
    user = pc.fill_null(pc.equal(pc.struct_field(flat, "role"), "user"), False)
    parents = pc.filter(pc.list_parent_indices(prompt), user).to_numpy()
    last = np.flatnonzero(np.append(parents[1:] != parents[:-1], True)) if len(parents) else \
        np.zeros(0, dtype=np.int64)
    return parents[last], pc.filter(pc.struct_field(flat, "content"), user).take(last)


def problems(path: Path) -> Iterator[Problem]:
    """The distinct problems of a verl parquet file, in file order: each prompt text
    normalised once, a problem named by its first row's problem id (extra_info.index, else
    ``row <i>``) and row. A row without a user message holds no problem."""
    seen: set[str] = set()
    keyed: dict[str, Problem] = {}
    offset = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=65536,
                                                   columns=["prompt", "extra_info"]):
        rows, texts = _user_texts(batch)
        encoded = pc.dictionary_encode(texts)
        codes = encoded.indices.to_numpy(zero_copy_only=False)
        firsts = np.sort(np.unique(codes, return_index=True)[1])  # each text's first row
        extra = batch.column("extra_info")
        pids = [None] * len(firsts)
        if pa.types.is_struct(extra.type) and extra.type.get_field_index("index") >= 0:
            pids = pc.struct_field(extra, "index").take(rows[firsts]).to_pylist()
        distinct = encoded.dictionary.to_pylist()
        for code, at, pid in zip(codes[firsts], rows[firsts], pids, strict=True):
            text, row = distinct[code], offset + int(at)
            if text not in keyed:
                keyed[text] = problem(text, str(pid if pid is not None else f"row {row}"), row)
            found = keyed[text]
            if found.key not in seen:
                seen.add(found.key)
                yield found
        offset += batch.num_rows


def resolved_k(cfg: Config) -> int:
    """eval.select.k, or the samples per problem when null."""
    from hy3rl.evaluate import resolve_sampling

    n = resolve_sampling(cfg.eval).n_samples
    sel = cfg.eval.select
    return int(sel.k) if sel is not None and sel.k is not None else int(n)


def selection_record(cfg: Config, heldout: Path | None) -> dict[str, Any] | None:
    """plan.json ``selection``: the rule as it will be applied (k resolved, the candidate
    set: hy3rl.selection.candidate_set), with the held-out file's sha256; None without
    eval.select."""
    from hy3rl.selection import candidate_set

    sel = cfg.eval.select
    if sel is None:
        return None
    k = resolved_k(cfg)
    key = f"{sel.grader} avg@{k}" if sel.metric == "avg" else f"{sel.grader} {sel.metric}@{k}"
    have = heldout is not None and Path(heldout).is_file()
    return {"set": sel.set, "grader": sel.grader, "metric": sel.metric, "k": k, "key": key,
            "tie": TIE_RULE, "candidates": candidate_set(cfg),
            "set_file": str(heldout) if have else None,
            "set_sha256": sha256_file(Path(heldout)) if have else None}


def check(r: Any, cfg: Config, *, heldout: Path | None, val: Path, train: Path) -> None:
    """Rule ``selection`` (and ``eval_steps_saved`` is in rules.py): the set named by
    eval.select exists, is not the test set, shares no problem with it nor with the
    training set, and k fits the samples per problem."""
    sel, ho = cfg.eval.select, cfg.data.heldout
    name = "selection"
    if sel is not None:
        if ho is None:
            r.error(name, f"eval.select.set: names {sel.set!r} but no held-out set is "
                    "configured (data.heldout is null): add one, or set eval.select: null")
            return
        if sel.set != ho.name:
            r.error(name, f"eval.select.set: no held-out set named {sel.set!r} "
                    f"(data.heldout.name is {ho.name!r}); the test set (data.val) never "
                    "selects")
            return
        from hy3rl.evaluate import resolve_sampling
        from hy3rl.metrics import ks_for

        n = int(resolve_sampling(cfg.eval).n_samples)
        k = resolved_k(cfg)
        if sel.metric == "avg" and k != n:
            r.error(name, f"eval.select.k = {k}: avg is over every sample (avg@n, n = {n}); "
                    "set k to null")
        elif sel.metric != "avg" and k not in ks_for(n):
            r.error(name, f"eval.select.k = {k}: {sel.metric}@k is recorded for k in "
                    f"{ks_for(n)} (n = eval samples per problem)")
    if ho is None:
        return
    if heldout is None:
        r.not_run(name, "not run: the held-out file (data/heldout.parquet) was not given")
        return
    if not Path(heldout).is_file():
        r.error(name, f"data.heldout {ho.name!r}: {heldout} is missing (rule data writes it)")
        return
    _overlaps(r, name, Path(heldout), val, train, ho.name)


def _named(p: Problem) -> str:
    return f"{p.pid} (row {p.row})"


def _overlaps(r: Any, name: str, heldout: Path, val: Path, train: Path, set_name: str) -> None:
    if sha256_file(heldout) == sha256_file(val):
        r.error(name, f"eval.select.set / data.heldout {set_name!r}: {heldout} has the same "
                f"content as the test set {val}: the selection would pick the winner on the "
                "test set itself")
        return
    held = list(problems(heldout))
    index = NgramIndex(held)
    for what, other in (("the test set (data.val)", val), ("the training set", train)):
        short = what.split(" (")[0]
        theirs = {p.key: p for p in problems(other)}
        common = [p for p in held if p.key in theirs]
        if common:
            same = len(common) == len(held) == len(theirs)
            pairs = ", ".join(f"{_named(p)} = {short} {_named(theirs[p.key])}"
                              for p in common[:SHOWN])
            count = ("the same problems as" if same else
                     f"{len(common)} of its {len(held)} problems are also in")
            r.error(name, f"data.heldout {set_name!r}: {count} {what} ({other}): {pairs}"
                    f"{' ...' if len(common) > SHOWN else ''}: a held-out set shares no "
                    "problem with it (compared after normalisation: docs/formats/preflight.md)")
        near = [d for d in index.near(theirs.values()) if d.mine.key not in theirs]
        if near:  # a problem refused above is not also a near-duplicate
            pairs = "; ".join(
                f"{_named(d.mine)} ~ {short} {_named(d.theirs)}, Jaccard {d.jaccard:.2f}: "
                f"{shown(d.mine.text)!r} / {shown(d.theirs.text)!r}" for d in near[:SHOWN])
            r.warn(name, f"data.heldout {set_name!r}: {len(near)} of its {len(held)} problems "
                   f"are near-duplicates of problems in {what} ({other}) (word {NGRAM}-gram "
                   f"Jaccard >= {NEAR_DUPLICATE_JACCARD}, not equal after normalisation): "
                   f"{pairs}{' ...' if len(near) > SHOWN else ''}: check that they are "
                   "different problems")
