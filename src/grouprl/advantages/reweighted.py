"""Group estimators that re-weight samples or the batch: grpo_passk, gpg, opo, remax
(ALGORITHMS.md §1, "Methods the peers ship").

Same contract as ``baseline.py``: ``rewards [P, G]`` (NaN = missing) and its validity mask
(None = all valid) in, :class:`~grouprl.types.Advantages` out; NaN entries get 0 and are
left out of every statistic. Where a peer gives a singleton group its raw reward (verl's
``mean = 0`` rule) these give 0, like every grouprl estimator (ALGORITHMS.md §0).
"""

from __future__ import annotations

import torch

from grouprl.advantages._groups import (
    _INT_OF,
    DEFAULT_TAU,
    SORT_NETWORK_MAX,
    check_positive,
    column_range,
    column_std,
    group_count,
    group_moments,
    mask_mean,
    scale_dev,
    spread_collapsed,
    top_two,
    transposed,
    wrap_advantages,
    zero_where,
)
from grouprl.advantages.baseline import DEFAULT_DDOF, GRPO_EPS
from grouprl.types import Advantages

__all__ = ["GPG_ALPHA", "gpg", "grpo_passk", "opo", "remax"]


def grpo_passk(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    norm_by_std: bool = True,
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """Pass@k advantage: only the group's best sample gets (r_max − r_2nd)/(σ_q + eps).

    verl ``grpo_passk`` (trainer/ppo/core_algos.py ``compute_grpo_passk_outcome_advantage``,
    after Tang et al., arXiv 2503.19595, the pass@k objective with k = group size): every
    other sample gets 0; ``norm_by_std`` is verl's ``norm_adv_by_std_in_grpo`` (False: the
    raw gap, scale 1). A tie at the top gives 0 to everyone. Order statistics over the
    valid rewards only; a collapsed group (σ_q < tau, or < 2 valid; verl raises on a
    singleton) gets 0. scale = σ_q + eps (or 1).
    """
    g = rewards.shape[1]
    if valid is None and 2 <= g <= SORT_NETWORK_MAX and rewards.dtype in _INT_OF:
        if rewards.requires_grad:  # the columns are written in place: no graph through them
            rewards = rewards.detach()
        return _passk_columns(rewards, norm_by_std, eps, ddof, tau)
    m = group_moments(rewards, valid, ddof, tau)
    scale = m.std + eps if norm_by_std else torch.ones_like(m.std)
    if rewards.shape[1] < 2:  # no second best: every group is collapsed
        return wrap_advantages(torch.zeros_like(rewards), valid, m.collapsed, scale, zeroed=True)
    keyed = rewards if valid is None else rewards.masked_fill(~valid, float("-inf"))
    # the best and the second best by two column reductions instead of torch.topk(k=2), which
    # took 57 % of this function's time (torch.profiler, 131,072 × 8) and 2.1x the time of these three
    # passes at P = 131,072, G = 8 [OURS]; a tie at the top gives a gap of 0 either way, and
    # a unique best is the same sample
    best, idx = keyed.max(dim=1, keepdim=True)  # [P, 1] each
    second = keyed.scatter(1, idx, float("-inf")).amax(dim=1)  # [P]
    gap = (best[:, 0] - second).nan_to_num(0.0, posinf=0.0, neginf=0.0)  # [P]
    gap = (gap / scale).masked_fill(m.collapsed, 0.0)
    values = torch.zeros_like(rewards).scatter_(1, idx, gap[:, None])  # [P, G]
    return wrap_advantages(values, valid, m.collapsed, scale, zeroed=True)


def _passk_columns(rewards, norm_by_std, eps, ddof, tau) -> Advantages:
    """:func:`grpo_passk` of a batch without NaN, 2 <= G <= 32, on its G columns ``[P]``.

    [OURS] The best and second best by :func:`top_two`, the collapse flag exactly as
    :func:`group_moments` sets it (:func:`spread_collapsed`), σ_q by :func:`column_std`
    (within a few ulps of the moments'), and the gap written to the column that equals the
    best: ``r − best`` is +0 exactly there (a unique best; with a tie the gap is 0 for
    every sample anyway), its sign bit a mask. No ``[P, G]`` broadcast, no scatter.
    """
    p, g = rewards.shape
    bits = _INT_OF[rewards.dtype]
    sign = torch.finfo(rewards.dtype).bits - 1
    cols = transposed(rewards).unbind(0)  # G x [P]
    second, first = top_two(cols)  # [P] each
    lo, _ = column_range(cols)
    collapsed = spread_collapsed(rewards, lo, first, ddof, tau)  # [P]
    scale = column_std(cols, ddof).add_(eps) if norm_by_std else torch.ones_like(first)
    gap = zero_where(torch.sub(first, second).div_(scale), collapsed)  # [P] >= 0
    out = torch.empty((g, p), dtype=rewards.dtype, device=rewards.device)  # [G, P]
    for k, c in enumerate(cols):  # -1 where c is the best (c − best = +0), else 0
        hit = torch.sub(c, first, out=out[k]).view(bits).bitwise_right_shift_(sign)
        hit.bitwise_not_().bitwise_and_(gap.view(bits))
    return wrap_advantages(transposed(out), None, collapsed, scale, zeroed=True)


GPG_ALPHA = ("paper", "verl")
"""GPG's batch correction α: the paper's B/(B − M) or verl's B / #(r ≠ 0) (or a number)."""


def _gpg_alpha(alpha, rewards, valid, m) -> torch.Tensor:
    counts = group_count(valid, rewards)  # [P]
    b = counts.sum().to(rewards.dtype)  # valid samples in the batch
    if alpha == "paper":
        invalid = (counts * m.collapsed).sum().to(rewards.dtype)  # samples with A = 0
        return b / (b - invalid).clamp_min(1)
    if alpha == "verl":
        r0 = rewards if valid is None else rewards.nan_to_num(0.0)
        return b / torch.count_nonzero(r0).to(rewards.dtype).clamp_min(1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(
            f"alpha must be one of {', '.join(GPG_ALPHA)} or a positive number, got {alpha!r}"
        )
    check_positive("alpha", float(alpha))
    return torch.tensor(float(alpha), dtype=rewards.dtype, device=rewards.device)


def gpg(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    alpha: str | float = "paper",
    f_norm: str | float = 1.0,
    eps: float = GRPO_EPS,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """GPG advantage: α·(r_i − r̄_q)/F_norm with a batch correction α ≥ 1.

    GPG (Chu et al., arXiv 2504.02546; AMAP-ML/GPG README table): F_norm = 1 (or the
    group std: ``f_norm="std"`` gives (r − r̄_q)/(σ_q + eps)), α = B/(B − M) with B the
    batch's samples and M the "invalid" ones, whose advantage is 0 (here: the valid samples
    of collapsed groups) — ``alpha="paper"``. verl ``gpg`` (core_algos.py
    ``compute_gpg_outcome_advantage``) computes α = B / count_nonzero(r): the samples with a
    *non-zero reward*, which equals the paper's only by accident (``alpha="verl"``); a number
    fixes α (the paper's α = 1 ablation). GPG's loss (−A·log π, no clip) is a surrogate.
    Collapsed groups get 0. scale = F_norm/α.
    """
    if isinstance(f_norm, str):
        if f_norm != "std":
            raise ValueError(f"f_norm must be a positive number or 'std', got {f_norm!r}")
    else:
        check_positive("f_norm", f_norm)
    m = group_moments(rewards, valid, ddof, tau)
    a = _gpg_alpha(alpha, rewards, valid, m)  # []
    norm = m.std + eps if f_norm == "std" else torch.full_like(m.std, float(f_norm))  # [P]
    values = scale_dev(m, a / norm)  # [P, G]
    return wrap_advantages(values, valid, m.collapsed, norm / a, zeroed=True, gpg_alpha=float(a))


def opo(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    lengths: torch.Tensor | None = None,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """OPO: r_i − b_q with the length-weighted baseline b_q = Σ_j L_j r_j / Σ_j L_j.

    OPO (Hao et al., arXiv 2505.23585 §3): the variance-optimal baseline E[‖∇log π‖² r] /
    E[‖∇log π‖²] with ‖∇log π(y)‖² ∝ |y|, no std division; verl ``opo`` (core_algos.py
    ``compute_opo_outcome_advantage``, lengths = ``response_mask.sum(-1)``). Needs
    ``lengths [P, G]`` (completion tokens). A group whose valid lengths sum to 0 falls back
    to the plain mean [OURS]. Collapsed groups get 0. scale = 1.
    """
    if lengths is None:
        raise ValueError("opo weights the baseline by completion length: pass lengths=[P, G]")
    m = group_moments(rewards, valid, ddof, tau)
    w = lengths.to(rewards.dtype)
    if valid is not None:
        w = w * valid.to(rewards.dtype)
    wsum = w.sum(dim=1)  # [P]
    # b_q − r̄_q = Σ_j w_j (r_j − r̄_q) / Σ_j w_j, so A = dev − that shift (dev is 0 at NaN)
    shift = (w * m.dev).sum(dim=1) / wsum.clamp_min(torch.finfo(rewards.dtype).tiny)  # [P]
    shift = shift.masked_fill(wsum <= 0, 0.0)
    values = m.dev.sub_(shift[:, None])
    if valid is not None:
        values = values.masked_fill_(~valid, 0.0)
    values = values.masked_fill_(m.collapsed[:, None], 0.0)
    return wrap_advantages(values, valid, m.collapsed, torch.ones_like(m.mean), zeroed=True)


def remax(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    baseline: torch.Tensor | None = None,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """ReMax: r_i − b_p, b_p the reward of the prompt's greedy completion.

    ReMax (Li et al., arXiv 2310.10505, Algorithm 1): REINFORCE with the greedy
    (argmax-decoded) response's reward as the baseline; verl ``remax`` (core_algos.py
    ``compute_remax_outcome_advantage``; ray_trainer.py generates one greedy response per
    prompt, ``__do_sample__ = False``). Needs ``baseline [P]``; a NaN baseline (the greedy
    completion could not be scored) gives its group 0 [OURS], counted in
    ``stats["remax/baseline_nan_frac"]``. No group statistics: a group whose samples all
    equal the greedy reward gets 0 because r − b = 0, not by a collapse rule; G = 1 works.
    ``ddof`` / ``tau`` only enter ``stats["collapsed_frac"]``. scale = 1.
    """
    if baseline is None:
        raise ValueError("remax needs baseline=[P]: the reward of each prompt's greedy completion")
    m = group_moments(rewards, valid, ddof, tau)
    b = baseline.to(rewards.dtype)  # [P]
    no_base = torch.isnan(b)
    values = rewards - b.nan_to_num(0.0)[:, None]  # [P, G]
    dead = no_base[:, None] if valid is None else (~valid) | no_base[:, None]
    values = values.masked_fill_(dead, 0.0)
    p = rewards.shape[0]
    return Advantages(
        values=values,
        keep=torch.ones(p, dtype=torch.bool, device=rewards.device),
        kl_weight=torch.ones_like(m.mean),
        scale=torch.ones_like(m.mean),
        stats={
            "collapsed_frac": mask_mean(m.collapsed),
            "remax/baseline_nan_frac": mask_mean(no_base),
        },
        updated=(values != 0).any(dim=1),
    )
