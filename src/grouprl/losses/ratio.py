"""What every surrogate shares: input checks, the importance ratio, ratio statistics.

The surrogates (``surrogates.py`` and the family files next to it) take the same inputs
(``logp, old_logp: [N, T]``, ``adv: [N]`` or ``[N, T]``, ``mask: [N, T]``) and report the same
ratio statistics, so both live here, in one place (ALGORITHMS.md §3).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "LOG_RATIO_CLAMP",
    "Eps",
    "beyond_count",
    "check_eps",
    "check_inputs",
    "eps_column",
    "float_mask",
    "masked_mean",
    "pessimistic_bounds",
    "ratio_stats",
    "sequence_level",
    "sequence_log_ratio",
    "sequence_ratio_tokens",
    "valid_sum",
    "zero_fill",
]

LOG_RATIO_CLAMP = 20.0
"""|log ρ| is clamped to this before ``exp`` (verl ``compute_policy_loss_vanilla``)."""


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as a 0/1 tensor of ``dtype`` (nonzero = valid), copied only when it must be.

    A float mask already in ``dtype`` that holds only 0 and 1 is returned as it is: checked by
    three reductions, no copy (``Σm² = Σm`` with ``0 ≤ m ≤ 1``). Any other (a bool or integer
    mask, a float mask of another dtype or with other values) becomes ``(mask != 0)`` in
    ``dtype``, the reading every loss function gives a mask.
    """
    if mask.dtype == dtype:
        flat = mask.reshape(-1)
        lo, hi, sq, total = torch.stack(
            [flat.amin(), flat.amax(), torch.dot(flat, flat), flat.sum()]
        ).tolist()  # one host transfer
        if flat.numel() == 0 or (lo >= 0 and hi <= 1 and sq == total):
            return mask
    elif mask.dtype == torch.bool:
        return mask.to(dtype)
    return (mask != 0).to(dtype)


def zero_fill(
    tensors: Sequence[torch.Tensor], mask: torch.Tensor, *, finite: Sequence[bool] | None = None
) -> list[torch.Tensor]:
    """Each tensor at the valid positions (``mask`` 0/1 float), exactly 0 at the others.

    A product ``t · mask`` when the tensor is finite everywhere (one sum tells: a finite sum of
    finite numbers; a sum that overflows only takes the slower branch), else ``torch.where``:
    ``NaN · 0`` is NaN, and padding may hold ``-inf`` log-probs. The product is ~20x cheaper
    than ``torch.where`` on a CPU, and its backward is one product too. ``finite``: the
    answers when the caller already has them (one host transfer for several checks).
    """
    if finite is None:
        finite = [math.isfinite(v) for v in torch.stack([t.detach().sum() for t in tensors]).tolist()]
    out = []
    for t, ok in zip(tensors, finite):
        if ok:
            out.append(t * mask)
        else:
            out.append(torch.where(mask.bool(), t, torch.zeros((), dtype=t.dtype, device=t.device)))
    return out


def check_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate surrogate inputs; return ``(logp, old_logp, adv [N, 1] or [N, T], mask float)``.

    Raises ValueError for: non-tensors, ``logp`` not 2-D ``[N, T]``, ``old_logp`` / ``mask`` of
    another shape, ``adv`` neither ``[N]`` nor ``[N, T]``, a mask with no valid token, and
    non-finite ``logp`` / ``old_logp`` / ``adv`` at valid positions. Masked positions are
    zero-filled so that padding never produces NaN (ALGORITHMS.md §3 inputs); float16 /
    bfloat16 inputs are computed in float32. The returned mask is 0/1 in the compute dtype
    (nonzero = valid).

    Cost [OURS, benchmarks/losses.py]: one host transfer of four sums (valid tokens, and
    ``logp``, ``old_logp``, ``adv`` over every position) decides everything in the common case,
    where all are finite: padding is then zero-filled by a product with the mask. Only a
    non-finite sum (``-inf`` padding, or an error to report) takes the ``torch.where`` path
    and the element-wise checks.
    """
    for name, t in (("logp", logp), ("adv", adv), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logp.dim() != 2:
        raise ValueError(
            f"logp must be [N sequences, T tokens], got shape {_shape(logp)}; "
            "a single sequence needs logp.unsqueeze(0)"
        )
    if old_logp is None:
        old_logp = logp.detach()
    if not isinstance(old_logp, torch.Tensor) or old_logp.shape != logp.shape:
        got = _shape(old_logp) if isinstance(old_logp, torch.Tensor) else type(old_logp).__name__
        raise ValueError(
            f"old_logp must have the shape of logp {_shape(logp)}, got {got}; both are the "
            "per-token log-probabilities of the same completion tokens"
        )
    if mask.shape != logp.shape:
        raise ValueError(
            f"mask must have the shape of logp {_shape(logp)}, got {_shape(mask)}; pass the "
            "completion mask (1 = real token), not the prompt+completion attention mask"
        )
    n = logp.shape[0]
    if adv.shape == (n,):
        adv = adv[:, None]  # [N, 1]
    elif adv.shape != logp.shape:
        raise ValueError(
            f"adv must be [N]={n} (one advantage per sequence) or [N, T]={_shape(logp)}, got "
            f"{_shape(adv)}; flatten a [P, G] advantage with Advantages.per_sample"
        )
    # half-precision log-probs are upcast: exp(logp - old_logp) in bf16 has ~3 significant
    # digits, far coarser than a 0.2 clip range [OURS]
    dtype = torch.promote_types(logp.dtype, torch.float32)
    m = float_mask(mask, dtype)
    logp, old_logp = logp.to(dtype), old_logp.detach().to(dtype)
    adv = adv.detach().to(dtype)
    sums = torch.stack([m.sum(), logp.detach().sum(), old_logp.sum(), adv.sum()]).tolist()
    count, finite = sums[0], [math.isfinite(v) for v in sums[1:]]
    if not count > 0:
        raise ValueError(
            "mask has no valid token (all zero): the loss would be 0/0; drop empty batches "
            "before the loss, or pass StepTotals to aggregate() for an empty micro-batch"
        )
    if not finite[2] and not bool(torch.isfinite(adv).all()):
        raise ValueError(
            "adv has non-finite values; advantages of NaN rewards must be 0 (see "
            "grouprl.advantages), never NaN"
        )
    logp, old_logp = zero_fill((logp, old_logp), m, finite=finite[:2])
    if not (finite[0] and finite[1]):
        # padding is 0 now, so the valid positions are finite iff the sums are; the count
        # only for the error message
        for name, t in (("logp", logp), ("old_logp", old_logp)):
            ok = torch.isfinite(t.detach())
            if not bool(ok.all()):
                raise ValueError(
                    f"{name} has {int((~ok).sum())} non-finite value(s) at valid (mask = 1) "
                    "positions; check the model's logits (fp16 overflow?) and the mask alignment"
                )
    return logp, old_logp, adv, m


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the valid tokens (``mask`` float, at least one valid token)."""
    return (x * mask).sum() / mask.sum()


def _row(x: float | torch.Tensor | None) -> float | torch.Tensor | None:
    """A ``[N, 1]`` bound as ``[N]``; a float or None as it is."""
    return x[:, 0] if isinstance(x, torch.Tensor) else x


def valid_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ x·mask`` without an ``[N, T]`` temporary: one dot product (``x`` ``[N, T]`` or
    ``[N, 1]``, one value per sequence, weighed by its valid-token count)."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return torch.dot(x.reshape(-1), mask.sum(-1))
    return torch.dot(x.reshape(-1), mask.reshape(-1))


def beyond_count(
    x: torch.Tensor,
    bound: float | torch.Tensor,
    mask: torch.Tensor,
    rows: torch.Tensor | None,
    *,
    below: bool,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """``Σ mask·rows·[x < bound]`` (``below``) or ``[x > bound]``, in float arithmetic.

    ``x`` and ``scratch`` are ``[N, T]``, ``bound`` a float or ``[N, 1]``, ``rows`` a 0/1 float
    ``[N, 1]`` or ``[N, T]`` (None: every row). ``sign(bound − x)`` clamped at 0 is 1 exactly
    where ``x < bound`` (two different floats never subtract to 0), computed in place in
    ``scratch``: one reused buffer instead of three boolean temporaries and an integer sum,
    whose fresh pages cost more than the arithmetic on a CPU [OURS, benchmarks/losses.py].
    """
    torch.sub(x, bound, out=scratch)
    if below:
        scratch.neg_()
    scratch.sign_().clamp_(min=0.0).mul_(mask)
    if rows is None:
        return scratch.sum()
    if rows.shape[-1] == 1 and scratch.shape[-1] != 1:
        return torch.dot(scratch.sum(-1), rows.reshape(-1))
    return torch.dot(scratch.reshape(-1), rows.reshape(-1))


@torch.no_grad()
def ratio_stats(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    lo: float | torch.Tensor | None,
    hi: float | torch.Tensor | None,
    log_ratio: torch.Tensor,
    *,
    any_sign: bool = False,
    cap: float | None = None,
) -> dict[str, torch.Tensor]:
    """Ratio and clip statistics over valid tokens (TRL GRPOTrainer's clip_ratio/* metrics).

    ``clip_frac_low`` counts ρ < ``lo`` where A < 0 and ``clip_frac_high`` ρ > ``hi`` where
    A > 0 (the tokens whose gradient PPO's clip cuts), or either bound whatever the sign of A
    with ``any_sign`` (a clipped weight, CISPO); ``cap`` adds ``clip_frac_dual``, ρ > cap
    where A < 0 (the dual clip).

    ``ratio`` and ``log_ratio`` are ``[N, T]``, or ``[N, 1]`` (one per sequence: computed on
    ``[N]``, each sequence weighed by its valid-token count; for the ratio when ``adv`` is
    ``[N, 1]`` too), ``mask`` 0/1 float, ``lo`` / ``hi`` floats or ``[N, 1]``. Fractions
    are counts over the valid-token count; a bound that is None gives a zero fraction without
    a pass over the batch. No gradient, and at most two ``[N, T]`` scratch buffers: sums are
    dot products with the mask, counts :func:`beyond_count`, and the minimum and maximum over
    the valid tokens are taken of ``ratio ± max_float·(1 − mask)`` (exact at the valid
    positions, beyond every ratio at the others).
    """
    n = mask.sum()
    r = ratio.detach()
    approx_kl = -valid_sum(log_ratio.detach(), mask) / n
    ratio_sum = valid_sum(r, mask)
    zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
    if r.shape[-1] == 1 and adv.shape[-1] == 1 and mask.shape[-1] != 1:  # all on [N]
        weight = mask.sum(-1)  # [N] valid tokens per sequence
        r, a, lo, hi = r[:, 0], adv[:, 0], _row(lo), _row(hi)
        inf = torch.tensor(math.inf, dtype=r.dtype, device=r.device)
        has = weight > 0
        r_min, r_max = torch.where(has, r, inf).amin(), torch.where(has, r, -inf).amax()
        neg, pos = (a < 0) | any_sign, (a > 0) | any_sign
        low = (((r < lo) & neg) * weight).sum() if lo is not None else zero
        high = (((r > hi) & pos) * weight).sum() if hi is not None else zero
        dual = (((r > cap) & (a < 0)) * weight).sum() if cap is not None else zero
    else:
        big = torch.finfo(r.dtype).max
        pad = 1.0 - mask  # [N, T]
        scratch = torch.add(r, pad, alpha=big)  # r at the valid positions, >= big elsewhere
        r_min = scratch.amin()
        r_max = torch.add(r, pad, alpha=-big, out=scratch).amax()
        r = r.expand_as(mask)
        neg, pos = (adv < 0).to(mask.dtype), (adv > 0).to(mask.dtype)
        count = functools.partial(beyond_count, r, mask=mask, scratch=scratch)
        sign = None if any_sign else neg
        low = count(lo, rows=sign, below=True) if lo is not None else zero
        high = count(hi, rows=None if any_sign else pos, below=False) if hi is not None else zero
        dual = count(cap, rows=neg, below=False) if cap is not None else zero
    out = {
        "ratio_mean": ratio_sum / n,
        "ratio_min": r_min,
        "ratio_max": r_max,
        "approx_kl": approx_kl,
        "clip_frac_low": low / n,
        "clip_frac_high": high / n,
        # the two never overlap (ρ < lo <= 1 <= hi < ρ, or A < 0 against A > 0): the
        # region is their sum
        "clip_frac_region": (low + high) / n,
    }
    if cap is not None:
        out["clip_frac_dual"] = dual / n
    return out


Eps = float | torch.Tensor
"""A clip bound: one float, or one per sequence (``[N]``)."""


def _eps_ok(e: Eps) -> bool:
    """Finite and >= 0 (a float, or every entry of a per-sequence tensor)."""
    if isinstance(e, torch.Tensor):
        return bool(((e >= 0) & torch.isfinite(e)).all())
    return math.isfinite(float(e)) and float(e) >= 0


def check_eps(eps_low: Eps, eps_high: Eps) -> None:
    ok = _eps_ok(eps_low) and _eps_ok(eps_high)
    if not ok:
        raise ValueError(f"clip bounds must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")


def eps_column(eps: Eps, n: int, like: torch.Tensor) -> float | torch.Tensor:
    """A float stays a float; a per-sequence ``[N]`` tensor becomes ``[N, 1]``."""
    if not isinstance(eps, torch.Tensor):
        return float(eps)
    if eps.shape != (n,):
        raise ValueError(
            f"a tensor clip bound must be [N]={n} (one per sequence, e.g. AGPO's per-prompt "
            f"epsilon repeated G times), got {tuple(eps.shape)}"
        )
    return eps.detach().to(like.dtype)[:, None]


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T] -> [N]``: the mean of the per-token log-ratios over each sequence's valid tokens.

    ``log s_i = Σ_t m_it·log ρ_it / max(|y_i|, 1)`` (GSPO's length-normalised sequence ratio;
    TRL ``importance_sampling_level="sequence"`` divides by ``mask.sum(-1).clamp(min=1)``).
    """
    return (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1.0)


def sequence_ratio_tokens(log_seq: torch.Tensor, token_part: torch.Tensor) -> torch.Tensor:
    """``[N], [N, T] -> [N, T]``: the token-trick form of a sequence-level log-ratio.

    ``sg(log s_i) + x_it − sg(x_it)`` (GSPO-token, Zheng et al. 2025 §4.3): its value is
    ``log s_i`` at every token, and the gradient at token t is ``∇x_it``. Summed over a
    sequence with one weight per sequence (every aggregation), ``f(exp(·))`` then has the value
    and the gradient of the sequence-level ``f(s_i)`` whenever ``∇ log s_i = Σ_t ∇x_it / |y_i|``
    and the sequence's tokens are averaged, as for ``x = logp`` (GSPO) or the clipped log-ratio
    (GMPO).
    """
    return log_seq.detach()[:, None] + token_part - token_part.detach()


def sequence_level(
    value: torch.Tensor, slope: torch.Tensor, token_part: torch.Tensor
) -> torch.Tensor:
    """``[N, 1], [N, 1], [N, T] -> [N, T]``: a sequence-level loss in the GSPO-token form.

    ``value_i + slope_i·(x_it − sg(x_it))``: the value ``value_i = f(log s_i)`` at every token
    and the gradient ``slope_i·∇x_it`` with ``slope_i = f'(log s_i)`` (detached), which is the
    gradient of ``f(sg(log s_i) + x_it − sg(x_it))`` (:func:`sequence_ratio_tokens`) computed
    from ``[N]`` values: ``f`` itself (an exponential, a clip, a gate) never runs on ``[N, T]``
    [OURS]. ``x`` must be finite (``x − sg(x)`` is then exactly 0).
    """
    return value.detach() + slope.detach() * (token_part - token_part.detach())


def pessimistic_bounds(
    adv: torch.Tensor,
    lo: float | torch.Tensor,
    hi: float | torch.Tensor,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lower, upper)`` in ``adv``'s shape such that ``−A·clamp(ρ, lower, upper)`` equals
    PPO's ``max(−Aρ, −A·clip(ρ, lo, hi))`` (and, with ``cap``, the dual clip
    ``min(·, −A·cap)`` for A < 0), value for value.

    For A > 0, ``min(ρ, clip(ρ, lo, hi)) = min(ρ, hi)``; for A < 0,
    ``max(ρ, clip(ρ, lo, hi)) = max(ρ, lo)``, capped at ``cap`` by the dual clip
    (``cap > 1 ≥ lo``); A = 0 gives 0 either way. So one clamp with per-row bounds replaces
    two products, a clamp and a maximum [OURS].
    """
    kw = {"dtype": adv.dtype, "device": adv.device}
    inf = torch.tensor(math.inf, **kw)
    lo_t, hi_t = torch.as_tensor(lo, **kw), torch.as_tensor(hi, **kw)
    top = inf if cap is None else torch.tensor(cap, **kw)
    return torch.where(adv < 0, lo_t, -inf), torch.where(adv > 0, hi_t, top)
