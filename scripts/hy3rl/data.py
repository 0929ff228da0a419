"""Stage `data`: DAPO-Math-17k / AIME-2024 (hub or local files) -> verl's 5-column parquet.

Reads each split's source (a hub dataset id through ``datasets``, a local dataset
directory, or a .parquet / .jsonl / .csv file), optionally converts a user's own
question/answer dataset with the DAPO prompt template, validates every row the way verl
will consume it, optionally de-duplicates by prompt and samples a seeded subset, and writes
``train.parquet``, ``val.parquet`` and ``summary.json`` (all three or none). With
``data.heldout`` it also writes ``heldout.parquet`` (all four or none): a held-out set read
from its own source like a split, or ``limit`` prompts carved out of ``data.train`` after
its dedup and before its ``limit`` (:func:`carve_heldout`).

The core works on Arrow tables column by column; only the unique prompts go through the
tokenizer (batched), weighted by how often they occur. docs/formats/data.md describes the
outputs.

Entry point: :func:`run` (rule ``data`` through ``scripts/adapters/data.py``; by hand,
``hy3rl data --configfile ...``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hy3rl.errors import StageError
from hy3rl.settings import Convert, Data, DataSource, HeldoutSource, ValSource

log = logging.getLogger("hy3rl.data")

COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
ROLES = ("system", "user", "assistant")
FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")
SUMMARY_FORMAT = "hy3rl.data.summary/1"

# DAPO-Math-17k's prompt (upstream-facts.md, "Data").
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    "problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# verl@220e903 verl/utils/reward_score/__init__.py: default_compute_score routes these
# data_source values (plus any starting with "aime") and raises NotImplementedError
# for every other one.
VERL_ROUTED_SOURCES = frozenset(
    {
        "openai/gsm8k",
        "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
        "math_dapo", "math", "math_dapo_reasoning",
        "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
        "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads",
        "codecontests", "apps", "codeforces", "taco",
        "hiyouga/geometry3k",
        "searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
        "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle",
    }
)
VERL_ROUTED_PREFIXES = ("aime",)

TRUNCATION_NOTE = (
    "verl@220e903 keeps these prompts (data.filter_overlong_prompts=False in the published "
    "script) and its agent loop left-truncates them to the last max_prompt_length tokens "
    "with only a log warning: their beginning (the instructions) is silently lost."
)
KEY_SEP_FIELD = "\x1f"  # between a message's role and content in a prompt key
KEY_SEP_MESSAGE = "\x1e"  # between messages
CHUNK_ROWS = 1 << 17


class DataError(StageError):
    """Bad input; the message names the file (or dataset id), row and column at fault."""


def verl_routes(data_source: str) -> bool:
    """True when verl's default scorer has a reward function for ``data_source``."""
    return data_source in VERL_ROUTED_SOURCES or data_source.startswith(VERL_ROUTED_PREFIXES)


# --------------------------------------------------------------------------- sources


def source_kind(source: str) -> str:
    """``file`` (a local .parquet/.jsonl/.json/.csv path), ``directory`` (a local dataset
    repository) or ``hub`` (a hub dataset id)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return "directory"
    if path.suffix.lower() in FILE_SUFFIXES or path.exists():
        return "file"
    return "hub"


def local_source_path(source: str) -> str | None:
    """The local path a source reads (for Snakemake inputs), None for a hub id."""
    return None if source_kind(source) == "hub" else str(Path(source).expanduser())


def hub_load_kwargs(
    source: str, revision: str | None = None, cache_dir: str | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``datasets.load_dataset`` (and ``load_dataset_builder``)."""
    kwargs: dict[str, Any] = {"path": source, "name": "default", "revision": revision}
    if cache_dir is not None:
        kwargs["cache_dir"] = cache_dir
    return kwargs


def sha256_file(path: str | Path, bufsize: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(bufsize):
            digest.update(chunk)
    return digest.hexdigest()


def _load_with_datasets(
    source: str, kind: str, revision: str | None, cache_dir: str | None
) -> tuple[pa.Table, dict[str, Any]]:
    import datasets

    kwargs = hub_load_kwargs(source, revision if kind == "hub" else None, cache_dir)
    requested = kwargs["revision"]
    what = f"dataset {source!r}" if kind == "hub" else f"{source}"
    try:
        builder = datasets.load_dataset_builder(**kwargs)
        if kind == "hub":  # load exactly the commit the revision resolved to (recorded below)
            kwargs["revision"] = builder.hash
        ds = datasets.load_dataset(**kwargs, split="train")
    except Exception as exc:  # datasets raises many types; all mean "cannot load"
        hint = ""
        if kind == "hub":
            hint = (
                " (no network? point data.<split>.source at a local .parquet/.jsonl file or "
                "a downloaded dataset directory)"
            )
        raise DataError(
            f"{what}: cannot load with datasets.load_dataset(name='default', split='train'"
            f"{', revision=' + repr(revision) if kind == 'hub' and revision else ''}): "
            f"{type(exc).__name__}: {exc}{hint}"
        ) from exc
    data_files = [str(f) for f in (builder.config.data_files or {}).get("train", [])]
    info: dict[str, Any] = {
        "kind": kind,
        "config": "default",
        "split": "train",
        "fingerprint": ds._fingerprint,
        "data_files": data_files,
    }
    if kind == "hub":
        # For hub datasets the module hash is the commit SHA the revision resolved to.
        info.update(id=source, revision_requested=requested, revision=builder.hash)
    else:
        info.update(
            path=str(source),
            files=[{"path": f, "sha256": sha256_file(f)} for f in data_files],
        )
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    if ds._indices is not None:  # not expected for a fresh split; be exact anyway
        table = ds.with_format("arrow")[:]
    return table, info


def _jsonl_error_detail(path: Path, exc: Exception) -> str:
    """Locate the line a JSON-lines read failed on (pyarrow's message names a block row)."""
    import re

    match = re.search(r"Column\((/[^)]*)\) changed from (\w+) to (\w+)", str(exc))
    col_path = match.group(1).strip("/").split("/") if match else None
    kinds = {"string": str, "number": (int, float), "boolean": bool, "array": list,
             "object": dict}
    first_kind = kinds.get(match.group(2)) if match else None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as jexc:
                return (f"line {lineno + 1} (row {lineno}): not valid JSON: {jexc.msg} "
                        "(JSON lines expected: one object per line)")
            if col_path and first_kind:
                value: Any = obj
                for part in col_path:
                    if isinstance(value, list):
                        value = value[0] if value else None
                    value = value.get(part) if isinstance(value, dict) else None
                if value is not None and not isinstance(value, first_kind):
                    return (
                        f"row {lineno}, column {'.'.join(col_path)}: {type(value).__name__} "
                        f"where earlier rows hold {match.group(2)} values"
                    )
    return str(exc)


def read_file(
    path: str | Path, convert: Convert | None = None
) -> tuple[pa.Table, dict[str, Any]]:
    """Read a local .parquet / .jsonl / .json (JSON lines) / .csv file into Arrow."""
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson

    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if suffix not in FILE_SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix!r} (use one of {FILE_SUFFIXES})")
    fmt = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}[suffix]
    try:
        if fmt == "parquet":
            table = pq.read_table(path)
        elif fmt == "jsonl":
            try:
                table = pajson.read_json(path)
            except pa.ArrowInvalid as exc:
                raise DataError(f"{path}: {_jsonl_error_detail(path, exc)}") from exc
        else:
            text_cols = {}
            if convert:
                # Read the mapped fields as text: "025" must stay "025", ids stay ids.
                text_cols = {name: pa.string()
                             for name in (convert.question, convert.answer, convert.id) if name}
            table = pacsv.read_csv(
                path, convert_options=pacsv.ConvertOptions(column_types=text_cols)
            )
    except DataError:
        raise
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read as {fmt}: {exc}") from exc
    info = {"kind": "file", "path": str(path), "format": fmt, "sha256": sha256_file(path)}
    return table, info


def load_source(
    source: str, revision: str | None = None, convert: Convert | None = None,
    cache_dir: str | None = None,
) -> tuple[pa.Table, dict[str, Any]]:
    kind = source_kind(source)
    if revision and kind != "hub":
        raise DataError(f"{source}: `revision` applies to hub datasets only (this is a local "
                        f"{kind})")
    if kind == "file":
        return read_file(source, convert)
    return _load_with_datasets(source, kind, revision, cache_dir)


# --------------------------------------------------------------------------- conversion


def _column(table: pa.Table, name: str, label: str) -> pa.ChunkedArray:
    if name not in table.column_names:
        raise DataError(
            f"{label}: column {name!r} missing (columns: {', '.join(table.column_names)})"
        )
    return plain_text(table[name])


def _is_text(t: pa.DataType) -> bool:
    """Arrow's three text types: ``string`` (pyarrow, ``datasets``, pandas' python-backed
    strings), ``large_string`` (pandas 3's default ``str`` and ``string`` dtypes) and
    ``string_view`` (polars)."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _plain_type(t: pa.DataType) -> pa.DataType:
    """``t`` with every text type in it ``string`` and every dictionary decoded (lists,
    structs followed down; other types as they are)."""
    if pa.types.is_dictionary(t):
        return _plain_type(t.value_type)
    if _is_text(t):
        return pa.string()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_plain_type(f.type)) for f in t])
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_plain_type(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_plain_type(t.value_type)))
    return t


def plain_text(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """``col`` with verl's text type (``string``) wherever its writer used another one
    (pandas 3: ``large_string``; polars: ``string_view``; categoricals: dictionaries), so
    that columns of different writers combine and every output has one schema."""
    target = _plain_type(col.type)
    return col if target == col.type else pc.cast(col, target)


TEXT_TYPES = "string, large_string or string_view"


def _as_text(col: pa.ChunkedArray, label: str, name: str, field_: str,
             numbers: tuple[str, ...] = ()) -> pa.ChunkedArray:
    """The mapped field ``name`` (``convert.<field_>``) as ``string``: text of any writer, and
    the kinds of numbers in ``numbers`` (``integer``, ``float``) cast to text; any other type
    is refused naming the file, the column and its type."""
    t = col.type
    if _is_text(t):
        return col
    kinds = {"integer": pa.types.is_integer, "float": pa.types.is_floating,
             "decimal": pa.types.is_decimal}
    if any(kinds[k](t) for k in numbers):
        return pc.cast(col, pa.string())
    allowed = f"text ({TEXT_TYPES})" + "".join(f" or {k}s" for k in numbers)
    raise DataError(f"{label}: column {name!r} (convert.{field_}) has type {t}: expected "
                    f"{allowed}")


def convert_custom(
    table: pa.Table, convert: Convert, label: str, split: str
) -> pa.Table:
    """A user's question/answer table -> verl's 5 columns (DAPO template unless 'none')."""
    n = table.num_rows
    question = _as_text(_column(table, convert.question, label), label, convert.question,
                        "question")
    answer = _as_text(_column(table, convert.answer, label), label, convert.answer, "answer",
                      ("integer", "float", "decimal"))
    for name, col in ((convert.question, question), (convert.answer, answer)):
        bad = pc.or_kleene(pc.is_null(col), _blank(col))
        _raise_first(bad, label, name, "empty or missing value")
    question = question.combine_chunks() if n else pa.array([], pa.string())
    answer = pc.utf8_trim_whitespace(answer).combine_chunks() if n else pa.array([], pa.string())
    if convert.id:
        ids = _as_text(_column(table, convert.id, label), label, convert.id, "id",
                       ("integer",))
        _raise_first(pc.is_null(ids), label, convert.id, "missing id")
        index = ids.combine_chunks() if n else pa.array([], pa.string())
    else:
        index = pa.array([str(i) for i in range(n)], pa.string())
    if convert.template == "dapo":
        content = pc.binary_join_element_wise(DAPO_PREFIX, question, DAPO_SUFFIX, "")
    else:
        content = question
    messages = pa.StructArray.from_arrays(
        [content, pa.array(["user"] * n, pa.string())], names=["content", "role"]
    )
    prompt = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), messages)
    reward_model = pa.StructArray.from_arrays(
        [answer, pa.array([convert.style] * n, pa.string())],
        names=["ground_truth", "style"],
    )
    extra_info = pa.StructArray.from_arrays(
        [index, question, pa.array([split] * n, pa.string())],
        names=["index", "raw_problem", "split"],
    )
    return pa.table(
        {
            "data_source": pa.array([convert.data_source] * n, pa.string()),
            "prompt": prompt,
            "ability": pa.array([convert.ability] * n, pa.string()),
            "reward_model": reward_model,
            "extra_info": extra_info,
        }
    )


# --------------------------------------------------------------------------- validation


def _raise_first(mask: pa.ChunkedArray | pa.Array, label: str, column: str, problem: str,
                 rows: np.ndarray | None = None) -> None:
    """Raise naming the first row where ``mask`` is true (``rows`` maps mask positions to
    table rows, for masks over flattened list elements)."""
    mask = pc.fill_null(mask, True)
    count = pc.sum(mask).as_py() or 0
    if not count:
        return
    pos = int(pc.index(mask, True).as_py())
    row = int(rows[pos]) if rows is not None else pos
    more = f" ({count} {'values' if rows is not None else 'rows'} affected)" if count > 1 else ""
    raise DataError(f"{label}: row {row}, column {column}: {problem}{more}")


def _type_error(label: str, column: str, expected: str, got: pa.DataType) -> DataError:
    return DataError(
        f"{label}: row 0, column {column}: expected {expected}, got {got} (the whole column "
        "has this type)"
    )


def select_columns(table: pa.Table, label: str) -> tuple[pa.Table, list[str]]:
    """Keep verl's 5 columns in order; return the table and the dropped column names."""
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(
            f"{label}: column {', '.join(missing)} missing (verl needs {', '.join(COLUMNS)}; "
            f"found {', '.join(table.column_names)}; a dataset in another shape needs "
            "data.<split>.convert)"
        )
    dropped = [c for c in table.column_names if c not in COLUMNS]
    cols = [plain_text(table[name]) for name in COLUMNS]
    return pa.table(cols, names=list(COLUMNS)), dropped


def validate(table: pa.Table, label: str) -> None:
    """Check every row as verl will use it; raise DataError naming file, row and column."""
    schema = table.schema
    for name in ("data_source", "ability"):
        if not _is_text(schema.field(name).type):
            raise _type_error(label, name, "a string", schema.field(name).type)
    pt = schema.field("prompt").type
    if not (pa.types.is_list(pt) or pa.types.is_large_list(pt)) or not pa.types.is_struct(
        pt.value_type
    ):
        raise _type_error(label, "prompt", "a list of {role, content} messages", pt)
    msg_fields = {f.name: f.type for f in pt.value_type}
    for sub in ("role", "content"):
        if sub not in msg_fields:
            raise DataError(f"{label}: row 0, column prompt.{sub}: missing in the messages")
        if not _is_text(msg_fields[sub]):
            raise _type_error(label, f"prompt.{sub}", "a string", msg_fields[sub])
    rt = schema.field("reward_model").type
    if not pa.types.is_struct(rt):
        raise _type_error(label, "reward_model", "a struct {ground_truth, style}", rt)
    rfields = {f.name: f.type for f in rt}
    for sub in ("ground_truth", "style"):
        if sub not in rfields:
            raise DataError(f"{label}: row 0, column reward_model.{sub}: missing")
        if not _is_text(rfields[sub]):
            raise _type_error(label, f"reward_model.{sub}", "a string", rfields[sub])
    et = schema.field("extra_info").type
    if not pa.types.is_struct(et):
        raise _type_error(label, "extra_info", "a struct", et)

    for name in COLUMNS:
        _raise_first(pc.is_null(table[name]), label, name, "missing value (null)")
    ds = table["data_source"]
    for value in pc.unique(ds).to_pylist():
        if not verl_routes(value):
            _raise_first(
                pc.equal(ds, value), label, "data_source",
                f"{value!r} is not routed by verl's default scorer "
                "(verl.utils.reward_score.default_compute_score would raise NotImplementedError;"
                " use math_dapo, math, math_dapo_reasoning or a name starting with 'aime')",
            )
    for sub in ("ground_truth", "style"):
        col = pc.struct_field(table["reward_model"], sub)
        _raise_first(pc.is_null(col), label, f"reward_model.{sub}", "missing value (null)")
    gt = pc.struct_field(table["reward_model"], "ground_truth")
    _raise_first(_blank(gt), label, "reward_model.ground_truth", "empty ground truth")
    prompt = table["prompt"]
    _raise_first(pc.equal(pc.list_value_length(prompt), 0), label, "prompt",
                 "empty chat (no messages)")
    offset = 0
    for chunk in prompt.chunks:
        if len(chunk):
            parents = pc.list_parent_indices(chunk).to_numpy() + offset
            flat = pc.list_flatten(chunk)
            _raise_first(pc.is_null(flat), label, "prompt", "a null message", parents)
            role = pc.struct_field(flat, "role")
            content = pc.struct_field(flat, "content")
            bad_role = pc.invert(pc.is_in(role, value_set=pa.array(ROLES)))
            first_bad = _first_true(bad_role)
            if first_bad is not None:
                raise DataError(
                    f"{label}: row {int(parents[first_bad])}, column prompt.role: "
                    f"{role[first_bad].as_py()!r} is not one of {', '.join(ROLES)}"
                )
            _raise_first(pc.is_null(content), label, "prompt.content", "missing (null)",
                         parents)
            _raise_first(_blank(content), label, "prompt.content", "empty message", parents)
        offset += len(chunk)


def _blank(strings: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """True for empty or whitespace-only strings (no copy of the text)."""
    return pc.or_(pc.equal(pc.binary_length(strings), 0), pc.utf8_is_space(strings))


def _first_true(mask: pa.Array) -> int | None:
    mask = pc.fill_null(mask, True)
    idx = pc.index(mask, True).as_py()
    return None if idx is None or idx < 0 else int(idx)


# --------------------------------------------------------------------------- prompts


def _chunks(col: pa.ChunkedArray, rows: int = CHUNK_ROWS) -> Iterable[pa.Array]:
    for chunk in col.chunks:
        for start in range(0, len(chunk), rows):
            yield chunk.slice(start, rows)


def prompt_ids(prompt: pa.ChunkedArray) -> np.ndarray:
    """An integer id per row, equal for rows whose prompts have the same roles and contents
    (ids number the distinct prompts in order of first appearance)."""
    ids = np.empty(len(prompt), dtype=np.int64)
    known: dict[str, int] = {}
    pos = 0
    for chunk in _chunks(prompt):
        n = len(chunk)
        if not n:
            continue
        flat = pc.list_flatten(chunk)
        elems = pc.binary_join_element_wise(
            pc.struct_field(flat, "role"), pc.struct_field(flat, "content"), KEY_SEP_FIELD
        )
        offsets = pc.subtract(chunk.offsets, chunk.offsets[0])
        list_type = pa.list_(elems.type)
        if pa.types.is_large_list(chunk.type):
            list_type = pa.large_list(elems.type)
            lists = pa.LargeListArray.from_arrays(offsets, elems)
        else:
            lists = pa.ListArray.from_arrays(offsets, elems)
        assert lists.type == list_type
        keys = pc.binary_join(lists, KEY_SEP_MESSAGE)
        encoded = pc.dictionary_encode(keys)
        local = encoded.dictionary.to_pylist()
        mapping = np.fromiter(
            (known.setdefault(k, len(known)) for k in local), dtype=np.int64, count=len(local)
        )
        ids[pos:pos + n] = mapping[encoded.indices.to_numpy(zero_copy_only=False)]
        pos += n
    return ids


def take_rows(table: pa.Table, indices: np.ndarray) -> pa.Table:
    """``table.take(indices)`` for ascending ``indices`` without concatenating the table's
    chunks first (Arrow's take on chunked list columns does, costing a full copy)."""
    batches, start = [], 0
    for batch in table.to_batches():
        end = start + batch.num_rows
        lo, hi = np.searchsorted(indices, [start, end])
        if hi > lo:
            batches.append(batch.take(pa.array(indices[lo:hi] - start)))
        start = end
    return pa.Table.from_batches(batches, schema=table.schema)


@dataclass
class PromptCounts:
    rows: int
    unique_prompts: int
    duplicates: int


def count_prompts(ids: np.ndarray) -> PromptCounts:
    unique = int(len(np.unique(ids))) if len(ids) else 0
    return PromptCounts(rows=len(ids), unique_prompts=unique, duplicates=len(ids) - unique)


def first_occurrences(ids: np.ndarray) -> np.ndarray:
    """Row indices of the first occurrence of each prompt, in source order."""
    _, first = np.unique(ids, return_index=True)
    return np.sort(first)


def conflicting_answers(ids: np.ndarray, ground_truth: pa.ChunkedArray) -> int:
    """How many prompts occur with more than one distinct ground truth."""
    if not len(ids):
        return 0
    grouped = pa.table({"id": ids, "gt": ground_truth}).group_by("id").aggregate(
        [("gt", "count_distinct")]
    )
    return int(pc.sum(pc.greater(grouped["gt_count_distinct"], 1)).as_py() or 0)


def sample_rows(n: int, limit: int | None, seed: int) -> np.ndarray | None:
    """Seeded choice of ``limit`` of ``n`` rows, returned in ascending order; None = all."""
    if limit is None or limit >= n:
        return None
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=limit, replace=False))


def implied_val_n(repeats: np.ndarray, dedup: bool, explicit: int | None, label: str,
                  key: str = "data.val") -> tuple[int, str]:
    """The validation n verl should use and where it comes from (``key``: the config
    section, ``data.val`` or ``data.heldout``)."""
    if explicit is not None:
        return int(explicit), f"{key}.n"
    if not dedup:
        return 1, "1: every row of the validation file is scored once (no dedup)"
    if not len(repeats):
        return 1, "1: empty validation set"
    lo, hi = int(repeats.min()), int(repeats.max())
    if lo != hi:
        raise DataError(
            f"{label}: cannot infer the validation n: problems repeat unevenly in the source "
            f"({lo} to {hi} times); set {key}.n"
        )
    return lo, f"inferred: each problem repeats {lo} times in the source"


# --------------------------------------------------------------------------- tokens


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise DataError(f"{path}: cannot load the tokenizer: {type(exc).__name__}: {exc}"
                        ) from exc
    if not getattr(tok, "chat_template", None):
        raise DataError(f"{path}: the tokenizer has no chat_template (verl applies it to "
                        "every prompt)")
    return tok


def prompt_token_lengths(tokenizer, conversations: Sequence[list[dict[str, str]]],
                         batch: int = 2048) -> np.ndarray:
    """Token count of each conversation as verl computes it: chat template with the
    generation prompt, tokenized without extra special tokens (batched)."""
    out = np.empty(len(conversations), dtype=np.int64)
    for start in range(0, len(conversations), batch):
        part = list(conversations[start:start + batch])
        ids = tokenizer.apply_chat_template(
            part, add_generation_prompt=True, tokenize=True, return_dict=True,
            tokenizer_kwargs={"return_attention_mask": False},
        )["input_ids"]
        out[start:start + len(part)] = [len(x) for x in ids]
    return out


def length_stats(lengths: np.ndarray, weights: np.ndarray) -> dict[str, Any]:
    """min/p50/p90/p99/max (nearest rank) and mean of ``lengths`` weighted by ``weights``."""
    if not len(lengths):
        return {k: None for k in ("min", "p50", "p90", "p99", "max", "mean")}
    expanded = np.repeat(lengths, weights)
    pct = np.percentile(expanded, [50, 90, 99], method="inverted_cdf")
    return {
        "min": int(expanded.min()),
        "p50": int(pct[0]),
        "p90": int(pct[1]),
        "p99": int(pct[2]),
        "max": int(expanded.max()),
        "mean": round(float(expanded.mean()), 3),
    }


# --------------------------------------------------------------------------- splits


@dataclass
class SplitResult:
    """One prepared split and its summary record (written into summary.json)."""

    table: pa.Table
    record: dict[str, Any] = field(default_factory=dict)
    n: int | None = None  # val, heldout: samples per prompt (summary val_n, heldout_n)
    carved: SplitResult | None = None  # train with a from_train held-out set: that set


@dataclass
class LoadedSplit:
    """A source after load, convert, validate and dedup, before ``limit``."""

    table: pa.Table
    ids: np.ndarray  # each row's prompt id (prompt_ids)
    rows: np.ndarray  # each row's 0-based row number in the source as read
    label: str  # the file or dataset id, as errors name it
    provenance: dict[str, Any]
    dropped: list[str]
    input_counts: PromptCounts
    conflicts: int
    repeats: np.ndarray  # rows of each prompt id in the source

    def take(self, indices: np.ndarray) -> LoadedSplit:
        """Only these rows (ascending ``indices``); the facts about the source stay."""
        return replace(self, table=take_rows(self.table, indices), ids=self.ids[indices],
                       rows=self.rows[indices])


@contextmanager
def _labelled(key: str) -> Iterator[None]:
    """Prefix a DataError raised inside with the config section at fault (``data.val``)."""
    try:
        yield
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from exc


def prepare_split(
    split: str, src: DataSource | HeldoutSource, tokenizer, max_prompt_length: int,
    cache_dir: str | None = None, carve: HeldoutSource | None = None,
) -> SplitResult:
    """Load, convert, validate, dedup and sample one split (``data.<split>``, or
    ``data.heldout`` with its own source as split ``heldout``); errors say which split.
    ``carve`` (``data.heldout`` with from_train) takes its prompts out of this split after
    dedup and before ``limit`` (:func:`carve_heldout`); the result's ``carved`` holds them."""
    key = f"data.{split}"
    with _labelled(key):
        loaded = _load_split(split, src, cache_dir)
    carved = None
    if carve is not None:
        before = len(loaded.ids)
        loaded, held, twins = carve_heldout(loaded, carve.limit, carve.seed, key)
        with _labelled("data.heldout"):
            carved = _finish_split(held, carve, tokenizer, max_prompt_length)
    with _labelled(key):
        result = _finish_split(loaded, src, tokenizer, max_prompt_length)
    if carved is not None:
        result.record["held_out_rows"] = before - len(loaded.ids)
        result.record["held_out_twins"] = twins
        result.carved = carved
    return result


def _load_split(split: str, src: DataSource | HeldoutSource, cache_dir: str | None
                ) -> LoadedSplit:
    source, convert = src.source, src.convert
    raw, provenance = load_source(source, src.revision, convert, cache_dir)
    label = provenance.get("path") or provenance.get("id") or source
    if convert:
        table = convert_custom(raw, convert, label, split)
        dropped = [c for c in raw.column_names
                   if c not in {convert.question, convert.answer, convert.id}]
    else:
        table, dropped = select_columns(raw, label)
    del raw
    if table.num_rows == 0:
        raise DataError(f"{label}: no rows")
    validate(table, label)

    ids = prompt_ids(table["prompt"])
    loaded = LoadedSplit(
        table=table, ids=ids, rows=np.arange(len(ids), dtype=np.int64), label=label,
        provenance=provenance, dropped=dropped, input_counts=count_prompts(ids),
        conflicts=conflicting_answers(ids, pc.struct_field(table["reward_model"],
                                                           "ground_truth")),
        repeats=np.bincount(ids) if len(ids) else np.zeros(0, dtype=np.int64),
    )
    keep = first_occurrences(ids) if src.dedup else None
    if keep is not None and len(keep) < len(ids):
        loaded = loaded.take(keep)
    return loaded


def carve_heldout(loaded: LoadedSplit, limit: int, seed: int, key: str = "data.train"
                  ) -> tuple[LoadedSplit, LoadedSplit, int]:
    """Hold ``limit`` distinct prompts out of ``loaded``, chosen with ``seed`` among its
    distinct prompts in order of first appearance (numpy default_rng, as
    :func:`sample_rows`). Returns (every row whose prompt is none of them nor the same
    problem written another way, the first row of each chosen prompt, both in source
    order; how many other distinct prompts were removed as such twins). Problems are the
    same when their normalised texts are (:func:`hy3rl.problems.problem_key`, preflight's
    held-out check)."""
    from hy3rl.problems import problem_key, user_text

    first = first_occurrences(loaded.ids)
    if limit >= len(first):
        raise DataError(
            f"data.heldout.limit: {limit} prompts to hold out, but {key} ({loaded.label}) has "
            f"{len(first)} distinct prompts after its dedup; at least one must stay for "
            "training"
        )
    held = first[sample_rows(len(first), limit, seed)]
    prompts = take_rows(loaded.table.select(["prompt"]), first)["prompt"].to_pylist()
    keys = [problem_key(user_text(p)) for p in prompts]  # of each distinct prompt id
    held_keys = {keys[i] for i in np.searchsorted(first, held)}
    gone = loaded.ids[first][[k in held_keys for k in keys]]
    keep = np.flatnonzero(~np.isin(loaded.ids, gone))
    return loaded.take(keep), loaded.take(held), len(gone) - len(held)


def check_problem_ids(table: pa.Table, ids: np.ndarray, rows: np.ndarray, label: str
                      ) -> None:
    """Each held-out problem (a distinct prompt) has its own ``extra_info.index``: the
    evaluation keys problems by it. ``rows`` are the source row numbers errors name."""
    if not len(ids):
        return
    et = table.schema.field("extra_info").type
    names = {f.name: f.type for f in et}
    if "index" not in names:
        raise DataError(
            f"{label}: row {int(rows[0])}, column extra_info.index: missing (the evaluation "
            "keys held-out problems by it; a converted source takes it from convert.id or the "
            "row number)"
        )
    if not (_is_text(names["index"]) or pa.types.is_integer(names["index"])):
        raise _type_error(label, "extra_info.index", "a string or an integer (a problem id)",
                          names["index"])
    index = pc.struct_field(table["extra_info"], "index")
    _raise_first(pc.is_null(index), label, "extra_info.index", "missing problem id (null)",
                 rows)
    owner: dict[Any, int] = {}
    for pos, pid in enumerate(index.to_pylist()):
        first = owner.setdefault(pid, pos)
        if ids[first] != ids[pos]:
            raise DataError(
                f"{label}: row {int(rows[pos])}, column extra_info.index: problem id {pid!r} "
                f"is also row {int(rows[first])}'s, whose prompt differs (the evaluation keys "
                "held-out problems by extra_info.index)"
            )


def _samples_per_prompt(src: DataSource | HeldoutSource, loaded: LoadedSplit
                        ) -> tuple[int | None, str | None]:
    """val and heldout: the n to record and where it comes from; (None, None) for train."""
    if isinstance(src, ValSource):
        return implied_val_n(loaded.repeats, src.dedup, src.n, loaded.label)
    if isinstance(src, HeldoutSource):
        if not src.from_train:
            return implied_val_n(loaded.repeats, src.dedup, src.n, loaded.label,
                                 "data.heldout")
        if src.n is not None:
            return int(src.n), "data.heldout.n"
        return 1, "1: one row per prompt carved out of data.train"
    return None, None


def _finish_split(loaded: LoadedSplit, src: DataSource | HeldoutSource, tokenizer,
                  max_prompt_length: int) -> SplitResult:
    """Sample ``limit`` rows (not for a carved set: it holds its ``limit`` prompts
    already), count prompt tokens and build the summary record."""
    table, ids, rows = loaded.table, loaded.ids, loaded.rows
    carved = isinstance(src, HeldoutSource) and src.from_train
    chosen = None if carved else sample_rows(len(ids), src.limit, src.seed)
    if chosen is not None:
        table, ids, rows = take_rows(table, chosen), ids[chosen], rows[chosen]
    table = table.replace_schema_metadata(None)
    if isinstance(src, HeldoutSource):
        check_problem_ids(table, ids, rows, loaded.label)
    n, n_source = _samples_per_prompt(src, loaded)

    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    order = np.argsort(first)  # tokenize each distinct prompt once, in file order
    first, counts = first[order], counts[order]
    conversations = take_rows(table.select(["prompt"]), first)["prompt"].to_pylist()
    lengths = prompt_token_lengths(tokenizer, conversations)
    over = lengths > max_prompt_length
    sources = pc.value_counts(table["data_source"]).to_pylist()
    record: dict[str, Any] = {
        **asdict(PromptCounts(len(ids), len(uniq), len(ids) - len(uniq))),
        "data_sources": {d["values"]: d["counts"] for d in sources},
        "prompt_tokens": length_stats(lengths, counts),
        "over_max_prompt_length": {
            "rows": int(counts[over].sum()),
            "unique_prompts": int(over.sum()),
            "max_prompt_length": max_prompt_length,
            "note": TRUNCATION_NOTE,
        },
        "input": {
            **asdict(loaded.input_counts),
            "dropped_columns": loaded.dropped,
            "prompts_with_conflicting_answers": loaded.conflicts,
        },
        "options": {
            "dedup": src.dedup, "limit": src.limit, "seed": src.seed,
            "convert": asdict(src.convert) if src.convert else None,
        },
        "source": loaded.provenance,
    }
    if isinstance(src, ValSource):
        record["options"]["n"] = src.n
        record.update(val_n=n, val_n_source=n_source)
    if isinstance(src, HeldoutSource):
        record["options"]["n"] = src.n
        record = {"name": src.name, "from_train": src.from_train, **record,
                  "heldout_n": n, "heldout_n_source": n_source}
        if carved:
            record["carved_prompts"] = len(uniq)
    return SplitResult(table=table, record=record, n=n)


# --------------------------------------------------------------------------- outputs


def _tmp_path(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)


def write_outputs(
    tables: Mapping[str, pa.Table], outs: Mapping[str, Path], summary: dict[str, Any],
    summary_path: Path,
) -> dict[str, Any]:
    """Write the parquet files and the summary (with their hashes): all or none."""
    temps: dict[Path, Path] = {}
    try:
        for split, table in tables.items():
            final = Path(outs[split])
            tmp = _tmp_path(final)
            temps[final] = tmp
            pq.write_table(table, tmp)
            rec = summary["splits"][split]
            rec["path"] = str(final)
            rec["sha256"] = sha256_file(tmp)
            rec["bytes"] = tmp.stat().st_size
        tmp = _tmp_path(Path(summary_path))
        temps[Path(summary_path)] = tmp
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
        for final, tmp in temps.items():  # summary last: it vouches for the others
            os.replace(tmp, final)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return summary


def run(
    data: Data, *, tokenizer: str | Path, train: Path, val: Path, summary: Path,
    heldout: Path | None = None, cache_dir: str | None = None,
) -> dict[str, Any]:
    """The whole stage: ``data.train`` and ``data.val`` -> the ``train`` and ``val`` parquet
    files and ``summary``, plus ``data.heldout`` -> ``heldout`` when that is set (all or
    none), prompt tokens counted with the tokenizer of the model directory ``tokenizer``;
    ``cache_dir`` is the ``datasets`` cache (None: the Hugging Face default). Returns the
    summary written."""
    spec = data.heldout
    if (spec is None) != (heldout is None):
        raise DataError(
            "data.heldout: set, but no path was given for its parquet file (run(heldout=...))"
            if spec is not None else
            "data.heldout: null, but a path was given for its parquet file (run(heldout=...))"
        )
    tok = load_tokenizer(str(tokenizer))
    carve = spec if spec is not None and spec.from_train else None
    results = {
        "train": prepare_split("train", data.train, tok, data.max_prompt_length, cache_dir,
                               carve=carve),
        "val": prepare_split("val", data.val, tok, data.max_prompt_length, cache_dir),
    }
    if carve is not None:
        results["heldout"] = results["train"].carved
    elif spec is not None:
        results["heldout"] = prepare_split("heldout", spec, tok, data.max_prompt_length,
                                           cache_dir)
    template = tok.chat_template
    doc: dict[str, Any] = {
        "format": SUMMARY_FORMAT,
        "max_prompt_length": data.max_prompt_length,
        "val_n": results["val"].n,
        "heldout_n": results["heldout"].n if "heldout" in results else None,
        "tokenizer": {
            "path": str(tokenizer),
            "class": type(tok).__name__,
            "chat_template_sha256": hashlib.sha256(
                (template if isinstance(template, str) else json.dumps(template)).encode()
            ).hexdigest(),
            "method": "apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)"
            " as verl's RLHFDataset; each unique prompt once, weighted by its rows",
        },
        "splits": {split: res.record for split, res in results.items()},
    }
    outs = {"train": Path(train), "val": Path(val)}
    if heldout is not None:
        outs["heldout"] = Path(heldout)
    write_outputs({s: r.table for s, r in results.items()}, outs, doc, Path(summary))
    for split, rec in doc["splits"].items():
        tokens = rec["prompt_tokens"]
        log.info("%s: %d rows (%d unique prompts) from %d source rows; prompt tokens p50 %s "
                 "max %s; %d rows over %d -> %s", split, rec["rows"], rec["unique_prompts"],
                 rec["input"]["rows"], tokens["p50"], tokens["max"],
                 rec["over_max_prompt_length"]["rows"], data.max_prompt_length, rec["path"])
    if carve is not None:
        log.info("heldout %s: %d prompts carved out of train (%d train rows removed)",
                 carve.name, carve.limit, doc["splits"]["train"]["held_out_rows"])
    log.info("val_n: %s; heldout_n: %s; summary -> %s", doc["val_n"], doc["heldout_n"],
             summary)
    return doc
