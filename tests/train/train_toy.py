"""Test doubles for the trainer tests: a trivially learnable task and a tiny config.

``ToyTask``: the prompt is ``<bos> q <sep>``; the reward is 1 when the completion's first
word is ``a``. A random tiny model says ``a`` first with probability about 1/V, so groups
of 8 are often mixed, and RL learns it within a few dozen steps.
"""

from __future__ import annotations

import math
from typing import Any

from grouprl.tasks.base import Example, Task

WORDS = ["a", "b", "c", "d", "q"]


class ToyTask(Task):
    """Say ``a`` first. ``nan_word``: completions starting with it are unscorable (NaN)."""

    name = "toy"
    reward_range = (0.0, 1.0)

    def __init__(self, nan_word: str | None = None, raise_word: str | None = None) -> None:
        self.config = {"nan_word": nan_word, "raise_word": raise_word}
        self.nan_word, self.raise_word = nan_word, raise_word

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return [Example(f"toy/{split}/{seed}/{i}", "q", "a") for i in range(n)]

    def verify(self, completion: str, reference: Any) -> float:
        first = (completion.split() or [""])[0]
        if self.raise_word is not None and first == self.raise_word:
            raise RuntimeError("verifier crashed")
        if self.nan_word is not None and first == self.nan_word:
            return math.nan
        return float(first == reference)

    def vocabulary(self) -> list[str]:
        return list(WORDS)

    def render(self, example: Example, tokenizer: Any) -> str:
        return f"<bos> {example.prompt} <sep>"


TINY = "tiny:d=16,layers=1,heads=2,ctx=32"

BASE = [
    "model.name=" + TINY,
    "model.warm_start=false",
    "sampling.prompts_per_step=4",
    "sampling.group_size=4",
    "sampling.max_new_tokens=4",
    "optim.lr=0.03",
    "optim.steps=3",
    "eval.every=0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
    "run.every=0",
]
"""Overrides of a fast tiny run (16 sequences of <= 4 tokens per step)."""


def make(tmp_path, *extra: str, task: Task | None = None):
    """(config, injected model/tokenizer/task) for ``loop.train(cfg, **injected)``."""
    from grouprl import models
    from grouprl.train.config import load_config

    cfg = load_config(None, [*BASE, f"run.out={tmp_path}", *extra], validate=False)
    task = task or ToyTask()
    model, tok = models.load(cfg.model.name, task=task, seed=cfg.run.seed)
    return cfg, {"model": model, "tokenizer": tok, "task": task}


TINY_MAZE_ARGS = [
    "--model",
    "tiny:d=16,layers=1,heads=2,ctx=64",
    "--set",
    "model.warm_start=false",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--set",
    "sampling.max_new_tokens=8",
    "--set",
    "eval.every=0",
    "--set",
    "run.tensorboard=false",
    "--set",
    "run.report=false",
    "--no-progress",
]
"""``grouprl train`` flags of a real run that is fast: tiny model, maze, no warm start."""


def grouprl_command(*argv: str) -> list[str]:
    """``python -m grouprl ARGV`` with this interpreter."""
    import sys

    return [sys.executable, "-m", "grouprl", *argv]


def subprocess_env() -> dict[str, str]:
    """The environment of a child process that imports this checkout's grouprl, offline."""
    import os
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{src}:{path}" if path else src}


def off_policy(m: dict[str, float]) -> float:
    """How far a step is from on-policy: the ratio's distance from 1, |approx KL| (step metrics)."""
    return max(abs(m["policy/ratio_max"] - 1), abs(m["policy/ratio_min"] - 1),
               abs(m["policy/approx_kl"]))  # fmt: skip


def to_reference(m: dict[str, float]) -> float:
    """The KL to the reference: in the loss (``kl/mean``) and the behaviour's (``kl/max``)."""
    return max(abs(m["kl/mean"]), abs(m["kl/max"]))
