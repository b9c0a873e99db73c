"""What the update fits a batch to: one frozen :class:`Targets` per step, one row per sequence.

The step (:func:`grouprl.train.loop.train_step`) builds it after the advantages, the
reference log-probs and the controller's clip bounds; the update reads a minibatch's or a
micro-batch's share with :meth:`Targets.rows`, next to the same rows of the
:class:`grouprl.train.batch.Batch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.losses.correction import Correction

__all__ = ["Targets"]


@dataclass(frozen=True)
class Targets:
    """The per-sequence targets of one step's update (rows ``p·G + g``, as the batch's).

    Attributes:
        adv: ``[N]`` float advantages, or ``[N, T]`` per token (a token-level estimator or a
            KL folded into the reward: ``advantages.compute_tokens``).
        keep: ``[N]`` bool; False: the sequence leaves the loss (a dropped group, a NaN
            reward), its KL branch included.
        kl_weight: ``[N]`` multiplier on β of each sequence's KL term.
        ref_logp: ``[N, T]`` the reference's log-probs, or None (β = 0: no KL term).
        clip: the surrogate's parameters for this update: floats, or ``[N]`` tensors for
            per-sequence bounds (AGPO's per-prompt ε).
        correction: the rollout correction of the batch (``losses.correction.Correction``:
            ``[N, T]`` weight and keep), or None (matched precision, or no correction).
    """

    adv: torch.Tensor  # [N] or [N, T]
    keep: torch.Tensor  # [N] bool
    kl_weight: torch.Tensor  # [N]
    ref_logp: torch.Tensor | None  # [N, T]
    clip: Mapping[str, Any]
    correction: Correction | None = None

    def __post_init__(self) -> None:
        n = self.adv.shape[:1]
        if self.adv.dim() not in (1, 2) or self.keep.shape != n or self.kl_weight.shape != n:
            raise ValueError(
                f"adv, keep and kl_weight must be [N] alike (adv may be [N, T] per token), got "
                f"{tuple(self.adv.shape)}, {tuple(self.keep.shape)}, {tuple(self.kl_weight.shape)}"
            )
        if self.ref_logp is not None and self.ref_logp.shape[:1] != n:
            raise ValueError(f"ref_logp must be [N={n[0]}, T], got {tuple(self.ref_logp.shape)}")
        for key, value in self.clip.items():
            if isinstance(value, torch.Tensor) and value.shape != n:
                raise ValueError(f"clip[{key!r}] must be a float or [N={n[0]}], got {value.shape}")
        if self.correction is not None and self.correction.weight.shape[:1] != n:
            raise ValueError(
                f"correction must be [N={n[0]}, T], got {self.correction.weight.shape}"
            )

    def loss_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` without the tokens the rollout correction rejected (``mask`` itself when
        there is none): what the step's normalisers count."""
        return mask if self.correction is None else self.correction.loss_mask(mask)

    @property
    def size(self) -> int:
        """N sequences."""
        return self.adv.shape[0]

    def rows(self, m: torch.Tensor) -> Targets:
        """The targets of sequences ``m`` (``[n]`` indices), every per-sequence value alike."""
        return Targets(
            adv=self.adv[m],
            keep=self.keep[m],
            kl_weight=self.kl_weight[m],
            ref_logp=None if self.ref_logp is None else self.ref_logp[m],
            clip={k: v[m] if isinstance(v, torch.Tensor) else v for k, v in self.clip.items()},
            correction=None if self.correction is None else self.correction.rows(m),
        )
