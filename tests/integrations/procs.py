"""Run an end-to-end command bounded in time, and leave nothing behind when it overruns.

``subprocess.run(timeout=...)`` kills only the child; torchrun's workers and the Ray daemons
``main_ppo`` starts would outlive it. The command gets its own session here, and on timeout the
whole process group is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def run_bounded(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a new session; on timeout,
    SIGKILL to its process group, then :class:`subprocess.TimeoutExpired` with the output."""
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(script: Path, out: Path, ranks: int, *, timeout: float) -> None:
    """``script OUT`` under torchrun (``ranks`` CPU processes, gloo), with this checkout's grouprl
    first on the path, one thread a process and no hub access; asserts it exited 0."""
    import grouprl

    src = str(Path(grouprl.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={ranks}", str(script), str(out)]
    res = run_bounded(cmd, env=env, timeout=timeout)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
