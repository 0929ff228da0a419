"""The CPU path's pieces (hy3rl.verl_cpu) without running verl: each workaround held to the
pinned verl (its line still there: still needed), the script's move to the FSDP engine, the
process-group fix, and the hf rollout's generation (stops at EOS, log-probabilities of what
it sampled). The real trainer runs in tests/test_real_verl.py."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fixtures.deps import VERL_PIN, mirror
from hy3rl.preflight.resolve import split_override
from hy3rl.verl_cpu import ENV, plan
from hy3rl.verl_cpu.rollout import HFServer
from hy3rl.verl_cpu.workarounds import WORKAROUNDS, _dedup_backend


def _pinned(path: str) -> str:
    repo = mirror("verl")
    if repo is None:
        pytest.skip("no verl mirror (HY3RL_VERL_MIRROR) holding the pin")
    proc = subprocess.run(["git", "-C", str(repo), "show", f"{VERL_PIN}:{path}"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{path} is not in verl@{VERL_PIN[:7]}: {proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("w", WORKAROUNDS, ids=lambda w: w.name)
def test_each_workaround_is_still_needed_at_the_pin(w):
    """The line a workaround works around is in the pinned verl: a pin that moved past it
    fails here, naming the workaround to re-examine."""
    text = _pinned(w.verl_file)
    assert w.verl_text in text, (
        f"workaround {w.name}: verl@{VERL_PIN[:7]} {w.verl_file} no longer has "
        f"{w.verl_text!r}; check whether {w.remedy!r} is still needed")


def test_the_environment_names_the_plugin_hook_verl_reads():
    init = _pinned("verl/__init__.py")
    assert 'os.getenv("VERL_USE_EXTERNAL_MODULES", "")' in init
    assert ENV["VERL_USE_EXTERNAL_MODULES"] == "hy3rl.verl_cpu"
    manager = _pinned("verl/plugin/platform/platform_manager.py")
    assert 'os.environ.get("VERL_PLATFORM", "")' in manager
    engine = _pinned("verl/workers/engine/base.py")
    assert 'os.getenv("VERL_ENGINE_DEVICE")' in engine and 'os.getenv("VERL_ENGINE_VENDOR")' \
        in engine


def test_the_dp_engine_group_exists_at_the_pin():
    assert "model_engine: dp" in _pinned("verl/trainer/config/model_engine/dp.yaml")


@pytest.mark.parametrize("given, wanted", [
    ("cpu:gloo,cpu:gloo", "cpu:gloo"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ("gloo", "gloo"),
    (None, None),
])
def test_the_process_group_backend_names_each_device_once(given, wanted):
    assert _dedup_backend(given) == wanted


def test_the_script_moves_to_the_fsdp_engine_dropping_megatron_keys_with_why():
    items = [SimpleNamespace(text=t) for t in (
        "model_engine=megatron",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=16",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True",
        "actor_rollout_ref.actor.optim.min_lr=1e-6",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "+reward_model.reward_kwargs.max_resp_len=8192",
    )]
    keys = {"actor_rollout_ref.actor.optim.lr"}
    kept, dropped = plan.move_to_fsdp(items, lambda k: k in keys, split_override)
    assert [(i.text, new) for i, new in kept] == [
        ("model_engine=megatron", "model_engine=dp"),
        ("actor_rollout_ref.actor.optim.lr=1e-6", None),
        ("+reward_model.reward_kwargs.max_resp_len=8192", None)]
    assert [(i.text.split("=")[0], why) for i, why in dropped] == [
        ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
         "Megatron engine only"),
        ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm",
         "Megatron engine only"),
        ("actor_rollout_ref.actor.optim.min_lr", "not a key of the dp engine's config")]


def test_every_cpu_override_says_why():
    for o in plan.overrides(2):
        assert o.why and o.value, o
    assert {o.key: o.value for o in plan.overrides(2)}["trainer.n_gpus_per_node"] == "2"


# ---- the hf rollout's generation (no Ray, no verl: the server's core) ---------------------


def _server(model_dir: Path, response_length: int) -> HFServer:
    from transformers import AutoModelForCausalLM

    server = object.__new__(HFServer)
    server.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    server.model.eval()
    server.config = SimpleNamespace(response_length=response_length, prompt_length=16,
                                    max_model_len=None)
    server.eos_ids = [int(server.model.config.eos_token_id)]
    server.pad_id = server.eos_ids[0]
    return server


def test_the_hf_rollout_stops_at_eos_and_returns_the_sampled_tokens_log_probs(tiny_hy3_dir):
    """With the model's EOS made likely the responses end before the limit, at EOS; each
    token has the log-probability the sampling gave it (temperature applied)."""
    server = _server(tiny_hy3_dir, response_length=48)
    eos = server.eos_ids[0]

    def likelier_eos(_module, _inputs, logits):  # p(EOS) ~ 1/10 a token
        logits[..., eos] += 4.0
        return logits

    server.model.lm_head.register_forward_hook(likelier_eos)
    torch.manual_seed(0)
    lengths = []
    for _ in range(6):
        out = server._generate([5, 6, 7, 8], {"temperature": 1.0, "top_p": 1.0,
                                               "logprobs": True})
        ids, logprobs = out["token_ids"], out["log_probs"]
        assert len(ids) == len(logprobs) and 1 <= len(ids) <= 48
        assert all(lp <= 0 for lp in logprobs)
        if len(ids) < 48:
            assert ids[-1] == eos and eos not in ids[:-1]
        lengths.append(len(ids))
    assert min(lengths) < 48, lengths  # stopped at EOS, not at the limit


def test_the_hf_rollout_honours_max_tokens_and_the_context(tiny_hy3_dir):
    server = _server(tiny_hy3_dir, response_length=64)
    out = server._generate([5, 6, 7], {"temperature": 0, "max_tokens": 3})
    assert 1 <= len(out["token_ids"]) <= 3
    server.config.max_model_len = 8
    out = server._generate([5, 6, 7, 8, 9, 10], {"temperature": 0})
    assert 1 <= len(out["token_ids"]) <= 2  # 8 - 6 positions left


def test_samples_are_seeded_by_weights_prompt_and_draw_whatever_the_order():
    """The k-th sample of a prompt from given weights has its own seed, whatever order the
    requests of a group arrive in; new weights (a sync) give new seeds; so does the config's
    seed."""
    def server(seed=42):
        s = object.__new__(HFServer)
        s.config, s.global_steps, s.weight_syncs, s._drawn = SimpleNamespace(seed=seed), 1, 1, {}
        return s

    a, b = server(), server()
    first = [a.sample_seed([1, 2, 3]) for _ in range(4)]
    assert len(set(first)) == 4
    other = a.sample_seed([1, 2, 4])
    assert other not in first
    # another order of the same requests: the same seeds
    assert b.sample_seed([1, 2, 4]) == other
    assert [b.sample_seed([1, 2, 3]) for _ in range(4)] == first
    b.weight_syncs += 1
    assert b.sample_seed([1, 2, 3]) not in first
    assert server(seed=7).sample_seed([1, 2, 3]) != first[0]


# ---- verl's FSDP checkpoint layout (the CPU path's saves) ---------------------------------


def _fsdp_step(root: Path, step: int, world: int = 2) -> Path:
    """A finished save in the layout verl's FSDP checkpoint manager writes at the pin."""
    step_dir = root / f"global_step_{step}"
    actor = step_dir / "actor"
    (actor / "huggingface").mkdir(parents=True)
    for kind in ("model", "optim", "extra_state"):
        for rank in range(world):
            torch.save({"rank": rank}, actor / f"{kind}_world_size_{world}_rank_{rank}.pt")
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 2}')
    torch.save({"dataloader": 1}, step_dir / "data.pt")
    return step_dir


def test_an_fsdp_checkpoint_is_complete_only_when_every_rank_and_file_is_whole(tmp_path):
    from fixtures.common import make_config
    from hy3rl.ckptdir import check_complete, is_fsdp
    from hy3rl.layout import Layout

    layout = Layout.from_config(make_config(run={"name": "r"},
                                            train={"checkpoint_root": str(tmp_path)}))
    good = _fsdp_step(layout.checkpoint_dir, 2)
    assert is_fsdp(good) and check_complete(good, 2) == (True, "")
    # the HF weights the evaluation reads: FSDP's actor/huggingface, Megatron's elsewhere
    assert layout.checkpoint_hf_model(2) == good / "actor/huggingface"
    assert layout.checkpoint_hf_model(4) == \
        layout.checkpoint_dir / "global_step_4/actor/model/huggingface"
    cases = {
        "rank": (lambda d: (d / "actor/optim_world_size_2_rank_1.pt").unlink(),
                 "no actor/optim_world_size_2_rank_1.pt"),
        "partial": (lambda d: (d / "actor/model_world_size_2_rank_0.pt").write_bytes(b"PK\3"),
                    "actor/model_world_size_2_rank_0.pt is not a whole torch archive"),
        "config": (lambda d: (d / "actor/fsdp_config.json").write_text("{"),
                   "actor/fsdp_config.json missing or unreadable"),
        "data": (lambda d: (d / "data.pt").unlink(), "no data.pt (dataloader state not saved)"),
        "model": (lambda d: [p.unlink() for p in (d / "actor").glob("model_*.pt")],
                  "no actor/model_world_size_*_rank_*.pt (actor save did not finish)"),
    }
    for i, (name, (spoil, says)) in enumerate(cases.items(), 3):
        step_dir = _fsdp_step(tmp_path / name, i)
        spoil(step_dir)
        ok, why = check_complete(step_dir, i)
        assert not ok and why.startswith(says), (name, why)
    mixed = _fsdp_step(tmp_path / "mixed", 9)
    torch.save({}, mixed / "actor/extra_state_world_size_4_rank_0.pt")
    assert check_complete(mixed, 9) == (False, "actor shards of several world sizes [2, 4]")
