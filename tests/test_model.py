"""The tiny Hy3 builder: real hy_v3 architecture, inner names, dtypes, shards, tokenizer,
and byte-identical output for the same seed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixtures.common import make_config
from hy3rl import model as tiny
from hy3rl.layout import TINY_MODEL_DIR
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]


def _tensors(d: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for shard in sorted(d.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for k in f.keys():  # noqa: SIM118
                t = f.get_slice(k)
                out[k] = (t.get_dtype(), tuple(t.get_shape()))
    return out


def test_tiny_layout(tiny_hy3_dir: Path):
    cfg = json.loads((tiny_hy3_dir / "config.json").read_text())
    assert cfg["model_type"] == "hy_v3" and cfg["architectures"] == ["HYV3ForCausalLM"]
    assert cfg["first_k_dense_replace"] == 1 and cfg["num_nextn_predict_layers"] == 1
    n, e = cfg["num_hidden_layers"], cfg["num_experts"]
    index = json.loads((tiny_hy3_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    tensors = _tensors(tiny_hy3_dir)
    assert set(tensors) == set(index["weight_map"])
    # Inner (on-disk) names: per-expert tensors, router.gate, shared_mlp, expert_bias.
    assert f"model.layers.1.mlp.experts.{e - 1}.gate_proj.weight" in tensors
    assert "model.layers.1.mlp.router.gate.weight" in tensors
    assert "model.layers.1.mlp.shared_mlp.up_proj.weight" in tensors
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # the dense layer
    assert not any("gate_up_proj" in k or "e_score_correction_bias" in k for k in tensors)
    for head in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
        assert f"model.layers.{n}.{head}.weight" in tensors  # the MTP layer
    assert f"model.layers.{n}.mlp.experts.0.down_proj.weight" in tensors
    assert tensors[f"model.layers.{n}.eh_proj.weight"][1] == (cfg["hidden_size"],
                                                             2 * cfg["hidden_size"])
    biases = {k: v for k, v in tensors.items() if k.endswith("mlp.expert_bias")}
    assert len(biases) == n  # n-1 MoE layers + the MTP layer
    assert all(v == ("F32", (e,)) for v in biases.values())
    assert all(v[0] == "BF16" for k, v in tensors.items() if k not in biases)
    with safe_open(tiny_hy3_dir / index["weight_map"]["model.layers.1.mlp.expert_bias"],
                   "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.expert_bias").abs().min() > 0
    sizes = {"BF16": 2, "F32": 4}
    total = 0
    for dtype, shape in tensors.values():
        count = 1
        for s in shape:
            count *= s
        total += count * sizes[dtype]
    assert index["metadata"]["total_size"] == total


def test_tiny_loads_and_generates_with_chat_template(tiny_hy3_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hy3_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_hy3_dir)
    assert len(tok) == model.config.vocab_size
    assert tok.tokenize("Answer: 204") [-3:] == ["2", "0", "4"]
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                  add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")
    assert tok.decode(enc["input_ids"][0]).endswith("<|assistant|>")
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]
    # The expert bias was loaded (not left at zero).
    assert model.model.layers[1].mlp.e_score_correction_bias.abs().min() > 0


def test_same_seed_byte_identical_other_seed_differs(tiny_hy3_dir: Path, tmp_path: Path):
    again = tiny.build_tiny_model(tmp_path / "again", seed=0)
    other = tiny.build_tiny_model(tmp_path / "other", seed=1)
    files = sorted(p.name for p in tiny_hy3_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (tiny_hy3_dir / name).read_bytes() == (again / name).read_bytes(), name
    shard = sorted(tiny_hy3_dir.glob("*.safetensors"))[0].name
    assert (tiny_hy3_dir / shard).read_bytes() != (other / shard).read_bytes()


def test_refuses_non_empty_output_and_bad_sizes(tmp_path: Path):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not empty"):
        tiny.build_tiny_model(out)
    assert (out / "keep.txt").read_text() == "precious"
    with pytest.raises(ValueError, match="num_shards"):
        tiny.build_tiny_model(tmp_path / "y", num_shards=1)
    assert not (tmp_path / "y").exists()
    assert not list(tmp_path.glob(".y.tmp-*"))
    # A failure after files were written (the tokenizer cannot fill a 5000-token vocab):
    # neither the output nor the temporary directory is left behind.
    with pytest.raises(RuntimeError, match="tokenizer has .* tokens, model vocab is 5000"):
        tiny.build_tiny_model(tmp_path / "z", vocab_size=5000)
    assert not (tmp_path / "z").exists()
    assert not list(tmp_path.glob(".z.tmp-*"))


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_run_and_hy3rl_tiny_model(tmp_path: Path):
    """`hy3rl tiny_model` builds model.tiny into the layout's TINY_MODEL_DIR; a second run
    refuses the non-empty directory with one clear line and exit status 1."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"tiny": {"seed": 3, "num_experts": 3,
                                                      "num_shards": 2}}}))
    cmd = [sys.executable, "-m", "hy3rl.cli", "tiny_model", "--configfile", str(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "2 shards" in proc.stderr and "seed 3" in proc.stderr
    out = tmp_path / TINY_MODEL_DIR
    assert json.loads((out / "config.json").read_text())["num_experts"] == 3
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and "not empty" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # run() itself: the typed section; a refused output is a StageError naming the path.
    with pytest.raises(tiny.ModelError, match=f"{out}: .*not empty"):
        tiny.run(make_config(model={"tiny": {"seed": 3}}).model.tiny, out=out)


@pytest.mark.slow  # quick loop: left out (a workflow run or a heavy subprocess)
def test_schema_default_is_the_tiny_model_path(tiny_hy3_dir: Path):
    schema = yaml.safe_load((REPO / "config/schema/model.schema.yaml").read_text())
    assert schema["properties"]["source"]["default"] == TINY_MODEL_DIR
    assert "directory(TINY_MODEL_DIR)" in (REPO / "rules/model.smk").read_text()
    # A local source, even before rule tiny_model has built it (not a hub repo id).
    assert make_config().model.is_local and make_config().model.path == TINY_MODEL_DIR
    # The builder's sizes default to the schema's (the fixture passes only the seed).
    spec = json.loads((tiny_hy3_dir / "tiny-hy3.json").read_text())["spec"]
    defaults = dataclasses.asdict(make_config().model.tiny)
    assert {k: spec[k] for k in defaults} == defaults
