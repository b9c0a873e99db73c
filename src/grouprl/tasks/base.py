"""What a task is: examples with references, a verifier, and a renderer for the model.

A task gives the trainer three things:

- ``examples(split, n, seed) -> list[Example]``: prompts with their references, drawn
  deterministically from ``(split, seed)``; splits ``"train"`` and ``"eval"`` are disjoint
  streams (procedural tasks) or disjoint parts of a file (dataset tasks);
- ``verify(completion, reference) -> float``: the reward of one decoded completion, in
  ``reward_range``; **NaN means unscorable** (the reference itself is broken, a verifier
  crashed): the advantage layer counts and excludes it, it is never a silent 0. A wrong or
  malformed answer is a 0, not a NaN;
- ``render(example, tokenizer) -> str``: the exact text the policy is prompted with (the
  chat template when the tokenizer has one). The rollout tokenises it with
  ``add_special_tokens=False``: any BOS or separator is already in this text.

Tasks that can be learned by imitation also give ``demonstration(example) -> str``, the
completion text of a correct answer (without EOS), used by the supervised warm start
(:mod:`grouprl.train.sft`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["SPLITS", "Example", "Task", "chat_render", "held_out", "row_order", "split_rng"]

SPLITS: tuple[str, ...] = ("train", "eval", "test")
"""Valid split names; each is its own deterministic stream of examples."""


@dataclass(frozen=True)
class Example:
    """One prompt of a task: a stable ``id``, the ``prompt`` text, and the ``reference`` to verify against.

    ``reference`` is whatever the task's ``verify`` needs (a string answer, a maze, a
    reasoning-gym entry dict); the trainer passes it through untouched.
    """

    id: str
    prompt: str
    reference: Any


def split_rng(task: str, split: str, seed: int) -> random.Random:
    """A ``random.Random`` for ``(task, split, seed)``; streams of different splits never share a seed.

    [OURS] The seed is the first 8 bytes of SHA-256 of ``"task/split/seed"``, so it does
    not depend on Python's hash randomisation and neighbouring seeds are unrelated.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    digest = hashlib.sha256(f"{task}/{split}/{int(seed)}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def held_out(index: int, key: str, fraction: float) -> bool:
    """Whether row ``index`` (with text ``key``) is in the held-out ``fraction`` of a file.

    [OURS] The first 4 bytes of SHA-256 of ``"index/key"`` as a number in [0, 1): a fixed
    choice that does not depend on the run, the seed or the order rows are read in.
    """
    digest = hashlib.sha256(f"{index}/{key}".encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < fraction


def row_order(task: str, split: str, seed: int, size: int, n: int) -> list[int]:
    """``n`` row indices of a ``size``-row split: seeded shuffles of all rows, one after another.

    A call never repeats a row before it has used them all; different seeds (steps) give
    different shuffles (:func:`split_rng` of ``(task, split, seed)``).
    """
    rng = split_rng(task, split, seed)
    order: list[int] = []
    while len(order) < check_n(n):
        order.extend(rng.sample(range(size), size))
    return order[:n]


def chat_render(prompt: str, tokenizer: Any, system: str | None = None) -> str:
    """The prompt as the tokenizer's chat template renders one user turn, or the plain prompt.

    With a chat template: ``apply_chat_template([{system}, {user: prompt}],
    add_generation_prompt=True, tokenize=False)`` (the template's own default system
    prompt applies when ``system`` is None, as in SmolLM2's ChatML template). Without
    one (base models, the tiny models): the prompt unchanged.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return prompt
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class Task:
    """Base class of the tasks: a name, a reward range, examples, a verifier, a renderer.

    Subclasses set ``name``, ``reward_range`` and ``config`` (the keyword arguments that
    rebuild the task, used as a cache key by the warm start) and implement ``examples``
    and ``verify``; ``render`` defaults to :func:`chat_render`.
    """

    name: str = "task"
    reward_range: tuple[float, float] = (0.0, 1.0)
    config: dict[str, Any]

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        raise NotImplementedError

    def verify(self, completion: str, reference: Any) -> float:
        raise NotImplementedError

    def render(self, example: Example, tokenizer: Any) -> str:
        """The text the policy sees: the chat template of one user turn, or the plain prompt."""
        return chat_render(example.prompt, tokenizer)

    def verify_batch(self, completions: list[str], references: list[Any]) -> list[float]:
        """``verify`` over aligned lists (the trainer's convenience; NaN passes through)."""
        if len(completions) != len(references):
            raise ValueError(
                f"{len(completions)} completions but {len(references)} references: "
                "repeat each reference group_size times (prompt-major order)"
            )
        return [float(self.verify(c, r)) for c, r in zip(completions, references)]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.config.items()))
        return f"{type(self).__name__}({args})"


def check_n(n: int) -> int:
    """``n`` as a positive int, or a ValueError saying so."""
    if int(n) != n or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return int(n)
