"""Clip-Cov and KL-Cov: restrict the update of the tokens whose log-probability co-varies most
with their advantage, the tokens that drive entropy down (ALGORITHMS.md §3).

Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv 2505.22617, §5): the entropy change of a policy-gradient step is driven by
``Cov(log π(y), A(y))``; Clip-Cov drops the gradient of a few randomly chosen high-covariance
tokens, KL-Cov adds a |log ρ| penalty on the top-k covariance tokens. verl implements both
(``core_algos.py:1743-1925``); the surrogates below equal verl's on the same batch.

**Which batch the covariance spans.** verl computes the covariance, the number of tokens to
select and the selection inside its policy-loss call, i.e. over one *micro-batch* on one
data-parallel rank (``dp_actor.update_policy`` calls the loss per micro-batch). That is the
default here (``selected=None``): exact for one micro-batch per step, micro-batch-local
otherwise. For a selection over the whole optimizer step, compute it once with
:func:`clip_cov_select` / :func:`kl_cov_select` on the step's micro-batches (they take lists,
and need the current policy's log-probabilities of every micro-batch before the first
backward, e.g. from a no-grad forward) and pass each micro-batch its ``selected`` mask: the
micro-batch losses (with the step's :class:`~grouprl.losses.StepTotals`) then sum to the
one-batch loss [OURS].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grouprl.losses.ratio import (
    apply_gate,
    autograd_inputs,
    autograd_masked,
    check_eps,
    check_inputs,
    clamp_log_ratio,
    float_mask,
    linearized,
    masked_log_ratio,
    masked_mean,
    pessimistic_bounds,
    ratio_stats,
    valid_sum,
)
from grouprl.types import to_floats

__all__ = [
    "clip_cov",
    "clip_cov_autograd",
    "clip_cov_select",
    "kl_cov",
    "kl_cov_autograd",
    "kl_cov_select",
    "token_covariance",
]

Batch = torch.Tensor | Sequence[torch.Tensor]


def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]``: each valid token's term of Cov(log π, A), centred over the batch's valid tokens.

    ``(A_it − mean A)·(log π_it − mean log π)``, both means over the valid tokens (a per-sequence
    advantage counts once per token), no gradient (verl ``compute_policy_loss_clip_cov`` /
    ``_kl_cov``). 0 at masked positions.
    """
    m = mask.to(logp.dtype)
    a = adv.expand_as(logp).detach()
    lp = logp.detach()
    cov = (a - masked_mean(a, m)) * (lp - masked_mean(lp, m))
    return cov * m


def _stack(batch: Batch, width: int) -> torch.Tensor:
    """One ``[N, T]`` tensor from a tensor or a list of micro-batch tensors (right-padded)."""
    if isinstance(batch, torch.Tensor):
        return batch
    rows = [t if t.dim() == 2 else t[:, None].expand(-1, width) for t in batch]
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in rows])


def _over_step(masks: Batch):
    """``(width, split)``: the padded width, and a function that cuts a stacked ``[ΣN, W]``
    result back into the micro-batches' shapes (or returns it as is for one tensor)."""
    if isinstance(masks, torch.Tensor):
        return masks.shape[1], lambda t: t
    shapes = [tuple(m.shape) for m in masks]
    width = max(s[1] for s in shapes)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        parts = torch.split(t, [s[0] for s in shapes])
        return [p[:, : s[1]] for p, s in zip(parts, shapes)]

    return width, split


def clip_cov_select(
    logp: Batch,
    old_logp: Batch,
    adv: Batch,
    mask: Batch,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Clip-Cov's tokens to detach: ``[N, T]`` bool (a list of them for a list of micro-batches).

    Candidates are the valid tokens that PPO's clip leaves unclipped (``−Aρ ≥ −A·clip(ρ)``) and
    whose covariance term (:func:`token_covariance`) lies strictly inside ``(clip_cov_lb,
    clip_cov_ub)``; ``max(⌊clip_cov_ratio · valid tokens⌋, 1)`` of them are drawn uniformly
    without replacement (``torch.randperm`` over the candidates in row-major order, verl's draw,
    from ``generator`` or torch's global generator). Given lists, the covariance means, the
    count and the draw span all of them: the step-level selection.
    """
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0 (verl asserts it), got {clip_cov_ratio}")
    width, split = _over_step(mask)
    lp, old, m = (_stack(x, width) for x in (logp, old_logp, mask))
    a = _stack(adv, width)
    a = a if a.dim() == 2 else a[:, None]
    valid = m.bool()
    with torch.no_grad():
        ratio = torch.exp(lp.detach() - old)
        unclipped = -a * ratio >= -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        cov = token_covariance(lp, a, m)
        candidate = valid & unclipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        idx = torch.nonzero(candidate)  # [C, 2] row-major
        count = max(int(clip_cov_ratio * float(valid.sum())), 1)
        # on the generator's device (the CPU for the global one), whatever the default device
        draw_on = generator.device if generator is not None else torch.device("cpu")
        perm = torch.randperm(idx.shape[0], generator=generator, device=draw_on)[:count]
        selected = torch.zeros_like(valid)
        pick = idx[perm.to(idx.device)]
        selected[pick[:, 0], pick[:, 1]] = True
    return split(selected)


def clip_cov(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    selected: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    log_ratio_clamp: float | None = None,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: PPO's clipped surrogate, with a few high-covariance tokens' loss set to 0.

    ``ℓ = max(−Aρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))·(1 − s)`` with ``s`` the
    :func:`clip_cov_select` mask (or ``selected``, a step-level one). Defaults are verl's
    (``PolicyLossConfig``: clip_cov_ratio 2e-4, lb 1, ub 5; verl ``actor/actor.yaml``), PPO's
    ε 0.2. verl does not clamp log ρ here (``log_ratio_clamp=None``) and has no dual clip.
    Stats: ``cov_frac`` (selected share of valid tokens, verl's ``pg_clipfrac`` for this loss)
    and PPO's clip fractions.
    """
    check_eps(eps_low, eps_high)
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    if selected is None:  # the selection reads the valid positions only: padding can stay
        selected = clip_cov_select(
            lp,
            old,
            adv,
            mask,
            eps_low=eps_low,
            eps_high=eps_high,
            clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb,
            clip_cov_ub=clip_cov_ub,
            generator=generator,
        )
    elif selected.shape != lp.shape:
        raise ValueError(f"selected must be [N, T]={tuple(lp.shape)}, got {tuple(selected.shape)}")
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    with torch.no_grad():
        log_ratio, gate = clamp_log_ratio(masked_log_ratio(lp, old, mask), log_ratio_clamp)
        ratio = torch.exp(log_ratio)  # [N, T], 1 at padding
        lower, upper = pessimistic_bounds(adv, lo, hi)
        value = ratio.clamp(lower, upper)  # PPO's max(−Aρ, −A·clip(ρ)), value for value
        inside = value == ratio
        chosen = float_mask(selected, mask.dtype)  # [N, T] 0/1
        keep = torch.rsub(chosen, 1.0).mul_(mask)  # 0 at the selected tokens and at padding
        value.mul_(-adv).mul_(keep)
        values = None
        if stats:
            values = ratio_stats(
                ratio, adv, mask, lo, hi, log_ratio, padding=1.0, scratch=log_ratio
            )
            values["cov_frac"] = valid_sum(chosen, mask) / mask.sum()
        slope = ratio.mul_(-adv).mul_(keep).mul_(inside)  # −A·ρ where the clip is inactive
        slope = apply_gate(slope, gate)
    return linearized(logp, value, slope), ({} if values is None else to_floats(values))


def clip_cov_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    selected: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """:func:`clip_cov` in plain autograd: ``max(−Aρ, −A·clip(ρ))·(1 − s)``, ``s`` the
    :func:`clip_cov_select` draw (or ``selected``)."""
    check_eps(eps_low, eps_high)
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    if selected is None:
        selected = clip_cov_select(
            lp.detach(), old, a, m, eps_low=eps_low, eps_high=eps_high,
            clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub,
            generator=generator,
        )  # fmt: skip
    log_ratio = lp - old
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    rho = torch.exp(log_ratio)
    loss = torch.maximum(-a * rho, -a * rho.clamp(1.0 - eps_low, 1.0 + eps_high))
    return autograd_masked(loss * (1.0 - selected.to(lp.dtype)), m)


def kl_cov_select(
    logp: Batch, adv: Batch, mask: Batch, *, kl_cov_ratio: float = 2e-4
) -> torch.Tensor | list[torch.Tensor]:
    """KL-Cov's penalised tokens: the top ``max(⌊kl_cov_ratio · valid tokens⌋, 1)`` by
    covariance term (:func:`token_covariance`), ``[N, T]`` bool (a list for a list).

    ``torch.topk`` over the valid tokens in row-major order, as verl does (ties as topk breaks
    them). Given lists of micro-batches, the selection spans all of them.
    """
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0 (verl asserts it), got {kl_cov_ratio}")
    width, split = _over_step(mask)
    lp, m = _stack(logp, width), _stack(mask, width)
    a = _stack(adv, width)
    a = a if a.dim() == 2 else a[:, None]
    valid = m.bool()
    with torch.no_grad():
        flat_valid = torch.nonzero(valid.reshape(-1)).squeeze(-1)  # [V]
        cov = token_covariance(lp, a, m).reshape(-1)[flat_valid]  # [V]
        count = max(1, int(flat_valid.numel() * kl_cov_ratio))
        top = torch.topk(cov, min(count, cov.numel()), largest=True).indices
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        selected[flat_valid[top]] = True
    return split(selected.reshape(valid.shape))


def kl_cov(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    selected: torch.Tensor | None = None,
    log_ratio_clamp: float | None = None,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: the unclipped ``−Aρ``, plus ``ppo_kl_coef·|log ρ|`` on the top-covariance tokens.

    ``ℓ = −Aρ + coef·|log ρ|·s`` with ``s`` the :func:`kl_cov_select` mask (or ``selected``).
    No clip acts on any token (verl ``compute_policy_loss_kl_cov``). Defaults: verl's
    ``PolicyLossConfig`` (kl_cov_ratio 2e-4, ppo_kl_coef 0.1; the function's own fallback for a
    missing coef is 1.0). Stats: ``cov_frac``, ``abs_log_ratio_mean`` (verl's ``ppo_kl`` for
    this loss).
    """
    if not ppo_kl_coef >= 0:
        raise ValueError(f"ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    lp, old, adv, mask = check_inputs(logp, old_logp, adv, mask)
    if selected is None:
        selected = kl_cov_select(lp, adv, mask, kl_cov_ratio=kl_cov_ratio)
    elif selected.shape != lp.shape:
        raise ValueError(f"selected must be [N, T]={tuple(lp.shape)}, got {tuple(selected.shape)}")
    with torch.no_grad():
        log_ratio, gate = clamp_log_ratio(masked_log_ratio(lp, old, mask), log_ratio_clamp)
        ratio = torch.exp(log_ratio)  # [N, T], 1 at padding
        chosen = float_mask(selected, mask.dtype)  # [N, T] 0/1
        unclipped = -adv * ratio  # −Aρ, also its slope in log ρ
        penalty = log_ratio.abs()
        values = None
        if stats:
            n = mask.sum()
            values = ratio_stats(ratio, adv, mask, None, None, log_ratio, padding=1.0)
            values["cov_frac"] = valid_sum(chosen, mask) / n
            values["abs_log_ratio_mean"] = valid_sum(penalty, mask) / n
        weight = chosen * ppo_kl_coef  # the penalty's coefficient at each token
        value = (unclipped + penalty.mul_(weight)).mul_(mask)
        slope = unclipped.add_(log_ratio.sign_().mul_(weight)).mul_(mask)  # d|x|/dx = sign x
        slope = apply_gate(slope, gate)
    return linearized(logp, value, slope), ({} if values is None else to_floats(values))


def kl_cov_autograd(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    selected: torch.Tensor | None = None,
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """:func:`kl_cov` in plain autograd: ``−Aρ + coef·|log ρ|·s``, ``s`` the
    :func:`kl_cov_select` tokens (or ``selected``)."""
    lp, old, a, m = autograd_inputs(logp, old_logp, adv, mask)
    if selected is None:
        selected = kl_cov_select(lp.detach(), a, m, kl_cov_ratio=kl_cov_ratio)
    log_ratio = lp - old
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    loss = -a * torch.exp(log_ratio) + ppo_kl_coef * log_ratio.abs() * selected.to(lp.dtype)
    return autograd_masked(loss, m)
