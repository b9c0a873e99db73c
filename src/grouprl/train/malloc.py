"""Give freed tensor memory back to the operating system (glibc's ``mallopt``).

PyTorch's CPU tensors come from ``malloc``. glibc maps a block of at least
``M_MMAP_THRESHOLD`` bytes on its own, and returns it to the OS when it is freed; smaller
blocks come from the heap, which keeps freed memory for reuse. The threshold starts at 128 KiB
but *grows* to the size of each mapped block freed, up to 32 MiB (``mallopt(3)``, "dynamic
mmap threshold"): after the first training step, activations and logits of a few MiB each are
carved from the heap, and a heap that served the rollouts' KV cache, then the training
forward's activations, holds the high-water mark of both. Setting the threshold fixes it (the
dynamic adjustment stops): every block of that size or more is mapped and unmapped, so the
resident memory follows the live tensors.

[OURS, measured: docs/results.md, "Peak memory, where it goes"] on SmolLM2-135M a fixed
128 KiB threshold takes the heap's retention off the peak, at the price of page faults: every
freed block of that size or more is unmapped and faults again on its next use. That pays on a
real LM, where the blocks are large and few, and costs a small model of many small tensors far
more time than memory, so ``run.mmap_threshold_kib`` is 0 (nothing set) by default and 128 in
the ``pretrained`` profile.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

__all__ = [
    "M_MMAP_THRESHOLD",
    "M_TRIM_THRESHOLD",
    "keep_freed_blocks",
    "map_large_blocks",
    "release_free_memory",
]

M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter number of the mmap threshold (glibc ``malloc.h``)."""

M_TRIM_THRESHOLD = -1
"""``mallopt`` parameter number of the trim threshold (glibc ``malloc.h``)."""

MAX_MMAP_THRESHOLD = 32 << 20
"""The largest mmap threshold glibc accepts on 64-bit (``mallopt(3)``: HEAP_MAX / 2)."""


@functools.cache
def _libc_handle() -> Any:
    """The C library, loaded once (``find_library`` runs ``ldconfig`` in a subprocess: a
    millisecond or more, too much to repeat before every training forward); None where
    there is none to load (not Linux, a sandbox without libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _libc(name: str, argtypes: list, restype: Any) -> Any:
    """glibc's function ``name`` with its C signature, or None (not Linux, no such libc or
    function: musl, a sandbox without libc)."""
    libc = _libc_handle()
    fn = None if libc is None else getattr(libc, name, None)
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def map_large_blocks(threshold_bytes: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` for this process; True when set.

    False where there is no glibc ``mallopt`` (not Linux, musl, a sandbox without libc) or
    it refuses the value (glibc accepts at most 32 MiB on 64-bit): nothing changes then.
    """
    mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None or threshold_bytes <= 0:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))


def keep_freed_blocks(trim_bytes: int = 1 << 30) -> bool:
    """The other way round from :func:`map_large_blocks`: blocks below 32 MiB come from the
    heap and what is freed stays there (up to ``trim_bytes`` free at its top) for the next
    allocation, so a tensor of a size freed before faults no page in. True when set.

    What a long-lived process reaches on its own once its freed blocks have raised glibc's
    dynamic threshold to its cap, without the trims that come and go with its history;
    ``benchmarks/advantages.py --malloc keep`` times both sides in this state [OURS].
    """
    mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None or trim_bytes <= 0:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, int(trim_bytes))
    )


def release_free_memory() -> bool:
    """Give the pages of every free heap block back to the OS (glibc ``malloc_trim(0)``,
    which since glibc 2.8 also releases whole free pages inside the heap, not only its top);
    True when called. A block used again later faults its pages in once more.

    Called before each training forward (``grouprl.train.policy.Policy.logprobs``): what the
    heap kept from the rollouts and the previous micro-batch is then not resident while the
    new micro-batch's activations and gradients are."""
    trim = _libc("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    if trim is None:
        return False
    trim(0)
    return True
