"""Notation, the few dataclasses that cross folders, and :func:`to_floats` for their metrics.

Shapes used in comments everywhere:

- ``P``: prompts in a batch; ``G``: completions sampled per prompt (the group size);
- ``N = P * G``: sequences; ``T``: completion tokens (padded).

``rewards`` is a float tensor ``[P, G]``; NaN means missing or unscorable (see
ALGORITHMS.md §0): NaN entries are left out of every statistic and get advantage 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["Advantages", "Rollouts", "to_floats"]


@dataclass(frozen=True)
class Advantages:
    """The result of an advantage estimator (ALGORITHMS.md §0).

    Attributes:
        values: ``[P, G]`` advantage of each real sample; exactly 0 where the reward is NaN
            and for groups that take no part in the update.
        keep: ``[P]`` bool; False means the group takes no part in the loss, in the reward
            branch **and** the KL branch (e.g. a one-bin group under the resolution protocol).
        kl_weight: ``[P]`` multiplier on β for the group's KL term (1 unless a method says
            otherwise, e.g. ``grpo_beta_comp``).
        scale: ``[P]`` the denominator the method divided by (σ_q + eps for GRPO, s_q for
            MaxNorm, 1 for RLOO / Dr.GRPO); the diagnostics read the tail of ``1/scale``.
        stats: per-batch numbers the method wants logged (floats), e.g. AVSPO's trigger state.
        updated: ``[P]`` bool, groups whose reward branch carries signal: kept and not
            collapsed (σ_q >= tau on the statistics the estimator used, virtual samples
            included). ``1/scale`` over these groups is the inverse-scale tail of the
            diagnostics; collapsed groups keep the scale the method would have used.
        token_values: ``[P, G, T]`` per-token advantages of a token-level estimator
            (``advantages.compute_tokens``; 0 at masked tokens), or None for a sequence-level
            one. ``values`` then holds each sample's mean over its valid tokens.
    """

    values: torch.Tensor  # [P, G]
    keep: torch.Tensor  # [P] bool
    kl_weight: torch.Tensor  # [P]
    scale: torch.Tensor  # [P]
    stats: dict[str, float] = field(default_factory=dict)
    updated: torch.Tensor | None = None  # [P] bool
    token_values: torch.Tensor | None = None  # [P, G, T]

    @property
    def per_sample(self) -> torch.Tensor:
        """``[P*G]`` advantages flattened in row-major (prompt-major) order."""
        return self.values.reshape(-1)

    @property
    def per_token(self) -> torch.Tensor | None:
        """``[P*G, T]`` per-token advantages in prompt-major order, or None (sequence-level)."""
        if self.token_values is None:
            return None
        return self.token_values.reshape(-1, self.token_values.shape[-1])


@dataclass
class Rollouts:
    """A batch of sampled completions, prompt-major: row ``p * G + g`` is sample g of prompt p.

    Attributes:
        prompt_ids: ``[N, Tp]`` left-padded prompt token ids.
        prompt_mask: ``[N, Tp]`` 1 for real prompt tokens.
        completion_ids: ``[N, T]`` right-padded completion token ids.
        completion_mask: ``[N, T]`` 1 for real completion tokens (EOS included).
        old_logp: ``[N, T]`` behaviour-policy log-probabilities of the completion tokens.
        finish_reason: one of ``"stop"`` (EOS) or ``"length"`` (truncated) per sequence.
        texts: decoded completions, one per sequence.
        group_size: G.
        kept_ids: ``[N, T, K]`` int32, the token ids the sampler's top-k / top-p kept at each
            position (-1 padding), when the log-probs are read on the truncated support
            (``Sampling.logprob_support="truncated"``); None otherwise.
        log_kept_mass: ``[N, T]`` log of the sampling distribution's mass on the kept set
            (0 at padding), whenever the sampler truncates; None when it does not.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    old_logp: torch.Tensor
    finish_reason: list[str]
    texts: list[str]
    group_size: int
    kept_ids: torch.Tensor | None = None
    log_kept_mass: torch.Tensor | None = None

    @property
    def num_prompts(self) -> int:
        return self.completion_ids.shape[0] // self.group_size

    @property
    def truncated(self) -> torch.Tensor:
        """``[N]`` bool: the completion hit the token limit before EOS."""
        flags = [r == "length" for r in self.finish_reason]
        return torch.tensor(flags, dtype=torch.bool, device=self.completion_ids.device)


def to_floats(values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """0-dim tensors -> Python floats under the same keys, with one host transfer.

    One ``.tolist()`` for the whole dict instead of one ``.item()`` (one device sync) per
    value; each float stays with its own key, so reordering the dict cannot mislabel one.
    """
    if not values:
        return {}
    tensors = list(values.values())
    first = tensors[0]
    if first.is_floating_point() and all(
        v.dim() == 0 and v.dtype == first.dtype and v.device == first.device for v in tensors
    ):  # the common case: one stack of 0-dim floats, no conversion per value
        stacked = torch.stack([v.detach() for v in tensors])
    else:
        stacked = torch.stack(
            [v.detach().to(first.device, torch.float64).reshape(()) for v in tensors]
        )
    return dict(zip(values, stacked.tolist()))
