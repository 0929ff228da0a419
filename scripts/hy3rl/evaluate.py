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
class ``VllmEngine``; without vLLM, :func:`run` writes ``status: not run`` and raises
:class:`EvalNotRun`).

Entry points: :func:`run` (rule ``eval_generate`` through ``scripts/adapters/eval_generate.py``,
and ``hy3rl evaluate --tag T``); :func:`model_for_tag` gives a tag's model directory (the
checkpoint directory from :class:`hy3rl.layout.Layout` only). ``python -m hy3rl.evaluate
JOB.json`` is internal: the Ray job of a multi-node vLLM evaluation (see :func:`run`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hy3rl.atomic import write_json_atomic, write_jsonl_atomic, write_text_atomic
from hy3rl.errors import StageError
from hy3rl.layout import Layout, heldout_tag, split_tag
from hy3rl.settings import Config, Eval, Ray, Runtime, VllmBackend, build
from hy3rl.timefmt import utc_now

PRESETS: dict[str, dict[str, Any]] = {
    # The published run's validation: val_kwargs temperature 1.0, top_p 1.0, 30 x 32 samples,
    # response length 8192 (verl@220e903 run_hy_v3_megatron.sh MAX_RESPONSE_LENGTH).
    "published_val": {"temperature": 1.0, "top_p": 1.0, "n_samples": 32, "max_tokens": 8192},
    # DAPO paper's AIME-2024 avg@32: temperature 1.0, top_p 0.7, max 20,480 tokens.
    "dapo": {"temperature": 1.0, "top_p": 0.7, "n_samples": 32, "max_tokens": 20480},
}


class EvalError(StageError):
    """Bad input for the evaluation (the message names the file, row or key)."""


class EvalNotRun(EvalError):
    """The generation could not run here (backend vllm without vLLM); samples.meta.json says
    ``status: not run`` and why, and no samples.jsonl is written (never a pass)."""


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


def resolve_sampling(ev: Eval) -> Sampling:
    """The preset's values (``eval.preset``; the schema admits only PRESETS' names),
    overridden by every non-null sampling key of the eval section."""
    vals = dict(PRESETS[ev.preset])
    for key in vals:
        if getattr(ev, key) is not None:
            vals[key] = getattr(ev, key)
    return Sampling(preset=ev.preset, temperature=float(vals["temperature"]),
                    top_p=float(vals["top_p"]), n_samples=int(vals["n_samples"]),
                    max_tokens=int(vals["max_tokens"]), seed=ev.seed,
                    num_problems=ev.num_problems)


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
    finish_reason: str | None


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


def vllm_engine_kwargs(model_path: str, vcfg: VllmBackend, sampling: Sampling,
                       max_prompt_tokens: int) -> dict[str, Any]:
    """kwargs of ``vllm.LLM`` for one engine replica. More than one node: the Ray executor
    on the Ray cluster the job started (RAY_ADDRESS), as for training."""
    tp, nodes, dp = vcfg.tensor_parallel_size, vcfg.nodes, vcfg.data_parallel_size
    gpus = nodes * vcfg.gpus_per_node
    if tp * dp != gpus:
        raise EvalError(f"eval.vllm: tensor_parallel_size ({tp}) x data_parallel_size ({dp}) "
                        f"must equal nodes x gpus_per_node ({gpus})")
    if dp > 1 and nodes > 1:
        raise EvalError("eval.vllm: data_parallel_size > 1 is supported on one node only "
                        "(one engine per GPU group); use one multi-node engine per job")
    max_len = vcfg.max_model_len or (max_prompt_tokens + sampling.max_tokens)
    return {
        "model": model_path, "tokenizer": model_path, "trust_remote_code": False,
        "tensor_parallel_size": tp, "dtype": "bfloat16",
        "gpu_memory_utilization": float(vcfg.gpu_memory_utilization),
        "max_model_len": int(max_len), "enforce_eager": bool(vcfg.enforce_eager),
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
    """One vLLM output as a sample, its finish reason as vLLM reports it: ``stop`` or
    ``length`` for a finished request; ``None`` (unfinished) and ``abort`` stay as they are,
    for the rehearsal's finish_reasons check to see."""
    return SampleRecord(request.problem_id, request.sample_index, request.seed,
                        request.prompt_hash, text, len(token_ids), finish_reason)


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
    """The model on one torch device (``eval.transformers``: ``auto`` = cuda when available,
    else cpu; dtype ``auto`` = float32 on CPU, bfloat16 on GPU)."""

    model_path: str
    device: str
    dtype: str

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
        write_text_atomic(meta, json.dumps(fingerprint, sort_keys=True))
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
    write_jsonl_atomic(out, (asdict(rec) for rec in records))
    part.unlink()
    meta.unlink(missing_ok=True)
    return records, reused


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# The files of an HF model directory that compute its answers (issue 42): the weights and
# their index, the model config, the generation config (vLLM and transformers take their
# default sampling and stop tokens from it), the tokenizer and the chat template. An
# evaluation records each one it could load by content (files), and rule release ships
# exactly these from the evaluated directory and compares them with that record.
_TOKENIZER = (r"tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..+|merges\.txt"
              r"|chat_template\.(jinja|json)")
TOKENIZER_FILES = re.compile(rf"^({_TOKENIZER})$")  # the tokenizer's and the template's
COMPUTES = re.compile(r"^(.+\.safetensors|model\.safetensors\.index\.json|config\.json"
                      rf"|generation_config\.json|{_TOKENIZER})$")


def json_keys(path: Path) -> dict[str, str] | None:
    """The first 16 hex digits of the sha256 of each top-level key's value (canonical JSON)
    of a JSON object file: what names the key a change touched (a tokenizer's
    ``normalizer``, a config's ``rope_theta``); None for a file that is not one."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16]
            for k, v in doc.items()}


def computing_files(model_dir: str | Path, threads: int = 1) -> dict[str, dict[str, Any]]:
    """Each file of ``model_dir`` that computes its answers (:data:`COMPUTES`): its sha256
    and, for a JSON file, its keys' digests (:func:`json_keys`); ``threads`` files hashed at
    a time (hy3rl.hub.hash_files)."""
    from hy3rl.hub import hash_files

    files = sorted(f for f in Path(model_dir).iterdir() if f.is_file() and COMPUTES.match(f.name))
    got = hash_files([(f, "sha256") for f in files], threads, progress=False,
                     desc="hashing the model's files")
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        out[f.name] = {"sha256": got[f]}
        if f.suffix == ".json" and not f.name.endswith(".index.json"):
            keys = json_keys(f)
            if keys is not None:
                out[f.name]["keys"] = keys
    return out


def prompt_encodings(tokenizer, rendered: dict[str, str]) -> dict[str, list]:
    """Per problem, [the number of token ids, the first 16 hex digits of their sha256] of its
    rendered prompt: what the evaluated tokenizer made of the evaluation's own prompts
    (rule release encodes them again with the tokenizer it ships)."""
    out = {}
    for pid, text in rendered.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out[pid] = [len(ids), hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]]
    return out


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "vllm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# --------------------------------------------------------------------------------------
# Tags and their models (rules/common.smk's eval section uses these; pure but for done.json)
# --------------------------------------------------------------------------------------


def eval_tags(cfg: Config, heldout: bool = True) -> list[str]:
    """Tags to evaluate: base always; step<N> for eval.steps and final only when training
    is in the DAG (Config.trains: GPUs or the CPU path); then, with data.heldout (and
    ``heldout``), each of them again on the held-out set (``heldout/<tag>``)."""
    tags = ["base"]
    if cfg.trains:
        tags += [f"step{s}" for s in cfg.eval.steps]
        if cfg.eval.final:
            tags.append("final")
    if heldout and cfg.data.heldout is not None:
        tags += [heldout_tag(t) for t in tags]
    return tags


def eval_steps(cfg: Config) -> list[int]:
    """The evaluation steps whose checkpoints are waited for while training runs."""
    return sorted(cfg.eval.steps) if cfg.trains else []


def final_step(train_done: Path) -> int:
    """The last trained step named by the train sentinel (docs/formats/train.md)."""
    try:
        done = json.loads(Path(train_done).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EvalError(f"{train_done}: cannot read the train sentinel: {exc}") from exc
    step = done.get("final_step") if isinstance(done, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise EvalError(f"{train_done}: needs an integer 'final_step'")
    return step


def checkpoint_step(model_path: str) -> int | None:
    """The training step a model directory holds (``.../global_step_<N>/actor/...``), None
    for a model that is no checkpoint (base): the step the report labels a tag with."""
    m = re.search(r"/global_step_(\d+)(?:/|$)", str(model_path))
    return int(m.group(1)) if m else None


def checkpoint_dir_of(model_path: str | Path) -> Path:
    """``.../global_step_<N>`` of a checkpoint's HF model directory."""
    p = Path(model_path)
    for parent in [p, *p.parents]:
        if re.fullmatch(r"global_step_\d+", parent.name):
            return parent
    raise EvalError(f"{model_path}: not inside a global_step_<N> checkpoint directory")


def model_for_tag(cfg: Config, tag: str, train_done: str | Path | None = None) -> str:
    """The model directory a tag evaluates: ``base`` is ``cfg.model.path`` (the directory
    rule model describes); ``step<N>`` and ``final`` (the ``final_step`` of ``train_done``,
    by default the layout's ``train/done.json``) are the HF weights of that step's
    checkpoint, under the one checkpoint directory of :class:`hy3rl.layout.Layout`."""
    layout = Layout.from_config(cfg)
    tag, _ = split_tag(tag)
    if tag == "base":
        return cfg.model.path
    if tag == "final":
        return str(layout.checkpoint_hf_model(final_step(Path(train_done or layout.train_done))))
    if tag.startswith("step") and tag[4:].isdigit():
        return str(layout.checkpoint_hf_model(int(tag[4:])))
    raise EvalError(f"unknown evaluation tag {tag!r} (base, step<N>, final)")


# --------------------------------------------------------------------------------------
# Multi-node vLLM: the same run() as a Ray job on the training launcher's Ray cluster
# --------------------------------------------------------------------------------------

IN_RAY_VAR = "HY3RL_EVAL_IN_RAY"


def ray_launch_script(job: Path, workdir: str, runtime: Runtime | None) -> str:
    """The script the Ray job runs for a multi-node vLLM evaluation: this module's internal
    entry point on ``job`` (the eval section and paths, as JSON), on the Ray cluster that
    hy3rl.launch started over the job's nodes (as for training). It runs in the training
    runtime (``train.runtime``: its python, where vLLM lives), which imports this
    workflow's package through PYTHONPATH, as the launcher's node processes do."""
    import shlex

    from hy3rl.launch import SCRIPTS_DIR, resolve_runtime

    python = resolve_runtime(runtime)["python"]
    cmd = " ".join(shlex.quote(a) for a in [python, "-m", "hy3rl.evaluate", str(job)])
    return ("#!/usr/bin/env bash\n# Written by hy3rl.evaluate: the evaluation as a Ray job.\n"
            "set -euo pipefail\n"
            f"cd {shlex.quote(workdir)}\n"
            f"export {IN_RAY_VAR}=1\n"
            f"export PYTHONPATH={shlex.quote(str(SCRIPTS_DIR))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
            f"exec {cmd}\n")


def _launch_on_ray(ev: Eval, job: dict[str, Any], *, tag: str, runtime_env: Path | None,
                   ray_dir: Path | None, cpus_per_node: int, runtime: Runtime | None,
                   ray: Ray | None) -> None:
    # ---- GPU cluster only: start Ray over the job's nodes with the training launcher and
    # run the generation again inside it (not run on this machine: needs vLLM and GPUs). ----
    from hy3rl.launch import LaunchSpec, launch

    if runtime_env is None or ray_dir is None:
        raise EvalError(f"tag {tag}: a multi-node vLLM evaluation needs the Ray runtime env "
                        "(deps/runtime_env.yaml) and a Ray log folder (eval/<tag>/ray)")
    job_file = ray_dir / "job.json"
    write_json_atomic(job_file, job, indent=1)
    script = ray_dir / "launch.sh"
    write_text_atomic(script, ray_launch_script(job_file.resolve(), os.getcwd(), runtime))
    slurm_job = os.environ.get("SLURM_JOB_ID", "local")
    spec = LaunchSpec(submission_id=f"eval-{tag}-{slurm_job}", launch_script=script.resolve(),
                      runtime_env=runtime_env, log_dir=ray_dir, nodes=ev.vllm.nodes,
                      gpus_per_node=ev.vllm.gpus_per_node, cpus_per_node=cpus_per_node,
                      runtime=runtime, ray=ray)
    result = launch(spec)
    if result.exit_code != 0:
        raise EvalError(f"tag {tag}: the evaluation's Ray job failed ({result.reason}, exit "
                        f"{result.exit_code}); logs in {ray_dir}")


# --------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------


def run(ev: Eval, *, tag: str, model: str | Path, val: Path, samples: Path, meta: Path,
        runtime_env: Path | None = None, ray_dir: Path | None = None,
        cpus_per_node: int = 1, runtime: Runtime | None = None, ray: Ray | None = None) -> None:
    """Generate ``samples`` (samples.jsonl) and ``meta`` (samples.meta.json) of ``tag``:
    ``model`` (a HF model directory; :func:`model_for_tag`) on the problems of ``val``
    (data/val.parquet), with the sampling settings and backend of ``ev`` (docs/formats/
    eval.md). Resumes an interrupted run from ``samples``' partial file.

    vLLM on more than one node (``eval.vllm.nodes``): Ray is started over the job's nodes by
    the training launcher with ``runtime_env`` (deps/runtime_env.yaml; ``cpus_per_node`` =
    cluster.cpus_per_node; ``runtime`` and ``ray`` = train.runtime and train.ray, as for
    training), its logs and the Ray job's script in ``ray_dir``
    (eval/<tag>/ray), and this same function runs inside it as the Ray job.
    Raises :class:`EvalError` for bad input, :class:`EvalNotRun` without vLLM."""
    val, samples, meta = Path(val), Path(samples), Path(meta)
    model_path = str(model)
    started = utc_now()
    sampling = resolve_sampling(ev)
    if not Path(model_path, "config.json").is_file():
        raise EvalError(f"tag {tag}: {model_path}/config.json not found (not an HF model "
                        "directory)")
    problems = load_problems(val, sampling.num_problems)
    backend, batch_size = ev.backend, ev.batch_size
    meta_doc: dict[str, Any] = {
        "tag": tag, "status": "running", "model_path": model_path,
        "step": checkpoint_step(model_path), "backend": backend,
        "preset": sampling.preset, "sampling": asdict(sampling), "val_file": str(val),
        "val_sha256": file_sha256(val), "num_problems": len(problems),
        "versions": _versions(), "started": started,
    }
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        rendered = render_prompts(tokenizer, problems)
    except EvalError as exc:
        raise EvalError(f"{model_path}: {exc}") from None
    meta_doc["chat_template_sha256"] = sha256_text(str(tokenizer.chat_template))
    requests = build_requests(problems, rendered, sampling)
    fp = _fingerprint(model_path, sampling, meta_doc["val_sha256"],
                      meta_doc["chat_template_sha256"], backend, batch_size)
    t0 = time.monotonic()

    def progress(i: int, n: int) -> None:
        print(f"batch {i}/{n} done ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)

    generate: Callable[[list[Request]], list[SampleRecord]]
    if backend == "vllm":
        vcfg = ev.vllm
        max_prompt = max(len(tokenizer(t, add_special_tokens=False)["input_ids"])
                         for t in rendered.values())
        engine = vllm_engine_kwargs(model_path, vcfg, sampling, max_prompt)
        if vcfg.data_parallel_size > 1:
            raise EvalError("eval.vllm.data_parallel_size > 1 is not supported by one job "
                            "yet: run one job per replica (e.g. one run per tag)")
        ok, why = vllm_available()
        if not ok:
            meta_doc.update(status="not run", reason=why, backend_settings={"engine": engine},
                            finished=utc_now())
            write_json_atomic(meta, meta_doc, indent=1)
            raise EvalNotRun(f"tag {tag}: not run: {why}")
        if vcfg.nodes > 1 and os.environ.get(IN_RAY_VAR) != "1":
            job = {"eval": asdict(ev), "tag": tag, "model": model_path, "val": str(val),
                   "samples": str(samples), "meta": str(meta)}
            _launch_on_ray(ev, job, tag=tag, runtime_env=runtime_env, ray_dir=ray_dir,
                           cpus_per_node=cpus_per_node, runtime=runtime, ray=ray)
            return
        meta_doc["backend_settings"] = {"engine": engine, "batch_size": batch_size}

        llm = VllmEngine(engine)

        def generate(batch: list[Request]) -> list[SampleRecord]:
            outs = llm.generate(vllm_prompts(batch, sampling))
            return [vllm_output_to_record(r, *o) for r, o in zip(batch, outs, strict=True)]
    else:
        be = TransformersBackend(model_path, device=ev.transformers.device,
                                 dtype=ev.transformers.dtype)
        meta_doc["backend_settings"] = {**be.settings(), "batch_size": batch_size}

        def generate(batch: list[Request]) -> list[SampleRecord]:
            return be.generate(batch, sampling)

    # the files this generation loads, by content, and what its tokenizer made of its
    # prompts (rule release compares them with its own)
    meta_doc["files"] = computing_files(model_path, cpus_per_node)
    meta_doc["weights"] = {k: v["sha256"] for k, v in meta_doc["files"].items()
                           if k.endswith(".safetensors")}
    meta_doc["prompt_ids"] = prompt_encodings(tokenizer, rendered)
    records, reused = run_generation(requests, generate, samples, fp, batch_size, progress)
    meta_doc.update(status="complete", num_samples=len(records), resumed_samples=reused,
                    truncated=sum(r.finish_reason == "length" for r in records),
                    finished=utc_now(), seconds=round(time.monotonic() - t0, 2))
    write_json_atomic(meta, meta_doc, indent=1)
    print(f"{tag}: {len(records)} samples ({reused} reused) -> {samples}", file=sys.stderr)


def _run_job(job_file: Path) -> None:
    """The Ray job of a multi-node vLLM evaluation: :func:`run` on the job file that
    :func:`_launch_on_ray` wrote."""
    job = json.loads(job_file.read_text())
    run(build(Eval, job["eval"], "eval"), tag=job["tag"], model=job["model"],
        val=Path(job["val"]), samples=Path(job["samples"]), meta=Path(job["meta"]))


if __name__ == "__main__":
    # Internal entry point (ray_launch_script), not a user CLI: use `hy3rl evaluate`.
    from hy3rl.smk import setup_logging

    setup_logging()
    try:
        _run_job(Path(sys.argv[1]))
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
