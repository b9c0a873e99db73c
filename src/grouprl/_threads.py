"""How many CPU threads a run uses when ``run.threads`` is 0 (auto), and telling OpenMP.

Auto is one thread per physical core this process may run on (its affinity mask; hyperthread
siblings counted once), torch's own rule, and nothing that changes from one minute to the
next: the thread count decides how torch splits its float reductions, so a count that
followed the machine's load would give the same command and seed different numbers on a
busy machine than on an idle one [OURS]. The same command and seed on the same machine give
the same numbers at any load (``tests/test_threads.py`` runs one beside a busy process).

:func:`tell_openmp` puts the choice in ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` before torch
is imported (the command line does it), so its thread pools start at that size, and sets
``OMP_WAIT_POLICY=PASSIVE``: an OpenMP thread that waits sleeps instead of spinning, which is
what keeps every core's thread usable on cores that other processes keep busy (a spinning
waiter can cost a step 50x on a shared machine: docs/training.md, "Threads") [OURS].
A value the user set for any of the three is kept, and auto then follows
``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["WAIT_POLICY", "available_cores", "choose_threads", "physical_cores", "tell_openmp"]


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def physical_cores(sysfs: str | Path = "/sys/devices/system/cpu") -> int:
    """The physical cores among the CPUs this process may run on: distinct
    ``(physical_package_id, core_id)`` pairs in ``sysfs``; :func:`available_cores` where the
    topology cannot be read (not Linux, a sandbox without ``/sys``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return available_cores()
    cores = set()
    try:
        for cpu in cpus:
            topo = Path(sysfs) / f"cpu{cpu}" / "topology"
            package = (topo / "physical_package_id").read_text().strip()
            cores.add((package, (topo / "core_id").read_text().strip()))
    except OSError:
        return available_cores()
    return max(1, len(cores))


def choose_threads(requested: int, *, cap: int | None = None) -> tuple[int, str]:
    """The thread count for ``run.threads = requested`` and why, in words for the run's log.

    ``requested > 0`` is taken as it is. 0 (auto): ``OMP_NUM_THREADS`` when the user set it,
    else :func:`physical_cores`, at most ``cap`` (torch's own count when the caller knows it).
    Neither depends on the machine's load.
    """
    if requested > 0:
        return requested, "run.threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "auto: OMP_NUM_THREADS"
    n = physical_cores()
    if cap is not None and cap < n:
        return max(1, cap), f"auto: {n} physical cores, torch's count {cap}"
    return n, f"auto: {n} physical core{'s' if n != 1 else ''}"


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
