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

``Sampling.logprob_support="truncated"`` [OURS] reads the behaviour log-probs on the truncated
distribution instead, renormalised over the tokens top-k / top-p kept at that position,

    old_logp[n, t] = z[y] - log Σ_{v ∈ K[n, t]} exp(z[v]),   z = logits[n, t] / T_lp,

and records the kept sets ``K`` (``Rollouts.kept_ids``: the token ids themselves, so a log-prob
pass replays the sampler's sets, not sets recomputed from its own, slightly different logits;
:func:`kept_mask`, :func:`truncated_log_softmax`). Whenever sampling truncates,
``Rollouts.log_kept_mass`` holds log M, M = Σ_{v ∈ K} softmax(logits / τ)[v], the sampling
distribution's mass on the kept set: the log-ratio between the two readings.

Per-prompt temperatures: ``generate(..., temperatures=[P])`` samples each prompt's group at
its own temperature (AGPO's τ_t per prompt, ``trainer.py:667``); every row draws from
``softmax(logits / τ_row)`` in one batched call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from grouprl.types import Rollouts

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers without per-layer caches: caches stay as the model builds them
    DynamicLayer = object

__all__ = [
    "DRAWS",
    "SUPPORTS",
    "Draw",
    "Sampling",
    "draw_tokens",
    "generate",
    "gqa_attention",
    "kept_mask",
    "sample_tokens",
    "truncated_log_softmax",
]


DRAWS = ("inverse_cdf", "multinomial")
"""The ways :func:`sample_tokens` draws a token (``Sampling.draw``)."""

SUPPORTS = ("full", "truncated")
"""Where the log-probs are read (``Sampling.logprob_support``): the full softmax, or the
truncated distribution renormalised over the kept tokens (module docstring)."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: ``temperature`` (0 = greedy), nucleus ``top_p``, ``top_k``, ``max_new_tokens``.

    Defaults: temperature 1.0 and top-p 1.0, the on-policy setting of DeepSeekMath's GRPO
    and DAPO; [OURS] max_new_tokens 64 (the maze needs at most 25 tokens with EOS).
    ``logprob_temperature``: the temperature of the recorded behaviour log-probs; None (the
    default) = the sampling temperature (TRL, verl), 1.0 = the raw logits (AGPO's code,
    ``src/llamafactory/train/agpo/trainer.py:304``: ``log_softmax(logits)`` with no division,
    used for the old log-probs at :683 and the new ones at :765).
    ``draw``: how a token is drawn from the (truncated) distribution, one of :data:`DRAWS`:
    ``"inverse_cdf"`` (the default, [OURS]: one float64 uniform per row against the running
    sum of the probabilities) or ``"multinomial"`` (``torch.multinomial``, as HF's
    ``generate`` and TRL: V exponential draws per row, ~ the cost of the lm-head matmul on
    SmolLM2's 49,152-token vocabulary). Same distribution, different draws for one seed.
    ``top_k``: keep only the k most probable tokens before top-p (0 = off), the order of HF's
    ``TopKLogitsWarper`` then ``TopPLogitsWarper`` and of vLLM's sampler: top-p then acts on
    the top-k renormalised distribution. ``logprob_support``: one of :data:`SUPPORTS`,
    ``"full"`` (the default: log-probs on the full softmax) or ``"truncated"`` (renormalised
    over the kept tokens, which the rollouts then carry; module docstring).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    logprob_temperature: float | None = None
    draw: str = "inverse_cdf"
    top_k: int = 0
    logprob_support: str = "full"

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
        if self.draw not in DRAWS:
            raise ValueError(f"draw must be one of {', '.join(DRAWS)}, got {self.draw!r}")
        if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.logprob_support not in SUPPORTS:
            raise ValueError(
                f"logprob_support must be one of {', '.join(SUPPORTS)}, got "
                f"{self.logprob_support!r}"
            )
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens}"
            )

    @property
    def truncates(self) -> bool:
        """True when a sampled token is drawn from fewer than all tokens (top-p or top-k set,
        not greedy)."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0)

    @property
    def records_support(self) -> bool:
        """True when the rollouts carry their kept sets: truncated support on a truncating
        sampler (with nothing truncated both readings are the full softmax)."""
        return self.logprob_support == "truncated" and self.truncates

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
            draw=getattr(sampling, "draw", "inverse_cdf"),
            top_k=int(getattr(sampling, "top_k", 0)),
            logprob_support=getattr(sampling, "logprob_support", "full"),
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


def _row_uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``[N, 1]`` float64 uniforms in [0, 1), one per row, drawn in row order from ``generator``."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(n, 1, dtype=torch.float64, generator=generator, device=gen_device)
    return u.to(device)


def _inverse_cdf(
    weights: torch.Tensor, cdf: torch.Tensor, count: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """``[N]`` index of the first position where ``cdf > u · cdf[count - 1]``, at most ``count - 1``.

    ``weights`` ``[N, V]`` non-negative, ``cdf`` ``[N, V]`` their float64 running sum, ``count``
    ``[N, 1]`` how many leading positions may be drawn (V, or the nucleus size), ``u`` ``[N, 1]``
    uniforms in [0, 1). A position of weight 0 has ``cdf`` equal to the one before it, so the
    strict ``>`` never lands on it; the clamp covers ``u · total`` rounding up to ``total``, and
    then a zero-weight last position is replaced by the last position of positive weight.
    """
    total = cdf.gather(-1, count - 1)  # [N, 1]
    idx = torch.searchsorted(cdf, u * total, right=True).clamp_(max=count - 1)  # [N, 1]
    empty = weights.gather(-1, idx) == 0  # [N, 1] only when u · total rounded up to total
    if bool(empty.any()):
        last = torch.searchsorted(cdf, total, right=False)  # first position reaching the total
        idx = torch.where(empty, last, idx)
    return idx.squeeze(-1)


class Draw(NamedTuple):
    """One decode step's draw (:func:`draw_tokens`)."""

    tokens: torch.Tensor  # [N] drawn token ids
    logp: torch.Tensor  # [N] behaviour log-probs at them (Sampling.logprob_support's reading)
    kept: torch.Tensor | None  # [N, K] int32 kept token ids, -1 padding; truncated support only
    log_kept_mass: torch.Tensor | None  # [N] log M of the kept set; when sampling truncates


def kept_mask(kept: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., V]`` bool, True at the token ids ``kept [..., K]`` lists (-1 = padding).

    [OURS] the exact replay of a sampler's kept set: the ids themselves, not a threshold on
    logits the replaying pass would compute slightly differently. Padding writes into a spare
    column V, dropped, so it can never clear a kept token.
    """
    idx = kept.long()
    idx = torch.where(idx >= 0, idx, vocab)  # [..., K]
    out = torch.zeros((*idx.shape[:-1], vocab + 1), dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, idx, True)[..., :vocab]


def truncated_log_softmax(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` log-probs of ``softmax(z)`` renormalised over ``keep`` (bool ``[..., V]``):
    ``z - log Σ_{keep} exp(z)`` on the kept tokens, -inf elsewhere; its gradient is that of the
    log of the renormalised probability (0 from every dropped token)."""
    return torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return ``(tokens [N], behaviour log-probs [N])``
    (:func:`draw_tokens` without the kept sets)."""
    d = draw_tokens(logits, sampling, generator, temperature)
    return d.tokens, d.logp


def draw_tokens(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None,
    temperature: torch.Tensor | None = None,
) -> Draw:
    """Draw one token per row: tokens ``[N]``, behaviour log-probs ``[N]`` and the kept sets.

    ``logits`` ``[N, V]``; ``temperature``: optional ``[N]`` per-row sampling temperatures
    (> 0) that replace ``sampling.temperature`` (AGPO's per-prompt τ_t, repeated over the
    group). Row n is drawn from ``softmax(logits[n] / τ_n)``, truncated by top-k (the k most
    probable tokens) then top-p (the smallest set of most probable tokens whose mass, of the
    top-k renormalised distribution, reaches ``top_p``, the first token always kept, as HF's
    ``TopPLogitsWarper``), with ``generator`` as ``sampling.draw`` says:
    ``"inverse_cdf"`` (one float64 uniform per row, :func:`_inverse_cdf`) or
    ``"multinomial"`` (``torch.multinomial``, V exponential draws per row). The log-probs are
    ``log_softmax(logits / T_lp)`` at the drawn token, before truncation
    (``logprob_support="full"``) or renormalised over the kept tokens (``"truncated"``), with
    ``T_lp = sampling.logprob_temperature`` or, when None, the row's sampling temperature
    (module docstring).
    """
    logits = logits.float()
    lp_t = sampling.logprob_temperature
    if temperature is None and sampling.temperature == 0.0:
        tokens = logits.argmax(dim=-1)  # [N]
        logp = torch.log_softmax(logits / (lp_t or 1.0), dim=-1)
        return Draw(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), None, None)
    t = (
        sampling.temperature
        if temperature is None
        else _row_temperatures(temperature.to(logits.device), logits.shape[0])
    )  # float or [N, 1]
    z = logits if isinstance(t, float) and t == 1.0 else logits / t  # x / 1.0 is x: one pass less
    record = sampling.logprob_support == "truncated"
    if sampling.draw == "multinomial":
        d = _multinomial(z, sampling.top_p, sampling.top_k, generator, record)
    else:
        d = _draw_inverse_cdf(z, sampling.top_p, sampling.top_k, generator, record)
    if lp_t is not None and (temperature is not None or lp_t != sampling.temperature):
        z_lp = logits / lp_t  # e.g. AGPO: the raw logits (T = 1), on the sampler's kept set
        if d.kept is not None:
            logp_all = truncated_log_softmax(z_lp, kept_mask(d.kept, z_lp.shape[-1]))
        else:
            logp_all = torch.log_softmax(z_lp, dim=-1)
        d = d._replace(logp=logp_all.gather(-1, d.tokens[:, None]).squeeze(-1))
    return d


def _kept_ids(order: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int32: the first ``count [N, 1]`` ids of ``order [N, V]`` (a descending sort),
    -1 after them; K = the largest count."""
    k = int(count.max())
    pos = torch.arange(k, device=order.device)  # [K]
    return torch.where(pos < count, order[:, :k], -1).to(torch.int32)


def _draw_inverse_cdf(
    z: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator | None, record: bool
) -> Draw:
    """Tokens ``[N]`` drawn from ``softmax(z)`` (top-k, top-p truncated) by inverse CDF, and
    their log-probs ``[N]`` (``log_softmax(z)``, or renormalised over the kept set with
    ``record``, which also returns the kept ids). [OURS] One uniform per row instead of
    ``torch.multinomial``'s V exponentials (its Gumbel-max trick, ``argmax(p / q)``,
    ``q ~ Exp(1)``): the same distribution, sampled through float64 running sums."""
    top = z.amax(-1, keepdim=True)  # [N, 1]
    w = (z - top).exp_()  # [N, V] unnormalised probabilities, the largest 1
    u = _row_uniforms(w.shape[0], generator, w.device)  # [N, 1]
    kept = log_mass = None
    if top_p < 1.0 or top_k > 0:
        w_sorted, order = w.sort(dim=-1, descending=True)  # [N, V]
        cdf = w_sorted.cumsum(-1, dtype=torch.float64)  # [N, V]
        k = min(top_k, w.shape[-1]) if top_k > 0 else w.shape[-1]
        if top_p < 1.0:
            # the nucleus of the top-k distribution: tokens whose mass strictly above them is
            # below top_p of the top-k mass (a prefix, >= 1)
            count = ((cdf - w_sorted) < top_p * cdf[:, k - 1 : k]).sum(-1, keepdim=True)
            count = count.clamp_(max=k) if k < w.shape[-1] else count  # [N, 1]
        else:
            count = torch.full_like(u, k, dtype=torch.long)  # [N, 1]
        tokens = order.gather(-1, _inverse_cdf(w_sorted, cdf, count, u)[:, None]).squeeze(-1)
        kept_total = cdf.gather(-1, count - 1)  # [N, 1] Σ_kept exp(z - top)
        log_mass = (kept_total.log() - cdf[:, -1:].log()).squeeze(-1).float()  # [N] log M
        if record:
            kept = _kept_ids(order, count)
    else:
        cdf = w.cumsum(-1, dtype=torch.float64)  # [N, V]
        count = torch.full_like(u, w.shape[-1], dtype=torch.long)  # [N, 1]
        tokens = _inverse_cdf(w, cdf, count, u)
    if kept is not None:
        log_total = kept_total.squeeze(-1).log().float()  # [N] log Σ_kept exp(z - top)
    else:
        log_total = cdf[:, -1].log().float()  # [N] log Σ exp(z - top)
    logp = (z.gather(-1, tokens[:, None]) - top).squeeze(-1) - log_total
    return Draw(tokens, logp, kept, log_mass)


def _multinomial(
    z: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator | None, record: bool
) -> Draw:
    """``torch.multinomial`` over ``softmax(z)`` (top-k, top-p truncated), as HF's sampler and
    this module before the inverse-CDF draw: tokens ``[N]`` and ``log_softmax(z)`` at them
    (renormalised over the kept set, and the kept ids, with ``record``)."""
    logp = torch.log_softmax(z, dim=-1)  # [N, V] the sampling distribution
    probs = logp.exp()
    kept = log_mass = None
    if top_p < 1.0 or top_k > 0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
        v = probs.shape[-1]
        drop = torch.zeros_like(sorted_p, dtype=torch.bool)  # [N, V]
        if 0 < top_k < v:
            drop[:, top_k:] = True
            sorted_p = sorted_p.masked_fill(drop, 0.0)
        if top_p < 1.0:
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
            # of the top-k renormalised distribution (HF: top-k, then top-p on its softmax)
            bound = top_p * sorted_p.sum(-1, keepdim=True) if 0 < top_k < v else top_p
            drop |= before >= bound
            sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        count = (~drop).sum(-1, keepdim=True)  # [N, 1] a prefix of the sort
        log_mass = sorted_p.sum(-1, dtype=torch.float64).log().float()  # [N] log M
        if record:
            kept = _kept_ids(order, count)
    if generator is not None and generator.device != probs.device:
        tokens = torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator)  # [N, 1]
    out = logp.gather(-1, tokens).squeeze(-1)
    if kept is not None:
        out = out - log_mass
    return Draw(tokens.squeeze(-1), out, kept, log_mass)


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
    With ``sampling.logprob_support="truncated"`` on a truncating sampler ``kept_ids`` holds
    each position's kept set and ``old_logp`` is renormalised over it; whenever sampling
    truncates ``log_kept_mass`` holds log M (module docstring).
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
    t_max = sampling.max_new_tokens
    cache = _preallocate(out.past_key_values, group_size, prompt_ids.shape[1] + t_max - 1)
    logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)  # [N, V]
    n = logits.shape[0]
    mask = prompt_mask.repeat_interleave(group_size, dim=0)  # [N, Tp]
    next_pos = prompt_mask.sum(-1).repeat_interleave(group_size)  # [N]

    # ---- decode all rows together; rows that have stopped leave the batch (compaction)
    completion_ids = torch.full((n, t_max), pad_id, dtype=torch.long, device=device)  # [N, T]
    completion_mask = torch.zeros((n, t_max), dtype=torch.long, device=device)  # [N, T]
    old_logp = torch.zeros((n, t_max), dtype=torch.float32, device=device)  # [N, T]
    done = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
    rows = torch.arange(n, device=device)  # [A] original row of each row in the model batch
    truncates = sampling.truncates
    log_mass = torch.zeros((n, t_max), dtype=torch.float32, device=device) if truncates else None
    kept_steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: (rows [a], ids [a, K])
    used = 0
    for step in range(t_max):
        d = draw_tokens(logits, sampling, generator, None if row_t is None else row_t[rows])
        tok, logp = d.tokens, d.logp  # [A], [A]
        live = ~done[rows]  # [A] rows not stopped yet (stopped ones await compaction)
        idx = rows[live]
        completion_ids[idx, step] = tok[live]
        old_logp[idx, step] = logp[live]
        completion_mask[idx, step] = 1
        if log_mass is not None and d.log_kept_mass is not None:
            log_mass[idx, step] = d.log_kept_mass[live]
        if d.kept is not None:
            kept_steps.append((idx, d.kept[live]))
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
    kept_ids = _stack_kept(kept_steps, n, used, device) if kept_steps else None
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
        kept_ids=kept_ids,
        log_kept_mass=None if log_mass is None else log_mass[:, :used],
    )


def _stack_kept(
    steps: list[tuple[torch.Tensor, torch.Tensor]], n: int, t: int, device: torch.device
) -> torch.Tensor:
    """``[N, T, K]`` int32 kept ids of every position (-1 padding and after a row's end) from
    each decode step's ``(rows [a], ids [a, K_step])``; K = the largest K_step."""
    k = max(ids.shape[1] for _, ids in steps)
    out = torch.full((n, t, k), -1, dtype=torch.int32, device=device)  # [N, T, K]
    for step, (rows, ids) in enumerate(steps):
        out[rows, step, : ids.shape[1]] = ids
    return out


# ---- the KV cache: written in place, never re-concatenated ----------------------------------


class _InPlaceLayer(DynamicLayer):  # type: ignore[misc,valid-type]
    """A transformers ``DynamicLayer`` whose keys and values live in a buffer of ``capacity``
    positions allocated once; ``keys`` / ``values`` are views of its filled prefix.

    [OURS] ``DynamicLayer.update`` concatenates the whole cache with each new token (SmolLM2
    at batch 64: ~90 MB copied per decode step at 100 cached positions); here a step writes
    its one position. The views hold the same values as the concatenated tensors, so
    attention sees the same keys and values. Built by :func:`_preallocate`.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, repeats: int, capacity: int):
        super().__init__()
        t = keys.shape[2]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._k = self._filled(keys, repeats, max(capacity, t))  # [B·r, H, C, D]
        self._v = self._filled(values, repeats, max(capacity, t))
        self._t = t
        self._views()

    @staticmethod
    def _filled(x: torch.Tensor, repeats: int, capacity: int) -> torch.Tensor:
        b, h, t, d = x.shape
        buf = x.new_empty((b * repeats, h, capacity, d))
        buf.view(b, repeats, h, capacity, d)[:, :, :, :t] = x[:, None]  # row b·r + i = row b
        return buf

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self._t], self._v[:, :, : self._t]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, n = self._t, key_states.shape[-2]
        if t + n > self._k.shape[2]:  # past the capacity: grow (never in generate)
            grow = max(t + n, 2 * self._k.shape[2]) - self._k.shape[2]
            self._k = torch.nn.functional.pad(self._k, (0, 0, 0, grow))
            self._v = torch.nn.functional.pad(self._v, (0, 0, 0, grow))
        self._k[:, :, t : t + n] = key_states
        self._v[:, :, t : t + n] = value_states
        self._t = t + n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._t

    def crop(self, max_length: int) -> None:
        self._t = min(self._t, max_length if max_length >= 0 else self._t + max_length)
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._views()


def _preallocate(cache: Any, group_size: int, capacity: int) -> Any:
    """The prefill's cache repeated ``group_size`` times along the batch, each plain
    ``DynamicLayer`` moved into an :class:`_InPlaceLayer` of ``capacity`` positions (others,
    e.g. sliding-window layers, repeated as they are)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        cache.batch_repeat_interleave(group_size)
        return cache
    for i, layer in enumerate(layers):
        if DynamicLayer is not object and type(layer) is DynamicLayer and layer.get_seq_length():
            layers[i] = _InPlaceLayer(layer.keys, layer.values, group_size, capacity)
        else:
            layer.batch_repeat_interleave(group_size)
    return cache


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
