"""``grouprl train``: RL on a verifiable task with a preset; no arguments = the maze miniature.

    grouprl train                                    # tiny model, SFT warm start, grpo, maze
    grouprl train --preset f_grpo --steps 300 --out runs/fgrpo
    grouprl train --model smollm2 --task basic_arithmetic --preset f_grpo
    grouprl train --config configs/maze.yaml --set optim.lr=1e-4 --set eval.every=25
    grouprl train --out runs/fgrpo --resume          # continue from the latest good checkpoint

Precedence: defaults < model profile (tiny / pretrained) < --config YAML < flags < --set.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_arguments", "overrides_from_args", "run"]


_FLAGS: dict[str, str] = {
    "model": "model.name",
    "task": "task.name",
    "preset": "algorithm.preset",
    "steps": "optim.steps",
    "group_size": "sampling.group_size",
    "prompts_per_step": "sampling.prompts_per_step",
    "seed": "run.seed",
    "out": "run.out",
}
"""Command-line flag (dest) -> config field it sets."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``grouprl train`` flags."""
    parser.add_argument(
        "--config",
        help="YAML run config (sections: model, task, sampling, "
        "algorithm, optim, eval, run); see configs/",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any field, e.g. --set optim.lr=1e-4 (repeatable)",
    )
    parser.add_argument(
        "--model", help="tiny[:d=64,layers=4], smollm2, a folder, a .gguf, an HF id"
    )
    parser.add_argument("--task", help="maze, math, or a reasoning-gym dataset (basic_arithmetic)")
    parser.add_argument("--preset", help="grpo, dapo, f_grpo, maxnorm_rloo, ... (grouprl list)")
    parser.add_argument("--steps", type=int, help="RL steps")
    parser.add_argument("--group-size", type=int, help="completions per prompt (G)")
    parser.add_argument("--prompts-per-step", type=int, help="prompts per step (P)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", help="run folder (metrics.jsonl, checkpoints/, report.html)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest good checkpoint in --out"
    )
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """The ``section.field=value`` list equivalent to the flags (then the --set ones)."""
    out = [
        f"{field}={getattr(args, dest)}"
        for dest, field in _FLAGS.items()
        if getattr(args, dest, None) is not None
    ]
    if args.resume:
        out.append("run.resume=true")
    if args.no_progress:
        out.append("run.progress=false")
    return out + list(args.overrides)


def run(args: argparse.Namespace) -> int:
    """Load and validate the config (before any model is loaded), then train."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
    from grouprl.tasks.verify import UnscorableError
    from grouprl.train.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, overrides_from_args(args))
    except (ConfigError, FileNotFoundError) as err:
        print(f"grouprl train: {err}", file=sys.stderr)
        return 2
    from grouprl.train.loop import TrainingError, train

    print(
        f"grouprl train: {cfg.model.name} on {cfg.task.name} with {cfg.algorithm.preset}, "
        f"{cfg.optim.steps} steps of {cfg.sampling.prompts_per_step} x "
        f"{cfg.sampling.group_size}; run folder {cfg.run.out}",
        flush=True,
    )
    try:
        result = train(cfg)
    except (TrainingError, UnscorableError) as err:
        print(f"grouprl train: stopped: {err}", file=sys.stderr)
        return 1
    _summary(result)
    return 128 + result.stopped_by if result.stopped_by else 0


def _summary(result) -> None:
    if result.evals:
        first, last = min(result.evals), max(result.evals)
        for key in result.evals[last]:
            before, after = result.evals[first].get(key), result.evals[last][key]
            print(f"  {key:<18} step {first}: {before:.3f}  ->  step {last}: {after:.3f}")
    print(f"run folder: {result.run_dir} (metrics.jsonl, rewards.jsonl, checkpoints/)")
