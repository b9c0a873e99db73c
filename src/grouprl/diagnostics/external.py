"""Reward groups from the rollout logs TRL and verl already write, for ``grouprl diagnose``.

Pure loading: each reader returns the structure :func:`grouprl.diagnostics.diagnose.load_groups`
returns (``batches[step] = (prompt_ids, rewards [P, G])``, NaN-padded), so the diagnosis, the
ACR split, the scale tails, the tail-miss advice and the report are the ones of our own runs.
Groups are rebuilt from ``(step, prompt)``: the samples of one step that share a prompt form
its group (first-seen order). Both trainers log a prompt's G samples under the same text; two
identical prompts in one batch therefore count as one group of 2G, and a note says so.

- **TRL** (``GRPOTrainer`` with ``log_completions=True``, TRL 1.x; format read in TRL 1.16,
  ``trl/trainer/grpo_trainer.py`` ``GRPOTrainer.log``): at each logging step,
  ``<output_dir>/completions/completions_<step:05d>.parquet`` with the columns ``step``,
  ``prompt``, ``completion``, one column per reward function (named after it), the
  ``log_extra`` columns, ``advantage``. The rows are the latest generation batch (a deque of
  ``generation_batch_size``). The reward is combined as TRL combines it for
  ``multi_objective_aggregation="sum_then_normalize"`` (``_generate_and_score_completions``):
  ``Σ_k w_k r_k`` with ``nansum``, NaN where every reward function returned None; the weights
  are ``GRPOConfig.reward_weights`` (default 1 each), which the files do not hold: pass them.
- **verl** (``trainer.rollout_data_dir``, verl 0.9; ``RayPPOTrainer._write_generations`` in
  ``verl/trainer/ppo/ray_trainer.py``): one ``<global_step>.jsonl`` a step, one line a sample
  with ``input`` (the decoded prompt), ``output``, ``gts``, ``score``, ``step`` and the reward
  manager's extra infos. ``score`` is ``token_level_scores.sum(-1)``: the reward the trainer
  combined, as its estimators see it (before a KL-in-reward penalty).

Verified correctness, for the ``reward_hacking`` rule: a reward-function column (TRL) or a
reward extra info (verl) named like a correctness score (:data:`CORRECT_NAMES`, or the
``correct`` argument) is read beside the combined reward as ``reward/correct_mean`` per step.
The trainers' metric logs (TRL's ``trainer_state.json`` ``log_history``, verl's file logger)
are read into our metric names for the health rules (:data:`HEALTH_PEER_KEYS`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grouprl._json import jsonl_lines, read_jsonl
from grouprl.diagnostics.diagnose import MAX_ERRORS_KEPT, GroupFile

__all__ = [
    "CORRECT_NAMES",
    "HEALTH_PEER_KEYS",
    "SOURCES",
    "ExternalGroups",
    "MismatchLog",
    "detect",
    "health_from_peer_log",
    "is_correct_name",
    "load",
    "load_mismatch",
    "load_trl",
    "load_verl",
]

TRL_FILE = re.compile(r"^completions_(\d+)\.parquet$")
"""TRL's ``completions_<step:05d>.parquet``."""
VERL_FILE = re.compile(r"^(\d+)\.jsonl$")
"""verl's ``<global_step>.jsonl``."""
TRL_FIXED_COLUMNS = ("step", "prompt", "completion", "advantage")
"""Columns of TRL's table that are not reward-function columns."""
VERL_KEYS = ("input", "output", "score")
"""Keys every line of verl's dump has (with ``gts`` and ``step``)."""
CORRECT_NAMES = ("acc", "accuracy", "correct", "correctness", "is_correct", "accuracy_reward")
"""Names of a reward function (TRL) or a reward extra info (verl) read as the verifier's
correctness (case-insensitive); TRL's own ``trl.rewards.accuracy_reward`` is one [OURS]."""

HEALTH_PEER_KEYS: dict[str, dict[str, str]] = {
    "trl": {
        "clip_ratio/low_mean": "policy/clip_frac_low",
        "clip_ratio/high_mean": "policy/clip_frac_high",
        "clip_ratio/region_mean": "policy/clip_frac_region",
        "entropy": "policy/entropy_mean",
        "completions/mean_length": "length/mean",
        "completions/clipped_ratio": "length/truncated_frac",
        "reward": "reward/mean",
    },
    "verl": {
        "actor/pg_clipfrac": "policy/clip_frac_region",
        "actor/entropy": "policy/entropy_mean",
        "response_length/mean": "length/mean",
        "response_length/clip_ratio": "length/truncated_frac",
        "critic/score/mean": "reward/mean",
    },
}
"""Metric names TRL 1.16 (``GRPOTrainer._compute_loss`` / ``_generate_and_score_completions``)
and verl 0.9.1 (``metric_utils.compute_data_metrics``, ``core_algos.compute_policy_loss_*``)
log -> the names the health rules read. TRL's ``clip_ratio/low_mean`` is A < 0 with ratio <
1 − ε_low and ``high_mean`` A > 0 with ratio > 1 + ε_high, our ``policy/clip_frac_low`` /
``_high``; verl's ``pg_clipfrac`` counts both bounds together (its ``pg_clipfrac_lower`` is
the dual-clip bound, not the low one), so a verl log gives ``clip_bound`` no direction.
TRL's ``rewards/<function>/mean`` of a correctness function (:data:`CORRECT_NAMES`) becomes
``reward/correct_mean``. Neither log holds which completions were truncated together with
their rewards, so ``truncation_zeroed`` reads only our runs."""


def is_correct_name(name: str) -> bool:
    """Whether a reward function / extra-info name reads as a correctness score."""
    return name.lower() in CORRECT_NAMES


@dataclass
class ExternalGroups(GroupFile):
    """:class:`~grouprl.diagnostics.diagnose.GroupFile` of an external log, with its source
    (``"trl"`` / ``"verl"``) and notes on how it was read (columns, weights, skipped files)."""

    source: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class _Sample:
    step: int
    prompt: str
    reward: float
    correct: float = math.nan
    """The verifier's correctness of the sample, NaN where the log has none."""


class _Collector:
    """Accumulates samples and malformed rows; builds the NaN-padded ``[P, G]`` batches."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, list[float]]] = {}
        self.errors: list[tuple[int, str]] = []
        self.n_errors = 0
        self.n_rows = 0
        self.correct: dict[int, list[float]] = {}

    def add(self, sample: _Sample) -> None:
        self.n_rows += 1
        self.steps.setdefault(sample.step, {}).setdefault(sample.prompt, []).append(sample.reward)
        if not math.isnan(sample.correct):
            self.correct.setdefault(sample.step, []).append(sample.correct)

    def error(self, row: int, message: str) -> None:
        self.n_rows += 1
        self.n_errors += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append((row, message))

    def build(self, path: Path, source: str, notes: list[str]) -> ExternalGroups:
        if not self.steps:
            raise ValueError(
                f"{path}: no scorable sample in the {source} log ({self.n_errors} malformed rows)"
            )
        batches = {}
        ragged = 0
        for step in sorted(self.steps):
            groups = self.steps[step]
            sizes = {len(r) for r in groups.values()}
            ragged += len(sizes) > 1
            rewards = torch.full((len(groups), max(sizes)), math.nan, dtype=torch.float64)
            for i, values in enumerate(groups.values()):  # parsing, not a hot path
                rewards[i, : len(values)] = torch.tensor(values, dtype=torch.float64)
            batches[step] = (list(groups), rewards)
        if ragged:
            notes.append(
                f"{ragged} step(s) have groups of different sizes (NaN-padded): a prompt that "
                "appears twice in one batch counts as one group"
            )
        correct = {
            step: {"reward/correct_mean": sum(v) / len(v)} for step, v in self.correct.items()
        }
        return ExternalGroups(
            path,
            batches,
            self.errors,
            self.n_errors,
            self.n_rows,
            step_metrics=correct,
            source=source,
            notes=notes,
        )


def _prompt_key(prompt: Any) -> str:
    """A prompt as a group key: the text, or the conversation as sorted JSON."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)


def _as_reward(value: Any) -> float:
    """A logged reward as a float; None -> NaN; anything else is an error."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"reward {value!r} is not a number")
    if math.isinf(value):
        raise ValueError("infinite reward")
    return float(value)


# --------------------------------------------------------------------------- detection
def _numbered(folder: Path, pattern: re.Pattern) -> list[Path]:
    files = [p for p in folder.iterdir() if p.is_file() and pattern.match(p.name)]
    return sorted(files, key=lambda p: int(pattern.match(p.name).group(1)))


def _trl_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    sub = path / "completions"
    return _numbered(sub if sub.is_dir() else path, TRL_FILE)


def _first_object(path: Path) -> dict | None:
    """The first non-empty line of a JSONL file as a dict (None if unreadable or not one)."""
    try:
        # closed at once, not when the abandoned generator is collected (its open file would
        # otherwise raise a ResourceWarning in a reference cycle)
        with closing(jsonl_lines(path)) as lines:
            for _, obj, _ in lines:
                return obj if isinstance(obj, dict) else None
    except (OSError, UnicodeDecodeError):
        return None
    return None


def _looks_like_verl_line(path: Path) -> bool:
    obj = _first_object(path)
    return obj is not None and "rewards" not in obj and all(k in obj for k in VERL_KEYS)


def detect(path: str | Path) -> str | None:
    """``"trl"``, ``"verl"`` or None: which trainer's log ``path`` is (a file or a folder).

    TRL: a ``.parquet`` file, or a folder holding ``completions_<n>.parquet`` (itself or in
    ``completions/``: TRL's ``output_dir``). verl: a folder of ``<n>.jsonl`` files, or one such
    file whose first line has verl's keys (and no ``"rewards"``, which marks grouprl's format).
    """
    path = Path(path)
    if path.is_file():
        if path.suffix == ".parquet":
            return "trl"
        if VERL_FILE.match(path.name) and _looks_like_verl_line(path):
            return "verl"
        return None
    if not path.is_dir():
        return None
    if _trl_files(path):
        return "trl"
    files = _numbered(path, VERL_FILE)
    if files and _looks_like_verl_line(files[0]):
        return "verl"
    return None


# --------------------------------------------------------------------------- TRL
def _read_parquet(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: reading TRL's completions needs pyarrow (installed with TRL): "
            "pip install pyarrow"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises its own error types for a bad file
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    return list(table.column_names), table.to_pylist()


def _trl_reward_columns(names: Sequence[str], rows: list[dict], path: Path) -> list[str]:
    """TRL's reward-function columns: the numeric columns between ``completion`` and
    ``advantage`` (TRL writes the reward columns, then the ``log_extra`` ones, there)."""
    missing = [c for c in TRL_FIXED_COLUMNS if c not in names]
    if missing:
        raise ValueError(
            f"{path}: missing TRL column(s) {', '.join(missing)}; expected the table "
            "GRPOTrainer writes with log_completions=True (step, prompt, completion, <reward "
            "functions>, advantage)"
        )
    between = names[names.index("completion") + 1 : names.index("advantage")]

    def numeric(col: str) -> bool:
        values = [r[col] for r in rows if r[col] is not None]
        return bool(values) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        )

    cols = [c for c in between if numeric(c)]
    if not cols:
        raise ValueError(
            f"{path}: no numeric reward column between 'completion' and 'advantage'; name "
            "them with --reward-columns"
        )
    return cols


def _trl_batch(
    path: Path,
    names: list[str],
    rows: list[dict],
    cols: list[str],
    weights: list[float],
    correct: str | None = None,
) -> Iterator[_Sample | tuple[int, str]]:
    unknown = [c for c in cols if c not in names]
    if unknown:
        raise ValueError(f"{path.name}: no reward column {', '.join(unknown)} (has {names})")
    for no, row in enumerate(rows, 1):
        try:
            values = [_as_reward(row[c]) for c in cols]
            step = row["step"]
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"step {step!r} is not an integer")
        except ValueError as err:
            yield no, f"{path.name} row {no}: {err}"
            continue
        scored = [(w, v) for w, v in zip(weights, values) if not math.isnan(v)]
        # TRL: weighted nansum; a row where every reward function returned None is NaN
        reward = sum(w * v for w, v in scored) if scored else math.nan
        ok = math.nan
        if correct is not None and isinstance(row.get(correct), (int, float)):
            ok = float(row[correct])
        yield _Sample(step, _prompt_key(row["prompt"]), reward, ok)


def _batch_signature(rows: list[dict], cols: list[str]) -> str:
    return json.dumps(
        [(r["prompt"], r["completion"], [r.get(c) for c in cols]) for r in rows],
        sort_keys=True,
        default=str,
    )


def _correct_column(names: Sequence[str], cols: Sequence[str], given: str | None, where: Path):
    """The correctness column: ``given`` (must exist), or the one reward column of several
    named like a correctness score; None when the reward is one function (it is then the
    correctness itself) or none is so named."""
    if given is not None:
        if given not in names:
            raise ValueError(f"{where}: no column {given!r} for --correct-key (has {list(names)})")
        return given
    named = [c for c in cols if is_correct_name(c)]
    return named[0] if len(cols) > 1 and named else None


def load_trl(
    path: str | Path,
    reward_columns: Sequence[str] | None = None,
    reward_weights: Sequence[float] | None = None,
    correct: str | None = None,
) -> ExternalGroups:
    """Groups from TRL's ``completions_<step>.parquet`` files (a file, ``completions/`` or
    TRL's ``output_dir``).

    ``reward_columns``: the reward-function columns (default: the numeric columns between
    ``completion`` and ``advantage``); ``reward_weights``: ``GRPOConfig.reward_weights`` in the
    same order (default 1 each); ``correct``: the column holding the verifier's correctness
    (default: a reward column named in :data:`CORRECT_NAMES`, when there are several). A file
    whose rows repeat the previous file's (TRL logs its
    latest generation batch at every logging step, so a batch trained on for several steps is
    logged several times) is skipped, with a note.
    """
    path = Path(path)
    files = _trl_files(path)
    if not files:
        raise ValueError(f"{path}: no completions_<step>.parquet (TRL log_completions=True)")
    out, notes = _Collector(), []
    cols: list[str] | None = list(reward_columns) if reward_columns else None
    weights: list[float] = []
    ok_col: str | None = None
    previous = None
    for f in files:
        names, rows = _read_parquet(f)
        if not rows:
            notes.append(f"{f.name}: empty, skipped")
            continue
        if cols is None:
            cols = _trl_reward_columns(names, rows, f)
        if ok_col is None:
            ok_col = _correct_column(names, cols, correct, f)
            if ok_col is not None:
                notes.append(f"verified correctness = {ok_col!r} (reward_hacking rule)")
        if not weights:
            weights = [1.0] * len(cols) if reward_weights is None else list(reward_weights)
            if len(weights) != len(cols):
                raise ValueError(
                    f"{len(weights)} reward weight(s) for {len(cols)} reward column(s) "
                    f"({', '.join(cols)}): give one weight per column"
                )
            notes.append(
                "TRL reward = "
                + " + ".join(f"{w:g}·{c}" for w, c in zip(weights, cols))
                + " (nansum; NaN where every function returned None)"
            )
        signature = _batch_signature(rows, cols)
        if signature == previous:
            notes.append(f"{f.name} repeats the previous file's generation batch: skipped")
            continue
        previous = signature
        for item in _trl_batch(f, names, rows, cols, weights, ok_col):
            if isinstance(item, _Sample):
                out.add(item)
            else:
                out.error(*item)
    return out.build(path, "trl", notes)


# --------------------------------------------------------------------------- verl
def _verl_lines(
    files: Iterable[Path], score_key: str, correct: str | None = None
) -> Iterator[_Sample | tuple[int, str]]:
    for f in files:
        try:
            lines = list(jsonl_lines(f))
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{f}: cannot read ({err})") from None
        for no, obj, error in lines:
            try:
                if error is not None:
                    raise ValueError(error)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
                missing = [k for k in ("input", "step", score_key) if k not in obj]
                if missing:
                    raise ValueError(f"no {', '.join(missing)}")
                step = obj["step"]
                if isinstance(step, bool) or not isinstance(step, int):
                    raise ValueError(f"step {step!r} is not an integer")
                ok = obj.get(correct) if correct is not None else None
                ok = float(ok) if isinstance(ok, (int, float)) else math.nan
                yield _Sample(step, _prompt_key(obj["input"]), _as_reward(obj[score_key]), ok)
            except ValueError as err:
                yield no, f"{f.name} line {no}: {err}"


def load_verl(
    path: str | Path, score_key: str = "score", correct: str | None = None
) -> ExternalGroups:
    """Groups from verl's ``rollout_data_dir`` (a folder of ``<step>.jsonl``, or one file).

    ``score_key``: the field holding the reward (default verl's ``score``; a reward manager's
    extra info, e.g. ``acc``, can be read instead). ``correct``: the extra info holding the
    verifier's correctness (default: the first line's field named in :data:`CORRECT_NAMES`).
    """
    path = Path(path)
    files = [path] if path.is_file() else _numbered(path, VERL_FILE) if path.is_dir() else []
    if not files:
        raise ValueError(f"{path}: no <step>.jsonl files (verl trainer.rollout_data_dir)")
    out = _Collector()
    notes = [f"verl reward = '{score_key}' of each line ({len(files)} file(s))"]
    if correct is None:
        first = _first_object(files[0]) or {}
        correct = next((k for k in first if is_correct_name(k) and k != score_key), None)
    if correct is not None:
        notes.append(f"verified correctness = {correct!r} (reward_hacking rule)")
    for item in _verl_lines(files, score_key, correct):
        if isinstance(item, _Sample):
            out.add(item)
        else:
            out.error(*item)
    return out.build(path, "verl", notes)


SOURCES = {"trl": load_trl, "verl": load_verl}
"""Source name -> reader."""


def load(
    path: str | Path,
    source: str | None = None,
    *,
    reward_columns: Sequence[str] | None = None,
    reward_weights: Sequence[float] | None = None,
    correct: str | None = None,
) -> ExternalGroups:
    """Read ``path`` with the reader of ``source`` (default: :func:`detect`); the reward
    columns and weights are TRL's (given for a verl log, they are an error); ``correct``
    names the verifier's correctness column (TRL) or extra info (verl)."""
    source = source or detect(path)
    if source not in SOURCES:
        raise ValueError(
            f"{path}: not a TRL completions log (completions_<step>.parquet) or a verl "
            "rollout_data_dir (<step>.jsonl)"
        )
    if source == "trl":
        return load_trl(path, reward_columns, reward_weights, correct)
    if reward_columns is not None or reward_weights is not None:
        raise ValueError(
            f"--reward-columns / --reward-weights apply to TRL logs; {path} is a {source} log "
            "(its 'score' is already the combined reward)"
        )
    return load_verl(path, correct=correct)


# --------------------------------------------------------------------------- mismatch metrics
@dataclass
class MismatchLog:
    """Logged rollout-vs-trainer mismatch metrics of a run, in our key names
    (:func:`grouprl.diagnostics.mismatch.from_peer_log`): ``rows`` = ``[{step, mismatch/*,
    corr/*}]``; ``metrics_only`` when ``path`` is a metrics file with no reward groups."""

    source: str
    path: Path
    rows: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics_only: bool = False


VERL_NO_LOGPROBS = (
    "verl's rollout_data_dir holds no log-probs, so no mismatch metrics: run verl with "
    "trainer.logger=[console,file] and pass its file logger's <experiment>.jsonl "
    "(VERL_FILE_LOGGER_ROOT/<project>/) to read its rollout_corr/* metrics"
)
TRL_NO_LOGPROBS = (
    "TRL's completions log holds no log-probs, and no trainer_state.json was found next to it "
    "(TRL writes one into each checkpoint-<step>/): its sampling/* mismatch metrics are only in "
    "your logger (W&B, TensorBoard)"
)


def _is_verl_metrics_file(path: Path) -> bool:
    """A verl ``FileLogger`` JSONL: every line ``{"step": n, "data": {metric: value}}``."""
    if not path.is_file() or path.suffix != ".jsonl":
        return False
    obj = _first_object(path)
    return obj is not None and "step" in obj and isinstance(obj.get("data"), dict)


def _trl_state(path: Path) -> Path | None:
    """``trainer_state.json`` of a TRL output_dir: its own, or the newest checkpoint's."""
    if path.is_file():
        return path if path.name == "trainer_state.json" else None
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    ckpts = [p for p in path.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    for ckpt in sorted(ckpts, key=lambda p: int(p.name.split("-")[-1]), reverse=True):
        if (ckpt / "trainer_state.json").is_file():
            return ckpt / "trainer_state.json"
    return None


def health_from_peer_log(
    source: str, metrics: dict[str, Any], correct: str | None = None
) -> dict[str, float]:
    """One logged step of ``source`` (``"trl"``, ``"verl"``) in the names the health rules
    read (:data:`HEALTH_PEER_KEYS`); TRL's ``rewards/<correct>/mean`` (default: the function
    named in :data:`CORRECT_NAMES`, when the run has several) as ``reward/correct_mean``."""
    names = HEALTH_PEER_KEYS.get(source, {})
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in names and isinstance(value, int | float) and not isinstance(value, bool):
            out[names[key]] = float(value)
    if source == "trl":
        funcs = [k[len("rewards/") : -len("/mean")] for k in metrics if _TRL_FUNC.match(k)]
        pick = correct
        if pick is None and len(funcs) > 1:
            pick = next((f for f in funcs if is_correct_name(f)), None)
        value = metrics.get(f"rewards/{pick}/mean") if pick is not None else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            out["reward/correct_mean"] = float(value)
    return out


_TRL_FUNC = re.compile(r"^rewards/(.+)/mean$")


def _mismatch_rows(
    source: str, steps: Iterable[tuple[int, dict]], correct: str | None = None
) -> list[dict[str, float]]:
    from grouprl.diagnostics.mismatch import from_peer_log

    rows = []
    for step, metrics in steps:
        ours = from_peer_log(source, metrics)
        if source != "grouprl":
            ours.update(health_from_peer_log(source, metrics, correct))
        if ours:
            rows.append({"step": float(step), **ours})
    return rows


def load_mismatch(path: str | Path, correct: str | None = None) -> MismatchLog | None:
    """The mismatch metrics (and, for TRL / verl, the health rules' metrics,
    :func:`health_from_peer_log`) ``path`` holds: a grouprl run folder (``metrics.jsonl``), a TRL
    output_dir or ``trainer_state.json`` (``log_history``), a verl file-logger JSONL. For a
    TRL / verl rollout log without them, a log with no rows and a note saying where they are.
    None when ``path`` is none of these."""
    path = Path(path)
    if _is_verl_metrics_file(path):
        lines = read_jsonl(path)  # a torn last line is skipped
        steps = ((int(o["step"]), o["data"]) for o in lines if isinstance(o, dict))
        return MismatchLog("verl", path, _mismatch_rows("verl", steps, correct), metrics_only=True)
    if path.is_dir() and (path / "metrics.jsonl").is_file():
        rows = {  # by step, the last row of a repeated step winning (report.read_metrics)
            int(r["step"]): r
            for r in read_jsonl(path / "metrics.jsonl")
            if isinstance(r, dict) and isinstance(r.get("step"), int)
        }
        steps = ((step, rows[step]) for step in sorted(rows))
        return MismatchLog("grouprl", path / "metrics.jsonl", _mismatch_rows("grouprl", steps))
    state = _trl_state(path) if path.exists() else None
    if state is not None:
        history = json.loads(state.read_text()).get("log_history", [])
        steps = ((int(h.get("step", 0)), h) for h in history if isinstance(h, dict))
        only = path.is_file() or detect(path) is None  # no completions log beside it
        rows = _mismatch_rows("trl", steps, correct)
        return MismatchLog("trl", state, rows, metrics_only=only)
    source = detect(path)
    if source == "trl":
        return MismatchLog("trl", path, notes=[TRL_NO_LOGPROBS])
    if source == "verl":
        return MismatchLog("verl", path, notes=[VERL_NO_LOGPROBS])
    return None
