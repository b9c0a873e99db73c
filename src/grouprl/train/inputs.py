"""What the trainer provides to the methods, by input name (``grouprl.registry.INPUTS``).

A method's declaration names what it reads beyond the rewards; the preset's union of them is
``Preset.reads``. The trainer computes exactly those inputs, each with its provider here, and
passes them by name: nothing in ``train/`` asks which method it serves. Three moments:

- :data:`ROUND`: per generation round, while its prompts are at hand (one greedy completion
  per prompt, each reward function's rewards);
- :data:`STEP`: per step, for the advantages, from the joined batch;
- :data:`LOSS`: inside the update (``train/update.py``): the token entropies, the step-level
  token selection, and the current policy's log-probs for a per-micro-batch correction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.train.batch import Batch, greedy_rewards

__all__ = ["LOSS", "ROUND", "STEP", "RoundView", "round_inputs", "step_inputs"]


@dataclass
class RoundView:
    """One generation round as the round-level providers see it."""

    policy: Any
    scorer: Any
    examples: list
    scores: Any  # the scorer's result: per_function, function_weights
    settings: Any  # the round's sampling settings
    overlong: Any  # train.filters.Overlong: the shaping the samples got
    gen: torch.Generator
    timer: Any
    device: torch.device


def _baseline(r: RoundView) -> dict[str, Any]:
    """``baseline [n]``: one greedy completion per prompt and its reward (ReMax, arXiv
    2310.10505 Algorithm 1); the soft overlong penalty applies to it as to the samples
    [OURS]."""
    greedy, base = greedy_rewards(r.policy, r.scorer, r.examples, r.settings, r.gen, timer=r.timer)
    return {"baseline": r.overlong.rewards(base, greedy.completion_mask)[:, 0]}  # [n]


def _reward_parts(r: RoundView) -> dict[str, Any]:
    """``reward_parts [n, G, K]`` and ``reward_weights``: each reward function's value, when
    the task has several functions (one function: nothing, the rewards are its values)."""
    if r.scores.per_function is None:
        return {}
    k = len(r.scores.function_weights)
    parts = torch.tensor(r.scores.per_function, dtype=torch.float32, device=r.device)
    return {
        "reward_parts": parts.view(len(r.examples), -1, k),  # [n, G, K]
        "reward_weights": tuple(r.scores.function_weights),
    }


ROUND: dict[str, Callable[[RoundView], dict[str, Any]]] = {
    "baseline": _baseline,
    "reward_parts": _reward_parts,
}
"""Round-level inputs: name -> provider of the ``Round`` fields that carry it."""


def round_inputs(reads: frozenset[str], view: RoundView) -> dict[str, Any]:
    """The round-level inputs among ``reads``, as ``Round`` keyword arguments."""
    out: dict[str, Any] = {}
    for name in sorted(reads & set(ROUND)):
        out.update(ROUND[name](view))
    return out


def _tokens(batch: Batch, x: torch.Tensor) -> torch.Tensor:
    return x.view(batch.num_prompts, batch.group_size, -1)  # [P, G, T]


STEP: dict[str, Callable[[Any, Batch], Any]] = {
    "lengths": lambda run, b: b.mask.sum(-1).view(b.num_prompts, b.group_size),  # [P, G]
    "baseline": lambda run, b: b.baseline,  # [P]
    "reward_parts": lambda run, b: b.reward_parts,  # [P, G, K]; None with one function
    "verifier_rewards": lambda run, b: b.verifier_rewards,  # [P, G]; None: not shaped
    "draw_weights": lambda run, b: b.draw_weights,  # [P]; None: a fresh stream
    "trigger": lambda run, b: run.trigger,
    "old_logp": lambda run, b: _tokens(b, b.old_logp),  # [P, G, T]
    # one no-grad forward of the batch at its log-prob temperature
    "sum_pi_squared": lambda run, b: _tokens(
        b, run.policy.batch_logprobs(b, sum_pi_squared=True).sum_pi_squared
    ),
}
"""Step-level inputs: name -> ``provider(run, batch)``, the value under that name."""


def step_inputs(reads: frozenset[str], run: Any, batch: Batch) -> dict[str, Any]:
    """The step-level inputs among ``reads``, by name."""
    return {name: STEP[name](run, batch) for name in sorted(reads & set(STEP))}


LOSS: Mapping[str, str] = {
    "entropy": "train.update: the policy's log-probs with entropy=True",
    "step_selection": "train.update.step_selection: the surrogate's select over the step",
    "current_logp": "train.update: the rollout correction of the micro-batch's log-probs",
    "train_logp": "losses.correction.compute: the batch's log-probs at the training precision",
    "rollout_logp": "losses.correction.compute: the rollout engine's log-probs (stage 2b)",
}
"""Loss-side inputs, provided inside the update (where each is computed)."""
