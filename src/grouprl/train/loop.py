"""The training loop: :func:`train` runs the steps, :func:`train_step` is one step, top to bottom.

One step, its stages in order, the step's tensors as locals::

    1-2. prompts → rollouts → rewards   P examples (a stream, or a pool + a prompt sampler),
         G completions each at the controller's
         temperature, verified → rewards [P, G] (NaN = unscorable, counted; too many stops
         the run); DAPO's overlong penalty; DAPO's dynamic sampling draws more prompts
         until P informative groups are found                     (collect_batch, below)
    3.   advantages    advantages.compute(preset) → per sample: adv [N], keep [N], kl_weight [N]
    4.   reference     ref_logp [N, T] (β > 0 only); the controller's clip bounds; all of it
                       one frozen Targets (train/targets.py)
    5.   update        epochs × minibatches of whole groups; each minibatch is one AdamW step
                       whose micro-batches share one StepTotals, so accumulation is exact
                                                                  (update_policy, below)
    6.   metrics       one dict built explicitly: rollout counters, update means, the
                       diagnostics' step metrics, run-health warnings, stage times

Every pass of the policy (rollouts, training forward, reference, AGPO's passes, evaluation)
goes through ``run.policy`` (train/policy.py) under one precision. Everything random draws
from generators that the checkpoint saves, so a resumed run ends with exactly the metrics of
an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from grouprl import advantages, diagnostics, losses
from grouprl.train import filters, resume
from grouprl.train.batch import (
    Batch,
    Round,
    evaluate,
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

__all__ = ["RunResult", "TrainingError", "train", "train_step"]


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
    schedule = cfg.schedule(run.preset)  # the preset's update schedule unless optim sets it
    for note in (
        schedule.note,
        losses.on_policy_warning(run.preset.surrogate, schedule.minibatches, schedule.ppo_epochs),
    ):
        if note:
            run.print(f"schedule: {note}")
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
    except BaseException:  # no report after a failure (a full disk, ...)
        run.sinks.close(report=False)
        raise
    run.sinks.close(report=cfg.run.report and run.step >= cfg.optim.steps)
    return RunResult(run.run_dir, run.step, metrics, run.evals, stop.signum)


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

    # -- 3. advantages: per group, then per sample (rows p·G + g) ----------------------------
    adv = advantages.compute(
        preset.estimator,
        rewards,
        **preset.advantage_kwargs(),
        trigger=run.trigger if preset.virtual else None,
        reward_range=tuple(run.task.reward_range),
    )
    adv_n = adv.per_sample.detach().float()  # [N]
    # [OURS] an unscorable (NaN-reward) sample leaves the loss entirely, KL branch included:
    # it carries no reward signal and must not count in the normaliser
    keep_n = adv.keep.repeat_interleave(g) & ~torch.isnan(rewards).reshape(-1)  # [N]
    kl_weight_n = adv.kl_weight.float().repeat_interleave(g)  # [N]

    # -- 4. reference log-probs (β > 0) and this step's surrogate parameters -----------------
    with timer("logprobs"):
        ref_logp = run.reference.logprobs(run.policy, batch)  # [N, T] or None
    clip, clip_metrics = run.controller.clip_params(
        run.policy, batch, dict(preset.surrogate_params)
    )
    targets = Targets(adv_n, keep_n, kl_weight_n, ref_logp, clip)

    # -- 5. update: epochs × minibatches of whole groups, one AdamW step each ----------------
    log = update_policy(run, batch, targets, timer)
    after_metrics = run.controller.after_update(run.policy, batch)

    # -- 6. metrics, built explicitly -------------------------------------------------------
    with timer("diagnostics"):
        metrics = {**rollout_metrics, **clip_metrics, **log.metrics(), **after_metrics}
        metrics["optim/skipped_total"] = float(run.nonfinite_total)
        metrics["optim/lr"] = run.optimizer.param_groups[0]["lr"]
        metrics.update({f"clip/{k}": _mean(v) for k, v in clip.items()})
        metrics.update(diagnostics.step_metrics(rewards, adv, reward_range=run.task.reward_range))
        metrics.update({f"adv/{k}": float(v) for k, v in adv.stats.items()})
        if ref_logp is not None:  # KL of the behaviour policy to the reference, per sequence
            seq_kl = diagnostics.kl_stats(
                losses.kl(preset.kl, batch.old_logp, ref_logp), batch.mask
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
        settings, per_prompt = sampling_at(s, temperature, logprob_t)
        roll, rewards, scores = sample_groups(
            run.policy, scorer, examples, g, settings, run.gen, temperatures=per_prompt,
            timer=timer,
        )  # fmt: skip
        rewards = overlong.rewards(rewards, roll.completion_mask)  # DAPO §3.4 ("soft")
        run.prompts.observe(indices, rewards)  # IS-GRPO's sampler: σ of every generated group
        unscorable += scores.unscorable_frac
        metrics.update(scores.extra)  # the reward functions' own numbers (dataset tasks)
        collapsed += diagnostics.acr(rewards) * n
        drawn += n
        kept = torch.arange(n, device=rewards.device) if sampler is None else sampler.add(rewards)
        rounds.append(Round(examples, roll, rewards, kept))
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


def update_policy(run: Run, batch: Batch, targets: Targets, timer: Timer) -> UpdateLog:
    """``ppo_epochs`` × ``minibatches`` AdamW steps over whole groups (``cfg.schedule``: the
    preset's sources' schedule unless ``optim.ppo_epochs`` / ``optim.minibatches`` are set).

    Groups are shuffled each epoch with a generator seeded by (seed, step). The R/KL balance
    is measured on the first micro-batch of the step every ``eval.balance_every`` steps when
    β > 0.
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
            optimizer_step(run, batch, targets, rows, timer=timer, log=log, balance=balance)
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
    balance: bool,
) -> None:
    """One AdamW step over sequences ``rows`` ``[n]``: micro-batches share one StepTotals.

    Micro-batch losses sum to the minibatch loss (exact accumulation whatever the split). A
    non-finite loss or gradient skips the step (counted; K in a row is a TrainingError).
    """
    cfg, preset = run.cfg, run.preset
    totals = losses.step_totals(  # counts over the whole minibatch, whatever the split
        batch.mask[rows], keep=targets.keep[rows],
        max_len=max(cfg.sampling.max_new_tokens, batch.mask.shape[1]),
    )  # fmt: skip
    if totals.is_empty:  # no kept token: nothing to learn from
        log.empty += 1
        return
    micro = micro_batches(
        rows, targets, beta=preset.beta, g=batch.group_size, size=cfg.optim.micro_batch_size
    )
    stats, finite, backward = StepStats(), True, False
    for m, grad in micro:
        if not batch.mask[m].any():  # no loss token (every completion masked): adds exactly 0
            stats.missing += len(m) / len(rows)
            continue
        with torch.set_grad_enabled(grad):
            obj = micro_batch_loss(run, batch, targets, m, totals, timer=timer)
            if obj is None:  # a non-finite log-prob or loss: the step is skipped
                finite = False
                break
            if grad:
                with timer("backward"):
                    if balance:
                        log.balance = _balance(run, obj)
                        balance = False
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
    rows: torch.Tensor, targets: Targets, *, beta: float, g: int, size: int
) -> list[tuple[torch.Tensor, bool]]:
    """The micro-batch plan of one optimizer step: ``(rows [m], with gradient)`` pairs.

    ``size`` sequences each (0: all of ``rows`` at once), the groups with a gradient first
    (:func:`gradient_rows`), then the rest: [OURS] groups whose every loss term is 0
    (dropped, or zero advantage without a KL term) run their forward without gradient, for
    the logged statistics only.
    """
    active = gradient_rows(
        rows, adv=targets.adv, keep=targets.keep, kl_weight=targets.kl_weight, beta=beta, g=g
    )  # [n]
    return [
        (m, grad) for grad in (True, False) for m in rows[active == grad].split(size or len(rows))
        if len(m)
    ]  # fmt: skip


def micro_batch_loss(
    run: Run,
    batch: Batch,
    targets: Targets,
    m: torch.Tensor,
    totals: losses.StepTotals,
    *,
    timer: Timer,
) -> losses.Objective | None:
    """The objective of micro-batch ``m`` (``[m]`` rows) under the minibatch's ``totals``, or
    None when its log-probs or loss are not finite. Gradient as the caller's grad mode."""
    p = run.preset
    with timer("logprobs"):
        lp = run.policy.logprobs(batch, m, entropy=run.cfg.optim.entropy)
    if not torch.isfinite(lp.logp.detach()).all():  # the surrogate refuses such input
        return None
    t = targets.rows(m)  # per-sequence bounds [N] (AGPO's per-prompt ε) follow the rows
    with timer("backward"):
        obj = losses.objective(
            lp.logp, batch.old_logp[m], t.adv, batch.mask[m], surrogate=p.surrogate,
            surrogate_params=dict(t.clip), aggregation=p.aggregation, totals=totals,
            keep=t.keep, ref_logp=t.ref_logp, kl=p.kl, beta=p.beta, kl_weight=t.kl_weight,
            entropy=lp.entropy,
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
) -> torch.Tensor:
    """``[n]`` bool: the rows of groups where some row's loss has a gradient.

    A row's loss terms are the surrogate, ∝ its advantage (every registered surrogate is
    ``-A·f(ratio)`` or ``-A·w·logp``), and β·kl_weight·KL; a dropped row (``keep`` False) has
    none. Rows with ``keep`` False, or with A = 0 and no KL weight, add exactly 0 to the loss
    and its gradient (GRPO's collapsed groups: all rewards equal). Decided per group, since a
    group's rows share one prompt forward. ``rows`` holds whole groups (``group_rows``). The
    loop passes no entropy bonus to ``losses.objective``; one would make every row live.
    """
    adv_r, keep_r, kl_r = adv[rows], keep[rows], kl_weight[rows]  # [n]
    live = keep_r & ((adv_r != 0) | ((beta > 0) & (kl_r != 0)))  # [n]
    return live.view(-1, g).any(-1).repeat_interleave(g)  # [n]


_LOSS_STATS = {"pg_loss": "pg", "kl_loss": "kl"}
"""The objective's loss statistics (summed over micro-batches) -> their ``loss/`` name; every
other statistic of ``losses.objective`` is a mean (weighted by sequences)."""


def _balance(run: Run, obj: losses.Objective) -> dict[str, float]:
    """R/KL = ‖g_R‖/(β‖g_KL‖) and the reward/KL gradient cosine of one micro-batch.

    As the MaxNorm paper's Table 3 caption defines it (``diagnostics.reward_kl_balance``): the
    base β and the gradient of the *unweighted* KL branch (no β, no per-group ``kl_weight``,
    so ``grpo_beta_comp``'s 1/σ weights are not folded in). Two extra backward passes with
    ``retain_graph``; the ``.grad`` buffers are not touched. Measured on the whole
    micro-batch [OURS] (the paper restricts it to low-σ groups).
    """
    params = [q for q in run.model.parameters() if q.requires_grad]
    return diagnostics.reward_kl_balance(
        obj.pg_loss, obj.kl_unweighted, params, beta=run.preset.beta
    )


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
            self.seconds[stage] += time.perf_counter() - t0

    def metrics(self, *, step: float) -> dict[str, float]:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": step}
