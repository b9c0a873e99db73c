"""Log-probabilities of completion tokens only, with the vocabulary projection done in chunks.

The memory of an RL step on a small LM is dominated by full-vocabulary logits: SmolLM2's
vocabulary is 49,152, so ``[32, 128, V]`` fp32 logits are 805 MB, and autograd keeps
the log-softmax output as well (docs/models.md: 13 GB peak for one naive step on
32 × 128 tokens). Here the decoder runs once to hidden states ``[N, L, H]``; only the positions that
predict real completion tokens are projected, ``chunk`` tokens at a time:
``log_softmax(lm_head(h) / temperature)`` gathered at the sampled token.

The projection of a plain fp32 ``nn.Linear`` head is one autograd function
(:class:`_HeadLogProb`): its backward is ``(onehot(y) - p) / T`` times the incoming
gradient, from the probabilities ``p`` kept from the forward, or, when keeping ``[M, V]``
probabilities would pass ``keep_bytes``, recomputed chunk by chunk (one extra head matmul
per token, the activation-checkpointing trade; TRL 1.x ``ChunkedLogProbFunction`` always
recomputes, verl's fused kernels likewise). Other heads (LoRA-wrapped, bf16, autocast) take
the autograd path: ``log_softmax`` then ``gather``, checkpointed under the same rule.

With prompt sharing (``group_size``) each prompt runs through the decoder once and its KV
cache serves the group; the completions then run in length buckets, each only as long as
its longest completion ([OURS]: padding after a completion's end changes nothing before it
under causal attention, so the values are those of the padded forward).

Dividing by the sampling temperature makes ``logp`` the log-probability under the
distribution the tokens were drawn from (TRL and verl both do this), so the PPO ratio
is 1 on-policy.

``kept_ids`` (the sampler's kept sets, ``Rollouts.kept_ids``) reads every log-prob on the
truncated distribution the sampler drew from: ``log_softmax`` of the logits with the tokens
outside the position's kept set at -inf (:func:`grouprl.rollout.hf.truncated_log_softmax`),
the entropy and Σπ² of that renormalised distribution. [OURS] This path takes autograd
(``log_softmax`` then ``gather``, checkpointed under the ``keep_bytes`` rule), not the fused
head.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from grouprl.rollout.hf import gqa_attention, kept_mask, truncated_log_softmax
from grouprl.train.lean import lean_activations

__all__ = ["TokenLogProbs", "completion_logprobs", "length_buckets", "position_ids"]


@dataclass
class TokenLogProbs:
    """Per-token log-probs ``[N, T]`` (0 at padding) and, optionally, entropies ``[N, T]``
    and Σ_v π(v)² ``[N, T]`` (the optimal token baseline's input), both without gradient."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None


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


def length_buckets(lengths: list[int], overhead: float) -> list[list[int]]:
    """Rows grouped so that Σ_buckets rows × (longest - 1) + overhead × buckets is least.

    ``lengths[i]``: how many completion positions row ``i`` needs (0 or 1: no decoder call,
    such rows are in no bucket). A bucket's decoder call runs its rows for ``longest - 1``
    tokens; ``overhead`` is the cost of one more call in token-equivalents. Exact dynamic
    programme over the distinct lengths, longest first (a bucket holds whole runs of equal
    lengths); rows in each bucket by index. [OURS]
    """
    values = sorted({x for x in lengths if x > 1}, reverse=True)  # v_1 > v_2 > ...
    if not values:
        return []
    counts = [sum(1 for x in lengths if x == v) for v in values]
    before = [0]
    for c in counts:
        before.append(before[-1] + c)  # rows of the first j distinct lengths
    best, cut = [0.0] + [float("inf")] * len(values), [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):  # buckets covering values[0:j]
        for i in range(j):  # last bucket = values[i:j], its longest values[i]
            cost = best[i] + (before[j] - before[i]) * (values[i] - 1) + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], len(values)
    while j:
        spans.append((cut[j], j))
        j = cut[j]
    buckets = []
    for i, j in reversed(spans):
        members = set(values[i:j])
        buckets.append([row for row, x in enumerate(lengths) if x in members])
    return buckets


def _needed_lengths(mask: torch.Tensor) -> torch.Tensor:
    """``[N]``: one past the last masked-in position of each row (0 for an empty row)."""
    steps = torch.arange(1, mask.shape[1] + 1, device=mask.device)  # [T]
    return (mask.bool() * steps).amax(-1) if mask.shape[1] else mask.new_zeros(mask.shape[0])


def _selectable(cache: Any) -> bool:
    """A transformers Cache made of layers that can select batch rows (DynamicCache)."""
    return hasattr(cache, "layers") and hasattr(cache, "batch_select_indices")


def _select_cache(cache: Any, rows: torch.Tensor) -> Any:
    """A copy of ``cache`` holding batch rows ``rows`` (the original's tensors untouched).

    ``rows`` repeats each prompt G times, so the gather's backward sums G gradients into
    each prompt row. ``index_select`` sums them in index order (``index_add_``); advanced
    indexing ``keys[rows]`` (what ``Cache.batch_select_indices`` does) sums them with
    parallel atomic adds whose order follows the threads' timing, which made the same
    command and seed give different numbers on a busy machine than on an idle one.
    """
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in out.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            if keys.numel():  # an empty layer has nothing to select (as transformers')
                layer.keys, layer.values = keys.index_select(0, rows), values.index_select(0, rows)
        else:  # a layer type without plain key/value tensors: its own selection
            layer.batch_select_indices(rows)
    return out


def _default_overhead(model: torch.nn.Module) -> float:
    """[OURS] one decoder call ~ 1e9 / parameters tokens, within [16, 4096]: a few tokens'
    worth of work on a 135M model, thousands on the 205k-parameter maze model."""
    params = sum(p.numel() for p in model.parameters())
    return float(min(4096, max(16, 1e9 / max(params, 1))))


def _forward_shared(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    g: int,
    trim: bool = True,
    overhead: float | None = None,
) -> tuple[torch.Tensor, Any]:
    """Hidden states ``[N, T, H]`` predicting each completion token, one prefill per prompt.

    ``trim``: the completions run in :func:`length_buckets` (``overhead`` token-equivalents
    per decoder call; None = :func:`_default_overhead`), each bucket only to its longest
    completion; positions no bucket computes (after a row's last masked-in token) are 0.
    """
    split = _split_head(model)
    if split is None:
        raise ValueError("group_size > 1 needs a Hugging Face causal LM (decoder + head)")
    body, head = split
    pm = prompt_mask[::g].long()  # [P, Tp]
    out = body(input_ids=prompt_ids[::g], attention_mask=pm, position_ids=position_ids(pm),
               use_cache=True)  # fmt: skip
    last = out.last_hidden_state[:, -1:].repeat_interleave(g, dim=0)  # [N, 1, H] predicts t=0
    n, t = completion_ids.shape
    if t == 1:
        return last, head
    cache, tp = out.past_key_values, prompt_ids.shape[1]
    mask = torch.cat([prompt_mask, completion_mask], dim=1).long()[:, :-1]  # [N, Tp+T-1]
    pos = position_ids(mask)[:, tp:]  # [N, T-1]
    if trim and _selectable(cache):
        lengths = _needed_lengths(completion_mask).tolist()  # [N]
        overhead = _default_overhead(model) if overhead is None else overhead
        hidden = last.new_zeros((n, t, last.shape[-1]))  # [N, T, H]
        hidden[:, :1] = last
        for rows in length_buckets(lengths, overhead):
            idx = torch.tensor(rows, device=completion_ids.device)  # [b]
            w = max(lengths[r] for r in rows) - 1  # positions 1..w need tokens 0..w-1
            rest = body(
                input_ids=completion_ids[idx, :w],
                attention_mask=mask[idx, : tp + w],
                position_ids=pos[idx, :w],
                past_key_values=_select_cache(cache, idx // g),
                use_cache=True,
            ).last_hidden_state  # [b, w, H]
            hidden[idx, 1 : w + 1] = rest
        return hidden, head
    cache.batch_repeat_interleave(g)  # differentiable: the copies keep the prompt's graph
    rest = body(input_ids=completion_ids[:, :-1], attention_mask=mask, position_ids=pos,
                past_key_values=cache, use_cache=True).last_hidden_state  # fmt: skip
    return torch.cat([last, rest], dim=1), head  # [N, T, H]


class _HeadLogProb(torch.autograd.Function):
    """``log_softmax((h W^T + b) / T)[y]`` and the entropy for a chunk of tokens, fused.

    Forward ``[c, H]`` hidden states to ``[c]`` log-probs (and entropies, no gradient) through
    one ``[c, V]`` block. Backward: d logp / d logits = (onehot(y) - p) / T, so the gradient
    needs only the probabilities: kept from the forward (``keep``, ``[c, V]``), else rebuilt
    from the saved row maxima and sums (``[c, 1]`` each) by the forward's own operations on
    the same operands: one more head matmul, and the same gradients bit for bit [OURS].
    fp32, no autocast (checked by the caller).
    """

    @staticmethod
    def forward(ctx, h, weight, bias, y, temperature, keep, with_entropy, with_spi=False):
        z = torch.nn.functional.linear(h, weight, bias)  # [c, V]
        if temperature != 1.0:
            z.div_(temperature)
        top = z.amax(-1, keepdim=True)  # [c, 1]
        z.sub_(top)
        p = z.exp()  # [c, V]
        total = p.sum(-1, keepdim=True)  # [c, 1]
        p.div_(total)
        log_total = total.log().squeeze(-1)  # [c]
        logp = z.gather(-1, y[:, None]).squeeze(-1) - log_total  # [c]
        if with_entropy:  # H = -Σ p (z - log Σ) = log Σ - Σ p z
            ent = log_total - torch.linalg.vecdot(p, z)
        else:
            ent = torch.zeros_like(logp)
        spi = torch.linalg.vecdot(p, p) if with_spi else torch.zeros_like(logp)  # Σ_v π_v²
        if keep:
            ctx.save_for_backward(h, weight, bias, y, p)  # p [c, V]
        else:  # the max and the sum [c, 1] rebuild p with the forward's own operations
            ctx.save_for_backward(h, weight, bias, y, top, total)
        ctx.keep, ctx.temperature = keep, temperature
        ctx.mark_non_differentiable(ent, spi)
        return logp, ent, spi

    @staticmethod
    def backward(ctx, grad_logp, grad_ent, grad_spi):
        h, weight, bias, y, *saved = ctx.saved_tensors
        t = ctx.temperature
        if ctx.keep:
            grad_z = saved[0] * (-grad_logp)[:, None]  # [c, V] (a new tensor: saved stays intact)
        else:  # p again, bit for bit: the same matmul on the same operands, then the same ops
            top, total = saved
            grad_z = torch.nn.functional.linear(h, weight, bias)  # [c, V]
            if t != 1.0:
                grad_z.div_(t)
            grad_z.sub_(top).exp_().div_(total).mul_((-grad_logp)[:, None])
        grad_z.scatter_add_(-1, y[:, None], grad_logp[:, None])  # onehot(y) · g
        if t != 1.0:
            grad_z.div_(t)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = grad_z @ weight if need_h else None
        grad_w = grad_z.t() @ h if need_w else None
        grad_b = grad_z.sum(0) if bias is not None and need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _fused_head(head: Any, h: torch.Tensor) -> bool:
    """True when ``head`` is a plain fp32 ``nn.Linear`` and no autocast is on: the fused path."""
    return (
        type(head) is torch.nn.Linear
        and head.weight.dtype == torch.float32
        and h.dtype == torch.float32
        and not torch.is_autocast_enabled(h.device.type)
    )


def _chunk_logp(
    head: torch.nn.Module,
    h: torch.Tensor,
    y: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    with_spi: bool = False,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs ``[c]`` (and entropies, Σπ² ``[c]``, no gradient) of ``y`` through ``head``;
    ``kept`` ``[c, K]``: on the distribution renormalised over those ids (-1 padding)."""
    logits = head(h).float() / temperature  # [c, V]
    if kept is None:
        logp_all = torch.log_softmax(logits, dim=-1)  # [c, V]
    else:  # the sampler's truncated distribution: -inf outside its kept set
        logp_all = truncated_log_softmax(logits, kept_mask(kept, logits.shape[-1]))
    logp = logp_all.gather(-1, y[:, None]).squeeze(-1)  # [c]
    with torch.no_grad():
        if with_entropy and kept is not None:  # 0 · log 0 = 0 at the dropped tokens
            ent = -(logp_all.exp() * logp_all.clamp_min(torch.finfo(logp_all.dtype).min)).sum(-1)
        elif with_entropy:
            ent = -(logp_all.exp() * logp_all).sum(-1)
        else:
            ent = torch.zeros_like(logp)
        # Σπ² = exp(logsumexp(2z) − 2·logsumexp(z)) (verl docs/algo/otb.md), from log π here
        spi = (2 * logp_all).exp().sum(-1) if with_spi else torch.zeros_like(logp)
    return logp, ent.detach(), spi.detach()


def _identity_head(x: torch.Tensor) -> torch.Tensor:
    return x


KEEP_BYTES = 1 << 30
"""[OURS] default ``keep_bytes``: keep up to 1 GiB of ``[M, V]`` fp32 probabilities for the
backward instead of recomputing them (SmolLM2, 16 sequences × 64 tokens: 201 MB)."""


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
    trim: bool = True,
    bucket_overhead: float | None = None,
    keep_bytes: int = KEEP_BYTES,
    sum_pi_squared: bool = False,
    kept_ids: torch.Tensor | None = None,
    recompute_mlp: bool = False,
) -> TokenLogProbs:
    """Log-probs ``[N, T]`` of the completion tokens under ``model`` at ``temperature``.

    Args:
        prompt_ids, prompt_mask: ``[N, Tp]`` left-padded prompts.
        completion_ids, completion_mask: ``[N, T]`` right-padded completions.
        chunk: tokens per vocabulary projection block.
        entropy: also return the token entropy ``[N, T]`` (no gradient).
        recompute: recompute each chunk's ``[chunk, V]`` block in the backward instead of
            keeping it; ``None`` = when gradients are on and the kept ``[M, V]`` fp32 block of
            all M completion tokens would exceed ``keep_bytes`` [OURS].
        group_size: G when rows ``p*G .. p*G+G-1`` share one prompt (prompt-major batches):
            each prompt then runs through the decoder once and its KV cache is repeated
            across the group, with gradients flowing through it (on the maze ~75 % of the
            tokens are prompt tokens). Checked; rows that do not share prompts fall back to
            the plain forward. Same values as the plain forward to float precision.
        trim: with prompt sharing, run the completions in length buckets, each only as long
            as its longest completion (:func:`length_buckets`); same values to float
            precision, fewer tokens through the decoder when lengths differ.
        bucket_overhead: the cost of one more decoder call, in tokens, for the bucketing
            (None: from the model's size, :func:`_default_overhead`).
        keep_bytes: the ``recompute=None`` threshold.
        sum_pi_squared: also return Σ_v π(v)² ``[N, T]`` at each position (no gradient): the
            optimal token baseline's w_t = 1 − 2π_t + Σπ² (verl ``calculate_sum_pi_squared``).
        kept_ids: ``[N, T, K]`` the sampler's kept token ids per position (-1 padding,
            ``Rollouts.kept_ids``): every output is then of the distribution renormalised
            over them (module docstring); None = the full softmax.
        recompute_mlp: Llama-form MLPs keep only their input and run the gate and up
            projections again in the backward (:func:`grouprl.train.lean.lean_activations`).

    Padding positions get log-prob 0 and entropy 0. Models that are not Hugging Face causal
    LMs (no separate decoder / output head) fall back to ``model(...).logits``, which holds
    ``[N, T, V]`` for the duration of the call. SDPA models with grouped key/value heads
    run under :func:`grouprl.rollout.hf.gqa_attention`; Llama-form MLPs and RMSNorms keep less
    for the backward (:func:`grouprl.train.lean.lean_activations`, the same gradients).
    """
    with gqa_attention(model), lean_activations(model, recompute_mlp):
        return _completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
            chunk, entropy, recompute, group_size, trim, bucket_overhead, keep_bytes,
            sum_pi_squared, kept_ids,
        )  # fmt: skip


def _completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    chunk: int,
    entropy: bool,
    recompute: bool | None,
    group_size: int,
    trim: bool,
    overhead: float | None,
    keep_bytes: int,
    spi: bool = False,
    kept_ids: torch.Tensor | None = None,
) -> TokenLogProbs:
    n, tp = prompt_ids.shape
    t = completion_ids.shape[1]
    if kept_ids is not None and kept_ids.shape[:2] != completion_ids.shape:
        raise ValueError(
            f"kept_ids must be [N, T, K] with [N, T] = completion_ids' {tuple(completion_ids.shape)}"
            f", got {tuple(kept_ids.shape)}"
        )
    shared = group_size > 1 and _split_head(model) is not None
    if shared and _shares_prompts(prompt_ids, prompt_mask, group_size):
        hidden, head = _forward_shared(model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, group_size, trim, overhead)  # fmt: skip
        split = True
    else:
        ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, Tp+T]
        mask = torch.cat([prompt_mask, completion_mask], dim=1).long()  # [N, Tp+T]
        hidden, head, split = _forward(model, ids, mask)  # [N, Tp+T, H] (or V without a head)
        hidden = hidden[:, tp - 1 : tp + t - 1]  # [N, T, H or V]: position i predicts token i+1
    sel = completion_mask.bool()  # [N, T]
    flat_h, flat_y = hidden[sel], completion_ids[sel]  # [M, H], [M]
    flat_k = None if kept_ids is None else kept_ids[sel]  # [M, K]
    vocab = getattr(head, "out_features", None) or hidden.shape[-1]
    if recompute is None:
        kept = flat_h.shape[0] * vocab * 4  # bytes of [M, V] fp32
        recompute = torch.is_grad_enabled() and split and kept > keep_bytes
    fused = split and flat_k is None and _fused_head(head, flat_h)
    pieces, ents, spis = [], [], []
    for start in range(0, flat_h.shape[0], chunk):
        h, y = flat_h[start : start + chunk], flat_y[start : start + chunk]
        k = None if flat_k is None else flat_k[start : start + chunk]  # [c, K]
        if fused:
            lp, en, sp = _HeadLogProb.apply(h, head.weight, head.bias, y, float(temperature),
                                            not recompute, entropy, spi)  # fmt: skip
        elif recompute:
            lp, en, sp = checkpoint(_chunk_logp, head, h, y, temperature, entropy, spi, k,
                                    use_reentrant=False)  # fmt: skip
        else:
            lp, en, sp = _chunk_logp(head, h, y, temperature, entropy, spi, k)
        pieces.append(lp)
        ents.append(en)
        spis.append(sp)
    logp = hidden.new_zeros((n, t), dtype=torch.float32)  # [N, T]
    ent = None
    if pieces:
        flat_lp = torch.cat(pieces)  # [M]
        if flat_k is not None and not bool(torch.isfinite(flat_lp.detach()).all()):
            raise ValueError(
                "a completion token lies outside the kept set kept_ids gives for its position "
                "(log-prob -inf): kept_ids must be the sampler's own (Rollouts.kept_ids) for "
                "these completions"
            )
        logp = logp.masked_scatter(sel, flat_lp)
    if entropy:
        ent = torch.zeros((n, t), dtype=torch.float32, device=hidden.device)
        if ents:
            ent = ent.masked_scatter(sel, torch.cat(ents).detach())
    sp = None
    if spi:
        sp = torch.zeros((n, t), dtype=torch.float32, device=hidden.device)
        if spis:
            sp = sp.masked_scatter(sel, torch.cat(spis).detach())
    return TokenLogProbs(logp, ent, sp)
