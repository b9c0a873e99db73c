"""The run configuration: one small frozen dataclass per stage, composed into ``RunConfig``.

YAML files and command-line overrides load into the same classes::

    cfg = load_config("configs/maze.yaml", overrides=["optim.lr=1e-4", "sampling.group_size=16"])

Cross-field checks run in ``RunConfig.validate()`` at load time, before any model is loaded:
a batch that does not split into whole groups, LoRA without ``peft``, an unknown preset,
task or model name each raise a ``ConfigError`` (a ``ValueError``) that says what to change.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from grouprl.presets import DEFAULT as DEFAULT_PRESET
from grouprl.presets import Preset, frozen

__all__ = [
    "RECOMPUTE",
    "AlgorithmConfig",
    "ConfigError",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "RunSectionConfig",
    "SamplingConfig",
    "Schedule",
    "TaskConfig",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which field and what to do."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy: a name for ``grouprl.models.load`` (registered name, HF id, folder, GGUF)."""

    name: str = "tiny"
    """``tiny[:d=64,layers=4,...]``, ``smollm2``, a folder, a ``.gguf`` file or an HF id."""
    device: str = "auto"
    """``auto`` (the first GPU torch sees, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``. The
    policy, the reference, rollouts, log-probs and the optimizer state all live there."""
    dtype: str = "float32"
    """The weights' dtype: ``float32``, ``bfloat16`` (``bf16``) or ``float16`` (``fp16``).
    ``bfloat16`` means plain bf16 weights and AdamW state (half the memory, but updates
    smaller than bf16's resolution round away); for bf16 compute with fp32 master weights,
    as TRL's ``bf16=True`` (accelerate autocast) and verl's FSDP mixed precision do, keep
    ``float32`` and set ``autocast: bfloat16``."""
    autocast: str = "none"
    """``none`` or ``bfloat16``: every forward pass (rollouts, training, reference, AGPO's
    passes, evaluation: ``grouprl.train.policy.Policy``) under ``torch.autocast(device,
    bfloat16)`` while weights, gradients and AdamW stay in ``dtype`` (mixed precision with
    master copies, TRL's and verl's convention)."""
    rollout_precision: str = "same"
    """The precision of generation only: ``same`` (``autocast``'s: matched, the rollouts'
    log-probs are the trainer's and the update is on-policy) or ``none`` / ``bfloat16``. A
    different one is a second engine, as vLLM-bf16 sampling for an FSDP-fp32 trainer: the
    trainer then recomputes the behaviour log-probs at its own precision (one forward, verl's
    decoupled mode), logs ``mismatch/*`` every step and applies
    ``algorithm.rollout_correction`` (docs/training.md, "Rollouts at another precision")."""
    attention: str = "sdpa"
    """The attention kernel transformers uses (``sdpa`` = torch's scaled_dot_product_attention,
    or ``eager``); applied when grouprl loads the model (not to an injected model)."""
    warm_start: bool = True
    """Supervised warm start before RL (``grouprl.train.sft.warm_start``), cached; only used
    for models built from scratch (the tiny model), as in F-GRPO §5.2 (SFT then RL)."""
    sft_steps: int = 1400
    """Warm-start steps (batch 64, lr 2e-3: ~3 min on one idle core, docs/models.md)."""
    lora_rank: int = 0
    """0 = full fine-tuning; > 0 wraps the policy in a peft LoRA adapter of that rank."""
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    """LoRA target modules (peft's ``target_modules``); defaults follow the LoRA paper."""

    @property
    def torch_dtype(self) -> Any:
        """``dtype`` as a ``torch.dtype`` (aliases ``bf16``, ``fp16``, ``fp32`` accepted)."""
        import torch

        return getattr(torch, _DTYPES[self.dtype])


_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
"""Accepted ``model.dtype`` spellings -> torch dtype names."""


@dataclass(frozen=True)
class TaskConfig:
    """The verifiable task: a name in ``grouprl.tasks.TASKS`` and its configuration."""

    name: str = "maze"
    params: MappingProxyType = field(default_factory=frozen)


@dataclass(frozen=True)
class SamplingConfig:
    """How the training groups are sampled."""

    prompts_per_step: int = 32
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """Keep only the k most probable tokens before top-p (0 = off; ``grouprl.rollout.hf``)."""
    logprob_support: str = "full"
    """Where every log-prob of the step is read (``grouprl.rollout.hf.SUPPORTS``): ``full``
    (the full softmax; with top-p / top-k the sampled policy is the truncated one, so the
    gradient is not that of the policy sampled) or ``truncated`` (the behaviour, training,
    reference and entropy passes all on the distribution renormalised over the tokens the
    sampler kept, its kept sets recorded at generation and replayed) [OURS; docs/training.md,
    "Truncated sampling"]. With top_p=1 and top_k=0 nothing is truncated and both are the
    full softmax."""
    max_new_tokens: int = 32
    draw: str = "inverse_cdf"
    """How a token is drawn (``grouprl.rollout.hf.DRAWS``): ``inverse_cdf`` (one uniform per
    row) or ``multinomial`` (``torch.multinomial``, as HF and TRL, and grouprl before issue
    26). The same distribution; the draws for one seed differ [OURS default: ~ the lm head's
    cost saved per decode step on a 49k vocabulary]."""
    max_unscorable_frac: float = 0.5
    """Stop the run when more than this fraction of a step's rewards are NaN (unscorable):
    the verifier, not the policy, is broken [OURS]."""
    verify_timeout_s: float = 10.0
    """Per-completion verifier timeout in a forked worker (``tasks.verify.score_batch``);
    0 = verify in-process without a timeout (cheap trusted verifiers such as the maze)."""
    overlong_cache: int = 0
    """DAPO's soft-penalty ramp L_cache in tokens; 0 = max_new_tokens // 5 (DAPO: 4096 of
    20480) [OURS scaling]."""
    pool_size: int = 0
    """Prompts come from a finite pool of this many train examples, drawn once from the seed,
    and the preset's prompt sampler (``grouprl.sampling``) picks each step's P from it. 0 =
    the preset's ``pool_size`` (1024 for ``is_grpo``, ``is_grpo_baseline`` and
    ``is_grpo_exact``, so they draw the same pool; 0 for the others: a fresh stream of prompts
    every step), and ``train.prompts.DEFAULT_POOL`` (1024) for a sampler that needs a pool when
    the preset sets none [OURS]. A dataset task with fewer rows gives a pool of its distinct
    rows."""
    curriculum_low: float = 0.05
    """Curriculum sampler (``algorithm.sampler=curriculum``, ``grouprl.sampling.
    CurriculumSampler``): a prompt whose estimated pass rate falls below this is set aside."""
    curriculum_high: float = 0.95
    """... or rises above this [OURS: the band's edges]."""
    curriculum_revisit: int = 20
    """Steps a set-aside prompt waits before it is drawn again [OURS]."""
    curriculum_decay: float = 0.5
    """Weight of the old pass-rate counts at each visit (1 = never forget) [OURS]."""
    curriculum_prior_strength: float = 2.0
    """Pseudo-visits of the prior (the visited prompts' mean pass rate) an unseen prompt
    starts from [OURS]."""
    max_resample_tries: int = 3
    """Dynamic sampling (DAPO): rounds of extra prompts before training on a short batch;
    DAPO's code uses ``max_num_gen_batches`` (0 = unlimited) [OURS default 3]."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """A preset name plus overrides of any of its fields (``beta``, ``surrogate_params``...),
    and the loss options no preset fixes, each passed to ``losses.objective`` by the trainer."""

    preset: str = DEFAULT_PRESET
    overrides: MappingProxyType = field(default_factory=frozen)
    kl_correction: str | None = None
    """None (the plain KL term), or an importance correction of the loss-side KL term for the
    tokens of an update taken after the first optimizer step on a batch (``losses.
    KL_CORRECTIONS``; ``losses.kl_corrected``): ``ratio`` (ρ·KL, TRL's
    ``use_bias_correction_kl``), ``sequence_ratio`` (TRL's at the sequence level),
    ``straight_through`` (the KL's value with the gradient of min(ρ, 10)·k2, OpenRLHF's
    ``kl.unbiased_gradient``). Needs a KL term in the loss (``algorithm.beta > 0``)."""
    top_entropy_quantile: float = 1.0
    """ρ in (0, 1]: the surrogate acts only on the valid tokens whose entropy is in the top ρ
    share ("Beyond the 80/20 Rule", arXiv 2506.01939, keeps ρ = 0.2; TRL's
    ``top_entropy_quantile``); 1 = every token. The threshold's batch: ``selection``."""
    selection: str = "step"
    """Which batch the token selections span: the top-entropy threshold and Clip-Cov's /
    KL-Cov's covariance selection. ``step`` [OURS, the default]: the optimizer step's
    minibatch, computed once before its first backward (one extra no-grad forward of each
    micro-batch when the step has several), so the update does not depend on
    ``optim.micro_batch_size``; ``micro_batch``: each micro-batch on its own, as TRL (the
    entropy quantile) and verl (the covariance selection) take them per micro-batch."""

    def resolve(self) -> Any:
        """The ``grouprl.presets.Preset`` with the overrides applied.

        An override that is not a preset field but a setting of the preset's estimator or
        surrogate (their registered declarations: ``algorithm.clip=3`` for a surrogate that
        takes ``clip``) goes into ``estimator_params`` / ``surrogate_params``."""
        from grouprl import presets

        base = presets.get(self.preset)
        changes = dict(self.overrides)
        settings = method_settings(base.with_(**{k: v for k, v in changes.items()
                                                 if k in _PRESET_FIELDS}))  # fmt: skip
        for key in [k for k in changes if k not in _PRESET_FIELDS and k in settings]:
            where = settings[key]
            changes[where] = {
                **dict(changes.get(where, getattr(base, where))),
                key: changes.pop(key),
            }
        return base.with_(**changes)


_PRESET_FIELDS = frozenset(
    f.name for f in fields(Preset) if f.name not in ("name", "description", "sources")
)
"""The preset fields ``algorithm.<field>`` sets."""


def method_settings(preset: Any) -> dict[str, str]:
    """Setting name -> ``"estimator_params"`` or ``"surrogate_params"``: the settings of the
    preset's estimator and surrogate (their registrations) that ``algorithm.<setting>`` sets;
    a name both take is left out (set it in the params mapping)."""
    from grouprl import advantages, losses

    axis = advantages.estimator_axis if preset.estimator in advantages.ESTIMATORS else (
        advantages.token_estimator_axis
    )  # fmt: skip
    out: dict[str, str] = {}
    both: set[str] = set()
    for where, decl in (("estimator_params", axis.get(preset.estimator)),
                        ("surrogate_params", losses.surrogate_axis.get(preset.surrogate))):  # fmt: skip
        for name in decl.setting_names():
            if name in out:
                both.add(name)
            out[name] = where
    return {k: v for k, v in out.items() if k not in both}


@dataclass(frozen=True)
class OptimConfig:
    """Optimisation: AdamW, PPO epochs and minibatches, exact gradient accumulation."""

    steps: int = 300
    """RL steps (the maze miniature takes 100, :data:`MAZE_MINIATURE`)."""
    lr: float = 5e-5
    """AdamW learning rate. [OURS] measured on the former maze default (5×5, 300 GRPO steps,
    32 x 8): 5e-5 raised pass@1 0.118 -> 0.191 with pass@8/16 held (0.326/0.380 ->
    0.334/0.385); 2e-4 (the rate of the standalone scripts, docs/models.md [prototype]) made pass@1 oscillate
    (0.10-0.16) and pass@16 fall to 0.28; 1e-4 was in between. Kept for the 4×4 miniature
    (docs/training.md, "The default run")."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global-norm clip (verl and TRL default 1.0); <= 0 disables clipping."""
    fused: bool = True
    """AdamW's fused implementation (``torch.optim.AdamW(fused=True)``), the same update as the
    for-loop one up to rounding. transformers' Trainer (and so TRL) defaults to it
    (``optim="adamw_torch_fused"``). [OURS, measured] one AdamW step over SmolLM2-135M's
    parameters on one CPU thread: 0.58 s for-loop, 0.50 s foreach, 0.077 s fused. Used where
    torch supports it (every parameter a floating-point tensor on the CPU or a CUDA device),
    else the default implementation."""
    activation_checkpointing: bool = False
    """Keep each decoder layer's input instead of its activations in the training forward and
    run the layer again in the backward (``grouprl.train.checkpointing``): the same gradients,
    a smaller peak, a second forward's CPU time: on SmolLM2 at the ``pretrained`` profile's
    settings 13 % less peak RSS for 12 % more CPU a step, which is why it stays off
    (docs/results.md, "Peak memory, where it goes")."""
    recompute: tuple[str, ...] = ()
    """What the training forward runs again in the backward instead of keeping it, the same
    gradients bit for bit (:data:`RECOMPUTE`): ``head``, the log-prob head's ``[tokens, V]``
    probabilities (one head matmul more; without it they are kept up to 1 GiB); ``mlp``, the
    gated MLPs' gate and up outputs (two of the MLP's three matmuls more; Llama-form MLPs
    outside autocast, where ``grouprl.train.lean`` runs the MLP). [OURS, measured] the
    ``pretrained`` profile recomputes ``[mlp]``: beside its 128 KiB ``run.mmap_threshold_kib``
    it is what brings the SmolLM2 comparison's peak under half of TRL's, and adding ``head``
    lowered the peak no further (docs/results.md, "Peak memory, where it goes")."""
    ppo_epochs: int | None = None
    """Passes over each generation batch; None = the preset's (``Preset.ppo_epochs``: AGPO's
    code runs 4, the others 1). See :meth:`RunConfig.schedule`."""
    minibatches: int | None = None
    """Optimizer steps per epoch, each on whole groups; None = the preset's
    (``Preset.minibatches``: DAPO and CISPO 16, GSPO and the F-* presets 4, the others 1). One minibatch and one
    epoch is fully on-policy: every step sees ratio 1 and no clip acts. A value set here
    must divide ``sampling.prompts_per_step``."""
    micro_batch_size: int = 0
    """Sequences per forward/backward (a multiple of the group size); 0 or more than the
    minibatch = the whole minibatch at once. The last micro-batch may be smaller: the step's
    StepTotals keep accumulation exact whatever the split."""
    logprob_chunk: int = 2048
    """Tokens per chunk of the vocabulary projection in ``logprobs`` (bounds [chunk, V])."""
    max_nonfinite_steps: int = 3
    """Stop after this many consecutive optimizer steps with a non-finite loss or gradient."""
    entropy: bool = True
    """Log the policy's token entropy (computed without gradient from the same chunks)."""


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: ``samples`` completions on each of ``prompts`` test examples."""

    every: int = 50
    """Evaluate every this many steps (and before the first and after the last); 0 = never."""
    prompts: int = 200
    samples: int = 16
    ks: tuple[int, ...] = (1, 8, 16)
    temperature: float = 1.0
    balance_every: int = 10
    """R/KL balance (ALGORITHMS.md §5) every this many steps when β > 0; 0 = never. Measured
    on the step's own forward (``train.update.BalanceProbe``): two extra ``autograd.grad``
    passes on the first micro-batch, two on each micro-batch holding low-σ rows."""


@dataclass(frozen=True)
class RunSectionConfig:
    """The ``run`` section: run folder, seed, checkpoints and sinks (``RunConfig`` is the
    whole configuration, every section together)."""

    out: str = "runs/default"
    seed: int = 0
    resume: bool = False
    """Continue from the latest good checkpoint in ``out`` (``grouprl.train.resume``)."""
    resume_anyway: bool = False
    """With ``resume``: continue even when the configuration changes the experiment; the
    changed fields are recorded in metrics.jsonl and the report (``grouprl.train.resume``)."""
    overwrite: bool = False
    """A new run (no ``resume``) in a folder that already holds a run deletes that run's
    outputs first instead of refusing (``grouprl.train.resume.fresh_start``)."""
    every: int = 50
    """Checkpoint every this many steps (and at the end and on SIGINT/SIGTERM); 0 = only those."""
    keep_last: int = 2
    progress: bool = True
    """A progress bar on a terminal; plain lines (every tenth of the run or 30 s) when stdout
    is not one, or with ``progress: false`` (``--no-progress``)."""
    tensorboard: bool | None = None
    """TensorBoard events in ``<out>/tb/``: None = when tensorboard is installed; true = asked
    for (a config error before the run when it is not installed); false = never."""
    wandb: bool = False
    """W&B offline logging in ``<out>/wandb/``; true without wandb installed is a config error
    before the run, naming the install command."""
    report: bool = True
    """Write ``report.html`` from the run folder's files after a finished run: done by the
    entry points, ``grouprl train`` and ``grouprl.train.run`` (``train.api.write_report``);
    ``loop.train`` itself writes no report (call ``write_report(cfg, result)``, or
    ``grouprl.report.write_run_report(run_dir)`` at any time)."""
    threads: int = 0
    """torch threads; 0 = auto (``grouprl._threads.choose_threads``): one per physical core
    this process may run on, or ``OMP_NUM_THREADS`` when set; a positive number is taken as it
    is. Never the machine's load: the count decides how torch splits its float reductions, so
    the same command and seed give the same numbers on the same machine at any load [OURS];
    ``benchmarks/train_step.py`` measures a given count."""
    mmap_threshold_kib: int = 0
    """glibc: blocks of at least this many KiB are mapped on their own and given back to the
    OS when freed (``grouprl.train.malloc``), so the resident memory follows the live tensors
    instead of the heap's high-water mark; 0 = glibc's growing default (nothing set). Every
    freed block of that size is then a munmap and its next use page faults, which costs a
    model of many small tensors far more time than it saves memory, so 0 is the default and
    the ``pretrained`` profile sets 128 (``grouprl train`` puts such blocks on huge pages,
    ``grouprl.cli.PROCESS_ENV``, which takes back part of the faulting) [OURS, measured:
    docs/results.md, "Peak memory, where it goes"]."""
    save_final: bool = True
    """Write the policy and tokenizer with ``save_pretrained`` to ``<out>/final/`` at the end
    of a finished run (``grouprl.train.export``), loadable by transformers, TRL and vLLM."""
    merge_lora: bool = False
    """LoRA runs: also write the adapter merged into the base weights to ``<out>/final_merged/``."""
    plugins: tuple[str, ...] = ()
    """Plugins loaded before any name is read (``grouprl.plugins``): ``.py`` files or module
    names that register methods and presets (``grouprl train --plugin``; docs/extending.md)."""


@dataclass(frozen=True)
class Schedule:
    """The update schedule a run applies: ``minibatches × ppo_epochs`` optimizer steps per
    generation batch, where each value came from (``"optim"`` or ``"preset"``), and a note
    when the preset's minibatch count had to be lowered to fit ``prompts_per_step``."""

    minibatches: int
    ppo_epochs: int
    source: MappingProxyType
    note: str | None = None

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per generation batch."""
        return self.minibatches * self.ppo_epochs


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclass(frozen=True)
class RunConfig:
    """Every stage's configuration; ``validate()`` checks the cross-field constraints."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunSectionConfig = field(default_factory=RunSectionConfig)

    @property
    def batch_size(self) -> int:
        """Sequences per step: ``prompts_per_step * group_size``."""
        return self.sampling.prompts_per_step * self.sampling.group_size

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-safe): tuples become lists, mappings dicts."""
        return {
            f.name: {
                g.name: _plain(getattr(getattr(self, f.name), g.name))
                for g in fields(getattr(self, f.name))
            }
            for f in fields(self)
        }

    def schedule(self, preset: Any = None) -> Schedule:
        """The update schedule: ``optim.minibatches`` / ``optim.ppo_epochs`` when set, else
        the preset's (its sources' schedule, ALGORITHMS.md §3 "Update schedule").

        ``preset``: the resolved ``Preset`` (default: ``algorithm.resolve()``). [OURS] A
        preset's minibatch count that does not divide ``sampling.prompts_per_step`` (DAPO's
        16 at 8 prompts) becomes the largest divisor of ``prompts_per_step`` below it, and
        ``note`` says so; a count set in ``optim.minibatches`` must divide it (validate()).
        """
        p = preset if preset is not None else self.algorithm.resolve()
        o, n_prompts = self.optim, self.sampling.prompts_per_step
        epochs = o.ppo_epochs if o.ppo_epochs is not None else p.ppo_epochs
        note = None
        if o.minibatches is not None:
            minibatches = o.minibatches
        else:
            minibatches = _largest_divisor(n_prompts, p.minibatches)
            if minibatches != p.minibatches:
                note = (
                    f"preset {p.name!r} takes {p.minibatches} minibatches per generation batch "
                    f"({p.sources.get('minibatches', 'its sources')}); sampling.prompts_per_step="
                    f"{n_prompts} splits into whole groups only by its divisors, so the run takes "
                    f"{minibatches}. Set optim.minibatches to choose, or prompts_per_step to a "
                    f"multiple of {p.minibatches}."
                )
        source = {
            "minibatches": "optim" if o.minibatches is not None else "preset",
            "ppo_epochs": "optim" if o.ppo_epochs is not None else "preset",
        }
        return Schedule(minibatches, epochs, frozen(source), note)

    def validate(self, *, check_names: bool = True) -> RunConfig:
        """Raise ``ConfigError`` on a configuration that cannot work; returns ``self``.

        The plugins of ``run.plugins`` (and the installed ones) are loaded first, so their
        methods and presets are checked as the built-ins are."""
        load_plugins(self)
        _check_ranges(self)
        _check_algorithm(self)
        _check_batch(self)
        if self.model.lora_rank > 0 and importlib.util.find_spec("peft") is None:
            raise ConfigError(
                "model.lora_rank > 0 needs peft, which is not installed: "
                "pip install 'grouprl[lora]' or set model.lora_rank=0"
            )
        if self.run.merge_lora and self.model.lora_rank <= 0:
            raise ConfigError(
                "run.merge_lora=true needs a LoRA run (model.lora_rank > 0); a full fine-tune's "
                "<out>/final/ already holds the whole model"
            )
        if check_names:
            _check_names(self)
        return self


def load_plugins(cfg: RunConfig) -> None:
    """Load ``cfg.run.plugins`` and the installed plugins (``grouprl.plugins``)."""
    from grouprl import plugins

    try:
        plugins.load_all(cfg.run.plugins)
    except plugins.PluginError as err:
        raise ConfigError(f"run.plugins: {err}") from None


def _plain(x: Any) -> Any:
    if isinstance(x, (dict, MappingProxyType)):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _check_ranges(cfg: RunConfig) -> None:
    s, o, e = cfg.sampling, cfg.optim, cfg.eval
    positive = {
        "sampling.prompts_per_step": s.prompts_per_step,
        "sampling.max_new_tokens": s.max_new_tokens,
        "optim.steps": o.steps,
        "optim.ppo_epochs": o.ppo_epochs,
        "optim.minibatches": o.minibatches,
        "optim.logprob_chunk": o.logprob_chunk,
        "optim.max_nonfinite_steps": o.max_nonfinite_steps,
        "run.keep_last": cfg.run.keep_last,
    }
    for name, value in positive.items():
        if value is not None and value < 1:
            unset = " (or null: the preset's)" if name in _SCHEDULE_FIELDS else ""
            raise ConfigError(f"{name} must be >= 1{unset}, got {value}")
    if s.group_size < 2:
        raise ConfigError(
            f"sampling.group_size must be >= 2 (group-relative baselines need two samples), "
            f"got {s.group_size}"
        )
    if not (s.temperature > 0 and e.temperature > 0):
        raise ConfigError("sampling.temperature and eval.temperature must be > 0")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    from grouprl.rollout.hf import DRAWS, SUPPORTS  # the sampler's own lists

    if s.draw not in DRAWS:
        raise ConfigError(f"sampling.draw must be one of {', '.join(DRAWS)}, got {s.draw!r}")
    if isinstance(s.top_k, bool) or not isinstance(s.top_k, int) or s.top_k < 0:
        raise ConfigError(f"sampling.top_k must be an integer >= 0 (0 = off), got {s.top_k!r}")
    if s.logprob_support not in SUPPORTS:
        raise ConfigError(
            f"sampling.logprob_support must be one of {', '.join(SUPPORTS)}, got "
            f"{s.logprob_support!r}"
        )
    if s.pool_size < 0 or 0 < s.pool_size < s.prompts_per_step:
        raise ConfigError(
            f"sampling.pool_size must be 0 (automatic) or at least sampling.prompts_per_step="
            f"{s.prompts_per_step}, got {s.pool_size}"
        )
    if not 0 <= s.max_unscorable_frac <= 1:
        raise ConfigError("sampling.max_unscorable_frac must be in [0, 1]")
    if o.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {o.lr}")
    _check_recompute(o.recompute)
    if cfg.run.threads < 0:
        raise ConfigError(f"run.threads must be >= 0 (0 = auto), got {cfg.run.threads}")
    if not 0 <= cfg.run.mmap_threshold_kib <= 32 * 1024:
        raise ConfigError(
            "run.mmap_threshold_kib must be in [0, 32768] (0 = glibc's default; glibc takes at "
            f"most 32 MiB), got {cfg.run.mmap_threshold_kib}"
        )
    _check_loggers(cfg.run)
    _check_model_runtime(cfg.model)
    if e.every and (e.samples < max(e.ks) or e.prompts < 1):
        raise ConfigError(
            f"eval.samples ({e.samples}) must be >= max(eval.ks) ({max(e.ks)}): pass@k needs "
            "n >= k samples per prompt; raise eval.samples or drop the large k"
        )


def _check_recompute(parts: tuple[str, ...]) -> None:
    unknown = [r for r in parts if r not in RECOMPUTE]
    if unknown:
        raise ConfigError(
            f"optim.recompute: unknown part(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(RECOMPUTE)} (e.g. optim.recompute=[head,mlp]), or [] for none"
        )


RECOMPUTE: dict[str, str] = {
    "head": "the log-prob head's [tokens, V] probabilities (one head matmul more)",
    "mlp": "the gated MLPs' gate and up outputs (two of the MLP's three matmuls more)",
}
"""``optim.recompute`` part -> what the backward runs again instead of keeping."""


LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install tensorboard  (or: pip install 'grouprl[logging]')"),
    "wandb": ("wandb", "pip install wandb"),
}
"""``run.<field>`` -> (the module it needs, the command that installs it)."""


def _check_loggers(run: RunSectionConfig) -> None:
    """A logger asked for (true) but not installed is an error before the run [OURS: issue
    25, ``run.wandb=true`` without wandb ran to the end without a word]."""
    for name, (module, command) in LOGGERS.items():
        if getattr(run, name) is True and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"run.{name}=true but {module} is not installed: {command}, or set run.{name}=false"
            )


SELECTIONS = ("step", "micro_batch")
"""Valid ``algorithm.selection`` values."""


def _check_algorithm(cfg: RunConfig) -> None:
    """The loss options of the algorithm section: known values, and a setting that acts."""
    from grouprl.losses import KL_CORRECTIONS

    a = cfg.algorithm
    if a.kl_correction is not None and a.kl_correction not in KL_CORRECTIONS:
        raise ConfigError(
            f"algorithm.kl_correction={a.kl_correction!r} is not a KL correction; valid: "
            f"{', '.join(KL_CORRECTIONS)}, or null for the plain KL term"
        )
    q = a.top_entropy_quantile
    if not 0 < q <= 1:
        raise ConfigError(
            f"algorithm.top_entropy_quantile must be in (0, 1] (the share of valid tokens, by "
            f"entropy, the surrogate acts on; 1 = all, 0.2 in the 80/20 paper), got {q}"
        )
    if a.selection not in SELECTIONS:
        raise ConfigError(
            f"algorithm.selection must be one of {', '.join(SELECTIONS)}, got {a.selection!r}"
        )
    preset = _resolved_preset(cfg)
    if a.kl_correction is not None and preset is not None and not preset.beta > 0:
        raise ConfigError(
            f"algorithm.kl_correction={a.kl_correction!r} corrects the loss's KL term, which "
            f"preset {preset.name!r} does not have (beta = {preset.beta}); set algorithm.beta "
            "> 0, or leave kl_correction null"
        )


def _check_model_runtime(m: ModelConfig) -> None:
    """dtype, autocast, attention and device spellings (availability is checked at set-up)."""
    if m.dtype not in _DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(_DTYPES)}, got {m.dtype!r}")
    from grouprl.train.policy import PRECISIONS  # the policy's own list of precisions

    if m.autocast not in PRECISIONS:
        raise ConfigError(
            f"model.autocast must be one of {', '.join(PRECISIONS)}, got {m.autocast!r}"
        )
    if m.rollout_precision not in ("same", *PRECISIONS):
        raise ConfigError(
            f"model.rollout_precision must be one of same, {', '.join(PRECISIONS)}, got "
            f"{m.rollout_precision!r}"
        )
    if m.attention not in ("sdpa", "eager"):
        raise ConfigError(f"model.attention must be sdpa or eager, got {m.attention!r}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", m.device):
        raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {m.device!r}")


_SCHEDULE_FIELDS = ("optim.ppo_epochs", "optim.minibatches")


def _resolved_preset(cfg: RunConfig) -> Any:
    """The preset with its overrides, or None when it cannot be resolved (``_check_names`` or
    ``setup`` reports an unknown preset or override)."""
    try:
        return cfg.algorithm.resolve()
    except (ValueError, TypeError):
        return None


def _check_batch(cfg: RunConfig) -> None:
    """Minibatches hold whole groups and micro-batches split minibatches exactly; the preset's
    controller fits its filters."""
    from grouprl.control import PER_PROMPT

    preset = _resolved_preset(cfg)
    if preset is not None and preset.controller in PER_PROMPT and preset.dynamic_sampling:
        raise ConfigError(
            f"the {preset.controller} controller sets each prompt's temperature and ε from its "
            "probe group, while dynamic sampling replaces collapsed groups with prompts drawn "
            "later: set algorithm.dynamic_sampling=false (the AGPO code has no dynamic sampling)"
        )
    m = cfg.optim.minibatches or (cfg.schedule(preset).minibatches if preset else 1)
    n, g = cfg.batch_size, cfg.sampling.group_size
    if cfg.sampling.prompts_per_step % m:
        raise ConfigError(
            f"optim.minibatches={m} does not divide sampling.prompts_per_step="
            f"{cfg.sampling.prompts_per_step}: each minibatch must hold whole groups of "
            f"{g}; pick minibatches among the divisors of prompts_per_step"
        )
    micro = cfg.optim.micro_batch_size
    if micro < 0 or micro % g:
        raise ConfigError(
            f"optim.micro_batch_size={micro} is not a multiple of the group size "
            f"sampling.group_size={g}: a micro-batch holds whole groups; use a multiple of {g} "
            f"(e.g. {g * max(1, micro // g)}) or 0 for the whole minibatch of {n // m} sequences"
        )


def _check_names(cfg: RunConfig) -> None:
    from grouprl import presets

    if cfg.algorithm.preset not in presets.PRESETS:
        raise ConfigError(
            f"unknown preset {cfg.algorithm.preset!r}; valid presets: {', '.join(presets.names())}"
        )
    fields_ = {f.name for f in fields(presets.Preset)} - {"name", "description", "sources"}
    try:
        base = presets.get(cfg.algorithm.preset).with_(
            **{k: v for k, v in cfg.algorithm.overrides.items() if k in fields_}
        )
        settings = method_settings(base)
    except (TypeError, ValueError):
        settings = {}
    unknown = sorted(set(cfg.algorithm.overrides) - fields_ - set(settings))
    if unknown:
        raise ConfigError(
            f"unknown algorithm override(s) {unknown}; valid: the preset fields "
            f"{', '.join(sorted(fields_))}, and the settings of its estimator and surrogate "
            f"{', '.join(sorted(settings)) or '(none)'}"
        )
    try:
        resolved = cfg.algorithm.resolve()
        _check_switched_method(cfg.algorithm.preset, cfg.algorithm.overrides, resolved)
        resolved = presets.check(resolved)  # the names its methods hold
    except (TypeError, ValueError) as err:
        raise ConfigError(f"algorithm overrides: {err}") from None
    from grouprl import sampling

    sampler = resolved.sampler
    if sampler not in sampling.SAMPLERS:
        raise ConfigError(
            f"unknown prompt sampler algorithm.sampler={sampler!r}; valid: "
            f"{', '.join(sampling.names())}"
        )
    if sampler == "curriculum" and resolved.sampler_weight:
        raise ConfigError(
            "algorithm.sampler=curriculum gives no importance weight (its draws are not i.i.d.): "
            "set algorithm.sampler_weight=false, or use the sigma sampler"
        )
    from grouprl import tasks

    if cfg.task.name not in tasks.TASKS:
        from grouprl.tasks.reasoning_gym import dataset_names

        if cfg.task.name not in dataset_names():
            raise ConfigError(
                f"unknown task {cfg.task.name!r}; valid tasks: {', '.join(tasks.TASKS)}, or a "
                "reasoning-gym dataset name (e.g. basic_arithmetic; `grouprl list` shows them)"
            )
    _check_model_name(cfg.model.name)


def _check_switched_method(preset: str, overrides: Mapping[str, Any], resolved: Any) -> None:
    """A ValueError naming the fix when an override switches the estimator or the surrogate
    and the preset's parameters for the old one are not settings of the new one (``grpo``'s
    ``eps_low`` / ``eps_high`` under ``algorithm.surrogate=topr``): they are the preset's, so
    the override must say which parameters the new method takes."""
    from grouprl import advantages, losses

    for method, key, tables in (
        ("surrogate", "surrogate_params", (losses.surrogate_axis,)),
        ("estimator", "estimator_params", (advantages.estimator_axis,
                                           advantages.token_estimator_axis)),
    ):  # fmt: skip
        name = getattr(resolved, method)
        if method not in overrides or key in overrides:
            continue
        axis = next((a for a in tables if name in a.table), None)
        if axis is None:  # an unknown name: presets.check says so
            continue
        decl = axis.get(name)
        valid = decl.setting_names()
        stale = sorted(set(getattr(resolved, key)) - set(valid))
        if not stale:
            continue
        defaults = ", ".join(f"{s.name}: {s.default!r}" for s in decl.settings) or "none"
        raise ValueError(
            f"algorithm.{method}={name} replaces the {method} of preset {preset!r}, whose {key} "
            f"{stale} are not settings of {decl.axis} {name!r} (its settings and defaults: "
            f"{defaults}). Set them with the override: --set 'algorithm.{key}={{}}' for "
            f"{name}'s defaults, or --set 'algorithm.{key}={{{valid[0] if valid else 'x'}: "
            f"...}}'"
        )


def _check_model_name(name: str) -> None:
    """A registered name, a local path, a GGUF file or an ``org/name`` HF id."""
    from grouprl import models

    registry = getattr(models, "MODELS", {})
    base = name.split(":", 1)[0]
    if base in registry or Path(name).expanduser().exists() or "/" in name:
        try:
            models.check_spec(name)  # a missing local path, a bad tiny option
        except models.ModelError as err:
            raise ConfigError(str(err)) from None
        return
    raise ConfigError(
        f"unknown model {name!r}; give one of: {', '.join(registry)}, a local folder or "
        "GGUF file, or a Hugging Face id (org/name; needs the hub or a local cache)"
    )


# ---- loading ------------------------------------------------------------------------------

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "sampling": SamplingConfig,
    "algorithm": AlgorithmConfig,
    "optim": OptimConfig,
    "eval": EvalConfig,
    "run": RunSectionConfig,
}
"""Section name in YAML / ``--set`` -> its dataclass."""

_MAPPINGS = {"params", "overrides"}


_EXP_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _numbers(x: Any) -> Any:
    """YAML 1.1 reads ``1e-4`` as a string; turn such strings into floats, recursively."""
    if isinstance(x, str) and _EXP_FLOAT.match(x.strip()):
        return float(x)
    if isinstance(x, dict):
        return {k: _numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_numbers(v) for v in x]
    return x


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A section's field name -> its annotation as a type (``typing.get_type_hints``)."""
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in args)
    if typing.get_origin(tp) is tuple:
        if args and Ellipsis not in args and len(set(args)) == 1:
            name = _type_name(args[0])
            return (
                f"a list of {len(args)} {name}s"
                if name.isidentifier()
                else f"a list of {len(args)} ({name})"
            )
        return f"a list of {_type_name(args[0])}" if args else "a list"
    return getattr(tp, "__name__", str(tp))


def _check_type(tp: Any, value: Any) -> bool:
    """Whether ``value`` (as YAML gives it) is of type ``tp``: an int is a float, a bool is
    neither an int nor a float, a list is a tuple; a type this does not know passes."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return any(_check_type(a, value) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp in (bool, str):
        return isinstance(value, tp)
    if origin is tuple:
        fixed = args and Ellipsis not in args  # a fixed-length tuple: (0.9, 0.999), not [0.9]
        if fixed and isinstance(value, (list, tuple)) and len(value) != len(args):
            return False
        items = [a for a in args if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and all(
            _check_type(items[min(i, len(items) - 1)], v) for i, v in enumerate(value)
        )
    return True


def _coerce(cls: type, f: Any, value: Any, section: str) -> Any:
    """Check a value against the field's type (:func:`_field_types`, the annotation as a
    type, not its text); ints become floats where the field is a float, lists tuples."""
    tp = _field_types(cls)[f.name]
    if not _check_type(tp, value):
        hint = ""
        variadic = any(Ellipsis in typing.get_args(k) for k in (tp, *typing.get_args(tp)))
        if variadic and not isinstance(value, (list, tuple, dict)) and _check_type(tp, [value]):
            shown = str(value).lower() if isinstance(value, bool) else value
            hint = f"; a single item is a list of one: {section}.{f.name}=[{shown}]"
        raise ConfigError(f"{section}.{f.name} must be {_type_name(tp)}, got {value!r}{hint}")
    if value is None:
        return None
    union = typing.get_origin(tp) in (types.UnionType, typing.Union)
    kinds = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    if float in kinds and int not in kinds:
        return float(value)
    for kind in kinds:
        if typing.get_origin(kind) is tuple:
            items = [a for a in typing.get_args(kind) if a is not Ellipsis]
            return tuple(float(v) if items and items[0] is float else v for v in value)
    return value


def _build(cls: type, values: dict[str, Any], section: str) -> Any:
    """One section's dataclass from a dict; unknown keys raise, listing the valid ones."""
    names = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    shorthand: dict[str, Any] = {}
    for key, value in values.items():
        if cls is AlgorithmConfig and key not in names:
            # ``algorithm.beta: 0.04`` is shorthand for ``algorithm.overrides.beta``.
            shorthand[key] = value
            continue
        if key not in names:
            raise ConfigError(f"unknown field {section}.{key}; valid fields: {', '.join(names)}")
        kwargs[key] = (
            frozen(value) if key in _MAPPINGS else _coerce(cls, names[key], value, section)
        )
    if shorthand:
        kwargs["overrides"] = frozen({**kwargs.get("overrides", {}), **shorthand})
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> RunConfig:
    """A ``RunConfig`` from a nested dict (the YAML layout); missing sections take defaults."""
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; valid sections: {', '.join(_SECTIONS)}")
    return RunConfig(
        **{name: _build(cls, data.get(name) or {}, name) for name, cls in _SECTIONS.items()}
    )


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) < 2 or parts[0] not in _SECTIONS:
        raise ConfigError(
            f"override {dotted!r} must be SECTION.FIELD[.KEY]=VALUE with SECTION one of "
            f"{', '.join(_SECTIONS)}"
        )
    node = data.setdefault(parts[0], {})
    for part in parts[1:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` strings (values parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set(data, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return data


PROFILE_DIR = Path(__file__).resolve().parents[1] / "configs"
"""Where the profiles live: ``grouprl/configs/`` (package data, installed with grouprl)."""

PROFILE_FILES: dict[str, Path] = {
    "tiny": PROFILE_DIR / "model_tiny.yaml",
    "pretrained": PROFILE_DIR / "model_pretrained.yaml",
}
"""Model profile -> its YAML file: ``tiny`` for models built from scratch, ``pretrained`` for
everything else (:func:`profile_for`)."""

TASK_PROFILE_FILES: dict[tuple[str, str], Path] = {
    ("tiny", "maze"): PROFILE_DIR / "task_tiny_maze.yaml",
}
"""(model profile, task) -> its YAML file: defaults applied over the model profile and under
the YAML file and the overrides, only when they give no ``task.params``."""


def _read_profile(path: Path) -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a profile is a mapping of sections, got {type(data).__name__}")
    return _numbers(data)


PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    name: _read_profile(path) for name, path in PROFILE_FILES.items()
}
"""Model profile -> its values, read from :data:`PROFILE_FILES`."""

TASK_PROFILES: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    key: _read_profile(path) for key, path in TASK_PROFILE_FILES.items()
}
"""(model profile, task) -> its values, read from :data:`TASK_PROFILE_FILES`."""

MAZE_MINIATURE: dict[str, dict[str, Any]] = TASK_PROFILES[("tiny", "maze")]
"""What ``grouprl train`` runs with no arguments (``grouprl/configs/task_tiny_maze.yaml``, which
says why)."""


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def profile_for(model_name: str) -> str:
    """``tiny`` for ``tiny[:...]`` specs, else ``pretrained``."""
    return "tiny" if model_name.split(":", 1)[0] == "tiny" else "pretrained"


def _layers(
    path: str | Path | None,
    overrides: list[str] | None,
    *,
    profile: str | None,
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """:func:`config_layers`, and the file's values with the overrides set into them."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: expected a mapping of sections, got {type(loaded).__name__}"
            )
        data = _numbers(_plain(loaded or {}))
    given = _numbers(apply_overrides({}, list(overrides or [])))
    top = _numbers(apply_overrides(copy.deepcopy(data), list(overrides or [])))
    layers: list[tuple[str, dict[str, Any]]] = []
    if profile is not None:
        if profile == "auto":
            profile = profile_for(str((top.get("model") or {}).get("name", ModelConfig.name)))
        if profile not in PROFILES:
            raise ConfigError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
        layers.append((f"model profile {profile} ({_shown(PROFILE_FILES[profile])})",
                       PROFILES[profile]))  # fmt: skip
        task = str((top.get("task") or {}).get("name", TaskConfig.name))
        key = (profile, task)
        if key in TASK_PROFILES and "params" not in (top.get("task") or {}):
            layers.append((f"task profile {profile}+{task} ({_shown(TASK_PROFILE_FILES[key])})",
                           TASK_PROFILES[key]))  # fmt: skip
    if data:
        layers.append((f"config file {path}", data))
    if given:
        layers.append(("command line", given))
    return layers, top


def config_layers(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    profile: str | None = "auto",
) -> list[tuple[str, dict[str, Any]]]:
    """The layers a run's configuration is made of, lowest first, each ``(where, values)``:
    the model profile, the task profile, the YAML file, the command line (flags and ``--set``,
    which set keys into the file's values: ``--set task.params={...}`` replaces the file's
    mapping). The dataclass defaults lie under all of them (:func:`describe_config`).

    ``profile="auto"`` picks :data:`PROFILE_FILES` by the final model name, and
    :data:`TASK_PROFILE_FILES` by (profile, task) when the task's params are not given; None
    applies neither.
    """
    return _layers(path, overrides, profile=profile)[0]


def _shown(path: Path) -> str:
    """A profile's path as a reader finds it: ``grouprl/configs/NAME.yaml``."""
    return f"grouprl/configs/{path.name}"


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    validate: bool = True,
    profile: str | None = "auto",
) -> RunConfig:
    """Defaults <- model profile (+ task profile) <- YAML file <- ``section.field=value``
    overrides (:func:`config_layers`), validated."""
    layers, top = _layers(path, overrides, profile=profile)
    data: dict[str, Any] = {}
    for where, values in layers:
        if not where.startswith(("config file", "command line")):
            data = _merge(data, values)  # the profiles
    cfg = from_dict(_merge(data, top))
    return cfg.validate() if validate else cfg


def _leaves(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_leaves(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def config_sources(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    profile: str | None = "auto",
) -> dict[str, str]:
    """``section.field[.key]`` -> the layer that set it (:func:`config_layers`); a key that no
    layer sets keeps its dataclass default."""
    out: dict[str, str] = {}
    for where, values in config_layers(path, overrides, profile=profile):
        for dotted in _leaves(values):
            stale = [k for k in out if k.startswith(dotted + ".") or dotted.startswith(k + ".")]
            for k in stale:  # a mapping replaced as a whole, or set key by key
                del out[k]
            out[dotted] = where
    return out


def describe_config(cfg: RunConfig, sources: dict[str, str]) -> str:
    """The resolved configuration, one ``section.field: value  # where`` line per field, and
    the update schedule it resolves to (``grouprl train --print-config``)."""
    lines = []
    for dotted, value in _leaves(cfg.to_dict()).items():
        section, name = dotted.split(".")[0], dotted.split(".")[1]
        where = sources.get(dotted)
        if where is None:
            inside = [w for k, w in sources.items() if k.startswith(dotted + ".")]
            where = inside[-1] if inside else None
        if where is None:
            cls = _SECTIONS[section].__name__
            where = f"default ({cls}.{name})"
        shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
        lines.append(f"{dotted}: {shown.strip()}  # {where}")
    schedule = cfg.schedule()
    lines.append(
        f"# update schedule: {schedule.minibatches} minibatch(es) x {schedule.ppo_epochs} "
        f"epoch(s) per generation batch (minibatches from the {schedule.source['minibatches']}, "
        f"epochs from the {schedule.source['ppo_epochs']})"
    )
    if schedule.note:
        lines.append(f"# {schedule.note}")
    return "\n".join(lines)
