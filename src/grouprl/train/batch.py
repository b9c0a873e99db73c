"""Stages 1-2 of a step and the held-out evaluation: prompts → rollouts → rewards.

``collect`` samples the step's prompts, generates G completions each, verifies them
(NaN = unscorable, counted, too many stops the run), applies the preset's overlong rule
and, for DAPO-style presets, repeats until the batch holds P informative groups.
``evaluate`` measures pass@k on a fixed held-out set with its own fixed generator, so the
numbers before and after training are paired (same prompts, same random stream) and an
evaluation never perturbs the training run's random state.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from grouprl import diagnostics
from grouprl.losses import filters
from grouprl.types import Advantages, Rollouts

__all__ = ["Batch", "collect", "evaluate", "score"]


@dataclass
class Batch:
    """One step's training data, prompt-major (row ``p * G + g``); ``attach`` adds advantages."""

    prompt_ids: torch.Tensor  # [N, Tp]
    prompt_mask: torch.Tensor  # [N, Tp]
    completion_ids: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] loss mask (truncated completions zeroed under overlong="mask")
    old_logp: torch.Tensor  # [N, T]
    truncated: torch.Tensor  # [N] bool
    rewards: torch.Tensor  # [P, G]
    prompt_ids_text: list[str]  # [P] example ids
    group_size: int
    temperature: float
    adv: torch.Tensor | None = None  # [N]
    keep: torch.Tensor | None = None  # [N] bool: group kept and reward scorable
    kl_weight: torch.Tensor | None = None  # [N]
    ref_logp: torch.Tensor | None = None  # [N, T]

    @property
    def size(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def num_prompts(self) -> int:
        return self.rewards.shape[0]

    def attach(self, adv: Advantages, ref_logp: torch.Tensor | None) -> None:
        """Per-sample advantages, keep and KL weights from the per-group ``Advantages``.

        [OURS] an unscorable (NaN-reward) sample is left out of the loss entirely, KL branch
        included: it carries no reward signal and must not count in the normaliser.
        """
        g = self.group_size
        self.adv = adv.per_sample.detach().float()  # [N]
        valid = ~torch.isnan(self.rewards).reshape(-1)  # [N]
        self.keep = adv.keep.repeat_interleave(g) & valid  # [N]
        self.kl_weight = adv.kl_weight.float().repeat_interleave(g)  # [N]
        self.ref_logp = ref_logp


def _pad(t: torch.Tensor, width: int, left: bool, value: float = 0) -> torch.Tensor:
    extra = width - t.shape[1]
    return F.pad(t, (extra, 0) if left else (0, extra), value=value) if extra else t


def _concat(
    parts: list[tuple[list[Any], Rollouts, torch.Tensor, torch.Tensor]],
    pad_id: int,
    temperature: float,
) -> Batch:
    """Join rounds of (examples, rollouts, rewards [p, G], kept group indices) into a Batch."""
    g = parts[0][1].group_size
    wp = max(r.prompt_ids.shape[1] for _, r, _, _ in parts)
    wc = max(r.completion_ids.shape[1] for _, r, _, _ in parts)
    cols: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("pi", "pm", "ci", "cm", "lp", "tr", "rw")
    }
    ids: list[str] = []
    for examples, r, rewards, groups in parts:
        rows = (groups[:, None] * g + torch.arange(g)).reshape(-1)  # [n]
        cols["pi"].append(_pad(r.prompt_ids[rows], wp, True, pad_id))
        cols["pm"].append(_pad(r.prompt_mask[rows], wp, True))
        cols["ci"].append(_pad(r.completion_ids[rows], wc, False, pad_id))
        cols["cm"].append(_pad(r.completion_mask[rows], wc, False))
        cols["lp"].append(_pad(r.old_logp[rows], wc, False))
        cols["tr"].append(r.truncated[rows])
        cols["rw"].append(rewards[groups])
        ids += [examples[i].id for i in groups.tolist()]
    c = {k: torch.cat(v) for k, v in cols.items()}
    return Batch(
        c["pi"],
        c["pm"],
        c["ci"],
        c["cm"].float(),
        c["lp"].float(),
        c["tr"],
        c["rw"],
        ids,
        g,
        temperature,
    )


def score(run: Any, texts: list[str], references: list[Any]) -> tuple[torch.Tensor, dict]:
    """Rewards ``[N]`` of decoded completions (NaN = unscorable) and their counters.

    ``sampling.verify_timeout_s > 0``: each call runs in a forked worker under that timeout
    (``grouprl.tasks.verify.score_batch``); 0: in this process, an exception is a NaN [OURS:
    for cheap, trusted verifiers such as the maze, where a fork per batch costs more than
    the scoring]. Either way more than ``max_unscorable_frac`` NaN stops the run.
    """
    from grouprl.tasks.verify import UnscorableError, score_batch

    s = run.cfg.sampling
    if s.verify_timeout_s > 0:
        out = score_batch(
            run.task.verify,
            texts,
            references,
            timeout_s=s.verify_timeout_s,
            max_unscorable_frac=s.max_unscorable_frac,
            reward_range=tuple(run.task.reward_range),
        )
        _log_errors(run, out.unscorable, out.errors)
        return torch.tensor(out.rewards, dtype=torch.float32), out.metrics()
    values, errors = [], []
    for text, ref in zip(texts, references):
        try:
            values.append(float(run.task.verify(text, ref)))
            if math.isnan(values[-1]):
                errors.append("the verifier returned NaN")
        except Exception as err:
            values.append(math.nan)
            errors.append(f"{type(err).__name__}: {err}")
    rewards = torch.tensor(values, dtype=torch.float32)
    frac = float(torch.isnan(rewards).float().mean()) if values else 0.0
    if frac > s.max_unscorable_frac:
        raise UnscorableError(
            f"{frac:.0%} of {len(values)} completions could not be scored, above "
            f"sampling.max_unscorable_frac={s.max_unscorable_frac}; first errors: "
            f"{errors[:5]}. Fix the verifier before training."
        )
    _log_errors(run, len(errors), [f"{e}" for e in errors[:5]])
    return rewards, {"reward/unscorable_frac": frac, "reward/unscorable": float(len(errors))}


def _log_errors(run: Any, count: int, sample: list[str]) -> None:
    """A sample of the verifier's errors in the log (the count is in the metrics)."""
    if count and getattr(run, "sinks", None) is not None:
        run.sinks.print(f"step {run.step}: {count} unscorable completion(s) (NaN); {sample}")


def rollout(
    run: Any,
    examples: list[Any],
    group_size: int,
    temperature: float,
    gen: torch.Generator,
    times: dict[str, float] | None = None,
) -> tuple[Rollouts, torch.Tensor, dict]:
    """Generate ``group_size`` completions per example and score them: rewards ``[P, G]``."""
    from grouprl.rollout import hf

    t0 = time.perf_counter()
    prompts = [run.task.render(ex, run.tokenizer) for ex in examples]
    s = run.cfg.sampling
    sampling = hf.Sampling(temperature=temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
    roll = hf.generate(run.model, run.tokenizer, prompts, group_size, sampling, gen)
    t1 = time.perf_counter()
    refs = [ex.reference for ex in examples for _ in range(group_size)]
    rewards, metrics = score(run, roll.texts, refs)
    if times is not None:
        times["generate"] += t1 - t0
        times["score"] += time.perf_counter() - t1
    return roll, rewards.view(len(examples), group_size), metrics


def _overlong(run: Any, roll: Rollouts, rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's soft overlong penalty on the rewards (``overlong="soft"``)."""
    if run.preset.overlong != "soft":
        return rewards
    s = run.cfg.sampling
    lengths = roll.completion_mask.sum(-1).view_as(rewards)  # [P, G]
    cache = s.overlong_cache or max(1, s.max_new_tokens // 5)
    return filters.apply_overlong_penalty(
        rewards, lengths, max_len=s.max_new_tokens, cache_len=cache
    )


def _prompt_seed(seed: int, step: int, round_: int) -> int:
    """[OURS] the train stream of step s, round r: distinct for every (seed, step, round)."""
    return (seed * 1_000_003 + step) * 64 + round_


def collect(run: Any, times: dict[str, float]) -> tuple[Batch, dict[str, float]]:
    """Stages 1-2: the step's prompts, their groups and rewards (dynamic sampling aware)."""
    cfg, preset = run.cfg, run.preset
    p, g = cfg.sampling.prompts_per_step, cfg.sampling.group_size
    metrics: dict[str, float] = {}
    temperature = cfg.sampling.temperature
    sampler = (
        filters.DynamicSampler(p, max_tries=cfg.sampling.max_resample_tries, on_exhausted="partial")
        if preset.dynamic_sampling
        else None
    )
    parts, unscorable, round_ = [], [], 0
    sampled_collapsed = sampled_groups = 0.0  # every group generated, before any filter
    while True:
        n = p if sampler is None else sampler.next_draw()
        examples = run.task.examples("train", n, _prompt_seed(cfg.run.seed, run.step, round_))
        if run.agpo is not None and round_ == 0:  # AGPO probe at τ_base: sets τ, no gradient
            probe, probe_rewards, _ = rollout(run, examples, g, temperature, run.gen, times)
            temperature, agpo_metrics = run.agpo.temperature_from_probe(probe_rewards, probe.texts)
            metrics.update(agpo_metrics)
        roll, rewards, m = rollout(run, examples, g, temperature, run.gen, times)
        unscorable.append(m["reward/unscorable_frac"])
        rewards = _overlong(run, roll, rewards)
        sampled_collapsed += diagnostics.acr(rewards) * n
        sampled_groups += n
        keep = torch.arange(n) if sampler is None else sampler.add(rewards)
        parts.append((examples, roll, rewards, keep))
        round_ += 1
        if sampler is None or sampler.done:
            break
    pad_id = getattr(run.tokenizer, "pad_token_id", None) or 0
    batch = _concat(parts, pad_id, temperature)
    if preset.overlong == "mask":
        batch.mask = filters.mask_truncated(batch.mask, batch.truncated)
    if sampler is not None:
        metrics.update({f"dynamic/{k}": v for k, v in sampler.stats().items()})
    lengths = batch.mask.sum(-1)
    metrics.update(
        {
            "reward/unscorable_frac": float(np.mean(unscorable)),
            # ACR of every generated group: with dynamic sampling acr/rate is measured after
            # the collapsed groups were dropped, so the rollouts they wasted show only here
            "acr/sampled_rate": sampled_collapsed / sampled_groups,
            "length/mean": float(lengths.mean()),
            "length/truncated_frac": float(batch.truncated.float().mean()),
            "sampling/temperature": float(temperature),
        }
    )
    return batch, metrics


@torch.no_grad()
def evaluate(run: Any) -> dict[str, float]:
    """pass@k (unbiased, Chen et al. 2021) on ``eval.prompts`` held-out examples.

    A sample is correct when its reward reaches the top of the task's reward range
    (within 1e-6) [OURS]; NaN counts as not correct. The eval generator is re-seeded from
    ``run.seed`` each time, so every evaluation sees the same prompts and random stream.
    """
    e, seed = run.cfg.eval, run.cfg.run.seed
    examples = run.task.examples("eval", e.prompts, seed)
    gen = torch.Generator().manual_seed(seed + 7_777_777)
    per_call = max(1, 512 // e.samples)
    correct, rewards = [], []
    for start in range(0, len(examples), per_call):
        chunk = examples[start : start + per_call]
        _, r, _ = rollout(run, chunk, e.samples, e.temperature, gen)
        rewards.append(r)
        correct.append((r >= run.task.reward_range[1] - 1e-6).sum(-1))
    c = torch.cat(correct).numpy()
    out = {f"eval/pass@{k}": float(np.mean(diagnostics.pass_at_k(e.samples, c, k))) for k in e.ks}
    out["eval/reward_mean"] = float(torch.nanmean(torch.cat(rewards)))
    return out
