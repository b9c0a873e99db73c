"""Where a step's prompts come from: a fresh stream, or a finite pool and a prompt sampler.

Two modes, chosen once at set-up from ``sampling.pool_size`` and the preset's ``sampler``
(:mod:`grouprl.sampling`):

- **stream** (``uniform`` sampler, pool size 0, the default of every preset but the
  ``is_grpo`` family): each (seed, step, round) draws P new examples from the task's ``train``
  stream, as before the sampler axis existed;
- **pool**: ``pool_size`` train examples are drawn once from the run's seed (for a dataset
  task with fewer rows, its distinct rows), and each round the sampler picks P indices into
  the pool. After each round the sampler observes the within-group reward std of every
  group it generated (:func:`grouprl.advantages.group_std`; dynamic sampling's dropped groups
  included), which is what IS-GRPO's ``sigma`` sampler draws by, and their pass rates, which
  the ``curriculum`` sampler draws by (its settings: ``sampling.curriculum_*``).

The indices come from a CPU generator seeded by (seed, step, round), so the draws of a resumed
run are those of an uninterrupted one; the sampler's own state (σ̂ per prompt) is checkpointed.
"""

from __future__ import annotations

from typing import Any

import torch

from grouprl import advantages, sampling
from grouprl.tasks.base import Example, Task

__all__ = ["DEFAULT_POOL", "Prompts", "prompt_seed", "sampler_params"]

DEFAULT_POOL = 1024
"""[OURS] pool size when ``sampling.pool_size`` is 0 and the sampler needs a pool (``sigma``):
with 32 prompts a step, each prompt is visited about every 32 steps."""

_POOL_SEED = 99_991
"""[OURS] offset of the pool's seed from the run's, so the pool is not the step-0 stream."""


def sampler_params(sampler: str, settings: Any) -> dict[str, Any]:
    """The keyword arguments of ``sampler`` that the run's ``SamplingConfig`` sets: the
    ``curriculum_*`` fields for the curriculum sampler, none for the others."""
    if sampler != "curriculum" or settings is None:
        return {}
    return {
        "band": (settings.curriculum_low, settings.curriculum_high),
        "revisit": settings.curriculum_revisit,
        "decay": settings.curriculum_decay,
        "prior_strength": settings.curriculum_prior_strength,
    }


def prompt_seed(seed: int, step: int, round_: int) -> int:
    """[OURS] the train stream of step s, round r: distinct for every (seed, step, round)."""
    return (seed * 1_000_003 + step) * 64 + round_


class Prompts:
    """The prompt source of a run (module docstring): ``draw`` → examples, ``observe`` → σ."""

    def __init__(
        self, task: Task, *, sampler: str, pool_size: int, seed: int, settings: Any = None
    ) -> None:
        if sampler not in sampling.SAMPLERS:
            raise ValueError(
                f"unknown prompt sampler {sampler!r}; valid: {', '.join(sampling.names())}"
            )
        self.task, self.seed = task, seed
        self.pool: list[Example] | None = None
        self.sampler: sampling.PromptSampler | None = None
        if sampler == "uniform" and pool_size == 0:
            return  # the stream
        pool: dict[str, Example] = {}
        for ex in task.examples("train", pool_size or DEFAULT_POOL, seed + _POOL_SEED):
            pool.setdefault(ex.id, ex)  # a dataset task cycles its rows: keep each once
        self.pool = list(pool.values())
        self.sampler = sampling.make(sampler, len(self.pool), **sampler_params(sampler, settings))

    @property
    def mode(self) -> str:
        return "stream" if self.sampler is None else "pool"

    def draw(self, n: int, step: int, round_: int) -> tuple[list[Example], torch.Tensor | None]:
        """``n`` examples for (step, round), and their pool indices ``[n]`` (None: stream)."""
        seed = prompt_seed(self.seed, step, round_)
        if self.sampler is None or self.pool is None:
            return self.task.examples("train", n, seed), None
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.sampler.begin_step(step)
        idx = self.sampler.sample(n, gen)  # [n]
        return [self.pool[i] for i in idx.tolist()], idx

    def importance_weights(self, indices: torch.Tensor | None) -> torch.Tensor | None:
        """``[n]`` 1/(|pool|·p_x) of the prompts ``indices`` just drew (None: the stream).

        Call it before :meth:`observe`, which moves p: these are the probabilities the draw
        was made with (``sampling.PromptSampler.importance_weights``; ``is_grpo_exact``).
        """
        if self.sampler is None or indices is None:
            return None
        return self.sampler.importance_weights(indices)

    def observe(self, indices: torch.Tensor | None, rewards: torch.Tensor) -> None:
        """Tell the sampler the within-group reward std ``[n]`` of the groups ``indices`` drew
        and their success (valid rewards rescaled to [0, 1] by the task's reward range, summed)
        and valid counts ``[n]``."""
        if self.sampler is None or indices is None:
            return
        lo, hi = getattr(self.task, "reward_range", (0.0, 1.0))
        valid = ~torch.isnan(rewards)  # [n, G]
        unit = ((torch.nan_to_num(rewards, nan=lo) - lo) / (hi - lo)).clamp(0, 1)  # [n, G]
        successes = (unit * valid).sum(-1).double().cpu()  # [n]
        trials = valid.sum(-1).double().cpu()  # [n]
        sigma = advantages.group_std(rewards).cpu()
        self.sampler.observe_groups(indices, sigma, successes, trials)

    def metrics(self) -> dict[str, float]:
        return {} if self.sampler is None else self.sampler.stats()

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.sampler is None else self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.sampler is not None and state is not None:
            self.sampler.load_state_dict(state)
