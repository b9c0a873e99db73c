"""Normalisation-regime statistics: when does dividing by σ_q help?

["Why GRPO needs normalization", abstract] + [OURS] (ALGORITHMS.md §5): GRPO's edge over
unnormalised REINFORCE grows with the average within-prompt reward std, and appears in the
phase where per-prompt variances are heterogeneous while per-prompt gradients stay near
orthogonal. We log the mean σ_q over non-collapsed groups, its coefficient of variation across
prompts, and (sampled every k steps) the mean |cosine| between per-prompt gradients.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from grouprl.advantages._groups import batch_std
from grouprl.diagnostics.acr import DEFAULT_TAU, collapse_split

__all__ = ["gradient_orthogonality", "per_prompt_gradients", "sigma_mean_cv", "sigma_stats"]


def sigma_mean_cv(sigma: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``sigma [P]`` over the ``live [P]`` groups and its coefficient of variation
    (population std / mean) across them, as 0-dim float64 tensors (no host transfer).

    Both 0 when no group is live or the mean is 0 [OURS: keeps the logs free of NaN].
    """
    sigma = sigma.to(torch.float64)  # [P]
    n = live.sum().clamp_min(1)
    mean = torch.where(live, sigma, torch.zeros_like(sigma)).sum() / n
    std = batch_std(sigma, live, ddof=0)
    cv = torch.where(mean > 0, std / mean.clamp_min(1e-300), torch.zeros_like(mean))
    return mean, cv


def sigma_stats(rewards: torch.Tensor, *, tau: float = DEFAULT_TAU) -> dict[str, float]:
    """Mean σ_q over non-collapsed groups and its coefficient of variation (std/mean) across them.

    Both 0 when every group is collapsed. σ with ddof = 1 (as the estimators).
    """
    split = collapse_split(rewards, tau=tau)
    live = ~split["collapsed"]  # [P]
    mean, cv = sigma_mean_cv(split["sigma"], live)
    return {
        "regime/sigma_mean": float(mean),
        "regime/sigma_cv": float(cv),
        "regime/live_groups": float(live.sum()),
    }


def gradient_orthogonality(grads: torch.Tensor) -> float:
    """Mean |cosine| over distinct pairs of per-prompt gradient rows ``[P, D]`` (0 = orthogonal).

    Rows with zero norm (collapsed prompts) are left out; with fewer than 2 rows left it is 0.
    Vectorised: one Gram matrix of the row-normalised gradients.
    """
    if grads.dim() != 2:
        raise ValueError(f"grads must be [P, D], got shape {tuple(grads.shape)}")
    g = grads.to(torch.float64)
    norms = g.norm(dim=1)  # [P]
    g = g[norms > 0] / norms[norms > 0, None]
    p = g.shape[0]
    if p < 2:
        return 0.0
    gram = (g @ g.T).abs()  # [P, P]
    off = gram.sum() - gram.diagonal().sum()
    return float(off / (p * (p - 1)))


def per_prompt_gradients(
    losses: torch.Tensor,
    params: Iterable[torch.Tensor],
    *,
    coords: int | None = 4096,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[P, D']`` gradient of each prompt's loss ``losses[q]``, on a random coordinate sample.

    One ``torch.autograd.grad`` per prompt (a loop over P, acceptable because this is sampled
    every k steps, never on the per-step path). ``coords``: keep this many uniformly sampled
    flat coordinates (the same ones for every prompt) [OURS: a coordinate sample is an unbiased
    projection for the inner products that the cosine needs and costs no D×D' matrix];
    ``None`` keeps the full gradient (tiny models only).
    """
    params = [p for p in params if p.requires_grad]
    if losses.dim() != 1:
        raise ValueError(f"losses must be [P] (one scalar per prompt), got {tuple(losses.shape)}")
    total = sum(p.numel() for p in params)
    idx = None
    if coords is not None and coords < total:
        idx = torch.randperm(total, generator=generator)[:coords]
    rows = []
    for q in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[q], params, retain_graph=True, allow_unused=True)
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(grads, params)
            ]
        )
        rows.append(flat if idx is None else flat[idx.to(flat.device)])
    return torch.stack(rows)
