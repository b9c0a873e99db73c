"""The training loop: :func:`train` runs the steps, :func:`train_step` is one step, top to bottom.

One step, its stages in order, the step's tensors as locals::

    1-2. prompts → rollouts → rewards   P examples (a stream, or a pool + a prompt sampler),
         G completions each at the controller's
         temperature, verified → rewards [P, G] (NaN = unscorable, counted; too many stops
         the run); DAPO's overlong penalty; DAPO's dynamic sampling draws more prompts
         until P informative groups are found                     (collect_batch, below)
    2b.  correction    rollouts sampled at another precision (model.rollout_precision): the
                       behaviour log-probs recomputed at the training precision, mismatch/*
                       metrics, the preset's rollout correction      (rollout_correction)
    3.   advantages    advantages.compute(preset) → per sample: adv [N], keep [N], kl_weight [N]
    4.   reference     ref_logp [N, T] (β > 0 only); the controller's clip bounds; all of it
                       one frozen Targets (train/targets.py)
    5.   update        epochs × minibatches of whole groups; each minibatch is one AdamW step
                       whose micro-batches share one StepTotals and the step's token
                       selections (top-entropy threshold, Clip-Cov / KL-Cov), so
                       accumulation is exact                      (update_policy, below)
    6.   metrics       one dict built explicitly: rollout counters, update means, the
                       diagnostics' step metrics, run-health warnings, stage times

Every pass of the policy (rollouts, training forward, reference, AGPO's passes, evaluation)
goes through ``run.policy`` (train/policy.py) under one precision. Everything random draws
from generators that the checkpoint saves, so a resumed run ends with exactly the metrics of
an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from grouprl import advantages, diagnostics, losses
from grouprl.losses import correction
from grouprl.train import filters, resume
from grouprl.train.batch import (
    Batch,
    Round,
    evaluate,
    greedy_rewards,
    group_rows,
    join_rounds,
    sample_groups,
    sampling_at,
)
from grouprl.train.config import RunConfig
from grouprl.train.runlock import RunLock
from grouprl.train.sinks import Sinks
from grouprl.train.state import Run, graceful_stop, save_checkpoint, setup
from grouprl.train.targets import Targets
from grouprl.types import Rollouts

__all__ = ["RunResult", "TrainingError", "schedule_lines", "train", "train_step"]


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite losses in a row, a broken verifier, ...)."""


@dataclass
class RunResult:
    """What ``train`` returns: where the run is, how far it got, its last metrics."""

    run_dir: Path
    step: int
    metrics: dict[str, float]
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    stopped_by: int | None = None
    """The signal number that stopped the run (after a checkpoint), or None."""


# ---- the run -----------------------------------------------------------------------------------


def train(cfg: RunConfig, **injected: Any) -> RunResult:
    """Run (or resume) training with ``cfg``; ``injected`` may pass model/tokenizer/task.

    The run folder is locked for the whole run (``train.runlock``): a second run on it
    raises ``RunFolderBusy`` before anything is loaded or written. A new run in a folder
    that holds an earlier one raises ``ResumeError`` unless ``run.overwrite``
    (``train.resume.fresh_start``).
    """
    with RunLock(cfg.run.out):  # one run per folder
        if not cfg.run.resume:
            resume.fresh_start(cfg)
        return _train(cfg, **injected)


def _train(cfg: RunConfig, **injected: Any) -> RunResult:
    run = setup(cfg, **injected)
    run.sinks = Sinks(
        run.run_dir,
        cfg.to_dict(),
        total_steps=cfg.optim.steps,
        resume_step=run.step,
        tensorboard=cfg.run.tensorboard,
        wandb=cfg.run.wandb,
        progress=cfg.run.progress,
        note=run.resume_note,  # --resume-anyway's change, in the first row
    )
    for line in schedule_lines(cfg, run.preset):
        run.print(line)
    if note := _matched_note(run):
        run.print(f"note: {note}")
    metrics: dict[str, float] = {}
    every, ckpt_every = cfg.eval.every, cfg.run.every
    try:
        with graceful_stop() as stop:
            if run.step == 0 and every:  # the start, logged as step 0 (eval/* keys only)
                run.sinks.log(0, _evaluate(run))
            while run.step < cfg.optim.steps and stop.signum is None:
                run.step += 1
                metrics = train_step(run)
                if every and (run.step % every == 0 or run.step == cfg.optim.steps):
                    metrics.update(_evaluate(run))
                run.sinks.log(run.step, metrics)
                if (ckpt_every and run.step % ckpt_every == 0) or run.step == cfg.optim.steps:
                    save_checkpoint(run)
            if run.step >= cfg.optim.steps and cfg.run.save_final:  # <out>/final/
                from grouprl.train.export import save_run

                save_run(run, say=run.print)
            if stop.signum is not None:
                save_checkpoint(run)
                run.print(
                    f"stopped by signal {stop.signum} after step {run.step}; "
                    f"resume with --resume --out {run.run_dir}"
                )
    finally:
        run.sinks.close()
    return RunResult(run.run_dir, run.step, metrics, run.evals, stop.signum)


def _matched_note(run: Run) -> str | None:
    """A note when a rollout correction is set but sampling runs at the training precision."""
    if not run.policy.matched or run.preset.rollout_correction == "none":
        return None
    return (
        f"algorithm.rollout_correction={run.preset.rollout_correction!r} has nothing to correct: "
        "the rollouts are sampled at the training precision (model.rollout_precision=same), "
        "so their log-probs are the trainer's and every correction weight is 1"
    )


def schedule_lines(cfg: RunConfig, preset: Any) -> list[str]:
    """What the run says about its update schedule before the first step.

    A clip-based surrogate at one optimizer step per batch is a one-line note when that is
    the preset's own schedule (its sources': ``losses.on_policy_note``) and a warning with
    what to set when ``optim.minibatches`` / ``optim.ppo_epochs`` chose another one
    (``losses.on_policy_warning``) [OURS: a warning is for a schedule the user changed].
    """
    schedule = cfg.schedule(preset)  # the preset's update schedule unless optim sets it
    n, epochs = schedule.minibatches, schedule.ppo_epochs
    out = [f"schedule: {schedule.note}"] if schedule.note else []
    if (n, epochs) == (preset.minibatches, preset.ppo_epochs):
        note = losses.on_policy_note(preset.surrogate, preset.name, n, epochs)
        out += [f"note: {note}"] if note else []
    else:
        warning = losses.on_policy_warning(preset.surrogate, n, epochs)
        out += [f"warning: {warning}"] if warning else []
    return out


def _evaluate(run: Run) -> dict[str, float]:
    out = evaluate(run.policy, run.scorer, run.cfg)
    run.evals[run.step] = out
    shown = "  ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in out.items())
    run.print(f"eval step {run.step}: {shown}")
    return out


# ---- one step ----------------------------------------------------------------------------------


def train_step(run: Run) -> dict[str, float]:
    """One training step, stages 1-6 in order (module docstring); returns the step's metrics."""
    t_step = time.perf_counter()
    timer = Timer(run.device)
    preset = run.preset

    # -- 1-2. prompts → rollouts → rewards (dynamic sampling: until P informative groups) ----
    batch, rollout_metrics = collect_batch(run, timer)
    rewards, g = batch.rewards, batch.group_size  # [P, G]

    # -- 2b. rollouts from another engine: the trainer's log-probs, the mismatch, the correction
    batch, corr, corr_metrics = rollout_correction(run, batch, timer)

    # -- 3-4. reference log-probs (β > 0, or a KL in the reward), then the advantages: per
    # group, then per sample (rows p·G + g), or per token (step_advantages) --------------------
    with timer("logprobs"):
        ref_logp = run.reference.logprobs(run.policy, batch)  # [N, T] or None
    adv, adv_n, reward_kl_metrics = step_advantages(run, batch, ref_logp)  # [N] or [N, T]
    # [OURS] an unscorable (NaN-reward) sample leaves the loss entirely, KL branch included:
    # it carries no reward signal and must not count in the normaliser
    keep_n = adv.keep.repeat_interleave(g) & ~torch.isnan(rewards).reshape(-1)  # [N]
    kl_weight_n = adv.kl_weight.float().repeat_interleave(g)  # [N]

    # -- this step's surrogate parameters ------------------------------------------------------
    clip, clip_metrics = run.controller.clip_params(
        run.policy, batch, dict(preset.surrogate_params)
    )
    loss_ref = ref_logp if preset.beta > 0 else None  # the loss-side KL term only when β > 0
    targets = Targets(adv_n, keep_n, kl_weight_n, loss_ref, clip, correction=corr)

    # -- 5. update: epochs × minibatches of whole groups, one AdamW step each ----------------
    low = diagnostics.low_sigma_groups(rewards, adv).repeat_interleave(g)  # [N] Table 3's rows
    log = update_policy(run, batch, targets, timer, low_sigma=low)
    after_metrics = run.controller.after_update(run.policy, batch)

    # -- 6. metrics, built explicitly -------------------------------------------------------
    with timer("diagnostics"):
        metrics = {**rollout_metrics, **corr_metrics, **clip_metrics, **log.metrics()}
        metrics.update(after_metrics)
        metrics.update(reward_kl_metrics)
        metrics["optim/skipped_total"] = float(run.nonfinite_total)
        metrics["optim/lr"] = run.optimizer.param_groups[0]["lr"]
        metrics.update({f"clip/{k}": _mean(v) for k, v in clip.items()})
        metrics.update(diagnostics.step_metrics(rewards, adv, reward_range=run.task.reward_range))
        metrics.update({f"adv/{k}": float(v) for k, v in adv.stats.items()})
        if loss_ref is not None:  # KL of the behaviour policy to the reference, per sequence
            seq_kl = diagnostics.kl_stats(
                losses.kl(preset.kl, batch.old_logp, loss_ref), batch.mask
            )
            metrics["kl/p95"], metrics["kl/max"] = seq_kl["kl/p95"], seq_kl["kl/max"]
        for line in run.health.update(run.step, metrics):
            run.print(f"health: {line}")
        metrics.update(run.health.metrics())
    metrics.update(timer.metrics(step=time.perf_counter() - t_step))
    if run.sinks is not None:
        run.sinks.log_groups(run.step, list(batch.example_ids), rewards)
    return metrics


def _mean(x: float | torch.Tensor) -> float:
    """A logged number: a float, or the mean of a per-prompt / per-sequence tensor."""
    return float(x.float().mean()) if isinstance(x, torch.Tensor) else float(x)


# ---- stages 1-2: the batch -------------------------------------------------------------------


def collect_batch(run: Run, timer: Timer) -> tuple[Batch, dict[str, float]]:
    """Generation rounds until the batch holds P groups (one round without dynamic sampling).

    Each round: draw prompts (``run.prompts``: a fresh stream, or a pool and IS-GRPO's
    sampler, which then observes every generated group's σ), sample G completions each (the
    controller sets the temperature on the first round, one or one per prompt, and the
    log-prob temperature), score them, apply DAPO's soft overlong penalty, keep the groups the
    dynamic sampler accepts.
    ``acr/sampled_rate`` counts every generated group: with dynamic sampling ``acr/rate`` is
    measured after the collapsed groups were dropped, so the rollouts they wasted show only
    there.
    """
    cfg, preset = run.cfg, run.preset
    p, g, s = cfg.sampling.prompts_per_step, cfg.sampling.group_size, cfg.sampling
    sampler = (
        filters.DynamicSampler(p, max_tries=s.max_resample_tries, on_exhausted="partial")
        if preset.dynamic_sampling
        else None
    )
    overlong = filters.Overlong.of(
        preset.overlong, max_new_tokens=s.max_new_tokens, cache=s.overlong_cache
    )
    scorer = run.scorer

    def probe(examples: list, temperature: float) -> tuple[Rollouts, torch.Tensor]:
        """The controller's probe: a group per example at ``temperature``."""
        settings, _ = sampling_at(s, temperature)
        roll, rewards, _ = sample_groups(
            run.policy, scorer, examples, g, settings, run.gen, timer=timer
        )
        return roll, rewards

    metrics: dict[str, float] = {}
    temperature: float | torch.Tensor = s.temperature
    logprob_t = run.controller.logprob_temperature  # None: the sampling temperature
    rounds: list[Round] = []
    unscorable = collapsed = drawn = 0.0
    while not rounds or (sampler is not None and not sampler.done):
        n = p if sampler is None else sampler.next_draw()
        examples, indices = run.prompts.draw(n, run.step, len(rounds))  # [n] pool indices
        if not rounds:
            temperature, controller_metrics = run.controller.temperature(examples, probe)
            metrics.update(controller_metrics)
        weights = run.prompts.importance_weights(indices)  # [n] of this draw, before observe
        settings, per_prompt = sampling_at(s, temperature, logprob_t)
        roll, verified, scores = sample_groups(
            run.policy, scorer, examples, g, settings, run.gen, temperatures=per_prompt,
            timer=timer,
        )  # fmt: skip
        rewards = overlong.rewards(verified, roll.completion_mask)  # DAPO §3.4 ("soft")
        extras = reward_side(run, examples, scores, settings, overlong, timer)
        if rewards is not verified:  # the verifier's own rewards, for the focal weight's μ̂
            extras["verifier_rewards"] = verified
        # IS-GRPO's sampler: σ of every generated group, of the verifier's rewards
        run.prompts.observe(indices, verified)
        unscorable += scores.unscorable_frac
        metrics.update(scores.extra)  # the reward functions' own numbers (dataset tasks)
        collapsed += diagnostics.acr(rewards) * n
        drawn += n
        kept = torch.arange(n, device=rewards.device) if sampler is None else sampler.add(rewards)
        rounds.append(Round(examples, roll, rewards, kept, draw_weights=weights, **extras))
    pad_id = getattr(run.tokenizer, "pad_token_id", None) or 0
    batch = join_rounds(rounds, pad_id, temperature if logprob_t is None else logprob_t)
    batch = replace(batch, mask=overlong.mask(batch.mask, batch.truncated))  # ("mask")
    if sampler is not None:
        metrics.update({f"dynamic/{k}": v for k, v in sampler.stats().items()})
    metrics.update(run.prompts.metrics())
    lengths = batch.mask.sum(-1)
    metrics.update(
        {
            "reward/unscorable_frac": unscorable / len(rounds),
            "acr/sampled_rate": collapsed / drawn,
            "length/mean": float(lengths.mean()),
            "length/truncated_frac": float(batch.truncated.float().mean()),
            "sampling/temperature": _mean(temperature),
        }
    )
    return batch, metrics


def reward_side(
    run: Run,
    examples: list,
    scores: Any,
    settings: Any,
    overlong: filters.Overlong,
    timer: Timer,
) -> dict[str, Any]:
    """What the preset's estimator reads of a round beyond its rewards ``[n, G]``:

    - ``baseline [n]``: one greedy completion per prompt and its reward (ReMax; the soft
      overlong penalty applies to it as to the samples [OURS]);
    - ``reward_parts [n, G, K]`` and ``reward_weights``: each reward function's value, for a
      combination that normalises them separately (GDPO's ``normalize_then_sum``), when the
      task has several functions (one function: the estimator combines ``[n, G]``).
    """
    preset, out = run.preset, {}
    if "baseline" in advantages.needs(preset.estimator, **dict(preset.estimator_params)):
        greedy, base = greedy_rewards(run.policy, run.scorer, examples, settings, run.gen,
                                      timer=timer)  # fmt: skip
        out["baseline"] = overlong.rewards(base, greedy.completion_mask)[:, 0]  # [n]
    if combination(preset) != "sum" and scores.per_function is not None:
        k = len(scores.function_weights)
        parts = torch.tensor(scores.per_function, dtype=torch.float32, device=run.device)
        out["reward_parts"] = parts.view(len(examples), -1, k)  # [n, G, K]
        out["reward_weights"] = tuple(scores.function_weights)
    return out


def combination(preset: Any) -> str:
    """The reward combination the preset's estimator applies (``advantages.compute``)."""
    return preset.reward_combination or advantages.DEFAULT_COMBINATION.get(preset.estimator, "sum")


# ---- stage 3: advantages -----------------------------------------------------------------------


def step_advantages(
    run: Run, batch: Batch, ref_logp: torch.Tensor | None
) -> tuple[advantages.Advantages, torch.Tensor, dict[str, float]]:
    """The step's advantages: ``(Advantages, adv [N] or [N, T], metrics)``.

    Sequence level (``advantages.compute``) unless the preset is token level
    (``Preset.token_level``: a token-level estimator, or a KL folded into the reward), then
    ``advantages.compute_tokens`` on the ``[P, G, T]`` completion mask with the estimator's
    token inputs: the KL penalty −β·KL_t of the behaviour log-probs against the reference
    (``ref_logp``; β from ``run.kl_controller``, which then advances with the measured KL,
    verl's ``apply_kl_penalty``), and Σπ² for the optimal token baseline (one no-grad
    forward of the batch at its log-prob temperature). A ReMax batch carries its greedy
    rewards (``Batch.baseline``), a GDPO batch its per-function rewards.
    """
    preset, rewards, g = run.preset, batch.rewards, batch.group_size  # [P, G]
    p = rewards.shape[0]
    kwargs: dict[str, Any] = dict(preset.advantage_kwargs())
    reads = advantages.needs(preset.estimator, **dict(preset.estimator_params))
    metrics: dict[str, float] = {}
    if batch.reward_parts is not None:
        rewards_in = batch.reward_parts  # [P, G, K]
        kwargs["reward_weights"] = list(batch.reward_weights)
    else:
        rewards_in = rewards
    if "baseline" in reads:
        kwargs["baseline"] = batch.baseline
    token_only = preset.estimator in advantages.TOKEN_ESTIMATORS
    if not token_only:  # the transforms' inputs, for compute()
        kwargs["trigger"] = run.trigger if preset.virtual else None
        kwargs["reward_range"] = tuple(run.task.reward_range)
        # F-GRPO eq. 11: the focal weight's μ̂ is the share of correct rollouts, from the
        # verifier's rewards, not the overlong-shaped ones
        kwargs["verifier_rewards"] = batch.verifier_rewards
        # is_grpo_exact: each group times the importance weight of its prompt's draw
        kwargs["group_weight"] = batch.draw_weights if preset.sampler_weight else None
    if not preset.token_level:
        lengths = batch.mask.sum(-1).view(p, g)  # [P, G] completion tokens (opo, token weights)
        adv = advantages.compute(preset.estimator, rewards_in, lengths=lengths, **kwargs)
        return adv, adv.per_sample.detach().float(), metrics
    mask = batch.mask.view(p, g, -1) > 0  # [P, G, T]
    ctrl = run.kl_controller
    current_kl = None
    if ctrl is not None:
        dense, current_kl = advantages.kl_reward(
            batch.old_logp, ref_logp, batch.mask, ctrl.value, preset.reward_kl
        )
        kwargs["token_rewards"] = dense.view(mask.shape)
        metrics["kl_reward/coef"], metrics["kl_reward/kl"] = float(ctrl.value), current_kl
    if "sum_pi_squared" in reads:
        spi = run.policy.batch_logprobs(batch, sum_pi_squared=True).sum_pi_squared
        kwargs["old_logp"] = batch.old_logp.view(mask.shape)
        kwargs["sum_pi_squared"] = spi.view(mask.shape)
    adv = advantages.compute_tokens(preset.estimator, rewards_in, mask, **kwargs)
    if ctrl is not None:
        ctrl.update(current_kl, n_steps=batch.size)  # verl: after the penalty, per batch
    return adv, adv.per_token.detach().float(), metrics


# ---- stage 2b: rollouts from another engine ----------------------------------------------------


@functools.cache
def _correction_spec(text: str) -> tuple[tuple, tuple]:
    """``(per batch, per micro-batch)`` parts of a rollout-correction spec: the methods of
    ``correction.USES_CURRENT_POLICY`` (``opsm``) read the current policy, so they run in
    the loss; the others run once on the whole batch."""
    spec = correction.parse_spec(text)
    now = correction.USES_CURRENT_POLICY
    return (
        tuple((n, p) for n, p in spec if n not in now),
        tuple((n, p) for n, p in spec if n in now),
    )


def rollout_correction(
    run: Run, batch: Batch, timer: Timer
) -> tuple[Batch, correction.Correction | None, dict[str, float]]:
    """The batch as the trainer sees it when another engine sampled it; unchanged if matched.

    When the rollouts ran at another precision (``model.rollout_precision``, so
    ``Policy.matched`` is False), their log-probs are the engine's (π_rollout): the behaviour
    log-probs are recomputed at the training precision (one forward without gradient, verl's
    decoupled mode: π_old of the ratio) and the engine's kept as ``batch.rollout_logp``. The
    ``mismatch/*`` metrics compare the two on every step, and the preset's
    ``rollout_correction`` runs once on the whole batch (its rejections count in no
    normaliser of the step: ``Targets.loss_mask``); ``opsm`` runs in the loss.
    """
    if run.policy.matched:
        return batch, None, {}
    with timer("logprobs"):
        train_logp = run.policy.batch_logprobs(batch).logp.float()  # [N, T]
    batch = replace(batch, old_logp=train_logp, rollout_logp=batch.old_logp)
    with timer("correction"):
        metrics = diagnostics.mismatch_metrics(batch.old_logp, batch.rollout_logp, batch.mask)
        per_batch, _ = _correction_spec(run.preset.rollout_correction)
        corr = None
        if per_batch:
            corr = correction.compute(per_batch, batch.old_logp, batch.rollout_logp, batch.mask)
            metrics.update(corr.stats)
    return batch, corr, metrics


def _current_policy_correction(
    run: Run, batch: Batch, m: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor
) -> torch.Tensor | None:
    """``[m, T]`` weight of the spec's methods that read the current policy (``opsm``) on
    micro-batch ``m``, against the engine's log-probs; None when there are none."""
    if batch.rollout_logp is None:
        return None
    _, now = _correction_spec(run.preset.rollout_correction)
    if not now:
        return None
    c = correction.compute(now, logp.detach(), batch.rollout_logp[m], batch.mask[m], adv=adv)
    return c.weight


# ---- stage 5: the update ---------------------------------------------------------------------


@dataclass
class UpdateLog:
    """What the update's optimizer steps add up to; :meth:`metrics` turns it into means.

    ``losses`` and ``policy`` hold, per key, the sum over optimizer steps taken of each
    step's value (a step's loss is the sum of its micro-batch losses, exact under
    StepTotals; a step's policy statistic is the sequence-weighted mean over its
    micro-batches [OURS]). Skipped (non-finite) and empty steps are counted, not averaged in.
    """

    taken: int = 0
    skipped: int = 0
    empty: int = 0
    grad_norm: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)
    policy: dict[str, float] = field(default_factory=dict)
    balance: dict[str, float] = field(default_factory=dict)

    def add(self, step: StepStats, grad_norm: float) -> None:
        """One optimizer step taken: its statistics and gradient norm."""
        self.taken += 1
        self.grad_norm += grad_norm
        for key, value in step.losses.items():
            self.losses[key] = self.losses.get(key, 0.0) + value
        for key, value in step.policy.items():
            value = value / (1.0 - step.missing) if step.missing else value
            self.policy[key] = self.policy.get(key, 0.0) + value

    def metrics(self) -> dict[str, float]:
        n = max(self.taken, 1)
        out = {f"loss/{k}": v / n for k, v in self.losses.items()}
        out.update({f"policy/{k}": v / n for k, v in self.policy.items()})
        out["kl/mean"] = out.pop("policy/kl_mean", 0.0)
        out["loss/total"] = out.get("loss/pg", 0.0) + out.get("loss/kl", 0.0)
        if self.taken:
            out["optim/grad_norm"] = self.grad_norm / n
        out["optim/steps"] = float(self.taken)  # optimizer steps taken on this batch
        out["optim/skipped_steps"] = float(self.skipped)
        out["optim/empty_steps"] = float(self.empty)
        out.update(self.balance)  # measured once per step, not averaged
        return out


@dataclass
class StepStats:
    """One optimizer step's statistics, summed over its micro-batches: the losses as sums
    (exact under StepTotals), every other statistic of ``losses.objective`` weighted by the
    micro-batch's share of the step's sequences [OURS]."""

    losses: dict[str, float] = field(default_factory=dict)
    policy: dict[str, float] = field(default_factory=dict)
    missing: float = 0.0
    """The share of the step's sequences in micro-batches without a loss token (skipped):
    the weighted statistics are then over the rest."""

    def add(self, stats: dict[str, float], weight: float) -> None:
        for key, value in stats.items():
            if key in _LOSS_STATS:
                name = _LOSS_STATS[key]
                self.losses[name] = self.losses.get(name, 0.0) + value
            else:
                self.policy[key] = self.policy.get(key, 0.0) + weight * value


def update_policy(
    run: Run,
    batch: Batch,
    targets: Targets,
    timer: Timer,
    *,
    low_sigma: torch.Tensor | None = None,
) -> UpdateLog:
    """``ppo_epochs`` × ``minibatches`` AdamW steps over whole groups (``cfg.schedule``: the
    preset's sources' schedule unless ``optim.ppo_epochs`` / ``optim.minibatches`` are set).

    Groups are shuffled each epoch with a generator seeded by (seed, step). The R/KL balance
    is measured at the first optimizer step every ``eval.balance_every`` steps when β > 0
    (:func:`_balance`); ``low_sigma`` ``[N]`` marks the rows of MaxNorm Table 3's subset
    (``diagnostics.low_sigma_groups``).
    """
    cfg, g = run.cfg, batch.group_size
    schedule = cfg.schedule(run.preset)
    every = cfg.eval.balance_every
    balance = run.preset.beta > 0 and every > 0 and run.step % every == 0
    shuffle = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + run.step)
    log = UpdateLog()
    for _ in range(schedule.ppo_epochs):
        order = torch.randperm(batch.num_prompts, generator=shuffle, device="cpu")  # [P]
        for groups in order.chunk(schedule.minibatches):
            rows = group_rows(groups.sort().values.to(run.device), g)  # [n] sorted rows
            optimizer_step(
                run, batch, targets, rows, timer=timer, log=log,
                balance=low_sigma if balance else None,
            )  # fmt: skip
            balance = False
    return log


def optimizer_step(
    run: Run,
    batch: Batch,
    targets: Targets,
    rows: torch.Tensor,
    *,
    timer: Timer,
    log: UpdateLog,
    balance: torch.Tensor | bool | None = None,
) -> None:
    """One AdamW step over sequences ``rows`` ``[n]``: micro-batches share one StepTotals.

    Micro-batch losses sum to the minibatch loss (exact accumulation whatever the split). A
    non-finite loss or gradient skips the step (counted; K in a row is a TrainingError).
    ``balance``: measure R/KL at this step (:func:`_balance`): the ``[N]`` low-σ row mask, or
    True (no low-σ subset); None / False: not this step.
    """
    cfg, preset = run.cfg, run.preset
    loss_mask = targets.loss_mask(batch.mask)  # [N, T] without rollout-rejected tokens
    totals = losses.step_totals(  # counts over the whole minibatch, whatever the split
        loss_mask[rows], keep=targets.keep[rows],
        max_len=max(cfg.sampling.max_new_tokens, batch.mask.shape[1]),
    )  # fmt: skip
    if totals.is_empty:  # no kept token: nothing to learn from
        log.empty += 1
        return
    micro = micro_batches(
        rows, targets, beta=preset.beta, g=batch.group_size, size=cfg.optim.micro_batch_size,
        every_row=preset.surrogate not in losses.ZERO_AT_ZERO_ADVANTAGE,
    )  # fmt: skip
    totals, selected = step_selection(run, batch, targets, loss_mask, micro, totals, timer=timer)
    stats, finite, backward = StepStats(), True, False
    for (m, grad), chosen in zip(micro, selected):
        if not loss_mask[m].any():  # no loss token (every completion masked): adds exactly 0
            stats.missing += len(m) / len(rows)
            continue
        with torch.set_grad_enabled(grad):
            obj = micro_batch_loss(run, batch, targets, m, totals, timer=timer, selected=chosen)
            if obj is None:  # a non-finite log-prob or loss: the step is skipped
                finite = False
                break
            if grad:
                with timer("backward"):
                    if balance is not None and balance is not False:
                        low = balance if isinstance(balance, torch.Tensor) else None
                        log.balance = _balance(run, batch, targets, obj, rows, totals, low)
                        balance = None
                    obj.loss.backward()  # micro-batch losses sum to the minibatch loss
                backward = True
        stats.add(obj.stats, len(m) / len(rows))
    if not backward:  # the gradient is exactly 0; AdamW still takes its step
        for q in run.model.parameters():
            if q.requires_grad:
                q.grad = torch.zeros_like(q)
    grad_norm = guarded_step(run, finite=finite, timer=timer)
    if grad_norm is None:
        log.skipped += 1
        return
    log.add(stats, grad_norm)


def micro_batches(
    rows: torch.Tensor,
    targets: Targets,
    *,
    beta: float,
    g: int,
    size: int,
    every_row: bool = False,
) -> list[tuple[torch.Tensor, bool]]:
    """The micro-batch plan of one optimizer step: ``(rows [m], with gradient)`` pairs.

    ``size`` sequences each (0: all of ``rows`` at once), the groups with a gradient first
    (:func:`gradient_rows`), then the rest: [OURS] groups whose every loss term is 0
    (dropped, or zero advantage without a KL term) run their forward without gradient, for
    the logged statistics only. ``every_row``: the surrogate has a term that does not vanish
    at A = 0 (``losses.ZERO_AT_ZERO_ADVANTAGE``): every kept row carries a gradient.
    """
    active = gradient_rows(
        rows,
        adv=targets.adv,
        keep=targets.keep,
        kl_weight=targets.kl_weight,
        beta=beta,
        g=g,
        every_row=every_row,
    )  # [n] fmt: skip
    return [
        (m, grad) for grad in (True, False) for m in rows[active == grad].split(size or len(rows))
        if len(m)
    ]  # fmt: skip


def step_selection(
    run: Run,
    batch: Batch,
    targets: Targets,
    loss_mask: torch.Tensor,
    micro: list[tuple[torch.Tensor, bool]],
    totals: losses.StepTotals,
    *,
    timer: Timer,
) -> tuple[losses.StepTotals, list[torch.Tensor | None]]:
    """The step's token selections, one per micro-batch, and ``totals`` with the step's
    top-entropy threshold (``algorithm.selection="step"``).

    Clip-Cov's and KL-Cov's covariance selection (``losses.clip_cov_select`` /
    ``kl_cov_select`` over the lists of micro-batches) and the top-entropy threshold
    (``losses.entropy_threshold``) of the whole minibatch, from one no-grad forward of each
    micro-batch before the first backward: the update is the one-batch update whatever
    ``optim.micro_batch_size`` is. Nothing to do (None per micro-batch, ``totals`` as given)
    for one micro-batch, where the loss call's own selection is the step's, for
    ``selection="micro_batch"`` and when no selection applies. ``loss_mask`` ``[N, T]``: the
    step's mask without rollout-rejected tokens (``targets.loss_mask(batch.mask)``).
    """
    algo, surrogate = run.cfg.algorithm, run.preset.surrogate
    cov = surrogate in ("clip_cov", "kl_cov")
    top = algo.top_entropy_quantile < 1.0
    none: list[torch.Tensor | None] = [None] * len(micro)
    if algo.selection != "step" or len(micro) < 2 or not (cov or top):
        return totals, none
    rows = [m for m, _ in micro]
    with timer("logprobs"), torch.no_grad():
        parts = [run.policy.logprobs(batch, m, entropy=top) for m in rows]
    kept = [loss_mask[m] * targets.keep[m][:, None].to(loss_mask.dtype) for m in rows]
    if top:
        threshold = losses.entropy_threshold(
            [p.entropy for p in parts], kept, algo.top_entropy_quantile
        )
        totals = replace(totals, entropy_threshold=threshold)
    if not cov:
        return totals, none
    lps, advs = [p.logp for p in parts], [targets.adv[m] for m in rows]
    clip = {k: v for k, v in targets.clip.items() if not isinstance(v, torch.Tensor)}
    if surrogate == "clip_cov":
        params = _params_of(losses.clip_cov_select, clip)
        selected = losses.clip_cov_select(
            lps, [batch.old_logp[m] for m in rows], advs, kept, **params
        )
    else:
        selected = losses.kl_cov_select(lps, advs, kept, **_params_of(losses.kl_cov_select, clip))
    return totals, list(selected)


def _params_of(fn: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``params`` that ``fn`` takes as keywords (a surrogate's parameters for
    its selection function)."""
    names = inspect.signature(fn).parameters
    return {k: v for k, v in params.items() if k in names}


def micro_batch_loss(
    run: Run,
    batch: Batch,
    targets: Targets,
    m: torch.Tensor,
    totals: losses.StepTotals,
    *,
    timer: Timer,
    selected: torch.Tensor | None = None,
) -> losses.Objective | None:
    """The objective of micro-batch ``m`` (``[m]`` rows) under the minibatch's ``totals``, or
    None when its log-probs or loss are not finite. Gradient as the caller's grad mode.
    ``selected``: the step's Clip-Cov / KL-Cov selection of these rows (:func:`step_selection`;
    None: the loss call selects within the micro-batch)."""
    p, algo = run.preset, run.cfg.algorithm
    entropy = run.cfg.optim.entropy or algo.top_entropy_quantile < 1.0
    with timer("logprobs"):
        lp = run.policy.logprobs(batch, m, entropy=entropy)
    if not torch.isfinite(lp.logp.detach()).all():  # the surrogate refuses such input
        return None
    t = targets.rows(m)  # per-sequence bounds [N] (AGPO's per-prompt ε) follow the rows
    weight = keep = None
    if t.correction is not None:  # the rollout correction of these rows (stage 2b)
        weight, keep = t.correction.weight, t.correction.keep
    now = _current_policy_correction(run, batch, m, lp.logp, t.adv)
    if now is not None:
        weight = now if weight is None else weight * now
    params = dict(t.clip) if selected is None else {**t.clip, "selected": selected}
    with timer("backward"):
        obj = losses.objective(
            lp.logp, batch.old_logp[m], t.adv, batch.mask[m], surrogate=p.surrogate,
            surrogate_params=params, aggregation=p.aggregation, totals=totals,
            keep=t.keep, ref_logp=t.ref_logp, kl=p.kl, beta=p.beta, kl_weight=t.kl_weight,
            entropy=lp.entropy, correction_weight=weight, correction_keep=keep,
            kl_correction=algo.kl_correction, top_entropy_quantile=algo.top_entropy_quantile,
        )  # fmt: skip
    return obj if torch.isfinite(obj.loss) else None


def guarded_step(run: Run, *, finite: bool, timer: Timer) -> float | None:
    """Clip the gradient and take the AdamW step; the gradient norm, or None when the step
    was skipped (a non-finite loss or gradient: counted, :func:`_count_nonfinite`)."""
    with timer("optimizer"):
        params = [q for q in run.model.parameters() if q.requires_grad]
        max_norm = run.cfg.optim.grad_clip if run.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not (finite and math.isfinite(grad_norm)):
            run.optimizer.zero_grad(set_to_none=True)
            _count_nonfinite(run)
            return None
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    run.nonfinite_run = 0
    return grad_norm


def gradient_rows(
    rows: torch.Tensor,
    *,
    adv: torch.Tensor,
    keep: torch.Tensor,
    kl_weight: torch.Tensor,
    beta: float,
    g: int,
    every_row: bool = False,
) -> torch.Tensor:
    """``[n]`` bool: the rows of groups where some row's loss has a gradient.

    A row's loss terms are the surrogate, ∝ its advantage (every surrogate of
    ``losses.ZERO_AT_ZERO_ADVANTAGE`` is ``-A·f(ratio)`` or ``-A·w·logp``; for KL-Cov and DRO,
    whose penalty acts at A = 0 too, ``every_row`` makes every kept row live), and
    β·kl_weight·KL; a dropped row (``keep`` False) has none. Rows with ``keep`` False, or with A = 0 and no KL weight, add exactly 0 to the loss
    and its gradient (GRPO's collapsed groups: all rewards equal). Decided per group, since a
    group's rows share one prompt forward. ``rows`` holds whole groups (``group_rows``). The
    loop passes no entropy bonus to ``losses.objective``; one would make every row live.
    """
    adv_r, keep_r, kl_r = adv[rows], keep[rows], kl_weight[rows]  # [n] ([n, T] per token)
    nonzero = adv_r != 0
    if nonzero.dim() > 1:  # per-token advantages: a row lives when any token's does
        nonzero = nonzero.any(-1)
    live = keep_r & (nonzero | ((beta > 0) & (kl_r != 0)) | every_row)  # [n]
    return live.view(-1, g).any(-1).repeat_interleave(g)  # [n]


_LOSS_STATS = {"pg_loss": "pg", "kl_loss": "kl"}
"""The objective's loss statistics (summed over micro-batches) -> their ``loss/`` name; every
other statistic of ``losses.objective`` is a mean (weighted by sequences)."""


def _balance(
    run: Run,
    batch: Batch,
    targets: Targets,
    obj: losses.Objective,
    rows: torch.Tensor,
    totals: losses.StepTotals,
    low_sigma: torch.Tensor | None,
) -> dict[str, float]:
    """R/KL = ‖g_R‖/(β‖g_KL‖) and the reward/KL gradient cosine, on two sets of rows.

    As the MaxNorm paper's Table 3 caption defines it (``diagnostics.reward_kl_balance``): the
    base β and the gradient of the *unweighted* KL branch (no β, no per-group ``kl_weight``,
    so ``grpo_beta_comp``'s 1/σ weights are not folded in). ``balance/low_sigma/*``: on the
    minibatch's rows of Table 3's subset, the updated groups with σ_q < 1e-2
    (``low_sigma`` ``[N]``, ``diagnostics.low_sigma_groups``, the definition
    ``simulate.low_variance`` uses), both branches aggregated over those rows alone, with
    ``balance/low_sigma/rows`` their count (no ratio when there are none): the number to hold
    against Table 3, and the one the health rule reads. ``balance/batch/*``: on the first
    micro-batch ``obj`` as trained, every kept row [OURS] (what was logged as
    ``balance/r_over_kl`` in older runs). Extra backward passes with ``retain_graph`` (and a
    forward of the subset); the ``.grad`` buffers are not touched.
    """
    p = run.preset
    params = [q for q in run.model.parameters() if q.requires_grad]
    out = diagnostics.subset_keys(
        diagnostics.reward_kl_balance(obj.pg_loss, obj.kl_unweighted, params, beta=p.beta),
        "batch",
    )
    sub = rows[low_sigma[rows]] if low_sigma is not None else rows[:0]  # [k] subset rows
    out["balance/low_sigma/rows"] = float(len(sub))
    if not len(sub) or not batch.mask[sub].any():
        return out
    sub_totals = losses.step_totals(
        targets.loss_mask(batch.mask)[sub], keep=targets.keep[sub], max_len=int(totals.max_len)
    )
    lp = run.policy.logprobs(batch, sub, entropy=False)
    t = targets.rows(sub)
    c = t.correction  # the subset's loss as trained: the rollout correction's weight and mask
    low = losses.objective(
        lp.logp, batch.old_logp[sub], t.adv, batch.mask[sub], surrogate=p.surrogate,
        surrogate_params=dict(t.clip), aggregation=p.aggregation, totals=sub_totals,
        keep=t.keep, ref_logp=t.ref_logp, kl=p.kl, beta=p.beta, kl_weight=t.kl_weight,
        correction_weight=None if c is None else c.weight,
        correction_keep=None if c is None else c.keep,
        kl_correction=run.cfg.algorithm.kl_correction, stats=False,
    )  # fmt: skip
    out.update(
        diagnostics.subset_keys(
            diagnostics.reward_kl_balance(low.pg_loss, low.kl_unweighted, params, beta=p.beta),
            "low_sigma",
        )
    )
    return out


def _count_nonfinite(run: Run) -> None:
    """Count a skipped optimizer step; K in a row is a ``TrainingError``."""
    run.nonfinite_run += 1
    run.nonfinite_total += 1
    k = run.cfg.optim.max_nonfinite_steps
    if run.nonfinite_run >= k:
        raise TrainingError(
            f"step {run.step}: {run.nonfinite_run} optimizer steps in a row had a non-finite "
            f"loss or gradient (limit optim.max_nonfinite_steps={k}); the policy has diverged. "
            "Lower optim.lr, keep optim.grad_clip > 0, or resume from an earlier checkpoint."
        )


# ---- timing --------------------------------------------------------------------------------


class Timer:
    """Wall-clock seconds per stage of one step, summed over its repeats (``time/<stage>``).

    On a GPU each stage ends with a synchronisation, so the time is the stage's, not the
    time to launch its kernels.
    """

    STAGES = ("generate", "score", "logprobs", "backward", "optimizer", "diagnostics")

    def __init__(self, device: torch.device) -> None:
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self._sync = device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            # a stage outside STAGES (``correction``) is logged only when it ran
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0

    def metrics(self, *, step: float) -> dict[str, float]:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": step}
