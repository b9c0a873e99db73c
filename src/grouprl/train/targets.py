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

__all__ = ["Targets"]


@dataclass(frozen=True)
class Targets:
    """The per-sequence targets of one step's update (rows ``p·G + g``, as the batch's).

    Attributes:
        adv: ``[N]`` float advantages.
        keep: ``[N]`` bool; False: the sequence leaves the loss (a dropped group, a NaN
            reward), its KL branch included.
        kl_weight: ``[N]`` multiplier on β of each sequence's KL term.
        ref_logp: ``[N, T]`` the reference's log-probs, or None (β = 0: no KL term).
        clip: the surrogate's parameters for this update: floats, or ``[N]`` tensors for
            per-sequence bounds (AGPO's per-prompt ε).
    """

    adv: torch.Tensor  # [N]
    keep: torch.Tensor  # [N] bool
    kl_weight: torch.Tensor  # [N]
    ref_logp: torch.Tensor | None  # [N, T]
    clip: Mapping[str, Any]

    def __post_init__(self) -> None:
        n = self.adv.shape
        if len(n) != 1 or self.keep.shape != n or self.kl_weight.shape != n:
            raise ValueError(
                f"adv, keep and kl_weight must be [N] alike, got {tuple(self.adv.shape)}, "
                f"{tuple(self.keep.shape)}, {tuple(self.kl_weight.shape)}"
            )
        if self.ref_logp is not None and self.ref_logp.shape[:1] != n:
            raise ValueError(f"ref_logp must be [N={n[0]}, T], got {tuple(self.ref_logp.shape)}")
        for key, value in self.clip.items():
            if isinstance(value, torch.Tensor) and value.shape != n:
                raise ValueError(f"clip[{key!r}] must be a float or [N={n[0]}], got {value.shape}")

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
        )
