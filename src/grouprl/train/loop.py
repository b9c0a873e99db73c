"""The training loop: :func:`train` runs the steps, :func:`train_step` is one step, top to bottom.

One step, its stages in order, the step's tensors as locals::

    1-2. prompts → rollouts → rewards   P examples (a stream, or a pool + a prompt sampler),
         G completions each at the controller's
         temperature, verified → rewards [P, G] (NaN = unscorable, counted; too many stops
         the run); DAPO's overlong penalty; DAPO's dynamic sampling draws more prompts
         until P informative groups are found                     (collect_batch, below)
    3.   advantages    advantages.compute(preset) → per sample: adv [N], keep [N], kl_weight [N]
    4.   reference     ref_logp [N, T] (β > 0 only); the controller's clip bounds
    5.   update        epochs × minibatches of whole groups; each minibatch is one AdamW step
                       whose micro-batches share one StepTotals, so accumulation is exact
                                                                  (update_policy, below)
    6.   metrics       one dict built explicitly: rollout counters, update means, the
                       diagnostics' step metrics, run-health warnings, stage times

Everything random draws from generators that the checkpoint saves, so a resumed run ends
with exactly the metrics of an uninterrupted one.
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
from grouprl.train.batch import Batch, Round, evaluate, group_rows, join_rounds, sample_groups
from grouprl.train.config import RunConfig
from grouprl.train.logprobs import completion_logprobs
from grouprl.train.runlock import RunLock
from grouprl.train.sinks import Sinks
from grouprl.train.state import Run, graceful_stop, save_checkpoint, setup

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
    out = evaluate(run)
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
        ref_logp = run.reference.logprobs(run, batch)  # [N, T] or None
    clip, clip_metrics = run.controller.clip_params(run, batch, dict(preset.surrogate_params))

    # -- 5. update: epochs × minibatches of whole groups, one AdamW step each ----------------
    log = update_policy(
        run, batch, adv=adv_n, keep=keep_n, kl_weight=kl_weight_n, ref_logp=ref_logp,
        clip=clip, timer=timer,
    )  # fmt: skip
    after_metrics = run.controller.after_update(run, batch)

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
    metrics: dict[str, float] = {}
    temperature: float | torch.Tensor = s.temperature
    logprob_t = run.controller.logprob_temperature  # None: the sampling temperature
    rounds: list[Round] = []
    unscorable = collapsed = drawn = 0.0
    while not rounds or (sampler is not None and not sampler.done):
        n = p if sampler is None else sampler.next_draw()
        examples, indices = run.prompts.draw(n, run.step, len(rounds))  # [n] pool indices
        if not rounds:
            temperature, controller_metrics = run.controller.temperature(run, examples, timer)
            metrics.update(controller_metrics)
        roll, rewards, scores = sample_groups(
            run, examples, g, temperature, run.gen, timer, logprob_temperature=logprob_t
        )
        if preset.overlong == "soft":  # DAPO §3.4: 0, then linear down to -1 at L_max
            lengths = roll.completion_mask.sum(-1).view_as(rewards)  # [n, G]
            cache = s.overlong_cache or max(1, s.max_new_tokens // 5)
            rewards = filters.apply_overlong_penalty(
                rewards, lengths, max_len=s.max_new_tokens, cache_len=cache
            )
        run.prompts.observe(indices, rewards)  # IS-GRPO's sampler: σ of every generated group
        unscorable += scores.unscorable_frac
        metrics.update(scores.extra)  # the reward functions' own numbers (dataset tasks)
        collapsed += diagnostics.acr(rewards) * n
        drawn += n
        kept = torch.arange(n, device=rewards.device) if sampler is None else sampler.add(rewards)
        rounds.append(Round(examples, roll, rewards, kept))
    pad_id = getattr(run.tokenizer, "pad_token_id", None) or 0
    batch = join_rounds(rounds, pad_id, temperature if logprob_t is None else logprob_t)
    if preset.overlong == "mask":  # DAPO's overlong filtering: truncated tokens leave the loss
        batch = replace(batch, mask=filters.mask_truncated(batch.mask, batch.truncated))
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


def update_policy(
    run: Run,
    batch: Batch,
    *,
    adv: torch.Tensor,
    keep: torch.Tensor,
    kl_weight: torch.Tensor,
    ref_logp: torch.Tensor | None,
    clip: dict[str, Any],
    timer: Timer,
) -> UpdateLog:
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
            optimizer_step(
                run, batch, rows, adv=adv, keep=keep, kl_weight=kl_weight, ref_logp=ref_logp,
                clip=clip, timer=timer, log=log, balance=balance,
            )  # fmt: skip
            balance = False
    return log


def optimizer_step(
    run: Run,
    batch: Batch,
    rows: torch.Tensor,
    *,
    adv: torch.Tensor,
    keep: torch.Tensor,
    kl_weight: torch.Tensor,
    ref_logp: torch.Tensor | None,
    clip: dict[str, Any],
    timer: Timer,
    log: UpdateLog,
    balance: bool,
) -> None:
    """One AdamW step over sequences ``rows`` ``[n]``: micro-batches share one StepTotals.

    Micro-batch losses sum to the minibatch loss (exact accumulation whatever the split). A
    non-finite loss or gradient skips the step (counted; K in a row is a TrainingError).
    """
    cfg, p = run.cfg, run.preset
    totals = losses.step_totals(  # counts over the whole minibatch, whatever the split
        batch.mask[rows], keep=keep[rows],
        max_len=max(cfg.sampling.max_new_tokens, batch.mask.shape[1]),
    )  # fmt: skip
    if totals.is_empty:  # no kept token: nothing to learn from
        log.empty += 1
        return
    # [OURS] groups whose every loss term is 0 (dropped, or zero advantage without a KL term)
    # run their forward without gradient, for the logged statistics only: no backward
    active = gradient_rows(
        rows, adv=adv, keep=keep, kl_weight=kl_weight, beta=p.beta, g=batch.group_size
    )
    size = cfg.optim.micro_batch_size or len(rows)
    micro = [
        (m, grad) for grad in (True, False) for m in rows[active == grad].split(size) if len(m)
    ]
    if not active.any():  # the gradient is exactly 0; AdamW still takes its step, as before
        for q in run.model.parameters():
            if q.requires_grad:
                q.grad = torch.zeros_like(q)
    step_losses: dict[str, float] = {}
    step_policy: dict[str, float] = {}
    finite = True
    for m, grad in micro:
        with timer("logprobs"), run.autocast(), torch.set_grad_enabled(grad):
            lp = completion_logprobs(
                run.model, batch.prompt_ids[m], batch.prompt_mask[m], batch.completion_ids[m],
                batch.mask[m], temperature=batch.temperature, group_size=batch.group_size,
                chunk=cfg.optim.logprob_chunk, entropy=cfg.optim.entropy,
            )  # fmt: skip
        if not torch.isfinite(lp.logp.detach()).all():  # the surrogate refuses such input
            finite = False
            break
        with timer("backward"), torch.set_grad_enabled(grad):
            # per-sequence bounds [N] (AGPO's per-prompt ε) follow the micro-batch's rows
            params = {k: v[m] if isinstance(v, torch.Tensor) else v for k, v in clip.items()}
            obj = losses.objective(
                lp.logp, batch.old_logp[m], adv[m], batch.mask[m], surrogate=p.surrogate,
                surrogate_params=params, aggregation=p.aggregation, totals=totals, keep=keep[m],
                ref_logp=None if ref_logp is None else ref_logp[m], kl=p.kl, beta=p.beta,
                kl_weight=kl_weight[m], entropy=lp.entropy,
            )  # fmt: skip
            if not torch.isfinite(obj.loss):
                finite = False
                break
            if balance and grad:
                log.balance = _balance(run, obj)
                balance = False
            if grad:
                obj.loss.backward()  # micro-batch losses sum to the minibatch loss (StepTotals)
        weight = len(m) / len(rows)
        for key, value in obj.stats.items():
            if key in _LOSS_STATS:
                step_losses[_LOSS_STATS[key]] = step_losses.get(_LOSS_STATS[key], 0.0) + value
            else:
                step_policy[key] = step_policy.get(key, 0.0) + weight * value
    with timer("optimizer"):
        params = [q for q in run.model.parameters() if q.requires_grad]
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not (finite and math.isfinite(grad_norm)):
            run.optimizer.zero_grad(set_to_none=True)
            _count_nonfinite(run)
            log.skipped += 1
            return
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
    run.nonfinite_run = 0
    log.taken += 1
    log.grad_norm += grad_norm
    for key, value in step_losses.items():
        log.losses[key] = log.losses.get(key, 0.0) + value
    for key, value in step_policy.items():
        log.policy[key] = log.policy.get(key, 0.0) + value


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
