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

import contextlib
import copy
import math
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grouprl import advantages, diagnostics, losses, presets
from grouprl.diagnostics.health import RunHealth
from grouprl.train import checkpoint as ckpt
from grouprl.train.batch import Batch, collect, evaluate
from grouprl.train.config import RunConfig
from grouprl.train.logprobs import completion_logprobs
from grouprl.train.sinks import Sinks

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


@dataclass
class Run:
    """Everything a step touches; the parts that change are saved in checkpoints."""

    cfg: RunConfig
    preset: presets.Preset
    task: Any
    model: torch.nn.Module
    tokenizer: Any
    ref: Any  # reference model (β > 0), "adapter-off" for LoRA, or None
    optimizer: torch.optim.Optimizer
    gen: torch.Generator  # rollout sampling
    trigger: advantages.VirtualTrigger | None
    agpo: Any
    health: RunHealth
    sinks: Sinks | None = None
    step: int = 0
    nonfinite_run: int = 0
    nonfinite_total: int = 0
    evals: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.out)

    def state(self) -> dict[str, Any]:
        """The non-tensor state a checkpoint carries (model and optimizer go separately)."""
        return {
            "rng": ckpt.capture_rng({"rollout": self.gen}),
            "trigger": self.trigger.state_dict() if self.trigger else None,
            "agpo": self.agpo.state_dict() if self.agpo else None,
            "health": self.health.state_dict(),
            "nonfinite": (self.nonfinite_run, self.nonfinite_total),
            "evals": self.evals,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        ckpt.restore_rng(state["rng"], {"rollout": self.gen})
        if self.trigger and state["trigger"]:
            self.trigger.load_state_dict(state["trigger"])
        if self.agpo and state["agpo"]:
            self.agpo.load_state_dict(state["agpo"])
        self.health.load_state_dict(state["health"])
        self.nonfinite_run, self.nonfinite_total = state["nonfinite"]
        self.evals = dict(state["evals"])


# ---- setup ---------------------------------------------------------------------------------


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _wrap_lora(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    m = cfg.model
    lora = LoraConfig(
        r=m.lora_rank,
        lora_alpha=m.lora_alpha,
        target_modules=list(m.lora_targets),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def _reference(model: torch.nn.Module, preset: presets.Preset, cfg: RunConfig) -> Any:
    """A frozen copy of the initial policy, only when β > 0 (LoRA: the adapter switched off)."""
    if preset.beta <= 0:
        return None
    if cfg.model.lora_rank > 0:
        return "adapter-off"
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def load_policy(cfg: RunConfig, task: Any) -> tuple[torch.nn.Module, Any]:
    """The policy and tokenizer: ``grouprl.models.load``, then the cached SFT warm start."""
    from grouprl import models

    dtype = getattr(torch, cfg.model.dtype)
    model, tokenizer = models.load(cfg.model.name, task=task, dtype=dtype, seed=cfg.run.seed)
    if cfg.model.warm_start and cfg.model.name.split(":", 1)[0] == "tiny":
        from grouprl.train import sft

        model = sft.warm_start(
            model,
            tokenizer,
            task,
            steps=cfg.model.sft_steps,
            seed=cfg.run.seed,
            progress=cfg.run.progress,
        )
    return model, tokenizer


def setup(cfg: RunConfig, *, model: Any = None, tokenizer: Any = None, task: Any = None) -> Run:
    """Build the run (or restore it from the latest good checkpoint when ``run.resume``)."""
    cfg.validate(check_names=task is None or model is None)
    torch.set_num_threads(cfg.run.threads)
    _seed_everything(cfg.run.seed)
    preset = cfg.algorithm.resolve()
    if task is None:
        from grouprl import tasks

        task = tasks.get(cfg.task.name, **dict(cfg.task.params))
    if model is None:
        model, tokenizer = load_policy(cfg, task)
    if cfg.model.lora_rank > 0:
        model = _wrap_lora(model, cfg)
    model.eval()  # [OURS] dropout off in RL (TRL disable_dropout=True): ratio 1 on-policy
    ref = _reference(model, preset, cfg)
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
    )
    agpo = None
    if preset.controller == "agpo":
        from grouprl.control import agpo as agpo_mod

        agpo = agpo_mod.AGPO(base_temperature=cfg.sampling.temperature)
    run = Run(
        cfg,
        preset,
        task,
        model,
        tokenizer,
        ref,
        optimizer,
        gen=torch.Generator().manual_seed(cfg.run.seed),
        trigger=advantages.VirtualTrigger() if preset.virtual else None,
        agpo=agpo,
        health=RunHealth(),
    )
    if cfg.run.resume:
        _resume(run)
    return run


def _resume(run: Run) -> None:
    ckpt_dir = run.run_dir / "checkpoints"
    for stale in ckpt_dir.glob(".tmp-*") if ckpt_dir.is_dir() else []:
        import shutil

        shutil.rmtree(stale, ignore_errors=True)
    loaded = ckpt.latest_good(ckpt_dir)
    if loaded is None:
        print(f"resume: no usable checkpoint in {ckpt_dir}; starting from step 0", flush=True)
        return
    ckpt.load_trainable(run.model, loaded.model)
    run.optimizer.load_state_dict(loaded.optimizer)
    run.load_state(loaded.state)
    run.step = loaded.step
    print(f"resume: continuing after step {loaded.step} from {loaded.path}", flush=True)


def save_checkpoint(run: Run) -> Path:
    """Checkpoint the run at its current step (atomic, checksummed, keep last K)."""
    return ckpt.save(
        run.run_dir / "checkpoints",
        run.step,
        model=run.model,
        optimizer=run.optimizer,
        state=run.state(),
        keep_last=run.cfg.run.keep_last,
    )


# ---- signals -------------------------------------------------------------------------------


class _StopFlag:
    signum: int | None = None


@contextlib.contextmanager
def _graceful_stop() -> Iterator[_StopFlag]:
    """SIGINT/SIGTERM set a flag (the loop checkpoints and returns); a second SIGINT aborts."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        if flag.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.signum = signum
        print(
            f"\nsignal {signum}: checkpointing after this step (Ctrl-C again to abort)", flush=True
        )

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---- the update ----------------------------------------------------------------------------


def _micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(rows.split(size)) if size else [rows]


def _ref_logp(run: Run, b: Batch, rows: torch.Tensor, temperature: float) -> torch.Tensor | None:
    if run.ref is None:
        return None
    args = (b.prompt_ids[rows], b.prompt_mask[rows], b.completion_ids[rows], b.mask[rows])
    kw = {"temperature": temperature, "chunk": run.cfg.optim.logprob_chunk}
    with torch.no_grad():
        if run.ref == "adapter-off":
            with run.model.disable_adapter():
                return completion_logprobs(run.model, *args, **kw).logp
        return completion_logprobs(run.ref, *args, **kw).logp


def _minibatch(run: Run, b: Batch, rows: torch.Tensor, clip: dict, times: dict) -> dict:
    """One optimizer step over ``rows``: micro-batches share the step's StepTotals."""
    cfg, preset = run.cfg, run.preset
    micro = _micro_batches(rows, cfg.optim.micro_batch_size)
    totals = losses.step_totals(
        [b.mask[m] for m in micro],
        keep=[b.keep[m] for m in micro],
        max_len=max(cfg.sampling.max_new_tokens, b.mask.shape[1]),
    )
    stats: dict[str, float] = {}
    if totals.is_empty:
        return {"optim/empty_steps": 1.0}
    finite = True
    for m in micro:
        t0 = time.perf_counter()
        lp = completion_logprobs(
            run.model,
            b.prompt_ids[m],
            b.prompt_mask[m],
            b.completion_ids[m],
            b.mask[m],
            temperature=b.temperature,
            chunk=cfg.optim.logprob_chunk,
            entropy=cfg.optim.entropy,
        )
        if not torch.isfinite(lp.logp.detach()).all():  # the surrogate refuses such input
            finite = False
            break
        obj = losses.objective(
            lp.logp,
            b.old_logp[m],
            b.adv[m],
            b.mask[m],
            surrogate=preset.surrogate,
            surrogate_params=clip,
            aggregation=preset.aggregation,
            totals=totals,
            keep=b.keep[m],
            ref_logp=None if b.ref_logp is None else b.ref_logp[m],
            kl=preset.kl,
            beta=preset.beta,
            kl_weight=b.kl_weight[m],
            entropy=lp.entropy,
        )
        t1 = time.perf_counter()
        times["logprobs"] += t1 - t0
        if not torch.isfinite(obj.loss):
            finite = False
            break
        obj.loss.backward()
        times["backward"] += time.perf_counter() - t1
        w = len(m) / len(rows)  # token-independent weight for the logged means [OURS]
        for key, value in obj.stats.items():
            name = f"loss/{key[:-5]}" if key.endswith("_loss") else f"policy/{key}"
            stats[name] = stats.get(name, 0.0) + (value if key.endswith("loss") else w * value)
    t0 = time.perf_counter()
    params = [p for p in run.model.parameters() if p.requires_grad]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
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
    if run.agpo is not None:
        clip.update(run.agpo.clip_params(b))
    shuffle = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + run.step)
    g, n_groups = b.group_size, b.num_prompts
    sums: dict[str, float] = {}
    count = 0
    for _ in range(cfg.optim.ppo_epochs):
        order = torch.randperm(n_groups, generator=shuffle)  # [P]
        for groups in order.chunk(cfg.optim.minibatches):
            rows = (groups[:, None] * g + torch.arange(g)).reshape(-1).sort().values  # [n]
            for key, value in _minibatch(run, b, rows, clip, times).items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
    out = {k: v / count for k, v in sums.items() if not k.startswith("optim/") or "norm" in k}
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
    b.attach(adv, _ref_logp(run, b, torch.arange(b.size), b.temperature))
    # -- 4. update ----------------------------------------------------------------------------
    metrics.update(update(run, b, times))
    if run.agpo is not None:
        metrics.update(run.agpo.after_update(run, b))
    # -- 5. metrics ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    metrics.update(diagnostics.step_metrics(b.rewards, adv, reward_range=run.task.reward_range))
    metrics.update({f"adv/{k}": float(v) for k, v in adv.stats.items()})
    metrics["kl/mean"] = metrics.pop("policy/kl_mean", 0.0)
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
        with _graceful_stop() as stop:
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
