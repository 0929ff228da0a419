"""AIME generation for one model tag: resumable sampling with a transformers or vLLM backend.

Reads the verl-format validation parquet (``prompt`` chat list, ``reward_model.ground_truth``,
``extra_info.index`` = problem id; 960 rows = 30 problems x 32 duplicates or 30 rows: rows
are grouped by problem id, never by answer), renders each problem with the model's own chat
template and draws ``n_samples`` samples per problem, each request with its own seed derived
from (``eval.seed``, problem id, sample index).

Resume: finished batches are appended (and fsync'ed) to ``samples.jsonl.partial`` next to the
output; a rerun keeps them, generates only the rest, and finally writes ``samples.jsonl``
atomically (temp file + os.replace) in (problem, sample index) order. Batches are a fixed
partition of the request list, so a resumed run computes exactly the batches an
uninterrupted run would, and draws the same samples.

Backends: ``transformers`` (batched ``generate`` whose sampling step draws every row with its
own ``torch.Generator``; finish reason ``stop`` when the EOS token was produced, else
``length``) and ``vllm`` (requests built by pure functions below; the engine call is the one
class ``VllmEngine``; without vLLM the CLI writes ``status: not run`` and exits 3).

CLI: ``python -m hy3rl.evaluate --config-json '{"eval": {...}}' --tag base --model DIR
--val val.parquet --out eval/base/samples.jsonl --meta eval/base/samples.meta.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_json_atomic

PRESETS: dict[str, dict[str, Any]] = {
    # The published run's validation: val_kwargs temperature 1.0, top_p 1.0, 30 x 32 samples,
    # response length 8192 (verl@220e903 run_hy_v3_megatron.sh MAX_RESPONSE_LENGTH).
    "published_val": {"temperature": 1.0, "top_p": 1.0, "n_samples": 32, "max_tokens": 8192},
    # DAPO paper's AIME-2024 avg@32: temperature 1.0, top_p 0.7, max 20,480 tokens.
    "dapo": {"temperature": 1.0, "top_p": 0.7, "n_samples": 32, "max_tokens": 20480},
}
NOT_RUN_EXIT = 3


class EvalError(ValueError):
    """Bad input for the evaluation (the message names the file, row or key)."""


# --------------------------------------------------------------------------------------
# Problems, sampling settings, requests (pure)
# --------------------------------------------------------------------------------------


@dataclass
class Problem:
    problem_id: str
    prompt: list[dict[str, str]]
    ground_truth: str
    data_source: str
    rows: list[int]


def _norm_messages(value: Any, where: str) -> list[dict[str, str]]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise EvalError(f"{where}: 'prompt' must be a non-empty chat list")
    out = []
    for m in value:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise EvalError(f"{where}: 'prompt' entries need 'role' and 'content'")
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    return out


def load_problems(val_path: str | Path, num_problems: int | None = None) -> list[Problem]:
    """Distinct problems of a verl validation parquet, grouped by ``extra_info.index``.
    Order: numeric by id when every id is an integer (AIME 0..29), else first appearance."""
    import pyarrow.parquet as pq

    val_path = Path(val_path)
    try:
        table = pq.read_table(val_path)
    except (OSError, ValueError) as exc:
        raise EvalError(f"{val_path}: cannot read parquet: {exc}") from exc
    missing = {"prompt", "reward_model", "extra_info"} - set(table.column_names)
    if missing:
        raise EvalError(f"{val_path}: missing column(s) {', '.join(sorted(missing))}")
    rows = table.to_pylist()
    by_id: dict[str, Problem] = {}
    for i, row in enumerate(rows):
        where = f"{val_path} row {i}"
        extra, rm = row.get("extra_info") or {}, row.get("reward_model") or {}
        if extra.get("index") is None:
            raise EvalError(f"{where}: extra_info.index (the problem id) is missing")
        if rm.get("ground_truth") is None:
            raise EvalError(f"{where}: reward_model.ground_truth is missing")
        pid, gt = str(extra["index"]), str(rm["ground_truth"])
        prompt = _norm_messages(row.get("prompt"), where)
        if pid not in by_id:
            by_id[pid] = Problem(pid, prompt, gt, str(row.get("data_source") or ""), [i])
            continue
        first = by_id[pid]
        if first.ground_truth != gt:
            raise EvalError(f"{where}: problem {pid} has ground truth {gt!r} but row "
                            f"{first.rows[0]} has {first.ground_truth!r}")
        if first.prompt != prompt:
            raise EvalError(f"{where}: problem {pid} has a different prompt than row "
                            f"{first.rows[0]}")
        first.rows.append(i)
    problems = list(by_id.values())
    if not problems:
        raise EvalError(f"{val_path}: no rows")
    if all(p.problem_id.lstrip("-").isdigit() for p in problems):
        problems.sort(key=lambda p: int(p.problem_id))
    if num_problems is not None:
        problems = problems[:num_problems]
    return problems


@dataclass(frozen=True)
class Sampling:
    """Resolved sampling settings (recorded in samples.meta.json)."""

    preset: str
    temperature: float
    top_p: float
    n_samples: int
    max_tokens: int
    seed: int
    num_problems: int | None


def resolve_sampling(eval_cfg: dict[str, Any]) -> Sampling:
    """Preset values, overridden by every non-null key of the eval section."""
    preset = eval_cfg.get("preset", "published_val")
    if preset not in PRESETS:
        raise EvalError(f"eval.preset: {preset!r} is not one of {', '.join(PRESETS)}")
    vals = dict(PRESETS[preset])
    for key in vals:
        if eval_cfg.get(key) is not None:
            vals[key] = eval_cfg[key]
    return Sampling(preset=preset, temperature=float(vals["temperature"]),
                    top_p=float(vals["top_p"]), n_samples=int(vals["n_samples"]),
                    max_tokens=int(vals["max_tokens"]), seed=int(eval_cfg.get("seed", 1234)),
                    num_problems=eval_cfg.get("num_problems"))


def request_seed(base_seed: int, problem_id: str, sample_index: int) -> int:
    """Seed of one request: a stable hash of (base seed, problem id, sample index), < 2**31."""
    digest = hashlib.sha256(f"{base_seed}:{problem_id}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Request:
    problem_id: str
    sample_index: int
    seed: int
    prompt_text: str
    prompt_hash: str
    messages: tuple[tuple[str, str], ...]

    @property
    def key(self) -> tuple[str, int]:
        return (self.problem_id, self.sample_index)


def build_requests(problems: Sequence[Problem], rendered: dict[str, str],
                   sampling: Sampling) -> list[Request]:
    """One request per (problem, sample index), in problem order then sample index."""
    out = []
    for p in problems:
        text = rendered[p.problem_id]
        msgs = tuple((m["role"], m["content"]) for m in p.prompt)
        for k in range(sampling.n_samples):
            out.append(Request(p.problem_id, k, request_seed(sampling.seed, p.problem_id, k),
                               text, sha256_text(text), msgs))
    return out


def render_prompts(tokenizer, problems: Sequence[Problem]) -> dict[str, str]:
    """The model's own chat template applied to each problem's chat list, with the
    generation prompt added (as verl's rollout renders it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise EvalError("the model's tokenizer has no chat template (tokenizer_config.json "
                        "'chat_template' or chat_template.jinja)")
    return {p.problem_id: tokenizer.apply_chat_template(p.prompt, tokenize=False,
                                                        add_generation_prompt=True)
            for p in problems}


@dataclass
class SampleRecord:
    """One line of samples.jsonl (docs/formats/eval.md)."""

    problem_id: str
    sample_index: int
    seed: int
    prompt_hash: str
    response: str
    num_tokens: int
    finish_reason: str


def batches(items: Sequence[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield list(items[i:i + size])


# --------------------------------------------------------------------------------------
# vLLM: request building (pure, unit-tested) and the one engine call (GPU only)
# --------------------------------------------------------------------------------------


def vllm_sampling_kwargs(sampling: Sampling, seed: int) -> dict[str, Any]:
    """kwargs of ``vllm.SamplingParams`` for one request (one sample: n=1, its own seed)."""
    return {"n": 1, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens, "seed": seed, "skip_special_tokens": True}


def vllm_engine_kwargs(model_path: str, vcfg: dict[str, Any], sampling: Sampling,
                       max_prompt_tokens: int) -> dict[str, Any]:
    """kwargs of ``vllm.LLM`` for one engine replica. More than one node: the Ray executor
    on the Ray cluster the job started (RAY_ADDRESS), as for training."""
    tp = int(vcfg.get("tensor_parallel_size", 1))
    nodes = int(vcfg.get("nodes", 1))
    gpus = nodes * int(vcfg.get("gpus_per_node", 1))
    dp = int(vcfg.get("data_parallel_size", 1))
    if tp * dp != gpus:
        raise EvalError(f"eval.vllm: tensor_parallel_size ({tp}) x data_parallel_size ({dp}) "
                        f"must equal nodes x gpus_per_node ({gpus})")
    if dp > 1 and nodes > 1:
        raise EvalError("eval.vllm: data_parallel_size > 1 is supported on one node only "
                        "(one engine per GPU group); use one multi-node engine per job")
    max_len = vcfg.get("max_model_len") or (max_prompt_tokens + sampling.max_tokens)
    return {
        "model": model_path, "tokenizer": model_path, "trust_remote_code": False,
        "tensor_parallel_size": tp, "dtype": "bfloat16",
        "gpu_memory_utilization": float(vcfg.get("gpu_memory_utilization", 0.9)),
        "max_model_len": int(max_len), "enforce_eager": bool(vcfg.get("enforce_eager", False)),
        "distributed_executor_backend": "ray" if nodes > 1 else "mp",
        "seed": sampling.seed,
    }


def vllm_dp_shards(requests: Sequence[Request], dp: int) -> list[list[Request]]:
    """Split requests over ``dp`` engine replicas: whole problems round-robin (balanced)."""
    ids = list(dict.fromkeys(r.problem_id for r in requests))
    owner = {pid: i % dp for i, pid in enumerate(ids)}
    shards: list[list[Request]] = [[] for _ in range(dp)]
    for r in requests:
        shards[owner[r.problem_id]].append(r)
    return shards


def vllm_dp_gpu_groups(gpus_per_node: int, tp: int, dp: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each replica on one node."""
    if tp * dp > gpus_per_node:
        raise EvalError(f"eval.vllm: {dp} replicas x TP {tp} exceed {gpus_per_node} GPUs")
    return [",".join(str(r * tp + g) for g in range(tp)) for r in range(dp)]


def vllm_prompts(batch: Sequence[Request], sampling: Sampling) -> list[dict[str, Any]]:
    """The offline engine's inputs: rendered prompt text (our chat-template rendering, the
    same text whose sha256 is recorded) and the SamplingParams kwargs of each request."""
    return [{"request_id": f"{r.problem_id}/{r.sample_index}", "prompt": r.prompt_text,
             "sampling_params": vllm_sampling_kwargs(sampling, r.seed)} for r in batch]


def openai_chat_payload(model_name: str, request: Request, sampling: Sampling) -> dict[str, Any]:
    """The same request for an OpenAI-compatible server (vLLM serve, verl's rollout servers):
    the server applies the model's chat template to ``messages``."""
    return {"model": model_name,
            "messages": [{"role": r, "content": c} for r, c in request.messages],
            "n": 1, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens, "seed": request.seed,
            "skip_special_tokens": True}


def vllm_output_to_record(request: Request, text: str, token_ids: Sequence[int],
                          finish_reason: str | None) -> SampleRecord:
    reason = "length" if finish_reason == "length" else "stop"
    return SampleRecord(request.problem_id, request.sample_index, request.seed,
                        request.prompt_hash, text, len(token_ids), reason)


class VllmEngine:
    """---- GPU ONLY: the one place that calls vLLM (not run on this machine: no vLLM). ----
    One offline engine, built once, then fed batches of prepared prompts."""

    def __init__(self, engine_kwargs: dict[str, Any]):
        from vllm import LLM

        self.llm = LLM(**engine_kwargs)

    def generate(self, prompts: list[dict[str, Any]]) -> list[tuple[str, list[int], str | None]]:
        from vllm import SamplingParams

        outs = self.llm.generate([p["prompt"] for p in prompts],
                                 [SamplingParams(**p["sampling_params"]) for p in prompts],
                                 use_tqdm=False)
        return [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
                for o in outs]


def vllm_available() -> tuple[bool, str]:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA error at import
        return False, f"vllm is not importable here ({type(exc).__name__}: {exc})"
    return True, ""


# --------------------------------------------------------------------------------------
# transformers backend
# --------------------------------------------------------------------------------------


def sample_row(logits, generator, temperature: float, top_p: float) -> int:
    """Draw one token id from one row of logits: temperature, then nucleus (top_p) filtering
    (keep the smallest prefix of the sorted distribution whose mass reaches top_p), then a
    multinomial draw with ``generator``. temperature 0 = greedy."""
    import torch

    logits = logits.float()
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= top_p  # mass before this token already reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


class PerRowSampler:
    """A logits processor that samples each row with its own generator and returns scores
    that make the (greedy) generate loop pick exactly that token: batched generate, with
    every request seeded on its own."""

    def __init__(self, generators, temperature: float, top_p: float):
        self.generators, self.temperature, self.top_p = generators, temperature, top_p

    def __call__(self, input_ids, scores):
        import torch

        out = torch.full_like(scores, float("-inf"))
        for i in range(scores.shape[0]):
            out[i, sample_row(scores[i], self.generators[i], self.temperature, self.top_p)] = 0
        return out


@dataclass
class TransformersBackend:
    model_path: str
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=getattr(torch, self.dtype)).to(self.device).eval()
        gen_eos = self.model.generation_config.eos_token_id
        eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos = [e for e in eos if e is not None] or [self.tokenizer.eos_token_id]
        if None in eos:
            raise EvalError(f"{self.model_path}: no EOS token id (generation_config/tokenizer)")
        self.eos_ids = set(int(e) for e in eos)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = int(self.tokenizer.pad_token_id)

    def settings(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype}

    def generate(self, batch: Sequence[Request], sampling: Sampling) -> list[SampleRecord]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        enc = self.tokenizer([r.prompt_text for r in batch], return_tensors="pt",
                             padding=True, add_special_tokens=False).to(self.device)
        gens = [torch.Generator(device=self.device).manual_seed(r.seed) for r in batch]
        gcfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=sampling.max_tokens,
                                eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)
        with torch.no_grad():
            out = self.model.generate(
                **enc, generation_config=gcfg,
                logits_processor=LogitsProcessorList(
                    [PerRowSampler(gens, sampling.temperature, sampling.top_p)]))
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        records = []
        for r, toks in zip(batch, new, strict=True):
            stop = next((i for i, t in enumerate(toks) if t in self.eos_ids), None)
            toks = toks[: stop + 1] if stop is not None else toks
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            records.append(SampleRecord(r.problem_id, r.sample_index, r.seed, r.prompt_hash,
                                        text, len(toks), "stop" if stop is not None else "length"))
        return records


# --------------------------------------------------------------------------------------
# Resumable driver
# --------------------------------------------------------------------------------------


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _fingerprint(model_path: str, sampling: Sampling, val_sha: str, template_sha: str,
                 backend: str, batch_size: int) -> dict[str, Any]:
    return {"model_path": str(model_path), "sampling": asdict(sampling), "val_sha256": val_sha,
            "chat_template_sha256": template_sha, "backend": backend, "batch_size": batch_size}


def read_partial(path: Path, fingerprint: dict[str, Any],
                 requests: Sequence[Request]) -> dict[tuple[str, int], SampleRecord]:
    """Finished samples of an interrupted run with the same settings. A torn last line (the
    process died while writing) is cut off; a partial file from other settings is set aside
    as ``.stale`` (kept, never reused)."""
    meta = path.with_name(path.name + ".meta.json")
    if not path.exists():
        return {}
    if not meta.exists() or json.loads(meta.read_text()) != fingerprint:
        os.replace(path, path.with_name(path.name + ".stale"))
        print(f"{path}: settings changed since it was written; moved aside (.stale)",
              file=sys.stderr)
        return {}
    data = path.read_bytes()
    good_end = data.rfind(b"\n") + 1
    if good_end != len(data):
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
    wanted = {r.key: r for r in requests}
    done: dict[tuple[str, int], SampleRecord] = {}
    for line in data[:good_end].decode().splitlines():
        rec = SampleRecord(**json.loads(line))
        req = wanted.get((rec.problem_id, rec.sample_index))
        if req is not None and req.seed == rec.seed and req.prompt_hash == rec.prompt_hash:
            done[req.key] = rec
    return done


def run_generation(
    requests: Sequence[Request], generate: Callable[[list[Request]], list[SampleRecord]],
    out: Path, fingerprint: dict[str, Any], batch_size: int,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[list[SampleRecord], int]:
    """Generate what ``out``'s partial file lacks, batch by batch (append + fsync), then write
    ``out`` atomically and remove the partial file. Returns (records in request order,
    number of samples reused from an earlier interrupted run)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    part = partial_path(out)
    done = read_partial(part, fingerprint, requests)
    reused = len(done)
    meta = part.with_name(part.name + ".meta.json")
    if not part.exists():
        tmp = meta.with_name(meta.name + ".tmp")
        tmp.write_text(json.dumps(fingerprint, sort_keys=True))
        os.replace(tmp, meta)
    # Fixed partition of the full request list: a resumed run computes the same batches.
    todo = [b for b in batches(list(requests), batch_size) if any(r.key not in done for r in b)]
    with open(part, "a") as fh:
        for i, batch in enumerate(todo):
            pending = [r for r in batch if r.key not in done]
            recs = generate(pending)
            for rec in recs:
                fh.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
                done[(rec.problem_id, rec.sample_index)] = rec
            fh.flush()
            os.fsync(fh.fileno())
            if on_batch is not None:
                on_batch(i + 1, len(todo))
    missing = [r.key for r in requests if r.key not in done]
    if missing:
        raise RuntimeError(f"{len(missing)} samples missing after generation: {missing[:3]}")
    records = [done[r.key] for r in requests]
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as fh:
        for rec in records:
            fh.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
    part.unlink()
    meta.unlink(missing_ok=True)
    return records, reused


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def resolve_model(tag: str, model: str | None, train_done: Path | None) -> str:
    """The model directory of a tag: given directly, or for ``final`` from the train sentinel
    (``hf_model``, else ``checkpoint_dir`` + ``final_step``; docs/formats/train.md)."""
    if model:
        return model
    if tag != "final" or train_done is None:
        raise EvalError(f"tag {tag}: --model is required")
    try:
        done = json.loads(train_done.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EvalError(f"{train_done}: cannot read the train sentinel: {exc}") from exc
    if isinstance(done.get("hf_model"), str):
        return done["hf_model"]
    step = done.get("final_step")
    ckpt = done.get("checkpoint_dir")
    if not isinstance(step, int) or not isinstance(ckpt, str):
        raise EvalError(f"{train_done}: needs integer 'final_step' and string 'checkpoint_dir'")
    return checkpoint_model_dir(ckpt, step)


def checkpoint_model_dir(checkpoint_dir: str, step: int) -> str:
    """verl's HF weights of a checkpoint: <dir>/global_step_N/actor/model/huggingface."""
    return str(Path(checkpoint_dir) / f"global_step_{step}" / "actor" / "model" / "huggingface")


IN_RAY_VAR = "HY3RL_EVAL_IN_RAY"


def ray_launch_script(argv: Sequence[str], workdir: str, scripts_dir: str,
                      python: str) -> str:
    """The script the Ray job runs for a multi-node vLLM evaluation: this same CLI, on the
    Ray cluster that hy3rl.launch started over the job's nodes (as for training)."""
    import shlex

    cmd = " ".join(shlex.quote(a) for a in [python, "-m", "hy3rl.evaluate", *argv])
    return ("#!/usr/bin/env bash\n# Written by hy3rl.evaluate: the evaluation as a Ray job.\n"
            "set -euo pipefail\n"
            f"cd {shlex.quote(workdir)}\n"
            f"export PYTHONPATH={shlex.quote(scripts_dir)}${{PYTHONPATH:+:$PYTHONPATH}}\n"
            f"export {IN_RAY_VAR}=1\n"
            f"exec {cmd}\n")


def _launch_on_ray(args: argparse.Namespace, argv: Sequence[str], vcfg: dict[str, Any],
                   cpus_per_node: int) -> int:
    # ---- GPU cluster only: start Ray over the job's nodes with the training launcher and
    # run this CLI again inside it (not run on this machine: needs vLLM and GPUs). ----
    from hy3rl.launch import LaunchSpec, launch

    if args.runtime_env is None:
        print("error: a multi-node vLLM evaluation needs --runtime-env (deps/runtime_env.yaml)",
              file=sys.stderr)
        return 1
    log_dir = args.out.parent / "ray"
    log_dir.mkdir(parents=True, exist_ok=True)
    script = log_dir / "launch.sh"
    script.write_text(ray_launch_script(argv, os.getcwd(), str(Path(__file__).parents[1]),
                                        sys.executable))
    job = os.environ.get("SLURM_JOB_ID", "local")
    spec = LaunchSpec(submission_id=f"eval-{args.tag}-{job}", launch_script=script.resolve(),
                      runtime_env=args.runtime_env, log_dir=log_dir,
                      nodes=int(vcfg.get("nodes", 1)),
                      gpus_per_node=int(vcfg.get("gpus_per_node", 1)),
                      cpus_per_node=cpus_per_node)
    return launch(spec).exit_code


# --------------------------------------------------------------------------------------
# Workflow helpers (used by rules/eval.smk; pure)
# --------------------------------------------------------------------------------------


def eval_tags(config: dict[str, Any]) -> list[str]:
    """Tags to evaluate: base always; step<N> for eval.steps and final only when training
    is in the DAG (cluster.gpu)."""
    ev = config.get("eval", {})
    tags = ["base"]
    if config.get("cluster", {}).get("gpu"):
        tags += [f"step{s}" for s in ev.get("steps", [])]
        if ev.get("final", True):
            tags.append("final")
    return tags


def run_checkpoint_dir(config: dict[str, Any], workdir: str | None = None) -> str:
    """<train.checkpoint_root>/<run.name>; an empty or missing root means
    <working dir>/checkpoints (docs/formats/train.md)."""
    root = (config.get("train") or {}).get("checkpoint_root") or os.path.join(
        workdir or os.getcwd(), "checkpoints")
    return os.path.join(root, config["run"]["name"])


def model_args(config: dict[str, Any], tag: str, train_done: str) -> str:
    """The --model / --train-done arguments of a tag for the CLI."""
    if tag == "base":
        return f"--model {config['model']['path']}"
    if tag == "final":
        return f"--train-done {train_done}"
    if not tag.startswith("step") or not tag[4:].isdigit():
        raise EvalError(f"unknown evaluation tag {tag!r} (base, step<N>, final)")
    return f"--model {checkpoint_model_dir(run_checkpoint_dir(config), int(tag[4:]))}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hy3rl.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--config-json", default="{}", help="JSON with an 'eval' section")
    ap.add_argument("--tag", required=True, help="base, step<N> or final")
    ap.add_argument("--model", default=None, help="HF model directory")
    ap.add_argument("--train-done", type=Path, default=None,
                    help="train/done.json (tag final: the checkpoint it names)")
    ap.add_argument("--val", type=Path, required=True, help="data/val.parquet")
    ap.add_argument("--out", type=Path, required=True, help="<tag>/samples.jsonl")
    ap.add_argument("--meta", type=Path, required=True, help="<tag>/samples.meta.json")
    ap.add_argument("--runtime-env", type=Path, default=None,
                    help="deps/runtime_env.yaml (multi-node vLLM: the Ray job's runtime env)")
    args = ap.parse_args(argv)
    full_cfg = json.loads(args.config_json)
    cfg = full_cfg.get("eval", {})
    started = _now()
    try:
        sampling = resolve_sampling(cfg)
        model_path = resolve_model(args.tag, args.model, args.train_done)
        if not Path(model_path, "config.json").is_file():
            raise EvalError(f"tag {args.tag}: {model_path}/config.json not found (not an HF "
                            "model directory)")
        problems = load_problems(args.val, sampling.num_problems)
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    backend = cfg.get("backend", "transformers")
    batch_size = int(cfg.get("batch_size", 16))
    meta: dict[str, Any] = {
        "tag": args.tag, "status": "running", "model_path": model_path, "backend": backend,
        "preset": sampling.preset, "sampling": asdict(sampling), "val_file": str(args.val),
        "val_sha256": file_sha256(args.val), "num_problems": len(problems),
        "versions": _versions(), "started": started,
    }
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        rendered = render_prompts(tokenizer, problems)
    except EvalError as exc:
        print(f"error: {model_path}: {exc}", file=sys.stderr)
        return 1
    meta["chat_template_sha256"] = sha256_text(str(tokenizer.chat_template))
    requests = build_requests(problems, rendered, sampling)
    fp = _fingerprint(model_path, sampling, meta["val_sha256"], meta["chat_template_sha256"],
                      backend, batch_size)
    t0 = time.monotonic()

    def progress(i: int, n: int) -> None:
        print(f"batch {i}/{n} done ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)

    if backend == "vllm":
        vcfg = cfg.get("vllm", {})
        max_prompt = max(len(tokenizer(t, add_special_tokens=False)["input_ids"])
                         for t in rendered.values())
        try:
            engine = vllm_engine_kwargs(model_path, vcfg, sampling, max_prompt)
            if int(vcfg.get("data_parallel_size", 1)) > 1:
                raise EvalError("eval.vllm.data_parallel_size > 1 is not supported by one job "
                                "yet: run one job per replica (e.g. one run per tag)")
        except EvalError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        ok, why = vllm_available()
        if not ok:
            meta.update(status="not run", reason=why, backend_settings={"engine": engine},
                        finished=_now())
            write_json_atomic(args.meta, meta, indent=1)
            print(f"not run: {why}", file=sys.stderr)
            return NOT_RUN_EXIT
        if int(vcfg.get("nodes", 1)) > 1 and os.environ.get(IN_RAY_VAR) != "1":
            cpus = int(full_cfg.get("cluster", {}).get("cpus_per_node", 1))
            return _launch_on_ray(args, sys.argv[1:] if argv is None else argv, vcfg, cpus)
        meta["backend_settings"] = {"engine": engine, "batch_size": batch_size}

        llm = VllmEngine(engine)

        def generate(batch: list[Request]) -> list[SampleRecord]:
            outs = llm.generate(vllm_prompts(batch, sampling))
            return [vllm_output_to_record(r, *o) for r, o in zip(batch, outs, strict=True)]
    else:
        be = TransformersBackend(model_path, **cfg.get("transformers", {}))
        meta["backend_settings"] = {**be.settings(), "batch_size": batch_size}

        def generate(batch: list[Request]) -> list[SampleRecord]:
            return be.generate(batch, sampling)

    records, reused = run_generation(requests, generate, args.out, fp, batch_size, progress)
    meta.update(status="complete", num_samples=len(records), resumed_samples=reused,
                truncated=sum(r.finish_reason == "length" for r in records), finished=_now(),
                seconds=round(time.monotonic() - t0, 2))
    write_json_atomic(args.meta, meta, indent=1)
    print(f"{args.tag}: {len(records)} samples ({reused} reused) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
