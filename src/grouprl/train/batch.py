"""Batch construction for a step: sample groups, score them, join rounds; and held-out evaluation.

The step (:func:`grouprl.train.loop.train_step`) calls these in order:

- :func:`sample_groups`: G completions per prompt (:meth:`grouprl.train.policy.Policy.generate`)
  at the step's temperature, and their rewards ``[P, G]`` (a :class:`Scorer`: NaN =
  unscorable, counted, too many stops the run);
- :func:`join_rounds`: the kept groups of every generation round (one round, or several
  under DAPO's dynamic sampling) as one prompt-major :class:`Batch`.

:func:`evaluate` measures pass@k on a fixed held-out set with its own fixed generator, so the
numbers before and after training are paired (same prompts, same random stream) and an
evaluation never perturbs the training run's random state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from grouprl import diagnostics
from grouprl.rollout import hf
from grouprl.tasks.base import Example, Task
from grouprl.tasks.verify import BatchScores
from grouprl.train.policy import Policy
from grouprl.types import Rollouts

if TYPE_CHECKING:
    from grouprl.train.config import RunConfig, SamplingConfig

__all__ = [
    "Batch",
    "Round",
    "Scorer",
    "evaluate",
    "greedy_rewards",
    "group_rows",
    "join_rounds",
    "sample_groups",
    "sampling_at",
]


@dataclass(frozen=True)
class Batch:
    """One step's training data, prompt-major (row ``p * G + g``), complete when built.

    Everything the update reads about the samples; what it fits them to (advantages, keep
    flags, KL weights, reference log-probs, clip bounds) is the step's
    :class:`grouprl.train.targets.Targets`.
    """

    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor  # [N, Tp]
    completion_ids: torch.Tensor  # [N, T] right-padded
    mask: torch.Tensor  # [N, T] float loss mask (truncated completions zeroed by overlong="mask")
    old_logp: torch.Tensor  # [N, T] behaviour log-probs from the sampler
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without EOS
    rewards: torch.Tensor  # [P, G] NaN = unscorable
    example_ids: tuple[str, ...]  # [P]
    group_size: int
    temperature: float  # of old_logp and of every log-prob the step computes on this batch
    baseline: torch.Tensor | None = None  # [P] reward of each prompt's greedy completion (ReMax)
    reward_parts: torch.Tensor | None = None  # [P, G, K] per reward function (GDPO), NaN = None
    reward_weights: tuple[float, ...] | None = None  # [K] the functions' weights
    verifier_rewards: torch.Tensor | None = None
    """``[P, G]`` the verifier's rewards before any shaping (DAPO's soft overlong penalty); the
    focal weight's μ̂ reads these (F-GRPO eq. 11). None: ``rewards`` are unshaped."""
    draw_weights: torch.Tensor | None = None
    """``[P]`` the importance weight 1/(|pool|·p_x) of each group's prompt draw (a prompt
    sampler over a pool); None: a fresh stream."""
    rollout_logp: torch.Tensor | None = None
    """[N, T] the sampler's own log-probs when it ran at another precision than the trainer
    (``model.rollout_precision``): ``old_logp`` is then the trainer's recomputation at the
    behaviour parameters, and the pair feeds the rollout correction (ALGORITHMS.md §3c).
    None when matched: ``old_logp`` is the sampler's and the trainer's alike."""
    kept_ids: torch.Tensor | None = None
    """``[N, T, K]`` int32 the token ids the sampler kept at each position (-1 padding) under
    ``sampling.logprob_support=truncated``: every log-prob pass on this batch (behaviour
    recomputation, training forward, reference, entropy) reads the distribution renormalised
    over them (``Policy.logprobs``). None: the full softmax."""
    log_kept_mass: torch.Tensor | None = None
    """``[N, T]`` log of the sampling distribution's mass on each position's kept set (0 at
    padding) whenever the sampler truncates (top-p < 1 or top-k > 0); None when it does not."""

    @property
    def size(self) -> int:
        """N = P·G sequences."""
        return self.completion_ids.shape[0]

    @property
    def num_prompts(self) -> int:
        """P groups."""
        return self.rewards.shape[0]


@dataclass(frozen=True)
class Round:
    """One generation round: its examples, rollouts, rewards ``[n, G]`` and the kept groups."""

    examples: list[Example]
    rollouts: Rollouts
    rewards: torch.Tensor  # [n, G]
    kept: torch.Tensor  # [k] indices into the n groups
    baseline: torch.Tensor | None = None  # [n] greedy completions' rewards (ReMax)
    reward_parts: torch.Tensor | None = None  # [n, G, K] per reward function (GDPO)
    reward_weights: tuple[float, ...] | None = None  # [K]
    verifier_rewards: torch.Tensor | None = None  # [n, G] before shaping; None = rewards
    draw_weights: torch.Tensor | None = None  # [n] 1/(|pool|·p_x); None = a fresh stream


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[k·G]`` row indices of the prompt-major samples of groups ``[k]``, in group order."""
    offsets = torch.arange(group_size, device=groups.device)  # [G]
    return (groups[:, None] * group_size + offsets).reshape(-1)


# ---- sampling and scoring --------------------------------------------------------------------


def sampling_at(
    s: SamplingConfig,
    temperature: float | torch.Tensor,
    logprob_temperature: float | None = None,
) -> tuple[hf.Sampling, torch.Tensor | None]:
    """The rollout settings of ``sampling`` at ``temperature`` (a float, or ``[P]`` per prompt:
    AGPO's τ_t) and the per-prompt temperatures (None for a float).

    ``logprob_temperature``: of the behaviour log-probs (None = the sampling one).
    """
    per_prompt = isinstance(temperature, torch.Tensor)
    settings = hf.Sampling(
        temperature=float(temperature.mean()) if per_prompt else temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        logprob_temperature=logprob_temperature,
        draw=s.draw,
        top_k=s.top_k,
        logprob_support=s.logprob_support,
    )
    return settings, temperature if per_prompt else None


def sample_groups(
    policy: Policy,
    scorer: Scorer,
    examples: list[Example],
    group_size: int,
    sampling: hf.Sampling,
    gen: torch.Generator,
    *,
    temperatures: torch.Tensor | None = None,
    timer: Any = None,
) -> tuple[Rollouts, torch.Tensor, BatchScores]:
    """``group_size`` completions per example, their rewards ``[P, G]`` and the scoring record.

    ``sampling``: the rollout settings (:func:`sampling_at`); ``temperatures``: ``[P]`` per
    example, replacing ``sampling.temperature``.
    """
    timer = timer or _NoTimer()
    with timer("generate"):
        prompts = [scorer.task.render(ex, policy.tokenizer) for ex in examples]
        roll = policy.generate(prompts, group_size, sampling, gen, temperatures=temperatures)
    if sampling.records_support and roll.kept_ids is None:
        raise ValueError(
            "sampling.logprob_support=truncated needs the sampler's kept token sets, and "
            "these rollouts carry none (Rollouts.kept_ids): sample with grouprl.rollout.hf."
            "generate, which records them, or set sampling.logprob_support=full"
        )
    with timer("score"):
        refs = [ex.reference for ex in examples for _ in range(group_size)]
        ids = [r[m].tolist() for r, m in zip(roll.completion_ids, roll.completion_mask.bool())]
        scores = scorer(roll.texts, refs, ids)  # token ids: TRL reward functions get them
    rewards = torch.tensor(scores.rewards, dtype=torch.float32, device=policy.device)  # [N]
    return roll, rewards.view(len(examples), group_size), scores


@dataclass(frozen=True)
class Scorer:
    """How a run scores decoded completions: the task's verifier under the sampling settings.

    ``step`` / ``max_steps``: where the run is (TRL-style reward functions receive them);
    ``say``: where the verifier's errors are written (None: nowhere, the count is in the
    metrics). :meth:`at` gives the scorer of another step.
    """

    task: Task
    timeout_s: float = 0.0
    max_unscorable_frac: float = 1.0
    max_steps: int = 0
    step: int = 0
    say: Callable[[str], None] | None = None

    def at(self, step: int) -> Scorer:
        return replace(self, step=step)

    def __call__(
        self, texts: list[str], references: list[Any], completion_ids: list | None = None
    ) -> BatchScores:
        """Rewards of decoded completions (NaN = unscorable), their counters and extra metrics.

        A task with a batched reward path (``reward_batch``: the dataset task's TRL-style
        reward functions, ``grouprl.tasks.rewards``) scores the whole batch with one call per
        function, under the same timeout and unscorable limit, with the completions' token
        ids.

        ``timeout_s > 0`` (``sampling.verify_timeout_s``): each call runs in a forked worker
        under that timeout (``grouprl.tasks.verify.score_batch``); 0: in this process, an
        exception is a NaN [OURS: for cheap, trusted verifiers such as the maze, where a fork
        per batch costs more than the scoring]. Either way more than ``max_unscorable_frac``
        NaN stops the run.
        """
        from grouprl.tasks.verify import UnscorableError, score_batch

        task = self.task
        if hasattr(task, "reward_batch"):  # batched reward functions
            out = task.reward_batch(
                texts, references, completion_ids, step=self.step, max_steps=self.max_steps,
                timeout_s=self.timeout_s, max_unscorable_frac=self.max_unscorable_frac,
            )  # fmt: skip
        elif self.timeout_s > 0:
            out = score_batch(
                task.verify,
                texts,
                references,
                timeout_s=self.timeout_s,
                max_unscorable_frac=self.max_unscorable_frac,
                reward_range=tuple(task.reward_range),
            )
        else:
            values, errors = [], []
            for text, ref in zip(texts, references):
                try:
                    values.append(float(task.verify(text, ref)))
                    if math.isnan(values[-1]):
                        errors.append("the verifier returned NaN")
                except Exception as err:
                    values.append(math.nan)
                    errors.append(f"{type(err).__name__}: {err}")
            out = BatchScores(values, sum(math.isnan(v) for v in values), errors[:5])
            if out.unscorable_frac > self.max_unscorable_frac:
                raise UnscorableError(
                    f"{out.unscorable_frac:.0%} of {len(values)} completions could not be "
                    f"scored, above sampling.max_unscorable_frac={self.max_unscorable_frac}; "
                    f"first errors: {errors[:5]}. Fix the verifier before training."
                )
        if out.unscorable and self.say is not None:  # a sample in the log, the count in metrics
            self.say(
                f"step {self.step}: {out.unscorable} unscorable completion(s) (NaN); {out.errors}"
            )
        return out


class _NoTimer:
    """A timer that times nothing (evaluation, AGPO's probe outside a step's timer)."""

    def __call__(self, name: str) -> Any:
        from contextlib import nullcontext

        return nullcontext()


# ---- joining rounds into a batch -------------------------------------------------------------


def _pad(t: torch.Tensor, width: int, left: bool, value: float = 0) -> torch.Tensor:
    extra = width - t.shape[1]
    return F.pad(t, (extra, 0) if left else (0, extra), value=value) if extra else t


def join_rounds(rounds: list[Round], pad_id: int, temperature: float) -> Batch:
    """The kept groups of every round as one prompt-major :class:`Batch` (padded to one width).

    ``temperature``: the log-prob temperature of the rollouts' ``old_logp``.
    """
    g = rounds[0].rollouts.group_size
    wp = max(r.rollouts.prompt_ids.shape[1] for r in rounds)
    wc = max(r.rollouts.completion_ids.shape[1] for r in rounds)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("pi", "pm", "ci", "cm", "lp", "tr")}
    rewards, ids, base, split, raw, weights = [], [], [], [], [], []
    for r in rounds:
        roll = r.rollouts
        rows = group_rows(r.kept, g).to(roll.prompt_ids.device)  # [k·G]
        parts["pi"].append(_pad(roll.prompt_ids[rows], wp, True, pad_id))
        parts["pm"].append(_pad(roll.prompt_mask[rows], wp, True))
        parts["ci"].append(_pad(roll.completion_ids[rows], wc, False, pad_id))
        parts["cm"].append(_pad(roll.completion_mask[rows], wc, False))
        parts["lp"].append(_pad(roll.old_logp[rows], wc, False))
        parts["tr"].append(roll.truncated[rows])
        kept = r.kept.to(r.rewards.device)
        rewards.append(r.rewards[kept])
        raw.append((r.rewards if r.verifier_rewards is None else r.verifier_rewards)[kept])
        if r.draw_weights is not None:
            weights.append(r.draw_weights[r.kept.to(r.draw_weights.device)])
        ids += [r.examples[i].id for i in r.kept.tolist()]
        if r.baseline is not None:
            base.append(r.baseline[kept])
        if r.reward_parts is not None:
            split.append(r.reward_parts[kept])
    c = {k: torch.cat(v) for k, v in parts.items()}
    kept_ids, log_mass = _join_kept(rounds, g, wc)
    shaped = any(r.verifier_rewards is not None for r in rounds)
    return Batch(
        prompt_ids=c["pi"],
        prompt_mask=c["pm"],
        completion_ids=c["ci"],
        mask=c["cm"].float(),
        old_logp=c["lp"].float(),
        truncated=c["tr"],
        rewards=torch.cat(rewards),
        example_ids=tuple(ids),
        group_size=g,
        temperature=temperature,
        baseline=torch.cat(base) if len(base) == len(rounds) else None,
        reward_parts=torch.cat(split) if len(split) == len(rounds) else None,
        reward_weights=rounds[0].reward_weights,
        verifier_rewards=torch.cat(raw) if shaped else None,
        draw_weights=torch.cat(weights) if len(weights) == len(rounds) else None,
        kept_ids=kept_ids,
        log_kept_mass=log_mass,
    )


def _join_kept(
    rounds: list[Round], g: int, width: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kept groups' ``kept_ids`` ``[N, T, K]`` (-1 padded to one T and K) and
    ``log_kept_mass`` ``[N, T]`` (0 padded) of every round, each None when no round has it.

    A round without kept sets next to one with them cannot be read on one support: an error.
    """
    out: list[torch.Tensor | None] = []
    for name in ("kept_ids", "log_kept_mass"):
        values = [getattr(r.rollouts, name) for r in rounds]
        if all(v is None for v in values):
            out.append(None)
            continue
        if any(v is None for v in values):
            raise ValueError(
                f"some generation rounds carry {name} and some do not: one batch must be "
                "sampled with one sampling setting"
            )
        k = max(v.shape[-1] for v in values) if name == "kept_ids" else 0
        parts = []
        for r, v in zip(rounds, values):
            rows = group_rows(r.kept, g).to(v.device)  # [k·G]
            v = v[rows]
            if name == "kept_ids":  # [n, T, K] -> [n, width, k]
                v = F.pad(v, (0, k - v.shape[-1], 0, width - v.shape[1]), value=-1)
            else:
                v = _pad(v, width, False)
            parts.append(v)
        out.append(torch.cat(parts))
    return out[0], out[1]


def greedy_rewards(
    policy: Policy,
    scorer: Scorer,
    examples: list[Example],
    sampling: hf.Sampling,
    gen: torch.Generator,
    *,
    timer: Any = None,
) -> tuple[Rollouts, torch.Tensor]:
    """One greedy (argmax-decoded) completion per example and its reward ``[P, 1]``: ReMax's
    baseline (arXiv 2310.10505, Algorithm 1; verl generates it next to the sampled ones with
    ``do_sample=False``). ``sampling``: the rollout settings; only the temperature changes."""
    greedy = replace(sampling, temperature=0.0, logprob_temperature=None)
    roll, rewards, _ = sample_groups(policy, scorer, examples, 1, greedy, gen, timer=timer)
    return roll, rewards


# ---- held-out evaluation -----------------------------------------------------------------------


@torch.no_grad()
def evaluate(policy: Policy, scorer: Scorer, cfg: RunConfig) -> dict[str, float]:
    """pass@k (unbiased, Chen et al. 2021) on ``eval.prompts`` held-out examples.

    A sample is correct when its reward reaches the top of the task's reward range
    (within 1e-6) [OURS]; NaN counts as not correct. The eval generator is re-seeded from
    ``run.seed`` each time, so every evaluation sees the same prompts and random stream.
    """
    e, seed, task = cfg.eval, cfg.run.seed, scorer.task
    examples = task.examples("eval", e.prompts, seed)
    gen = torch.Generator(device=policy.device).manual_seed(seed + 7_777_777)
    sampling, _ = sampling_at(cfg.sampling, e.temperature)
    per_call = max(1, 512 // e.samples)
    correct, rewards = [], []
    for start in range(0, len(examples), per_call):
        chunk = examples[start : start + per_call]
        _, r, _ = sample_groups(policy, scorer, chunk, e.samples, sampling, gen)
        rewards.append(r)
        correct.append((r >= task.reward_range[1] - 1e-6).sum(-1))
    c = torch.cat(correct).cpu().numpy()
    out = {f"eval/pass@{k}": float(np.mean(diagnostics.pass_at_k(e.samples, c, k))) for k in e.ks}
    out["eval/reward_mean"] = float(torch.nanmean(torch.cat(rewards)))
    return out
