"""Group sampling with vLLM on a GPU (import-guarded: a clear error when vLLM or a GPU is absent).

    llm = vllm_engine("path/to/model")               # vllm.LLM(model=..., seed=...)
    rollouts = generate(llm, tokenizer, prompts, group_size=8, sampling=Sampling(...), seed=0)

vLLM samples ``n = group_size`` completions per prompt with prefix caching, so the
prompt is prefilled once per group as in :mod:`grouprl.rollout.hf`. Behaviour
log-probs: vLLM reports the sampled token's log-prob from its own kernels (by default
the *raw* model log-probs, before temperature), which is neither bit-identical to the
training forward nor the [OURS] convention of :mod:`grouprl.rollout.hf` (after
temperature, before top-p). So ``old_logp`` is NaN-filled unless ``trust_logprobs=True``;
the trainer must then recompute the behaviour log-probs with its own forward before the
first update (what verl does with ``recompute_log_prob``).

The policy weights must be pushed into the engine after each update
(:func:`load_weights`); on one GPU that means the trainer and vLLM share its memory
(``gpu_memory_utilization``).

Status: written against vLLM's documented ``LLM`` / ``SamplingParams`` API but **not run**:
the machines this project was built on have neither vLLM nor a GPU. ``load_weights``
reaches into the V0 engine's model runner; vLLM's V1 engine needs
``llm.collective_rpc`` instead. Only the import guard is tested.
"""

from __future__ import annotations

from typing import Any

import torch

from grouprl.rollout.hf import Sampling
from grouprl.types import Rollouts

__all__ = ["available", "generate", "load_weights", "vllm_engine"]


def available() -> bool:
    """True when vLLM imports and a CUDA GPU is visible."""
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _require() -> Any:
    try:
        import vllm
    except Exception as err:
        raise ImportError(
            "the vLLM backend needs `pip install vllm` and a CUDA GPU; on this machine use "
            "the transformers backend (grouprl.rollout.hf, rollout backend 'hf')"
        ) from err
    if not torch.cuda.is_available():
        raise ImportError("vLLM is installed but no CUDA GPU is visible; use rollout backend 'hf'")
    return vllm


def vllm_engine(
    model: str, *, seed: int = 0, gpu_memory_utilization: float = 0.4, **kwargs: Any
) -> Any:
    """A ``vllm.LLM`` for a local model folder, with prefix caching on (one prefill per group)."""
    vllm = _require()
    return vllm.LLM(
        model=model,
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=True,
        **kwargs,
    )


def load_weights(llm: Any, model: torch.nn.Module) -> None:
    """Copy the policy's current weights into the engine (after every optimizer step)."""
    _require()
    runner = llm.llm_engine.model_executor.driver_worker.model_runner.model
    runner.load_weights(model.state_dict().items())


def generate(
    llm: Any,
    tokenizer: Any,
    prompts: list[str],
    group_size: int,
    sampling: Any = None,
    seed: int = 0,
    *,
    trust_logprobs: bool = False,
) -> Rollouts:
    """Sample ``group_size`` completions per prompt with vLLM; the same prompt-major Rollouts as ``hf``."""
    vllm = _require()
    sampling = Sampling.of(sampling)
    params = vllm.SamplingParams(
        n=group_size,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_new_tokens,
        seed=seed,
        logprobs=0 if trust_logprobs else None,
    )
    inputs = [
        {"prompt_token_ids": tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts
    ]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_rows, comp_rows, logp_rows, reasons, texts = [], [], [], [], []
    for inp, out in zip(inputs, outputs):
        for comp in out.outputs:
            prompt_rows.append(inp["prompt_token_ids"])
            comp_rows.append(list(comp.token_ids))
            if trust_logprobs and comp.logprobs is not None:
                logp_rows.append([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])
            else:
                logp_rows.append([float("nan")] * len(comp.token_ids))
            reasons.append("stop" if comp.finish_reason == "stop" else "length")
            texts.append(comp.text)
    tp = max(map(len, prompt_rows))
    t = max(1, max(map(len, comp_rows)))
    n = len(comp_rows)
    prompt_ids = torch.full((n, tp), pad, dtype=torch.long)
    prompt_mask = torch.zeros((n, tp), dtype=torch.long)
    completion_ids = torch.full((n, t), pad, dtype=torch.long)
    completion_mask = torch.zeros((n, t), dtype=torch.long)
    old_logp = torch.zeros((n, t), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompt_rows, comp_rows, logp_rows)):
        prompt_ids[i, tp - len(p) :] = torch.tensor(p)
        prompt_mask[i, tp - len(p) :] = 1
        if c:
            completion_ids[i, : len(c)] = torch.tensor(c)
            completion_mask[i, : len(c)] = 1
            old_logp[i, : len(c)] = torch.tensor(lp)
    return Rollouts(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        old_logp,
        reasons,
        texts,
        group_size,
    )
