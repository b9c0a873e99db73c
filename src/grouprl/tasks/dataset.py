"""Your own data and reward functions: a task from a dataset with a ``prompt`` column, scored the TRL way.

    task = tasks.get("dataset", data="rows.jsonl", rewards=["my_rewards.py:correct"])
    task = DatasetTask(datasets.Dataset.from_list(rows), rewards=[correct, format_reward],
                       reward_weights=[1.0, 0.1])

**Data**: a ``datasets.Dataset`` (or a ``DatasetDict``: its ``train`` split, and ``test`` or
``validation`` as the held-out split), a list of dicts, a pandas DataFrame, a ``.jsonl`` /
``.json`` / ``.parquet`` / ``.csv`` file, or a folder written by ``Dataset.save_to_disk``.
Every row needs a ``prompt`` (TRL's column name, grpo_trainer.py: "It must include a
column ``prompt``"): a non-empty text, or chat messages (a list of ``{role, content}``
dicts, TRL's conversational format); every other column is passed to the reward
functions as a keyword argument holding one value per completion.

**Rendering** follows TRL's GRPOTrainer (``_tokenize_prompts``): a text prompt goes to the
model as it is (plus the special tokens the tokenizer adds by itself, e.g. a BOS) and
chat messages through the tokenizer's chat template with ``add_generation_prompt=True``;
completions reach the reward functions as text, or as ``[{"role": "assistant", "content":
text}]`` for chat prompts.

**Rewards**: :class:`grouprl.tasks.rewards.Rewards`: TRL's reward-function contract, weights with
TRL's ``reward_weights`` meaning, failures counted NaN. Every problem that can be found
without a model is found when the task is built: no rows, no ``prompt`` column, a prompt
that is neither text nor messages, a reward file, module or function that does not exist,
a function that wants a column the data lacks, one that raises, hangs or returns the
wrong number of rewards on a trial call.

**Splits** [OURS, as the math task]: with ``eval_data`` all rows train and ``eval_data`` is
held out; otherwise a fixed ``eval_fraction`` (default 0.1) of the rows, chosen by a hash
of each row's index and prompt, is held out (at least one row when the data has two or
more), so the evaluation's pass@k is measured on prompts the policy never trained on.
``eval_fraction=0`` holds nothing out (then set ``eval.every=0``). ``test`` is the held-out
split too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grouprl.tasks.base import Example, Task, held_out, row_order
from grouprl.tasks.rewards import (
    EXCLUDED_COLUMNS,
    RewardBatch,
    Rewards,
    combine,
    default_range,
    spec_of,
    trainer_state,
)

__all__ = ["DatasetTask", "is_chat", "load_table"]

FORMATS: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv")
"""File types read directly; a folder must come from ``datasets.Dataset.save_to_disk``."""


# ---- reading ------------------------------------------------------------------------------


def _from_datasets(obj: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Rows of a ``datasets`` object; a DatasetDict gives (train, test or validation)."""
    kind = type(obj).__name__
    if kind in ("IterableDataset", "IterableDatasetDict"):
        raise ValueError(
            f"a streaming {kind} cannot be sampled at random; materialise it, e.g. "
            "Dataset.from_list(list(stream.take(10_000)))"
        )
    if hasattr(obj, "column_names") and not isinstance(obj.column_names, dict):
        return [dict(r) for r in obj], None
    splits = dict(obj)
    if "train" not in splits:
        raise ValueError(
            f"the DatasetDict has splits {sorted(splits)} but no 'train'; pass one split, "
            "e.g. dataset=ds['<split>']"
        )
    held = next((splits[s] for s in ("test", "validation") if s in splits), None)
    return [dict(r) for r in splits["train"]], None if held is None else [dict(r) for r in held]


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix in (".jsonl", ".json"):
        from grouprl.tasks.math import load_rows

        return load_rows(str(path))
    try:
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError as err:
        raise ValueError(
            f"reading {path.suffix} files needs pyarrow: pip install 'grouprl[data]'"
        ) from err
    try:
        table = (
            pyarrow.parquet.read_table(path)
            if path.suffix == ".parquet"
            else pyarrow.csv.read_csv(path)
        )
    except Exception as err:
        raise ValueError(f"could not read {str(path)!r}: {type(err).__name__}: {err}") from err
    return table.to_pylist()


def _read_folder(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    markers = ("dataset_dict.json", "state.json", "dataset_info.json")
    if not any((path / m).is_file() for m in markers):
        raise ValueError(
            f"folder {str(path)!r} is not a saved dataset (no {' / '.join(markers)}); give a "
            f"folder written by Dataset.save_to_disk, or a {'/'.join(FORMATS)} file"
        )
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            "reading a save_to_disk folder needs datasets: pip install 'grouprl[data]'"
        ) from err
    return _from_datasets(datasets.load_from_disk(str(path)))


def load_table(data: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(rows, held-out rows or None)`` of any accepted data (module docstring)."""
    if isinstance(data, (str, Path)):
        path = Path(data).expanduser()
        if path.is_dir():
            return _read_folder(path)
        if path.suffix not in FORMATS:
            raise ValueError(
                f"data {str(data)!r}: unknown file type; give a {', '.join(FORMATS)} file or a "
                "folder written by Dataset.save_to_disk"
            )
        if not path.is_file():
            raise ValueError(f"data file {str(data)!r} does not exist")
        return _read_file(path), None
    if type(data).__module__.split(".")[0] == "datasets":
        return _from_datasets(data)
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        return data.to_dict("records"), None
    if isinstance(data, Sequence) and all(isinstance(r, dict) for r in data):
        return [dict(r) for r in data], None
    raise ValueError(
        f"cannot read data of type {type(data).__name__}; give a datasets.Dataset, a list of "
        f"dicts, a DataFrame, a {'/'.join(FORMATS)} file or a save_to_disk folder"
    )


def describe(data: Any) -> str:
    """What the run's config.yaml records for ``data``: its path, or what it was."""
    if isinstance(data, (str, Path)):
        return str(data)
    size = len(data) if hasattr(data, "__len__") else "?"
    return f"<in-memory {type(data).__name__}, {size} rows>"


# ---- checking -----------------------------------------------------------------------------


def is_chat(prompt: Any) -> bool:
    """TRL's conversational format: a list of ``{role, content}`` messages."""
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    )


def _check_prompts(rows: list[dict[str, Any]], column: str, source: str) -> bool:
    """Every row has a usable prompt, all text or all messages; returns whether they are chat."""
    if not rows:
        raise ValueError(f"{source}: the dataset has no rows")
    if column not in rows[0]:
        raise ValueError(
            f"{source}: no {column!r} column; its columns are: "
            f"{', '.join(map(str, rows[0])) or '(none)'}. The prompts must be in a column named "
            f"{column!r} (TRL's convention), or name it with prompt_column="
        )
    chat = is_chat(rows[0][column])
    for i, row in enumerate(rows):
        prompt = row.get(column)
        if chat and not (is_chat(prompt) and prompt):
            raise ValueError(
                f"{source}: row {i}: the prompts are chat messages (row 0), but this one is "
                f"{type(prompt).__name__}; every prompt is a list of {{role, content}} dicts"
            )
        if chat and not all(isinstance(m["content"], str) for m in prompt):
            raise ValueError(f"{source}: row {i}: message contents must be text")
        if not chat and not (isinstance(prompt, str) and prompt):
            raise ValueError(
                f"{source}: row {i}: {column!r} must be a non-empty text or a list of "
                f"{{role, content}} messages, got {type(prompt).__name__} {str(prompt)[:60]!r}"
            )
    return chat


def _columns(rows: list[dict[str, Any]], prompt_column: str) -> list[str]:
    """Every column but the prompt and TRL's excluded ones, in first-seen order."""
    seen = dict.fromkeys(k for r in rows for k in r)
    return [c for c in seen if c != prompt_column and c not in EXCLUDED_COLUMNS]


def _show(prompt: Any) -> str:
    """A one-string view of a prompt (Example.prompt): text, or the messages' contents."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


# ---- the task -----------------------------------------------------------------------------


class DatasetTask(Task):
    """Prompts from your data, rewards from your TRL-style reward functions (module docstring)."""

    name = "dataset"

    def __init__(
        self,
        data: Any = None,
        *,
        rewards: Any = None,
        reward_weights: Any = None,
        eval_data: Any = None,
        eval_fraction: float = 0.1,
        prompt_column: str = "prompt",
        reward_range: Sequence[float] | None = None,
        demonstration: str | None = None,
        probe: bool = True,
    ) -> None:
        """Read and check everything now, before any model is loaded.

        Args:
            data: the rows (module docstring for what is accepted).
            rewards: reward functions: callables or ``"FILE.py:NAME"`` / ``"module:NAME"``.
            reward_weights: one weight per function (TRL's ``reward_weights``); None = all 1.
            eval_data: held-out rows (same kinds as ``data``); default: ``eval_fraction``.
            eval_fraction: share of ``data`` held out when there is no ``eval_data``.
            prompt_column: the column holding the prompts (TRL: ``prompt``).
            reward_range: ``(lo, hi)`` of the combined reward: ``hi`` is "correct" for
                pass@k and the F-GRPO / AVSPO transforms. Default [OURS]: each function in
                [0, 1], so ``(Σ min(w, 0), Σ max(w, 0))``.
            demonstration: a column holding a correct completion: the supervised warm start
                of models built from scratch (``model.warm_start``) trains on it.
            probe: call every reward function once on the first rows (empty completions)
                to catch a broken one now; False skips that.
        """
        if data is None:
            raise ValueError(
                "the dataset task needs data=<a datasets.Dataset, a .jsonl/.parquet/.csv file "
                "or a save_to_disk folder> with a 'prompt' column"
            )
        if not 0.0 <= float(eval_fraction) < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        self.prompt_column, self.demonstration_column = prompt_column, demonstration
        rows, held = load_table(data)
        source = describe(data)
        self.chat = _check_prompts(rows, prompt_column, source)
        if eval_data is not None:
            held = load_table(eval_data)[0]
        if held is not None:
            held_source = describe(data if eval_data is None else eval_data)
            if self.chat != _check_prompts(held, prompt_column, held_source):
                raise ValueError("the training and held-out prompts must both be text or chat")
            self._rows = {"train": rows, "eval": held}
        else:
            self._rows = _split(rows, prompt_column, float(eval_fraction))
        self._rows["test"] = self._rows["eval"]
        every = rows + self._rows["eval"]
        if demonstration is not None and any(demonstration not in r for r in every):
            raise ValueError(f"{source}: demonstration column {demonstration!r} is missing")
        self.columns = _columns(every, prompt_column)
        self.rewards = Rewards(rewards, reward_weights)
        self.rewards.check_columns(self.columns)
        self.reward_range = tuple(
            float(x) for x in (reward_range or default_range(self.rewards.weights))
        )
        if len(self.reward_range) != 2 or not self.reward_range[0] < self.reward_range[1]:
            raise ValueError(f"reward_range must be (lo, hi) with lo < hi, got {reward_range!r}")
        self.config = {
            "data": source,
            "rewards": [r if isinstance(r, str) else spec_of(r) for r in _as_list(rewards)],
            "reward_weights": list(self.rewards.weights),
            "eval_data": None if eval_data is None else describe(eval_data),
            "eval_fraction": float(eval_fraction),
            "prompt_column": prompt_column,
            "reward_range": list(self.reward_range),
            "demonstration": demonstration,
        }
        self._prefix: dict[int, str] = {}
        if probe:
            trial = self._rows["train"][:2]
            empty = [[{"role": "assistant", "content": ""}] if self.chat else "" for _ in trial]
            self.rewards.probe(self._batch(empty, trial, [[] for _ in trial]))

    # ---- examples and scoring ---------------------------------------------------------------

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` rows of ``split`` in a seeded order; the reference is the whole row."""
        if split not in self._rows:
            raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(self._rows)}")
        rows = self._rows[split]
        if not rows:
            raise ValueError(
                f"the {split!r} split of the data is empty: pass eval_data=, raise "
                "eval_fraction, or turn the evaluation off (eval.every=0)"
            )
        return [
            Example(f"dataset/{split}/{i}", _show(rows[i][self.prompt_column]), rows[i])
            for i in row_order("dataset", split, seed, len(rows), n)
        ]

    def _batch(self, completions: list[Any], refs: Sequence[dict], ids: list) -> RewardBatch:
        return RewardBatch(
            [r[self.prompt_column] for r in refs],
            completions,
            ids,
            {c: [r.get(c) for r in refs] for c in self.columns},
        )

    def _wrap(self, texts: Sequence[str]) -> list[Any]:
        """Completions as the functions get them: text, or one assistant message (chat)."""
        if self.chat:
            return [[{"role": "assistant", "content": t}] for t in texts]
        return list(texts)

    def reward_batch(
        self,
        completions: Sequence[str],
        references: Sequence[dict[str, Any]],
        completion_ids: Sequence[Sequence[int]] | None,
        *,
        step: int = 0,
        max_steps: int = 0,
        timeout_s: float = 10.0,
        max_unscorable_frac: float = 1.0,
    ) -> Any:
        """The combined rewards of a batch of decoded completions: ``grouprl.tasks.verify.BatchScores``.

        The trainer's batched path (``train.batch.score``): one call of each reward
        function on the whole batch, in a forked worker under ``timeout_s`` (0: in this
        process), with ``trainer_state`` at ``step`` of ``max_steps``. ``completion_ids`` None
        (no token ids at hand): each function gets ``None`` for every completion's ids.
        """
        if completion_ids is None:
            completion_ids = [None] * len(completions)
        if not len(completions) == len(references) == len(completion_ids):
            raise ValueError(
                f"{len(completions)} completions, {len(references)} references and "
                f"{len(completion_ids)} token-id lists: pass one of each per completion"
            )
        ids = [None if i is None else [int(t) for t in i] for i in completion_ids]
        batch = self._batch(self._wrap(completions), references, ids)
        return self.rewards.score(
            batch,
            state=trainer_state(step, max_steps),
            timeout_s=timeout_s,
            max_unscorable_frac=max_unscorable_frac,
        )

    def verify(self, completion: str, reference: Any) -> float:
        """The combined reward of one completion, in this process (NaN: no function applied).

        Raises RuntimeError when a function failed on it, so callers count it as unscorable
        with the reason. Without the trainer there are no token ids: ``completion_ids`` is
        ``[None]``.
        """
        batch = self._batch(self._wrap([completion]), [reference], [None])
        out = self.rewards.evaluate(batch, trainer_state(0, 0), timeout_s=0)
        if out.failed.any():
            raise RuntimeError(out.reasons[0])
        return float(combine(out.values, out.failed, self.rewards.weight_tensor())[0])

    # ---- what the model sees ----------------------------------------------------------------

    def _special_prefix(self, tokenizer: Any) -> str:
        """The special tokens ``tokenizer(text)`` puts before a text (a BOS, or nothing)."""
        key = id(tokenizer)
        if key not in self._prefix:
            full = tokenizer("x")["input_ids"]
            bare = tokenizer("x", add_special_tokens=False)["input_ids"]
            extra = len(full) - len(bare)
            ok = extra > 0 and full[extra:] == bare
            self._prefix[key] = tokenizer.decode(full[:extra]) if ok else ""
        return self._prefix[key]

    def render(self, example: Example, tokenizer: Any) -> str:
        """A text prompt as it is (with the tokenizer's own BOS); messages via the chat template."""
        prompt = example.reference[self.prompt_column]
        if tokenizer is None:
            return _show(prompt)
        if not self.chat:
            return self._special_prefix(tokenizer) + prompt
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the prompts are chat messages but the tokenizer has no chat template; give "
                "text prompts, a model whose tokenizer has one, or set tokenizer.chat_template"
            )
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

    def demonstration(self, example: Example) -> str:
        """The ``demonstration`` column of the row (the supervised warm start's target)."""
        if self.demonstration_column is None:
            raise ValueError(
                "the dataset task has no demonstration column, so a model built from scratch "
                "cannot be warm-started: pass demonstration=<column> (task.params.demonstration) "
                "or set model.warm_start=false"
            )
        return str(example.reference[self.demonstration_column])


def _as_list(funcs: Any) -> list[Any]:
    return [funcs] if callable(funcs) or isinstance(funcs, str) else list(funcs or [])


def _split(rows: list[dict[str, Any]], column: str, fraction: float) -> dict[str, list]:
    """Train and held-out rows by :func:`held_out` (at least one held out when possible)."""
    keys = [json.dumps(r[column], sort_keys=True, ensure_ascii=False) for r in rows]
    held = [held_out(i, k, fraction) for i, k in enumerate(keys)]
    if fraction > 0 and not any(held) and len(rows) >= 2:
        held[0] = True  # [OURS] a tiny file still gets a held-out prompt
    if all(held):
        held[0] = False
    return {
        "train": [r for r, h in zip(rows, held) if not h],
        "eval": [r for r, h in zip(rows, held) if h],
    }
