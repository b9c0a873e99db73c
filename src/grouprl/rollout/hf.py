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

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers without per-layer caches: caches stay as the model builds them
    DynamicLayer = object

__all__ = ["DRAWS", "Sampling", "generate", "gqa_attention", "sample_tokens"]


DRAWS = ("inverse_cdf", "multinomial")
"""The ways :func:`sample_tokens` draws a token (``Sampling.draw``)."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: ``temperature`` (0 = greedy), nucleus ``top_p``, ``max_new_tokens``.

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
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    logprob_temperature: float | None = None
    draw: str = "inverse_cdf"

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
            draw=getattr(sampling, "draw", "inverse_cdf"),
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
    kept, as HF's ``TopPLogitsWarper``), with ``generator`` as ``sampling.draw`` says:
    ``"inverse_cdf"`` (one float64 uniform per row, :func:`_inverse_cdf`) or
    ``"multinomial"`` (``torch.multinomial``, V exponential draws per row). The returned
    log-probs are ``log_softmax(logits / T_lp)`` at the drawn token, before top-p, with
    ``T_lp = sampling.logprob_temperature`` or, when None, the row's sampling temperature
    (module docstring).
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
    z = logits if isinstance(t, float) and t == 1.0 else logits / t  # x / 1.0 is x: one pass less
    if sampling.draw == "multinomial":
        tokens, logp = _multinomial(z, sampling.top_p, generator)
    else:
        tokens, logp = _draw_inverse_cdf(z, sampling.top_p, generator)
    if lp_t is not None and (temperature is not None or lp_t != sampling.temperature):
        logp_all = torch.log_softmax(logits / lp_t, dim=-1)  # e.g. AGPO: the raw logits (T = 1)
        logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logp


def _draw_inverse_cdf(
    z: torch.Tensor, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[N]`` drawn from ``softmax(z)`` (top-p truncated) by inverse CDF, and
    ``log_softmax(z)`` ``[N]`` at them. [OURS] One uniform per row instead of
    ``torch.multinomial``'s V exponentials (its Gumbel-max trick, ``argmax(p / q)``,
    ``q ~ Exp(1)``): the same distribution, sampled through float64 running sums."""
    top = z.amax(-1, keepdim=True)  # [N, 1]
    w = (z - top).exp_()  # [N, V] unnormalised probabilities, the largest 1
    u = _row_uniforms(w.shape[0], generator, w.device)  # [N, 1]
    if top_p < 1.0:
        w_sorted, order = w.sort(dim=-1, descending=True)  # [N, V]
        cdf = w_sorted.cumsum(-1, dtype=torch.float64)  # [N, V]
        # the nucleus: tokens whose mass strictly above them is below top_p (a prefix, >= 1)
        count = ((cdf - w_sorted) < top_p * cdf[:, -1:]).sum(-1, keepdim=True)  # [N, 1]
        tokens = order.gather(-1, _inverse_cdf(w_sorted, cdf, count, u)[:, None]).squeeze(-1)
    else:
        cdf = w.cumsum(-1, dtype=torch.float64)  # [N, V]
        count = torch.full_like(u, w.shape[-1], dtype=torch.long)  # [N, 1]
        tokens = _inverse_cdf(w, cdf, count, u)
    log_total = cdf[:, -1].log().float()  # [N] log Σ exp(z - top)
    logp = (z.gather(-1, tokens[:, None]) - top).squeeze(-1) - log_total
    return tokens, logp


def _multinomial(
    z: torch.Tensor, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.multinomial`` over ``softmax(z)`` (top-p truncated), as HF's sampler and this
    module before the inverse-CDF draw: tokens ``[N]`` and ``log_softmax(z)`` at them."""
    logp = torch.log_softmax(z, dim=-1)  # [N, V] the sampling distribution
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if generator is not None and generator.device != probs.device:
        tokens = torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator)  # [N, 1]
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
