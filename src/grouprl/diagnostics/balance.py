"""Reward/KL balance from two backward passes, and KL mean / P95 over sequences.

ALGORITHMS.md §5 [PAPER seed: MaxNorm-AC, Table 3 caption: "R/KL is ‖g_R‖/(β‖g_KL‖), and Dir.
is the reward/KL direction cosine"]: g_R is the gradient of the reward branch of the loss,
g_KL the gradient of the **unweighted** KL branch — the KL term without β and without any
per-group ``kl_weight`` — and β the base coefficient. One definition for every method, so
GRPO+β_q-comp, whose ``kl_weight = 1/(σ_q + eps)`` rescales the KL it trains with, is measured
on the same scale as GRPO (the paper reports 2.94 for it next to GRPO's 3.10, which only the
unweighted reading gives: its reward branch is GRPO's). GRPO on low-variance groups reaches
R/KL ≈ 3.1; RLOO / Dr.GRPO ≈ 0.5 (KL-dominated).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from grouprl.diagnostics.inverse_scale import updated_groups
from grouprl.types import Advantages

__all__ = [
    "LOW_SIGMA",
    "SUBSETS",
    "flat_gradient",
    "gradient_balance",
    "kl_stats",
    "low_sigma_groups",
    "reward_kl_balance",
    "subset_keys",
]

LOW_SIGMA = 1e-2
"""σ_q below which a group is "low-variance": MaxNorm-AC Table 3 measures its diagnostics, R/KL
included, "on updated groups with σ_q < 1e-2" [PAPER seed: Table 3 caption]."""

SUBSETS = ("low_sigma", "batch")
"""Where the trainer measures R/KL, logged as ``balance/<subset>/...``: ``low_sigma`` = the
updated groups with σ_q < :data:`LOW_SIGMA` (:func:`low_sigma_groups`, Table 3's subset, the
number to hold against Table 3 and the one the health rule reads); ``batch`` = every kept row
of the measured micro-batch (what was logged as ``balance/r_over_kl`` in older runs)."""


def low_sigma_groups(
    rewards: torch.Tensor, adv: Advantages, low_sigma: float = LOW_SIGMA
) -> torch.Tensor:
    """``[P]`` bool: MaxNorm Table 3's subset, updated groups whose raw-reward σ_q < ``low_sigma``.

    ``rewards [P, G]``: the rewards the estimator was given (NaN = missing, counted out);
    σ_q their standard deviation with Bessel's correction (ddof 1, the GRPO estimator's, and
    what the Table 3 reproduction uses); a group with fewer than two valid rewards has no σ and
    is not in the subset. ``adv``: the estimator's output (:func:`updated_groups`). One
    definition for the trainer and ``simulate.low_variance``.
    """
    if rewards.dim() != 2 or rewards.shape[0] != adv.values.shape[0]:
        raise ValueError(
            f"rewards must be [P, G] with the advantages' P = {adv.values.shape[0]}, got "
            f"{tuple(rewards.shape)}"
        )
    valid = ~torch.isnan(rewards)  # [P, G]
    n = valid.sum(dim=1)  # [P]
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = r.sum(dim=1) / n.clamp_min(1)  # [P]
    dev = torch.where(valid, rewards - mean[:, None], torch.zeros_like(rewards))
    sigma = (dev.pow(2).sum(dim=1) / (n - 1).clamp_min(1)).sqrt()  # [P]
    return updated_groups(adv) & (n >= 2) & (sigma < low_sigma)


def subset_keys(metrics: dict[str, float], subset: str) -> dict[str, float]:
    """``balance/x`` -> ``balance/<subset>/x`` (:data:`SUBSETS`) for :func:`reward_kl_balance`'s
    output, so the Table 3 subset and the whole batch are logged under their own names."""
    if subset not in SUBSETS:
        raise ValueError(f"unknown R/KL subset {subset!r}; valid subsets: {', '.join(SUBSETS)}")
    return {k.replace("balance/", f"balance/{subset}/", 1): v for k, v in metrics.items()}


def flat_gradient(
    loss: torch.Tensor, params: list[torch.Tensor], *, retain_graph: bool = True
) -> torch.Tensor:
    """``[Σ numel]`` float64: the gradient of the scalar ``loss`` with respect to ``params``,
    flattened and concatenated (0 for a parameter the loss does not reach), by
    ``torch.autograd.grad``: the ``.grad`` buffers are not touched."""
    grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    parts = [
        (g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64)
        for g, p in zip(grads, params)
    ]
    return torch.cat(parts)


def reward_kl_balance(
    reward_loss: torch.Tensor,
    kl_loss: torch.Tensor,
    params: Iterable[torch.Tensor],
    *,
    beta: float,
    retain_graph: bool = True,
) -> dict[str, float]:
    """R/KL = ‖g_R‖/(β‖g_KL‖) and the direction cosine (MaxNorm Table 3 caption).

    ``reward_loss``: the scalar reward branch (surrogate, aggregated). ``kl_loss``: the scalar
    **unweighted** KL branch — the per-token KL aggregated like the loss, without β and
    without the per-group ``kl_weight`` (for every estimator but ``grpo_beta_comp`` that is
    the trained KL term divided by β). ``beta``: the base coefficient. ``params``: the
    trainable parameters. Two ``torch.autograd.grad`` calls, so ``.grad`` buffers are not
    touched; ``retain_graph=True`` (default) leaves the graph for the optimizer's own backward.

    Returns ``balance/reward_grad_norm`` (‖g_R‖), ``balance/kl_grad_norm`` (‖g_KL‖, unweighted),
    ``balance/cosine`` (0 when either gradient is 0) and ``balance/r_over_kl`` =
    ‖g_R‖/(β‖g_KL‖), left out when β·‖g_KL‖ = 0 [OURS: no inf in the log].
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("params has no tensor with requires_grad=True: pass model.parameters()")
    if reward_loss.dim() != 0 or kl_loss.dim() != 0:
        raise ValueError("reward_loss and kl_loss must be scalars (aggregate the branches first)")
    g_r = flat_gradient(reward_loss, params)
    g_k = flat_gradient(kl_loss, params, retain_graph=retain_graph)
    return gradient_balance(g_r, g_k, beta=beta)


def gradient_balance(g_r: torch.Tensor, g_k: torch.Tensor, *, beta: float) -> dict[str, float]:
    """:func:`reward_kl_balance`'s metrics from the two gradients themselves: ``g_r`` and
    ``g_k`` ``[D]`` (:func:`flat_gradient` of the reward branch and of the unweighted KL
    branch, or their sums over micro-batches), ``beta`` the base coefficient."""
    nr, nk = float(g_r.norm()), float(g_k.norm())
    cos = float(g_r @ g_k) / (nr * nk) if nr > 0 and nk > 0 else 0.0
    out = {"balance/reward_grad_norm": nr, "balance/kl_grad_norm": nk, "balance/cosine": cos}
    if beta * nk > 0:
        out["balance/r_over_kl"] = nr / (beta * nk)
    return out


def kl_stats(kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """KL mean and P95 over sequences from a per-token KL ``[N, T]`` and its ``mask``.

    Each sequence's KL is its token mean over real tokens (MaxNorm Table 3 reports KL mean and
    KL P95 over sequences [PAPER seed]; token mean per sequence is [OURS]); sequences without
    a real token are left out. Returns ``kl/mean``, ``kl/p95``, ``kl/max`` (0 when empty).
    """
    if kl.shape != mask.shape or kl.dim() != 2:
        raise ValueError(
            f"kl and mask must both be [N, T], got {tuple(kl.shape)} / {tuple(mask.shape)}"
        )
    m = mask.to(torch.float64)
    n_tok = m.sum(dim=1)  # [N]
    seq = (kl.detach().to(torch.float64) * m).sum(dim=1) / n_tok.clamp_min(1)  # [N]
    seq = torch.where(n_tok > 0, seq, torch.full_like(seq, float("nan")))
    q = torch.tensor([0.95], dtype=seq.dtype, device=seq.device)
    stats = torch.stack(
        [seq.nanmean(), torch.nanquantile(seq, q)[0], seq.nan_to_num(-torch.inf).amax()]
    )
    mean, p95, mx = torch.nan_to_num(stats, nan=0.0, neginf=0.0).tolist()
    return {"kl/mean": mean, "kl/p95": p95, "kl/max": mx}
