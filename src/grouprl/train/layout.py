"""Where a run's checkpoints live in its folder: ``RUN_DIR/checkpoints/step_00000042/``.

The one home of the checkpoint folders' names, for the writer (``train.checkpoint``) and for
the messages that name the newest one (``train.diskfull``, ``train.resume``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHECKPOINT_PREFIX", "checkpoint_name", "checkpoint_step", "list_checkpoints"]

CHECKPOINT_PREFIX = "step_"
"""A finished checkpoint's folder name: this prefix and the step in 8 digits."""


def checkpoint_name(step: int) -> str:
    """``step_00000042``: the folder name of step ``step``'s checkpoint."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint folder (its name's number)."""
    return int(Path(path).name[len(CHECKPOINT_PREFIX) :])


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (temporary folders are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=checkpoint_step)
