"""Generation: validation problems grouped by id, presets, per-request seeds, vLLM request
building (vLLM itself is not installed here: `not run`), the transformers backend end to end
on the tiny Hy3 on CPU, resume after an interruption (in-process and a real SIGKILL of
`hy3rl evaluate`), tags and their models (the checkpoint directory of hy3rl.layout), and
`snakemake evaluate` on the embedded default."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from fixtures.common import REPO_ROOT, make_config
from fixtures.eval import make_val_parquet
from hy3rl import evaluate
from hy3rl.config import ConfigError, deep_merge
from hy3rl.evaluate import (
    EvalError,
    EvalNotRun,
    Request,
    Sampling,
    build_requests,
    load_problems,
    openai_chat_payload,
    request_seed,
    resolve_sampling,
    run_generation,
    sample_row,
    vllm_dp_gpu_groups,
    vllm_dp_shards,
    vllm_engine_kwargs,
    vllm_output_to_record,
    vllm_prompts,
    vllm_sampling_kwargs,
)
from hy3rl.layout import Layout

SMALL = {"n_samples": 2, "max_tokens": 8, "num_problems": 3, "batch_size": 2}
HY3RL = [sys.executable, "-m", "hy3rl.cli"]


def _ev(**over):
    """The typed eval section of the embedded default with ``over`` merged in."""
    return make_config(eval=over).eval


def _run(ev, model: Path, val: Path, out: Path, tag: str = "base") -> None:
    evaluate.run(ev, tag=tag, model=model, val=val, samples=out,
                 meta=out.with_name("samples.meta.json"))


# ---------------------------------------------------------------------- problems & settings


def test_problems_grouped_by_id_not_by_answer(tmp_path):
    dup = load_problems(make_val_parquet(tmp_path / "a.parquet", copies=32))
    single = load_problems(make_val_parquet(tmp_path / "b.parquet", copies=1))
    assert [p.problem_id for p in dup] == [str(i) for i in range(30)]
    assert [(p.problem_id, p.ground_truth, p.prompt) for p in dup] == \
        [(p.problem_id, p.ground_truth, p.prompt) for p in single]
    assert all(len(p.rows) == 32 for p in dup)
    assert dup[2].ground_truth == dup[5].ground_truth == "104"  # shared answer, two problems
    assert [p.problem_id for p in load_problems(tmp_path / "a.parquet", 4)] == ["0", "1", "2", "3"]


def test_bad_validation_rows_are_named(tmp_path):
    path = make_val_parquet(tmp_path / "v.parquet", n_problems=3, copies=2, seed=1)
    rows = pq.read_table(path).to_pylist()
    rows[3]["reward_model"]["ground_truth"] = "999"
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(EvalError, match=r"v.parquet row \d+: problem \d+ has ground truth "
                       r"'\d+' but row \d+ has '\d+'") as err:
        load_problems(path)
    assert "'999'" in str(err.value)
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "x"}]}]), path)
    with pytest.raises(EvalError, match="missing column"):
        load_problems(path)


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_presets_and_overrides():
    unset = {"n_samples": None, "max_tokens": None}  # the embedded default sets these two
    pub = resolve_sampling(_ev(**unset))
    assert (pub.temperature, pub.top_p, pub.n_samples, pub.max_tokens) == (1.0, 1.0, 32, 8192)
    dapo = resolve_sampling(_ev(preset="dapo", **unset))
    assert (dapo.temperature, dapo.top_p, dapo.n_samples, dapo.max_tokens) == (1.0, 0.7, 32, 20480)
    mine = resolve_sampling(_ev(preset="dapo", top_p=0.95, temperature=0.6, n_samples=64,
                                max_tokens=None, seed=9))
    assert (mine.temperature, mine.top_p, mine.n_samples, mine.max_tokens, mine.seed) == \
        (0.6, 0.95, 64, 20480, 9)
    with pytest.raises(ConfigError, match="preset"):  # the schema refuses an unknown preset
        _ev(preset="nope")


def test_request_seeds_are_stable_and_distinct():
    seeds = {request_seed(1234, str(p), k) for p in range(30) for k in range(32)}
    assert len(seeds) == 960 and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(1234, "3", 5) == request_seed(1234, "3", 5) != request_seed(1235, "3", 5)


def _requests(n_problems=2, n=3) -> tuple[list[Request], Sampling]:
    sampling = resolve_sampling(_ev(preset="dapo", n_samples=n, max_tokens=None, seed=5))
    probs = [evaluate.Problem(str(i), [{"role": "user", "content": f"q{i}"}], "1", "math_dapo",
                              [i]) for i in range(n_problems)]
    return build_requests(probs, {p.problem_id: f"<u>{p.problem_id}<a>" for p in probs},
                          sampling), sampling


def test_build_requests_order_and_hash():
    reqs, _ = _requests()
    assert [r.key for r in reqs] == [("0", 0), ("0", 1), ("0", 2), ("1", 0), ("1", 1), ("1", 2)]
    assert reqs[0].prompt_hash == hashlib.sha256(b"<u>0<a>").hexdigest()
    assert reqs[0].seed == request_seed(5, "0", 0)


# ---------------------------------------------------------------------- vLLM request building


def test_vllm_sampling_params_and_prompts():
    reqs, sampling = _requests()
    kw = vllm_sampling_kwargs(sampling, 42)
    assert kw == {"n": 1, "temperature": 1.0, "top_p": 0.7, "max_tokens": 20480, "seed": 42,
                  "skip_special_tokens": True}
    prompts = vllm_prompts(reqs, sampling)
    assert [p["request_id"] for p in prompts][:2] == ["0/0", "0/1"]
    assert prompts[1]["prompt"] == "<u>0<a>"
    assert [p["sampling_params"]["seed"] for p in prompts] == [r.seed for r in reqs]
    payload = openai_chat_payload("hy3", reqs[4], sampling)
    assert payload == {"model": "hy3", "messages": [{"role": "user", "content": "q1"}],
                       "n": 1, "temperature": 1.0, "top_p": 0.7, "max_tokens": 20480,
                       "seed": reqs[4].seed, "skip_special_tokens": True}


def test_vllm_finish_reasons_are_recorded_as_vllm_reports_them():
    """None (unfinished) and "abort" are not masked as "stop": the rehearsal's
    finish_reasons check has to see them (issue 28)."""
    reqs, _ = _requests()
    got = {reason: dataclasses.asdict(vllm_output_to_record(reqs[1], "ab", [7, 8], reason))
           for reason in ("stop", "length", None, "abort")}
    assert {k: r["finish_reason"] for k, r in got.items()} == {
        "stop": "stop", "length": "length", None: None, "abort": "abort"}
    assert got[None] == {"problem_id": "0", "sample_index": 1, "seed": reqs[1].seed,
                         "prompt_hash": reqs[1].prompt_hash, "response": "ab",
                         "num_tokens": 2, "finish_reason": None}
    assert json.loads(json.dumps(got["abort"]))["finish_reason"] == "abort"


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_vllm_engine_layout():
    _, sampling = _requests()

    def vllm(**v):
        return _ev(vllm=v).vllm

    hy3 = vllm_engine_kwargs("/m", vllm(tensor_parallel_size=16, nodes=2, gpus_per_node=8,
                                        max_model_len=10240), sampling, 300)
    assert hy3["tensor_parallel_size"] == 16 and hy3["distributed_executor_backend"] == "ray"
    assert hy3["max_model_len"] == 10240 and hy3["model"] == hy3["tokenizer"] == "/m"
    assert hy3["gpu_memory_utilization"] == 0.9 and hy3["enforce_eager"] is False
    one = vllm_engine_kwargs("/m", vllm(tensor_parallel_size=8, gpus_per_node=8), sampling, 300)
    assert one["distributed_executor_backend"] == "mp" and one["max_model_len"] == 300 + 20480
    with pytest.raises(EvalError, match="must equal nodes x gpus_per_node"):
        vllm_engine_kwargs("/m", vllm(tensor_parallel_size=8, nodes=2, gpus_per_node=8),
                           sampling, 1)
    reqs, _ = _requests(n_problems=5, n=2)
    shards = vllm_dp_shards(reqs, 2)
    assert sorted(r.key for s in shards for r in s) == sorted(r.key for r in reqs)
    assert {r.problem_id for r in shards[0]} == {"0", "2", "4"}
    assert vllm_dp_gpu_groups(8, 4, 2) == ["0,1,2,3", "4,5,6,7"]
    with pytest.raises(EvalError):
        vllm_dp_gpu_groups(8, 8, 2)


def test_vllm_backend_records_not_run_here(tmp_path, tiny_hy3_dir, eval_val_parquet):
    pytest.importorskip("torch")
    if evaluate.vllm_available()[0]:
        pytest.skip("vLLM is installed here")
    out, meta = tmp_path / "s.jsonl", tmp_path / "s.meta.json"
    with pytest.raises(EvalNotRun, match="not run: vllm is not importable"):
        evaluate.run(_ev(backend="vllm", **SMALL), tag="base", model=tiny_hy3_dir,
                     val=eval_val_parquet, samples=out, meta=meta)
    assert not out.exists()
    m = json.loads(meta.read_text())
    assert m["status"] == "not run" and "vllm" in m["reason"]


# ---------------------------------------------------------------------- transformers backend


def test_sample_row_top_p_temperature_and_seed():
    import torch

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = {sample_row(logits, torch.Generator().manual_seed(s), 1.0, 0.7) for s in range(300)}
    assert draws == {0, 1}  # nucleus 0.7 keeps the 0.5 and 0.3 tokens only
    draws = {sample_row(logits, torch.Generator().manual_seed(s), 1.0, 1.0) for s in range(300)}
    assert draws == {0, 1, 2, 3}
    assert sample_row(logits, torch.Generator().manual_seed(0), 0.0, 1.0) == 0  # greedy
    a = [sample_row(logits, torch.Generator().manual_seed(11), 1.0, 1.0) for _ in range(5)]
    assert len(set(a)) == 1


def _gen(tmp_path: Path, model: Path, val: Path, name: str, **cfg) -> tuple[Path, dict]:
    out = tmp_path / name / "samples.jsonl"
    _run(_ev(**{**SMALL, **cfg}), model, val, out)
    return out, json.loads(out.with_name("samples.meta.json").read_text())


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_hy3_dir):
    """An uninterrupted run: 3 problems x 2 samples x 8 tokens, batches of 2."""
    tmp = tmp_path_factory.mktemp("ref")
    val = make_val_parquet(tmp / "val.parquet", copies=2)
    out, meta = _gen(tmp, tiny_hy3_dir, val, "ref")
    return val, out, meta


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_transformers_end_to_end_on_tiny_hy3(tmp_path, tiny_hy3_dir, reference):
    from transformers import AutoTokenizer

    val, out, meta = reference
    recs = _lines(out)
    assert [(r["problem_id"], r["sample_index"]) for r in recs] == \
        [(p, k) for p in ("0", "1", "2") for k in (0, 1)]
    tok = AutoTokenizer.from_pretrained(tiny_hy3_dir)
    problems = load_problems(val, 3)
    rendered = evaluate.render_prompts(tok, problems)
    for r in recs:
        assert r["prompt_hash"] == hashlib.sha256(rendered[r["problem_id"]].encode()).hexdigest()
        assert r["seed"] == request_seed(1234, r["problem_id"], r["sample_index"])
        assert r["finish_reason"] in ("stop", "length") and 1 <= r["num_tokens"] <= 8
        if r["finish_reason"] == "length":
            assert r["num_tokens"] == 8
    assert len({r["response"] for r in recs}) > 1
    assert meta["status"] == "complete" and meta["num_samples"] == 6
    assert meta["sampling"]["max_tokens"] == 8 and meta["backend_settings"]["device"] == "cpu"
    assert meta["versions"]["transformers"] == "5.6.0"
    # the weight files it loaded, by content (rule release compares its release with them)
    assert meta["weights"] == {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                               for f in tiny_hy3_dir.glob("*.safetensors")}
    assert sorted(meta["weights"]) == sorted(p.name for p in tiny_hy3_dir.glob("*.safetensors"))
    # issue 42: every file that computes, JSON files by key (not tiny-hy3.json, the
    # fixture's own notes), and what the tokenizer made of each prompt
    assert sorted(meta["files"]) == sorted(
        p.name for p in tiny_hy3_dir.iterdir() if p.name != "tiny-hy3.json")
    assert "architectures" in meta["files"]["config.json"]["keys"]
    assert "normalizer" in meta["files"]["tokenizer.json"]["keys"]
    assert "keys" not in meta["files"]["model.safetensors.index.json"]
    assert set(meta["prompt_ids"]) == set(rendered)
    assert all(n > 0 and len(h) == 16 for n, h in meta["prompt_ids"].values())
    # same seeds -> the same samples; another base seed -> other samples
    again, _ = _gen(tmp_path, tiny_hy3_dir, val, "again")
    assert again.read_bytes() == out.read_bytes()
    other, _ = _gen(tmp_path, tiny_hy3_dir, val, "other", seed=99)
    assert [r["response"] for r in _lines(other)] != [r["response"] for r in recs]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_finish_reason_stop_when_the_eos_token_is_drawn(tmp_path, tiny_hy3_copy, reference):
    """Make the token the reference run drew first for sample (0, 0) an EOS token of a copy
    of the model: with the same seed that sample now stops after one token."""
    val, out, _ = reference
    first = _lines(out)[0]
    from transformers import AutoTokenizer

    model = tiny_hy3_copy("eos")
    tok = AutoTokenizer.from_pretrained(model)
    first_token = tok(first["response"], add_special_tokens=False)["input_ids"][0]
    gen_cfg = json.loads((model / "generation_config.json").read_text())
    eos = gen_cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    gen_cfg["eos_token_id"] = [*eos, first_token]
    (model / "generation_config.json").write_text(json.dumps(gen_cfg))
    new, _ = _gen(tmp_path, model, val, "eos")
    s0 = _lines(new)[0]
    assert (s0["finish_reason"], s0["num_tokens"]) == ("stop", 1)


# ---------------------------------------------------------------------- resume


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_resume_after_interrupt_in_process(tmp_path, tiny_hy3_dir, reference):
    from transformers import AutoTokenizer

    val, ref_out, _ = reference
    sampling = resolve_sampling(_ev(**SMALL))
    problems = load_problems(val, 3)
    tok = AutoTokenizer.from_pretrained(tiny_hy3_dir)
    reqs = build_requests(problems, evaluate.render_prompts(tok, problems), sampling)
    backend = evaluate.TransformersBackend(str(tiny_hy3_dir), device="auto", dtype="auto")
    calls: list[int] = []

    def generate(batch):
        calls.append(len(batch))
        return backend.generate(batch, sampling)

    def stop_after_two(i, n):
        if i == 2:
            raise KeyboardInterrupt

    out = tmp_path / "samples.jsonl"
    fp = {"x": 1}
    with pytest.raises(KeyboardInterrupt):
        run_generation(reqs, generate, out, fp, 2, stop_after_two)
    assert not out.exists()
    part = evaluate.partial_path(out)
    assert len(part.read_text().splitlines()) == 4
    # a torn last line (killed while writing) is cut off on resume
    with open(part, "a") as fh:
        fh.write('{"problem_id": "2", "sample_')
    calls.clear()
    records, reused = run_generation(reqs, generate, out, fp, 2)
    assert reused == 4 and calls == [2]  # only the last batch was generated
    assert out.read_bytes() == ref_out.read_bytes()  # same result as uninterrupted
    assert not part.exists()


def test_partial_from_other_settings_is_set_aside(tmp_path):
    reqs, _ = _requests()
    out = tmp_path / "samples.jsonl"
    part = evaluate.partial_path(out)
    fake = evaluate.SampleRecord("0", 0, reqs[0].seed, reqs[0].prompt_hash, "old", 1, "stop")
    part.write_text(json.dumps(fake.__dict__) + "\n")
    part.with_name(part.name + ".meta.json").write_text(json.dumps({"other": True}))

    def generate(batch):
        return [evaluate.SampleRecord(r.problem_id, r.sample_index, r.seed, r.prompt_hash,
                                      "new", 1, "stop") for r in batch]

    records, reused = run_generation(reqs, generate, out, {"mine": True}, 4)
    assert reused == 0 and all(r.response == "new" for r in records)
    assert part.with_name(part.name + ".stale").exists()


def _configfile(tmp_path: Path, model: Path, **ev) -> Path:
    """A config file for `hy3rl` run from ``tmp_path``: run `k`, the tiny model, ``ev``."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "k"}, "model": {"source": str(model)},
                                    "eval": ev}))
    return path


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_resume_after_sigkill(tmp_path, tiny_hy3_dir, reference):
    """Kill the real `hy3rl evaluate` with SIGKILL after its first saved batch, rerun: no
    duplicates, and the file equals the uninterrupted run's."""
    val, ref_out, _ = reference
    cfg = _configfile(tmp_path, tiny_hy3_dir, **{**SMALL, "batch_size": 1})
    layout = Layout.of_results(tmp_path / "results" / "k")
    Path(layout.data_val).parent.mkdir(parents=True)
    shutil.copyfile(val, layout.data_val)
    out = Path(layout.eval_samples("base"))
    part = evaluate.partial_path(out)
    cmd = [*HY3RL, "evaluate", "--configfile", str(cfg), "--tag", "base"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if part.exists() and part.read_text().count("\n") >= 1:
            break
        time.sleep(0.01)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = part.read_text().count("\n")
    assert not out.exists() and 1 <= done_before < 6
    _run(_ev(**{**SMALL, "batch_size": 1}), tiny_hy3_dir, Path(layout.data_val), out)
    meta = json.loads(Path(layout.eval_samples_meta("base")).read_text())
    assert meta["resumed_samples"] == done_before
    recs = _lines(out)
    assert len({(r["problem_id"], r["sample_index"]) for r in recs}) == len(recs) == 6
    assert [r["response"] for r in recs] == [r["response"] for r in _lines(ref_out)]


# ---------------------------------------------------------------------- workflow


# The embedded default's evaluation through Snakemake (30 problems x 4 samples x 32 tokens,
# the pinned verl's math_dapo.py, the report's numbers) is asserted on the real tier's run of
# the whole default (tests/test_real_verl.py), which evaluates base, step 1 and final.


# ---------------------------------------------------------------------- tags and models


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_tags_and_their_models(tmp_path):
    from hy3rl.settings import Config

    # the embedded default trains on the CPU path: base, step 1 and final, each on the
    # held-out set too; without training, base alone
    tags = ["base", "step1", "final"]
    assert evaluate.eval_tags(make_config()) == tags + [f"heldout/{t}" for t in tags]
    off = {"cpu": {"enable": False}}
    assert evaluate.eval_tags(make_config(train=off)) == ["base", "heldout/base"]
    assert evaluate.eval_tags(make_config(data={"heldout": None}, train=off)) == ["base"]
    paper = Config.load(REPO_ROOT / "config/config.yaml", REPO_ROOT / "config/paper.yaml")
    tags = ["base", "step20", "step100", "step180", "final"]
    assert evaluate.eval_tags(paper) == tags + [f"heldout/{t}" for t in tags]
    assert evaluate.eval_tags(paper, heldout=False) == tags
    no_final = dataclasses.replace(paper, eval=dataclasses.replace(paper.eval, final=False))
    assert evaluate.eval_tags(no_final, heldout=False)[-1] == "step180"
    assert evaluate.model_for_tag(paper, "heldout/step20") == evaluate.model_for_tag(
        paper, "step20")

    def with_root(root: str) -> Config:
        return Config.from_dict(deep_merge(paper.raw, {"train": {"checkpoint_root": root}}))

    shared = with_root("/shared/ckpt")
    hf20 = "global_step_20/actor/model/huggingface"
    assert evaluate.model_for_tag(shared, "step20") == f"/shared/ckpt/hy3-grpo-paper/{hf20}"
    assert evaluate.model_for_tag(shared, "base") == paper.model.path
    done = tmp_path / "done.json"
    done.write_text(json.dumps({"final_step": 190, "checkpoint_dir": "/elsewhere"}))
    assert evaluate.model_for_tag(shared, "final", done) == \
        "/shared/ckpt/hy3-grpo-paper/global_step_190/actor/model/huggingface"
    with pytest.raises(EvalError, match="unknown evaluation tag"):
        evaluate.model_for_tag(shared, "stepx")
    # An empty checkpoint_root: the one checkpoint directory of the layout (as train and
    # preflight use it), <results_root>/<run>/checkpoints, absolute.
    empty = with_root("")
    expected = Path(os.path.abspath(f"{empty.run.results_root}/hy3-grpo-paper/checkpoints"))
    assert Layout.from_config(empty).checkpoint_dir == expected
    assert evaluate.model_for_tag(empty, "step20") == str(expected / hf20)


def test_final_model_from_train_sentinel(tmp_path):
    cfg = make_config(run={"name": "run"}, train={"checkpoint_root": "/c"})
    done = tmp_path / "done.json"
    done.write_text(json.dumps({"final_step": 190, "checkpoint_dir": "/c/run"}))
    assert evaluate.model_for_tag(cfg, "final", done) == \
        "/c/run/global_step_190/actor/model/huggingface"
    assert evaluate.final_step(done) == 190
    done.write_text(json.dumps({"final_step": "x"}))
    with pytest.raises(EvalError, match="done.json"):
        evaluate.model_for_tag(cfg, "final", done)
    with pytest.raises(EvalError, match="cannot read"):
        evaluate.final_step(tmp_path / "missing.json")


def test_ray_launch_script_runs_the_job_inside_ray(tmp_path):
    job = tmp_path / "eval" / "step20" / "ray" / "job.json"
    from hy3rl.launch import SCRIPTS_DIR
    from hy3rl.settings import Runtime

    text = evaluate.ray_launch_script(job, "/work dir", Runtime(prefix="apptainer exec x.sif",
                                                                 python="/env/bin/python"))
    script = tmp_path / "launch.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert f"export {evaluate.IN_RAY_VAR}=1" in text and "cd '/work dir'" in text
    # the runtime's python (vLLM lives there) imports this workflow's package by PYTHONPATH
    assert f"export PYTHONPATH={SCRIPTS_DIR}" in text
    # the quoted command line parses back to exactly the internal entry point
    import shlex

    exec_line = next(x for x in text.splitlines() if x.startswith("exec "))
    assert shlex.split(exec_line)[1:] == ["/env/bin/python", "-m", "hy3rl.evaluate", str(job)]


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_ray_job_file_round_trip(tmp_path, tiny_hy3_dir, reference):
    """The job file a multi-node vLLM evaluation hands to its Ray job (the eval section and
    the paths) runs the same generation: here with transformers, in-process."""
    val, ref_out, _ = reference
    out = tmp_path / "job" / "samples.jsonl"
    job = {"eval": dataclasses.asdict(_ev(**SMALL)), "tag": "base", "model": str(tiny_hy3_dir),
           "val": str(val), "samples": str(out), "meta": str(out.with_name("samples.meta.json"))}
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    evaluate._run_job(job_file)
    assert out.read_bytes() == ref_out.read_bytes()


def test_vllm_bad_layout_is_an_error_before_anything_runs(tmp_path, tiny_hy3_dir,
                                                          eval_val_parquet):
    out, meta = tmp_path / "s.jsonl", tmp_path / "s.meta.json"
    ev = _ev(backend="vllm", **SMALL,
             vllm={"tensor_parallel_size": 16, "nodes": 1, "gpus_per_node": 8})
    with pytest.raises(EvalError, match="must equal nodes x gpus_per_node"):
        evaluate.run(ev, tag="base", model=tiny_hy3_dir, val=eval_val_parquet, samples=out,
                     meta=meta)
    assert not out.exists() and not meta.exists()


def test_hy3rl_evaluate_errors_exit_1_with_the_message(tmp_path, tiny_hy3_dir):
    """`hy3rl evaluate`: a bad input is its message on stderr and exit status 1, no
    traceback, no output."""
    cfg = _configfile(tmp_path, tiny_hy3_dir, **SMALL)
    proc = subprocess.run([*HY3RL, "evaluate", "--configfile", str(cfg), "--tag", "base"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "hy3rl evaluate: error: results/k/data/val.parquet: cannot read parquet" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results" / "k" / "eval" / "base" / "samples.meta.json").exists()


# ---------------------------------------------------------------------- where the rules run


def test_the_seconds_long_evaluation_steps_run_on_the_submit_host(tmp_path):
    """With the SLURM executor (the one profiles/slurm selects), Snakemake runs scoring,
    metrics, the selection and the summary on the submit host (its own is_local, as it
    decides when it executes; a dry run never prints it), and submits the generations as
    cluster jobs. The workflow is parsed by Snakemake's API with a GPU config (every
    evaluation rule in it)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        OutputSettings,
        Quietness,
        ResourceSettings,
        StorageSettings,
    )
    from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry

    gpu = tmp_path / "gpu.yaml"
    gpu.write_text(yaml.safe_dump({"cluster": {"gpu": True}, "train": {"cpu": {"enable": False}}}))
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        wf = api.workflow(
            resource_settings=ResourceSettings(cores=1), storage_settings=StorageSettings(),
            config_settings=ConfigSettings(configfiles=[REPO_ROOT / "config/config.yaml", gpu]),
            snakefile=REPO_ROOT / "Snakefile", workdir=tmp_path)._workflow
        wf._executor_plugin = ExecutorPluginRegistry().get_plugin("slurm")
        assert not wf.local_exec
        local = {r.name: wf.is_local(r) for r in wf.rules}
    for name in ("eval_score", "eval_metrics", "eval_select", "evaluate", "eval_request",
                 "eval_checkpoint"):
        assert local[name] is True, name
    assert local["eval_generate"] is False and local["train"] is False
