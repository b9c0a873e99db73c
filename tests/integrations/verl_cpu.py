"""Test-only support for running verl 0.9.1's own trainer (``verl.trainer.main_ppo``) on a CPU.

verl imports this module in every process (driver, Ray workers) when it is named in
``VERL_USE_EXTERNAL_MODULES``; nothing in verl's files is edited. It lives under tests/ on
purpose: in src/ the ``verl.plugins`` entry point would load it into users' processes, and it
leans on verl internals (pinned: :data:`VERL_VERSION`). What it bends, and where in verl
(paths relative to verl's package folder):

- **A CPU platform.** verl 0.9.1 knows nvidia, npu and rocm only
  (``plugin/platform/platform_manager.py``) and falls back to nvidia. :class:`CpuPlatform` is
  registered as ``cpu`` and chosen with ``VERL_PLATFORM=cpu``: device ``cpu``, backend gloo,
  memory and stream calls are no-ops, ``current_device()`` is ``"cpu"`` (verl moves tensors
  with ``.to(get_device_id())``). Its Ray resource is still ``GPU``, backed by one logical GPU
  declared at ``ray.init`` (``+ray_kwargs.ray_init.num_gpus=1``).
- **The process-group backend.** ``utils/distributed.py`` builds
  ``f"cpu:gloo,{device}:{backend}"`` = ``"cpu:gloo,cpu:gloo"``, which torch rejects
  (a device listed twice); :func:`_init_process_group` passes ``"gloo"`` instead.
- **A rollout.** verl's trainer always samples through an async server (vllm, sglang, trtllm:
  ``workers/rollout/base.py``, ``workers/rollout/replica.py``). :class:`HFReplica` is an
  ``hf`` replica registered through ``RolloutReplicaRegistry``: one Ray actor
  (:class:`HFServer`) sampling with transformers and returning tokens and log-probs;
  :class:`HFServerAdapter` (the rollout object inside the actor worker, registered in the
  private ``_ROLLOUT_REGISTRY``) receives the FSDP actor's weights through verl's ``naive``
  checkpoint engine and hands them to the server.

Set outside this module (see ``test_verl_trainer.py``): ``VERL_ENGINE_DEVICE=cuda`` (the FSDP
engine is registered for cuda and npu only; with this platform it runs on CPU),
``trainer.use_v1=false`` (the v1 trainer needs the ``transfer_queue`` package), the CUDA-only
config defaults turned off, ``CUDA_VISIBLE_DEVICES`` unset (Ray refuses a GPU when it is empty).

Rollout precision (test only): ``GROUPRL_VERL_ROLLOUT_DTYPE=bfloat16`` samples with bf16
weights while the actor trains in fp32, so verl's rollout correction has a mismatch to correct.

Recording (test only): with ``GROUPRL_VERL_RECORD=<folder>``, :func:`_record_estimator` and
:func:`_record_loss` wrap grouprl's registered estimator and policy loss and write what verl
handed them and what they returned to ``<folder>/estimator-<pid>.jsonl`` (driver) and
``<folder>/loss-<pid>.jsonl`` (actor worker). They call the registered functions unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import types
from typing import Any

import ray
import torch
import torch.distributed
import verl
from verl.plugin.platform import PlatformBase, PlatformRegistry
from verl.trainer.ppo import core_algos
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

import grouprl.integrations.verl as gv

VERL_VERSION = "0.9.1"
"""The verl this support was written against; other versions are refused."""

if verl.__version__ != VERL_VERSION:
    raise ImportError(
        f"tests/integrations/verl_cpu.py supports verl {VERL_VERSION} only (found "
        f"{verl.__version__}): it bends verl internals; pin verl=={VERL_VERSION}"
    )

ROLLOUT_NAME = "hf"
SERVER_NAME = "grouprl_verl_cpu_hf_server_{rank}"


# --------------------------------------------------------------------------- the platform
def _noop(*_: Any, **__: Any) -> None:
    return None


class _Stream:
    """What verl does with a device stream on CPU: nothing."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *_: Any) -> None:
        pass

    def record_event(self, *_: Any) -> None:
        pass


_CPU_DEVICE = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: "cpu",
    set_device=_noop,
    synchronize=_noop,
    empty_cache=_noop,
    ipc_collect=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    mem_get_info=lambda *_: (1 << 34, 1 << 34),
    memory_allocated=lambda *_: 0,
    memory_reserved=lambda *_: 0,
    max_memory_allocated=lambda *_: 0,
    max_memory_reserved=lambda *_: 0,
    reset_peak_memory_stats=_noop,
    set_per_process_memory_fraction=_noop,
    get_device_name=lambda *_: "cpu",
    current_stream=lambda *_: _Stream(),
    stream=lambda *_: contextlib.nullcontext(),
    Stream=_Stream,
    Event=_Stream,
)
"""The ``torch.<device>`` namespace verl calls (``get_torch_device().…``), for the CPU."""


@PlatformRegistry.register(platform="cpu")
class CpuPlatform(PlatformBase):
    """verl's platform interface on the CPU (selected with ``VERL_PLATFORM=cpu``)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self):  # verl calls tensor.to(get_device_id())
        return "cpu"

    def device_count(self) -> int:
        return 1

    set_device = synchronize = manual_seed_all = set_allocator_settings = empty_cache = (
        staticmethod(_noop)
    )
    profiler_start = profiler_stop = staticmethod(_noop)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def ray_resource_name(self) -> str:
        return "GPU"  # one logical GPU per process, declared at ray.init

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


_torch_init_process_group = torch.distributed.init_process_group


def _init_process_group(*args: Any, backend: Any = None, **kwargs: Any):
    """``"cpu:gloo,cpu:gloo"`` (verl's backend string on this platform) -> ``"gloo"``."""
    if isinstance(backend, str) and {b.strip() for b in backend.split(",")} == {"cpu:gloo"}:
        backend = "gloo"
    return _torch_init_process_group(*args, backend=backend, **kwargs)


torch.distributed.init_process_group = _init_process_group


# --------------------------------------------------------------------------- the rollout
def _sample(logits: torch.Tensor, params: dict[str, Any]) -> tuple[int, float]:
    """One token from ``logits [V]`` with vLLM's sampling knobs; its log-prob under the
    distribution it was drawn from."""
    temperature = float(params.get("temperature", 1.0))
    if temperature <= 0:  # greedy
        logp = torch.log_softmax(logits, -1)
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    logits = logits / temperature
    top_k = int(params.get("top_k", -1) or -1)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = torch.where(logits < kth, torch.full_like(logits, -torch.inf), logits)
    top_p = float(params.get("top_p", 1.0))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
        drop = torch.cumsum(probs, -1) - probs > top_p
        logits[order[drop]] = -torch.inf
    logp = torch.log_softmax(logits, -1)
    tok = int(torch.multinomial(logp.exp(), 1))
    return tok, float(logp[tok])


class HFServer:
    """The rollout server: a transformers model on the CPU behind verl's server interface."""

    def __init__(self, model_path: str, response_length: int, prompt_length: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        # GROUPRL_VERL_ROLLOUT_DTYPE=bfloat16: sample with bf16 weights while the FSDP actor
        # trains in fp32 -- the mismatch a vLLM-bf16 + FSDP-fp32 stack has
        dtype = getattr(torch, os.environ.get("GROUPRL_VERL_ROLLOUT_DTYPE", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=dtype, attn_implementation="eager"
        ).eval()
        self.eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        self.response_length = response_length
        self.prompt_length = prompt_length
        self.weight_updates = 0

    @torch.no_grad()
    def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: Any
    ) -> TokenOutput:
        params = dict(sampling_params)
        limit = params.pop("max_tokens", None) or params.pop("max_new_tokens", None)
        limit = min(limit or self.response_length, self.response_length)
        ids = torch.tensor([list(prompt_ids)])
        tokens, logps = [], []
        for _ in range(limit):
            logits = self.model(ids).logits[0, -1].float()
            tok, lp = _sample(logits, params)
            tokens.append(tok)
            logps.append(lp)
            if tok == self.eos:
                break
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
        return TokenOutput(
            token_ids=tokens,
            log_probs=logps if params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.weight_updates},
        )

    def load_weights(self, named: dict[str, torch.Tensor]) -> int:
        state = self.model.state_dict()
        unknown = sorted(set(named) - set(state))
        if unknown:
            raise KeyError(f"weights the rollout model does not have: {unknown[:5]}")
        with torch.no_grad():
            for name, value in named.items():
                state[name].copy_(value.to(state[name].dtype))
        self.weight_updates += 1
        return len(named)

    def ping(self) -> bool:
        return True

    # what verl asks of a server between steps: nothing to do on the CPU
    def wake_up(self) -> None: ...
    def sleep(self) -> None: ...
    def clear_kv_cache(self) -> None: ...
    def release_kv_cache(self) -> None: ...
    def resume_kv_cache(self) -> None: ...
    def abort_all_requests(self, reject_request: bool = False) -> None: ...
    def resume_generation(self) -> None: ...
    def start_profile(self, **_: Any) -> None: ...
    def stop_profile(self) -> None: ...


class HFReplica(RolloutReplica):
    """verl rollout replica ``hf``: one :class:`HFServer` actor per replica."""

    async def launch_servers(self) -> None:
        name = SERVER_NAME.format(rank=self.replica_rank)
        server = (
            ray.remote(HFServer)
            .options(name=name, num_cpus=0, num_gpus=0, max_concurrency=4)
            .remote(
                self.model_config.get("local_path") or self.model_config.path,
                self.config.response_length,
                self.config.prompt_length,
            )
        )
        await server.ping.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name


class HFServerAdapter(BaseRollout):
    """The rollout object inside verl's actor worker: forwards the actor's weights to the server."""

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs: Any):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes named tensors, not {wire_format}")
        named = {name: t.detach().to("cpu").clone() for name, t in weights}
        server = ray.get_actor(SERVER_NAME.format(rank=0))
        await server.load_weights.remote(named)


RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFReplica)
rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"


# --------------------------------------------------------------------------- recording
def _append(kind: str, row: dict) -> None:
    folder = os.environ.get("GROUPRL_VERL_RECORD")
    if folder:
        with open(os.path.join(folder, f"{kind}-{os.getpid()}.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")


def _record_estimator(fn):
    def recorded(token_level_rewards, response_mask, index=None, config=None, **kw):
        adv, ret = fn(token_level_rewards, response_mask, index=index, config=config, **kw)
        _append(
            "estimator",
            {
                "uid": [str(u) for u in index],
                "token_level_rewards": token_level_rewards.tolist(),
                "response_mask": response_mask.tolist(),
                "advantages": adv.tolist(),
            },
        )
        return adv, ret

    recorded.__dict__.update(fn.__dict__)  # keeps _grouprl_estimator: register() stays idempotent
    recorded.__name__ = fn.__name__
    return recorded


def _record_loss(fn):
    def recorded(old_log_prob, log_prob, advantages, response_mask, *a, **kw):
        loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask, *a, **kw)
        args = dict(zip(("loss_agg_mode", "config", "rollout_is_weights"), a), **kw)
        weights = args.get("rollout_is_weights")
        config = args.get("config")
        _append(
            "loss",
            {
                "loss": float(loss.detach()),
                "requires_grad": bool(loss.requires_grad),
                "log_prob_requires_grad": bool(log_prob.requires_grad),
                "advantages": advantages.detach().tolist(),
                "response_mask": response_mask.detach().tolist(),
                "old_log_prob": old_log_prob.detach().tolist(),
                "log_prob": log_prob.detach().tolist(),
                "loss_agg_mode": args.get("loss_agg_mode"),
                "global_batch_info": {
                    k: float(v) if v is not None else None
                    for k, v in dict(getattr(config, "global_batch_info", None) or {}).items()
                },
                "rollout_is_weights": None if weights is None else weights.detach().tolist(),
            },
        )
        return loss, metrics

    recorded.__dict__.update(fn.__dict__)
    recorded.__name__ = fn.__name__
    return recorded


if os.environ.get("GROUPRL_VERL_RECORD"):
    for _name in gv.estimator_names():
        core_algos.ADV_ESTIMATOR_REGISTRY[_name] = _record_estimator(
            core_algos.ADV_ESTIMATOR_REGISTRY[_name]
        )
    for _name in gv.LOSS_NAMES:
        core_algos.POLICY_LOSS_REGISTRY[_name] = _record_loss(
            core_algos.POLICY_LOSS_REGISTRY[_name]
        )

__all__ = ["CpuPlatform", "HFReplica", "HFServer", "HFServerAdapter"]
