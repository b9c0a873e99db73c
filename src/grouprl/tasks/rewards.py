"""Reward functions the way TRL writes them, weighted, under a timeout; failures are counted NaN.

    from grouprl.tasks.rewards import Rewards, load_reward
    rewards = Rewards([correct, "my_rewards.py:format_reward"], weights=[1.0, 0.1])
    scores = rewards.score(batch, timeout_s=10.0)     # BatchScores: rewards [N], NaN = unscorable

**The contract** (TRL 1.16, ``GRPOTrainer._calculate_rewards``, trl/trainer/grpo_trainer.py):
a reward function is called once per batch with keyword arguments ``prompts`` (the
prompt column: text, or a list of ``{role, content}`` messages), ``completions`` (decoded
text, or ``[{"role": "assistant", "content": text}]`` when the prompts are messages),
``completion_ids`` (token ids of each completion), ``trainer_state`` (TRL passes
``transformers.TrainerState``: ``global_step``, ``max_steps``), ``log_metric(name, value)``,
and every other dataset column as a list (TRL leaves out ``prompt``, ``completion`` and
``completion_ids``). It returns one value per completion: a number, or None when the
function does not apply to that sample. Async functions are awaited.

**Combining** several functions with weights ``w`` (TRL's ``reward_weights``, default all 1)
follows TRL's ``multi_objective_aggregation="sum_then_normalize"``
(grpo_trainer.py, ``_generate_and_score_completions``): None becomes NaN, the reward is
``nansum_k(w_k · r_k)``, and a sample for which *every* function returned None is
unscorable (NaN), never a 0. A NaN returned by a function is read as None, as in TRL.
TRL's other mode, ``normalize_then_sum``, is an advantage estimator's business here (the
preset's estimator normalises the combined reward), so it is not offered.

**Failures** [OURS]: TRL lets an exception stop training. Here a function that raises,
hangs past ``timeout_s`` (each call runs in a forked worker of
:func:`grouprl.tasks.verify.run_calls`, the verifiers' machinery), kills its worker,
returns something that is not a list of numbers, a list of the wrong length or an infinite
value makes the samples it should have scored **unscorable (NaN)**, counted in
``reward/unscorable_frac`` like a crashed verifier, with the reason in the log; more than
``max_unscorable_frac`` of a batch stops the run (``UnscorableError``). A function that
raises on the whole batch is called again on each completion alone, so one bad completion
costs one NaN, not the batch. A failed sample is NaN even when other functions scored it:
a weighted sum with a silently missing term would be a different reward.

Functions that do not take ``**kwargs`` get only the arguments they name [OURS: TRL
passes everything and such a function fails there]; a function that names an argument
nobody passes (a column the dataset lacks) is an error before training.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from grouprl.tasks.verify import BatchScores, UnscorableError, failure_advice, run_calls

__all__ = [
    "Outcome",
    "RewardBatch",
    "Rewards",
    "combine",
    "default_range",
    "load_reward",
    "reward_name",
    "trainer_state",
]

RewardFunc = Callable[..., Sequence[Any]]

RESERVED: tuple[str, ...] = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_metric",
)
"""Keyword arguments every reward function receives besides the dataset's columns."""

EXCLUDED_COLUMNS: tuple[str, ...] = ("prompt", "completion", "completion_ids")
"""Dataset columns TRL does not pass as keyword arguments (grpo_trainer.py,
``_calculate_rewards``: ``keys = [key for key in inputs[0] if key not in [...]]``)."""


# ---- loading ------------------------------------------------------------------------------


def _import_file(path: Path) -> Any:
    """Import a ``.py`` file as a module of its own (its folder goes first on ``sys.path``)."""
    name = "grouprl_user_" + re.sub(r"\W", "_", str(path.resolve().with_suffix("")))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward file {str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # so it can import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(
            f"reward file {str(path)!r} raised while being imported: {type(err).__name__}: {err}"
        ) from err
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def load_reward(spec: str) -> RewardFunc:
    """The function named by ``"path/to/file.py:name"`` or ``"package.module:name"``.

    Errors say what was wrong: no ``:``, a missing file, a module that does not import,
    no such name (the module's functions are listed), a name that is not callable.
    """
    module_part, sep, attr = str(spec).rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"reward {spec!r} must look like FILE.py:FUNCTION or MODULE:FUNCTION "
            "(e.g. my_rewards.py:correct)"
        )
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise ValueError(f"reward file {module_part!r} does not exist (from {spec!r})")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as err:
            raise ValueError(
                f"reward module {module_part!r} cannot be imported ({err}); give a file path "
                "(my_rewards.py:correct) or a module on PYTHONPATH"
            ) from err
    fn = getattr(module, attr, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{module_part!r} has no function {attr!r}; its functions: "
            f"{', '.join(names) or '(none)'}"
        )
    if not callable(fn):
        raise ValueError(f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn


def reward_name(fn: Any) -> str:
    """The name a function is logged under: ``__name__`` (TRL's ``reward_func_names``)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def resolve(funcs: Any) -> list[RewardFunc]:
    """A callable, a ``FILE.py:NAME`` string, or a list of them -> a list of callables."""
    items = [funcs] if callable(funcs) or isinstance(funcs, str) else list(funcs or [])
    if not items:
        raise ValueError(
            "no reward function given: pass reward_funcs=[f, ...] (Python) or "
            "--reward my_rewards.py:correct (command line)"
        )
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(load_reward(item))
        elif callable(item):
            out.append(item)
        else:
            raise ValueError(
                f"a reward function must be a callable or a 'FILE.py:NAME' string, got "
                f"{type(item).__name__}"
            )
    return out


def spec_of(fn: Any) -> str:
    """A ``module:qualname`` description of a callable (what the run's config.yaml records)."""
    module = getattr(fn, "__module__", None) or "?"
    if module.startswith("grouprl_user_"):
        module = getattr(sys.modules.get(module), "__file__", module)
    return f"{module}:{getattr(fn, '__qualname__', reward_name(fn))}"


# ---- the math -----------------------------------------------------------------------------


def check_weights(weights: Any, k: int) -> tuple[float, ...]:
    """``weights`` as K finite floats (None: all 1, TRL's default), or a ValueError."""
    if weights is None:
        return (1.0,) * k
    if isinstance(weights, str):
        weights = [w for w in re.split(r"[,\s]+", weights.strip()) if w]
    try:
        out = tuple(float(w) for w in weights)
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward weights must be numbers, got {weights!r}") from err
    if len(out) != k:
        raise ValueError(
            f"{len(out)} reward weight(s) for {k} reward function(s): give one weight per "
            "function, in the order of the functions (TRL's reward_weights)"
        )
    if not all(math.isfinite(w) for w in out):
        raise ValueError(f"reward weights must be finite, got {out}")
    return out


def default_range(weights: Sequence[float]) -> tuple[float, float]:
    """[OURS] The combined reward's range when every function returns values in [0, 1].

    ``(Σ min(w, 0), Σ max(w, 0))``: weights 1, 0.1 give (0, 1.1). What counts as correct
    (pass@k: reward >= the top) and what the F-GRPO / AVSPO transforms call success.
    """
    lo, hi = sum(min(w, 0.0) for w in weights), sum(max(w, 0.0) for w in weights)
    return (lo, hi) if hi > lo else (0.0, 1.0)


def combine(values: torch.Tensor, failed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted reward ``[N]`` of per-function rewards ``values [N, K]`` (NaN = None).

    TRL sum_then_normalize (grpo_trainer.py): ``nansum_k(w_k · r_k)``, NaN when every
    function returned None. [OURS] NaN also when any function failed on the sample
    (``failed [N, K]`` bool): a missing term would silently change the reward.
    """
    weighted = values * weights[None, :]  # [N, K], NaN where None
    total = torch.nansum(weighted, dim=1)  # [N]
    unscorable = torch.isnan(values).all(dim=1) | failed.any(dim=1)  # [N]
    return torch.where(unscorable, torch.full_like(total, math.nan), total)


# ---- one batch ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardBatch:
    """What the reward functions see for N completions (prompt-major, each prompt G times)."""

    prompts: list[Any]  # [N] text or messages
    completions: list[Any]  # [N] text or [{"role": "assistant", "content": text}]
    completion_ids: list[list[int]]  # [N]
    columns: dict[str, list[Any]] = field(default_factory=dict)  # name -> [N]

    def __len__(self) -> int:
        return len(self.completions)

    def rows(self, index: Sequence[int]) -> RewardBatch:
        """The sub-batch of rows ``index``."""
        return RewardBatch(
            [self.prompts[i] for i in index],
            [self.completions[i] for i in index],
            [self.completion_ids[i] for i in index],
            {k: [v[i] for i in index] for k, v in self.columns.items()},
        )


def trainer_state(step: int, max_steps: int) -> Any:
    """What TRL passes as ``trainer_state``: a ``transformers.TrainerState`` at this step."""
    try:
        from transformers import TrainerState
    except ImportError:  # [OURS] without transformers: the two fields reward functions read
        return SimpleNamespace(global_step=int(step), max_steps=int(max_steps))
    return TrainerState(global_step=int(step), max_steps=int(max_steps))


def _accepts(fn: Any) -> tuple[set[str] | None, set[str]]:
    """(names it accepts, or None with ``**kwargs``; names it requires)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass everything
        return None, set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        named = None
    else:
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return named, required


_NO_RETRY = ("reward function timed out", "reward function process died")
"""Reasons (from ``run_calls``) after which calling again per completion would only wait."""


class _Job:
    """Call function ``k`` on rows ``index`` (all rows when None): a picklable unit of work.

    Returns ``("ok", values, logged)`` or ``("bad", reason, logged)``; an exception of the
    function itself propagates (the worker turns it into the call's error).
    """

    def __init__(self, rewards: Rewards, batch: RewardBatch, state: Any, jobs: list) -> None:
        self.rewards, self.batch, self.state, self.jobs = rewards, batch, state, jobs

    def __call__(self, j: int) -> tuple[str, Any, dict[str, list[float]]]:
        k, index = self.jobs[j]
        batch = self.batch if index is None else self.batch.rows(index)
        logged: dict[str, list[float]] = {}

        def log_metric(name: str, value: float) -> None:
            logged.setdefault(str(name), []).append(float(value))

        kwargs = {
            "prompts": batch.prompts,
            "completions": batch.completions,
            "completion_ids": batch.completion_ids,
            "trainer_state": self.state,
            "log_metric": log_metric,
            **batch.columns,
        }
        named = self.rewards.accepts[k]
        if named is not None:
            kwargs = {key: v for key, v in kwargs.items() if key in named}
        out = self.rewards.funcs[k](**kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_await(out))
        return (*_as_list(out, len(batch)), logged)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _as_list(out: Any, n: int) -> tuple[str, Any]:
    """``("ok", [float | None] * n)`` or ``("bad", reason)`` for a function's return value."""
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().reshape(-1).tolist()
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        return "bad", f"returned {type(out).__name__}, not a list of rewards"
    values = list(out)
    if len(values) != n:
        return "bad", (
            f"returned {len(values)} rewards for {n} completions (one per completion, in the "
            "order of `completions`)"
        )
    clean: list[float | None] = []
    for v in values:
        if v is None:
            clean.append(None)
            continue
        try:
            clean.append(float(v))
        except (TypeError, ValueError):
            return "bad", f"returned a {type(v).__name__} among its rewards, not a number or None"
    return "ok", clean


@dataclass
class Outcome:
    """Per-function results of one batch: values [N, K] (NaN = None), failed [N, K], reasons."""

    values: torch.Tensor
    failed: torch.Tensor
    reasons: dict[int, str] = field(default_factory=dict)
    logged: dict[str, list[float]] = field(default_factory=dict)


class Rewards:
    """Weighted TRL-style reward functions: ``score`` a batch, ``probe`` them before training."""

    def __init__(self, funcs: Any, weights: Any = None) -> None:
        self.funcs = resolve(funcs)
        self.weights = check_weights(weights, len(self.funcs))
        names = [reward_name(f) for f in self.funcs]
        self.names = [n if names.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(names)]
        sigs = [_accepts(f) for f in self.funcs]
        self.accepts = [named for named, _ in sigs]
        self.requires = [required for _, required in sigs]

    def weight_tensor(self) -> torch.Tensor:
        """The weights ``[K]`` as a float64 CPU tensor (for :func:`combine`)."""
        return torch.tensor(self.weights, dtype=torch.float64, device="cpu")

    def check_columns(self, columns: Sequence[str]) -> None:
        """Every argument a function requires is passed: a reserved name or a column."""
        available = set(RESERVED) | set(columns)
        for name, required in zip(self.names, self.requires):
            missing = sorted(required - available)
            if missing:
                raise ValueError(
                    f"reward function {name!r} needs argument(s) {missing}, which are neither "
                    f"dataset columns ({', '.join(sorted(columns)) or 'none'}) nor what every "
                    f"reward function gets ({', '.join(RESERVED)}); rename the argument or add "
                    "the column"
                )

    def _run(self, batch: RewardBatch, state: Any, jobs: list, timeout_s: float) -> list:
        call = _Job(self, batch, state, jobs)
        if timeout_s > 0:
            return run_calls(call, len(jobs), timeout_s, label="reward function")
        out = []
        for j in range(len(jobs)):  # in this process: no timeout, an exception is a failure
            try:
                out.append((call(j), None))
            except Exception as err:
                out.append((math.nan, f"{type(err).__name__}: {err}"[:300]))
        return out

    def evaluate(self, batch: RewardBatch, state: Any, timeout_s: float) -> Outcome:
        """Every function on ``batch``: per-function values, failures and their reasons."""
        n, k = len(batch), len(self.funcs)
        # the functions' lists become host tensors: bookkeeping on the CPU whatever the
        # default device (the trainer moves the combined rewards to the policy's device)
        values = torch.full((n, k), math.nan, dtype=torch.float64, device="cpu")  # [N, K]
        failed = torch.zeros((n, k), dtype=torch.bool, device="cpu")  # [N, K]
        outcome = Outcome(values, failed)
        results = self._run(batch, state, [(i, None) for i in range(k)], timeout_s)
        retry = []
        for f, (result, err) in enumerate(results):
            if err is not None and not err.startswith(_NO_RETRY):
                retry.append(f)  # it raised: try each completion alone
                continue
            self._record(outcome, f, range(n), result, err)
        if retry and n > 1:
            jobs = [(f, [i]) for f in retry for i in range(n)]
            for (f, index), (result, err) in zip(jobs, self._run(batch, state, jobs, timeout_s)):
                self._record(outcome, f, index, result, err)
        elif retry:
            for f in retry:
                self._record(outcome, f, range(n), math.nan, results[f][1])
        return outcome

    def _record(self, out: Outcome, f: int, rows: Sequence[int], result: Any, err: Any) -> None:
        """Write one call's result for function ``f`` on ``rows`` into ``out``."""
        if err is None and not (isinstance(result, tuple) and len(result) == 3):
            err = f"internal: unexpected result {type(result).__name__}"
        if err is None:
            status, payload, logged = result
            for key, vals in logged.items():
                out.logged.setdefault(f"{self.names[f]}/{key}", []).extend(vals)
            if status == "bad":
                err = payload
            else:
                for i, v in zip(rows, payload):
                    if v is not None and math.isinf(v):
                        out.failed[i, f] = True
                        out.reasons.setdefault(i, f"{self.names[f]}: returned {v}")
                    elif v is not None:
                        out.values[i, f] = v  # NaN stays NaN: read as None, as TRL does
                return
        for i in rows:
            out.failed[i, f] = True
            out.reasons.setdefault(i, f"{self.names[f]}: {err}")

    def score(
        self,
        batch: RewardBatch,
        *,
        state: Any = None,
        timeout_s: float = 10.0,
        max_unscorable_frac: float = 1.0,
        max_errors: int = 5,
    ) -> BatchScores:
        """The combined rewards of ``batch`` (NaN = unscorable) with counts and reasons.

        ``timeout_s > 0``: each function's call on the batch runs in a forked worker under
        that deadline; 0: in this process without a deadline. Raises ``UnscorableError``
        when more than ``max_unscorable_frac`` of the batch is NaN.
        """
        start = time.monotonic()
        n = len(batch)
        state = state if state is not None else trainer_state(0, 0)
        out = self.evaluate(batch, state, timeout_s) if n else None
        if out is None:
            return BatchScores([], 0, [], 0.0)
        weights = self.weight_tensor()  # [K]
        rewards = combine(out.values, out.failed, weights)  # [N]
        for i in torch.isnan(rewards).nonzero().flatten().tolist():
            out.reasons.setdefault(i, "every reward function returned None")
        unscorable = int(torch.isnan(rewards).sum())
        errors = [f"[{i}] {out.reasons[i]}" for i in sorted(out.reasons)[:max_errors]]
        # per function (GDPO's normalize_then_sum): an unscorable sample is NaN throughout
        parts = out.values.masked_fill(torch.isnan(rewards)[:, None], math.nan)  # [N, K]
        scores = BatchScores(
            rewards.tolist(), unscorable, errors, time.monotonic() - start, self._metrics(out),
            per_function=parts.tolist(), function_weights=tuple(weights.tolist()),
        )  # fmt: skip
        if scores.unscorable_frac > max_unscorable_frac:
            raise UnscorableError(
                f"{unscorable} of {n} completions ({scores.unscorable_frac:.0%}) could not be "
                f"scored, above max_unscorable_frac={max_unscorable_frac}; first errors: "
                f"{errors}. "
                + failure_advice(
                    "the reward function(s)",
                    out.reasons.values(),
                    timeout_s,
                    "sampling.verify_timeout_s",
                )
                + "."
            )
        return scores

    def _metrics(self, out: Outcome) -> dict[str, float]:
        """Per function: mean over the samples it scored, share of None, share failed."""
        metrics: dict[str, float] = {}
        for f, name in enumerate(self.names):
            v, bad = out.values[:, f], out.failed[:, f]  # [N]
            scored = ~torch.isnan(v) & ~bad
            metrics[f"reward/{name}/mean"] = float(v[scored].mean()) if scored.any() else math.nan
            metrics[f"reward/{name}/none_frac"] = float((torch.isnan(v) & ~bad).double().mean())
            metrics[f"reward/{name}/failed_frac"] = float(bad.double().mean())
        for key, vals in out.logged.items():  # log_metric(name, value), averaged as TRL does
            metrics[f"reward/{key}"] = sum(vals) / len(vals)
        return metrics

    def probe(self, batch: RewardBatch, timeout_s: float = 10.0) -> None:
        """Call every function once on ``batch`` and raise a ValueError on any failure.

        Run before any model loads, on the first rows with empty completions: a function
        that raises, hangs, returns a list of the wrong length or something that is not
        a list of numbers is a mistake to fix now, not a run of NaN later.
        """
        k = len(self.funcs)
        for f, (result, err) in enumerate(
            self._run(batch, trainer_state(0, 0), [(i, None) for i in range(k)], timeout_s)
        ):
            if err is None and result[0] == "bad":
                err = result[1]
            if err is not None:
                raise ValueError(
                    f"reward function {self.names[f]!r} failed on a trial call (the first "
                    f"{len(batch)} dataset row(s), empty completions) before training: {err}. "
                    "A reward function returns one number per completion (0 for a wrong or "
                    "malformed one, None where it does not apply)."
                )
