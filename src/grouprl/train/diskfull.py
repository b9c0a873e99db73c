"""A full disk is a message, not a traceback: ``DiskFullError`` says what to do.

Every writer of a run folder (a checkpoint, metrics.jsonl, rewards.jsonl, config.yaml,
report.html) catches an ``OSError`` whose errno is ``ENOSPC`` (no space left) or ``EDQUOT``
(quota exceeded), removes what it left half-written (the ``.tmp-step_*`` folder, the torn
line, the partial file), and raises ``DiskFullError`` instead. Its message names the file
and the step, the last good checkpoint, and what to do: free space, then rerun the same
command with ``--resume``. ``grouprl train`` prints it and exits with code 1.

torch wraps some write errors of ``torch.save`` in a ``RuntimeError`` whose cause or
context is the ``OSError``; :func:`is_disk_full` follows that chain.
"""

from __future__ import annotations

import errno
from pathlib import Path

from grouprl.train.layout import checkpoint_step, list_checkpoints

__all__ = ["DISK_FULL_ERRNOS", "DiskFullError", "is_disk_full", "last_checkpoint"]

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""errno values that mean "no room to write": no space left, disk quota exceeded."""


def _disk_full_cause(err: BaseException | None) -> OSError | None:
    """The full-disk ``OSError`` in ``err``'s chain of causes and contexts, if any."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return err
        err = err.__cause__ or err.__context__
    return None


def is_disk_full(err: BaseException | None) -> bool:
    """True when ``err``, or an exception it was raised from or during, is a full disk."""
    return _disk_full_cause(err) is not None


def last_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest finished checkpoint folder in ``ckpt_dir`` (None when there is none)."""
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def _strerror(err: BaseException | None) -> str:
    found = _disk_full_cause(err)
    return found.strerror if found is not None and found.strerror else "no space left on device"


class DiskFullError(RuntimeError):
    """The disk (or quota) filled up while a run folder's file was being written.

    ``path``: the file being written; ``step``: the step it belonged to; ``ckpt_dir``: where
    the run's checkpoints are (the message names the newest one); ``cleaned``: what the
    writer removed or kept intact, one sentence; ``cause``: the ``OSError``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        step: int,
        ckpt_dir: str | Path,
        cleaned: str = "",
        cause: BaseException | None = None,
    ) -> None:
        self.path, self.step, self.ckpt_dir = Path(path), step, Path(ckpt_dir)
        self.last_checkpoint = last_checkpoint(ckpt_dir)
        last = (
            f"{self.last_checkpoint} (step {checkpoint_step(self.last_checkpoint)})"
            if self.last_checkpoint is not None
            else "none yet (a resumed run starts again from step 0)"
        )
        super().__init__(
            f"disk full ({_strerror(cause)}) while writing {self.path} at step {step}. "
            + (f"{cleaned} " if cleaned else "")
            + f"Last good checkpoint: {last}. Free space on the disk that holds "
            f"{self.ckpt_dir.parent} (df -h {self.ckpt_dir.parent}), then rerun the same "
            "command with --resume."
        )
