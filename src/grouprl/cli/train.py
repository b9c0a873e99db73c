"""``grouprl train``: RL on a verifiable task with a preset; no arguments = the maze miniature.

    grouprl train                                    # tiny model, SFT warm start, grpo, maze
    grouprl train --preset f_grpo --steps 300 --out runs/fgrpo
    grouprl train --model smollm2 --task basic_arithmetic --preset f_grpo
    grouprl train --config configs/maze.yaml --set optim.lr=1e-4 --set eval.every=25
    grouprl train --out runs/fgrpo --resume          # continue from the latest good checkpoint
    grouprl train --data rows.jsonl --reward my_rewards.py:correct \
                  --reward my_rewards.py:format_reward --reward-weights 1,0.1 --model smollm2

Precedence: defaults < model profile (tiny / pretrained) < --config YAML < flags < --set.

Exit codes: 0 done; 1 the run stopped (diverged, broken verifier, full disk: the message
says what to do); 2 the command cannot run as given (a bad or unreadable config, a model
that cannot be found, a run folder in use by another run, a ``--resume`` that would change
the experiment or replace a run without a checkpoint); 128 + N stopped by signal N after a
checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["add_arguments", "build_task", "data_overrides", "overrides_from_args", "run"]


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
        "--print-config",
        action="store_true",
        help="print the resolved config, each value with where it came from, and exit",
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
    parser.add_argument(
        "--resume-anyway",
        action="store_true",
        help="--resume even when the configuration changes the experiment (model, task, "
        "preset, group size, lr, seed...); the change is recorded in metrics.jsonl and the report",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in an --out that holds one, deleting its checkpoints, metrics, "
        "report and final/ (without it, such a folder is refused)",
    )
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    add_plugin_argument(parser)
    add_data_arguments(parser)


def add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    """``--plugin FILE.py|MODULE`` (repeatable): methods and presets of your own."""
    parser.add_argument(
        "--plugin",
        dest="plugins",
        action="append",
        default=[],
        metavar="FILE.py|MODULE",
        help="load a plugin that registers methods and presets (repeatable; docs/extending.md)",
    )


def plugin_overrides(args: argparse.Namespace) -> list[str]:
    """``run.plugins=[...]`` for the ``--plugin`` flags (files as absolute paths, so a run
    folder's config.yaml finds them from anywhere)."""
    specs = getattr(args, "plugins", None) or []
    if not specs:
        return []
    paths = [str(Path(p).resolve()) if p.endswith(".py") else p for p in specs]
    return ["run.plugins=" + json.dumps(paths)]


# ---- your own data and reward functions (grouprl.tasks.dataset) ----------------------------


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data``, ``--eval-data``, ``--reward``, ``--reward-weights``: the dataset task."""
    group = parser.add_argument_group(
        "your own data",
        "a dataset with a 'prompt' column (text or chat messages) and TRL-style reward "
        "functions f(prompts, completions, **columns) -> list[float | None]",
    )
    group.add_argument(
        "--data", help="a .jsonl / .json / .parquet / .csv file or a save_to_disk folder"
    )
    group.add_argument(
        "--eval-data", help="held-out rows (default: a fixed 10%% of --data; see docs/tasks.md)"
    )
    group.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="FILE.py:FUNCTION",
        help="a reward function (repeatable; also MODULE:FUNCTION)",
    )
    group.add_argument(
        "--reward-weights",
        metavar="W1,W2,...",
        help="one weight per --reward, in order (TRL's reward_weights; default all 1)",
    )


def data_overrides(args: argparse.Namespace) -> list[str]:
    """The ``task.*`` overrides of the data flags; the warm start is off (nothing to imitate).

    Raises ConfigError when the flags do not go together.
    """
    from grouprl.train.config import ConfigError

    data, rewards = getattr(args, "data", None), getattr(args, "reward", None) or []
    weights, held = getattr(args, "reward_weights", None), getattr(args, "eval_data", None)
    if data is None:
        if rewards or weights or held:
            raise ConfigError("--reward, --reward-weights and --eval-data need --data")
        return []
    if getattr(args, "task", None) is not None:
        raise ConfigError(f"--data makes the task 'dataset'; drop --task {args.task}")
    if not rewards:
        raise ConfigError("--data needs at least one --reward FILE.py:FUNCTION")
    out = ["task.name=dataset", f"task.params.data={json.dumps(data)}"]
    out.append(f"task.params.rewards={json.dumps(rewards)}")
    if weights is not None:
        try:
            values = [float(w) for w in weights.replace(" ", "").split(",") if w]
        except ValueError as err:
            raise ConfigError(
                f"--reward-weights must be numbers like 1,0.1; got {weights!r}"
            ) from err
        out.append(f"task.params.reward_weights={json.dumps(values)}")
    if held is not None:
        out.append(f"task.params.eval_data={json.dumps(held)}")
    # [OURS] a tiny model's warm start needs a demonstration column; --set turns it back on
    return [*out, "model.warm_start=false"]


def build_task(cfg: Any) -> Any:
    """The dataset task of ``cfg`` (data read, reward functions loaded and tried), or None."""
    if cfg.task.name != "dataset":
        return None
    from grouprl import tasks

    return tasks.get("dataset", **dict(cfg.task.params))


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """The ``section.field=value`` list equivalent to the flags (then the --set ones)."""
    out = [
        f"{field}={getattr(args, dest)}"
        for dest, field in _FLAGS.items()
        if getattr(args, dest, None) is not None
    ]
    if args.resume or args.resume_anyway:
        out.append("run.resume=true")
    if args.resume_anyway:
        out.append("run.resume_anyway=true")
    if args.overwrite:
        out.append("run.overwrite=true")
    if args.no_progress:
        out.append("run.progress=false")
    return out + data_overrides(args) + plugin_overrides(args) + list(args.overrides)


def run(args: argparse.Namespace) -> int:
    """Load and validate the config (before any model is loaded), then train."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
    from grouprl.train.config import (
        ConfigError,
        config_layers,
        config_sources,
        describe_config,
        load_config,
    )

    try:
        overrides = overrides_from_args(args)
        cfg = load_config(args.config, overrides)
        if args.print_config:
            print(describe_config(cfg, config_sources(args.config, overrides)))
            return 0
        layers = [where for where, _ in config_layers(args.config, overrides)]
        task = build_task(cfg)  # the dataset task fails here, before any model loads
    except (ConfigError, OSError, UnicodeDecodeError) as err:
        return _fail(_config_message(args.config, err), 2)
    except yaml.YAMLError as err:
        return _fail(_yaml_message(args.config, err), 2)
    except ValueError as err:  # data or reward functions (grouprl.tasks.dataset)
        return _fail(str(err), 2)
    from grouprl._threads import tell_openmp

    threads, why = tell_openmp(cfg.run.threads)  # before torch loads and starts its pools
    print(
        f"grouprl train: {cfg.model.name} on {cfg.task.name} with {cfg.algorithm.preset}, "
        f"{cfg.optim.steps} steps of {cfg.sampling.prompts_per_step} x "
        f"{cfg.sampling.group_size}; run folder {cfg.run.out}\n"
        f"threads: {threads} ({why}; --set run.threads=N to choose)\n"
        f"config: defaults < {' < '.join(layers)} (--print-config shows each value's source)",
        flush=True,
    )
    return _train(cfg, task)


def _train(cfg: Any, task: Any) -> int:
    """``train(cfg)`` with every failure a user can meet turned into a message and a code."""
    from grouprl.models import ModelError
    from grouprl.tasks.verify import UnscorableError
    from grouprl.train.api import write_report
    from grouprl.train.diskfull import DiskFullError, is_disk_full
    from grouprl.train.loop import TrainingError, train
    from grouprl.train.resume import ResumeError
    from grouprl.train.runlock import RunFolderBusy

    try:
        result = train(cfg) if task is None else train(cfg, task=task)
        write_report(cfg, result)  # from the run folder's files
    except (TrainingError, UnscorableError, DiskFullError) as err:
        return _fail(f"stopped: {err}", 1)
    except (RunFolderBusy, ResumeError, ModelError) as err:
        return _fail(str(err), 2)
    except OSError as err:  # a full disk outside the run folder (caches, temp files)
        if not is_disk_full(err):
            raise
        return _fail(
            f"stopped: disk full ({err}). Free space, then rerun the same command with --resume.",
            1,
        )
    _summary(result)
    return 128 + result.stopped_by if result.stopped_by else 0


def _fail(message: str, code: int) -> int:
    print(f"grouprl train: {message}", file=sys.stderr, flush=True)
    return code


def _config_message(path: str | None, err: Exception) -> str:
    if isinstance(err, FileNotFoundError):
        return f"config file {path} not found; check the path (examples are in configs/)"
    if isinstance(err, (OSError, UnicodeDecodeError)):
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        return f"cannot read config file {path}: {reason}"
    return str(err)


def _yaml_message(path: str | None, err: yaml.YAMLError) -> str:
    """``FILE, line L, column C: what; what to do`` on one line (YAML marks are 0-based)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and start is not mark:
        context += f" that starts at line {start.line + 1}, column {start.column + 1}"
    detail = f"{what} ({context})" if context else what
    return (
        f"{where}: not valid YAML: {detail}; fix the file (a config is a mapping of sections, "
        "see configs/maze.yaml)"
    )


def _summary(result) -> None:
    if result.evals:
        first, last = min(result.evals), max(result.evals)
        for key in result.evals[last]:
            before, after = result.evals[first].get(key), result.evals[last][key]
            print(f"  {key:<18} step {first}: {before:.3f}  ->  step {last}: {after:.3f}")
    print(f"run folder: {result.run_dir} (metrics.jsonl, rewards.jsonl, checkpoints/)")
    report = result.run_dir / "report.html"
    if report.is_file():
        print(f"report: {report}")
