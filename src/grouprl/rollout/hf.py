"""Group sampling with a transformers causal LM: one prefill per prompt, its KV cache shared by the group.

    rollouts = generate(model, tokenizer, prompts, group_size=8,
                        sampling=Sampling(temperature=1.0, top_p=1.0, max_new_tokens=32),
                        generator=torch.Generator().manual_seed(0))

The loop calls ``model.forward`` with ``past_key_values`` itself instead of
``model.generate``: every prompt is prefilled **once** (on the maze ~75 % of a step's
tokens are prompt tokens, docs/models.md), its cache is repeated ``G`` times along the
batch, and then all ``P·G`` sequences decode together, one token per step, until every
row has emitted EOS or ``max_new_tokens`` is reached. Prompts are left-padded; the
attention mask and explicit position ids make padded rows see exactly what an unpadded
forward would (when all prompts have the same length no mask is passed at all).

Behaviour log-probabilities (``Rollouts.old_logp``), [OURS] convention:

    old_logp[n, t] = log_softmax(logits[n, t] / T_lp)[token[n, t]]

computed **before** top-p truncation (top-p only decides which tokens may be drawn; the
probabilities are not renormalised over the nucleus), with ``T_lp`` =
``Sampling.logprob_temperature``: by default the sampling temperature (TRL's GRPOTrainer
and verl divide the logits by it), or 1.0, the raw logits, as AGPO's code takes its
log-probs, KL and entropy while sampling at τ_t (ALGORITHMS.md §4). The trainer must
compute its training log-probs the same way (divide the logits by the same ``T_lp``,
full-vocabulary log-softmax, position ids from the attention mask) for the ratio
``exp(logp - old_logp)`` to be exactly 1 at the first optimizer step. With
``temperature == 0`` decoding is greedy and ``old_logp`` is taken at ``T_lp`` (1 unless set).

Per-prompt temperatures: ``generate(..., temperatures=[P])`` samples each prompt's group at
its own temperature (AGPO's τ_t per prompt, ``trainer.py:667``); every row draws from
``softmax(logits / τ_row)`` in one batched call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.types import Rollouts

__all__ = ["Sampling", "generate", "gqa_attention", "sample_tokens"]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: ``temperature`` (0 = greedy), nucleus ``top_p``, ``max_new_tokens``.

    Defaults: temperature 1.0 and top-p 1.0, the on-policy setting of DeepSeekMath's GRPO
    and DAPO; [OURS] max_new_tokens 64 (the maze needs at most 25 tokens with EOS).
    ``logprob_temperature``: the temperature of the recorded behaviour log-probs; None (the
    default) = the sampling temperature (TRL, verl), 1.0 = the raw logits (AGPO's code,
    ``src/llamafactory/train/agpo/trainer.py:304``: ``log_softmax(logits)`` with no division,
    used for the old log-probs at :683 and the new ones at :765).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    logprob_temperature: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        lt = self.logprob_temperature
        if lt is not None and not (isinstance(lt, (int, float)) and lt > 0 and lt < float("inf")):
            raise ValueError(
                f"logprob_temperature must be a positive number (1.0 = raw logits) or None "
                f"(= the sampling temperature), got {lt!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens}"
            )

    @classmethod
    def of(cls, sampling: Any) -> Sampling:
        """A Sampling from a Sampling, a dict, None (defaults), or any object with the three attributes."""
        if sampling is None:
            return cls()
        if isinstance(sampling, cls):
            return sampling
        if isinstance(sampling, dict):
            return cls(**sampling)
        return cls(
            temperature=float(sampling.temperature),
            top_p=float(getattr(sampling, "top_p", 1.0)),
            max_new_tokens=int(sampling.max_new_tokens),
            logprob_temperature=getattr(sampling, "logprob_temperature", None),
        )


def _row_temperatures(temperature: torch.Tensor, n: int) -> torch.Tensor:
    """``[N, 1]`` float per-row temperatures, checked: one per row, finite and > 0."""
    if temperature.shape != (n,):
        raise ValueError(
            f"per-row temperatures must be [N]={n} (one per sequence), got "
            f"{tuple(temperature.shape)}"
        )
    if not bool(((temperature > 0) & torch.isfinite(temperature)).all()):
        raise ValueError(
            "per-row temperatures must be finite and > 0 (greedy decoding takes "
            "Sampling(temperature=0) for the whole batch)"
        )
    return temperature.float()[:, None]  # [N, 1]


def sample_tokens(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return ``(tokens [N], behaviour log-probs [N])``.

    ``logits`` ``[N, V]``; ``temperature``: optional ``[N]`` per-row sampling temperatures
    (> 0) that replace ``sampling.temperature`` (AGPO's per-prompt τ_t, repeated over the
    group). Row n is drawn from ``softmax(logits[n] / τ_n)``, truncated by top-p (the
    smallest set of most probable tokens whose mass reaches ``top_p``, the first token always
    kept, as HF's ``TopPLogitsWarper``), with ``torch.multinomial`` and ``generator``. The
    returned log-probs are ``log_softmax(logits / T_lp)`` at the drawn token, before top-p,
    with ``T_lp = sampling.logprob_temperature`` or, when None, the row's sampling
    temperature (module docstring).
    """
    logits = logits.float()
    lp_t = sampling.logprob_temperature
    if temperature is None and sampling.temperature == 0.0:
        tokens = logits.argmax(dim=-1)  # [N]
        logp = torch.log_softmax(logits / (lp_t or 1.0), dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    t = (
        sampling.temperature
        if temperature is None
        else _row_temperatures(temperature.to(logits.device), logits.shape[0])
    )  # float or [N, 1]
    logp = torch.log_softmax(logits / t, dim=-1)  # [N, V] the sampling distribution
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if generator is not None and generator.device != probs.device:
        tokens = torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator)  # [N, 1]
    if lp_t is not None and (temperature is not None or lp_t != sampling.temperature):
        logp = torch.log_softmax(logits / lp_t, dim=-1)  # e.g. AGPO: the raw logits (T = 1)
    return tokens.squeeze(-1), logp.gather(-1, tokens).squeeze(-1)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id: generation could never stop")
    return sorted(ids)


def _encode(
    tokenizer: Any, prompts: list[str], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[P, Tp]`` ids and mask of the prompts (tokenised without added specials)."""
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("an empty prompt has nothing to condition on; render the task's prompt")
    width = max(len(e) for e in encoded)
    ids = [[pad_id] * (width - len(e)) + e for e in encoded]
    mask = [[0] * (width - len(e)) + [1] * len(e) for e in encoded]
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(mask, dtype=torch.long, device=device),
    )


def _with_gqa_attention(fn: Callable[..., Rollouts]) -> Callable[..., Rollouts]:
    """Run ``fn(model, ...)`` inside :func:`gqa_attention` (defined at the end of the module)."""

    @functools.wraps(fn)
    def wrapper(model: Any, *args: Any, **kwargs: Any) -> Rollouts:
        with gqa_attention(model):
            return fn(model, *args, **kwargs)

    return wrapper


@_with_gqa_attention
@torch.inference_mode()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    group_size: int,
    sampling: Any = None,
    generator: torch.Generator | None = None,
    *,
    temperatures: torch.Tensor | list[float] | None = None,
    compact_below: float = 0.75,
) -> Rollouts:
    """Sample ``group_size`` completions per prompt with a shared prompt KV cache; prompt-major Rollouts.

    Row ``p * G + g`` is sample ``g`` of prompt ``p``. ``completion_mask`` is 1 up to and
    including EOS; after EOS a row holds pad ids, mask 0 and ``old_logp`` 0.
    ``finish_reason`` is ``"stop"`` (EOS emitted) or ``"length"`` (hit max_new_tokens).
    ``texts`` are decoded without special tokens. Deterministic given ``generator``
    (and the same model, dtype and thread count).

    ``temperatures``: ``[P]`` per-prompt sampling temperatures (> 0) that replace
    ``sampling.temperature``: prompt p's group is drawn at ``temperatures[p]`` (AGPO samples
    each prompt's training group at its own τ_t, ``src/llamafactory/train/agpo/trainer.py:
    658-667``). ``old_logp`` is then taken at ``sampling.logprob_temperature`` when it is
    set, else at each row's own temperature.

    ``compact_below``: [OURS] when the rows still running fall to this fraction of the
    model batch, the stopped rows are dropped from the batch and its KV cache
    (``batch_select_indices``), so long-tail rows do not pay for finished ones; 0 never
    compacts (every row decodes to the longest), 1 compacts at every stop.
    """
    sampling = Sampling.of(sampling)
    if not prompts:
        raise ValueError("no prompts to sample from")
    if int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if not 0.0 <= compact_below <= 1.0:
        raise ValueError(f"compact_below must be in [0, 1], got {compact_below}")
    row_t = None
    if temperatures is not None:
        per_prompt = torch.as_tensor(temperatures, dtype=torch.float32, device="cpu").reshape(-1)
        if per_prompt.shape != (len(prompts),):
            raise ValueError(
                f"temperatures must hold one value per prompt ({len(prompts)}), got "
                f"{tuple(per_prompt.shape)}"
            )
        n_rows = len(prompts) * group_size
        row_t = _row_temperatures(per_prompt.repeat_interleave(group_size), n_rows)[:, 0]  # [N]
    device = next(model.parameters()).device
    row_t = None if row_t is None else row_t.to(device)
    eos = torch.tensor(_eos_ids(model, tokenizer), device=device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(eos[0])
    prompt_ids, prompt_mask = _encode(tokenizer, prompts, pad_id, device)  # [P, Tp]
    padded = bool((prompt_mask == 0).any())
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [P, Tp]

    # ---- prefill each prompt once, then share its cache across the group
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask if padded else None,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    cache.batch_repeat_interleave(group_size)
    logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)  # [N, V]
    n = logits.shape[0]
    mask = prompt_mask.repeat_interleave(group_size, dim=0)  # [N, Tp]
    next_pos = prompt_mask.sum(-1).repeat_interleave(group_size)  # [N]

    # ---- decode all rows together; rows that have stopped leave the batch (compaction)
    t_max = sampling.max_new_tokens
    completion_ids = torch.full((n, t_max), pad_id, dtype=torch.long, device=device)  # [N, T]
    completion_mask = torch.zeros((n, t_max), dtype=torch.long, device=device)  # [N, T]
    old_logp = torch.zeros((n, t_max), dtype=torch.float32, device=device)  # [N, T]
    done = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
    rows = torch.arange(n, device=device)  # [A] original row of each row in the model batch
    used = 0
    for step in range(t_max):
        tok, logp = sample_tokens(
            logits, sampling, generator, None if row_t is None else row_t[rows]
        )  # [A], [A]
        live = ~done[rows]  # [A] rows not stopped yet (stopped ones await compaction)
        idx = rows[live]
        completion_ids[idx, step] = tok[live]
        old_logp[idx, step] = logp[live]
        completion_mask[idx, step] = 1
        done[idx] = torch.isin(tok[live], eos)
        used = step + 1
        remaining = int((~done[rows]).sum())
        if remaining == 0 or used == t_max:
            break
        if remaining < len(rows) and remaining <= compact_below * len(rows):  # [OURS]
            keep = (~done[rows]).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, tok, mask = rows[keep], tok[keep], mask[keep]
        if padded:
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], 1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask if padded else None,
            position_ids=(next_pos[rows] + step)[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1]

    completion_ids = completion_ids[:, :used]  # on the model's device, as every tensor here
    completion_mask = completion_mask[:, :used]
    old_logp = old_logp[:, :used]
    stopped = done.tolist()
    lengths = completion_mask.sum(-1).tolist()
    eos_set = set(eos.tolist())
    texts = []
    for row, length in enumerate(lengths):
        ids = completion_ids[row, :length].tolist()
        if ids and ids[-1] in eos_set:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return Rollouts(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        old_logp=old_logp,
        finish_reason=["stop" if s else "length" for s in stopped],
        texts=texts,
        group_size=int(group_size),
    )


# ---- attention: SDPA with the key/value heads shared in the kernel --------------------------

GQA_SDPA = "grouprl_sdpa_gqa"
"""The name under which :func:`_sdpa_gqa_forward` is registered with transformers."""


def _sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` with ``enable_gqa=True`` whatever the mask.

    transformers (5.x ``integrations/sdpa_attention.py``, ``use_gqa_in_sdpa``) copies each
    key/value head ``num_key_value_groups`` times (``repeat_kv``) whenever an attention mask is
    passed, which is every call on left-padded prompts; torch's kernel can read the shared
    heads itself. Same kernel, same inputs: on the CPU the outputs are identical (measured
    max |difference| 0, the key gradient within 1e-6); SmolLM2 has 9 query heads on 3
    key/value heads, and a decode step's attention ran 3-4x faster. query ``[B, H, q, D]``,
    key/value ``[B, H_kv, k, D]``; returns ``[B, q, H, D]`` as transformers expects.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_gqa_sdpa() -> bool:
    """Register :data:`GQA_SDPA` (attention and mask functions) with transformers, once."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # an older transformers: keep its own SDPA path
        return False
    AttentionInterface.register(GQA_SDPA, _sdpa_gqa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return True


@contextlib.contextmanager
def gqa_attention(model: Any) -> Iterator[bool]:
    """Within the block, an SDPA model with grouped key/value heads uses :func:`_sdpa_gqa_forward`.

    [OURS] a speed-up only: the model's configured attention stays ``sdpa`` outside the block
    (``config._attn_implementation`` is switched and restored). Models with as many key/value
    heads as query heads, other attention kernels, and nested blocks are left alone. Yields
    whether the switch was made.
    """
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    switch = (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and heads is not None
        and kv_heads != heads
        and _register_gqa_sdpa()
    )
    if not switch:
        yield False
        return
    config._attn_implementation = GQA_SDPA
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"
