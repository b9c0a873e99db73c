"""Log-probabilities of completion tokens only, with the vocabulary projection done in chunks.

The memory of an RL step on a small LM is dominated by full-vocabulary logits: SmolLM2's
vocabulary is 49,152, so ``[32, 128, V]`` fp32 logits are 805 MB, and autograd keeps
the log-softmax output as well (docs/models.md: 13 GB peak for one naive step on
32 × 128 tokens). Here the decoder runs once to hidden states ``[N, L, H]``; only the positions that
predict real completion tokens are projected, ``chunk`` tokens at a time:
``log_softmax(lm_head(h) / temperature)`` gathered at the sampled token. With gradient,
each chunk is recomputed in the backward pass (activation checkpointing), so at most one
``[chunk, V]`` block is alive at any time, at the price of one extra head matmul per
token ([OURS]; TRL's ``selective_log_softmax`` loops over rows but keeps the graph,
verl's fused kernels do what we do here).

Dividing by the sampling temperature makes ``logp`` the log-probability under the
distribution the tokens were drawn from (TRL and verl both do this), so the PPO ratio
is 1 on-policy.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["TokenLogProbs", "completion_logprobs", "position_ids"]


@dataclass
class TokenLogProbs:
    """Per-token log-probs ``[N, T]`` (0 at padding) and, optionally, entropies ``[N, T]``."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """``[N, L]`` positions that skip left padding: cumsum(mask) - 1, clamped at 0.

    Hugging Face ``generate`` builds the same positions for left-padded prompts, so the
    training forward sees each token at the position it was sampled at.
    """
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, lm_head) of a Hugging Face causal LM (peft-wrapped or not), else None."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(inner, "base_model", None)
    get_head = getattr(inner, "get_output_embeddings", None)
    if base is None or base is inner or get_head is None:
        return None
    head = get_head()
    return (base, head) if head is not None else None


def _accepts(module: torch.nn.Module, name: str) -> bool:
    params = inspect.signature(module.forward).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _forward(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, Any, bool]:
    """(hidden states, output head, True) of an HF causal LM, or (logits, identity, False)."""
    split = _split_head(model)
    body = split[0] if split else model
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    if _accepts(body, "position_ids"):
        kwargs["position_ids"] = position_ids(mask)
    if _accepts(body, "use_cache"):
        kwargs["use_cache"] = False
    out = body(**kwargs)
    if split is not None:
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden, split[1], True
    return (out.logits if hasattr(out, "logits") else out), _identity_head, False


def _shares_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, g: int) -> bool:
    """True when every block of ``g`` consecutive rows holds one prompt."""
    n = prompt_ids.shape[0]
    if n % g:
        return False
    ids = prompt_ids.view(n // g, g, -1)  # [P, G, Tp]
    mask = prompt_mask.view(n // g, g, -1)
    return bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())


def _forward_shared(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    g: int,
) -> tuple[torch.Tensor, Any]:
    """Hidden states ``[N, T, H]`` predicting each completion token, one prefill per prompt."""
    split = _split_head(model)
    if split is None:
        raise ValueError("group_size > 1 needs a Hugging Face causal LM (decoder + head)")
    body, head = split
    pm = prompt_mask[::g].long()  # [P, Tp]
    out = body(input_ids=prompt_ids[::g], attention_mask=pm, position_ids=position_ids(pm),
               use_cache=True)  # fmt: skip
    last = out.last_hidden_state[:, -1:].repeat_interleave(g, dim=0)  # [N, 1, H] predicts t=0
    t = completion_ids.shape[1]
    if t == 1:
        return last, head
    cache = out.past_key_values
    cache.batch_repeat_interleave(g)  # differentiable: the copies keep the prompt's graph
    mask = torch.cat([prompt_mask, completion_mask], dim=1).long()[:, :-1]  # [N, Tp+T-1]
    pos = position_ids(mask)[:, prompt_ids.shape[1] :]  # [N, T-1]
    rest = body(input_ids=completion_ids[:, :-1], attention_mask=mask, position_ids=pos,
                past_key_values=cache, use_cache=True).last_hidden_state  # fmt: skip
    return torch.cat([last, rest], dim=1), head  # [N, T, H]


def _chunk_logp(
    head: torch.nn.Module, h: torch.Tensor, y: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(h).float() / temperature  # [c, V]
    logp_all = torch.log_softmax(logits, dim=-1)  # [c, V]
    logp = logp_all.gather(-1, y[:, None]).squeeze(-1)  # [c]
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)  # [c]
    else:
        ent = torch.zeros_like(logp).detach()
    return logp, ent


def _identity_head(x: torch.Tensor) -> torch.Tensor:
    return x


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 2048,
    entropy: bool = False,
    recompute: bool | None = None,
    group_size: int = 1,
) -> TokenLogProbs:
    """Log-probs ``[N, T]`` of the completion tokens under ``model`` at ``temperature``.

    Args:
        prompt_ids, prompt_mask: ``[N, Tp]`` left-padded prompts.
        completion_ids, completion_mask: ``[N, T]`` right-padded completions.
        chunk: tokens per vocabulary projection block.
        entropy: also return the token entropy ``[N, T]`` (no gradient).
        recompute: checkpoint each chunk (recomputed in backward) so no ``[chunk, V]`` block
            outlives its chunk; ``None`` = when gradients are on and V >= 4096 [OURS].
        group_size: G when rows ``p*G .. p*G+G-1`` share one prompt (prompt-major batches):
            each prompt then runs through the decoder once and its KV cache is repeated
            across the group, with gradients flowing through it (on the maze ~75 % of the
            tokens are prompt tokens). Checked; rows that do not share prompts fall back to
            the plain forward. Same values as the plain forward to float precision.

    Padding positions get log-prob 0 and entropy 0. Models that are not Hugging Face causal
    LMs (no separate decoder / output head) fall back to ``model(...).logits``, which holds
    ``[N, T, V]`` for the duration of the call.
    """
    n, tp = prompt_ids.shape
    t = completion_ids.shape[1]
    shared = group_size > 1 and _split_head(model) is not None
    if shared and _shares_prompts(prompt_ids, prompt_mask, group_size):
        hidden, head = _forward_shared(model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, group_size)  # fmt: skip
        split = True
    else:
        ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, Tp+T]
        mask = torch.cat([prompt_mask, completion_mask], dim=1).long()  # [N, Tp+T]
        hidden, head, split = _forward(model, ids, mask)  # [N, Tp+T, H] (or V without a head)
        hidden = hidden[:, tp - 1 : tp + t - 1]  # [N, T, H or V]: position i predicts token i+1
    sel = completion_mask.bool()  # [N, T]
    flat_h, flat_y = hidden[sel], completion_ids[sel]  # [M, H], [M]
    vocab = getattr(head, "out_features", None) or hidden.shape[-1]
    if recompute is None:
        recompute = torch.is_grad_enabled() and split and vocab >= 4096
    pieces, ents = [], []
    for start in range(0, flat_h.shape[0], chunk):
        h, y = flat_h[start : start + chunk], flat_y[start : start + chunk]
        if recompute:
            lp, en = checkpoint(_chunk_logp, head, h, y, temperature, entropy, use_reentrant=False)
        else:
            lp, en = _chunk_logp(head, h, y, temperature, entropy)
        pieces.append(lp)
        ents.append(en)
    logp = hidden.new_zeros((n, t), dtype=torch.float32)  # [N, T]
    ent = None
    if pieces:
        logp = logp.masked_scatter(sel, torch.cat(pieces))
    if entropy:
        ent = torch.zeros((n, t), dtype=torch.float32, device=hidden.device)
        if ents:
            ent = ent.masked_scatter(sel, torch.cat(ents).detach())
    return TokenLogProbs(logp, ent)
