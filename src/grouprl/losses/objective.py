"""The full objective of one (micro-)batch in one call: surrogate + β·kl_weight·KL − c·entropy.

``per_token = surrogate(A) + β·kl_weight_i·KL_t − entropy_coeff·H_t`` over the tokens of the
sequences with ``keep = True``, aggregated with one aggregation (verl applies the same
``loss_agg_mode`` to the policy, KL and entropy terms). The KL term is added *after* and
*outside* the advantage: an estimator that divides A by a scale s_q (GRPO's σ, MaxNorm's
s_q) never rescales the KL branch, and ``kl_weight`` (``Advantages.kl_weight``, 1 unless a
method such as ``grpo_beta_comp`` says otherwise) is the only per-group knob on it
(ALGORITHMS.md §0, §3). A group with ``keep = False`` takes part in neither branch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from grouprl import registry
from grouprl.losses.aggregation import StepTotals, entropy_threshold, reduce_masked
from grouprl.losses.kl import (
    KL_CORRECTIONS,
    KL_IS_WEIGHT_CLIP,
    corrected_value_slope,
    kl_corrected,
    kl_value_slope,
)
from grouprl.losses.ratio import float_mask, float_mask_count, linearized
from grouprl.losses.surrogates import surrogate as surrogate_fn
from grouprl.types import to_floats

__all__ = ["Objective", "objective"]


@dataclass
class Objective:
    """The result of :func:`objective`.

    Attributes:
        loss: scalar to ``backward()``: ``pg_loss + kl_loss − entropy_bonus``.
        pg_loss: the aggregated reward (surrogate) branch, with its graph.
        kl_loss: the aggregated ``β·kl_weight·KL`` branch, with its graph (0 when β = 0).
        kl_unweighted: the per-token KL aggregated the same way but without β and without
            ``kl_weight``, with its graph (0 when β = 0): the KL branch the MaxNorm paper's
            R/KL = ‖g_R‖/(β‖g_KL‖) differentiates (``diagnostics.reward_kl_balance``).
        entropy_bonus: the aggregated ``entropy_coeff·H`` (0 when unused).
        per_token: ``[N, T]`` the summed per-token objective (0 at masked / dropped tokens).
        reward_tokens, kl_tokens, loss_mask, aggregation: the branches' per-token terms as
            aggregated (``[N, T]``, 0 outside ``loss_mask``: the surrogate after the
            top-entropy mask and the correction weight; the unweighted KL, None when β = 0),
            the ``[N, T]`` 0/1 mask of the tokens in the loss and the aggregation name:
            :meth:`branches` re-aggregates them over a subset of the rows.
        stats: floats: the surrogate's stats (ratio, clip fractions) plus ``pg_loss``,
            ``kl_loss``, ``kl_mean`` (token mean of the raw KL estimate), ``entropy_mean``,
            ``kept_frac`` (fraction of sequences kept). Loss values are this micro-batch's
            contribution: with StepTotals they *sum* over micro-batches to the step's value;
            means (ratio, kl_mean...) are over this micro-batch's kept tokens.
    """

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl_loss: torch.Tensor
    entropy_bonus: torch.Tensor
    per_token: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)
    kl_unweighted: torch.Tensor | None = None
    reward_tokens: torch.Tensor | None = None
    kl_tokens: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    aggregation: str = "token_mean"

    def branches(
        self, rows: torch.Tensor, totals: StepTotals | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reward branch, unweighted KL branch)`` of this call's rows ``rows`` (``[k]``
        indices) alone, aggregated under ``totals``, with their graph.

        The same per-token terms as :attr:`pg_loss` and :attr:`kl_unweighted` (this call's
        forward, its selection, correction and entropy mask), reduced over the rows ``rows``
        only: what ``diagnostics.reward_kl_balance`` differentiates for a subset (MaxNorm
        Table 3's low-σ groups) without a second forward or a second objective. The KL branch
        is 0 with the graph when β = 0.
        """
        if self.reward_tokens is None or self.loss_mask is None:
            raise ValueError("this Objective carries no per-token branches (losses.objective)")
        mask = self.loss_mask[rows]  # [k, T]
        pg = reduce_masked(self.aggregation, self.reward_tokens[rows], mask, totals)
        if self.kl_tokens is None:
            return pg, pg * 0.0
        return pg, reduce_masked(self.aggregation, self.kl_tokens[rows], mask, totals)


def _per_sample(name: str, t: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        return torch.ones(n, dtype=like.dtype, device=like.device)
    if not isinstance(t, torch.Tensor) or t.shape != (n,):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{name} must be [N]={n} (one value per sequence), got {got}; expand a per-group "
            f"[P] tensor with .repeat_interleave(group_size)"
        )
    return t


def _surrogate_params(
    name: str, params: Mapping[str, float] | None, entropy: torch.Tensor | None
) -> dict:
    """The surrogate's keywords: its parameters, and the entropies when it declares them."""
    out = dict(params or {})
    if entropy is not None and "entropy" in registry.AXES["surrogate"].reads(name):
        out["entropy"] = entropy
    return out


def _top_entropy(
    entropy: torch.Tensor | None,
    eff: torch.Tensor,
    quantile: float,
    totals: StepTotals | None,
    shape: torch.Size,
) -> torch.Tensor | None:
    """``[N, T]`` 0/1 float: the kept tokens whose entropy reaches the top-ρ threshold (None:
    ρ = 1)."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {quantile}")
    if quantile >= 1.0:
        return None
    if entropy is None or entropy.shape != shape:
        raise ValueError(
            f"top_entropy_quantile={quantile} needs entropy=[N, T]={tuple(shape)} (the token "
            "entropies, losses.token_entropy(logits))"
        )
    thr = totals.entropy_threshold if totals is not None else None
    if thr is None:
        thr = entropy_threshold(entropy, eff, quantile)
    return eff * (entropy.detach() >= thr).to(eff.dtype)


def _correction_weight(w: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor | None:
    """``[N, T]`` or ``[N, 1]`` detached weight, checked finite and >= 0 (None: no weight)."""
    if w is None:
        return None
    n, t = logp.shape
    if not isinstance(w, torch.Tensor) or w.shape not in ((n, t), (n,)):
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(
            f"correction_weight must be [N, T]={(n, t)} or [N]={n} (Correction.weight), got {got}"
        )
    w = w.detach()
    total, low = torch.stack([w.sum(), w.amin()]).double().tolist()  # one host transfer
    # a finite sum of values >= 0: all fine; else the element-wise check decides
    fine = math.isfinite(total) and low >= 0
    if not fine and not bool((torch.isfinite(w) & (w >= 0)).all()):
        raise ValueError("correction_weight must be finite and >= 0 (an importance weight)")
    return w if w.dim() == 2 else w[:, None]


def _zero_fill(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``t`` where ``keep`` (0/1 float) is 1, exactly 0 elsewhere: a product when ``t`` is finite
    everywhere (one sum tells), else ``torch.where`` (``NaN · 0`` is NaN; padding may hold
    ``-inf``). The product is ~20x cheaper than ``torch.where`` on a CPU."""
    if math.isfinite(float(t.detach().sum())):
        return t * keep
    return torch.where(keep.bool(), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _kl_tokens(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    eff: torch.Tensor,
    correction: str | None,
    weight_clip: float,
) -> torch.Tensor:
    """``[N, T]`` per-token KL (importance-corrected when ``correction`` is set), 0 outside
    ``eff`` (0/1 float), with its gradient. Computed from copies whose padding is zero-filled
    (:func:`_zero_fill`), so that -inf / NaN there never reaches the value or the gradient;
    element-wise forms as value and slope (:func:`grouprl.losses.kl.kl_value_slope`), the
    sequence-ratio correction through autograd."""
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs)")
    if not isinstance(ref_logp, torch.Tensor) or ref_logp.shape != logp.shape:
        got = tuple(ref_logp.shape) if isinstance(ref_logp, torch.Tensor) else type(ref_logp)
        raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {got}")
    dtype = eff.dtype  # float32 at least (check_inputs)
    if correction == "sequence_ratio":
        safe = [_zero_fill(t.to(dtype), eff) for t in (logp, ref_logp.detach())]
        old = None if old_logp is None else _zero_fill(old_logp.detach().to(dtype), eff)
        value = kl_corrected(name, safe[0], safe[1], old, eff, correction=correction)
        return value * eff
    lp = _zero_fill(logp.detach().to(dtype), eff)
    ref = _zero_fill(ref_logp.detach().to(dtype), eff)
    if correction is None:
        value, slope = kl_value_slope(name, lp, ref)
    else:
        if correction not in KL_CORRECTIONS:
            raise ValueError(
                f"unknown KL correction {correction!r}; valid corrections: "
                f"{', '.join(KL_CORRECTIONS)}"
            )
        if correction == "straight_through" and not weight_clip > 0:
            raise ValueError(f"kl_weight_clip must be > 0, got {weight_clip}")
        old = lp if old_logp is None else _zero_fill(old_logp.detach().to(dtype), eff)
        value, slope = corrected_value_slope(
            name, lp, ref, old, correction=correction, weight_clip=weight_clip
        )
    with torch.no_grad():
        value = value * eff
        slope = slope * eff
    return linearized(logp, value, slope)


def objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    surrogate: str = "ppo_clip",
    surrogate_params: Mapping[str, float] | None = None,
    aggregation: str = "token_mean",
    totals: StepTotals | None = None,
    keep: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl: str = "k3",
    beta: float = 0.0,
    kl_weight: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    kl_correction: str | None = None,
    kl_weight_clip: float = KL_IS_WEIGHT_CLIP,
    top_entropy_quantile: float = 1.0,
    correction_weight: torch.Tensor | None = None,
    correction_keep: torch.Tensor | None = None,
    stats: bool = True,
) -> Objective:
    """Surrogate + β·kl_weight·KL − entropy_coeff·H per token, aggregated, in one call.

    Args:
        logp, old_logp, mask: ``[N, T]`` as for :func:`grouprl.losses.surrogate`.
        adv: ``[N]`` advantages (``Advantages.per_sample`` of a prompt-major batch).
        surrogate, surrogate_params: the surrogate name and its keyword parameters.
        aggregation, totals: the aggregation and the step's :class:`StepTotals` (build the
            totals with ``step_totals(masks, keep=keeps)`` so dropped rows are not counted).
        keep: ``[N]`` bool; False rows contribute to neither branch (``Advantages.keep``
            expanded per sample). ``None`` keeps all.
        ref_logp, kl, beta: reference log-probs, KL estimator and β; ``ref_logp`` is required
            when β > 0.
        kl_weight: ``[N]`` multiplier on β per sequence (``Advantages.kl_weight`` expanded).
        entropy, entropy_coeff: ``[N, T]`` token entropies (:func:`token_entropy`) and the
            bonus coefficient; the bonus is subtracted (higher entropy lowers the loss).
        kl_correction, kl_weight_clip: None (the plain KL term), or an importance correction of
            the KL term for off-policy steps (:func:`grouprl.losses.kl_corrected`: ``"ratio"``
            = TRL ``use_bias_correction_kl``, ``"sequence_ratio"`` = the same at TRL's sequence
            level, ``"straight_through"`` = OpenRLHF ``kl.unbiased_gradient``, whose weight is
            capped at ``kl_weight_clip``).
        top_entropy_quantile: ρ < 1 keeps in the surrogate branch only the valid tokens whose
            entropy is at least the (1 − ρ)-quantile ("Beyond the 80/20 Rule", arXiv
            2506.01939, ρ = 0.2; TRL ``top_entropy_quantile``, grpo_trainer.py:3050-3053,
            3143-3144): the other tokens' surrogate loss is 0, the normalisers and the KL
            branch are unchanged, and the entropy bonus acts on the kept tokens only (TRL
            also divides it by their count; here it takes the objective's aggregation). Needs
            ``entropy``. The threshold is ``totals.entropy_threshold`` when the
            step's totals carry one (one threshold for every micro-batch: the one-batch mask),
            else the quantile over this call's kept tokens (TRL's micro-batch reading).
        correction_weight: ``[N, T]`` (or ``[N]``) rollout-correction weight
            (:class:`grouprl.losses.correction.Correction` ``.weight``): a detached factor on
            the surrogate's per-token loss only, as verl (``pg_losses * rollout_is_weights``)
            and TRL (``per_token_loss * importance_sampling_ratio`` before the KL term) apply
            it; a zero weight leaves the token in the normaliser. Finite and >= 0.
        correction_keep: ``[N, T]`` bool (``Correction.keep``): False rejects the token from
            every branch and, without ``totals``, from the normaliser (verl's rejection
            sampling rewrites ``response_mask``); with ``totals``, build them from
            ``Correction.loss_mask(mask)`` so that the step's counts leave it out too.
        stats: compute :attr:`Objective.stats` (the surrogate's ratio and clip statistics and
            the branch values; no gradient, one host transfer). ``False`` returns an empty
            dict and skips that work: for a caller that wants only the loss (the trainer
            asks once per micro-batch).

    A micro-batch in which every row has ``keep = False`` returns a zero loss that is still
    connected to ``logp`` (``backward()`` works and adds nothing).
    """
    if beta < 0 or entropy_coeff < 0:
        raise ValueError(f"beta and entropy_coeff must be >= 0, got {beta} and {entropy_coeff}")
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError("logp must be a [N, T] tensor")
    keep_t, mask_f, eff, n_tok = _masks(logp, mask, keep, correction_keep)
    corr_w = _correction_weight(correction_weight, logp)
    any_kept = n_tok > 0
    sur_mask = eff if any_kept else mask_f  # validate the raw inputs when nothing is kept
    sur_params = _surrogate_params(surrogate, surrogate_params, entropy)
    per_token, sur_stats = surrogate_fn(
        surrogate, logp, old_logp, adv, sur_mask, stats=stats, **sur_params
    )  # [N, T], 0 outside eff
    if not any_kept:
        zero = (per_token * 0.0).sum()  # 0 with the graph: backward() works and adds nothing
        if stats:
            sur_stats = {key: 0.0 for key in sur_stats}
            sur_stats.update(pg_loss=0.0, kl_loss=0.0, kl_mean=0.0, entropy_mean=0.0, kept_frac=0.0)
        return Objective(
            zero, zero, zero, zero, per_token * 0.0, sur_stats, zero,
            reward_tokens=per_token * 0.0, loss_mask=eff, aggregation=aggregation,
        )  # fmt: skip
    extra: dict[str, torch.Tensor] = {}
    token_keep = _top_entropy(entropy, eff, top_entropy_quantile, totals, logp.shape)
    if token_keep is not None:
        per_token = _zero_fill(per_token, token_keep)
        extra["entropy_mask_frac"] = token_keep.sum() / n_tok
    if corr_w is not None:
        per_token = per_token * corr_w.to(per_token.dtype)  # weights the reward branch only
    pg_loss = reduce_masked(aggregation, per_token, eff, totals)
    # an unused branch: 0 with the graph (per_token is finite everywhere, also where logp
    # holds -inf padding, which logp.sum() * 0 would turn into NaN)
    zero = pg_loss * 0.0
    loss, total = pg_loss, per_token  # only the branches that act: a zero branch would add
    kl_loss = kl_unweighted = ent_bonus = zero  # a backward pass
    kl_tok = None
    if beta > 0:
        kl_tok = _kl_tokens(
            kl, logp, ref_logp, old_logp, eff, kl_correction, kl_weight_clip
        )  # [N, T], 0 outside eff
        w = _per_sample("kl_weight", kl_weight, logp.shape[0], logp).detach().to(eff.dtype)
        kl_term = beta * w[:, None] * kl_tok
        kl_loss = reduce_masked(aggregation, kl_term, eff, totals)
        kl_unweighted = reduce_masked(aggregation, kl_tok, eff, totals)
        loss, total = loss + kl_loss, total + kl_term
        if stats:
            extra["kl_mean"] = kl_tok.detach().sum() / n_tok
    if entropy is not None and (stats or entropy_coeff > 0):
        ent = _entropy_tokens(entropy, eff)  # [N, T], 0 outside eff
        if stats:
            extra["entropy_mean"] = ent.detach().sum() / n_tok
        if token_keep is not None:  # the bonus acts where the surrogate does
            ent = ent * token_keep
        if entropy_coeff > 0:
            ent_bonus = entropy_coeff * reduce_masked(aggregation, ent, eff, totals)
            loss, total = loss - ent_bonus, total - entropy_coeff * ent
    if stats:
        extra.update(pg_loss=pg_loss, kl_loss=kl_loss)
        if keep is not None:
            extra["kept_frac"] = keep_t.to(eff.dtype).mean()
        sur_stats.update(_branch_stats(to_floats(extra)))  # one device sync for all of them
    return Objective(
        loss, pg_loss, kl_loss, ent_bonus, total, sur_stats, kl_unweighted,
        reward_tokens=per_token, kl_tokens=kl_tok, loss_mask=eff, aggregation=aggregation,
    )  # fmt: skip


def _masks(
    logp: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor | None,
    correction_keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``(keep [N] bool, mask [N, T] 0/1 float, eff [N, T] 0/1 float, valid tokens of eff)``:
    ``eff`` is the tokens that take part in the loss (valid, in a kept row, not rejected by
    the correction)."""
    n = logp.shape[0]
    keep_t = _per_sample("keep", keep, n, logp).bool()
    if not isinstance(mask, torch.Tensor) or mask.shape != logp.shape:
        raise ValueError(f"mask must have the shape of logp {tuple(logp.shape)}")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask_f, count = float_mask_count(mask, dtype)
    if keep is None and correction_keep is None:
        return keep_t, mask_f, mask_f, count
    eff = mask_f if keep is None else mask_f * keep_t.to(dtype)[:, None]  # [N, T] 0/1
    if correction_keep is not None:
        if not isinstance(correction_keep, torch.Tensor) or correction_keep.shape != logp.shape:
            raise ValueError(
                f"correction_keep must be [N, T]={tuple(logp.shape)} bool (Correction.keep)"
            )
        eff = eff * float_mask(correction_keep, dtype)
    return keep_t, mask_f, eff, float(eff.sum())


def _entropy_tokens(entropy: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` token entropies, 0 outside ``eff`` (zero-filled: NaN padding never leaks)."""
    if entropy.shape != eff.shape:
        raise ValueError(f"entropy must be [N, T]={tuple(eff.shape)}")
    return _zero_fill(entropy.to(eff.dtype), eff)


def _branch_stats(floats: dict[str, float]) -> dict[str, float]:
    """The objective's own statistics in their fixed order; an absent branch reads 0 and
    ``kept_frac`` 1 when no row was dropped."""
    out = {}
    if "entropy_mask_frac" in floats:
        out["entropy_mask_frac"] = floats["entropy_mask_frac"]
    for key in ("kl_mean", "entropy_mean", "pg_loss", "kl_loss"):
        out[key] = floats.get(key, 0.0)
    out["kept_frac"] = floats.get("kept_frac", 1.0)
    return out
