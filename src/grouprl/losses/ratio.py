"""What every surrogate shares: input checks, the importance ratio, the gradient attachment,
ratio statistics.

The surrogates (``surrogates.py`` and the family files next to it) take the same inputs
(``logp, old_logp: [N, T]``, ``adv: [N]`` or ``[N, T]``, ``mask: [N, T]``), are computed the
same way and report the same ratio statistics, so all of it lives here, in one place
(ALGORITHMS.md §3).

**How a surrogate is computed** [OURS, measured by ``benchmarks/losses.py``]. Every surrogate
is an element-wise function of each token's log-probability (a sequence-level quantity, GSPO's
s_i or VESPO's weight, enters with its stop-gradient, and its gradient runs through each
token). So each one computes, without an autograd graph, its per-token value and the slope
``∂ℓ_t/∂logp_t`` written out from the quantities the value already needs, and
:func:`linearized` attaches ``grad · slope`` as the backward: one saved tensor and one product,
where autograd would save a tensor per operation and run a backward kernel for each (on a
CPU the backward of a clamp or a maximum builds boolean masks and ``torch.where`` copies,
~20x the cost of a product). Padding is handled by products with the 0/1 mask on values that
are finite everywhere (:func:`check_inputs`), never by ``torch.where``; statistics are dot
products and in-place passes over one scratch buffer (:func:`ratio_stats`), and run only when
asked (``stats=True``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "LOG_RATIO_CLAMP",
    "Eps",
    "apply_gate",
    "autograd_inputs",
    "autograd_masked",
    "beyond_count",
    "check_eps",
    "check_inputs",
    "clamp_log_ratio",
    "eps_column",
    "float_mask",
    "float_mask_count",
    "linearized",
    "masked_log_ratio",
    "masked_mean",
    "pessimistic_bounds",
    "ratio_stats",
    "sequence_log_ratio",
    "valid_sum",
]

LOG_RATIO_CLAMP = 20.0
"""|log ρ| is clamped to this before ``exp`` (verl ``compute_policy_loss_vanilla``)."""


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as a 0/1 tensor of ``dtype`` (nonzero = valid), copied only when it must be.

    A float mask already in ``dtype`` that holds only 0 and 1 is returned as it is (checked by
    :func:`_binary`, no copy). Any other (a bool or integer mask, a float mask of another
    dtype or with other values) becomes ``(mask != 0)`` in ``dtype``, the reading every loss
    function gives a mask.
    """
    return float_mask_count(mask, dtype)[0]


def _mask_checks(mask: torch.Tensor) -> torch.Tensor:
    """``[min, max, Σm², Σm]`` of a float mask (three passes), to stack with other sums."""
    flat = mask.reshape(-1)
    low, high = torch.aminmax(flat)
    return torch.stack([low, high, torch.dot(flat, flat), flat.sum()])


def _binary(checks: list[float]) -> bool:
    """A float mask holds only 0 and 1: ``0 ≤ m ≤ 1`` and ``Σm² = Σm`` (``m² < m`` inside)."""
    low, high, squares, total = checks[:4]
    return low >= 0 and high <= 1 and squares == total


def check_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate surrogate inputs; return ``(logp, old_logp, adv [N, 1] or [N, T], mask)``:
    detached, in the compute dtype, finite at every position, the mask 0/1 float.

    Raises ValueError for: non-tensors, ``logp`` not 2-D ``[N, T]``, ``old_logp`` / ``mask`` of
    another shape, ``adv`` neither ``[N]`` nor ``[N, T]``, a mask with no valid token, and
    non-finite ``logp`` / ``old_logp`` / ``adv`` at valid positions. Non-finite values at
    masked positions (``-inf`` padding) are replaced by 0 so that padding never produces NaN
    (ALGORITHMS.md §3 inputs); finite padding is left as it is, so a surrogate multiplies
    what it computes from it by the mask (:func:`masked_log_ratio`). float16 / bfloat16
    inputs are computed in float32; a mask's nonzero entries are its valid tokens.

    Cost: one host transfer of four sums (valid tokens, and ``logp``, ``old_logp``, ``adv`` over
    every position) decides everything in the common case, where all are finite; only a
    non-finite sum (``-inf`` padding, or an error to report) takes the ``torch.where`` path and
    the element-wise checks.
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
    lp, old, adv = logp.detach().to(dtype), old_logp.detach().to(dtype), adv.detach().to(dtype)
    m, sums = _mask_and_sums(mask, dtype, (lp, old, adv))  # valid tokens, Σlogp, Σold, Σadv
    if not sums[0] > 0:
        raise ValueError(
            "mask has no valid token (all zero): the loss would be 0/0; drop empty batches "
            "before the loss, or pass StepTotals to aggregate() for an empty micro-batch"
        )
    if not math.isfinite(sums[3]) and not bool(torch.isfinite(adv).all()):
        raise ValueError(
            "adv has non-finite values; advantages of NaN rewards must be 0 (see "
            "grouprl.advantages), never NaN"
        )
    out = []
    for name, t, total in (("logp", lp, sums[1]), ("old_logp", old, sums[2])):
        if not math.isfinite(total):  # zero-fill the padding; then valid values must be finite
            t = torch.where(m.bool(), t, torch.zeros((), dtype=dtype, device=t.device))
            ok = torch.isfinite(t)
            if not bool(ok.all()):
                raise ValueError(
                    f"{name} has {int((~ok).sum())} non-finite value(s) at valid (mask = 1) "
                    "positions; check the model's logits (fp16 overflow?) and the mask alignment"
                )
        out.append(t)
    return out[0], out[1], adv, m


def _mask_and_sums(
    mask: torch.Tensor, dtype: torch.dtype, tensors: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, list[float]]:
    """``(mask as 0/1 float, [valid tokens, Σ tensor for each tensor])`` with one host transfer:
    a float mask's 0/1 check (:func:`_binary`, whose Σm is the valid-token count) rides on the
    same one."""
    sums = [t.sum() for t in tensors]
    if mask.dtype == dtype and mask.numel():
        values = torch.stack([*_mask_checks(mask), *sums]).tolist()
        if _binary(values):
            return mask, [values[3], *values[4:]]
        m = (mask != 0).to(dtype)  # other values than 0 and 1: nonzero is valid
        return m, [float(m.sum()), *values[4:]]
    m = mask.to(dtype) if mask.dtype == torch.bool else (mask != 0).to(dtype)
    values = torch.stack([m.sum(), *sums]).tolist()
    return m, values


def float_mask_count(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """``(float_mask(mask, dtype), its number of valid tokens)`` with one host transfer."""
    m, (count,) = _mask_and_sums(mask, dtype, ())
    return m, count


def autograd_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of a surrogate's plain autograd form (the ``*_autograd`` functions beside
    each surrogate): :func:`check_inputs`' checks, then ``(logp, old_logp, adv, mask)`` with
    ``logp`` still on the caller's graph, both log-probabilities in the compute dtype and 0 at
    every padded position (``torch.where``, so ``-inf`` padding never reaches the graph),
    ``adv`` ``[N, 1]`` or ``[N, T]`` and ``mask`` 0/1 float."""
    _, old, adv, m = check_inputs(logp, old_logp, adv, mask)
    valid, zero = m.bool(), torch.zeros((), dtype=m.dtype, device=m.device)
    lp = torch.where(valid, logp.to(m.dtype), zero)
    return lp, torch.where(valid, old, zero), adv, m


def autograd_masked(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``loss`` ``[N, T]`` set to 0 (value and gradient) at the padded positions of ``mask``."""
    return torch.where(mask.bool(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def masked_log_ratio(lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]``: ``(logp − old_logp)·mask``, exactly 0 at padding (inputs finite, as
    :func:`check_inputs` returns them), in one buffer."""
    return torch.sub(lp, old).mul_(mask)


class _Linearized(torch.autograd.Function):
    """``value`` forward, ``grad · slope (· mask)`` backward (see :func:`linearized`)."""

    @staticmethod
    def forward(ctx, logp, value, slope, mask):
        ctx.save_for_backward(slope, mask)
        ctx.dtype = logp.dtype
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        slope, mask = ctx.saved_tensors
        out = grad * slope
        if mask is not None:
            out.mul_(mask)
        return out.to(ctx.dtype), None, None, None


def linearized(
    logp: torch.Tensor,
    value: torch.Tensor,
    slope: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token loss ``value`` ``[N, T]`` with the gradient ``∂ℓ_t/∂logp_t = slope_t``
    (``slope`` ``[N, T]``, 0 at padding; or ``[N, 1]``, one per sequence, with ``mask``).

    ``value`` and ``slope`` are computed without a graph; the backward is ``grad · slope``
    (times the mask for a per-sequence slope). See the module docstring for why; the slopes
    are pinned against autograd through the peers' own functions and plain references
    (``tests/losses``). First-order only: the gradient carries no graph, and a
    double-backward chain raises. Without a gradient to take (``logp`` needs none, or grad
    mode is off) ``value`` comes back as it is.
    """
    if not (torch.is_grad_enabled() and logp.requires_grad):
        return value
    return _Linearized.apply(logp, value, slope, mask)


def clamp_log_ratio(
    log_ratio: torch.Tensor, bound: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_ratio.clamp(±bound), gate)``: ``gate`` is where the clamp passes the gradient, a
    bool ``[N, T]`` (within the bounds, inclusive, as autograd's clamp), or None when no entry
    lies beyond ``bound`` (one ``aminmax``): the clamp is then the identity, in value and
    gradient alike. ``bound=None``: no clamp. Apply it with :func:`apply_gate`."""
    if bound is None:
        return log_ratio, None
    low, high = torch.aminmax(log_ratio)
    if -bound <= float(low) and float(high) <= bound:
        return log_ratio, None
    return log_ratio.clamp(-bound, bound), log_ratio.abs() <= bound


def apply_gate(slope: torch.Tensor, *gates: torch.Tensor | None) -> torch.Tensor:
    """``slope`` set to 0 in place where a gate (:func:`clamp_log_ratio`) is False: a clamp
    that acts passes no gradient, and a NaN slope there (``-inf`` inputs) becomes 0 as
    autograd's clamp makes it."""
    for gate in gates:
        if gate is not None:
            slope.masked_fill_(~gate, 0.0)
    return slope


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the valid tokens (``mask`` float, at least one valid token)."""
    return (x * mask).sum() / mask.sum()


def valid_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ x·mask`` without an ``[N, T]`` temporary: one dot product (``x`` ``[N, T]`` or
    ``[N, 1]``, one value per sequence, weighed by its valid-token count)."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return torch.dot(x.reshape(-1), mask.sum(-1))
    return torch.dot(x.reshape(-1), mask.reshape(-1))


def beyond_count(
    x: torch.Tensor,
    bound: float | torch.Tensor,
    rows: torch.Tensor | None,
    *,
    below: bool,
    scratch: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """``Σ mask·rows·[x < bound]`` (``below``) or ``[x > bound]``.

    ``x`` and ``scratch`` are ``[N, T]``, ``bound`` a float or ``[N, 1]``, ``rows`` a 0/1 float
    ``[N, 1]`` or ``[N, T]`` (None: every row), ``mask`` the 0/1 mask, or None when the padded
    positions of ``x`` are known to be within the bound. The comparison writes 1.0 / 0.0 into
    ``scratch`` (a float ``out``): no boolean temporary, no integer sum.
    """
    (torch.lt if below else torch.gt)(x, bound, out=scratch)
    if mask is not None:
        scratch.mul_(mask)
    if rows is None:
        return scratch.sum()
    if rows.shape[-1] == 1 and scratch.shape[-1] != 1:
        return torch.dot(scratch.sum(-1), rows.reshape(-1))
    return torch.dot(scratch.reshape(-1), rows.reshape(-1))


def _outside(padding: float | None, bound: float | torch.Tensor, below: bool) -> bool:
    """Whether a padded ratio equal to ``padding`` may lie beyond ``bound`` (None: unknown)."""
    if padding is None or isinstance(bound, torch.Tensor):
        return True
    return padding < bound if below else padding > bound


def _row(x: float | torch.Tensor | None) -> float | torch.Tensor | None:
    """A ``[N, 1]`` bound as ``[N]``; a float or None as it is."""
    return x[:, 0] if isinstance(x, torch.Tensor) else x


@torch.no_grad()
def ratio_stats(
    ratio: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    lo: float | torch.Tensor | None,
    hi: float | torch.Tensor | None,
    log_ratio: torch.Tensor,
    *,
    any_sign: bool = False,
    cap: float | None = None,
    padding: float | None = None,
    scratch: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Ratio and clip statistics over valid tokens (TRL GRPOTrainer's clip_ratio/* metrics).

    ``clip_frac_low`` counts ρ < ``lo`` where A < 0 and ``clip_frac_high`` ρ > ``hi`` where
    A > 0 (the tokens whose gradient PPO's clip cuts), or either bound whatever the sign of A
    with ``any_sign`` (a clipped weight, CISPO); ``cap`` adds ``clip_frac_dual``, ρ > cap
    where A < 0 (the dual clip). A bound that is None gives a zero fraction without a pass.

    ``ratio`` and ``log_ratio`` are ``[N, T]``, or ``[N, 1]`` (one per sequence: then computed
    on ``[N]``, each sequence weighed by its valid-token count), ``mask`` 0/1 float, ``lo`` /
    ``hi`` floats or ``[N, 1]``; ``ratio=None`` means ``exp(log_ratio)``, computed here.
    ``padding``: the value ``ratio`` holds at every padded position when known (1.0 for the
    exponential of a masked log-ratio): the minimum and the maximum then come from one
    ``aminmax`` unless the valid ratios all lie on one side of it, and a count skips the mask
    when the padding lies within its bound; otherwise the minimum and maximum over the valid
    tokens are those of ``ratio ± max_float·(1 − mask)`` (exact at the valid positions,
    beyond every ratio at the others). Sums are dot products with the mask. ``[N, T]``
    buffers: ``scratch``, a tensor the caller no longer needs (it may be ``log_ratio``
    itself, read first), else new ones, only as the statistics need them.
    """
    n = mask.sum()
    approx_kl = -valid_sum(log_ratio.detach(), mask) / n
    if ratio is None:  # exp(log_ratio), into the scratch buffer when there is one
        ratio = torch.exp(log_ratio) if scratch is None else torch.exp(log_ratio, out=scratch)
        scratch = None if scratch is ratio else scratch
    r = ratio.detach()
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
        r = r.expand_as(mask)
        buffers = [] if scratch is None else [scratch]

        def buf() -> torch.Tensor:  # one [N, T] buffer, made when first needed
            if not buffers:
                buffers.append(torch.empty_like(mask))
            return buffers[0]

        r_min, r_max = _valid_min_max(r, mask, padding, buf)
        neg, pos = (adv < 0).to(mask.dtype), (adv > 0).to(mask.dtype)

        def count(bound, rows, below):
            if bound is None:
                return zero
            masked = mask if _outside(padding, bound, below) else None
            return beyond_count(r, bound, rows, below=below, scratch=buf(), mask=masked)

        low = count(lo, None if any_sign else neg, True)
        high = count(hi, None if any_sign else pos, False)
        dual = count(cap, neg, False)
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


def _valid_min_max(
    r: torch.Tensor, mask: torch.Tensor, padding: float | None, buf: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimum and maximum of ``r`` over the valid positions (see :func:`ratio_stats`)."""
    if padding is not None:
        low, high = torch.aminmax(r)
        lo_f, hi_f = float(low), float(high)
        # a minimum below the padding's value is a valid entry's (so is a maximum above it);
        # all equal to it: every valid entry is that value too
        if (lo_f < padding or lo_f == hi_f) and (hi_f > padding or lo_f == hi_f):
            return low, high
    big = torch.finfo(r.dtype).max
    # big·(1 − m) as big − big·m: exactly 0 at the valid positions, big at the others
    scratch = torch.mul(mask, -big, out=buf()).add_(big)
    r_min = scratch.add_(r).amin()  # r at the valid positions
    r_max = scratch.sub_(r).neg_().add_(r).amax()  # r − big·(1 − m)
    return r_min, r_max


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
