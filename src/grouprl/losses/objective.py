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

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from grouprl.losses.aggregation import StepTotals, aggregate
from grouprl.losses.kl import kl as kl_fn
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
    if not bool((torch.isfinite(w) & (w >= 0)).all()):
        raise ValueError("correction_weight must be finite and >= 0 (an importance weight)")
    return w if w.dim() == 2 else w[:, None]


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
    correction_weight: torch.Tensor | None = None,
    correction_keep: torch.Tensor | None = None,
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
        correction_weight: ``[N, T]`` (or ``[N]``) rollout-correction weight
            (:class:`grouprl.losses.correction.Correction` ``.weight``): a detached factor on
            the surrogate's per-token loss only, as verl (``pg_losses * rollout_is_weights``)
            and TRL (``per_token_loss * importance_sampling_ratio`` before the KL term) apply
            it; a zero weight leaves the token in the normaliser. Finite and >= 0.
        correction_keep: ``[N, T]`` bool (``Correction.keep``): False rejects the token from
            every branch and, without ``totals``, from the normaliser (verl's rejection
            sampling rewrites ``response_mask``); with ``totals``, build them from
            ``Correction.loss_mask(mask)`` so that the step's counts leave it out too.

    A micro-batch in which every row has ``keep = False`` returns a zero loss that is still
    connected to ``logp`` (``backward()`` works and adds nothing).
    """
    if beta < 0 or entropy_coeff < 0:
        raise ValueError(f"beta and entropy_coeff must be >= 0, got {beta} and {entropy_coeff}")
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError("logp must be a [N, T] tensor")
    n = logp.shape[0]
    keep_t = _per_sample("keep", keep, n, logp).bool()
    if not isinstance(mask, torch.Tensor) or mask.shape != logp.shape:
        raise ValueError(f"mask must have the shape of logp {tuple(logp.shape)}")
    eff = mask.bool() & keep_t[:, None]  # [N, T]
    if correction_keep is not None:
        if not isinstance(correction_keep, torch.Tensor) or correction_keep.shape != logp.shape:
            raise ValueError(
                f"correction_keep must be [N, T]={tuple(logp.shape)} bool (Correction.keep)"
            )
        eff = eff & correction_keep.bool()
    corr_w = _correction_weight(correction_weight, logp)
    any_kept = bool(eff.any())
    sur_mask = eff if any_kept else mask  # validate the raw inputs when nothing is kept
    per_token, stats = surrogate_fn(
        surrogate, logp, old_logp, adv, sur_mask, **dict(surrogate_params or {})
    )
    eff_f = eff.to(per_token.dtype)
    zero = logp.sum() * 0.0  # keeps the graph when nothing contributes
    if not any_kept:
        stats = {key: 0.0 for key in stats}
        stats.update(pg_loss=0.0, kl_loss=0.0, kl_mean=0.0, entropy_mean=0.0, kept_frac=0.0)
        return Objective(zero, zero, zero, zero, per_token * 0.0, stats, zero)
    if corr_w is not None:
        per_token = per_token * corr_w.to(per_token.dtype)  # weights the reward branch only
    total = per_token  # already 0 outside eff (the surrogate's mask)
    pg_loss = aggregate(aggregation, total, eff_f, totals)
    kl_loss = kl_unweighted = zero
    n_tok = eff_f.sum()
    extra = {"kl_mean": zero.detach(), "entropy_mean": zero.detach()}
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs)")
        w = _per_sample("kl_weight", kl_weight, n, logp).detach().to(per_token.dtype)
        dt, dt_dev = per_token.dtype, per_token.device  # float32 at least (check_inputs)
        safe_logp = torch.where(eff, logp.to(dt), torch.zeros((), dtype=dt, device=dt_dev))
        safe_ref = torch.where(eff, ref_logp.to(dt), torch.zeros((), dtype=dt, device=dt_dev))
        kl_tok = kl_fn(kl, safe_logp, safe_ref) * eff_f  # [N, T]
        kl_term = beta * w[:, None] * kl_tok
        kl_loss = aggregate(aggregation, kl_term, eff_f, totals)
        kl_unweighted = aggregate(aggregation, kl_tok, eff_f, totals)
        total = total + kl_term
        extra["kl_mean"] = kl_tok.detach().sum() / n_tok
    ent_bonus = zero
    if entropy is not None:
        if entropy.shape != logp.shape:
            raise ValueError(f"entropy must be [N, T]={tuple(logp.shape)}")
        ent = torch.where(
            eff, entropy.to(eff_f.dtype), torch.zeros((), dtype=eff_f.dtype, device=eff_f.device)
        )
        extra["entropy_mean"] = ent.detach().sum() / n_tok
        if entropy_coeff > 0:
            ent_bonus = entropy_coeff * aggregate(aggregation, ent, eff_f, totals)
            total = total - entropy_coeff * ent
    extra.update(pg_loss=pg_loss, kl_loss=kl_loss, kept_frac=keep_t.to(n_tok.dtype).mean())
    stats.update(to_floats(extra))  # one device sync for all of them
    loss = pg_loss + kl_loss - ent_bonus
    return Objective(loss, pg_loss, kl_loss, ent_bonus, total, stats, kl_unweighted)
