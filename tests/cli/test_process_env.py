"""The command line sets PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` for its own process, before
torch's first allocation, unless the caller set it; the library sets nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl import cli

HUGE = """
{setup}
import torch
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched: faulted in by the kernel
huge_kib = sum(int(line.split()[1]) for line in open("/proc/self/smaps")
               if line.startswith("AnonHugePages:"))
print(huge_kib // 1024)
"""
"""Prints the MiB of the process's memory on transparent huge pages after a 64 MiB tensor is
written: ~64 when torch's huge-page placement is on (it ``madvise``s such blocks), ~0 otherwise
where the kernel gives huge pages only on request."""

THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _kernel_thp_mode() -> str:
    try:
        text = Path(THP_MODE).read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1 : text.index("]")]


def _huge_mib(setup: str, env_thp: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_thp is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_thp
    code = HUGE.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


def test_the_command_line_sets_the_variable_unless_the_caller_did(monkeypatch, capsys):
    assert cli.PROCESS_ENV == {"THP_MEM_ALLOC_ENABLE": "1"}
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert cli.main(["list", "presets"]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert cli.main(["list", "presets"]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
    capsys.readouterr()


@pytest.mark.skipif(
    _kernel_thp_mode() != "madvise",
    reason=f"the kernel gives huge pages on request only in THP mode madvise ({THP_MODE})",
)
def test_it_takes_effect_in_the_process_and_only_through_the_command_line():
    # torch reads the variable once, at its first CPU allocation: the command line must set it
    # before any (grouprl.cli imports no torch), and importing the library must not set it
    via_cli = "from grouprl.cli import main; main(['list', 'presets'])"
    assert _huge_mib("", "1") >= 32  # the control: torch's own switch does this
    assert _huge_mib(via_cli, None) >= 32
    assert _huge_mib("import grouprl.advantages, grouprl.train.config", None) < 8
    assert _huge_mib(via_cli, "0") < 8  # the caller's choice wins
