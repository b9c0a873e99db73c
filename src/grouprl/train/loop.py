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
    3.   advantages    advantages.compute(preset) with the inputs the preset's methods
                       declare (Preset.reads, provided by name: train/inputs.py) → per
                       sample: adv [N], keep [N], kl_weight [N]   (step_advantages)
    4.   reference     ref_logp [N, T] (β > 0 only); the controller's clip bounds; all of it
                       one frozen Targets (train/targets.py)
    5.   update        epochs × minibatches of whole groups; each minibatch is one AdamW step
                       whose micro-batches share one StepTotals and the step's token
                       selections (the top-entropy threshold, a surrogate's declared
                       step_selection), so accumulation is exact; the objective's settings
                       are the run's LossSpec      (train/update.py: update_policy)
    6.   metrics       one dict built explicitly: rollout counters, update means, the
                       diagnostics' step metrics, run-health warnings, stage times

Every pass of the policy (rollouts, training forward, reference, AGPO's passes, evaluation)
goes through ``run.policy`` (train/policy.py) under one precision. Everything random draws
from generators that the checkpoint saves, so a resumed run ends with exactly the metrics of
an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from grouprl import advantages, diagnostics, losses
from grouprl.losses import correction
from grouprl.train import filters, resume
from grouprl.train.batch import Batch, Round, evaluate, join_rounds, sample_groups, sampling_at
from grouprl.train.config import RunConfig
from grouprl.train.inputs import RoundView, round_inputs, step_inputs
from grouprl.train.runlock import RunLock
from grouprl.train.sinks import Sinks
from grouprl.train.state import Run, graceful_stop, save_checkpoint, setup
from grouprl.train.targets import Targets
from grouprl.train.update import LossSpec, UpdateLog, split_correction, update_policy
from grouprl.types import Rollouts

__all__ = [
    "RunResult",
    "Timer",
    "TrainingError",
    "UpdateLog",
    "schedule_lines",
    "train",
    "train_step",
]


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
    from grouprl.train.config import load_plugins

    load_plugins(cfg)  # a config built without validate() names them too
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
    spec = LossSpec.of(run.preset, cfg)  # the objective's settings, once per run
    metrics: dict[str, float] = {}
    every, ckpt_every = cfg.eval.every, cfg.run.every
    try:
        with graceful_stop() as stop:
            if run.step == 0 and every:  # the start, logged as step 0 (eval/* keys only)
                run.sinks.log(0, _evaluate(run))
            while run.step < cfg.optim.steps and stop.signum is None:
                run.step += 1
                metrics = train_step(run, spec)
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


def train_step(run: Run, spec: LossSpec | None = None) -> dict[str, float]:
    """One training step, stages 1-6 in order (module docstring); returns the step's metrics.

    ``spec``: the run's :class:`~grouprl.train.update.LossSpec` (built from the preset and
    the config when not given). The run's counters (non-finite optimizer steps) are
    updated here, from what the update reports.
    """
    t_step = time.perf_counter()
    timer = Timer(run.device)
    preset, cfg = run.preset, run.cfg
    spec = spec or LossSpec.of(preset, cfg)

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
    every = cfg.eval.balance_every  # R/KL (MaxNorm Table 3) on its low-σ rows, when β > 0
    low = diagnostics.low_sigma_groups(rewards, adv).repeat_interleave(g)  # [N]
    log = update_policy(
        run.policy, run.optimizer, batch, targets, spec, schedule=cfg.schedule(preset),
        shuffle=torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + run.step),
        timer=timer, balance_rows=low if spec.beta > 0 and every and run.step % every == 0
        else None, streak=run.nonfinite_run,
    )  # fmt: skip
    run.nonfinite_total += log.skipped
    run.nonfinite_run = log.streak
    if log.diverged:
        raise TrainingError(
            f"step {run.step}: {log.streak} optimizer steps in a row had a non-finite "
            f"loss or gradient (limit optim.max_nonfinite_steps={spec.max_nonfinite_steps}); "
            "the policy has diverged. Lower optim.lr, keep optim.grad_clip > 0, or resume "
            "from an earlier checkpoint."
        )
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
        trained_cut = batch.truncated & (batch.mask.sum(-1) > 0)  # [N] cut, in the loss
        metrics.update(diagnostics.shaping_metrics(rewards, trained_cut, reward_range=run.task.reward_range, verifier_rewards=batch.verifier_rewards))  # fmt: skip
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
    scorer, reads = run.scorer, preset.reads

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
        view = RoundView(
            run.policy, scorer, examples, scores, settings, overlong, run.gen, timer, run.device
        )
        extras = round_inputs(reads, view)  # what the methods read of this round, by name
        if rewards is not verified:  # the verifier's own rewards, for the focal weight's μ̂
            extras["verifier_rewards"] = verified
        # the prompt sampler observes σ of every generated group, of the verifier's rewards
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
    metrics.update(diagnostics.kept_mass_metrics(batch.log_kept_mass, batch.mask, batch.kept_ids))
    return batch, metrics


# ---- stage 3: advantages -----------------------------------------------------------------------


def step_advantages(
    run: Run, batch: Batch, ref_logp: torch.Tensor | None
) -> tuple[advantages.Advantages, torch.Tensor, dict[str, float]]:
    """The step's advantages: ``(Advantages, adv [N] or [N, T], metrics)``.

    The inputs the preset's methods declare (``Preset.reads``) come from their providers
    (``train.inputs.STEP``), by name. Sequence level (``advantages.compute``) unless the
    preset is token level (``Preset.token_level``: a token-level estimator, or a KL folded
    into the reward), then ``advantages.compute_tokens`` on the ``[P, G, T]`` completion mask,
    with the KL penalty −β·KL_t of the behaviour log-probs against the reference
    (``ref_logp``; β from ``run.kl_controller``, which then advances with the measured KL,
    verl's ``apply_kl_penalty``).
    """
    preset, rewards = run.preset, batch.rewards  # [P, G]
    kwargs: dict[str, Any] = dict(preset.advantage_kwargs())
    inputs = step_inputs(preset.reads, run, batch)
    rewards_in = rewards
    if inputs.pop("reward_parts", None) is not None:  # [P, G, K], one value per function
        rewards_in, kwargs["reward_weights"] = batch.reward_parts, list(batch.reward_weights)
    if "draw_weights" in inputs:  # the sampler's importance weights: on the groups, and/or
        weights = inputs.pop("draw_weights")  # to an estimator that reads them
        if preset.sampler_weight:
            kwargs["group_weight"] = weights
        if "draw_weights" in advantages.needs(preset.estimator, **dict(preset.estimator_params)):
            kwargs["draw_weights"] = weights
    if preset.estimator not in advantages.TOKEN_ESTIMATORS:  # the transforms' reward scale
        kwargs["reward_range"] = tuple(run.task.reward_range)
    metrics: dict[str, float] = {}
    if not preset.token_level:
        adv = advantages.compute(preset.estimator, rewards_in, **inputs, **kwargs)
        return adv, adv.per_sample.detach().float(), metrics
    inputs.pop("lengths", None)  # compute_tokens counts them from the mask
    mask = batch.mask.view(batch.num_prompts, batch.group_size, -1) > 0  # [P, G, T]
    ctrl = run.kl_controller
    current_kl = None
    if ctrl is not None:
        dense, current_kl = advantages.kl_reward(
            batch.old_logp, ref_logp, batch.mask, ctrl.value, preset.reward_kl
        )
        kwargs["token_rewards"] = dense.view(mask.shape)
        metrics["kl_reward/coef"], metrics["kl_reward/kl"] = float(ctrl.value), current_kl
    adv = advantages.compute_tokens(preset.estimator, rewards_in, mask, **inputs, **kwargs)
    if ctrl is not None:
        ctrl.update(current_kl, n_steps=batch.size)  # verl: after the penalty, per batch
    return adv, adv.per_token.detach().float(), metrics


# ---- stage 2b: rollouts from another engine ----------------------------------------------------


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
    normaliser of the step: ``Targets.loss_mask``); a method that reads ``current_logp``
    runs in the loss (``train.update``).
    """
    if run.policy.matched:
        return batch, None, {}
    with timer("logprobs"):
        train_logp = run.policy.batch_logprobs(batch).logp.float()  # [N, T]
    batch = replace(batch, old_logp=train_logp, rollout_logp=batch.old_logp)
    with timer("correction"):
        metrics = diagnostics.mismatch_metrics(batch.old_logp, batch.rollout_logp, batch.mask)
        per_batch, _ = split_correction(run.preset.rollout_correction)
        corr = None
        if per_batch:
            corr = correction.compute(per_batch, batch.old_logp, batch.rollout_logp, batch.mask)
            metrics.update(corr.stats)
    return batch, corr, metrics


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
