"""The training loop, top to bottom: prompts → rollouts → rewards → advantages → update → log.

One step (``train`` below, stage banners as comments)::

    1. prompts     P examples from the task's train stream for this step
    2. rollouts    G completions each (grouprl.rollout.hf.generate), then verify → rewards [P, G]
                   (NaN = unscorable, counted; too many stops the run); DAPO's dynamic
                   sampling repeats 1-2 until P informative groups are found
    3. advantages  grouprl.advantages.compute(preset.estimator, rewards, **preset kwargs)
    4. update      PPO epochs × minibatches; each minibatch is one AdamW step whose
                   micro-batches share one StepTotals, so accumulation is exact
    5. metrics     diagnostics.step_metrics + RunHealth warnings + losses + timings
    6. eval/ckpt   pass@k on held-out prompts every ``eval.every`` steps; checkpoints

Everything random draws from generators that the checkpoint saves, so a resumed run ends
with exactly the metrics of an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grouprl import advantages, diagnostics, losses
from grouprl.train.batch import Batch, collect, evaluate
from grouprl.train.config import RunConfig
from grouprl.train.logprobs import completion_logprobs
from grouprl.train.sinks import Sinks
from grouprl.train.state import Run, graceful_stop, save_checkpoint, setup

__all__ = ["RunResult", "TrainingError", "train"]


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


# ---- the update ----------------------------------------------------------------------------


def _micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(rows.split(size)) if size else [rows]


@torch.no_grad()
def batch_logprobs(
    run: Run, b: Batch, *, model: Any = None, entropy: bool = False
) -> tuple[torch.Tensor, Any]:
    """Log-probs (and entropies) of the whole batch under ``model`` (the policy), no gradient."""
    out, ents = [], []
    for m in _micro_batches(torch.arange(b.size), run.cfg.optim.micro_batch_size):
        lp = completion_logprobs(
            model or run.model, b.prompt_ids[m], b.prompt_mask[m], b.completion_ids[m],
            b.mask[m], temperature=b.temperature, group_size=b.group_size,
            chunk=run.cfg.optim.logprob_chunk, entropy=entropy,
        )  # fmt: skip
        out.append(lp.logp)
        ents.append(lp.entropy)
    return torch.cat(out), torch.cat(ents) if entropy else None


def _ref_logp(run: Run, b: Batch) -> torch.Tensor | None:
    """Reference log-probs ``[N, T]``, only when β > 0 (LoRA: the policy without its adapter)."""
    if run.ref is None:
        return None
    if run.ref == "adapter-off":
        with run.model.disable_adapter():
            return batch_logprobs(run, b)[0]
    return batch_logprobs(run, b, model=run.ref)[0]


def _micro_loss(run: Run, b: Batch, m: torch.Tensor, clip: dict, totals: Any) -> Any:
    """The objective of micro-batch rows ``m`` (None when the policy's log-probs are not finite)."""
    lp = completion_logprobs(
        run.model, b.prompt_ids[m], b.prompt_mask[m], b.completion_ids[m], b.mask[m],
        temperature=b.temperature, group_size=b.group_size, chunk=run.cfg.optim.logprob_chunk,
        entropy=run.cfg.optim.entropy,
    )  # fmt: skip
    if not torch.isfinite(lp.logp.detach()).all():  # the surrogate refuses such input
        return None
    p = run.preset
    return losses.objective(
        lp.logp, b.old_logp[m], b.adv[m], b.mask[m], surrogate=p.surrogate,
        surrogate_params=clip, aggregation=p.aggregation, totals=totals, keep=b.keep[m],
        ref_logp=None if b.ref_logp is None else b.ref_logp[m], kl=p.kl, beta=p.beta,
        kl_weight=b.kl_weight[m], entropy=lp.entropy,
    )  # fmt: skip


def _balance(run: Run, obj: Any) -> dict[str, float]:
    """R/KL and the reward/KL gradient cosine of one micro-batch (diagnostics.reward_kl_balance).

    Two extra backward passes with ``retain_graph``; the ``.grad`` buffers are not touched.
    Measured on the whole micro-batch [OURS] (the MaxNorm paper restricts it to low-σ groups).
    """
    beta = run.preset.beta
    params = [p for p in run.model.parameters() if p.requires_grad]
    return diagnostics.reward_kl_balance(obj.pg_loss, obj.kl_loss / beta, params, beta=beta)


def _minibatch(
    run: Run, b: Batch, rows: torch.Tensor, clip: dict, times: dict, balance: bool = False
) -> dict:
    """One optimizer step over ``rows``: micro-batches share the step's StepTotals.

    ``balance``: also log the R/KL balance of the first micro-batch.
    """
    micro = _micro_batches(rows, run.cfg.optim.micro_batch_size)
    totals = losses.step_totals(
        [b.mask[m] for m in micro], keep=[b.keep[m] for m in micro],
        max_len=max(run.cfg.sampling.max_new_tokens, b.mask.shape[1]),
    )  # fmt: skip
    if totals.is_empty:
        return {"optim/empty_steps": 1.0}
    stats: dict[str, float] = {}
    finite = True
    for m in micro:
        t0 = time.perf_counter()
        obj = _micro_loss(run, b, m, clip, totals)
        t1 = time.perf_counter()
        times["logprobs"] += t1 - t0
        if obj is None or not torch.isfinite(obj.loss):
            finite = False
            break
        if balance:
            stats.update(_balance(run, obj))
            balance = False
        obj.loss.backward()  # micro-batch losses sum to the minibatch loss (StepTotals)
        times["backward"] += time.perf_counter() - t1
        w = len(m) / len(rows)  # [OURS] logged means weighted by sequences
        for key, value in obj.stats.items():
            name = f"loss/{key[:-5]}" if key.endswith("_loss") else f"policy/{key}"
            stats[name] = stats.get(name, 0.0) + (value if key.endswith("loss") else w * value)
    t0 = time.perf_counter()
    params = [p for p in run.model.parameters() if p.requires_grad]
    max_norm = run.cfg.optim.grad_clip if run.cfg.optim.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not (finite and math.isfinite(grad_norm)):
        run.optimizer.zero_grad(set_to_none=True)
        return _nonfinite(run)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.nonfinite_run = 0
    times["optimizer"] += time.perf_counter() - t0
    return {**stats, "optim/grad_norm": grad_norm}


def _nonfinite(run: Run) -> dict:
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
    return {"optim/skipped_steps": 1.0}


def update(run: Run, b: Batch, times: dict[str, float]) -> dict[str, float]:
    """PPO epochs × minibatches of whole groups; returns the means of the logged numbers."""
    cfg = run.cfg
    clip = dict(run.preset.surrogate_params)
    if run.agpo is not None:  # AGPO: ε from the probe and the policy entropy before the update
        from grouprl.control.agpo import group_token_mean

        _, entropy = batch_logprobs(run, b, entropy=True)
        clip.update(run.agpo.clip_params(group_token_mean(entropy, b.mask, b.group_size)))
    shuffle = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + run.step)
    g, n_groups = b.group_size, b.num_prompts
    sums: dict[str, float] = {}
    count = 0
    every = cfg.eval.balance_every
    balance = run.preset.beta > 0 and every > 0 and run.step % every == 0
    for _ in range(cfg.optim.ppo_epochs):
        order = torch.randperm(n_groups, generator=shuffle)  # [P]
        for groups in order.chunk(cfg.optim.minibatches):
            rows = (groups[:, None] * g + torch.arange(g)).reshape(-1).sort().values  # [n]
            for key, value in _minibatch(run, b, rows, clip, times, balance).items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
            balance = False
    out = {  # means over minibatches; the balance is measured once per step
        k: v if k.startswith("balance/") else v / count
        for k, v in sums.items()
        if not k.startswith("optim/") or "norm" in k
    }
    out["optim/skipped_steps"] = sums.get("optim/skipped_steps", 0.0)
    out["optim/skipped_total"] = float(run.nonfinite_total)
    out["optim/lr"] = run.optimizer.param_groups[0]["lr"]
    out.update({f"clip/{k}": float(v) for k, v in clip.items()})
    return out


# ---- one step ------------------------------------------------------------------------------


def _advantages(run: Run, rewards: torch.Tensor) -> advantages.Advantages:
    preset = run.preset
    return advantages.compute(
        preset.estimator,
        rewards,
        **preset.advantage_kwargs(),
        trigger=run.trigger if preset.virtual else None,
        reward_range=tuple(run.task.reward_range),
    )


def step_once(run: Run) -> dict[str, float]:
    """One training step (stages 1-5); returns the step's metrics."""
    t_step = time.perf_counter()
    times = dict.fromkeys(("generate", "score", "logprobs", "backward", "optimizer"), 0.0)
    # -- 1-2. prompts, rollouts, rewards (with dynamic sampling when the preset asks) -------
    b, metrics = collect(run, times)
    # -- 3. advantages ------------------------------------------------------------------------
    adv = _advantages(run, b.rewards)
    b.attach(adv, _ref_logp(run, b))
    # -- 4. update ----------------------------------------------------------------------------
    metrics.update(update(run, b, times))
    if run.agpo is not None:  # AGPO: the update's drift feeds the clip controller
        new_logp, _ = batch_logprobs(run, b)
        metrics.update(run.agpo.observe_update(b.old_logp, new_logp, b.mask, b.group_size))
    # -- 5. metrics ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    metrics.update(diagnostics.step_metrics(b.rewards, adv, reward_range=run.task.reward_range))
    metrics.update({f"adv/{k}": float(v) for k, v in adv.stats.items()})
    metrics["kl/mean"] = metrics.pop("policy/kl_mean", 0.0)
    if b.ref_logp is not None:  # KL of the behaviour policy to the reference, per sequence
        seq_kl = diagnostics.kl_stats(losses.kl(run.preset.kl, b.old_logp, b.ref_logp), b.mask)
        metrics.update({"kl/p95": seq_kl["kl/p95"], "kl/max": seq_kl["kl/max"]})
    metrics["loss/total"] = metrics.get("loss/pg", 0.0) + metrics.get("loss/kl", 0.0)
    for line in run.health.update(run.step, metrics):
        _print(run, f"health: {line}")
    metrics.update(run.health.metrics())
    times["diagnostics"] = time.perf_counter() - t0
    times["step"] = time.perf_counter() - t_step
    metrics.update({f"time/{k}": v for k, v in times.items()})
    if run.sinks is not None:
        run.sinks.log_groups(run.step, b.prompt_ids_text, b.rewards)
    return metrics


def _print(run: Run, message: str) -> None:
    if run.sinks is not None:
        run.sinks.print(message)
    else:
        print(message, flush=True)


def _evaluate(run: Run) -> dict[str, float]:
    out = evaluate(run)
    run.evals[run.step] = out
    shown = "  ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in out.items())
    _print(run, f"eval step {run.step}: {shown}")
    return out


def _open_sinks(run: Run) -> Sinks:
    c = run.cfg.run
    return Sinks(
        run.run_dir,
        run.cfg.to_dict(),
        total_steps=run.cfg.optim.steps,
        resume_step=run.step,
        tensorboard=c.tensorboard,
        wandb=c.wandb,
        progress=c.progress,
    )


def train(cfg: RunConfig, **injected: Any) -> RunResult:
    """Run (or resume) training with ``cfg``; ``injected`` may pass model/tokenizer/task."""
    run = setup(cfg, **injected)
    run.sinks = _open_sinks(run)
    metrics: dict[str, float] = {}
    every, ckpt_every = cfg.eval.every, cfg.run.every
    try:
        with graceful_stop() as stop:
            if run.step == 0 and every:
                _evaluate(run)
            while run.step < cfg.optim.steps and stop.signum is None:
                run.step += 1
                metrics = step_once(run)
                if every and (run.step % every == 0 or run.step == cfg.optim.steps):
                    metrics.update(_evaluate(run))
                run.sinks.log(run.step, metrics)
                if (ckpt_every and run.step % ckpt_every == 0) or run.step == cfg.optim.steps:
                    save_checkpoint(run)
            if stop.signum is not None:
                save_checkpoint(run)
                _print(
                    run,
                    f"stopped by signal {stop.signum} after step {run.step}; "
                    f"resume with --resume --out {run.run_dir}",
                )
    finally:
        run.sinks.close(report=cfg.run.report and run.step >= cfg.optim.steps)
    return RunResult(run.run_dir, run.step, metrics, run.evals, stop.signum)
