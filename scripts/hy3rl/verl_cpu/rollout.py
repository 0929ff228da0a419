"""verl's ``hf`` rollout on the CPU path: generation with transformers from the actor's
current weights, in the shape verl's agent loop expects of a rollout server.

verl@220e903 registers only vllm, sglang and trtllm replicas
(verl/workers/rollout/replica.py ``RolloutReplicaRegistry``) and server adapters
(verl/workers/rollout/base.py ``_ROLLOUT_REGISTRY``); its ``HFRollout`` exists but nothing
reaches it since SPMD rollouts were retired. Three pieces stand in for a vLLM server:

- ``HFServer``: a Ray actor per replica that holds a transformers model, answers
  ``generate(prompt_ids, sampling_params, request_id)`` with verl's ``TokenOutput``
  (response ids, their log-probabilities after temperature and top-p, and
  ``stop_reason``), stopping at the model's end-of-sequence tokens like an engine, so
  response lengths vary; each sample seeded from the rollout's ``seed``, the weights and
  the prompt (``sample_seed``), so a run draws the same samples again; and takes new
  weights at each sync.
- ``HFReplica``: verl's ``RolloutReplica`` that starts the server beside the hybrid workers.
- ``HFServerAdapter``: verl's ``BaseRollout`` inside the hybrid worker; at each weight sync
  (checkpoint engine ``naive``, verl/workers/engine_workers.py ``update_weights``) it sends
  the actor's full tensors to the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import ray
import torch

NAME = "hf"
SERVER_PREFIX = f"{NAME}_server"


def server_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{SERVER_PREFIX}_{replica_rank}_{node_rank}"


class HFServer:
    """One rollout replica: a transformers model on the host. Requests are served one at a
    time (the host's cores are the limit, and the agent loop awaits each independently)."""

    def __init__(self, config, model_config, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        # as verl's vLLM server (vllm_async_server.py _init_config, _init_model_config)
        self.config = omega_conf_to_dataclass(config)
        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.model_config = model_config
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        path = model_config.local_path
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa",
            trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)))
        self.model.eval()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not self.eos_ids:
            raise ValueError(f"{path}: neither generation_config.json nor config.json names an "
                             "eos_token_id: the hf rollout could never stop before the limit")
        self.pad_id = getattr(gen, "pad_token_id", None)
        if self.pad_id is None:
            self.pad_id = self.eos_ids[0]
        self._names = set(self.model.state_dict())
        self._lock = asyncio.Lock()
        self.weight_syncs = 0
        self._drawn: dict[tuple, int] = {}  # (weights, prompt) -> samples drawn for it

    # -- weights ---------------------------------------------------------------------------
    def update_weights(self, weights: dict[str, torch.Tensor], global_steps: int | None = None
                       ) -> int:
        """Load the actor's tensors; every name must be one of the model's (a mismatch in the
        naming would otherwise leave the rollout generating from stale weights)."""
        unknown = sorted(set(weights) - self._names)
        if unknown:
            raise KeyError(f"hf rollout: {len(unknown)} tensors of the actor are not in the "
                           f"rollout's model, e.g. {unknown[:3]}")
        missing = sorted(self._names - set(weights))
        if missing:
            raise KeyError(f"hf rollout: the actor sent no tensor for {len(missing)} of the "
                           f"model's, e.g. {missing[:3]}")
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=True)
        self.weight_syncs += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return len(weights)

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def sample_seed(self, prompt_ids: list[int]) -> int:
        """The seed of the next sample of ``prompt_ids`` from the current weights: derived
        from the rollout's ``seed``, the weights' step and the prompt's k-th sample, so a run
        draws the same samples whatever order the agent loop's requests arrive in (the k
        samples of one prompt are exchangeable: GRPO groups them). Requests are served one
        at a time (the lock), so the global generator is seeded for each alone."""
        key = (self.global_steps, self.weight_syncs, tuple(prompt_ids))
        k = self._drawn.get(key, 0)
        self._drawn[key] = k + 1
        text = f"{getattr(self.config, 'seed', 0)}:{key[0]}:{key[1]}:{k}:{list(prompt_ids)}"
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    # -- generation ------------------------------------------------------------------------
    def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict:
        params = dict(sampling_params)
        cfg = self.config
        if "max_tokens" in params:
            max_tokens = params.pop("max_tokens")
        elif "max_new_tokens" in params:
            max_tokens = params.pop("max_new_tokens")
        else:  # as verl's vLLM server (vllm_async_server.py generate)
            max_tokens = min(cfg.response_length,
                             cfg.prompt_length + cfg.response_length - len(prompt_ids))
        max_possible = cfg.max_model_len - len(prompt_ids) if cfg.max_model_len else max_tokens
        max_tokens = max(1, min(int(max_tokens), int(max_possible)))
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1) or -1)
        do_sample = temperature > 0
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_tokens, "do_sample": do_sample,
            "eos_token_id": self.eos_ids, "pad_token_id": self.pad_id,
            "return_dict_in_generate": True, "output_scores": True,
            "repetition_penalty": float(params.get("repetition_penalty", 1.0) or 1.0),
        }
        if do_sample:
            kwargs.update(temperature=temperature, top_p=top_p,
                          top_k=top_k if top_k > 0 else 0)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      **kwargs)
            scores = self.model.compute_transition_scores(out.sequences, out.scores,
                                                          normalize_logits=True)
        response = out.sequences[0, ids.shape[1]:].tolist()
        logprobs = scores[0, :len(response)].tolist()
        return {"token_ids": response, "log_probs": logprobs}

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, audio_data=None,
                       mm_processor_kwargs=None, priority: int = 0, kv_transfer_params=None):
        from verl.utils import normalize_token_ids
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or audio_data:
            raise NotImplementedError("hf rollout: text only")
        prompt_ids = normalize_token_ids(prompt_ids)
        want_logprobs = bool(sampling_params.get("logprobs", False))
        async with self._lock:
            torch.manual_seed(self.sample_seed(prompt_ids))
            res = await asyncio.to_thread(self._generate, prompt_ids, sampling_params)
        return TokenOutput(token_ids=res["token_ids"],
                           log_probs=res["log_probs"] if want_logprobs else None,
                           stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    # -- the rest of a rollout server's interface: nothing to do on the host ---------------
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        async with self._lock:
            return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    def get_server_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), 0


def _replica_class():
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """verl's rollout replica for the ``hf`` rollout: one ``HFServer`` beside the hybrid
        workers (no accelerator of its own: it shares the host with them)."""

        async def launch_servers(self):
            name = server_name(self.replica_rank) + self.name_suffix
            server = ray.remote(HFServer).options(
                name=name, num_cpus=0, max_concurrency=self.max_concurrency,
                runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                          if k.startswith("VERL_")}},
            ).remote(config=self.config, model_config=self.model_config,
                     replica_rank=self.replica_rank)
            self.servers = [server]
            self._server_handle = server
            address, port = await server.get_server_address.remote()
            self._server_address = f"{address}:{port}"

    return HFReplica


def _adapter_class():
    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """Inside the hybrid worker: sends the actor's weights to the replica's server at
        each sync (rank 0 of the replica; the tensors are full, so one rank suffices)."""

        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", "0"))
            size = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                    * self.config.pipeline_model_parallel_size)
            self.replica_rank = rank // size if replica_rank == -1 else replica_rank
            self.rollout_rank = rank % size
            self.server_handle = None

        def _server(self):
            if self.rollout_rank != 0:
                return None
            if self.server_handle is None:
                self.server_handle = ray.get_actor(server_name(self.replica_rank))
            return self.server_handle

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        @torch.no_grad()
        async def update_weights(self, weights, global_steps: int | None = None, **kwargs):
            state = {}
            for name, tensor in weights:  # full tensors (DTensor.full_tensor() upstream)
                if hasattr(tensor, "full_tensor"):
                    tensor = tensor.full_tensor()
                state[name] = tensor.detach().to("cpu", copy=True)
            server = self._server()
            if server is not None:
                await server.update_weights.remote(state, global_steps)

    return HFServerAdapter


HFReplica = None
HFServerAdapter = None


def register() -> None:
    """Make ``actor_rollout_ref.rollout.name=hf`` known to verl's two registries."""
    global HFReplica, HFServerAdapter
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    HFReplica = _replica_class()
    HFServerAdapter = _adapter_class()
    RolloutReplicaRegistry.register(NAME, lambda: HFReplica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFServerAdapter"
