"""Verifiable tasks: examples with references, a verifier (NaN = unscorable), a renderer.

    from grouprl import tasks
    task = tasks.get("maze")                                  # F-GRPO §5.2 miniature, 5 × 5
    task = tasks.get("basic_arithmetic")                      # any reasoning-gym dataset name
    task = tasks.get("count_bits", max_n=16)                  # ... with its config fields
    task = tasks.get("math", path="problems.jsonl")           # math-verify on question/answer
    task = tasks.get("dataset", data="rows.jsonl", rewards=["my_rewards.py:correct"])
    ex = task.examples("train", n=8, seed=0)
    text = task.render(ex[0], tokenizer)                      # chat template when there is one
    reward = task.verify(completion_text, ex[0].reference)    # float in reward_range, or NaN

See :mod:`grouprl.tasks.base` for the interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grouprl.tasks.base import SPLITS, Example, Task
from grouprl.tasks.code import HumanEvalTask
from grouprl.tasks.math import MathTask
from grouprl.tasks.maze import MazeTask
from grouprl.tasks.reasoning_gym import ReasoningGymTask

__all__ = ["SPLITS", "TASKS", "Example", "Task", "get", "names"]


def _dataset(**config: Any) -> Task:
    """Your own data (a 'prompt' column) scored by TRL-style reward functions, weighted.

    ``grouprl.tasks.dataset.DatasetTask(**config)``, imported on use (it pulls in torch).
    """
    from grouprl.tasks.dataset import DatasetTask

    return DatasetTask(**config)


TASKS: dict[str, Callable[..., Task]] = {
    "maze": MazeTask,
    "reasoning_gym": ReasoningGymTask,
    "math": MathTask,
    "humaneval": HumanEvalTask,
    "dataset": _dataset,
}
"""Task name -> factory. Any reasoning-gym dataset name (e.g. ``basic_arithmetic``) is also
accepted by :func:`get`, which passes it as ``ReasoningGymTask(dataset=name, **config)``."""


def names() -> list[str]:
    """The registered task names (reasoning-gym dataset names are accepted too)."""
    return list(TASKS)


def get(name: str, **config: Any) -> Task:
    """The task called ``name`` built with ``config``; a reasoning-gym dataset name also works.

    Unknown names raise a ValueError listing the registered tasks and some reasoning-gym
    datasets.
    """
    if name in TASKS:
        return TASKS[name](**config)
    from grouprl.tasks.reasoning_gym import dataset_names

    datasets = dataset_names()
    if name in datasets:
        return ReasoningGymTask(name, **config)
    raise ValueError(
        f"unknown task {name!r}; choose one of: {', '.join(TASKS)}, or any reasoning-gym "
        f"dataset ({len(datasets)}: {', '.join(datasets[:8])}, ...; "
        "`python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'`)"
    )
