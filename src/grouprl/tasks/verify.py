"""Verifiers under a timeout: an exception, a hang or a crash is a counted NaN, never a 0.

A reward that silently becomes 0 when the verifier fails drags every group baseline down
and teaches the policy to avoid whatever made the verifier fail. Here each call of
``verify_fn(completion, reference)`` runs in a forked worker process with a wall-clock
deadline; the caller gets a float reward, or NaN with the reason when the verifier raised,
hung, crashed its process, returned a non-number or a value outside ``reward_range``.
NaN rewards are excluded from group baselines by ``grouprl.advantages.compute`` and counted
in ``reward/unscorable_frac``. [OURS]

Why processes and not threads or ``signal.alarm``: math-verify's sympy simplification can
loop for minutes in pure Python or in C; a thread cannot be killed, and ``SIGALRM`` only
works on the main thread of the main interpreter (the trainer may score from a thread).
A worker process can always be killed (SIGKILL) and replaced. Workers are forked once per
batch and reused for every item in it, so the per-item cost is one pipe round trip
(tens of microseconds), not a fork. With the ``fork`` start method ``verify_fn`` and the
batch are inherited, so lambdas and closures work; where only ``spawn`` exists (Windows)
they must be picklable.

:func:`run_calls` is the machinery underneath: ``call(i)`` for ``i < n`` in the same
workers under the same deadline, returning each value or the reason it failed. The
batched reward functions of :mod:`grouprl.tasks.rewards` (one call per function per batch) use it.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = [
    "BatchScores",
    "UnscorableError",
    "failure_advice",
    "run_calls",
    "safe_verify",
    "score_batch",
]

VerifyFn = Callable[[str, Any], float]


class UnscorableError(RuntimeError):
    """Too large a share of a batch could not be scored: the run must stop, not learn from it."""


@dataclass(frozen=True)
class BatchScores:
    """Rewards of one batch (NaN = unscorable) with the count and a sample of the reasons.

    ``rewards[i]`` belongs to ``completions[i]``. ``errors`` holds at most ``max_errors``
    messages of the form ``"[i] reason"`` for the log; ``unscorable`` counts all of them.
    """

    rewards: list[float]
    unscorable: int
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    """More numbers for the log (e.g. ``reward/<function>/mean`` of batched reward functions)."""
    per_function: list[list[float]] | None = None
    """``[N][K]`` each reward function's value (NaN = None, or the whole row when the sample
    is unscorable), for a reward combination that needs them (GDPO); None: one function."""
    function_weights: tuple[float, ...] | None = None
    """``[K]`` the functions' weights, with ``per_function``."""

    @property
    def unscorable_frac(self) -> float:
        """Share of the batch that is NaN (0.0 for an empty batch)."""
        return self.unscorable / len(self.rewards) if self.rewards else 0.0

    def metrics(self) -> dict[str, float]:
        """The numbers the trainer logs each step."""
        return {
            "reward/unscorable_frac": self.unscorable_frac,
            "reward/unscorable": float(self.unscorable),
            "reward/verify_seconds": self.seconds,
            **self.extra,
        }


def _describe(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_value(value: Any, reward_range: tuple[float, float] | None) -> tuple[float, str | None]:
    """A verifier's return value as a reward, or NaN with the reason it is not one."""
    try:
        reward = float(value)
    except (TypeError, ValueError) as exc:
        return math.nan, f"verifier returned {type(value).__name__}, not a number ({exc})"
    if math.isnan(reward):
        return math.nan, "verifier returned NaN (it could not score this completion)"
    if math.isinf(reward):
        return math.nan, f"verifier returned {reward}"
    if reward_range is not None and not reward_range[0] <= reward <= reward_range[1]:
        return math.nan, f"verifier returned {reward}, outside reward_range {reward_range}"
    return reward, None


def _die_with_parent(parent: int) -> None:
    """SIGKILL this worker when the scoring process dies, even mid-verifier (Linux).

    Elsewhere the worker notices between items (its parent pid changes) and a verifier
    stuck in a loop lives on until it returns.
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(0)


def _worker_main(conn: Connection, parent: int, call: Callable[[int], Any]) -> None:
    """Run ``call(index)`` for the indices the parent sends until it sends None (in the child)."""
    # Ctrl-C reaches the whole foreground process group: leave it to the parent (which kills
    # the workers on its way out) and drop any SIGTERM handler inherited from the trainer.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent)
    while True:
        try:
            # Forked siblings inherit each other's pipe ends, so a dead parent does not
            # always mean EOF here: notice it by the parent pid changing.
            while not conn.poll(1.0):
                if os.getppid() != parent:
                    return
            index = conn.recv()
        except (EOFError, OSError):
            return
        if index is None:
            return
        try:
            value: Any = call(index)
            err = None
        except BaseException as exc:  # the verifier is untrusted: anything it raises is data
            value, err = math.nan, _describe(exc)
        try:
            conn.send((index, value, err))
        except Exception as exc:  # an unpicklable return value
            conn.send((index, math.nan, f"its result could not be sent back: {_describe(exc)}"))


class _VerifyItem:
    """``verify_fn(completions[i], references[i])`` as a picklable call of ``i`` (for spawn)."""

    def __init__(self, verify_fn: VerifyFn, completions: Sequence[str], references: Sequence[Any]):
        self.verify_fn, self.completions, self.references = verify_fn, completions, references

    def __call__(self, index: int) -> Any:
        return self.verify_fn(self.completions[index], self.references[index])


def _context() -> mp.context.BaseContext:
    """``fork`` where available (inherits unpicklable verifiers), else ``spawn``."""
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


class _Worker:
    """One verifier process and the item it is scoring."""

    def __init__(self, ctx: mp.context.BaseContext, call: Callable[[int], Any]) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, os.getpid(), call), daemon=True)
        self.proc.start()
        child.close()
        self.index: int | None = None
        self.deadline = math.inf

    def submit(self, index: int, timeout_s: float) -> None:
        self.index, self.deadline = index, time.monotonic() + timeout_s
        self.conn.send(index)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5.0)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout=1.0)
        self.kill()


def _validate(
    completions: Sequence[str],
    references: Sequence[Any],
    timeout_s: float,
    max_unscorable_frac: float,
) -> None:
    if len(completions) != len(references):
        raise ValueError(
            f"score_batch: {len(completions)} completions but {len(references)} references; "
            "pass one reference per completion (repeat each prompt's reference G times)."
        )
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"score_batch: timeout_s must be a positive number, got {timeout_s!r}.")
    if not 0.0 <= max_unscorable_frac <= 1.0:
        raise ValueError(
            f"score_batch: max_unscorable_frac must be in [0, 1], got {max_unscorable_frac!r}."
        )


def score_batch(
    verify_fn: VerifyFn,
    completions: Sequence[str],
    references: Sequence[Any],
    *,
    timeout_s: float = 10.0,
    max_unscorable_frac: float = 0.5,
    workers: int | None = None,
    reward_range: tuple[float, float] | None = None,
    max_errors: int = 5,
) -> BatchScores:
    """Score every completion with ``verify_fn`` under a per-call timeout; failures are NaN.

    Each call gets ``timeout_s`` seconds of wall time in one of ``workers`` forked
    processes (default ``min(4, cpu_count)``); a call that raises, hangs past its deadline
    (its worker is killed and replaced), kills its worker, or returns a non-finite value or
    one outside ``reward_range`` scores NaN and its reason goes into ``errors`` (first
    ``max_errors``). A verifier that itself returns NaN ("could not score", e.g. the code
    sandbox failed) is counted the same way. [OURS]

    Raises UnscorableError when the NaN share exceeds ``max_unscorable_frac``: a verifier
    that fails on most of a batch is broken, and training on the rest would be silent
    selection bias. Pass ``max_unscorable_frac=1.0`` to never stop.
    """
    _validate(completions, references, timeout_s, max_unscorable_frac)
    start = time.monotonic()
    n = len(completions)
    rewards = [math.nan] * n
    reasons: dict[int, str] = {}
    outcomes = run_calls(_VerifyItem(verify_fn, completions, references), n, timeout_s, workers)
    for i, (value, err) in enumerate(outcomes):
        rewards[i], bad = (math.nan, err) if err else _check_value(value, reward_range)
        if bad:
            reasons[i] = bad
    unscorable = sum(1 for r in rewards if math.isnan(r))
    errors = [f"[{i}] {reasons[i]}" for i in sorted(reasons)[:max_errors]]
    scores = BatchScores(rewards, unscorable, errors, time.monotonic() - start)
    if scores.unscorable_frac > max_unscorable_frac:
        raise UnscorableError(
            f"{unscorable} of {n} completions ({scores.unscorable_frac:.0%}) could not be "
            f"scored, above max_unscorable_frac={max_unscorable_frac}; first errors: "
            f"{errors}. {failure_advice('the verifier', reasons.values(), timeout_s, 'timeout_s')} "
            "before training."
        )
    return scores


def failure_advice(what: str, reasons: Iterable[str], timeout_s: float, setting: str) -> str:
    """What to do about completions that could not be scored, from why they failed.

    A call that timed out (``run_calls``' "timed out after" reason) asks for a faster
    function or a longer ``setting`` (naming its value); any other failure (an exception, a
    bad return value, a dead worker) asks to fix ``what``. A timeout is never suggested for a
    function that raised, nor when ``timeout_s`` is 0 (in-process: there is none) [OURS:
    "raise the timeout, now 0 s per call" is no advice for a reward function that raised].
    """
    reasons = list(reasons)
    timed_out = sum("timed out after" in r for r in reasons)
    parts = []
    if len(reasons) > timed_out or not reasons:
        parts.append(f"Fix {what}: see the first errors")
    if timed_out:
        parts.append(
            f"{timed_out} call(s) ran past the timeout: make {what} faster or raise {setting} "
            f"(now {timeout_s:g} s per call)"
        )
    return "; ".join(parts)


def run_calls(
    call: Callable[[int], Any],
    n: int,
    timeout_s: float,
    workers: int | None = None,
    label: str = "verifier",
) -> list[tuple[Any, str | None]]:
    """``call(i)`` for ``i < n`` in forked workers, each under ``timeout_s`` of wall time.

    Returns ``(value, None)`` for a call that returned and ``(nan, reason)`` for one that
    raised, hung past its deadline (its worker is killed and replaced) or killed its worker.
    ``workers`` defaults to ``min(4, cpu_count)``; ``label`` names the callee in the
    reasons (``"verifier timed out after 10 s"``). The values are not checked: that is the
    caller's business (``score_batch`` wants a number in range, ``grouprl.tasks.rewards`` a list).
    """
    out: list[tuple[Any, str | None]] = [(math.nan, "not run")] * n
    if not n:
        return out
    ctx = _context()
    n_workers = max(1, min(workers or min(4, os.cpu_count() or 1), n))
    pending = deque(range(n))
    idle: list[_Worker] = []
    busy: dict[Connection, _Worker] = {}
    spawned = 0
    retried: set[int] = set()
    try:
        while pending or busy:
            while pending and (idle or spawned < n_workers):
                if idle:
                    worker = idle.pop()
                else:
                    worker, spawned = _Worker(ctx, call), spawned + 1
                index = pending.popleft()
                try:
                    worker.submit(index, timeout_s)
                except OSError:  # it died between two items: replace it, retry the item
                    worker.kill()
                    spawned -= 1
                    if index in retried:
                        out[index] = (math.nan, f"{label} process died before it took the item")
                    else:
                        retried.add(index)
                        pending.appendleft(index)
                    continue
                busy[worker.conn] = worker
            now = time.monotonic()
            next_deadline = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - now)):
                worker = busy.pop(conn)
                try:
                    index, value, err = conn.recv()
                except (EOFError, OSError):
                    worker.kill()
                    spawned -= 1
                    out[worker.index] = (
                        math.nan,
                        f"{label} process died (exit code {worker.proc.exitcode})",
                    )
                    continue
                out[index] = (value, err)
                idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now >= worker.deadline:
                    del busy[conn]
                    worker.kill()
                    spawned -= 1
                    out[worker.index] = (math.nan, f"{label} timed out after {timeout_s:g} s")
    finally:
        for worker in idle + list(busy.values()):
            worker.stop()
    return out


def safe_verify(
    verify_fn: VerifyFn,
    completion: str,
    reference: Any,
    *,
    timeout_s: float = 10.0,
    reward_range: tuple[float, float] | None = None,
) -> float:
    """One verifier call under a timeout in a forked process: the reward, or NaN on failure.

    Costs a fork per call; score many completions with ``score_batch`` instead.
    """
    scores = score_batch(
        verify_fn,
        [completion],
        [reference],
        timeout_s=timeout_s,
        max_unscorable_frac=1.0,
        workers=1,
        reward_range=reward_range,
    )
    return scores.rewards[0]
