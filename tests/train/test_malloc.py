"""train.malloc: glibc's mmap threshold fixed for the process, and what it does to freed memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grouprl.train import malloc
from grouprl.train.config import ConfigError, load_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

PROBE = """
import ctypes, sys
from grouprl.train import malloc
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
if sys.argv[1] == "set":
    assert malloc.map_large_blocks(128 * 1024)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
big = libc.malloc(16 << 20); libc.free(big)  # by default the threshold now grows to 16 MiB
blocks = [libc.malloc(4 << 20) for _ in range(64)]  # 256 MiB in 4 MiB blocks
fence = libc.malloc(64)  # a live block after them: the heap cannot shrink from its top
for b in blocks:
    ctypes.memset(b, 1, 4 << 20)
before = rss()
for b in blocks:
    libc.free(b)
if sys.argv[1] == "trim":
    assert malloc.release_free_memory()
print(before - rss())
"""


def _returned_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_go_back_to_the_os_only_with_the_fixed_threshold():
    # glibc's default: a freed mapped block raises the threshold (here to 32 MiB, its cap), so
    # later 4 MiB blocks live in the heap and their memory stays with the process when freed
    assert _returned_mib("default") < 64
    assert _returned_mib("set") > 240  # ~256 MiB handed back


def test_release_free_memory_hands_back_free_heap_blocks_below_a_live_one():
    # the default threshold keeps the 4 MiB blocks in the heap, under the live fence, where
    # trimming the heap's top cannot reach them: malloc_trim(0) releases their pages
    assert _returned_mib("trim") > 240


def test_bad_values_do_nothing_and_the_config_checks_the_range():
    assert not malloc.map_large_blocks(0)
    assert not malloc.map_large_blocks(-5)
    with pytest.raises(ConfigError, match="mmap_threshold_kib"):
        load_config(None, ["run.mmap_threshold_kib=65536"])
    assert load_config(None, ["run.mmap_threshold_kib=0"]).run.mmap_threshold_kib == 0
