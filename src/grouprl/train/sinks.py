"""Where a run's numbers go: metrics.jsonl (always), TensorBoard, W&B offline, progress.

Progress is a rich bar on a terminal; when stdout is not one (a file, a pipe, CI) or
``progress`` is off, a plain line every tenth of the run or every 30 s instead
(``grouprl._progress.ProgressLines``), so a piped run shows it is alive.

``RUN_DIR`` after a run::

    config.yaml      the resolved RunConfig
    metrics.jsonl    one JSON object per step {"step": s, "reward/mean": ..., ...}, flushed
    rewards.jsonl    one line per group {"step": s, "prompt_id": ..., "rewards": [...]}
                     (NaN written as null), read by ``grouprl diagnose RUN_DIR``
    tb/              TensorBoard events (when tensorboard is installed)
    report.html      written after the run by the entry points (``grouprl train``,
                     ``grouprl.train.run``: ``grouprl.train.api.write_report``), from
                     these files; the trainer never imports ``grouprl.report``

A resumed run first cuts both JSONL files after the resume step, so no step appears twice.

Lines are appended with one ``write`` system call each (no user-space buffer), so a
line is on its way to disk as soon as ``log`` returns; when the disk fills up mid-line,
the file is cut back to its last whole line and ``DiskFullError`` says what to do
(``grouprl.train.diskfull``). config.yaml is replaced atomically.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from grouprl._json import json_safe, read_jsonl
from grouprl._progress import ProgressLines, use_bar
from grouprl.train.diskfull import DiskFullError, is_disk_full

__all__ = ["JsonlAppender", "Sinks", "read_jsonl", "truncate_jsonl"]

_BAR_FIELDS = {"reward": "reward/mean", "ACR": "acr/rate", "KL": "kl/mean"}
"""Progress-bar label -> metric name."""


def truncate_jsonl(path: str | Path, last_step: int) -> int:
    """Keep only rows with ``step <= last_step`` (and drop a torn line); return rows kept."""
    path = Path(path)
    if not path.exists():
        return 0
    rows = [r for r in read_jsonl(path) if int(r.get("step", -1)) <= last_step]
    _replace_text(path, "".join(json.dumps(r) + "\n" for r in rows), step=last_step)
    return len(rows)


def _replace_text(path: Path, text: str, *, step: int) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if is_disk_full(err):
            raise DiskFullError(
                path,
                step=step,
                ckpt_dir=path.parent / "checkpoints",
                cleaned=f"{path.name} was left as it was.",
                cause=err,
            ) from err
        raise


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a write may be short)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class JsonlAppender:
    """Whole lines appended to a file, never a torn one: a failed write is cut back.

    Each ``write`` is one or more ``os.write`` calls on an ``O_APPEND`` descriptor, so
    there is no buffer to flush; when one fails (a full disk), the file is truncated to
    the size it had before, and the error goes on.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    def write(self, text: str) -> None:
        data = text.encode()
        try:
            _write_all(self._fd, data)
        except BaseException:
            os.ftruncate(self._fd, self._size)  # drop the torn line; truncating needs no space
            raise
        self._size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Sinks:
    """All outputs of one run; ``log`` writes a step everywhere, ``close`` ends the run."""

    def __init__(
        self,
        run_dir: str | Path,
        config: dict[str, Any],
        *,
        total_steps: int,
        resume_step: int = 0,
        tensorboard: bool | None = None,
        wandb: bool = False,
        progress: bool = True,
        note: dict[str, Any] | None = None,
    ) -> None:
        """``note``: extra entries of the first metrics row written (e.g. ``resume/changed``
        after ``--resume-anyway``, ``grouprl.train.resume``); values may be any JSON."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._step = resume_step
        self._note = dict(note or {})
        _replace_text(
            self.run_dir / "config.yaml",
            yaml.safe_dump(config, sort_keys=False),
            step=resume_step,
        )
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.rewards_path = self.run_dir / "rewards.jsonl"
        for path in (self.metrics_path, self.rewards_path):
            if resume_step > 0:
                truncate_jsonl(path, resume_step)
            elif path.exists():
                path.unlink()
        self._metrics = JsonlAppender(self.metrics_path)
        self._rewards = JsonlAppender(self.rewards_path)
        # None: when installed; True was checked with the config (config._check_loggers)
        self._tb = self._open_tensorboard(resume_step) if tensorboard is not False else None
        self._wandb = self._open_wandb(config, resume_step) if wandb else None
        self._bar = self._open_bar(total_steps, resume_step) if use_bar(progress) else None
        self._lines = (
            None if self._bar is not None else ProgressLines("step", total_steps, start=resume_step)
        )

    # ---- optional backends ----------------------------------------------------------------
    def _open_tensorboard(self, resume_step: int) -> Any:
        if importlib.util.find_spec("tensorboard") is None:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step + 1)

    def _open_wandb(self, config: dict[str, Any], resume_step: int) -> Any:
        if importlib.util.find_spec("wandb") is None:
            return None
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        return wandb.init(dir=str(self.run_dir), config=config, mode="offline")

    def _open_bar(self, total_steps: int, resume_step: int) -> Any:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[live]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            transient=False,
        )
        bar.start()
        self._task = bar.add_task("train", total=total_steps, completed=resume_step, live="")
        return bar

    # ---- per step -------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one step to metrics.jsonl (flushed) and the optional backends."""
        row = {"step": step, **{k: json_safe(float(v)) for k, v in metrics.items()}}
        self._append(self._metrics, json.dumps({**row, **self._note}) + "\n", step)
        self._note = {}
        self._step = step
        if self._tb is not None:
            try:
                for key, value in metrics.items():
                    if math.isfinite(value):
                        self._tb.add_scalar(key, value, step)
            except OSError as err:
                self._tensorboard_full(err, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        live = "  ".join(  # KL only where there is one (β > 0)
            f"{label} {metrics[key]:.3f}"
            for label, key in _BAR_FIELDS.items()
            if key in metrics and (label != "KL" or metrics[key] != 0)
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=step, live=live)
        elif self._lines is not None and step > 0:  # step 0 holds the first evaluation only
            self._lines.update(step, live)

    def log_groups(self, step: int, prompt_ids: list[Any], rewards: Any) -> None:
        """One rewards.jsonl line per group: ``{"step", "prompt_id", "rewards"}``."""
        lines = [
            json.dumps(
                {"step": step, "prompt_id": pid, "rewards": json_safe([float(r) for r in row])}
            )
            for pid, row in zip(prompt_ids, rewards.tolist())
        ]
        self._append(self._rewards, "\n".join(lines) + "\n", step)

    def _append(self, out: JsonlAppender, text: str, step: int) -> None:
        try:
            out.write(text)
        except OSError as err:
            if not is_disk_full(err):
                raise
            raise DiskFullError(
                out.path,
                step=step,
                ckpt_dir=self.run_dir / "checkpoints",
                cleaned=f"{out.path.name} was cut back to its last whole line (step "
                f"{step - 1}); metrics.jsonl and rewards.jsonl hold no torn line.",
                cause=err,
            ) from err

    def _tensorboard_full(self, err: OSError, step: int) -> None:
        """TensorBoard's writer failed: a full disk becomes ``DiskFullError`` (the writer is
        dropped, so closing does not fail again); any other error goes on."""
        if not is_disk_full(err):
            raise err
        tb, self._tb = self._tb, None
        with contextlib.suppress(Exception):
            tb.close()
        raise DiskFullError(
            self.run_dir / "tb",
            step=step,
            ckpt_dir=self.run_dir / "checkpoints",
            cleaned="metrics.jsonl holds every step up to this one; the TensorBoard events may "
            "lack the last values (a resumed run writes them again from its checkpoint).",
            cause=err,
        ) from err

    def print(self, message: str) -> None:
        """A line above the progress bar (or on stdout without one)."""
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Flush and close everything (report.html is the entry points' job: ``grouprl
        train`` and ``grouprl.train.run`` write it from the run folder's files)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        for f in (self._metrics, self._rewards):
            f.close()
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as err:
                self._tensorboard_full(err, self._step)
        if self._wandb is not None:
            self._wandb.finish()
