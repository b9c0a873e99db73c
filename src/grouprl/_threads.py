"""How many CPU threads a run uses when ``run.threads`` is 0 (auto), and telling OpenMP.

torch's own default is one thread per physical core. On cores that other processes already
keep busy that is the worst choice: every parallel region waits for a thread the scheduler
has not run yet. Measured on the maze miniature, 20 steps on 2 cores: idle, 11 s
at two threads and 12 s at one; beside four busy processes, 105 s at two and 37 s at one.
So auto takes the cores that the load average leaves free, at least one, at most torch's
count: all of them on an idle laptop, one on a shared machine [OURS].

:func:`tell_openmp` puts the choice in ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` before torch
is imported (the command line does it), so its thread pools start at that size, and sets
``OMP_WAIT_POLICY=PASSIVE``: an OpenMP thread that waits sleeps instead of spinning. Spinning
is what made two threads so slow on busy cores: at a load average of ~25 on the same 2 cores
(nice 10), 20 steps took 2.8 s a step at one thread and 107 s a step at two (11 steps
measured), and 5 steps at two with ``PASSIVE`` 2.0 s a step [OURS]. A value the
user set for any of the three is kept, and auto then follows ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import math
import os

__all__ = ["WAIT_POLICY", "auto_threads", "available_cores", "choose_threads", "tell_openmp"]


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def auto_threads(cores: int, load: float, cap: int | None = None) -> int:
    """``max(1, min(cap, floor(cores − load + ½)))``: the cores the load average leaves free,
    rounded, between 1 and ``cap`` (default ``cores``)."""
    free = math.floor(cores - max(0.0, load) + 0.5)
    return max(1, min(cap if cap is not None else cores, free))


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not available: assume an idle machine
        return 0.0


def choose_threads(requested: int, *, cap: int | None = None) -> tuple[int, str]:
    """The thread count for ``run.threads = requested`` and why, in words for the run's log.

    ``requested > 0`` is taken as it is. 0 (auto): ``OMP_NUM_THREADS`` when the user set it,
    else :func:`auto_threads` of this machine's cores and 1-minute load average, capped at
    ``cap`` (torch's own default, one per physical core, when the caller knows it).
    """
    if requested > 0:
        return requested, "run.threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "auto: OMP_NUM_THREADS"
    cores, load = available_cores(), _load()
    n = auto_threads(cores, load, cap)
    return n, f"auto: {cores} cores, load average {load:.1f}"


WAIT_POLICY = "PASSIVE"
"""What :func:`tell_openmp` sets ``OMP_WAIT_POLICY`` to (module docstring)."""


def tell_openmp(requested: int) -> tuple[int, str]:
    """Before torch is imported: set ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` to the
    choice for ``requested`` and ``OMP_WAIT_POLICY`` to ``PASSIVE``, each unless the user set
    it; returns :func:`choose_threads`'s ``(count, why)``."""
    n, why = choose_threads(requested)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(n))
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return n, why
