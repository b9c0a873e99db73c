"""One run per folder: an OS-level lock that a training run holds for its whole life.

``RunLock(run_dir)`` takes an exclusive, non-blocking ``flock(2)`` on
``RUN_DIR/.grouprl.lock`` and keeps it until ``release()`` or the end of the process. The
kernel drops a flock when the last descriptor of its open file is closed, which happens
on any exit, SIGKILL and crashes included, so a dead run never leaves a stale lock
[OURS: a kernel lock rather than a pid file, for that reason]. The holder writes its pid,
host, start time and command line into the file; a second run on the folder reads them
and refuses with :class:`RunFolderBusy`, naming the holder. The file stays (removing it
would let two processes lock two different files of the same name); ``release`` empties it.

Forked children (the verifier workers of ``tasks.verify``) close their copy of the
descriptor at fork (``os.register_at_fork``), so a child that outlives a killed run does
not keep the folder locked. A child closes it when it first runs, though, not at the
fork itself: a run SIGKILLed just after a fork leaves the lock held until the child is
scheduled (measured 10-45 ms on a loaded two-core machine, one kill in five;
``tests/train/test_runlock.py``). So when the lock is busy but its recorded holder is a
process of this host that no longer exists, :class:`RunLock` waits up to
``stale_wait_s`` for the lock before refusing [OURS]; a resume right after a kill then
succeeds, and a process that keeps the file open longer is named as what it is. Readers
take no lock: ``grouprl diagnose RUN_DIR`` works on a live run. The lock is per open file,
so two runs in one process also exclude each other.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["LOCK_NAME", "RunFolderBusy", "RunLock"]

LOCK_NAME = ".grouprl.lock"
"""The lock file inside a run folder."""

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""flock errors of file systems without locks (some network and FUSE mounts)."""

STALE_WAIT_S = 5.0
"""[OURS] how long a new lock waits when the recorded holder has exited but the lock is still
held (a forked child of the dead run that has not run yet, module docstring)."""

_HELD: set[int] = set()
"""Lock descriptors held by this process; closed in forked children."""


def _close_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunFolderBusy(RuntimeError):
    """Another process is training in this run folder; ``holder`` says which one."""

    def __init__(self, run_dir: Path, holder: dict[str, Any], *, holder_exited: bool = False):
        self.run_dir, self.holder = run_dir, holder
        pid, host = holder.get("pid"), holder.get("host")
        if holder_exited:
            lock = run_dir / LOCK_NAME
            super().__init__(
                f"run folder {run_dir} is locked, but the run that took the lock (pid {pid}) "
                f"has exited: a process it started still has {lock} open. Find it with "
                f"`fuser -v {lock}` (or `lsof {lock}`), stop it, and run again."
            )
            return
        if pid is None:
            who = "another process (it has not written its details yet)"
            stop = "stop that run"
        else:
            here = host == socket.gethostname()
            who = f"pid {pid} on {'this host' if here else 'host'} {host}"
            if holder.get("started"):
                who += f", started {holder['started']}"
            if holder.get("command"):
                who += f" ({holder['command']})"
            stop = f"stop it (kill {pid}{'' if here else f' on {host}'})"
        super().__init__(
            f"run folder {run_dir} is in use by {who}. Two runs in one folder overwrite each "
            f"other's metrics and checkpoints. Wait for it to finish, {stop}, or pass "
            "another --out."
        )


class RunLock:
    """An exclusive lock on a run folder, taken at construction (context manager)."""

    def __init__(self, run_dir: str | Path, *, stale_wait_s: float = STALE_WAIT_S) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / LOCK_NAME
        self._pid = os.getpid()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            _lock(self._fd, self.path, stale_wait_s)
        except _Busy as busy:
            os.close(self._fd)
            self._fd = -1
            raise RunFolderBusy(
                self.run_dir, busy.holder, holder_exited=busy.holder_exited
            ) from None
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                os.close(self._fd)
                raise
            print(
                f"note: {self.run_dir} is on a file system without file locks ({err.strerror});"
                " a second run started in this folder would not be refused",
                file=sys.stderr,
                flush=True,
            )
        _HELD.add(self._fd)
        _write_holder(self._fd)

    def release(self) -> None:
        """Empty the holder details and drop the lock (idempotent)."""
        if self._fd < 0 or os.getpid() != self._pid:  # a forked child closed it at fork
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        _HELD.discard(self._fd)
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class _Busy(Exception):
    """The lock is held by someone else (``holder``: the details in the file)."""

    def __init__(self, holder: dict[str, Any], holder_exited: bool) -> None:
        self.holder, self.holder_exited = holder, holder_exited


def _lock(fd: int, path: Path, stale_wait_s: float) -> None:
    """``flock(fd)`` exclusive, or raise :class:`_Busy`; while the recorded holder is a
    process of this host that has exited, retry for up to ``stale_wait_s`` (module docstring)."""
    deadline = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _read_holder(path)
            exited = _exited(holder)
            if not exited:
                raise _Busy(holder, False) from None
            deadline = deadline or time.monotonic() + stale_wait_s
            if time.monotonic() >= deadline:
                raise _Busy(holder, True) from None
            time.sleep(0.01)


def _exited(holder: dict[str, Any]) -> bool:
    """True when the holder is a process of this host that no longer runs (gone, or a
    zombie that its parent has not reaped yet: it holds no descriptor)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    try:  # Linux: the state is the field after the parenthesised command name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _write_holder(fd: int) -> None:
    """pid, host, start time and command line, for the message of a refused second run."""
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": _command(),
    }
    data = (json.dumps(holder) + "\n").encode()
    try:  # best effort: a full disk must not stop the run here (the sinks report it)
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass


def _command() -> str:
    """This process's command line, shortened (``grouprl train ...``)."""
    if not sys.argv or not sys.argv[0]:
        return ""
    exe = Path(sys.argv[0])
    name = exe.parent.name if exe.name == "__main__.py" else exe.name  # python -m grouprl
    return " ".join([name, *sys.argv[1:]])


def _read_holder(path: Path, tries: int = 10) -> dict[str, Any]:
    """The holder's details; waits briefly for a holder that has just taken the lock."""
    for _ in range(tries):
        try:
            holder = json.loads(path.read_text())
            if isinstance(holder, dict):
                return holder
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}
