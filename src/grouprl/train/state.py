"""A run's state and its life cycle: build it, resume it, checkpoint it, stop it on a signal.

``setup`` builds a :class:`Run` (task, :class:`~grouprl.train.policy.Policy` with its cached
SFT warm start, optional LoRA and its precision, reference model only when β > 0, AdamW,
controllers, run health) and, with ``run.resume``,
restores everything from the latest intact checkpoint. ``save_checkpoint`` writes the
parts that change; ``graceful_stop`` turns SIGINT/SIGTERM into "checkpoint after this step".
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from grouprl import advantages, presets
from grouprl._threads import choose_threads
from grouprl.diagnostics.health import RunHealth
from grouprl.tasks.base import Task
from grouprl.train import checkpoint as ckpt
from grouprl.train import resume
from grouprl.train.batch import Scorer
from grouprl.train.config import RunConfig
from grouprl.train.controllers import Controller, make_controller
from grouprl.train.malloc import map_large_blocks
from grouprl.train.policy import Policy
from grouprl.train.prompts import Prompts
from grouprl.train.reference import Reference, make_reference

if TYPE_CHECKING:
    from grouprl.train.sinks import Sinks

__all__ = ["Run", "graceful_stop", "load_policy", "resolve_device", "save_checkpoint", "setup"]


@dataclass
class Run:
    """Everything a step touches; the parts that change are saved in checkpoints.

    The step's parts take only what they use: the policy (``policy``) for sampling and
    log-probs, the scorer (``scorer``) for rewards; the run itself is the loop's.
    """

    cfg: RunConfig
    preset: presets.Preset
    task: Task
    policy: Policy
    reference: Reference
    controller: Controller
    prompts: Prompts
    optimizer: torch.optim.Optimizer
    gen: torch.Generator  # rollout sampling, on the policy's device
    trigger: advantages.VirtualTrigger | None
    health: RunHealth
    kl_controller: Any = None  # β of a KL folded into the reward (grouprl.control.kl), or None
    sinks: Sinks | None = None  # opened by the loop
    step: int = 0
    nonfinite_run: int = 0
    nonfinite_total: int = 0
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    resume_note: dict[str, Any] | None = None
    """what ``--resume-anyway`` changed (``train.resume.check``), logged with
    the first metrics row after the resume."""

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.out)

    @property
    def model(self) -> torch.nn.Module:
        """The policy's model (``policy.model``)."""
        return self.policy.model

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (a transformers ``PreTrainedTokenizerBase``)."""
        return self.policy.tokenizer

    @property
    def device(self) -> torch.device:
        """Where the policy lives; every tensor of a step is created there."""
        return self.policy.device

    @property
    def scorer(self) -> Scorer:
        """How this step scores completions: the task's verifier under ``sampling``'s
        timeout and unscorable limit, at the current step; errors go to the sinks."""
        s = self.cfg.sampling
        return Scorer(
            self.task,
            timeout_s=s.verify_timeout_s,
            max_unscorable_frac=s.max_unscorable_frac,
            max_steps=self.cfg.optim.steps,
            step=self.step,
            say=None if self.sinks is None else self.sinks.print,
        )

    def print(self, message: str) -> None:
        """A line for the user: through the sinks (above the progress bar) once they are open."""
        if self.sinks is not None:
            self.sinks.print(message)
        else:
            print(message, flush=True)

    def state(self) -> dict[str, Any]:
        """The non-tensor state a checkpoint carries (model and optimizer go separately)."""
        return {
            "rng": ckpt.capture_rng({"rollout": self.gen}),
            "device": str(self.device),
            "trigger": self.trigger.state_dict() if self.trigger else None,
            "kl_controller": self.kl_controller.state_dict() if self.kl_controller else None,
            "controller": self.controller.state_dict(),
            "prompts": self.prompts.state_dict(),
            "health": self.health.state_dict(),
            "nonfinite": (self.nonfinite_run, self.nonfinite_total),
            "evals": self.evals,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        saved = torch.device(state.get("device", "cpu"))
        if saved.type == self.device.type:
            ckpt.restore_rng(state["rng"], {"rollout": self.gen})
        else:  # a generator's state does not carry across device types (CPU <-> CUDA)
            ckpt.restore_rng(state["rng"], {})
            self.gen.manual_seed(self.cfg.run.seed * 1_000_003 + int(state.get("step", 0)))
            self.print(
                f"resume: the checkpoint was written on {saved} and this run is on "
                f"{self.device}: the rollout generator is re-seeded from (seed, step), so "
                "from here on the samples differ from an uninterrupted run on the same device"
            )
        if self.trigger and state["trigger"]:
            self.trigger.load_state_dict(state["trigger"])
        if self.kl_controller and state.get("kl_controller"):
            self.kl_controller.load_state_dict(state["kl_controller"])
        self.controller.load_state_dict(state.get("controller", state.get("agpo")))
        self.prompts.load_state_dict(state.get("prompts"))
        self.health.load_state_dict(state["health"])
        self.nonfinite_run, self.nonfinite_total = state["nonfinite"]
        self.evals = dict(state["evals"])


# ---- setup ---------------------------------------------------------------------------------

TORCH_THREADS = torch.get_num_threads()
"""torch's own thread count when this module was imported (one per physical core, or
``OMP_NUM_THREADS``): the most ``run.threads = 0`` (auto) takes."""


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


def resolve_device(spec: str) -> torch.device:
    """``auto`` = the first GPU torch sees (``cuda:0``), else the CPU; ``cpu``, ``cuda``, ``cuda:N``.

    A GPU asked for where torch sees none is a ``ConfigError`` naming what torch sees.
    """
    from grouprl.train.config import ConfigError

    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            raise ConfigError(
                f"model.device={spec!r} but torch sees {count} CUDA device(s) "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                "use model.device=cpu or auto, or install a CUDA build of torch"
            )
        return torch.device("cuda", index)
    return device


def load_policy(cfg: RunConfig, task: Any) -> tuple[torch.nn.Module, Any]:
    """The policy and tokenizer: ``grouprl.models.load``, then the cached SFT warm start."""
    from grouprl import models

    model, tokenizer = models.load(
        cfg.model.name,
        task=task,
        dtype=cfg.model.torch_dtype,
        seed=cfg.run.seed,
        attn_implementation=cfg.model.attention,
    )
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
    device = resolve_device(cfg.model.device)
    torch.set_num_threads(choose_threads(cfg.run.threads, cap=TORCH_THREADS)[0])
    map_large_blocks(cfg.run.mmap_threshold_kib * 1024)  # 0: glibc's default
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
    model.to(device)
    if cfg.optim.activation_checkpointing:
        from grouprl.train.checkpointing import checkpoint_layers
        from grouprl.train.config import ConfigError

        try:
            checkpoint_layers(model)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    reference = make_reference(
        model, beta=preset.beta, lora=cfg.model.lora_rank > 0,
        kl_in_reward=preset.reward_kl_coef > 0,
    )  # fmt: skip
    o = cfg.optim
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=True if o.fused and fused_adamw_supported(trainable) else None,
    )
    policy = Policy(
        model,
        tokenizer,
        precision=cfg.model.autocast,
        micro_batch_size=o.micro_batch_size,
        logprob_chunk=o.logprob_chunk,
        recompute=o.recompute,
        rollout_precision=None
        if cfg.model.rollout_precision == "same"
        else cfg.model.rollout_precision,
    )
    run = Run(
        cfg,
        preset,
        task,
        policy,
        reference,
        make_controller(preset.controller, cfg),
        Prompts(
            task,
            sampler=preset.sampler,
            pool_size=cfg.sampling.pool_size or preset.pool_size,
            seed=cfg.run.seed,
            settings=cfg.sampling,
        ),
        optimizer,
        gen=torch.Generator(device=device).manual_seed(cfg.run.seed),
        trigger=advantages.VirtualTrigger() if preset.virtual else None,
        health=RunHealth(),
        kl_controller=preset.kl_controller(),
    )
    if cfg.run.resume:
        _resume(run)
    return run


def _resume(run: Run) -> None:
    ckpt_dir = run.run_dir / "checkpoints"
    for stale in ckpt_dir.glob(".tmp-*") if ckpt_dir.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)
    loaded = ckpt.latest_good(ckpt_dir)
    # grouprl.train.resume: refuse a folder that holds a run but no checkpoint,
    # and a configuration that changes the experiment (unless --resume-anyway)
    if loaded is None:
        resume.no_checkpoint(run.cfg)
        return
    run.resume_note = resume.check(run.cfg, loaded.manifest, loaded.path)
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
        config=run.cfg.to_dict(),  # recorded for --resume (train.resume)
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


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` accepts ``params`` (``OptimConfig.fused``):
    floating-point tensors on the CPU or a CUDA device (torch's fused kernels exist for
    those); a meta or MPS parameter keeps the default implementation."""
    return bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )
