"""Any reasoning-gym dataset as a task, scored by the dataset's own scorer on an extracted answer.

reasoning-gym's default ``score_answer`` gives 1.0 for an exact match and
``len(gold) / len(reply)`` when the gold answer merely occurs in a longer reply (``' 1'``
scores 0.5 against ``'1'``), and small models ignore ``<answer>`` tags (SmolLM2-135M:
pass@1 0.18 on one-digit sums with a last-number parser, 0 when tags are demanded;
docs/models.md). So [OURS] we first extract the answer leniently (:func:`extract_answer`)
and then, by default, binarise the scorer's value: reward 1 iff the scorer gives 1.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from grouprl.tasks.answers import last_boxed
from grouprl.tasks.base import Example, Task, chat_render, check_n, split_rng

__all__ = ["DEFAULT_CONFIGS", "ReasoningGymTask", "dataset_names", "extract_answer"]

DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ("+", "-"),
        "allow_parentheses": False,
        "allow_negation": False,
    },
}
"""[OURS] Dataset configs used when the caller gives none: one-digit add/subtract, where
SmolLM2-135M's pass@1 is ~0.18 and 72 % of groups of 8 are mixed (docs/models.md);
reasoning-gym's own default (2–6 terms, up to 4 digits, all four operators) leaves a
135M model at ~0."""

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")
_FULL_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_PREFIX = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is)?\s*[:=]?\s*", re.I)


def dataset_names() -> list[str]:
    """Every reasoning-gym dataset name (106 in reasoning-gym 0.1.25)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text.replace("\u2212", "-"))
    if not found:
        return None
    number = found[-1].replace(",", "")
    if "." in number:  # 7.0 -> 7, 2.50 -> 2.5: the form the generators write
        number = number.rstrip("0").rstrip(".") or "0"
    return "0" if number in ("-0", "") else number


def extract_answer(text: str, numeric: bool) -> str | None:
    """The answer in a reply: last ``<answer>…</answer>``, else ``\\boxed{…}``, else the reply.

    Then, when the gold answer is a number (``numeric``), the last number in that span
    (thousands commas dropped, trailing ``.0`` trimmed, unicode minus read as ``-``);
    otherwise the span's last non-empty line, with an ``Answer:`` / ``The answer is``
    prefix and a trailing full stop removed. None when nothing is left (reward 0).
    [OURS] lenient extraction, after the measurement in docs/models.md (reasoning-gym).
    """
    span = text
    tags = _ANSWER_TAG.findall(text)
    boxed = last_boxed(text)
    if tags:
        span = tags[-1]
    elif boxed is not None:
        span = boxed
    if numeric:
        return _last_number(span)
    lines = [line.strip() for line in span.strip().splitlines() if line.strip()]
    if not lines:
        return None
    answer = _PREFIX.sub("", lines[-1]).strip()
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1].rstrip()
    return answer or None


class ReasoningGymTask(Task):
    """A reasoning-gym dataset by name and config; lenient extraction, the dataset's scorer, binary reward."""

    reward_range = (0.0, 1.0)

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        *,
        binary: bool = True,
        system: str | None = None,
        **config: Any,
    ) -> None:
        """``dataset`` is any name in ``reasoning_gym.factory.DATASETS``; ``config`` its config fields.

        Args:
            binary: [OURS] reward 1 iff the dataset's scorer gives 1 (partial credit → 0).
            system: system prompt for chat templates (None: the template's own default).
            config: the dataset's config fields; when empty, :data:`DEFAULT_CONFIGS` applies.
        """
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}; choose one of: {', '.join(sorted(DATASETS))}"
            )
        if not config:
            config = dict(DEFAULT_CONFIGS.get(dataset, {}))
        _, config_cls = DATASETS[dataset]
        fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(
                f"reasoning-gym dataset {dataset!r} has no config field(s) {unknown}; "
                f"its fields are: {', '.join(sorted(fields))}"
            )
        self.name = dataset
        self.dataset = dataset
        self.binary = bool(binary)
        self.system = system
        self.dataset_config = dict(config)
        self.config = {"dataset": dataset, "binary": self.binary, **config}
        if system is not None:
            self.config["system"] = system
        try:
            self._scorer = reasoning_gym.create_dataset(dataset, size=1, seed=0, **config)
        except AssertionError as err:
            raise ValueError(f"invalid config for reasoning-gym {dataset!r}: {err}") from err

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` items generated by reasoning-gym with a seed drawn from ``(split, seed)``; reference = the entry."""
        import reasoning_gym

        rg_seed = split_rng(f"rg/{self.dataset}", split, seed).randrange(2**31)
        data = reasoning_gym.create_dataset(
            self.dataset, size=check_n(n), seed=rg_seed, **self.dataset_config
        )
        return [
            Example(f"{self.dataset}/{split}/{seed}/{i}", entry["question"], entry)
            for i, entry in enumerate(data)
        ]

    def verify(self, completion: str, reference: Any) -> float:
        """Extract the answer, score it with the dataset's scorer; binary by default; NaN if the scorer fails."""
        if not isinstance(reference, dict) or "answer" not in reference:
            return float("nan")
        gold = str(reference["answer"]).strip()
        answer = extract_answer(completion, numeric=bool(_FULL_NUMBER.match(gold)))
        if answer is None:
            return 0.0
        try:
            score = float(self._scorer.score_answer(answer=answer, entry=reference))
        except Exception:  # a crashing scorer is unscorable, counted as NaN by the trainer
            return float("nan")
        if self.binary:
            return 1.0 if score >= 1.0 - 1e-9 else 0.0
        return score

    def demonstration(self, example: Example) -> str:
        """The gold answer as the whole reply (a warm start that teaches the answer format)."""
        return str(example.reference["answer"])

    def render(self, example: Example, tokenizer: Any) -> str:
        """The question in the tokenizer's chat template (plain question without one)."""
        return chat_render(example.prompt, tokenizer, self.system)
