"""A run's state and its life cycle: build it, resume it, checkpoint it, stop it on a signal.

``setup`` builds a :class:`Run` (task, policy with its cached SFT warm start, optional LoRA,
reference model only when β > 0, AdamW, controllers, run health) and, with ``run.resume``,
restores everything from the latest intact checkpoint. ``save_checkpoint`` writes the
parts that change; ``graceful_stop`` turns SIGINT/SIGTERM into "checkpoint after this step".
"""

from __future__ import annotations

import contextlib
import copy
import random
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grouprl import advantages, presets
from grouprl.diagnostics.health import RunHealth
from grouprl.train import checkpoint as ckpt
from grouprl.train.config import RunConfig

__all__ = ["Run", "graceful_stop", "load_policy", "save_checkpoint", "setup"]


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
    sinks: Any = None  # grouprl.train.sinks.Sinks once the loop opens them
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
def graceful_stop() -> Iterator[_StopFlag]:
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
