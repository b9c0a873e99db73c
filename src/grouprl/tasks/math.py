"""Math word problems from a JSONL file or an HF dataset, answers checked with math-verify.

Rows need a question column and an answer column (names configurable); a missing column
is a ValueError naming it and listing the columns present. The answer in a completion is
found by math-verify's own extraction (``\\boxed{}`` first, then LaTeX and plain
expressions), and compared symbolically to the gold answer (``1/2`` = ``0.5`` =
``\\frac12``). A gold answer math-verify cannot parse makes the sample unscorable (NaN,
counted), never a silent 0; a completion without a parseable answer is wrong (0).
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

from grouprl._json import jsonl_lines
from grouprl.tasks.base import Example, Task, chat_render, held_out, row_order

__all__ = ["MathTask", "load_rows", "math_verify_reward"]


def _timeouts() -> dict[str, Any]:
    # math-verify times out with signal.alarm, which only works in the main thread.
    # raise_on_error: by default math-verify swallows its own timeouts and errors and answers
    # "not equal", a silent 0; raising lets the caller (tasks.verify.score_batch) count the
    # sample as unscorable (NaN) instead.
    main = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 5 if main else None, "raise_on_error": True}


@functools.lru_cache(maxsize=65536)
def _parse_gold(gold: str) -> tuple:
    from math_verify import parse

    parsed = parse(gold, **_timeouts())
    if not parsed:  # plain-text gold such as "x^2+1" is read as inline math
        parsed = parse(f"${gold}$", **_timeouts())
    return tuple(parsed)


def math_verify_reward(completion: str, gold: str) -> float:
    """1.0 if math-verify finds the completion's answer equal to ``gold``, 0.0 if not, NaN if gold is unparseable.

    A timeout or an internal error of math-verify (sympy on adversarial LaTeX) raises instead
    of scoring 0, so that :func:`grouprl.tasks.verify.score_batch` counts it as unscorable.
    """
    from math_verify import parse, verify

    parsed_gold = _parse_gold(str(gold).strip())
    if not parsed_gold:
        return float("nan")
    pred = parse(completion, **_timeouts())
    if not pred:
        return 0.0
    main = threading.current_thread() is threading.main_thread()
    ok = verify(list(parsed_gold), pred, timeout_seconds=5 if main else None, raise_on_error=True)
    return 1.0 if ok else 0.0


def load_rows(source: str, *, hf_split: str = "train") -> list[dict[str, Any]]:
    """Rows of a ``.jsonl`` / ``.json`` file, or of an HF dataset (local folder or cached id).

    HF datasets need the ``datasets`` package and, on a machine without a hub, a local
    folder (``load_from_disk`` output or a folder of data files).
    """
    path = Path(source)
    if path.suffix in (".jsonl", ".json") or path.is_file():
        if not path.is_file():
            raise ValueError(f"dataset file {source!r} does not exist")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return list(json.loads(text))
        rows = []
        for lineno, obj, error in jsonl_lines(path):
            if error is not None:
                raise ValueError(f"{source}:{lineno}: not a JSON object ({error})")
            rows.append(obj)
        return rows
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"{source!r} is not a .jsonl/.json file; loading an HF dataset needs "
            "`pip install datasets` (and a local folder when there is no hub)"
        ) from err
    try:
        if path.is_dir() and (path / "dataset_info.json").exists():
            return list(datasets.load_from_disk(str(path)))
        return list(datasets.load_dataset(source, split=hf_split))
    except Exception as err:
        raise ValueError(
            f"could not load HF dataset {source!r} split {hf_split!r}: {err}. "
            "Without a dataset hub, pass a local .jsonl file or a dataset folder."
        ) from err


class MathTask(Task):
    """Math problems from JSONL / an HF dataset (question, answer columns), checked by math-verify."""

    name = "math"
    reward_range = (0.0, 1.0)

    def __init__(
        self,
        path: str | None = None,
        *,
        question: str = "question",
        answer: str = "answer",
        eval_path: str | None = None,
        eval_fraction: float = 0.1,
        hf_split: str = "train",
        system: str | None = None,
    ) -> None:
        """Load the rows now, so a missing file or column fails before any model is loaded.

        Args:
            path: a ``.jsonl`` / ``.json`` file or an HF dataset folder / cached id.
            question, answer: the column names.
            eval_path: held-out rows; without it, [OURS] a fixed ``eval_fraction`` of the rows
                (chosen by a hash of index and question, so stable across runs) is held out.
            hf_split: the split to read from an HF dataset.
            system: system prompt for chat templates (None: the template's default).
        """
        if path is None:
            raise ValueError(
                "the math task needs path=<file.jsonl or dataset folder> with "
                f"{question!r} and {answer!r} columns"
            )
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        self.question, self.answer, self.system = question, answer, system
        self.config = {
            "path": str(path),
            "question": question,
            "answer": answer,
            "eval_path": eval_path,
            "eval_fraction": eval_fraction,
            "hf_split": hf_split,
        }
        rows = self._checked(load_rows(str(path), hf_split=hf_split), str(path))
        if eval_path is not None:
            self._rows = {"train": rows, "eval": self._checked(load_rows(eval_path), eval_path)}
        else:
            held = [held_out(i, r[question], eval_fraction) for i, r in enumerate(rows)]
            self._rows = {
                "train": [r for r, h in zip(rows, held) if not h],
                "eval": [r for r, h in zip(rows, held) if h],
            }
        self._rows["test"] = self._rows["eval"]

    def _checked(self, rows: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
        if not rows:
            raise ValueError(f"{source!r} has no rows")
        for column in (self.question, self.answer):
            if column not in rows[0]:
                raise ValueError(
                    f"{source!r} has no column {column!r}; its columns are: "
                    f"{', '.join(map(str, rows[0]))}. Pass question=/answer= to name them."
                )
        return [
            {self.question: str(r[self.question]), self.answer: str(r[self.answer])} for r in rows
        ]

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` rows of the split in a seeded order (cycling through a fresh order when n > rows)."""
        if split not in self._rows:
            raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(self._rows)}")
        rows = self._rows[split]
        if not rows:
            raise ValueError(f"the {split!r} split is empty; raise eval_fraction or pass eval_path")
        return [
            Example(f"math/{split}/{i}", rows[i][self.question], rows[i][self.answer])
            for i in row_order("math", split, seed, len(rows), n)
        ]

    def verify(self, completion: str, reference: Any) -> float:
        """math-verify's equivalence of the completion's answer and the gold answer (NaN: gold unparseable)."""
        return math_verify_reward(completion, str(reference))

    def demonstration(self, example: Example) -> str:
        """The gold answer in ``\\boxed{}``."""
        return f"\\boxed{{{example.reference}}}"

    def render(self, example: Example, tokenizer: Any) -> str:
        """The question in the tokenizer's chat template (plain question without one)."""
        return chat_render(example.prompt, tokenizer, self.system)
