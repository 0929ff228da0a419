"""Stage `data` on real files made in the tests: parquet / JSONL / CSV in DAPO-Math-17k and
AIME-2024 shapes, a real BPE tokenizer with a chat template, `run()` in-process, `hy3rl data`
and the real rule."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from fixtures.common import REPO_ROOT, run_snakemake
from fixtures.data import (
    AIME_ANSWERS,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    aime_rows,
    dapo_problem,
    dapo_rows,
    write_jsonl,
    write_parquet,
)
from hy3rl import cli, data
from hy3rl.config import ConfigError
from hy3rl.layout import Layout
from hy3rl.settings import Config

COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def data_section(train: dict, val: dict, max_prompt_length: int = 2048,
                 heldout: dict | None = None):
    """The typed `data` section: these splits over the schema's defaults only."""
    return Config.from_dict({"data": {"max_prompt_length": max_prompt_length, "train": train,
                                      "val": val, "heldout": heldout}}).data


def run_stage(tmp_path: Path, tokenizer: Path, train: dict, val: dict,
              max_prompt_length: int = 2048, heldout: dict | None = None
              ) -> tuple[str | None, Path]:
    """run() in-process into ``tmp_path/out``; returns the DataError's message (None when
    the stage succeeded) and the output directory."""
    out = tmp_path / "out"
    try:
        data.run(data_section(train, val, max_prompt_length, heldout),
                 tokenizer=str(tokenizer), train=out / "train.parquet",
                 val=out / "val.parquet", summary=out / "summary.json",
                 heldout=out / "heldout.parquet" if heldout else None,
                 cache_dir=str(tmp_path / "hf-cache"))
    except data.DataError as exc:
        return str(exc), out
    return None, out


def read_summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verl_lengths(tokenizer_dir: Path, prompts: list) -> list[int]:
    """Independent count: verl's per-row call (RLHFDataset.doc2len), one prompt at a time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [len(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)) for p in prompts]


def nearest_rank(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    return {
        # 20 prompts x 100 (whole blocks repeated, as DAPO-Math-17k) + a pandas index column
        "dapo": write_parquet(src / "dapo-math-17k.parquet", dapo_rows(20, 100),
                              pandas_index=True),
        "aime": write_parquet(src / "aime-2024.parquet", aime_rows(32), pandas_index=True),
    }


def test_paper_shape_keeps_file_as_is_and_summary_matches_independent_count(
    tmp_path, files, tiny_tokenizer_dir
):
    """The published setting: both files as they are (no dedup), val_n 1."""
    err, out = run_stage(tmp_path, tiny_tokenizer_dir,
                         {"source": str(files["dapo"]), "dedup": False},
                         {"source": str(files["aime"]), "dedup": False}, max_prompt_length=200)
    assert err is None, err
    summary = read_summary(out)
    train = pq.read_table(out / "train.parquet")
    val = pq.read_table(out / "val.parquet")
    assert train.column_names == COLUMNS and val.column_names == COLUMNS
    assert train.schema.metadata is None  # no pandas index re-created on read
    assert train.num_rows == 2000 and val.num_rows == 960
    assert pa.types.is_string(train.schema.field("data_source").type)
    src_rows = dapo_rows(20, 100)
    assert train.to_pylist() == src_rows  # content and order preserved exactly
    assert summary["val_n"] == 1 and summary["splits"]["val"]["val_n"] == 1

    rec = summary["splits"]["train"]
    assert (rec["rows"], rec["unique_prompts"], rec["duplicates"]) == (2000, 20, 1980)
    assert rec["input"]["dropped_columns"] == ["__index_level_0__"]
    assert rec["input"]["prompts_with_conflicting_answers"] == 0
    assert rec["data_sources"] == {"math_dapo": 2000}
    lengths = verl_lengths(tiny_tokenizer_dir, [r["prompt"] for r in src_rows])
    tok = rec["prompt_tokens"]
    assert tok["min"] == min(lengths) and tok["max"] == max(lengths)
    for q in (50, 90, 99):
        assert tok[f"p{q}"] == nearest_rank(lengths, q), q
    assert tok["mean"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-3)
    over = [n for n in lengths if n > 200]
    assert 0 < len(over) < len(lengths)  # the fixture straddles the limit
    assert rec["over_max_prompt_length"]["rows"] == len(over)
    assert rec["over_max_prompt_length"]["unique_prompts"] == len(over) // 100
    assert "left-truncates" in rec["over_max_prompt_length"]["note"]

    for split in ("train", "val"):
        r = summary["splits"][split]
        assert r["sha256"] == sha256(out / f"{split}.parquet")
        assert r["bytes"] == (out / f"{split}.parquet").stat().st_size
    assert rec["source"] == {"kind": "file", "path": str(files["dapo"]), "format": "parquet",
                             "sha256": sha256(files["dapo"])}
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "train.parquet",
                                                     "val.parquet"]
    # data.heldout null: no held-out file, no held-out record, heldout_n null
    assert summary["heldout_n"] is None and sorted(summary["splits"]) == ["train", "val"]
    assert "held_out_rows" not in rec


def test_dedup_keeps_first_occurrences_and_aime_problem_mode(tmp_path, files,
                                                            tiny_tokenizer_dir):
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"])})
    assert err is None, err
    summary = read_summary(out)
    train = pq.read_table(out / "train.parquet").to_pylist()
    assert train == dapo_rows(20, 1)
    rec = summary["splits"]["train"]
    assert (rec["rows"], rec["unique_prompts"], rec["duplicates"]) == (20, 20, 0)
    assert (rec["input"]["rows"], rec["input"]["unique_prompts"]) == (2000, 20)
    # 30 problems, kept apart even though two share the answer 104; n = 32 repeats.
    val = pq.read_table(out / "val.parquet").to_pylist()
    assert len(val) == 30
    assert sorted(r["extra_info"]["index"] for r in val) == list(range(30))
    assert sorted(r["reward_model"]["ground_truth"] for r in val) == sorted(
        str(a) for a in AIME_ANSWERS)
    assert [r["reward_model"]["ground_truth"] for r in val].count("104") == 2
    assert summary["val_n"] == 32
    assert "32" in summary["splits"]["val"]["val_n_source"]
    lengths = verl_lengths(tiny_tokenizer_dir, [r["prompt"] for r in val])
    assert summary["splits"]["val"]["prompt_tokens"]["max"] == max(lengths)


def test_explicit_and_uneven_val_n(tmp_path, files, tiny_tokenizer_dir):
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"]), "n": 16})
    assert err is None and read_summary(out)["val_n"] == 16
    rows = aime_rows(32)[:-1]  # one problem now repeats 31 times
    uneven = write_parquet(tmp_path / "uneven.parquet", rows)
    err, out2 = run_stage(tmp_path / "b", tiny_tokenizer_dir, {"source": str(files["dapo"])},
                          {"source": str(uneven)})
    assert "cannot infer the validation n" in err and not out2.exists()


def test_seeded_sample_is_reproducible_and_in_source_order(tmp_path, files,
                                                           tiny_tokenizer_dir):
    train = {"source": str(files["dapo"]), "dedup": False, "limit": 50, "seed": 7}
    val = {"source": str(files["aime"]), "limit": 5, "seed": 1}
    err_a, out_a = run_stage(tmp_path / "a", tiny_tokenizer_dir, train, val)
    err_b, out_b = run_stage(tmp_path / "b", tiny_tokenizer_dir, train, val)
    err_c, out_c = run_stage(tmp_path / "c", tiny_tokenizer_dir, {**train, "seed": 8}, val)
    assert err_a is err_b is err_c is None, (err_a, err_b, err_c)
    assert sha256(out_a / "train.parquet") == sha256(out_b / "train.parquet")
    assert sha256(out_a / "train.parquet") != sha256(out_c / "train.parquet")
    rows = pq.read_table(out_a / "train.parquet").to_pylist()
    assert len(rows) == 50
    source = dapo_rows(20, 100)
    expected = np.sort(np.random.default_rng(7).choice(2000, 50, replace=False))
    assert rows == [source[i] for i in expected]
    summary = read_summary(out_a)
    assert summary["splits"]["val"]["rows"] == 5 and summary["val_n"] == 32
    assert summary["splits"]["train"]["options"]["limit"] == 50


def test_jsonl_source_and_custom_conversions(tmp_path, files, tiny_tokenizer_dir):
    jsonl = write_jsonl(tmp_path / "dapo.jsonl", dapo_rows(6, 2))
    # A user's own CSV: "025" must stay text, negative answers kept, ids mapped.
    csv = tmp_path / "mine.csv"
    csv.write_text('uid,problem,answer,other\n'
                   'a1,"What is 5*5, written with three digits?",025,x\n'
                   'a2,Compute 3 - 10.,-7,y\n')
    err, out = run_stage(
        tmp_path, tiny_tokenizer_dir, {"source": str(jsonl), "dedup": False},
        {"source": str(csv), "convert": {"question": "problem", "answer": "answer",
                                         "id": "uid"}},
    )
    assert err is None, err
    assert pq.read_table(out / "train.parquet").to_pylist() == dapo_rows(6, 2)
    val = pq.read_table(out / "val.parquet").to_pylist()
    assert val[0] == {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + "What is 5*5, written with three digits?"
                    + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "025", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a1", "raw_problem": "What is 5*5, written with three digits?",
                       "split": "val"},
    }
    assert val[1]["reward_model"]["ground_truth"] == "-7"
    summary = read_summary(out)
    assert summary["splits"]["val"]["input"]["dropped_columns"] == ["other"]
    assert summary["splits"]["train"]["source"]["format"] == "jsonl"
    assert summary["splits"]["val"]["source"]["sha256"] == sha256(csv)

    # JSONL with numeric answers, no id field, template none, another routed data_source.
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"q": "Find x if x+1=0.", "a": -1},
                                                 {"q": "Find y if 2y=208.", "a": 104}])
    par = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"question": ["What is 1+1?"], "solution": [2]}), par)
    err, out2 = run_stage(
        tmp_path / "two", tiny_tokenizer_dir,
        {"source": str(mine), "convert": {"question": "q", "answer": "a", "template": "none",
                                          "data_source": "aime2024"}},
        {"source": str(par), "convert": {"question": "question", "answer": "solution"}},
    )
    assert err is None, err
    train = pq.read_table(out2 / "train.parquet").to_pylist()
    assert [r["prompt"][0]["content"] for r in train] == ["Find x if x+1=0.",
                                                          "Find y if 2y=208."]
    assert [r["reward_model"]["ground_truth"] for r in train] == ["-1", "104"]
    assert [r["extra_info"]["index"] for r in train] == ["0", "1"]
    assert {r["data_source"] for r in train} == {"aime2024"}
    val = pq.read_table(out2 / "val.parquet").to_pylist()
    assert val[0]["reward_model"]["ground_truth"] == "2"
    assert val[0]["prompt"][0]["content"].startswith(DAPO_PREFIX)


BAD_CASES = {
    # name: (make the bad source file, expected message fragments)
    "missing_column": (
        lambda d: write_parquet(d / "bad.parquet", [
            {k: v for k, v in r.items() if k != "ability"} for r in dapo_rows(3)]),
        ["column ability missing"]),
    "wrong_type": (
        lambda d: write_jsonl(d / "bad.jsonl", [
            {**r, "reward_model": {"ground_truth": 34, "style": "s"}} for r in dapo_rows(3)]),
        ["row 0", "column reward_model.ground_truth", "expected a string, got int64"]),
    "mixed_type_jsonl": (
        lambda d: write_jsonl(d / "bad.jsonl", [
            *dapo_rows(3), {**dapo_rows(1)[0], "reward_model": {"ground_truth": 5,
                                                                 "style": "s"}}]),
        ["row 3", "column reward_model.ground_truth"]),
    "empty_answer": (
        lambda d: write_parquet(d / "bad.parquet", [
            *dapo_rows(4), {**dapo_rows(5)[4], "reward_model": {"ground_truth": " ",
                                                                 "style": "s"}}]),
        ["row 4", "column reward_model.ground_truth", "empty ground truth"]),
    "bad_role": (
        lambda d: write_parquet(d / "bad.parquet", [
            *dapo_rows(2), {**dapo_rows(3)[2], "prompt": [
                {"content": "sys", "role": "system"}, {"content": "hi", "role": "human"}]}]),
        ["row 2", "column prompt.role", "'human'"]),
    "empty_prompt": (
        lambda d: write_parquet(d / "bad.parquet", [*dapo_rows(2), {**dapo_rows(1)[0],
                                                                   "prompt": []}]),
        ["row 2", "column prompt", "no messages"]),
    "empty_content": (
        lambda d: write_parquet(d / "bad.parquet", [
            {**dapo_rows(1)[0], "prompt": [{"content": "", "role": "user"}]}, *dapo_rows(2)]),
        ["row 0", "column prompt.content", "empty message"]),
    "unroutable_source": (
        lambda d: write_parquet(d / "bad.parquet", [
            *dapo_rows(5), {**dapo_rows(6)[5], "data_source": "gsm8k"}]),
        ["row 5", "column data_source", "'gsm8k'", "NotImplementedError"]),
    "prompt_as_text": (
        lambda d: write_parquet(d / "bad.parquet", [
            {**r, "prompt": r["prompt"][0]["content"]} for r in dapo_rows(2)]),
        ["row 0", "column prompt", "list of {role, content}"]),
    "unreadable_file": (
        lambda d: (d / "bad.parquet").write_bytes(b"PAR1 this is not parquet") and (
            d / "bad.parquet"),
        ["cannot read as parquet"]),
    "missing_file": (lambda d: d / "nope.parquet", ["no such file"]),
    "csv_without_convert": (
        lambda d: (d / "bad.csv").write_text(
            "data_source,prompt,ability,reward_model,extra_info\nmath_dapo,hi,MATH,1,{}\n")
        and d / "bad.csv",
        ["row 0", "column prompt", "list of {role, content}"]),
    "broken_jsonl": (
        lambda d: (d / "bad.jsonl").write_text(
            json.dumps(dapo_rows(1)[0]) + "\n{not json\n") and d / "bad.jsonl",
        ["line 2 (row 1)", "not valid JSON"]),
    "data_source_not_text": (
        lambda d: write_parquet(d / "bad.parquet", [
            {**r, "data_source": 7} for r in dapo_rows(2)]),
        ["row 0", "column data_source", "expected a string, got int64"]),
    "extra_info_not_struct": (
        lambda d: write_parquet(d / "bad.parquet", [
            {**r, "extra_info": "idx"} for r in dapo_rows(2)]),
        ["row 0", "column extra_info", "expected a struct"]),
    "null_message_role": (
        lambda d: write_parquet(d / "bad.parquet", [
            *dapo_rows(3), {**dapo_rows(4)[3], "prompt": [{"content": "hi", "role": None}]}]),
        ["row 3", "column prompt.role", "None is not one of"]),
    "null_ground_truth": (
        lambda d: write_parquet(d / "bad.parquet", [
            *dapo_rows(1), {**dapo_rows(2)[1], "reward_model": {"ground_truth": None,
                                                                 "style": "s"}}]),
        ["row 1", "column reward_model.ground_truth", "null"]),
}


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("split", ["train", "val"])
def test_bad_input_names_file_row_column_and_leaves_nothing(
    case, split, tmp_path, files, tiny_tokenizer_dir
):
    make, fragments = BAD_CASES[case]
    src = tmp_path / "bad"
    src.mkdir()
    bad = make(src)
    good = {"train": {"source": str(files["dapo"])}, "val": {"source": str(files["aime"])}}
    good[split] = {"source": str(bad)}
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, good["train"], good["val"])
    assert err is not None
    assert err.startswith(f"data.{split}: "), err
    assert str(bad) in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert not out.exists() or list(out.iterdir()) == []  # no outputs, no temp files


def test_custom_conversion_errors(tmp_path, files, tiny_tokenizer_dir):
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"q": "a?", "a": 1}, {"q": "b?", "a": None}])
    err, out = run_stage(tmp_path, tiny_tokenizer_dir,
                         {"source": str(mine), "convert": {"question": "q", "answer": "a"}},
                         {"source": str(files["aime"])})
    assert err and f"{mine}: row 1, column a: empty or missing value" in err
    err, out = run_stage(
        tmp_path, tiny_tokenizer_dir,
        {"source": str(mine), "convert": {"question": "question", "answer": "a"}},
        {"source": str(files["aime"])})
    assert err and f"{mine}: column 'question' missing" in err
    assert not out.exists() or list(out.iterdir()) == []
    listy = tmp_path / "listy.parquet"
    pq.write_table(pa.table({"q": ["a?", "b?"], "a": [[1, 2], [3]]}), listy)
    err, out = run_stage(tmp_path, tiny_tokenizer_dir,
                         {"source": str(listy), "convert": {"question": "q", "answer": "a"}},
                         {"source": str(files["aime"])})
    assert err == (f"data.train: {listy}: column 'a' (convert.answer) has type list<element: "
                   "int64>: expected text (string, large_string or string_view) or integers "
                   "or floats or decimals"), err
    assert not out.exists() or list(out.iterdir()) == []


# ---- custom data from every common writer (issue 27, item 13) ----

QA = {"q": ["Find x if x+1=0.", "What is 5*5, written with three digits?", "Compute 3 - 10."],
      "a": ["-1", "025", "-7"], "id": ["I-1", "I-2", "II-1"]}
QA_CONVERT = {"question": "q", "answer": "a", "id": "id"}


def _pandas(dtype):
    def write(path: Path) -> None:
        import pandas as pd

        pd.DataFrame({k: pd.Series(v, dtype=dtype) for k, v in QA.items()}).to_parquet(path)
    return write


def _pyarrow(text_type: pa.DataType):
    def write(path: Path) -> None:
        pq.write_table(pa.table({k: pa.array(v, text_type) for k, v in QA.items()}), path)
    return write


def _datasets(path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict(QA).to_parquet(str(path))


WRITERS = {  # writer -> (write QA to a parquet file, the Arrow type its text is read back as)
    "pandas3_default_str": (_pandas(None), pa.large_string()),
    "pandas3_string_dtype": (_pandas("string"), pa.large_string()),
    "pandas_python_strings": (_pandas("string[python]"), pa.string()),
    "pandas_categorical": (_pandas("category"), pa.dictionary(pa.int8(), pa.string())),
    "pyarrow_string": (_pyarrow(pa.string()), pa.string()),
    "pyarrow_large_string": (_pyarrow(pa.large_string()), pa.large_string()),
    "pyarrow_string_view_as_polars": (_pyarrow(pa.string_view()), pa.string_view()),
    "datasets_to_parquet": (_datasets, pa.string()),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_custom_parquet_of_every_writer_converts_to_the_same_rows(writer, tmp_path):
    write, text_type = WRITERS[writer]
    path = tmp_path / f"{writer}.parquet"
    write(path)
    assert pq.read_schema(path).field("q").type == text_type  # the writer's own type
    reference = tmp_path / "reference.parquet"
    _pyarrow(pa.string())(reference)
    convert = data_section({"source": str(path), "convert": QA_CONVERT},
                           {"source": "x"}).train.convert
    tables = [data.convert_custom(data.read_file(f, convert)[0], convert, str(f), "heldout")
              for f in (path, reference)]
    assert tables[0].schema == tables[1].schema and tables[0].equals(tables[1])
    rows = tables[0].to_pylist()
    assert [r["extra_info"] for r in rows] == [
        {"index": i, "raw_problem": q, "split": "heldout"}
        for i, q in zip(QA["id"], QA["q"], strict=True)]
    assert [r["prompt"][0]["content"] for r in rows] == [DAPO_PREFIX + q + DAPO_SUFFIX
                                                         for q in QA["q"]]
    assert [r["reward_model"]["ground_truth"] for r in rows] == QA["a"]


def test_verl_format_file_with_large_and_view_strings_reads_as_string(tmp_path):
    """A verl-format file whose text is large_string (pandas 3) throughout, or string_view
    (polars) in its top-level columns (pyarrow writes no nested string_view): the same rows,
    verl's string types, one prompt id per problem."""
    rows = aime_rows(repeats=1)
    plain = pa.Table.from_pylist(rows)
    for nested, top in ((pa.large_string(), pa.large_string()),
                        (pa.large_string(), pa.string_view())):
        schema = pa.schema([f.with_type(top if pa.types.is_string(f.type) else
                                        _with_text(f.type, nested)) for f in plain.schema])
        path = tmp_path / f"{top}.parquet"
        pq.write_table(plain.cast(schema), path)
        assert pq.read_schema(path).field("data_source").type == top
        table, _ = data.select_columns(data.read_file(path)[0], str(path))
        data.validate(table, str(path))
        assert table.schema == plain.schema and table.to_pylist() == rows
        assert len(set(data.prompt_ids(table["prompt"]))) == 30


def _with_text(t: pa.DataType, text: pa.DataType) -> pa.DataType:
    if pa.types.is_string(t):
        return text
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_with_text(f.type, text)) for f in t])
    if pa.types.is_list(t):
        return pa.list_(_with_text(t.value_type, text))
    return t


def test_pandas3_file_through_hy3rl_data_end_to_end(tmp_path, files, tiny_tokenizer_dir,
                                                  monkeypatch, capsys):
    """`hy3rl data` (the stage's entry point, in this process) with a held-out set and a
    training set that pandas 3 wrote (large_string text, numeric answers): every output
    written, verl's string types, the rows converted."""
    import pandas as pd

    work = tmp_path / "work"
    work.mkdir()
    held = work / "aime-2025-pandas3.parquet"
    pd.DataFrame({"problem": QA["q"], "answer": [-1, 25, -7], "id": QA["id"]}).to_parquet(held)
    mine = work / "mine-pandas3.parquet"
    pd.DataFrame({"question": [dapo_problem(i) for i in range(5)],
                  "solution": [str(i) for i in range(5)]}).to_parquet(mine)
    assert pq.read_schema(held).field("problem").type == pa.large_string()
    override = {"run": {"name": "t"}, "model": {"source": str(tiny_tokenizer_dir)},
                "data": {"train": {"source": str(mine), "limit": None,
                                   "convert": {"question": "question", "answer": "solution"}},
                         "val": {"source": str(files["aime"])},
                         "heldout": {"name": "aime2025", "source": str(held),
                                     "from_train": False, "limit": None,
                                     "convert": {"question": "problem", "answer": "answer",
                                                 "id": "id"}}}}
    (work / "config.yaml").write_text(yaml.safe_dump(override))
    monkeypatch.chdir(work)
    assert cli.main(["data", "--configfile", str(work / "config.yaml")]) == 0, \
        capsys.readouterr().err
    layout = Layout("results", "t")
    summary = json.loads((work / layout.data_summary).read_text())
    heldout = pq.read_table(work / layout.data_heldout)
    assert heldout.schema == pq.read_table(work / layout.data_train).schema
    assert heldout.to_pylist() == [{
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + q + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": i, "raw_problem": q, "split": "heldout"},
    } for q, a, i in zip(QA["q"], ["-1", "25", "-7"], QA["id"], strict=True)]
    assert summary["splits"]["heldout"]["rows"] == 3 and summary["heldout_n"] == 1
    assert summary["splits"]["heldout"]["source"]["sha256"] == sha256(held)
    assert summary["splits"]["train"]["rows"] == 5
    assert [r["extra_info"]["raw_problem"] for r in
            pq.read_table(work / layout.data_train).to_pylist()] == [dapo_problem(i)
                                                                     for i in range(5)]


UNSUPPORTED = {  # column values -> (convert field, the type named in the refusal)
    "int_question": ({"q": [1, 2, 3]}, "question", "int64"),
    "list_question": ({"q": [["a"], ["b"], ["c"]]}, "question", "list<element: string>"),
    "struct_answer": ({"a": [{"v": 1}, {"v": 2}, {"v": 3}]}, "answer", "struct<v: int64>"),
    "float_id": ({"id": [1.5, 2.5, 3.5]}, "id", "double"),
    "binary_question": ({"q": [b"a", b"b", b"c"]}, "question", "binary"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_column_type_is_refused_naming_file_column_and_type(
        case, tmp_path, files, tiny_tokenizer_dir):
    values, field_, type_name = UNSUPPORTED[case]
    path = tmp_path / "mine.parquet"
    pq.write_table(pa.table({**QA, **values}), path)
    column = QA_CONVERT[field_]
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"])},
                         heldout={"name": "mine", "source": str(path), "convert": QA_CONVERT})
    assert err is not None and err.startswith(
        f"data.heldout: {path}: column {column!r} (convert.{field_}) has type {type_name}: "
        "expected text (string, large_string or string_view)"), err
    assert not out.exists() or list(out.iterdir()) == []


def test_existing_outputs_survive_a_failed_rerun(tmp_path, files, tiny_tokenizer_dir):
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"])})
    before = {p.name: sha256(p) for p in out.iterdir()}
    err2, _ = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(files["dapo"])},
                        {"source": str(tmp_path / "missing.parquet")})
    assert err is None and "no such file" in err2
    assert {p.name: sha256(p) for p in out.iterdir()} == before  # the old triple, intact


def test_verl_routing():
    for ok in ("math_dapo", "math", "math_dapo_reasoning", "aime", "aime2024", "aime_2025",
               "openai/gsm8k", "HuggingFaceH4/MATH-500", "numina_olympiads", "searchR1_nq"):
        assert data.verl_routes(ok), ok
    for bad in ("gsm8k", "MATH", "", "AIME2024", "math-dapo", "DAPO"):
        assert not data.verl_routes(bad), bad


def test_source_kinds_and_hub_arguments(tmp_path):
    (tmp_path / "repo").mkdir()
    assert data.source_kind(str(tmp_path / "repo")) == "directory"
    assert data.source_kind(str(tmp_path / "not-yet.parquet")) == "file"
    assert data.source_kind("BytedTsinghua-SIA/DAPO-Math-17k") == "hub"
    assert data.local_source_path("BytedTsinghua-SIA/AIME-2024") is None
    assert data.hub_load_kwargs("BytedTsinghua-SIA/AIME-2024", "abc", "/c") == {
        "path": "BytedTsinghua-SIA/AIME-2024", "name": "default", "revision": "abc",
        "cache_dir": "/c"}


def test_local_dataset_repository_through_datasets(tmp_path, tiny_tokenizer_dir):
    """A directory laid out like the hub repository (an offline mirror) goes through the
    real datasets.load_dataset(path, "default", split="train")."""
    repo = tmp_path / "AIME-2024"
    write_parquet(repo / "data" / "aime-2024.parquet", aime_rows(32), pandas_index=True)
    train_repo = tmp_path / "DAPO-Math-17k"
    write_parquet(train_repo / "data" / "dapo-math-17k.parquet", dapo_rows(10, 3))
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(train_repo)},
                         {"source": str(repo)})
    assert err is None, err
    summary = read_summary(out)
    src = summary["splits"]["val"]["source"]
    assert src["kind"] == "directory" and src["config"] == "default"
    assert src["files"] == [{"path": str(repo / "data" / "aime-2024.parquet"),
                             "sha256": sha256(repo / "data" / "aime-2024.parquet")}]
    assert src["fingerprint"]
    assert summary["val_n"] == 32 and summary["splits"]["val"]["rows"] == 30
    assert summary["splits"]["val"]["input"]["dropped_columns"] == ["__index_level_0__"]
    assert pq.read_table(out / "train.parquet").to_pylist() == dapo_rows(10, 1)


def hy3rl_data(work: Path, override: dict, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    """`hy3rl data --configfile <work>/config.yaml` run from ``work`` (its own process)."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "config.yaml"
    cfg.write_text(yaml.safe_dump(override))
    return subprocess.run(
        [sys.executable, "-m", "hy3rl.cli", "data", "--configfile", str(cfg)],
        capture_output=True, text=True, cwd=work, timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_hub_source_offline_is_a_clear_error(tmp_path, tiny_tokenizer_dir):
    """The hub path itself cannot run here (no network); offline it must fail clearly,
    naming the dataset id, and leave nothing behind."""
    override = {"run": {"name": "t"}, "model": {"source": str(tiny_tokenizer_dir)},
                "data": {"train": {"source": "BytedTsinghua-SIA/DAPO-Math-17k"},
                         "val": {"source": "BytedTsinghua-SIA/AIME-2024"}}}
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    work = tmp_path / "work"
    proc = hy3rl_data(work, override, env)
    assert proc.returncode == 1, proc.stderr
    assert "dataset 'BytedTsinghua-SIA/DAPO-Math-17k': cannot load" in proc.stderr
    assert "Traceback" not in proc.stderr
    out = work / Path(Layout("results", "t").data_summary).parent
    assert not out.exists() or list(out.iterdir()) == []


def test_bad_config_and_tokenizer(tmp_path, files, tiny_tokenizer_dir):
    # A misspelt key: the schema names it (the Snakefile and `hy3rl` validate first).
    with pytest.raises(ConfigError, match=r"data\.train\.dedupe"):
        data_section({"source": str(files["dapo"]), "dedupe": True}, {"source": "x"})
    # `hy3rl data`: the same, as one line and a non-zero exit status, no traceback.
    proc = hy3rl_data(tmp_path / "work", {"data": {"train": {"dedupe": True}}})
    assert proc.returncode != 0 and "data.train.dedupe" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    err, out = run_stage(tmp_path, tmp_path / "no-model", {"source": str(files["dapo"])},
                         {"source": str(files["aime"])})
    assert err and "cannot load the tokenizer" in err
    assert not out.exists()


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_data_rule_through_snakemake(tmp_path, files, tiny_tokenizer_dir):
    """The real `data` rule with local sources and a model directory holding the
    tokenizer (what an offline user configures)."""
    import shutil

    work = tmp_path / "work"
    model = work / "model"
    shutil.copytree(tiny_tokenizer_dir, model)
    (model / "config.json").write_text("{}")
    override = {"run": {"name": "t"}, "model": {"source": str(model)},
                "data": {"train": {"source": str(files["dapo"]), "limit": 8},
                         "val": {"source": str(files["aime"])},
                         "heldout": {"limit": 4}}}  # config.yaml's carve, 4 of 20 prompts
    cfg = tmp_path / "local.yaml"
    cfg.write_text(yaml.safe_dump(override))
    target = "results/t/data/summary.json"
    run_snakemake(["--configfile", str(REPO_ROOT / "config/config.yaml"), str(cfg),
                   "--cores", "2", target], work)
    summary = json.loads((work / target).read_text())
    # config.yaml's data.val.n 1 (one sample a problem in verl's validation, CPU time)
    assert summary["splits"]["train"]["rows"] == 8 and summary["val_n"] == 1
    heldout = work / "results/t/data/heldout.parquet"
    assert summary["splits"]["heldout"]["sha256"] == sha256(heldout)
    assert summary["splits"]["heldout"]["name"] == "dapo_heldout"
    assert pq.read_table(heldout).num_rows == 4 and summary["heldout_n"] == 1
    assert "val_n: 1" in (work / "results/t/logs/data.log").read_text()
    # The model directory is read after rule model described it (the data rule's input).
    manifest = json.loads((work / "results/t/model/manifest.json").read_text())
    assert manifest["source"] == {"kind": "local", "path": str(model)}


def test_prompt_ids_across_chunks_and_roles():
    """Ids agree with a plain Python grouping by (role, content) of every message, also
    when the column spans several chunks and slices."""
    prompts = [
        [{"content": "a", "role": "user"}],
        [{"content": "a", "role": "system"}],
        [{"content": "s", "role": "system"}, {"content": "a", "role": "user"}],
        [{"content": "a", "role": "user"}],
        [{"content": "s", "role": "system"}, {"content": "a", "role": "user"}],
        [{"content": "sa", "role": "system"}],
    ] * 3
    arrays = [pa.array(prompts[i:i + 4]) for i in range(0, len(prompts), 4)]
    col = pa.chunked_array(arrays)
    seen: dict = {}
    expected = [seen.setdefault(json.dumps(p), len(seen)) for p in prompts]
    assert data.prompt_ids(col).tolist() == expected
    table = pa.table({"prompt": col, "i": list(range(len(prompts)))})
    keep = [1, 2, 7, 8, 16]
    assert data.take_rows(table, np.array(keep))["i"].to_pylist() == keep


def test_conflicting_answers_counted_and_first_kept(tmp_path, files, tiny_tokenizer_dir):
    rows = dapo_rows(3, 2)
    rows[4] = {**rows[4], "reward_model": {"ground_truth": "999", "style": "s"}}
    src = write_parquet(tmp_path / "conflict.parquet", rows)
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(src)},
                         {"source": str(files["aime"])})
    assert err is None, err
    rec = read_summary(out)["splits"]["train"]
    assert rec["input"]["prompts_with_conflicting_answers"] == 1
    assert pq.read_table(out / "train.parquet").to_pylist() == dapo_rows(3, 1)


def test_empty_source_and_revision_on_local_file(tmp_path, files, tiny_tokenizer_dir):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(dapo_rows(1)).slice(0, 0), empty)
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(empty)},
                         {"source": str(files["aime"])})
    assert err == f"data.train: {empty}: no rows"
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"]), "revision": "main"})
    assert "applies to hub datasets only" in err
    assert not out.exists() or list(out.iterdir()) == []


# --------------------------------------------------------------------------- data.heldout


def prompt_texts(rows: list[dict]) -> list[str]:
    return [json.dumps(r["prompt"], sort_keys=True) for r in rows]


def carve(limit: int, seed: int = 1, **extra) -> dict:
    return {"name": "dapo_heldout", "from_train": True, "limit": limit, "seed": seed, **extra}


def test_heldout_carved_from_train_after_dedup_before_limit(tmp_path, files,
                                                            tiny_tokenizer_dir):
    """20 prompts x 100 (dedup on): 5 prompts held out, train's limit then samples the 15
    left; the choice is numpy default_rng(seed) over the distinct prompts."""
    train = {"source": str(files["dapo"]), "limit": 10, "seed": 3}
    val = {"source": str(files["aime"])}
    err, out = run_stage(tmp_path / "a", tiny_tokenizer_dir, train, val, heldout=carve(5))
    assert err is None, err
    assert sorted(p.name for p in out.iterdir()) == ["heldout.parquet", "summary.json",
                                                     "train.parquet", "val.parquet"]
    source = dapo_rows(20, 1)
    chosen = np.sort(np.random.default_rng(1).choice(20, 5, replace=False))
    heldout = pq.read_table(out / "heldout.parquet")
    assert heldout.column_names == COLUMNS and heldout.schema.metadata is None
    assert heldout.to_pylist() == [source[i] for i in chosen]  # training rows, index kept
    left = [r for i, r in enumerate(source) if i not in set(chosen.tolist())]
    expected_train = np.sort(np.random.default_rng(3).choice(15, 10, replace=False))
    train_rows = pq.read_table(out / "train.parquet").to_pylist()
    assert train_rows == [left[i] for i in expected_train]
    assert not set(prompt_texts(train_rows)) & set(prompt_texts(heldout.to_pylist()))

    summary = read_summary(out)
    assert summary["heldout_n"] == 1 and summary["val_n"] == 32
    rec = summary["splits"]["heldout"]
    assert (rec["name"], rec["from_train"], rec["carved_prompts"]) == ("dapo_heldout", True, 5)
    assert (rec["rows"], rec["unique_prompts"], rec["duplicates"]) == (5, 5, 0)
    assert rec["heldout_n"] == 1 and "carved" in rec["heldout_n_source"]
    assert rec["options"] == {"dedup": True, "limit": 5, "seed": 1, "convert": None, "n": None}
    assert rec["source"] == summary["splits"]["train"]["source"]
    assert rec["input"] == summary["splits"]["train"]["input"]
    assert rec["sha256"] == sha256(out / "heldout.parquet")
    assert rec["bytes"] == (out / "heldout.parquet").stat().st_size
    assert rec["path"] == str(out / "heldout.parquet")
    lengths = verl_lengths(tiny_tokenizer_dir, [r["prompt"] for r in heldout.to_pylist()])
    assert rec["prompt_tokens"]["max"] == max(lengths)
    trec = summary["splits"]["train"]
    assert trec["held_out_rows"] == 5 and trec["rows"] == 10 and trec["held_out_twins"] == 0
    assert "carved_prompts" not in trec and "name" not in trec

    # Same seeds: the same files; another held-out seed: another set.
    err_b, out_b = run_stage(tmp_path / "b", tiny_tokenizer_dir, train, val, heldout=carve(5))
    err_c, out_c = run_stage(tmp_path / "c", tiny_tokenizer_dir, train, val,
                             heldout=carve(5, seed=2, n=4))
    assert err_b is err_c is None, (err_b, err_c)
    for name in ("heldout.parquet", "train.parquet"):
        assert sha256(out / name) == sha256(out_b / name)
    assert sha256(out / "heldout.parquet") != sha256(out_c / "heldout.parquet")
    assert read_summary(out_c)["heldout_n"] == 4


def test_heldout_carve_without_dedup_removes_every_duplicate(tmp_path, files,
                                                            tiny_tokenizer_dir):
    err, out = run_stage(tmp_path, tiny_tokenizer_dir,
                         {"source": str(files["dapo"]), "dedup": False},
                         {"source": str(files["aime"])}, heldout=carve(4, seed=5))
    assert err is None, err
    source = dapo_rows(20, 100)
    chosen = np.sort(np.random.default_rng(5).choice(20, 4, replace=False))
    heldout = pq.read_table(out / "heldout.parquet").to_pylist()
    assert heldout == [source[i] for i in chosen]  # one row a prompt: its first occurrence
    held = set(prompt_texts(heldout))
    train_rows = pq.read_table(out / "train.parquet").to_pylist()
    assert train_rows == [r for r in source if prompt_texts([r])[0] not in held]
    assert len(train_rows) == 1600
    summary = read_summary(out)
    assert summary["splits"]["train"]["held_out_rows"] == 400
    assert summary["splits"]["train"]["input"]["rows"] == 2000
    assert summary["splits"]["heldout"]["rows"] == 4


def test_heldout_carve_removes_the_same_problem_written_another_way(tmp_path, files,
                                                                   tiny_tokenizer_dir):
    """A training source holding each problem twice, in the DAPO prompt and bare with
    another spacing: a carved problem leaves train in both forms (preflight's held-out
    check would refuse the other), counted in held_out_twins."""
    wrapped = dapo_rows(10)
    bare = [{**r, "prompt": [{"role": "user", "content": dapo_problem(i).replace(" + ", "+")}],
             "extra_info": {"index": f"bare-{i}"}} for i, r in enumerate(wrapped)]
    source = write_parquet(tmp_path / "twins.parquet", wrapped + bare)
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(source), "limit": None},
                         {"source": str(files["aime"])}, heldout=carve(3, seed=4))
    assert err is None, err

    def number(row: dict) -> int:
        index = row["extra_info"]["index"]
        return int(index[5:]) if index.startswith("bare-") else [
            r["extra_info"]["index"] for r in wrapped].index(index)

    held = {number(r) for r in pq.read_table(out / "heldout.parquet").to_pylist()}
    train_rows = pq.read_table(out / "train.parquet").to_pylist()
    assert sorted(number(r) for r in train_rows) == sorted(
        [i for i in range(10) if i not in held] * 2)
    trec = read_summary(out)["splits"]["train"]
    assert trec["held_out_twins"] == 2 * len(held) - 3 > 0  # seed 4: not 3 pairs of twins
    assert trec["held_out_rows"] == 2 * len(held)


@pytest.mark.parametrize("limit", [20, 25])
def test_heldout_carve_larger_than_train_is_refused(limit, tmp_path, files,
                                                   tiny_tokenizer_dir):
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"])}, heldout=carve(limit))
    assert err is not None and err.startswith("data.heldout.limit: "), err
    assert f"{limit} prompts" in err and "20 distinct prompts" in err
    assert str(files["dapo"]) in err
    assert not out.exists() or list(out.iterdir()) == []


def test_heldout_from_its_own_source(tmp_path, files, tiny_tokenizer_dir):
    """A local parquet read like a split: dedup, limit, n inferred as val's; and a user's
    JSONL converted with an id field."""
    aime25 = write_parquet(tmp_path / "aime-2025.parquet", aime_rows(4))
    own = {"name": "aime2025", "source": str(aime25)}
    err, out = run_stage(tmp_path / "a", tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"])}, heldout=own)
    assert err is None, err
    summary = read_summary(out)
    rec = summary["splits"]["heldout"]
    assert (rec["name"], rec["from_train"]) == ("aime2025", False)
    assert "carved_prompts" not in rec and "held_out_rows" not in summary["splits"]["train"]
    assert rec["rows"] == 30 and rec["input"]["rows"] == 120
    assert summary["heldout_n"] == 4 and summary["val_n"] == 32
    assert rec["source"]["sha256"] == sha256(aime25)
    assert sorted(r["extra_info"]["index"] for r in
                  pq.read_table(out / "heldout.parquet").to_pylist()) == list(range(30))
    assert summary["splits"]["train"]["rows"] == 20  # train untouched

    err, out = run_stage(tmp_path / "b", tiny_tokenizer_dir, {"source": str(files["dapo"])},
                         {"source": str(files["aime"])},
                         heldout={**own, "dedup": False, "limit": 7, "seed": 2, "n": 3})
    assert err is None, err
    summary = read_summary(out)
    assert summary["heldout_n"] == 3 and summary["splits"]["heldout"]["rows"] == 7
    expected = np.sort(np.random.default_rng(2).choice(120, 7, replace=False))
    assert pq.read_table(out / "heldout.parquet").to_pylist() == [
        aime_rows(4)[i] for i in expected]

    mine = write_jsonl(tmp_path / "mine.jsonl", [{"id": "I-1", "q": "Find x if x+1=0.", "a": -1},
                                                 {"id": "II-1", "q": "What is 2+2?", "a": 4}])
    err, out = run_stage(
        tmp_path / "c", tiny_tokenizer_dir, {"source": str(files["dapo"])},
        {"source": str(files["aime"])},
        heldout={**own, "source": str(mine),
                 "convert": {"question": "q", "answer": "a", "id": "id"}})
    assert err is None, err
    rows = pq.read_table(out / "heldout.parquet").to_pylist()
    assert [r["extra_info"] for r in rows] == [
        {"index": "I-1", "raw_problem": "Find x if x+1=0.", "split": "heldout"},
        {"index": "II-1", "raw_problem": "What is 2+2?", "split": "heldout"}]
    assert read_summary(out)["heldout_n"] == 1


def test_heldout_errors_name_the_set_and_leave_nothing(tmp_path, files, tiny_tokenizer_dir):
    """Errors of the held-out source say data.heldout, its file and row; the earlier
    outputs (train, val, summary, heldout) stay as they were."""
    train, val = {"source": str(files["dapo"])}, {"source": str(files["aime"])}
    err, out = run_stage(tmp_path, tiny_tokenizer_dir, train, val, heldout=carve(3))
    assert err is None, err
    before = {p.name: sha256(p) for p in out.iterdir()}
    assert len(before) == 4

    mine = write_jsonl(tmp_path / "mine.jsonl", [{"id": "p1", "q": "a?", "a": 1},
                                                 {"id": "p2", "q": "b?", "a": 2},
                                                 {"id": "p1", "q": "c?", "a": 3}])
    own = {"name": "mine", "source": str(mine),
           "convert": {"question": "q", "answer": "a", "id": "id"}}
    err, _ = run_stage(tmp_path, tiny_tokenizer_dir, train, val, heldout=own)
    assert err == (f"data.heldout: {mine}: row 2, column extra_info.index: problem id 'p1' is "
                   "also row 0's, whose prompt differs (the evaluation keys held-out problems "
                   "by extra_info.index)"), err
    bad = write_parquet(tmp_path / "bad.parquet", [*dapo_rows(2), {**dapo_rows(3)[2],
                                                                   "ability": None}])
    err, _ = run_stage(tmp_path, tiny_tokenizer_dir, train, val,
                       heldout={"name": "bad", "source": str(bad)})
    assert err.startswith(f"data.heldout: {bad}: row 2, column ability"), err
    uneven = write_parquet(tmp_path / "uneven.parquet", aime_rows(32)[:-1])
    err, _ = run_stage(tmp_path, tiny_tokenizer_dir, train, val,
                       heldout={"name": "u", "source": str(uneven)})
    assert err.startswith("data.heldout: ") and "set data.heldout.n" in err, err
    err, _ = run_stage(tmp_path, tiny_tokenizer_dir, train, val, heldout=carve(20))
    assert err.startswith("data.heldout.limit: "), err
    assert {p.name: sha256(p) for p in out.iterdir()} == before  # all four, intact

    # Fresh directory, a failing held-out set: nothing written at all.
    err, out2 = run_stage(tmp_path / "fresh", tiny_tokenizer_dir, train, val, heldout=own)
    assert err and (not out2.exists() or list(out2.iterdir()) == [])


def test_heldout_path_must_match_config(tmp_path, files, tiny_tokenizer_dir):
    section = data_section({"source": str(files["dapo"])}, {"source": str(files["aime"])},
                           heldout=carve(3))
    out = tmp_path / "out"
    with pytest.raises(data.DataError, match=r"data\.heldout: set, but no path"):
        data.run(section, tokenizer=str(tiny_tokenizer_dir), train=out / "t.parquet",
                 val=out / "v.parquet", summary=out / "s.json")
    assert not out.exists()


def test_check_problem_ids_missing_index(tmp_path):
    rows = [{**r, "extra_info": {"other": "x"}} for r in dapo_rows(2)]
    table = pa.Table.from_pylist(rows)
    with pytest.raises(data.DataError, match=r"f: row 7, column extra_info.index: missing"):
        data.check_problem_ids(table, np.array([0, 1]), np.array([7, 9]), "f")
    table = pa.Table.from_pylist([{**r, "extra_info": {"index": [1]}} for r in dapo_rows(2)])
    with pytest.raises(data.DataError, match="expected a string or an integer"):
        data.check_problem_ids(table, np.array([0, 1]), np.array([0, 1]), "f")
    same = pa.Table.from_pylist([{**r, "extra_info": {"index": 5}} for r in dapo_rows(1, 2)])
    data.check_problem_ids(same, np.array([0, 0]), np.array([0, 1]), "f")  # one problem
