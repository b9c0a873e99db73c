"""Run an end-to-end command bounded in time, and leave nothing behind when it overruns.

``subprocess.run(timeout=...)`` kills only the child; torchrun's workers and the Ray daemons
``main_ppo`` starts would outlive it. The command gets its own session here, and on timeout the
whole process group is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess


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
