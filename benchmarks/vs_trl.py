"""grouprl's trainer vs TRL's GRPOTrainer at equal settings, proven from both trainers' live objects.

    python benchmarks/vs_trl.py --model smollm2     # SmolLM2-135M-Instruct, basic_arithmetic
    python benchmarks/vs_trl.py --model tiny        # the 205k-parameter maze Llama after SFT
    python benchmarks/vs_trl.py --settings-only     # build both trainers, compare, stop
    python benchmarks/vs_trl.py --quick             # smoke sizes

Both trainers start from the same weights, train on the same task with the ``grpo`` preset
(TRL: the equivalent ``GRPOConfig`` from ``grouprl.integrations.trl.trl_loss_settings``),
P prompts × G completions per step, one AdamW step per generation batch, in fp32 on the CPU
with no autocast (TRL's ``GRPOConfig`` defaults ``bf16=True``, which on a CPU means
``torch.autocast("cpu", bfloat16)``, and ``gradient_checkpointing=True``; both are turned off
here), the same micro-batch, sampling, completion length, threads and steps.
``--gradient-checkpointing`` turns checkpointing on in both (TRL's default,
``gradient_checkpointing=True``; grouprl's ``optim.activation_checkpointing=true``), so that
the comparison with checkpointing is like with like too. Each trainer runs
in its own child process (its peak RSS is its own), one after the other.

Equal settings, shown: each child builds its trainer and reads the settings back from the
trainer's live objects (TRL: ``trainer.args``, ``trainer.accelerator.autocast()``,
``trainer.generation_config``, the optimizer's ``param_groups``, ``model.config``,
``torch.get_num_threads()``; grouprl: the ``Run`` that ``grouprl.train.state.setup`` builds
from the same config: ``run.cfg``, ``run.policy.autocast()``, ``run.optimizer``, ``run.model``). A
forward pre-hook on the decoder records what every forward pass of the timed run actually ran
with (parameter dtype, autocast, threads, train mode, dropout, gradient checkpointing, prompt
lengths) and counts the passes. The table goes into the JSON; a row that differs stops the run
before anything is timed (rows compared from the construction) or fails it after (rows observed
during the run), with a message listing the rows.

Measured per trainer: ``samples_per_s`` / ``tokens_per_s`` (completions and generated tokens
per second of ``train()``; model loading, TRL's trainer construction and grouprl's final
checkpoint write excluded: TRL saves nothing with ``save_strategy="no"``), ``samples_per_cpu_s``
(completions per CPU second of the child's process, all its threads: on a shared machine the
wall clock also counts the time other processes held the cores), ``peak_rss_mib``
(the child's ``ru_maxrss``; grouprl's taken before that checkpoint write, which is reported
separately), the per-phase time split (generate, score, forward, backward,
optimizer), the training reward, and (``--eval-prompts`` > 0) the held-out reward of the final
policy under one sampler (grouprl's rollout for both). Ratios are grouprl / TRL. The machine's
load average before and after each child is in the JSON: numbers taken on a busy machine are
provisional.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import loadguard  # benchmarks/loadguard.py: headline files only from idle runs

# the environment ``grouprl train`` gives its own process, given to the grouprl worker; the TRL
# worker runs in the caller's (grouprl.cli imports no torch)
from grouprl.cli import PROCESS_ENV as GROUPRL_PROCESS_ENV

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

MODELS: dict[str, dict[str, Any]] = {
    # the maze miniature: 16 mazes x 8, 32 tokens, after the cached SFT warm start
    "tiny": {
        "task": "maze",
        "sft_steps": 1400,
        "prompts": 16,
        "group": 8,
        "max_new": 32,
        "steps": 20,
        "lr": 5e-5,
        "micro": 0,
        "chunk": 2048,
        "eval_prompts": 128,
        "eval_samples": 8,
        "verify_timeout": 0.0,
    },
    # SmolLM2-135M-Instruct on one-digit arithmetic with the chat template
    "smollm2": {
        "task": "basic_arithmetic",
        "sft_steps": 0,
        "prompts": 8,
        "group": 8,
        "max_new": 64,
        "steps": 5,
        "lr": 2e-6,
        "micro": 16,
        "chunk": 256,
        "eval_prompts": 0,
        "eval_samples": 8,
        "verify_timeout": 0.0,
    },
}
"""Per-model defaults [OURS]: grouprl's own defaults for that model (config.PROFILES), with
``micro`` sequences per forward/backward (0 = the whole batch) on both sides."""

QUICK: dict[str, dict[str, Any]] = {
    "tiny": {"steps": 3, "prompts": 4, "group": 4, "max_new": 16, "sft_steps": 0,
             "eval_prompts": 16, "eval_samples": 4},
    "smollm2": {"steps": 1, "prompts": 2, "group": 4, "max_new": 8, "micro": 4,
                "eval_prompts": 0},
}  # fmt: skip
"""``--quick`` sizes (smoke: seconds for tiny, about a minute for SmolLM2)."""


def _rss_mib() -> float:
    """Peak RSS of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class MemoryProbe:
    """Resident memory (``/proc/self/statm``) sampled on a thread every ``interval`` seconds,
    with the peak of each phase the trainer is in (set by :meth:`during`).

    The overall peak is ``ru_maxrss`` (exact); per-phase peaks are the largest samples taken
    in that phase, so a spike shorter than the interval can be missed. The same probe runs in
    both children.
    """

    def __init__(self, interval: float = 0.002) -> None:
        import threading

        self.phase = "load"
        self.peak: dict[str, float] = {}
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss_mib(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page / 2**20

    def _sample(self) -> None:
        rss, phase = self.rss_mib(), self.phase
        if rss > self.peak.get(phase, 0.0):
            self.peak[phase] = rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    @contextlib.contextmanager
    def during(self, phase: str):
        before, self.phase = self.phase, phase
        self._sample()
        try:
            yield
        finally:
            self._sample()
            self.phase = before

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        """``obj.name`` runs inside ``during(phase)`` when called in the timed run's ``train``
        phase (the outermost phase wins when calls nest)."""
        fn = getattr(obj, name)

        def probed(*a: Any, **k: Any) -> Any:
            if self.phase != "train":  # outside the timed run, or already inside a phase
                return fn(*a, **k)
            with self.during(phase):
                return fn(*a, **k)

        setattr(obj, name, probed)

    def close(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {k: round(v, 1) for k, v in self.peak.items()}


MEMORY = MemoryProbe if sys.platform.startswith("linux") else None
"""The probe where ``/proc/self/statm`` exists."""


_MEM: MemoryProbe | None = None
"""The child's memory probe (None in the parent, in --settings-only, off Linux)."""


@contextlib.contextmanager
def _phase(name: str):
    if _MEM is None:
        yield
        return
    with _MEM.during(name):
        yield


def _capture_optimizers() -> list:
    """Every optimizer that takes a step (the trainers build their own): wrap
    ``Optimizer.step``'s subclasses in use (AdamW), the step also counted as the
    ``optimizer`` memory phase."""
    import torch

    seen: list = []
    step = torch.optim.AdamW.step

    def recorded(self, *a: Any, **k: Any) -> Any:
        if not any(o is self for o in seen):
            seen.append(self)
        with (
            _phase("optimizer")
            if _MEM is not None and _MEM.phase == "train"
            else contextlib.nullcontext()
        ):
            return step(self, *a, **k)

    torch.optim.AdamW.step = recorded
    return seen


def _tensor_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def memory_breakdown(
    model, optimizers: list, peaks: dict[str, float], rss: dict[str, float]
) -> dict:
    """Where the memory goes: the process before the model, the weights, their gradients
    (one per trainable parameter, fp32 as the parameters), the optimizer's state, and the
    rest of each phase's peak (activations, logits, caches, temporaries, allocator slack)."""
    import torch

    params = _tensor_mib(model.parameters())
    grads = _tensor_mib(p for p in model.parameters() if p.requires_grad)
    state = 0.0
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        state += _tensor_mib(
            v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        )
    fixed = rss["after_model_mib"] + grads + state
    return {
        "rss_before_model_mib": round(rss["before_model_mib"], 1),
        "rss_after_model_mib": round(rss["after_model_mib"], 1),
        "parameters_mib": round(params, 1),
        "gradients_mib": round(grads, 1),
        "optimizer_state_mib": round(state, 1),
        "peak_by_phase_mib": peaks,
        "above_model_grads_optimizer_by_phase_mib": {
            k: round(v - fixed, 1) for k, v in peaks.items() if k not in ("load", "setup")
        },
    }


def machine() -> dict[str, Any]:
    """CPU model, the SIMD flags that decide fp32/bf16 speed, cores, load, versions."""
    model, flags = "?", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {
        "cpu_model": model,
        "cpu_flags": [f for f in wanted if f in flags],
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


# ---- the starting policy and the task ---------------------------------------------------------


def build(args: argparse.Namespace):
    """The starting policy, its tokenizer and the task (identical in both children)."""
    import torch

    from grouprl import models, tasks

    task = tasks.get(args.task)
    name = "tiny" if args.model == "tiny" else args.model
    # [OURS] the start is fixed (init and SFT seed 0: the cached warm start `grouprl train`
    # uses); --seed changes only the RL runs (prompt order, sampling).
    model, tok = models.load(
        name, task=task, dtype=torch.float32, seed=0, attn_implementation="sdpa"
    )
    if args.sft_steps > 0:
        from grouprl.train import sft

        model = sft.warm_start(model, tok, task, steps=args.sft_steps, seed=0, progress=False)
    dtype = getattr(torch, PRECISION_MODES[args.precision]["dtype"])
    return model.to(dtype).eval(), tok, task


def weights_checksum(model) -> float:
    """Sum of every parameter in float64: equal starting weights give equal sums."""
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def train_prompts(args: argparse.Namespace, task, tok) -> list[tuple[str, Any]]:
    """(rendered prompt, reference) of every step, in the order grouprl's loop draws them
    (its own prompt source, ``grouprl.train.prompts.Prompts``, for the preset's sampler)."""
    from grouprl import presets
    from grouprl.train.prompts import Prompts

    sampler = presets.get(args.preset).sampler
    source = Prompts(task, sampler=sampler, pool_size=0, seed=args.seed)
    out = []
    for step in range(1, args.steps + 1):  # the loop increments run.step before the step
        examples, _ = source.draw(args.prompts, step, 0)
        out += [(task.render(ex, tok), ex.reference) for ex in examples]
    return out


def evaluate(model, tok, task, args: argparse.Namespace) -> dict[str, float] | None:
    """Mean reward and pass@1 on ``--eval-prompts`` held-out examples × ``--eval-samples``."""
    if args.eval_prompts <= 0:
        return None
    import torch

    from grouprl.rollout import hf

    examples = task.examples("eval", args.eval_prompts, 12345)
    prompts = [task.render(ex, tok) for ex in examples]
    gen = torch.Generator().manual_seed(999)
    sampling = hf.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new)
    with torch.no_grad():
        roll = hf.generate(model, tok, prompts, args.eval_samples, sampling, gen)
    refs = [ex.reference for ex in examples for _ in range(args.eval_samples)]
    r = torch.tensor([task.verify(t, ref) for t, ref in zip(roll.texts, refs)], dtype=torch.float64)
    per_prompt = r.view(len(examples), -1).mean(1)  # [P]
    return {
        "reward": float(r.mean()),
        "reward_se": float(per_prompt.std() / math.sqrt(len(examples))),
        "pass@1": float(r.mean()),
    }


# ---- settings, read back from live objects ---------------------------------------------------


def _autocast_state() -> str:
    """``off`` or ``cpu <dtype>``: the autocast state of the calling code, on the CPU."""
    import torch

    if not torch.is_autocast_enabled("cpu"):
        return "off"
    return f"cpu {str(torch.get_autocast_dtype('cpu')).removeprefix('torch.')}"


def _param_dtypes(model) -> str:
    return ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}))


def _dropout_p(model) -> float:
    """The largest dropout probability in the model: Dropout modules and attention dropout."""
    import torch

    ps = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    ps.append(float(getattr(model.config, "attention_dropout", 0.0) or 0.0))
    return float(max(ps))


def _optimizer(opt) -> dict[str, Any]:
    """Class and the distinct hyper-parameter sets of an optimizer's param groups."""
    inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "fused", "foreach")
    groups = {
        json.dumps({k: g.get(k) for k in keys}, sort_keys=True, default=list)
        for g in inner.param_groups
    }
    return {"class": type(inner).__name__, "groups": [json.loads(g) for g in sorted(groups)]}


def _grouprl_checkpointing(model) -> bool:
    """True when grouprl's activation checkpointing wrapped the model's decoder layers
    (``grouprl.train.checkpointing.checkpoint_layers`` marks each layer it wraps)."""
    return any(getattr(m, "_grouprl_checkpointed", False) for m in model.modules()) or bool(
        getattr(model, "is_gradient_checkpointing", False)
    )


def _trainable(model) -> int:
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad))


_SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}
"""grouprl estimator -> the TRL ``scale_rewards`` that computes the same advantage."""

_OVERLONG = {None: "kept", "mask": "masked", "soft": "soft penalty"}


def grouprl_settings(run) -> dict[str, Any]:
    """The settings table of a grouprl ``Run`` (``grouprl.train.state.setup``)."""
    import torch

    from grouprl.integrations.trl import trl_loss_settings
    from grouprl.rollout import hf

    cfg, model, o, s = run.cfg, run.model, run.cfg.optim, run.cfg.sampling
    with run.policy.autocast():
        autocast = _autocast_state()
    per_step = cfg.batch_size // o.minibatches
    return {
        "parameter dtype": _param_dtypes(model),
        "autocast in forward passes": autocast,
        "attention implementation": model.config._attn_implementation,
        "torch threads": torch.get_num_threads(),
        "prompts per step": s.prompts_per_step,
        "group size": s.group_size,
        "sequences per forward/backward (micro-batch)": o.micro_batch_size or per_step,
        "max completion tokens": s.max_new_tokens,
        "prompt truncation": "none",
        "temperature": s.temperature,
        "top-p": s.top_p,
        "top-k": "off",  # grouprl's sampler has no top-k, min-p or repetition penalty
        "min-p": "off",
        "repetition penalty": 1.0,
        "EOS token ids": hf._eos_ids(model, run.tokenizer),
        "optimizer": _optimizer(run.optimizer),
        "lr schedule": "constant, no warm-up",  # the loop has no scheduler
        "grad clip (global norm)": o.grad_clip if o.grad_clip > 0 else "off",
        "epochs per generation batch": o.ppo_epochs,
        "optimizer steps per epoch": o.minibatches,
        "gradient checkpointing": _grouprl_checkpointing(model),
        "dropout probability (modules, attention)": _dropout_p(model),
        "loss": trl_loss_settings(run.preset),
        "advantage (TRL scale_rewards)": _SCALE_REWARDS.get(run.preset.estimator, "other"),
        "truncated completions": _OVERLONG.get(run.preset.overlong, run.preset.overlong),
        "trainable parameters": _trainable(model),
    }


def trl_settings(trainer) -> dict[str, Any]:
    """The same table from a live ``GRPOTrainer`` (after ``create_optimizer``)."""
    import torch

    a, gen = trainer.args, trainer.generation_config
    with trainer.accelerator.autocast():
        autocast = _autocast_state()
    warm = float(a.warmup_steps or 0) + float(getattr(a, "warmup_ratio", 0) or 0)
    schedule = str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type))
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    return {
        "parameter dtype": _param_dtypes(trainer.model),
        "autocast in forward passes": autocast,
        "attention implementation": trainer.model.config._attn_implementation,
        "torch threads": torch.get_num_threads(),
        "prompts per step": a.generation_batch_size // trainer.num_generations,
        "group size": trainer.num_generations,
        "sequences per forward/backward (micro-batch)": a.per_device_train_batch_size,
        "max completion tokens": gen.max_new_tokens,
        "prompt truncation": getattr(a, "max_prompt_length", None) or "none",
        "temperature": gen.temperature,
        "top-p": gen.top_p,
        "top-k": gen.top_k or "off",
        "min-p": gen.min_p or "off",
        "repetition penalty": gen.repetition_penalty,
        "EOS token ids": sorted(int(i) for i in eos),
        "optimizer": _optimizer(trainer.optimizer),
        "lr schedule": f"{schedule}, no warm-up" if warm == 0 else f"{schedule}, warm-up {warm}",
        "grad clip (global norm)": a.max_grad_norm if a.max_grad_norm > 0 else "off",
        "epochs per generation batch": trainer.num_iterations,
        "optimizer steps per epoch": a.steps_per_generation // a.gradient_accumulation_steps,
        # the Trainer switches it on inside train(): its argument says what it will do
        "gradient checkpointing": bool(
            a.gradient_checkpointing or getattr(trainer.model, "is_gradient_checkpointing", False)
        ),
        "dropout probability (modules, attention)": _dropout_p(trainer.model),
        "loss": {
            "loss_type": trainer.loss_type,
            "epsilon": trainer.epsilon_low,
            "epsilon_high": trainer.epsilon_high,
            "importance_sampling_level": trainer.importance_sampling_level,
            "delta": a.delta,
            "beta": trainer.beta,
            "use_bias_correction_kl": a.use_bias_correction_kl,
        },
        "advantage (TRL scale_rewards)": trainer.scale_rewards,
        "truncated completions": "masked" if trainer.mask_truncated_completions else "kept",
        "trainable parameters": _trainable(trainer.model),
    }


class Probe:
    """A forward pre-hook on the decoder: what every forward pass actually ran with.

    Per pass: gradient on or off, with or without a KV cache (decode steps have one; a
    prefill or a scoring forward has none), rows × tokens, and the autocast state, torch
    threads, parameter dtype, train mode, active dropout and gradient checkpointing at that
    moment; for the rollouts' prefills (whole-model passes without gradient or cache) the
    prompt lengths. No-gradient
    passes are the rollouts' (and grouprl's statistics-only forwards of collapsed groups).
    """

    def __init__(self, model) -> None:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = inner.base_model
        self.passes = {"grad": 0, "no_grad_cached": 0, "no_grad_uncached": 0}
        self.grad_tokens = 0
        self.train_mode: set[bool] = set()
        self.seen: dict[str, set] = {}
        self.prompt_lengths: list[int] = []
        self._handles = [
            self.decoder.register_forward_pre_hook(self._hook, with_kwargs=True),
            # the rollouts call the whole model (grouprl's log-probs call the decoder alone)
            model.register_forward_pre_hook(self._prompts, with_kwargs=True),
        ]

    def _note(self, key: str, value: Any) -> None:
        self.seen.setdefault(key, set()).add(json.dumps(value))

    def _hook(self, module, args, kwargs) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        rows, length = (ids.shape[0], ids.shape[1]) if ids is not None else (0, 0)
        past = kwargs.get("past_key_values")
        cached = past is not None and past.get_seq_length() > 0
        grad = torch.is_grad_enabled()
        kind = "grad" if grad else ("no_grad_cached" if cached else "no_grad_uncached")
        self.passes[kind] += 1
        self._note(f"autocast in {'gradient' if grad else 'no-gradient'} passes", _autocast_state())
        self._note("parameter dtype in forward", _param_dtypes(module))
        self._note("torch threads in forward", torch.get_num_threads())
        # active = recomputing in the backward: transformers' only in train mode, grouprl's
        # wrapping (train/checkpointing.py) in any mode; neither where grad is off
        hf_on = bool(getattr(module, "gradient_checkpointing", False) and module.training)
        checkpointing = grad and (hf_on or _grouprl_checkpointing(module))
        self._note("gradient checkpointing active", checkpointing)
        if grad:
            self.grad_tokens += rows * length
            self.train_mode.add(bool(module.training))  # information: dropout is what counts
            self._note("dropout in gradient passes", _dropout_p(module) if module.training else 0.0)

    def _prompts(self, module, args, kwargs) -> None:
        """Prompt lengths of the rollouts' prefills: whole-model passes, no gradient, no cache."""
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("past_key_values")
        if torch.is_grad_enabled() or ids is None or (past is not None and past.get_seq_length()):
            return
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            self.prompt_lengths += mask.sum(-1).tolist()
        else:
            self.prompt_lengths += [ids.shape[1]] * ids.shape[0]

    def close(self) -> dict[str, Any]:
        """Observed rows (compared) and pass counts (information: a trainer's choice)."""
        for handle in self._handles:
            handle.remove()
        rows = {k: sorted(json.loads(v) for v in vs) for k, vs in sorted(self.seen.items())}
        lengths = self.prompt_lengths
        rows["prompt tokens per sequence (mean, max)"] = (
            [round(sum(lengths) / len(lengths), 3), max(lengths)] if lengths else None
        )
        counts = {**self.passes, "grad_tokens": self.grad_tokens,
                  "train_mode_in_training_forward": sorted(self.train_mode)}  # fmt: skip
        return {"observed": rows, "forward_passes": counts}


# ---- the two trainers -------------------------------------------------------------------------


def grouprl_config(args: argparse.Namespace, out: Path):
    from grouprl.train.config import load_config

    return load_config(
        None,
        [
            f"model.name={args.model}",
            "model.warm_start=false",
            f"model.dtype={PRECISION_MODES[args.precision]['dtype']}",
            f"model.autocast={PRECISION_MODES[args.precision]['autocast']}",
            "model.attention=sdpa",
            "model.device=cpu",
            f"task.name={args.task}",
            f"sampling.prompts_per_step={args.prompts}",
            f"sampling.group_size={args.group}",
            f"sampling.max_new_tokens={args.max_new}",
            "sampling.temperature=1.0",
            "sampling.top_p=1.0",
            f"sampling.verify_timeout_s={args.verify_timeout}",
            f"algorithm.preset={args.preset}",
            f"optim.steps={args.steps}",
            f"optim.lr={args.lr}",
            "optim.grad_clip=1.0",
            "optim.ppo_epochs=1",
            "optim.minibatches=1",
            f"optim.micro_batch_size={args.micro}",
            f"optim.logprob_chunk={args.chunk}",
            "optim.entropy=true",
            "eval.every=0",
            f"run.out={out}",
            "run.every=0",
            f"run.seed={args.seed}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "run.save_final=false",  # TRL writes nothing at the end either
            f"run.threads={args.threads}",
            f"optim.activation_checkpointing={str(args.gradient_checkpointing).lower()}",
            *args.grouprl_set,
        ],
    )


def run_grouprl(args: argparse.Namespace, model, tok, task, out: Path) -> dict[str, Any]:
    from grouprl.train import loop
    from grouprl.train.sinks import read_jsonl
    from grouprl.train.state import setup

    cfg = grouprl_config(args, out)
    settings = grouprl_settings(setup(cfg, model=model, tokenizer=tok, task=task))
    if args.settings_only:
        return {"settings": settings}
    probe = Probe(model)
    saving = _checkpoint_meter(loop)  # the final checkpoint: TRL runs with save_strategy="no"
    if _MEM is not None:
        from grouprl.rollout import hf
        from grouprl.train import batch, policy

        _MEM.wrap(hf, "generate", "generate")
        for module in (policy, loop, batch):  # where the log-prob kernel is called from
            if hasattr(module, "completion_logprobs"):
                _MEM.wrap(module, "completion_logprobs", "forward")
    t0, c0 = time.perf_counter(), time.process_time()
    with _phase("train"):
        loop.train(cfg, model=model, tokenizer=tok, task=task)
    cpu = time.process_time() - c0  # the checkpoint write's CPU time included (small)
    checkpoint = saving["seconds"]
    wall = time.perf_counter() - t0 - checkpoint
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    n = args.prompts * args.group
    stages = ("generate", "score", "logprobs", "backward", "optimizer")
    phases = {k: sum(r.get(f"time/{k}", 0.0) for r in rows) for k in stages}
    phases["forward"] = phases.pop("logprobs")
    return {
        "settings": settings,
        # how grouprl holds its memory: not a compared setting (no number changes), recorded
        "memory_settings": {
            "run.mmap_threshold_kib": cfg.run.mmap_threshold_kib,
            "optim.recompute": list(cfg.optim.recompute),
            **{k: os.environ.get(k, "") for k in GROUPRL_PROCESS_ENV},
        },
        **probe.close(),
        "wall_s": wall,
        "cpu_s": cpu,
        "init_s": 0.0,
        "checkpoint_s_excluded": checkpoint,
        "peak_rss_before_checkpoint_mib": saving["peak_before_mib"],
        "steps": len(rows),
        "completion_tokens": sum(r["length/mean"] * n for r in rows),
        "train_rewards": [r["reward/mean"] for r in rows],
        "collapsed_group_frac": [r.get("acr/rate") for r in rows],  # all-equal rewards
        "phase_s": phases,
    }


def _checkpoint_meter(loop: Any) -> dict[str, Any]:
    """Wrap the loop's ``save_checkpoint``: its seconds, and the peak RSS before the first save
    (grouprl writes a checkpoint at the last step; TRL here writes none)."""
    meter: dict[str, Any] = {"seconds": 0.0, "peak_before_mib": None}
    save = getattr(loop, "save_checkpoint", None)
    if save is None:
        return meter

    def measured(*a: Any, **k: Any) -> Any:
        if meter["peak_before_mib"] is None:
            meter["peak_before_mib"] = _rss_mib()
        t0 = time.perf_counter()
        try:
            return save(*a, **k)
        finally:
            meter["seconds"] += time.perf_counter() - t0

    loop.save_checkpoint = measured
    return meter


def _value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


class _PhaseTimer:
    """Seconds inside wrapped callables, per phase (TRL's trainer methods)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)


def _optimizer_callback(timer: _PhaseTimer):
    from transformers import TrainerCallback

    class OptimizerTime(TrainerCallback):
        t0 = 0.0

        def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_optimizer_step(self, *a: Any, **k: Any) -> None:
            dt = time.perf_counter() - self.t0
            timer.seconds["optimizer"] = timer.seconds.get("optimizer", 0.0) + dt

    return OptimizerTime()


def trl_config(args: argparse.Namespace, out: Path):
    from trl import GRPOConfig

    from grouprl import presets
    from grouprl.integrations.trl import trl_loss_settings

    preset = presets.get(args.preset)
    loss = trl_loss_settings(preset)
    if loss is None or preset.estimator not in _SCALE_REWARDS:
        raise SystemExit(f"preset {args.preset} has no TRL-native equivalent")
    n = args.prompts * args.group
    micro = args.micro or n
    if n % micro:
        raise SystemExit(f"--micro {micro} must divide prompts x group = {n}")
    fields: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": n // micro,  # one optimizer step per generation batch
        "num_generations": args.group,
        "max_completion_length": args.max_new,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "max_steps": args.steps,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "optim": "adamw_torch_fused",  # transformers' default for torch >= 2.8; grouprl optim.fused
        "num_iterations": 1,
        # fp32 mode: off (GRPOConfig's default bf16=True means bf16 autocast on the CPU)
        "bf16": PRECISION_MODES[args.precision]["autocast"] == "bfloat16",
        "fp16": False,
        # GRPOConfig's default is True; off unless --gradient-checkpointing (then both on)
        "gradient_checkpointing": args.gradient_checkpointing,
        "disable_dropout": True,  # grouprl trains in eval mode (dropout off)
        "shuffle_dataset": False,  # the prompts in grouprl's order
        "scale_rewards": _SCALE_REWARDS[preset.estimator],
        "mask_truncated_completions": preset.overlong == "mask",
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "seed": args.seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "log_completions": False,
        **loss,
    }
    for item in args.trl_set:
        key, _, value = item.partition("=")
        fields[key.strip()] = _value(value)
    return GRPOConfig(**fields)


def run_trl(args: argparse.Namespace, model, tok, task, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOTrainer

    pairs = train_prompts(args, task, tok)
    data = Dataset.from_dict({"prompt": [p for p, _ in pairs], "row": list(range(len(pairs)))})
    references = [ref for _, ref in pairs]

    def task_reward(prompts, completions, row, **kwargs):
        out = []
        for text, i in zip(completions, row):
            try:
                out.append(float(task.verify(text, references[i])))
            except Exception:  # unscorable, as grouprl's NaN
                out.append(None)
        return out

    timer = _PhaseTimer()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=trl_config(args, out),
        train_dataset=data,
        processing_class=tok,
        callbacks=[_optimizer_callback(timer)],
    )
    init = time.perf_counter() - t0
    if args.settings_only:
        trainer.create_optimizer()
        return {"settings": trl_settings(trainer)}
    timer.wrap(trainer, "_generate_single_turn", "generate")
    timer.wrap(trainer, "_calculate_rewards", "score")
    timer.wrap(trainer, "compute_loss", "forward")
    timer.wrap(trainer.accelerator, "backward", "backward")
    if _MEM is not None:
        _MEM.wrap(trainer, "_generate_single_turn", "generate")
        _MEM.wrap(trainer, "_calculate_rewards", "score")
        _MEM.wrap(trainer, "compute_loss", "forward")
    probe = Probe(model)
    t0, c0 = time.perf_counter(), time.process_time()
    with _phase("train"):
        trainer.train()
    cpu = time.process_time() - c0
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    n = args.prompts * args.group
    return {
        "settings": trl_settings(trainer),
        **probe.close(),
        "wall_s": wall,
        "cpu_s": cpu,
        "init_s": init,
        "steps": len(logs),
        "completion_tokens": sum(h["completions/mean_length"] * n for h in logs),
        "train_rewards": [h["reward"] for h in logs],
        "collapsed_group_frac": [h.get("frac_reward_zero_std") for h in logs],
        "phase_s": {k: timer.seconds.get(k, 0.0) for k in _PHASES},
        "model": trainer.model,
    }


_PHASES = ("generate", "score", "forward", "backward", "optimizer")
"""The per-phase split both trainers report: generate (the sampler), score (the reward),
forward (grouprl: the training forward with its log-probs; TRL: ``compute_loss``), backward
(grouprl: the loss and its backward; TRL: ``accelerator.backward``), optimizer (clip excluded
for TRL, included for grouprl); the rest of the wall time is bookkeeping."""


def worker(args: argparse.Namespace) -> None:
    """Child process: build, train with one library, evaluate; JSON on stdout."""
    import torch

    global _MEM

    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    _MEM = MEMORY() if MEMORY is not None and not args.settings_only else None
    optimizers = _capture_optimizers()
    if _MEM is not None:
        _MEM.wrap(torch.Tensor, "backward", "backward")  # both trainers call loss.backward()
    rss = {"before_model_mib": _MEM.rss_mib() if _MEM else 0.0}
    model, tok, task = build(args)
    rss["after_model_mib"] = _MEM.rss_mib() if _MEM else 0.0
    checksum = weights_checksum(model)
    before = evaluate(model, tok, task, args) if args.eval_before else None
    rss0 = _rss_mib()
    fn = run_grouprl if args.worker == "grouprl" else run_trl
    with tempfile.TemporaryDirectory() as tmp, _phase("setup"):
        res = fn(args, model, tok, task, Path(tmp))
    if _MEM is not None:
        _MEM.phase = "after"  # evaluation, checkpoint write
    res["settings"]["initial weights (float64 sum)"] = checksum
    res["settings"]["task"] = args.task
    if args.settings_only:
        print("@@RESULT@@" + json.dumps(res))
        return
    trained = res.pop("model", model)
    peak_all = _rss_mib()
    if _MEM is not None:
        res["memory"] = memory_breakdown(trained, optimizers, _MEM.close(), rss)
    peak = res.get("peak_rss_before_checkpoint_mib") or peak_all
    n = args.prompts * args.group
    k = max(1, len(res["train_rewards"]) // 4)
    phases = res["phase_s"]
    phases["other"] = max(0.0, res["wall_s"] - sum(phases.values()))
    out = {
        **res,
        "samples_per_s": res["steps"] * n / res["wall_s"],
        "tokens_per_s": res["completion_tokens"] / res["wall_s"],
        "s_per_step": res["wall_s"] / max(res["steps"], 1),
        # CPU seconds of the process (all its threads): on a shared machine, where the wall
        # clock also counts the time other processes held the cores, the load-robust measure
        "samples_per_cpu_s": res["steps"] * n / max(res["cpu_s"], 1e-9),
        "peak_rss_mib": peak,
        "peak_rss_incl_checkpoint_mib": peak_all,
        "rss_before_train_mib": rss0,
        "train_reward_mean": sum(res["train_rewards"]) / max(len(res["train_rewards"]), 1),
        "train_reward_last": sum(res["train_rewards"][-k:]) / k,
        "eval": evaluate(trained.eval(), tok, task, args),
        "eval_before": before,
        "load_average_before": list(load0),
        "load_average_after": list(os.getloadavg()),
    }
    print("@@RESULT@@" + json.dumps(out))


# ---- the parent: pre-flight, the two runs, the comparison -------------------------------------


def compare(
    a: dict[str, Any], b: dict[str, Any], *, observed: bool = False
) -> dict[str, dict[str, Any]]:
    """``{row: {grouprl, trl, equal}}`` over the union of rows (a missing row differs).

    ``observed``: rows a trainer never produced (e.g. no gradient pass ran because every
    group collapsed) are ``equal: None``, not compared, rather than a difference.
    """
    table = {}
    for key in list(dict.fromkeys([*a, *b])):
        va, vb = a.get(key, "<missing>"), b.get(key, "<missing>")
        same: bool | None = json.dumps(va, sort_keys=True) == json.dumps(vb, sort_keys=True)
        if observed and "<missing>" in (va, vb):
            same = None
        table[key] = {"grouprl": va, "trl": vb, "equal": same}
    return table


def differing(table: dict[str, dict[str, Any]]) -> list[str]:
    """One line per row that differs: ``row: grouprl X vs TRL Y``."""
    return [
        f"{key}: grouprl {json.dumps(r['grouprl'], sort_keys=True)} "
        f"vs TRL {json.dumps(r['trl'], sort_keys=True)}"
        for key, r in table.items()
        if r["equal"] is False
    ]


class SettingsDiffer(SystemExit):
    """The two trainers do not run with equal settings; the message lists the rows."""

    def __init__(self, when: str, rows: list[str]) -> None:
        super().__init__(
            f"vs_trl: settings differ {when} ({len(rows)} row(s)), the comparison would not be "
            "like with like: " + "; ".join(rows)
        )


def _child(args: argparse.Namespace, which: str, settings_only: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", which, *args.passthrough]
    if settings_only:
        cmd.append("--settings-only")
    elif which == "grouprl" and args.eval_prompts > 0:
        cmd.append("--eval-before")
    # the grouprl worker gets what ``grouprl train`` sets before torch loads (grouprl.cli)
    env = {**GROUPRL_PROCESS_ENV, **os.environ} if which == "grouprl" else dict(os.environ)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@") :])
    raise SystemExit(f"{which} worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="tiny")
    ap.add_argument("--precision", choices=list(PRECISION_MODES), default="fp32",
                    help="fp32 | bf16_autocast (TRL bf16=True) | bf16 (bf16 weights, both)")  # fmt: skip
    ap.add_argument("--steps", type=int)
    ap.add_argument("--prompts", type=int, help="prompts per step (P)")
    ap.add_argument("--group", type=int, help="completions per prompt (G)")
    ap.add_argument("--max-new", type=int, help="max completion tokens")
    ap.add_argument("--micro", type=int, help="sequences per forward/backward (0 = all)")
    ap.add_argument("--chunk", type=int, help="grouprl's log-prob chunk (tokens)")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--preset", default="grpo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both trainers")
    ap.add_argument("--sft-steps", type=int, help="SFT warm start of the tiny model (0 = none)")
    ap.add_argument("--eval-prompts", type=int, help="held-out prompts (0 = no eval)")
    ap.add_argument("--eval-samples", type=int)
    ap.add_argument("--only", choices=("grouprl", "trl"), help="run one trainer only")
    ap.add_argument("--settings-only", action="store_true", help="compare settings; no training")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="checkpointing on in both trainers (TRL's default; grouprl "
                         "optim.activation_checkpointing=true)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smoke sizes (QUICK)")
    ap.add_argument(
        "--trl-set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a GRPOConfig field (e.g. bf16=true: the run then fails)",
    )
    ap.add_argument("--grouprl-set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override a grouprl config field")  # fmt: skip
    ap.add_argument("--worker", choices=("grouprl", "trl"), help=argparse.SUPPRESS)
    loadguard.add_arguments(ap)
    ap.add_argument("--eval-before", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {**MODELS[args.model], **(QUICK[args.model] if args.quick else {})}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.passthrough = [
        f"--model={args.model}",
        f"--precision={args.precision}",
        f"--steps={args.steps}",
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--max-new={args.max_new}",
        f"--micro={args.micro}",
        f"--chunk={args.chunk}",
        f"--lr={args.lr}",
        f"--preset={args.preset}",
        f"--seed={args.seed}",
        f"--threads={args.threads}",
        *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
        f"--sft-steps={args.sft_steps}",
        f"--eval-prompts={args.eval_prompts}",
        f"--eval-samples={args.eval_samples}",
        *[f"--trl-set={s}" for s in args.trl_set],
        *[f"--grouprl-set={s}" for s in args.grouprl_set],
    ]
    return args


def _ratios(g: dict[str, Any], t: dict[str, Any]) -> dict[str, Any]:
    ratios = {
        "samples_per_s": g["samples_per_s"] / t["samples_per_s"],
        "tokens_per_s": g["tokens_per_s"] / t["tokens_per_s"],
        "peak_rss": g["peak_rss_mib"] / t["peak_rss_mib"],
        "samples_per_cpu_s": g["samples_per_cpu_s"] / t["samples_per_cpu_s"],
    }
    if g.get("eval") and t.get("eval"):
        ratios["eval_reward_diff"] = g["eval"]["reward"] - t["eval"]["reward"]
        ratios["eval_reward_diff_se"] = math.hypot(g["eval"]["reward_se"], t["eval"]["reward_se"])
    return ratios


def targets(model: str, precision: str) -> dict[str, tuple[str, float]]:
    """The project's targets, side by side at equal settings: samples/s >= 3x TRL's in fp32 (SmolLM2
    and the tiny maze model), ahead of TRL (> 1x) in bf16; on SmolLM2 peak memory <= 0.5x
    TRL's (the tiny model's ~0.6 GB peak is the Python process itself, alike on both sides)."""
    speed = (">=", 3.0) if precision == "fp32" else (">", 1.0)
    goal = {"samples_per_s": speed}
    if model == "smollm2":
        goal["peak_rss"] = ("<=", 0.5)
    return goal


PRECISION_MODES: dict[str, dict[str, str]] = {
    "fp32": {"dtype": "float32", "autocast": "none", "says": "float32, no autocast (both)"},
    "bf16_autocast": {
        "dtype": "float32",
        "autocast": "bfloat16",
        "says": "float32 weights, bf16 autocast (TRL bf16=True; grouprl model.autocast=bfloat16)",
    },
    "bf16": {
        "dtype": "bfloat16",
        "autocast": "bfloat16",
        "says": "bfloat16 weights, gradients and AdamW state, bf16 autocast (both)",
    },
}
"""``--precision``: the weights' dtype and the autocast of both trainers (TRL's ``bf16``)."""


def _targets(ratios: dict[str, Any], goal: dict[str, tuple[str, float]]) -> dict[str, bool]:
    check = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b}
    out = {k: check[op](ratios[k], value) for k, (op, value) in goal.items()}
    if "eval_reward_diff" in ratios:
        out["eval_reward_not_worse"] = (
            ratios["eval_reward_diff"] >= -2 * ratios["eval_reward_diff_se"]
        )
    return out


def _setting(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "task": args.task,
        "sft_steps": args.sft_steps,
        "preset": args.preset,
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "samples_per_step": args.prompts * args.group,
        "max_new_tokens": args.max_new,
        "micro_batch": args.micro or args.prompts * args.group,
        "steps": args.steps,
        "lr": args.lr,
        "threads": args.threads,
        "gradient_checkpointing": args.gradient_checkpointing,
        "precision": args.precision,
        "dtype": PRECISION_MODES[args.precision]["says"],
        "eval": f"{args.eval_prompts} held-out x {args.eval_samples} samples, T=1"
        if args.eval_prompts > 0
        else "none (training reward only)",
        "command": "python benchmarks/vs_trl.py " + " ".join(sys.argv[1:]),
    }


def _versions() -> dict[str, str]:
    import torch
    import transformers
    import trl

    import grouprl

    return {
        "grouprl": getattr(grouprl, "__version__", "?"),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    which = [args.only] if args.only else ["grouprl", "trl"]
    load0 = loadguard.load_average()
    # pre-flight: both trainers built, their settings read back and compared, nothing timed
    pre = {w: _child(args, w, settings_only=True)["settings"] for w in which}
    table = compare(pre["grouprl"], pre["trl"]) if len(pre) == 2 else None
    out: dict[str, Any] = {
        "benchmark": "vs_trl",
        "setting": _setting(args),
        "versions": _versions(),
        "machine": machine(),
        "settings": table or {w: s for w, s in pre.items()},
        "settings_equal": table is not None and not differing(table),
    }
    if table is not None and differing(table):
        print(json.dumps(out, indent=2))
        raise SettingsDiffer("before training (read from the trainers)", differing(table))
    if args.settings_only:
        print(json.dumps(out, indent=2))
        return 0
    res = {w: _child(args, w, settings_only=False) for w in which}
    load1 = loadguard.load_average()
    out["results"] = {
        w: {k: v for k, v in r.items() if k not in ("train_rewards", "settings", "observed")}
        for w, r in res.items()
    }
    out["train_rewards"] = {w: r["train_rewards"] for w, r in res.items()}
    if len(res) == 2:
        g, t = res["grouprl"], res["trl"]
        observed = compare(g["observed"], t["observed"], observed=True)
        out["observed"] = observed
        out["settings"] = compare(g["settings"], t["settings"])  # read again after training
        out["ratios"] = _ratios(g, t)
        goal = targets(args.model, args.precision)
        out["targets"] = {k: f"{op} {v}x TRL" for k, (op, v) in goal.items()}
        out["targets_met"] = _targets(out["ratios"], goal)
        for key, met in out["targets_met"].items():
            print(f"vs_trl {args.model} {args.precision}: {key} {out['ratios'].get(key, 0):.3f}x "
                  f"(target {out['targets'].get(key, 'not worse')}): "
                  f"{'met' if met else 'NOT MET'}", file=sys.stderr)  # fmt: skip
        rows = differing(out["settings"]) + differing(observed)
        out["settings_equal"] = not rows
        loadguard.write(out, load0, load_after=load1, out=args.out,
                        allow_loaded=args.allow_loaded, indent=2)  # fmt: skip
        if rows:
            raise SettingsDiffer("in the timed runs", rows)
        return 0
    loadguard.write(out, load0, load_after=load1, out=args.out, allow_loaded=args.allow_loaded,
                    indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
