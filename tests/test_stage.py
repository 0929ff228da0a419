"""rehearsal.shape stage (issue 28; hy3rl.stage): one pipeline stage of a Hy3 built from the
real checkpoint's config and headers, at a reduced size here (a tiny random Hy3 stands for
the real one: never gigabytes in CI); its inventory against the real one, each way it can
differ; the per-GPU figures of the paper plan and of the stage rehearsal's plan, composed by
preflight over the fake verl, equal; and a rehearsal that would change them refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hy3rl import rehearsal as rh
from hy3rl import stage
from hy3rl.checkpoint import read_header
from hy3rl.layout import Layout
from hy3rl.model import build_tiny_model
from hy3rl.settings import Config
from test_preflight import PUBLISHED

# The real Hy3 (upstream-facts.md): its config as the checkpoint's config.json gives it.
HY3 = {"model_type": "hy_v3", "architectures": ["HYV3ForCausalLM"], "vocab_size": 120832,
       "hidden_size": 4096, "num_hidden_layers": 80, "num_attention_heads": 64,
       "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 13312,
       "moe_intermediate_size": 1536, "num_experts": 192, "num_experts_per_tok": 8,
       "num_shared_experts": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
       "tie_word_embeddings": False}
HY3_BYTES = 597_572_342_272  # metadata.total_size of the real checkpoint


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    """A tiny Hy3 standing for the real one: 4 decoder layers (0 dense) + MTP, 8 experts."""
    return build_tiny_model(tmp_path_factory.mktemp("real") / "hy3", num_hidden_layers=4,
                            num_experts=8)


def headers(model: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        shard = read_header(f)
        assert shard.error is None, shard.error
        out.update({n: (i.dtype, i.shape) for n, i in shard.tensors.items()})
    return out


def test_the_real_hy3s_stage_is_the_heaviest_five_layers_of_the_real_sizes() -> None:
    """The paper's stage, from the real config alone (no weights): the inventory builder
    gives the real checkpoint's total size exactly, the stage 5 layers of it: the layers of
    the run's heaviest stage (issue 43: stage 1, real layers 5-9, five MoE; stage 0 holds
    the dense layer 0), with the embedding, the output layer and the MTP layer."""
    assert stage.stage_bytes(HY3) == HY3_BYTES
    assert stage.heaviest_offset(HY3, 16) == 5
    cfg, cut = stage.stage_config(HY3, 16)
    assert cfg["num_hidden_layers"] == 5 and cut == [] and cfg["first_k_dense_replace"] == 0
    inv = stage.inventory(cfg)
    assert "model.layers.0.mlp.gate_proj.weight" not in inv  # no dense layer
    assert inv["model.layers.0.mlp.experts.0.gate_proj.weight"].shape == (1536, 4096)
    assert inv["model.layers.4.mlp.experts.191.up_proj.weight"].shape == (1536, 4096)
    assert inv["model.layers.5.eh_proj.weight"].shape == (4096, 8192)  # the MTP layer
    assert inv["lm_head.weight"].shape == (120832, 4096)
    assert stage.real_name("model.layers.0.mlp.router.gate.weight", 5, 80, 5) == \
        "model.layers.5.mlp.router.gate.weight"
    assert stage.real_name("model.layers.5.eh_proj.weight", 5, 80, 5) == \
        "model.layers.80.eh_proj.weight"
    assert 46e9 < stage.stage_bytes(cfg) < 47e9  # ~23.3B parameters in bf16


# The paper plan's per-GPU values (tests/test_preflight.py PUBLISHED) and what the pinned
# launch script adds for memory: full recompute, one layer a group; vLLM's fraction 0.65.
PAPER_EFF = {**PUBLISHED,
             "actor_rollout_ref.actor.megatron.override_transformer_config": {
                 "recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1},
             "actor_rollout_ref.rollout.gpu_memory_utilization": 0.65,
             "actor_rollout_ref.rollout.max_num_seqs": 1024}
# issue 43's table, computed by hand from the real config (GB of 1e9 bytes a GPU)
HAND = {"static_stage_15": 48.05, "static_rehearsal": 44.69, "stored_stage_0": 20.13,
        "stored_stage_1": 18.87, "peak_stage_1": 63.2, "peak_rehearsal": 45.9,
        "kv_budget_run": 25.5, "kv_tokens_run": 623e3, "kv_bytes_run": 40960,
        "kv_budget_rehearsal_before": 32.6, "kv_bytes_rehearsal": 20480,
        "kv_tokens_rehearsal_before": 1.59e6}


# the rehearsal's stage as it was before issue 43: the real model's first five layers (1
# dense, 4 MoE) with the MTP layer, the embedding and the output layer
OLD_STAGE = {**HY3, "num_hidden_layers": 5}


def _rehearsal_eff(**change) -> dict:
    """The stage rehearsal's plan: one node, PP 1, rollout TP 1."""
    return {**PAPER_EFF, "trainer.nnodes": 1,
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 1,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 1, **change}


def test_the_paper_plans_memory_by_stage_reproduces_the_hand_table() -> None:
    """Issue 43: the paper run's heaviest GPU is not the rehearsal's stage. Every stage of
    the real run predicted from the real config and the paper plan, within 5 % of the hand
    computation: stage 15 holds the most static memory (5 MoE layers and the output layer),
    stages 0 and 1 the most stored activations (16 and 15 microbatches in flight under
    1F1B), stage 1 the largest peak; the rehearsal's stage as it was (1 dense, 4 MoE,
    embedding and output, one microbatch in flight) 45.9 GB; as it is now (the heaviest
    stage's five MoE layers with both ends' weights) 53.0 GB, its static memory above every
    real stage's."""
    from hy3rl import stage_memory as sm

    run = sm.stages(HY3, PAPER_EFF, 128)
    rows = run["stages"]
    assert len(rows) == 16 and run["worst"] == 1
    assert rows[15]["static_gb"] == pytest.approx(HAND["static_stage_15"], rel=0.05)
    assert max(r["static_gb"] for r in rows) == rows[15]["static_gb"]
    assert rows[0]["stored_gb"] == pytest.approx(HAND["stored_stage_0"], rel=0.05)
    assert rows[1]["stored_gb"] == pytest.approx(HAND["stored_stage_1"], rel=0.05)
    assert rows[1]["peak_gb"] == pytest.approx(HAND["peak_stage_1"], rel=0.05)
    assert (rows[0]["in_flight"], rows[1]["in_flight"], rows[15]["in_flight"]) == (16, 15, 1)
    assert (rows[0]["mix"], rows[1]["mix"], rows[15]["mix"]) == (
        "1 dense, 4 MoE + embedding", "5 MoE", "5 MoE + output")
    assert sm.describe(rows[1]) == ("stage 1 (layers 5-9: 5 MoE): static 44.34 GB + 15 "
                                    "microbatch(es) in flight x 1.258 GB = 63.21 GB")
    (old,) = sm.stages(OLD_STAGE, _rehearsal_eff(), 8)["stages"]
    assert old["mix"] == "1 dense, 4 MoE + embedding + output" and old["in_flight"] == 1
    assert old["static_gb"] == pytest.approx(HAND["static_rehearsal"], rel=0.05)
    assert old["peak_gb"] == pytest.approx(HAND["peak_rehearsal"], rel=0.05)
    cfg, _ = stage.stage_config(HY3, 16)
    reh = sm.stages(cfg, _rehearsal_eff(), 8)
    (only,) = reh["stages"]
    assert only["mix"] == "5 MoE + embedding + output" and only["in_flight"] == 1
    assert only["static_gb"] == pytest.approx(51.76, abs=0.01)
    assert only["static_gb"] > max(r["static_gb"] for r in rows)
    assert only["peak_gb"] == pytest.approx(53.02, abs=0.01)
    # the run's stages from a measured rehearsal peak: the difference the model predicts
    measured = sm.from_measured(50.0, run, reh)
    assert measured[1]["peak_gb"] == pytest.approx(50.0 + 63.21 - 53.02, abs=0.02)
    # MTP trained: verl builds the MTP layer on the last stage, which then holds it too
    mtp = sm.stages(HY3, {**PAPER_EFF, "actor_rollout_ref.model.mtp.enable": True}, 128)
    assert mtp["stages"][15]["mix"] == "5 MoE + MTP + output"
    assert mtp["stages"][15]["static_gb"] > rows[15]["static_gb"] + 8
    # a recompute setting the model does not cover: static only, said so
    plain = sm.stages(HY3, {**PAPER_EFF, sm.RECOMPUTE: {"recompute_granularity": None}}, 128)
    assert not plain["stages"][1]["complete"] and plain["stages"][1]["activation_gb"] is None
    assert "not modeled: recompute_granularity None" in sm.describe(plain["stages"][1])


def test_vllm_at_the_runs_concurrency_per_engine() -> None:
    """Issue 43: vLLM skips the MTP layer (7.5 GB), so the run's KV budget a GPU is 25.5 GB
    (not 25.05), 40,960 bytes a token at TP 16 (one of 8 KV heads a rank, 80 layers), 623K
    tokens (61 full sequences), 256 requests an engine a step. The stage at rollout TP 1
    (5 layers, 8 KV heads: 20,480 bytes a token) with a fraction that kept the run's budget
    in GB held 2.5 x the run's tokens and served 16 requests; the matching fraction and
    batch give it the run's tokens and requests an engine."""
    from hy3rl import stage_memory as sm

    run = sm.rollout(HY3, PAPER_EFF, gpus=128, gpu_memory_gb=96, model_bytes=HY3_BYTES)
    assert run["kv_budget_gb"] == pytest.approx(HAND["kv_budget_run"], abs=0.05)
    assert run["kv_bytes_per_token"] == HAND["kv_bytes_run"]
    assert run["kv_tokens"] == pytest.approx(HAND["kv_tokens_run"], rel=0.01)
    assert (run["full_sequences"], run["engines"], run["requests_per_engine"]) == (60.8, 8, 256)
    cfg, _ = stage.stage_config(HY3, 16)
    before = sm.rollout(OLD_STAGE, _rehearsal_eff(**{
        "data.train_batch_size": 8, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6745}),
        gpus=8, gpu_memory_gb=96)
    assert before["kv_budget_gb"] == pytest.approx(HAND["kv_budget_rehearsal_before"], abs=0.1)
    assert before["kv_bytes_per_token"] == HAND["kv_bytes_rehearsal"]
    assert before["kv_tokens"] == pytest.approx(HAND["kv_tokens_rehearsal_before"], rel=0.01)
    assert before["requests_per_engine"] == 16
    util = sm.matching_utilization(run, cfg, _rehearsal_eff(), 96)
    after = sm.rollout(cfg, _rehearsal_eff(**{
        "actor_rollout_ref.rollout.gpu_memory_utilization": util}), gpus=8, gpu_memory_gb=96)
    assert run["kv_tokens"] <= after["kv_tokens"] <= run["kv_tokens"] * (1 + stage.KV_TOLERANCE)
    # 623K tokens x 20,480 B + the five MoE layers, embedding and output (39.2 GB) on 96 GB
    assert after["requests_per_engine"] == 256 and util == pytest.approx(
        (run["kv_tokens"] * 20480 + 39.18e9) / 96e9, abs=1e-3)
    run_gpu = stage.per_gpu(HY3, PAPER_EFF, gpu_memory_gb=96, model_bytes=HY3_BYTES)
    reh_gpu = stage.per_gpu(cfg, _rehearsal_eff(**{
        "actor_rollout_ref.rollout.gpu_memory_utilization": util}), gpu_memory_gb=96,
        model_bytes=stage.stage_bytes(cfg))
    assert reh_gpu["rollout_kv_tokens"] == after["kv_tokens"]
    assert stage.compare(run_gpu, reh_gpu) == []
    few = stage.per_gpu(cfg, _rehearsal_eff(**{
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6745,
        "data.train_batch_size": 8}), gpu_memory_gb=96, model_bytes=stage.stage_bytes(cfg))
    assert {d["key"] for d in stage.compare(run_gpu, few)} == {
        "rollout_kv_tokens", "rollout_requests_per_engine"}


def test_a_plan_whose_worst_stage_exceeds_the_headroom_is_refused_naming_it() -> None:
    """Issue 43: the paper plan on a GPU of 64 GB: stage 1's predicted 63.2 GB is above 0.9
    of it; the refusal names the stages over, the heaviest first, with their terms."""
    from hy3rl import stage_memory as sm

    cfg, _ = stage.stage_config(HY3, 16)
    memory = sm.plan_prediction(HY3, PAPER_EFF, cfg, _rehearsal_eff())
    assert (memory["heaviest"], memory["heaviest_mix"], memory["rehearsal_mix"]) == (
        1, "5 MoE", "5 MoE + embedding + output")
    assert sm.refusal(memory, 96.0, 0.9) is None
    why = sm.refusal(memory, 64.0, 0.9)
    assert why.startswith(
        "the run's predicted peak exceeds 0.9 of the 64 GB GPU (57.6 GB) on 6 of 16 pipeline "
        "stage(s): stage 1 (layers 5-9: 5 MoE): static 44.34 GB + 15 microbatch(es) in "
        "flight x 1.258 GB = 63.21 GB; stage 2 (layers 10-14: 5 MoE)"), why
    assert "experts / (EP x ETP) x (2 + 4 + 12 / 1) B" in why
    fsdp = sm.plan_prediction(HY3, {**PAPER_EFF, "actor_rollout_ref.actor.strategy": "fsdp"},
                              cfg, _rehearsal_eff())
    assert fsdp["not_run"].startswith("not run: actor strategy 'fsdp'")
    assert sm.refusal(fsdp, 64.0, 0.9) is None


def test_a_stage_that_cannot_be_cut_is_refused_naming_the_key() -> None:
    with pytest.raises(stage.StageBuildError, match=r"num_hidden_layers = 80 does not split "
                       r"into 3 pipeline stages"):
        stage.stage_config(HY3, 3)
    with pytest.raises(stage.StageBuildError, match="all dense"):
        stage.stage_config({**HY3, "first_k_dense_replace": 80}, 16)
    with pytest.raises(stage.StageBuildError, match="model_type"):
        stage.stage_config({**HY3, "model_type": "llama"}, 16)


def test_the_stage_holds_the_real_tensors_of_its_layers_and_loads(real: Path,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "stage"
    rec = stage.build_stage(real, out, pp=2, shard_bytes=150_000)
    check = rec["inventory_check"]
    assert (check["against"], check["problems"], check["problem_count"]) == ("headers", [], 0)
    assert (rec["layers"], rec["real_layers"], rec["mtp_layers"]) == (2, 4, 1)
    # the heaviest of the two stages: real layers 2-3 (both MoE; stage 0 holds dense 0)
    assert (rec["real_layers_held"], rec["stage_of_run"]) == ([2, 3], 1)
    assert rec["per_layer_keys_cut"] == ["mlp_layer_types"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["mlp_layer_types"] == ["sparse", "sparse"]
    real_cfg = json.loads((real / "config.json").read_text())
    own = ("num_hidden_layers", "mlp_layer_types", "first_k_dense_replace")
    assert {k: v for k, v in cfg.items() if k not in own} \
        == {k: v for k, v in real_cfg.items() if k not in own}
    # tensor by tensor, header against header: real layers 2-3 (stage 0-1), the MTP layer
    # (real 4, stage 2), the embedding, norm and output layer; nothing of layers 0-1
    got, want = headers(out), headers(real)
    mapping = {n: stage.real_name(n, 2, 4, 2) for n in got}
    assert mapping["model.layers.2.eh_proj.weight"] == "model.layers.4.eh_proj.weight"
    assert mapping["model.layers.0.mlp.router.gate.weight"] == \
        "model.layers.2.mlp.router.gate.weight"
    assert {n: got[n] for n in got} == {n: want[mapping[n]] for n in got}
    held = set(mapping.values())
    assert {n for n in want if n not in held} == {
        n for n in want if n.startswith(("model.layers.0.", "model.layers.1."))}
    # shard by shard (several shards at this shard size), the index names every tensor
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got) and rec["shards"] > 2
    assert index["metadata"]["total_size"] == rec["total_size"] == sum(
        f.stat().st_size - 8 - read_header(f).header_len for f in out.glob("*.safetensors"))
    # random weights, norms at one, the expert bias F32 and non-zero; the tokenizer copied
    from safetensors import safe_open

    values = {}
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            values.update({n: fh.get_tensor(n) for n in fh.keys()})  # noqa: SIM118
    assert values["model.layers.1.mlp.experts.3.up_proj.weight"].float().std() > 0.01
    assert (values["model.norm.weight"] == 1).all()
    bias = values["model.layers.1.mlp.expert_bias"]
    assert str(bias.dtype) == "torch.float32" and (bias != 0).all()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (real / name).read_bytes()
    assert not (out / "tiny-hy3.json").exists()  # the real model's own record is not copied
    assert not list(tmp_path.glob(".stage.tmp-*"))
    # transformers' hy_v3 loads it and generates (the MTP layer ignored on load, as Hy3's)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Find 2 + 2.", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 4 or tok.eos_token_id in gen[0].tolist()


def test_only_the_index_on_disk_the_config_decides(real: Path, tmp_path: Path) -> None:
    """Header-only where the shards are there; where only config and index are (not
    downloaded), the real config's inventory is the reference, and says so."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        shutil.copy2(real / name, bare / name)
    real_cfg = json.loads((real / "config.json").read_text())
    cfg, _ = stage.stage_config(real_cfg, 2)
    rec = stage.check_against_real(cfg, bare, real_cfg, stage.heaviest_offset(real_cfg, 2))
    assert rec["against"] == "config" and rec["problems"] == []


def test_a_real_checkpoint_unlike_its_config_is_refused_naming_the_tensor(
        real: Path, tmp_path: Path) -> None:
    """The stage comes from the config; the real shards' headers decide: a config whose
    expert FFN size is not the checkpoint's fails, naming the tensor, with nothing written."""
    lying = tmp_path / "lying"
    shutil.copytree(real, lying)
    cfg = json.loads((lying / "config.json").read_text())
    cfg["moe_intermediate_size"] *= 2
    (lying / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "stage"
    with pytest.raises(stage.StageBuildError, match=r"against its headers.*"
                       r"model\.layers\.0\.mlp\.(experts\.0|shared_mlp)\.(gate|up|down)_proj\."
                       r"weight: stage BF16\[\d+, \d+\], real model\.layers\.2\."):
        stage.build_stage(lying, out, pp=2)
    assert not out.exists() and not list(tmp_path.glob(".stage.tmp-*"))
    # a real tensor of the stage's layers the config does not imply (an extra tensor)
    from safetensors.torch import load_file, save_file

    extra = tmp_path / "extra"
    shutil.copytree(real, extra)
    first = sorted(extra.glob("*.safetensors"))[0]
    tensors = load_file(first)
    name = next(n for n in tensors if n.startswith("model.layers."))
    tensors["model.layers.2.mlp.surprise.weight"] = tensors[name].clone()  # a layer held
    save_file(tensors, str(first), metadata={"format": "pt"})
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.2.mlp.surprise.weight"] = first.name
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(stage.StageBuildError, match=r"model\.layers\.2\.mlp\.surprise\.weight: "
                       r"in the real checkpoint, not in the stage"):
        stage.build_stage(extra, out, pp=2)


def test_an_output_in_the_way_is_refused_and_kept(real: Path, tmp_path: Path) -> None:
    out = tmp_path / "stage"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(stage.StageBuildError, match="exists and is not empty"):
        stage.build_stage(real, out, pp=2)
    assert (out / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------- the plans


def _paper_stage_cfg(tmp_path: Path, real: Path, **rehearsal) -> Config:
    from hy3rl.config import deep_merge, load

    repo = Path(__file__).resolve().parents[1]
    raw = deep_merge(load(repo / "config/config.yaml", repo / "config/paper.yaml"), {
        "run": {"results_root": str(tmp_path / "results")},
        "model": {"source": str(real), "revision": None, "dir": ""},
        "data": {"heldout": None}, "eval": {"select": None},
        "train": {"checkpoint_root": str(tmp_path / "ckpt")},
        "preflight": {"waive": ["disk"]}, "rehearsal": rehearsal})
    return Config.from_dict(raw)


def _plans(cfg: Config, verl, tmp_path: Path) -> tuple[Path, Layout]:
    """The run's plan (preflight over the fake verl), then the stage built from it."""
    from hy3rl import preflight as pf
    from test_preflight import bridge_report

    layout = Layout.from_config(cfg)
    main = Path(layout.preflight_plan)
    bridge = bridge_report(tmp_path / "checks" / "bridge.json")
    pf.run(cfg, lock=verl.lock, data_summary=None, train_files=tmp_path / "data/train.parquet",
           val_files=tmp_path / "data/val.parquet", checkpoint_check=None,
           bridge_check=bridge, plan=main, launch=Path(layout.preflight_launch),
           refused=main.with_name("refused.json"),
           reward_fn=lambda sha: main.with_name(f"{sha}.py"))
    stage.run(cfg, out=Path(layout.rehearsal_model), plan=main)
    return main, layout


def _rehearsal_plan(cfg: Config, verl, tmp_path: Path, layout: Layout, main: Path) -> dict:
    rh.plan(cfg, layout, lock=verl.lock, data_summary=tmp_path / "none.json",
            train_files=tmp_path / "data/train.parquet",
            val_files=tmp_path / "data/val.parquet", checkpoint_check=None,
            bridge_check=tmp_path / "checks" / "bridge.json", main_plan=main)
    return json.loads(Path(layout.rehearsal_layout().preflight_plan).read_text())


@pytest.fixture(scope="module")
def real_pp16(tmp_path_factory) -> Path:
    """A tiny Hy3 whose 32 layers split into the paper's 16 stages of 2 (0 dense, 1 MoE)."""
    return build_tiny_model(tmp_path_factory.mktemp("real16") / "hy3", num_hidden_layers=32,
                            num_experts=8)


def test_the_paper_stage_plans_per_gpu_figures_equal_the_paper_plans(
        real_pp16: Path, fake_verl_repo, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # the paper's loggers include wandb
    verl = fake_verl_repo()
    cfg = _paper_stage_cfg(tmp_path, real_pp16)
    assert cfg.rehearsal.shape == "stage"
    main, layout = _plans(cfg, verl, tmp_path)
    record = json.loads((Path(layout.rehearsal_model) / "stage-hy3.json").read_text())
    assert (record["pipeline_stages"], record["layers"]) == (16, 2)
    doc = _rehearsal_plan(cfg, verl, tmp_path, layout, main)
    assert doc["ok"], doc["errors"]
    per = doc["rehearsal"]["per_gpu"]
    assert doc["rehearsal"]["shape"] == "stage" and per["differ"] == []
    run, reh = per["run"], per["rehearsal"]
    # the paper's per-GPU layout and lengths, in both plans
    for key, value in {"layers_per_pp_stage": 2, "experts_per_ep_rank": 1,
                       "context_parallel": 8, "max_prompt_length": 2048,
                       "max_response_length": 8192, "rollout_max_model_len": 10240}.items():
        assert run[key] == reh[key] == value, key
    for key in stage.SAME:
        if key != "rollout_kv_tokens":
            assert run[key] == reh[key], key
    assert (run["rollout_tp"], reh["rollout_tp"]) == (16, 1)
    # vLLM at the run's concurrency: each of the node's 8 engines serves the run's 256
    # requests a step (the derived batch: 128 prompts x 16) and holds the run's KV capacity
    # in tokens (the derived fraction), not its budget in GB
    assert run["rollout_requests_per_engine"] == reh["rollout_requests_per_engine"] == 256
    assert (run["rollout_engines"], reh["rollout_engines"]) == (8, 8)
    assert run["rollout_kv_tokens"] <= reh["rollout_kv_tokens"] <= run["rollout_kv_tokens"] * (
        1 + stage.KV_TOLERANCE)
    # the paper: preflight.model_bytes (the real 597.6 GB, less the share of the MTP layer
    # vLLM skips: one layer of 33 in this stand-in) at rollout TP 16 and the script's
    # ROLLOUT_GPU_MEM_UTIL 0.65
    assert run["rollout_gpu_memory_utilization"] == 0.65
    assert 35 < run["rollout_weights_gb"] < 37.35
    assert run["rollout_kv_budget_gb"] == pytest.approx(
        96 * 0.65 - run["rollout_weights_gb"], abs=0.01)
    # every stage of the run predicted, and the rehearsal's stage (here tiny: nothing near a
    # GPU's memory); the plan says which real stage is the heaviest
    memory = per["memory"]
    assert len(memory["run"]["stages"]) == 16 and memory["heaviest"] in range(16)
    assert memory["rehearsal_mix"] == "2 MoE + embedding + output"
    # what the stage reduces: nodes, PP, rollout TP (and vLLM's fraction with it), batch, lr
    red = {r["key"]: (r["run"], r["rehearsal"]) for r in doc["rehearsal"]["reductions"]}
    assert red["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"] == ("16", "1")
    assert red["actor_rollout_ref.rollout.tensor_model_parallel_size"] == ("16", "1")
    assert rh.MEM_UTIL_KEY in red
    for kept in ("data.max_response_length", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                 "actor_rollout_ref.actor.megatron.context_parallel_size",
                 "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
                 "reward.reward_kwargs.overlong_buffer_cfg.len"):
        assert kept not in red, kept


def test_the_rehearsal_plan_refuses_a_run_whose_stage_cannot_fit_before_any_job(
        real_pp16: Path, fake_verl_repo, tmp_path: Path, monkeypatch) -> None:
    """Issue 43: rule rehearsal_plan (a CPU job, before the rehearsal's GPU job) refuses a
    run whose predicted stage peak is above rehearsal.memory_headroom of the GPU, naming the
    heaviest stage with its terms; nothing of the rehearsal's plan is left. (The stand-in
    model is tiny: a headroom of a millionth of the GPU plays the stage that cannot fit.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    verl = fake_verl_repo()
    cfg = _paper_stage_cfg(tmp_path, real_pp16, memory_headroom=1e-6)
    main, layout = _plans(cfg, verl, tmp_path)
    with pytest.raises(rh.RehearsalError) as err:
        _rehearsal_plan(cfg, verl, tmp_path, layout, main)
    text = str(err.value)
    assert re.search(r"^the run's predicted peak exceeds 1e-06 of the 96 GB GPU \(0\.0 GB\) "
                     r"on 16 of 16 pipeline stage\(s\): stage \d+ \(layers \d+-\d+: ", text), text
    assert "microbatch(es) in flight x" in text and "before any GPU job" in text
    assert not Path(layout.rehearsal_layout().preflight_plan).exists()


def test_a_stage_rehearsal_that_changes_the_per_gpu_layout_is_refused_by_name(
        real_pp16: Path, fake_verl_repo, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    verl = fake_verl_repo()
    cfg = _paper_stage_cfg(tmp_path, real_pp16,
                           env={"ACTOR_EP": 4, "ACTOR_CP": 1})
    main, layout = _plans(cfg, verl, tmp_path)
    with pytest.raises(rh.RehearsalError) as err:
        _rehearsal_plan(cfg, verl, tmp_path, layout, main)
    text = str(err.value)
    assert "experts_per_ep_rank: run 1.0, rehearsal 2.0" in text
    assert "context_parallel: run 8, rehearsal 1" in text
    assert not Path(layout.rehearsal_layout().preflight_plan).exists()
    # the small shape lists the same differences and plans
    small = _paper_stage_cfg(tmp_path, real_pp16, shape="small")
    shutil.rmtree(layout.rehearsal_model)
    from hy3rl.model import build_tiny_model as tiny

    tiny(layout.rehearsal_model, small.rehearsal.model)
    doc = _rehearsal_plan(small, verl, tmp_path, layout, main)
    keys = {d["key"] for d in doc["rehearsal"]["per_gpu"]["differ"]}
    assert {"max_response_length", "context_parallel", "ppo_max_token_len_per_gpu"} <= keys


def test_the_report_says_what_the_stage_was_and_its_peaks_beside_the_device(
        tmp_path: Path) -> None:
    """The report's rehearsal section from the records: the stage named with its sizes and
    inventory check, the memory peaks beside one GPU's memory, the per-GPU figures of both
    plans with a difference marked."""
    from fixtures.common import make_config
    from hy3rl.atomic import write_json_atomic
    from hy3rl.report import build

    cfg = make_config(run={"results_root": str(tmp_path / "results")},
                      cluster={"gpu": True, "gpu_memory_gb": 96},
                      rehearsal={"shape": "stage"})
    layout = Layout.from_config(cfg)
    peak = {"key": "actor/perf/max_memory_allocated_gb", "peak": 71.5, "step": 2,
            "missing": []}
    write_json_atomic(Path(layout.rehearsal_checks), {
        "schema_version": 1, "ok": True, "started": "s", "finished": "f",
        "checks": [{"name": n, "status": "pass", "detail": "ok"} for n in rh.CHECKS],
        "memory": {"gpu_memory_gb": 96.0, "headroom": 0.9,
                   "phases": {"update": {"max_memory_allocated_gb": peak}}},
        "evaluation": {"backend": "vllm"}})
    run = {"layers_per_pp_stage": 5.0, "rollout_kv_budget_gb": 25.05, "rollout_tp": 16}
    write_json_atomic(Path(layout.rehearsal_layout().preflight_plan), {"rehearsal": {
        "shape": "stage", "gpus_per_node": 8, "total_training_steps": 3, "kill_after": 2,
        "reductions": [], "model": {"layers": 5, "real_layers": 80, "mtp_layers": 1,
                                    "parameters": 19.86e9, "total_size": 39.7e9,
                                    "inventory_check": {"against": "headers"}},
        "per_gpu": {"run": run, "rehearsal": {**run, "rollout_tp": 1},
                    "differ": [{"key": "rollout_tp", "run": 16, "rehearsal": 1}]}}})
    import html

    page = html.unescape(build(cfg, layout, {})["index.html"].decode())
    assert ("one pipeline stage of the run's model (5 of its 80 layers + 1 MTP, 19.9B "
            "parameters, 39.7 GB of random weights, its tensors checked against the real "
            "checkpoint's headers)") in page
    memory = page.split('id="rehearsal-memory"', 1)[1].split("</table>", 1)[0]
    assert "max_memory_allocated_gb" in memory and "71.5" in memory and "96" in memory
    per = page.split('id="rehearsal-per-gpu"', 1)[1].split("</table>", 1)[0]
    assert "layers_per_pp_stage" in per and "25.05" in per
    assert per.count("differs") == 1


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_snakemake_builds_the_stage_and_plans_its_rehearsal(tmp_path: Path) -> None:
    """Through `snakemake --profile profiles/local` on the GPU DAG (the fake verl cloned
    for real, local parquet, the tiny Hy3 built by rule tiny_model standing for the real
    model): rule rehearsal_model builds the stage from the model and the run's plan, rule
    rehearsal_plan plans it with per-GPU figures equal to the run's."""
    import os
    import sys

    import yaml
    from fixtures.gpu_dag import double_sources, snakemake, workflow_copy

    cfg = {"run": {"name": "st"}, **double_sources(tmp_path),
           "cluster": {"gpu": True, "nodes": 1, "gpus_per_node": 1, "cpus_per_node": 1,
                       "gpu_memory_gb": 80},
           "train": {"checkpoint_root": str(tmp_path / "ckpt"), "total_training_steps": 2,
                     "cpu": {"enable": False}},
           "eval": {"select": None}, "preflight": {"waive": ["bridge"]},
           "rehearsal": {"shape": "stage"}}
    cfg["data"]["heldout"] = None
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump(cfg))
    snakefile = workflow_copy(tmp_path / "wf")
    work = tmp_path / "work"
    work.mkdir()
    wf = snakefile.parent
    env = {"PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
           "WANDB_MODE": "offline"}
    code, out = snakemake(snakefile, [  # the target first: --configfile takes the rest
        "results/st/rehearsal/preflight/plan.json", "--profile",
        str(wf / "profiles" / "local"), "--configfile", str(wf / "config" / "config.yaml"),
        str(override)], work, env)
    assert code == 0, out[-5000:]
    res = work / "results" / "st"
    record = json.loads((res / "rehearsal" / "model" / "stage-hy3.json").read_text())
    model = json.loads((res / "rehearsal" / "model" / "config.json").read_text())
    real = json.loads((work / "resources" / "tiny-hy3" / "config.json").read_text())
    assert record["inventory_check"] == {"against": "headers", "tensors": record[
        "inventory_check"]["tensors"], "problems": [], "problem_count": 0}
    assert record["layers"] == real["num_hidden_layers"] // record["pipeline_stages"]
    assert {k: model[k] for k in ("hidden_size", "num_experts", "vocab_size")} == {
        k: real[k] for k in ("hidden_size", "num_experts", "vocab_size")}
    plan = json.loads((res / "rehearsal" / "preflight" / "plan.json").read_text())
    assert plan["ok"] and plan["rehearsal"]["shape"] == "stage"
    assert plan["rehearsal"]["per_gpu"]["differ"] == []
    assert plan["rehearsal"]["model"]["layers"] == record["layers"]
