"""Resume continues the same experiment: what ``--resume`` compares, refuses and records.

A checkpoint's manifest records the run's configuration and the grouprl version that
wrote it (``checkpoint.save(config=...)``). On ``--resume``, :func:`check` compares it
with the configuration given now, field by field:

- a field of :data:`EXPERIMENT_FIELDS` that differs stops the run with a
  :class:`ResumeError` that lists each such field with both values, unless
  ``run.resume_anyway`` (``--resume-anyway``): then the run continues, says so, and the
  first metrics row after the resume carries the change under ``resume/changed``, which
  report.html shows in its own section;
- a field of :data:`BOOKKEEPING_FIELDS` may change (printed, not refused).

Every ``RunConfig`` field is in exactly one of the two tuples (tests/train/test_resume.py
fails on a field in neither, so a new field must be classified here), and the test runs
the trainer with the bookkeeping fields changed to check that the training numbers stay
the same.

:func:`no_checkpoint` decides what ``--resume`` does in a folder with no usable
checkpoint [OURS]: a new or empty folder starts a new run (so a script may always pass
``--resume``), a folder that holds a logged run is refused, since starting again would
replace its metrics.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

__all__ = [
    "BOOKKEEPING_FIELDS",
    "EXPERIMENT_FIELDS",
    "RUN_OUTPUTS",
    "ResumeError",
    "changes",
    "check",
    "fresh_start",
    "no_checkpoint",
]

EXPERIMENT_FIELDS: tuple[str, ...] = (
    # the policy and where it starts (frozen weights, the warm start and the reference
    # model are rebuilt from these, not read from the checkpoint)
    "model.name",
    "model.device",  # other kernels, and the rollout generator lives there (its own stream)
    "model.dtype",
    "model.autocast",  # bf16 compute
    "model.rollout_precision",  # the sampler's precision: another behaviour policy
    "model.warm_start",
    "model.sft_steps",
    "model.lora_rank",
    "model.lora_alpha",
    "model.lora_targets",
    # the data
    "task.name",
    "task.params",
    # what is sampled and how it is scored
    "sampling.prompts_per_step",
    "sampling.group_size",
    "sampling.temperature",
    "sampling.top_p",
    "sampling.top_k",
    "sampling.logprob_support",  # which distribution every log-prob is read on
    "sampling.draw",  # other draws for the same seed
    "sampling.max_new_tokens",
    "sampling.verify_timeout_s",  # a completion that times out scores NaN
    "sampling.overlong_cache",
    "sampling.pool_size",  # which prompts the sampler draws from
    "sampling.curriculum_low",  # the curriculum's band, decay, prior and schedule: which
    "sampling.curriculum_high",  #   prompts it draws
    "sampling.curriculum_decay",
    "sampling.curriculum_prior_strength",
    "sampling.curriculum_revisit",
    "sampling.max_resample_tries",  # dynamic sampling: which groups make the batch
    # the algorithm: the preset and every override of its fields
    "algorithm.preset",
    "algorithm.overrides",
    "algorithm.kl_correction",
    "algorithm.top_entropy_quantile",
    "algorithm.selection",
    # the update
    "optim.lr",
    "optim.weight_decay",
    "optim.betas",
    "optim.eps",
    "optim.grad_clip",
    "optim.ppo_epochs",
    "optim.minibatches",
    # [OURS, measured] the same sums in exact arithmetic (StepTotals), but AdamW amplifies
    # the rounding of another split: kl/mean 1.2 % apart at step 3 of the toy test run
    "optim.micro_batch_size",
    # the evaluation protocol: the eval curve before and after must be comparable
    "eval.prompts",
    "eval.samples",
    "eval.ks",
    "eval.temperature",
    # every random stream
    "run.seed",
)
"""Fields that change what a run computes: ``--resume`` refuses to change them."""

BOOKKEEPING_FIELDS: tuple[str, ...] = (
    "optim.steps",  # how far to go (no schedule depends on it)
    "optim.logprob_chunk",  # the same projection in other chunks: rounding only
    "optim.fused",  # the same AdamW update in one kernel: rounding only
    "optim.activation_checkpointing",  # the same forward run again in the backward
    "optim.recompute",  # the same tensors rebuilt in the backward: bit for bit
    "model.attention",  # sdpa or eager: the same attention, rounding only
    "optim.max_nonfinite_steps",  # a guard: it may stop the run, it changes no number
    "optim.entropy",  # logs the policy entropy; no loss term uses it
    "sampling.max_unscorable_frac",  # a guard
    "eval.every",  # when to evaluate (the evaluation has its own generator)
    "eval.balance_every",  # when to measure R/KL (no gradient is changed)
    "run.out",  # a run folder may be moved
    "run.resume",
    "run.resume_anyway",
    "run.overwrite",
    "run.every",
    "run.keep_last",
    "run.progress",
    "run.tensorboard",
    "run.wandb",
    "run.report",
    "run.threads",  # speed; rounding only
    "run.mmap_threshold_kib",  # where freed memory goes; no number changes
    "run.save_final",  # what is exported at the end (final/)
    "run.merge_lora",
    "run.plugins",  # where the methods come from; the preset and its overrides are the math
)
"""Fields that cannot change the math: ``--resume`` lets them change."""

_NOTE_KEY = "resume/changed"
"""The metrics.jsonl entry of a ``--resume-anyway`` (in the first row after the resume)."""


class ResumeError(RuntimeError):
    """``--resume`` cannot continue this run; the message says why and what to do."""


def config_fields(cfg_type: Any = None) -> list[str]:
    """Every ``section.field`` of ``RunConfig``, in declaration order."""
    from grouprl.train.config import RunConfig

    cls = cfg_type or RunConfig
    return [
        f"{section.name}.{f.name}"
        for section in fields(cls)
        for f in fields(section.default_factory)  # type: ignore[misc]
    ]


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {
        f"{section}.{name}": value
        for section, values in config.items()
        if isinstance(values, dict)
        for name, value in values.items()
    }


def _default(name: str) -> Any:
    from grouprl.train.config import RunConfig

    return _flat(RunConfig().to_dict()).get(name)


def changes(
    recorded: dict[str, Any], now: dict[str, Any], names: tuple[str, ...] = EXPERIMENT_FIELDS
) -> dict[str, tuple[Any, Any]]:
    """``{field: (checkpoint's value, value now)}`` for the ``names`` that differ.

    Both configs are ``RunConfig.to_dict()`` layouts. A field the checkpoint does not
    record (written before the field existed) counts as changed only when its value now
    is not the default [OURS: a new field's default keeps the old behaviour].
    """
    before, after = _flat(recorded), _flat(now)
    out: dict[str, tuple[Any, Any]] = {}
    for name in names:
        if name not in after:
            continue
        if name not in before:
            if after[name] != _default(name):
                out[name] = ("not recorded", after[name])
        elif before[name] != after[name]:
            out[name] = (before[name], after[name])
    return out


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _lines(diff: dict[str, tuple[Any, Any]]) -> list[str]:
    return [f"  {k}: {_show(a)} (checkpoint) -> {_show(b)} (now)" for k, (a, b) in diff.items()]


def _restore_hint(diff: dict[str, tuple[Any, Any]]) -> str:
    sets = [
        "--set "
        + shlex.quote(f"{k}={a if isinstance(a, str) else json.dumps(a, separators=(',', ':'))}")
        for k, (a, _) in diff.items()
        if a != "not recorded"
    ]
    return " ".join(sets)


def check(
    cfg: Any,
    manifest: dict[str, Any],
    checkpoint: str | Path,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """Compare the checkpoint's recorded configuration with ``cfg`` (a ``RunConfig``).

    Raises ``ResumeError`` when an experiment field differs and ``cfg.run.resume_anyway``
    is off; returns the metrics note to log after a ``--resume-anyway`` (else None).
    """
    from grouprl import __version__

    checkpoint = Path(checkpoint)
    step, version = int(manifest.get("step", 0)), manifest.get("grouprl", "an unknown version")
    recorded = manifest.get("config")
    if not isinstance(recorded, dict):
        log(
            f"resume: {checkpoint} records no configuration (written by an older grouprl); "
            "cannot check that this run continues the same experiment"
        )
        return None
    now = cfg.to_dict()
    if version != __version__:
        log(f"resume: {checkpoint} was written by grouprl {version}; this is {__version__}")
    diff = changes(recorded, now)
    where = f"{checkpoint} (step {step}, grouprl {version})"
    if diff and not cfg.run.resume_anyway:
        hint = _restore_hint(diff)
        raise ResumeError(
            "\n".join(
                [
                    f"--resume would change the experiment of {checkpoint.parent.parent}: "
                    f"its checkpoint {where} was written with",
                    *_lines(diff),
                    "One metrics.jsonl would then mix two experiments. To continue the run, "
                    + (f"give the checkpoint's values ({hint})" if hint else "drop the changes")
                    + "; to start a new one, pass another --out; to continue with the change "
                    "and record it in metrics.jsonl and the report, add --resume-anyway.",
                ]
            )
        )
    kept = changes(recorded, now, BOOKKEEPING_FIELDS)
    for name in ("run.resume", "run.resume_anyway", "run.overwrite"):  # how it was started
        kept.pop(name, None)
    if kept:
        log("resume: changed since the checkpoint (allowed, no effect on the math):")
        for line in _lines(kept):
            log(line)
    if not diff:
        return None
    log(f"resume: --resume-anyway: continuing {where} with a changed experiment:")
    for line in _lines(diff):
        log(line)
    log(f"resume: the change is recorded in metrics.jsonl ({_NOTE_KEY}) and report.html")
    return {
        _NOTE_KEY: {
            "after_step": step,
            "checkpoint": str(checkpoint),
            "grouprl": [version, __version__],
            "fields": {k: [a, b] for k, (a, b) in diff.items()},
        }
    }


RUN_OUTPUTS: tuple[str, ...] = (
    "checkpoints",
    "metrics.jsonl",
    "rewards.jsonl",
    "config.yaml",
    "tb",
    "report.html",
    "final",
    "final_merged",
)
"""What a run writes into its folder (``train.sinks``, ``train.checkpoint``,
``train.export``): what ``--overwrite`` deletes. Anything else in the folder is left."""


def _held_run(run_dir: Path) -> tuple[int, int, int]:
    """(checkpoints, logged steps, logged groups) in ``run_dir``; the step-0 evaluation
    row does not count as a step."""
    from grouprl.train.layout import list_checkpoints
    from grouprl.train.sinks import read_jsonl

    ckpts = len(list_checkpoints(run_dir / "checkpoints"))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = sum(isinstance(r, dict) and r.get("step", 0) >= 1 for r in rows)
    groups = len(read_jsonl(run_dir / "rewards.jsonl"))
    return ckpts, steps, groups


def fresh_start(cfg: Any, *, log: Callable[[str], None] = print) -> None:
    """A new run (no ``--resume``) in ``run.out``: refuse a folder that holds a run [OURS].

    Starting a run over an earlier one would delete its metrics and, worse, mix two runs'
    checkpoints: the earlier run's later steps would outrank the new run's, so keep-last
    pruning deletes the new checkpoints and a later ``--resume`` continues the old run.
    A folder with a checkpoint or a logged step (the step-0 evaluation does not count)
    raises :class:`ResumeError` naming the three ways on; with ``run.overwrite``
    (``--overwrite``) the earlier run's outputs (:data:`RUN_OUTPUTS`) are deleted first.
    """
    import shutil

    run_dir = Path(cfg.run.out)
    ckpts, steps, groups = _held_run(run_dir)
    if not (ckpts or steps or groups):
        return
    held = (
        f"{ckpts} checkpoint{'' if ckpts == 1 else 's'}, "
        f"{steps} logged step{'' if steps == 1 else 's'}"
    )
    if not cfg.run.overwrite:
        raise ResumeError(
            f"{run_dir} already holds a run ({held}). Continue it with --resume; start "
            "over with --overwrite (deletes its checkpoints, metrics, report and final/ "
            "export); or keep it and pass another --out."
        )
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    log(f"--overwrite: deleted the earlier run in {run_dir} ({held})")


def no_checkpoint(cfg: Any, *, log: Callable[[str], None] = print) -> None:
    """``--resume`` found no usable checkpoint: start a new run, or refuse [OURS].

    A folder where no step was logged yet (new, empty, or a run stopped before its first
    step; the step-0 evaluation does not count) starts a new run and says so; a folder that holds a logged run raises
    ``ResumeError``: starting again would replace its metrics.jsonl and rewards.jsonl.
    """
    run_dir = Path(cfg.run.out)
    rejected, steps, groups = _held_run(run_dir)  # none of the checkpoints was usable
    if not (steps or groups or rejected):
        log(
            f"resume: no checkpoint in {run_dir} and nothing logged there yet: "
            "starting a new run from step 0"
        )
        return
    if rejected:
        why = f"{rejected} checkpoint(s) rejected, see above"
    else:
        every = cfg.run.every
        cadence = f"every {every} steps and at the end" if every else "only at the end"
        why = f"none was written yet: run.every={every} writes one {cadence}"
    raise ResumeError(
        f"--resume: {run_dir} holds a run ({steps} step{'' if steps == 1 else 's'} in "
        "metrics.jsonl) but no usable "
        f"checkpoint ({why}). Starting again would replace its metrics. To start over in "
        "this folder, run with --overwrite instead of --resume (it deletes that run's "
        "outputs); to keep it, pass another --out."
    )
