"""Per-sample loss weights: one non-negative factor per sequence on its policy loss.

verl's ``loss_weight`` (a per-sample batch field weighting each response's loss; verl
0.9.1 does not have it and its source was not available to read here, so the reading below is
ours [OURS]): sample i's per-token policy loss is multiplied by ``w_i``, the aggregation's
normaliser is unchanged (a sample of weight 0 still counts in the token / sequence totals, as
a zero rollout-correction weight does). Pass the result as
``losses.objective(correction_weight=...)`` (times a correction's own weight when both are
on): like every correction weight it multiplies the policy term only, not the KL or entropy
terms.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NORMALIZE", "sample_weights"]

NORMALIZE = ("none", "mean")
"""``none``: the weights as given; ``mean``: divided by their mean over the sequences with a
valid token, so the batch's loss scale is that of unit weights [OURS]."""


def sample_weights(
    weights: torch.Tensor, mask: torch.Tensor, *, normalize: str = "none"
) -> torch.Tensor:
    """``[N, T]`` per-token factor: ``w_i`` on every valid token of sequence i, 0 at padding.

    ``weights [N]`` finite and >= 0 (else a ValueError naming the fault); ``mask [N, T]``.
    """
    if not isinstance(weights, torch.Tensor) or weights.dim() != 1:
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise ValueError(f"weights must be a [N] tensor, one weight per sample, got {got}")
    if mask.dim() != 2 or mask.shape[0] != weights.shape[0]:
        raise ValueError(
            f"mask must be [N, T] with N={weights.shape[0]} rows, got {tuple(mask.shape)}"
        )
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    dtype = torch.promote_types(weights.dtype, torch.float32)
    w = weights.detach().to(dtype)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and >= 0 (a per-sample loss weight)")
    valid = mask.bool()
    if normalize == "mean":
        rows = valid.any(-1)
        mean = w[rows].mean() if bool(rows.any()) else torch.ones((), dtype=dtype)
        if not (math.isfinite(float(mean)) and float(mean) > 0):
            raise ValueError("normalize='mean' needs a positive mean weight over the samples")
        w = w / mean
    return torch.where(valid, w[:, None], torch.zeros((), dtype=dtype))
