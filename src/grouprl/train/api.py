"""``grouprl.train.run``: train on your own dataset with TRL-style reward functions, in one call.

    from datasets import Dataset
    from grouprl.train import run

    def correct(completions, answer, **kwargs):          # written for TRL: runs unchanged
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    result = run(
        model="smollm2",                                  # a name for grouprl.models.load, or a
        dataset=Dataset.from_list(rows),                  #   transformers model (+ tokenizer=)
        reward_funcs=[correct, "my_rewards.py:format_reward"],
        reward_weights=[1.0, 0.1],
        preset="f_grpo",
        optim={"lr": 1e-5, "steps": 100},                 # config: one dict per section
        sampling={"group_size": 8, "max_new_tokens": 128},
        run={"out": "runs/mine"},
    )
    result.evals                                           # {step: {"eval/pass@1": ...}}

**Configuration** goes in one keyword argument per section of the YAML layout
(``grouprl.train.config``): ``task``, ``sampling``, ``algorithm``, ``optim``, ``eval``,
``run``, each a dict of that section's fields, e.g. ``optim={"lr": 1e-5}``, and
``model_config`` for the ``model`` section (``model=`` is the model itself), e.g.
``model_config={"lora_rank": 8, "dtype": "bfloat16"}``; they
go through the same loader as ``grouprl train --set optim.lr=1e-5`` (same defaults, model
profile, checks and errors). A YAML file can come first with ``config="run.yaml"``; the
section arguments override it. Flat names (``lr=``) are refused with a message that
says which section holds them: ``every`` and ``temperature`` exist in two sections.
``task={...}`` holds the dataset task's options (``eval_fraction``, ``prompt_column``,
``reward_range``, ``demonstration``, ``probe``; see :class:`grouprl.tasks.dataset.DatasetTask`).

Everything that can fail without a model fails before one is loaded: the data (no
``prompt`` column, an unreadable file), the reward functions (an unknown file, module or
function, a column they need and the data lacks, a trial call that raises, hangs or
returns the wrong number of rewards), the weights, and every config field.

A model built from scratch (``tiny``) is warm-started on a ``demonstration`` column when
the task names one; without one the warm start is off (``model.warm_start=false``) unless
you set it. The run's ``config.yaml`` records the data path and the reward specs when they
were given as a path and ``FILE.py:NAME`` strings (``grouprl train --config`` then repeats
the run); in-memory data and function objects are recorded as descriptions, so resume
such a run from Python with the same objects and ``run={"resume": True}``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grouprl.presets import DEFAULT as DEFAULT_PRESET

__all__ = ["SECTIONS", "run", "write_report"]

SECTIONS: tuple[str, ...] = ("task", "sampling", "algorithm", "optim", "eval", "run")
"""The keyword arguments that carry configuration: one dict per section of RunConfig (the
``model`` section comes as ``model_config=``)."""

_TASK_OPTIONS = ("eval_fraction", "prompt_column", "reward_range", "demonstration", "probe")


def _where(name: str) -> list[str]:
    """The sections that have a field called ``name`` (for the error on a flat keyword)."""
    from dataclasses import fields

    from grouprl.train.config import RunConfig

    return [
        s.name for s in fields(RunConfig) if name in {f.name for f in fields(s.default_factory)}
    ]


def _check_sections(sections: dict[str, Any]) -> None:
    for key, value in sections.items():
        if key not in SECTIONS:
            homes = _where(key)
            hint = (
                f"; it is a field of {' and '.join(homes)}: write "
                + " or ".join(
                    f"{'model_config' if h == 'model' else h}={{{key!r}: ...}}" for h in homes
                )
                if homes
                else ""
            )
            raise TypeError(
                f"run() got an unknown argument {key!r}; configuration goes in one dict per "
                f"section ({', '.join(SECTIONS)}, model_config){hint}"
            )
        if not isinstance(value, dict):
            raise TypeError(f"run(): {key}= must be a dict of that section's fields, got {value!r}")


def _overrides(sections: dict[str, dict[str, Any]]) -> list[str]:
    """``section.field=<JSON>`` strings (JSON is YAML, which the override loader reads)."""
    return [
        f"{section}.{key}={json.dumps(value, default=str)}"
        for section, values in sections.items()
        for key, value in values.items()
    ]


def _task_params(task: Any, dataset: Any) -> dict[str, Any]:
    """What config.yaml records: the task's own description of itself."""
    params = dict(task.config)
    if isinstance(dataset, (str, Path)):
        params["data"] = str(dataset)
    return params


def _tokenizer_for(model: Any, tokenizer: Any) -> Any:
    if tokenizer is not None:
        return tokenizer
    source = getattr(model, "name_or_path", "") or ""
    if source and Path(source).is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    raise ValueError(
        "run(model=<a model object>) needs its tokenizer: pass tokenizer=, or pass the model "
        "as a name or folder (model='smollm2', model='path/to/folder')"
    )


def run(
    model: Any = "tiny",
    dataset: Any = None,
    reward_funcs: Any = None,
    *,
    preset: str = DEFAULT_PRESET,
    reward_weights: Sequence[float] | None = None,
    eval_dataset: Any = None,
    tokenizer: Any = None,
    model_config: dict[str, Any] | None = None,
    config: str | Path | None = None,
    plugins: Sequence[str | Path] = (),
    **sections: dict[str, Any],
) -> Any:
    """Train ``model`` on ``dataset`` with ``reward_funcs``; returns ``loop.RunResult``.

    Args:
        model: a spec for ``grouprl.models.load`` (``"tiny"``, ``"smollm2"``, a folder, a
            ``.gguf`` file, an HF id), or a transformers causal LM (then ``tokenizer=``).
        dataset: a ``datasets.Dataset`` / ``DatasetDict``, a list of dicts, a DataFrame, a
            ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file or a ``save_to_disk``
            folder, with a ``prompt`` column (text or chat messages).
        reward_funcs: one or a list of TRL-style reward functions or ``"FILE.py:NAME"``.
        preset: a ``grouprl.presets`` name (``grpo``, ``dapo``, ``f_grpo``, ...).
        reward_weights: one weight per reward function (TRL's ``reward_weights``).
        eval_dataset: held-out rows (default: a fixed 10 % of ``dataset``).
        tokenizer: the tokenizer of a model object.
        model_config: the ``model`` section's fields (``lora_rank``, ``dtype``, ...).
        config: a YAML run config applied before the section arguments.
        plugins: ``.py`` files or module names that register methods and presets
            (``grouprl.plugins``; docs/extending.md), loaded before any name is read and
            recorded as ``run.plugins``.
        **sections: ``task=``, ``sampling=``, ``algorithm=``, ``optim=``, ``eval=``,
            ``run=`` dicts (module docstring).
    """
    from grouprl import presets
    from grouprl.tasks.dataset import DatasetTask
    from grouprl.train.config import load_config, profile_for
    from grouprl.train.loop import train

    _check_sections(sections)
    if model_config is not None and not isinstance(model_config, dict):
        raise TypeError(f"run(): model_config= must be a dict, got {model_config!r}")
    sections = {k: dict(v) for k, v in sections.items()}
    sections["model"] = dict(model_config or {})
    task_opts = sections.pop("task", {})
    unknown = sorted(set(task_opts) - set(_TASK_OPTIONS))
    if unknown:
        raise TypeError(
            f"run(): unknown task option(s) {unknown}; valid: {', '.join(_TASK_OPTIONS)}"
        )
    named = isinstance(model, str)
    model_section = sections["model"]
    model_section.setdefault(
        "name", model if named else (getattr(model, "name_or_path", "") or "custom")
    )
    sections.setdefault("algorithm", {}).setdefault("preset", preset)
    if plugins:  # loaded before the names are checked, recorded in the run's config.yaml
        if isinstance(plugins, (str, Path)):
            plugins = [plugins]
        files = [str(Path(p).resolve()) if str(p).endswith(".py") else str(p) for p in plugins]
        sections.setdefault("run", {})["plugins"] = files
    sections["task"] = {"name": "dataset"}
    # the configuration first (cheap), then the data and reward functions, then the model
    load_config(config, _overrides(sections), validate=False).validate(check_names=named)
    presets.get(sections["algorithm"]["preset"])
    task = DatasetTask(
        dataset,
        rewards=reward_funcs,
        reward_weights=reward_weights,
        eval_data=eval_dataset,
        **task_opts,
    )
    if named and profile_for(model) == "tiny" and task.demonstration_column is None:
        model_section.setdefault("warm_start", False)  # nothing to imitate
    sections["task"]["params"] = _task_params(task, dataset)
    cfg = load_config(config, _overrides(sections), validate=False).validate(check_names=named)
    if named:
        result = train(cfg, task=task)
    else:
        result = train(cfg, model=model, tokenizer=_tokenizer_for(model, tokenizer), task=task)
    write_report(cfg, result)
    return result


def write_report(cfg: Any, result: Any) -> Path | None:
    """``report.html`` of a finished run from its folder's files (``run.report``), after
    ``train()`` returned; None when not written (a run that stopped early, ``run.report``
    false, no matplotlib, or a bug of the report, which is printed: metrics are kept).

    The entry points call it (``grouprl train``, :func:`run`): the trainer never imports
    the report (docs/design.md, "Layers"). A full disk removes the partial page and raises
    ``DiskFullError``.
    """
    from grouprl.train.diskfull import DiskFullError, is_disk_full

    if not cfg.run.report or result.step < cfg.optim.steps:
        return None
    try:
        from grouprl.report import write_run_report
    except ImportError:
        return None
    run_dir = Path(result.run_dir)
    try:
        return write_run_report(run_dir)
    except Exception as err:  # a report bug must not lose a finished run
        if is_disk_full(err):
            partial = run_dir / "report.html"
            partial.unlink(missing_ok=True)
            raise DiskFullError(
                partial,
                step=result.step,
                ckpt_dir=run_dir / "checkpoints",
                cleaned="The partial report.html was removed; metrics, rewards and "
                "checkpoints are complete (--resume on a finished run only writes its "
                "report).",
                cause=err,
            ) from err
        print(f"report.html not written ({type(err).__name__}: {err}); metrics are kept")
        return None
