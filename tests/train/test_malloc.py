"""train.malloc: glibc's mmap threshold fixed for the process, and what it does to freed memory."""

from __future__ import annotations

import os
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
if sys.argv[1] == "keep":
    assert malloc.keep_freed_blocks()
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


FAULTS = """
import resource, sys, torch
from grouprl.train import malloc
if sys.argv[1] == "keep":
    assert malloc.keep_freed_blocks()
elif sys.argv[1] == "map":
    assert malloc.map_large_blocks(128 * 1024)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.rand(1 << 20)
for _ in range(3):  # warm: the heap has held blocks of these sizes
    y = (x + 1.0) * 2.0
    del y
trials = []
for _ in range(3):  # the least of three: a trial may meet a block the heap had not held
    before = faults()
    for _ in range(10):
        y = (x + 1.0) * 2.0  # two fresh 4 MiB tensors, one freed at once
        del y
    trials.append(faults() - before)
print(min(trials))
"""


def _faults(mode: str) -> int:
    # 4 KiB pages: without torch's huge-page allocations (the CLI sets them for its own
    # process, and a test before this one may have left the variable in the environment)
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True,
                         check=True, env=env)  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


def test_kept_freed_blocks_fault_no_page_in_where_mapped_ones_fault_every_page():
    # 20 fresh 4 MiB tensors: mapped and unmapped each time, ~1,024 faults apiece (4 KiB
    # pages); kept in the heap, later ones reuse freed pages (glibc's default regime does
    # either, by the process's history: 0 or ~20,000 here in four runs)
    assert _faults("map") > 18 * 1024
    assert _faults("keep") < 1024


HEAP = """
import ctypes, sys
from grouprl.train import malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_void_p], [ctypes.c_long]
if sys.argv[1] == "keep":
    assert malloc.keep_freed_blocks()
block = libc.malloc(16 << 20)
top = libc.sbrk(0)
in_heap = block < top  # below the program break: carved from the heap, not mapped
libc.free(block)
print(in_heap, libc.sbrk(0) == top)  # freed at the heap's top: kept, or trimmed away
"""


def test_kept_freed_blocks_come_from_the_heap_and_stay_there():
    # a fresh process maps a 16 MiB block (the threshold starts at 128 KiB); kept, it comes
    # from the heap and freeing it at the heap's top does not shrink the heap
    def probe(mode):
        out = subprocess.run([sys.executable, "-c", HEAP, mode], capture_output=True,
                             text=True, check=True)  # fmt: skip
        return out.stdout.split()

    assert probe("default")[0] == "False"
    assert probe("keep") == ["True", "True"]


def test_bad_values_do_nothing_and_the_config_checks_the_range():
    assert not malloc.map_large_blocks(0)
    assert not malloc.map_large_blocks(-5)
    assert not malloc.keep_freed_blocks(0)
    with pytest.raises(ConfigError, match="mmap_threshold_kib"):
        load_config(None, ["run.mmap_threshold_kib=65536"])
    assert load_config(None, ["run.mmap_threshold_kib=0"]).run.mmap_threshold_kib == 0
