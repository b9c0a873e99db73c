"""Batch filters: DAPO's dynamic sampling and overlong handling (ALGORITHMS.md §3).

Dynamic sampling (DAPO, Yu et al. 2025, §3.2; verl ``algorithm.filter_groups``): groups whose
rewards are all equal carry no gradient under a group baseline, so they are dropped and more
prompts are drawn until the batch holds ``target`` informative groups, giving up after
``max_tries`` generation rounds. Two pieces:

- pure helpers: :func:`informative_groups` (which groups to keep) and :func:`prompts_to_draw`
  (how many more prompts to generate);
- :class:`DynamicSampler`, the small stateful accumulator a trainer uses per step::

      sampler = DynamicSampler(target=P, max_tries=10)
      while not sampler.done:
          rollouts, rewards = generate(sampler.next_draw())   # rewards [p, G]
          idx = sampler.add(rewards)                          # indices of groups to keep
          keep_groups(rollouts, idx)
      log(sampler.stats())

Overlong handling (DAPO §3.4): either mask the tokens of truncated completions out of the
loss (:func:`mask_truncated`, "overlong filtering"), or add DAPO's soft length penalty to the
reward (:func:`overlong_penalty`, :func:`apply_overlong_penalty`). The trainer reaches both
through one hook, :class:`Overlong` (a preset's ``overlong`` field): ``rewards`` on each
generation round's rewards, ``mask`` on the joined batch's loss mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grouprl.diagnostics.acr import DEFAULT_TAU

__all__ = [
    "OVERLONG",
    "DynamicSampler",
    "DynamicSamplingExhausted",
    "Overlong",
    "apply_overlong_penalty",
    "informative_groups",
    "mask_truncated",
    "overlong_penalty",
    "prompts_to_draw",
]


def informative_groups(rewards: torch.Tensor, *, tau: float = DEFAULT_TAU) -> torch.Tensor:
    """``[P]`` bool: groups that carry signal, i.e. at least two valid rewards that differ.

    DAPO keeps a group when ``0 < #correct < G`` (verl ``filter_groups`` keeps std > 0); for
    continuous rewards we keep a group whose valid rewards have ``max − min ≥ tau`` [OURS: the
    range, unlike σ with its ddof, does not depend on the std convention]. NaN rewards are
    ignored; a group with fewer than 2 valid rewards is not informative.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        raise ValueError("rewards must be a [P, G] tensor (NaN = missing)")
    valid = ~torch.isnan(rewards)  # [P, G]
    inf = torch.full_like(rewards, math.inf)
    hi = torch.where(valid, rewards, -inf).amax(dim=1)  # [P]
    lo = torch.where(valid, rewards, inf).amin(dim=1)  # [P]
    return (valid.sum(dim=1) >= 2) & ((hi - lo) >= tau)


def prompts_to_draw(
    have: int,
    target: int,
    keep_rate: float | None,
    *,
    batch_prompts: int,
    min_rate: float = 0.05,
    max_draw: int | None = None,
) -> int:
    """How many prompts to generate next so that ``have`` kept groups likely reach ``target``.

    ``ceil((target − have) / max(keep_rate, min_rate))``, at least 1; before any round
    (``keep_rate`` None) a full ``batch_prompts`` [OURS: verl always draws a full
    ``gen_batch_size``; drawing what the observed keep rate says is needed wastes fewer
    rollouts]. ``max_draw`` (default ``4·batch_prompts``) caps one round's draw.
    """
    if target <= have:
        return 0
    if keep_rate is None:
        return batch_prompts
    cap = max_draw if max_draw is not None else 4 * batch_prompts
    need = math.ceil((target - have) / max(keep_rate, min_rate))
    return int(max(1, min(need, cap)))


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling gave up: ``max_tries`` rounds did not fill the batch."""


class DynamicSampler:
    """Per-step accumulator for DAPO's dynamic sampling (see the module docstring).

    Args:
        target: informative groups wanted per step (the training batch's P).
        max_tries: generation rounds before giving up (verl ``max_num_gen_batches``, default
            10 here; 0 in verl means unlimited, which we do not allow).
        on_exhausted: ``"raise"`` (default, verl's behaviour) raises
            :class:`DynamicSamplingExhausted`; ``"partial"`` [OURS] ends the step with the
            groups collected so far (``done`` becomes True).
        tau: collapse threshold for :func:`informative_groups`.
    """

    def __init__(
        self,
        target: int,
        *,
        max_tries: int = 10,
        on_exhausted: str = "raise",
        tau: float = DEFAULT_TAU,
    ) -> None:
        if target < 1 or max_tries < 1:
            raise ValueError(f"target and max_tries must be >= 1, got {target}, {max_tries}")
        if on_exhausted not in ("raise", "partial"):
            raise ValueError(f"on_exhausted must be 'raise' or 'partial', got {on_exhausted!r}")
        self.target = target
        self.max_tries = max_tries
        self.on_exhausted = on_exhausted
        self.tau = tau
        self.reset()

    def reset(self) -> None:
        """Start a new optimizer step."""
        self.kept = 0
        self.kept_raw = 0
        self.drawn = 0
        self.tries = 0
        self.exhausted = False

    @property
    def done(self) -> bool:
        """True when the batch is full (or, with ``on_exhausted="partial"``, tries ran out)."""
        return self.kept >= self.target or self.exhausted

    @property
    def keep_rate(self) -> float | None:
        """Fraction of drawn groups kept so far this step (None before the first round)."""
        return self.kept_raw / self.drawn if self.drawn else None

    def next_draw(self) -> int:
        """Prompts to generate in the next round (:func:`prompts_to_draw`)."""
        return prompts_to_draw(self.kept, self.target, self.keep_rate, batch_prompts=self.target)

    def add(self, rewards: torch.Tensor) -> torch.Tensor:
        """Record one round's ``[p, G]`` rewards; return the indices of the groups to keep.

        The indices are in order and trimmed so that the step never exceeds ``target`` (DAPO
        and verl drop the surplus). Raises :class:`DynamicSamplingExhausted` when this was the
        last allowed round and the batch is still not full (``on_exhausted="raise"``).
        """
        if self.done:
            raise RuntimeError("DynamicSampler.add after the batch is full; call reset()")
        informative = informative_groups(rewards, tau=self.tau)  # [p]
        self.tries += 1
        self.drawn += int(informative.numel())
        self.kept_raw += int(informative.sum())
        idx = torch.nonzero(informative).flatten()[: self.target - self.kept]
        self.kept += int(idx.numel())
        if self.kept < self.target and self.tries >= self.max_tries:
            if self.on_exhausted == "raise":
                raise DynamicSamplingExhausted(
                    f"dynamic sampling: after {self.tries} generation rounds only "
                    f"{self.kept}/{self.target} groups had non-identical rewards (keep rate "
                    f"{self.kept_raw}/{self.drawn}); the prompts are too easy or too hard for "
                    "the model. Raise max_tries, use a larger group size, filter the "
                    "dataset by difficulty, or set on_exhausted='partial'"
                )
            self.exhausted = True
        return idx

    def stats(self) -> dict[str, float]:
        """Per-step numbers to log: rounds, prompts drawn, groups kept, keep rate."""
        return {
            "tries": float(self.tries),
            "drawn": float(self.drawn),
            "kept": float(self.kept),
            "keep_rate": float(self.keep_rate) if self.keep_rate is not None else 0.0,
        }

    def state_dict(self) -> dict[str, float]:
        """Configuration (per-step counters are reset each step and not saved)."""
        return {"target": self.target, "max_tries": self.max_tries, "tau": self.tau}


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` mask with every token of a truncated completion set to 0 (DAPO overlong filter).

    ``truncated`` is ``[N]`` bool (``Rollouts.truncated``: hit the length limit before EOS).
    """
    if truncated.shape != mask.shape[:1]:
        raise ValueError(
            f"truncated must be [N]={tuple(mask.shape[:1])}, got {tuple(truncated.shape)}"
        )
    return mask * (~truncated.bool()).to(mask.dtype)[:, None]


def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_len: int,
    cache_len: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong penalty per completion: 0, then linear down to −factor at L_max.

    ``R = 0`` for ``L ≤ L_max − L_cache``; ``(L_max − L_cache − L)/L_cache·factor`` for
    ``L_max − L_cache < L ≤ L_max``; ``−factor`` beyond (DAPO eq. 13; verl DAPO reward manager
    ``overlong_buffer``: ``len``=L_cache, ``penalty_factor``=factor). DAPO used L_max = 20480,
    L_cache = 4096. ``lengths`` are completion token counts, any shape.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, {max_len=}")
    start = max_len - cache_len
    excess = (lengths.to(torch.get_default_dtype()) - start).clamp(min=0.0)
    return -(excess / cache_len).clamp(max=1.0) * factor


def apply_overlong_penalty(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_len: int,
    cache_len: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """``[P, G]`` rewards plus DAPO's soft overlong penalty; NaN rewards stay NaN."""
    if lengths.shape != rewards.shape:
        raise ValueError(
            f"lengths must have the shape of rewards {tuple(rewards.shape)}, got "
            f"{tuple(lengths.shape)}"
        )
    pen = overlong_penalty(lengths, max_len=max_len, cache_len=cache_len, factor=factor)
    return rewards + pen.to(rewards.dtype)


OVERLONG = {
    None: "truncated completions are trained on as they are (TRL's default)",
    "mask": "DAPO's overlong filtering: a truncated completion's tokens leave the loss",
    "soft": "DAPO's soft overlong punishment: 0, then linear down to -1 at L_max, on the reward",
}
"""A preset's ``overlong`` value -> what :class:`Overlong` does with it."""


@dataclass(frozen=True)
class Overlong:
    """DAPO's overlong handling (§3.4) as the trainer's one hook, for a preset's ``overlong``.

    :meth:`rewards` shapes each generation round's rewards (``"soft"``: plus
    :func:`overlong_penalty` with ``max_len`` = L_max and ``cache_len`` = L_cache, before the
    dynamic sampler sees them, as DAPO's reward manager adds it); :meth:`mask` shapes the
    joined batch's loss mask (``"mask"``: :func:`mask_truncated`). Every other combination
    returns its input unchanged (the same tensor).
    """

    mode: str | None
    max_len: int
    cache_len: int

    def __post_init__(self) -> None:
        if self.mode not in OVERLONG:
            valid = ", ".join(str(k) for k in OVERLONG)
            raise ValueError(f"unknown overlong handling {self.mode!r}; valid: {valid}")

    @classmethod
    def of(cls, mode: str | None, *, max_new_tokens: int, cache: int = 0) -> Overlong:
        """The hook of a run: L_max = ``max_new_tokens``; L_cache = ``cache``, or when 0
        ``max_new_tokens // 5`` (at least 1; ``sampling.overlong_cache``) [OURS scaling]."""
        return cls(mode, max_new_tokens, cache or max(1, max_new_tokens // 5))

    def rewards(self, rewards: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
        """``[P, G]`` rewards of one round given its completions' mask ``[P·G, T]``."""
        if self.mode != "soft":
            return rewards
        lengths = completion_mask.sum(-1).view_as(rewards)  # [P, G] tokens, EOS included
        return apply_overlong_penalty(
            rewards, lengths, max_len=self.max_len, cache_len=self.cache_len
        )

    def mask(self, mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """``[N, T]`` loss mask of the joined batch given ``truncated`` ``[N]``."""
        return mask_truncated(mask, truncated) if self.mode == "mask" else mask
