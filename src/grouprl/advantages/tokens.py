"""Token-level advantages ``[P, G, T]`` (ALGORITHMS.md §1, "Token-level advantages").

An outcome reward ``rewards [P, G]`` (NaN = missing) sits on each completion's last valid
token; ``token_rewards [P, G, T]`` adds dense per-token rewards (a KL folded into the
reward: :func:`kl_reward`). ``mask [P, G, T]`` marks the completion tokens (holes allowed:
tool-output tokens of a multi-turn rollout are 0 and are skipped by every statistic).

Token estimators (``TOKEN_ESTIMATORS``) take ``(rewards, valid, mask, token_rewards,
**params)`` and return :class:`~grouprl.types.Advantages` whose ``token_values [P, G, T]``
hold the per-token advantages (0 at masked tokens and NaN-reward samples) and whose
``values [P, G]`` are each sample's mean over its valid tokens (for the diagnostics).
"""

from __future__ import annotations

import numpy as np
import torch

from grouprl.advantages._groups import (
    _INT_OF,
    DEFAULT_TAU,
    group_count,
    group_moments,
    mask_mean,
    transposed,
    zero_where,
)
from grouprl.advantages.baseline import DEFAULT_DDOF
from grouprl.advantages.global_norm import EPS_MODES, whiten, whiten_kept_
from grouprl.types import Advantages

__all__ = [
    "OTB_EPS",
    "TOKEN_ESTIMATORS",
    "TOKEN_REWARDS_AS",
    "kl_reward",
    "optimal_token_baseline",
    "outcome_to_tokens",
    "reinforce_pp_baseline_tokens",
    "reinforce_pp_global_tokens",
    "reward_to_go",
    "sequence_mean",
    "tir_optimal_token_baseline",
]

TOKEN_REWARDS_AS = ("score", "return")
"""How dense token rewards meet a sequence-level estimator: ``"score"`` (verl: summed into
the sequence score before the estimator) or ``"return"`` (OpenRLHF, verl ReMax: the
estimator runs on the outcome reward, the dense rewards' reward-to-go is added per token)."""

OTB_EPS = 1e-8
"""verl ``compute_optimal_token_baseline_advantage``: ``epsilon=1e-8`` in the denominator."""


# --------------------------------------------------------------------------- building blocks
def outcome_to_tokens(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[P, G, T]``: each sample's reward on its last valid token, 0 elsewhere (NaN -> 0).

    OpenRLHF ``models/utils.py`` ``compute_reward`` (the reward at the EOS index) and verl's
    reward managers (the score at ``valid_response_length - 1``).
    """
    t = mask.shape[-1]
    small = torch.int16 if t < 2**15 else torch.long  # [OURS] 4x less memory to reduce
    pos = torch.arange(t, device=mask.device, dtype=small)
    last = torch.where(mask, pos, -1).amax(dim=-1).long()  # [P, G], -1 for an empty completion
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    hit = last >= 0
    src = torch.where(hit, rewards.nan_to_num(0.0), torch.zeros_like(rewards))
    return out.scatter_(-1, last.clamp_min(0)[..., None], src[..., None])


def reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0):
    """``[..., T]`` discounted reward-to-go over the valid tokens; 0 at masked tokens.

    G_t = Σ_{s ≥ t, s valid} γ^{n(t, s)} r_s with n(t, s) the valid tokens from t to s
    (verl ``compute_reinforce_plus_plus_outcome_advantage``: a masked token carries the
    running return through unchanged, so tool-output spans are skipped, not discounted).
    γ = 1 is a reverse cumulative sum; γ < 1 walks the T positions backwards (vectorised
    over the batch, as verl does): G_t = r_t + G_{t+1}·f_t with f_t = γ at a valid token and
    1 at a masked one (r_t = 0 there, so G_{t+1} passes through unchanged) [OURS: the same
    floats as verl's loop].
    """
    return _returns(
        zero_where(token_rewards.clone(memory_format=torch.contiguous_format), ~mask), mask, gamma
    )


def _returns(x: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """:func:`reward_to_go` of ``x [..., T]``, which is already 0 at the masked tokens.

    [OURS] The T − 1 steps run on the columns ``[T, N]`` (:func:`_returns_columns_`), each
    reading and writing whole contiguous rows instead of every T-th float of ``[..., T]``.
    """
    shape, t = x.shape, x.shape[-1]
    cols = transposed(x.reshape(-1, t))  # [T, N]
    _returns_columns_(cols, _keep_mask(_mask_columns(mask), cols.dtype), gamma)
    return transposed(cols).reshape(shape)


# --------------------------------------------------------------------------- token columns
def _mask_columns(mask: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` uint8 (0/1): the token mask ``[..., T]`` (bool) as columns, N samples.

    [OURS] On CPU numpy's byte transpose (torch's strided copy of a bool ``[N, T]`` took
    ~6x as long at N = 131,072, T = 16).
    """
    m = mask.reshape(-1, mask.shape[-1])
    if m.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(m.contiguous().numpy().view(np.uint8).T))
    return m.t().to(torch.uint8).contiguous()


def _keep_mask(kept: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kept [T, N]`` (0/1) as :func:`_zero_dropped_` applies it to a ``dtype`` tensor: the
    integer of ``dtype``'s width, −1 where kept (one bit-and zeroes the rest), or bool where
    the type has none (or off the CPU: ``masked_fill``)."""
    bits = _INT_OF.get(dtype)
    if bits is None or kept.device.type != "cpu":
        return kept.to(torch.bool)
    return kept.to(bits).neg_()


def _zero_dropped_(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x [T, N]`` with +0.0 wherever :func:`_keep_mask` ``keep`` drops, in place."""
    if keep.dtype == torch.bool:
        return x.masked_fill_(~keep, 0.0)
    x.view(keep.dtype).bitwise_and_(keep)
    return x


def _last_token(mt: torch.Tensor) -> torch.Tensor:
    """``[N]`` long: each sample's last valid token in the mask columns ``mt [T, N]`` (0/1),
    −1 for an empty completion. [OURS] The max of ``mask·(t + 1)`` over the T rows, in the
    narrowest integer that holds T (a row reduction of ``[N, T]`` took ~10x)."""
    t = mt.shape[0]
    small = torch.uint8 if t < 255 else torch.int16 if t < 2**15 else torch.long
    pos = torch.arange(1, t + 1, dtype=small, device=mt.device)[:, None]  # [T, 1]
    return (mt.to(small) * pos).amax(0).long() - 1


def _returns_columns_(cols: torch.Tensor, on: torch.Tensor, gamma: float) -> torch.Tensor:
    """:func:`reward_to_go` on the columns ``cols [T, N]`` (0 at the masked tokens), in
    place; ``on``: the token mask as :func:`_keep_mask` gives it.

    G_t = x_t + G_{t+1}·f_t, f_t = γ at a valid token and 1 at a masked one, then 0 at the
    masked tokens: verl's loop, the same floats (x·1 is exact; γ = 1 adds without it).
    """
    t = cols.shape[0]
    f = None
    if gamma != 1.0 and t > 1:
        if on.dtype == torch.bool:
            f = torch.ones_like(cols).masked_fill_(on, gamma)  # [T, N]
        else:  # 1.0 where masked, γ where valid: the bits of one, xor (γ ^ one) where valid
            one, g = (int(torch.tensor(v, dtype=cols.dtype).view(on.dtype)) for v in (1.0, gamma))
            f = on.clone().bitwise_and_(g ^ one).bitwise_xor_(one).view(cols.dtype)
    tmp = torch.empty_like(cols[0])  # [N]
    for s in range(t - 2, -1, -1):
        cols[s].add_(cols[s + 1] if f is None else torch.mul(cols[s + 1], f[s], out=tmp))
    return _zero_dropped_(cols, on)


def _columns_result(cols, kept, rewards, valid, scale, collapsed, **stats) -> Advantages:
    """:func:`_token_result` of the token values as columns ``cols [T, N]`` (0 where
    ``kept [T, N]``, 0/1, is 0): each sample's mean over its kept tokens, and the values
    back in ``[P, G, T]``."""
    p, g = rewards.shape
    count = kept.sum(0).clamp_min(1).to(cols.dtype)  # [N]
    live = ~collapsed if valid is None else valid.any(dim=1) & ~collapsed
    return Advantages(
        values=(cols.sum(0) / count).reshape(p, g),
        keep=torch.ones(p, dtype=torch.bool, device=rewards.device),
        kl_weight=torch.ones(p, dtype=rewards.dtype, device=rewards.device),
        scale=scale,
        stats={"collapsed_frac": mask_mean(collapsed), **stats},
        updated=live,
        token_values=transposed(cols).reshape(p, g, cols.shape[0]),
    )


def sequence_mean(token_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[P, G]`` mean of each sample's token values over its valid tokens (0 if none)."""
    m = mask.to(token_values.dtype)
    return (token_values * m).sum(-1) / m.sum(-1).clamp_min(1)


def kl_reward(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, float]:
    """``(token_rewards [..., T], current_kl)``: the KL to the reference as a reward penalty.

    token_rewards = −coef·KL_t·mask, KL_t the per-token estimator of ``grouprl.losses.kl``
    (``"k1"`` = verl ``kl_penalty="kl"``, the default of verl ``use_kl_in_reward`` and of
    OpenRLHF; ``"k2"`` = verl ``"mse"``; ``"k3"`` = verl ``"low_var_kl"``), computed on
    the behaviour policy's log-probabilities ``logp`` (verl ``apply_kl_penalty`` uses
    ``old_log_probs``; OpenRLHF ``compute_approx_kl`` the rollout's). ``current_kl`` is
    what verl feeds its controller (ray_trainer.py ``apply_kl_penalty``): the batch mean of
    each sequence's token-mean KL. No gradient flows through either. The mask *selects*
    (``torch.where``): a NaN or infinite log-probability at a padded token gives 0 there,
    where verl's ``kld * response_mask`` gives NaN [OURS; equal to verl wherever it is finite].
    """
    from grouprl.losses import kl as kl_fn  # losses never import advantages: no cycle

    if not torch.isfinite(torch.as_tensor(coef)):
        raise ValueError(f"coef must be finite, got {coef!r}")
    m = mask.to(logp.dtype)
    with torch.no_grad():
        k = torch.where(m > 0, kl_fn(estimator, logp.detach(), ref_logp.detach()), 0.0)  # [..., T]
        seq = k.sum(-1) / (m.sum(-1) + 1e-8)  # verl masked_mean(axis=-1)
        current = float(seq.mean()) if seq.numel() else 0.0
    return -float(coef) * k, current


def _token_result(token_values, mask, sample_valid, rewards, scale, collapsed, **stats):
    p = rewards.shape[0]
    keep_tok = mask & sample_valid[..., None]
    token_values = zero_where(token_values.clone(memory_format=torch.contiguous_format), ~keep_tok)
    live = sample_valid.any(dim=1) & ~collapsed
    count = keep_tok.sum(-1).clamp_min(1).to(token_values.dtype)  # [P, G]
    return Advantages(
        values=token_values.sum(-1) / count,  # sequence_mean: the masked terms are 0 already
        keep=torch.ones(p, dtype=torch.bool, device=rewards.device),
        kl_weight=torch.ones(p, dtype=rewards.dtype, device=rewards.device),
        scale=scale,
        stats={"collapsed_frac": mask_mean(collapsed), **stats},
        updated=live,
        token_values=token_values,
    )


def _sample_valid(rewards, valid):
    return torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid


def _check_eps_mode(eps_mode: str) -> None:
    if eps_mode not in EPS_MODES:
        raise ValueError(f"unknown eps_mode {eps_mode!r}; valid: {', '.join(EPS_MODES)}")


# --------------------------------------------------------------------------- REINFORCE++
def reinforce_pp_global_tokens(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    mask: torch.Tensor,
    token_rewards: torch.Tensor,
    *,
    gamma: float = 1.0,
    eps_mode: str = "var",
    eps: float = 1e-8,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """REINFORCE++ on tokens: returns of outcome + dense rewards, whitened over the batch.

    The discounted returns are whitened over every valid token of the batch.

    REINFORCE++ (arXiv 2501.03262 §3: A_t = r − β Σ_{s ≥ t} KL_s, then global
    normalisation); verl ``reinforce_plus_plus`` (core_algos.py: returns with ``gamma``,
    ``masked_whiten``: ``eps_mode="var"``, eps 1e-8, ddof 1 — the defaults here); OpenRLHF
    0.11 ``reinforce`` (``get_cumulative_returns``, then ``eps_mode="var_clamp"``, ddof 0).
    No group baseline: nothing is zeroed for a collapsed group. scale = the batch s.
    """
    _check_eps_mode(eps_mode)
    p, g, t = mask.shape
    n = p * g
    mt = _mask_columns(mask)  # [T, N] 0/1
    cols = transposed(token_rewards.reshape(n, t))  # [T, N]: returns, then advantages
    on = _keep_mask(mt, cols.dtype)
    _zero_dropped_(cols, on)
    last = _last_token(mt)  # [N] the outcome reward's token
    src = zero_where(rewards.reshape(n).nan_to_num(0.0), last < 0)  # [N]
    cols.scatter_add_(0, last.clamp_min(0)[None], src[None].to(cols.dtype))
    _returns_columns_(cols, on, gamma)
    kept, keep = mt, on
    if valid is not None:  # the tokens of a NaN-reward sample leave the statistics
        kept = mt & valid.reshape(1, n).to(torch.uint8)
        keep = _keep_mask(kept, cols.dtype)
        _zero_dropped_(cols, keep)
    count = kept.sum().to(cols.dtype)  # [] exact
    cols, mu, s = whiten_kept_(
        cols, lambda x: _zero_dropped_(x, keep), count, ddof, eps, eps_mode
    )  # over the kept tokens, in place
    m = group_moments(rewards, valid, ddof, tau)
    none = torch.zeros(p, dtype=torch.bool, device=rewards.device)
    out = _columns_result(
        cols, kept, rewards, valid, s.expand(p).clone(), none, batch_mean=float(mu)
    )
    out.stats["collapsed_frac"] = mask_mean(m.collapsed)
    return out


def reinforce_pp_baseline_tokens(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    mask: torch.Tensor,
    token_rewards: torch.Tensor,
    *,
    token_rewards_as: str = "score",
    eps_mode: str = "var",
    eps: float = 1e-8,
    zero_collapsed: bool = True,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """REINFORCE++-baseline on tokens: group-centred rewards + dense rewards, then whitened.

    The whitening runs over every valid token of the batch.

    Two readings of where the dense (KL) rewards enter, both peers': ``"score"`` (verl
    ``reinforce_plus_plus_baseline``: u = score − mean_q score with score = r + Σ_t dense_t,
    the same u on every token); ``"return"`` (OpenRLHF 0.11 ``reinforce_baseline``: u_t =
    (r − mean_q r) + Σ_{s ≥ t} dense_s, γ = 1). Then token whitening (verl ``eps_mode="var"``
    eps 1e-8 ddof 1 = the defaults; OpenRLHF ``"var_clamp"``, ddof 0). ``zero_collapsed``
    [OURS]: a group whose scores (``"score"``) or outcome rewards (``"return"``) have
    σ_q < tau gets 0 after whitening (the peers give it the whitening shift).
    """
    _check_eps_mode(eps_mode)
    if token_rewards_as not in TOKEN_REWARDS_AS:
        raise ValueError(
            f"unknown token_rewards_as {token_rewards_as!r}; valid: {', '.join(TOKEN_REWARDS_AS)}"
        )
    sv = _sample_valid(rewards, valid)
    dense = token_rewards * mask
    if token_rewards_as == "score":
        score = rewards + dense.sum(-1)  # NaN stays NaN
        m = group_moments(score, valid, ddof, tau)
        u = m.dev[..., None].expand(mask.shape).clone()  # [P, G, T]
    else:
        m = group_moments(rewards, valid, ddof, tau)
        u = m.dev[..., None] + reward_to_go(dense, mask)
    keep_tok = mask & sv[..., None]
    values, mu, s = whiten(u, keep_tok, ddof=ddof, eps=eps, eps_mode=eps_mode)
    collapsed = m.collapsed if zero_collapsed else torch.zeros_like(m.collapsed)
    values = values.masked_fill(collapsed[:, None, None], 0.0)
    p = rewards.shape[0]
    out = _token_result(
        values, mask, sv, rewards, s.expand(p).clone(), collapsed, batch_mean=float(mu)
    )
    out.stats["collapsed_frac"] = mask_mean(m.collapsed)
    return out


# --------------------------------------------------------------------------- optimal token baseline
def _compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [..., T], compact mask)``: gather order putting each row's valid tokens first."""
    t = mask.shape[-1]
    pos = torch.arange(t, device=mask.device).expand(mask.shape)
    key = torch.where(mask, pos, pos + t)  # valid tokens first, each kept in order
    order = key.argsort(dim=-1)
    n = mask.sum(-1, keepdim=True)  # [..., 1]
    return order, pos < n


def _zero_tail(baseline, lengths, sv):
    """verl ``handle_zero_tail``: when one trajectory of a group is strictly the longest, its
    baseline beyond the second-longest length is 0 (no other trajectory estimates it)."""
    g, t = lengths.shape[1], baseline.shape[-1]
    if g < 2:
        return baseline
    lens = torch.where(sv, lengths, torch.full_like(lengths, -1))  # [P, G]
    top, idx = torch.topk(lens, 2, dim=1)  # [P, 2]
    unique = (lens == top[:, :1]).sum(1) == 1  # [P]
    unique = unique & (top[:, 0] > top[:, 1]) & (top[:, 1] >= 0)
    pos = torch.arange(t, device=baseline.device)
    tail = pos[None, :] >= top[:, 1:2]  # [P, T]
    hit = torch.zeros_like(baseline, dtype=torch.bool)  # [P, G, T]
    hit.scatter_(1, idx[:, :1, None].expand(-1, 1, t), (tail & unique[:, None])[:, None, :])
    return baseline.masked_fill(hit, 0.0)


def _otb(
    rewards,
    valid,
    mask,
    token_rewards,
    old_logp,
    sum_pi_squared,
    is_weights,
    handle_zero_tail,
    eps,
    zero_collapsed,
    ddof,
    tau,
):
    if old_logp is None or sum_pi_squared is None:
        raise ValueError(
            "the optimal token baseline needs old_logp [P, G, T] (behaviour log-probs of the "
            "sampled tokens) and sum_pi_squared [P, G, T] (Σ_v π(v)² at each position; verl "
            "actor.calculate_sum_pi_squared)"
        )
    for name, x in (
        ("old_logp", old_logp),
        ("sum_pi_squared", sum_pi_squared),
        ("is_weights", is_weights),
    ):
        if x is not None and tuple(x.shape) != tuple(mask.shape):
            raise ValueError(
                f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(x.shape)}"
            )
    sv = _sample_valid(rewards, valid)
    keep_tok = mask & sv[..., None]  # NaN-reward samples leave the group
    m_tok = keep_tok.to(rewards.dtype)
    tok = outcome_to_tokens(rewards, mask) + token_rewards * mask
    returns = reward_to_go(tok, mask)  # [P, G, T]
    w = 1.0 - 2.0 * old_logp.to(rewards.dtype).exp() + sum_pi_squared.to(rewards.dtype)
    if is_weights is not None:
        w = w * is_weights.to(rewards.dtype).square()
    wc = (w * m_tok).cumsum(-1)  # W_t = Σ_{j ≤ t} w_j  [P, G, T]
    num = (returns * wc * m_tok).sum(1)  # [P, T]
    den = (wc * m_tok).sum(1) + eps
    baseline = (num / den)[:, None, :].expand(mask.shape)  # [P, G, T]
    if handle_zero_tail:
        baseline = _zero_tail(baseline, keep_tok.sum(-1), sv)
    score = torch.where(sv, (tok * mask).sum(-1), torch.full_like(rewards, float("nan")))
    m = group_moments(score, None if valid is None else sv, ddof, tau)
    small = group_count(None if valid is None else sv, rewards) < 2  # no baseline: 0 [§0]
    dead = (m.collapsed if zero_collapsed else small) | small
    values = (returns - baseline).masked_fill(dead[:, None, None], 0.0)
    return values, sv, dead, m.collapsed


def optimal_token_baseline(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    mask: torch.Tensor,
    token_rewards: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    eps: float = OTB_EPS,
    zero_collapsed: bool = True,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """Optimal token baseline: A_t = G_t − B_t, B_t = Σ_i G_t^i W_t^i / (Σ_i W_t^i + eps).

    verl ``optimal_token_baseline`` (core_algos.py ``compute_optimal_token_baseline_advantage``;
    docs/algo/otb.md): G_t the reward-to-go, W_t = Σ_{j ≤ t} (1 − 2π_j + Σ_v π_v²)_j the
    cumulative logit-gradient energy (π_j = exp(old_logp_j) the sampled token's
    probability, Σπ² from the logits), both over the group's trajectories at the same
    *position* t; ``is_weights`` (rollout IS weights ρ̄) scale w by ρ̄²;
    ``handle_zero_tail`` zeroes the baseline of a strictly-longest trajectory past the
    second-longest length (verl default True). Deviations [OURS], ALGORITHMS.md §0: a group
    with < 2 valid samples gets 0 (verl: its return); ``zero_collapsed``: a group whose
    sequence scores have σ_q < tau gets 0 (verl: the zero tail of an all-correct group keeps
    +r). NaN-reward samples leave their group. scale = 1.
    """
    values, sv, dead, collapsed = _otb(
        rewards,
        valid,
        mask,
        token_rewards,
        old_logp,
        sum_pi_squared,
        is_weights,
        handle_zero_tail,
        eps,
        zero_collapsed,
        ddof,
        tau,
    )
    out = _token_result(values, mask, sv, rewards, torch.ones_like(rewards[:, 0]), dead)
    out.stats["collapsed_frac"] = mask_mean(collapsed)
    return out


def tir_optimal_token_baseline(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    mask: torch.Tensor,
    token_rewards: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    eps: float = OTB_EPS,
    zero_collapsed: bool = True,
    ddof: int = DEFAULT_DDOF,
    tau: float = DEFAULT_TAU,
) -> Advantages:
    """The optimal token baseline aligned by *valid-token index* (multi-turn tool use).

    verl ``tir_optimal_token_baseline`` (core_algos.py
    ``compute_multi_turn_optimal_token_baseline_advantage``): each trajectory's valid tokens
    are packed to the left (tool-output holes in the mask removed), the baseline of
    :func:`optimal_token_baseline` is taken across the group at the k-th *generated* token,
    and the advantages are scattered back. With masks that are a prefix (no holes) it
    equals ``optimal_token_baseline``. Same parameters and deviations.
    """
    order, cmask = _compact(mask, mask)

    def pack(x):
        return None if x is None else x.gather(-1, order)

    vals, sv, dead, collapsed = _otb(
        rewards,
        valid,
        cmask,
        pack(token_rewards * mask),
        pack(old_logp),
        pack(sum_pi_squared),
        pack(is_weights),
        handle_zero_tail,
        eps,
        zero_collapsed,
        ddof,
        tau,
    )
    values = torch.zeros_like(vals).scatter_(-1, order, vals)  # back to the original positions
    out = _token_result(values, mask, sv, rewards, torch.ones_like(rewards[:, 0]), dead)
    out.stats["collapsed_frac"] = mask_mean(collapsed)
    return out


TOKEN_ESTIMATORS = {
    "reinforce_pp_global": reinforce_pp_global_tokens,
    "reinforce_pp_baseline": reinforce_pp_baseline_tokens,
    "optimal_token_baseline": optimal_token_baseline,
    "tir_optimal_token_baseline": tir_optimal_token_baseline,
}
"""Token-level estimator name -> ``fn(rewards [P, G], valid, mask [P, G, T] bool,
token_rewards [P, G, T], **params) -> Advantages`` with ``token_values [P, G, T]``.
Every name in :data:`grouprl.advantages.ESTIMATORS` also runs token-level through
:func:`grouprl.advantages.compute_tokens` (broadcast, ``token_rewards_as``)."""
