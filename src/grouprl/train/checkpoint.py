"""Checkpoints that survive being killed: temporary name, sha256 manifest, atomic rename.

Layout: ``RUN_DIR/checkpoints/step_00000042/`` holds ``model.pt`` (trainable parameters
only: the frozen ones come back from the model's source), ``optimizer.pt``, ``state.pt``
(step, controllers, run health, RNG states) and ``manifest.json`` (sha256 and size of each
file). A checkpoint is first written to ``.tmp-step_00000042-PID``, every file fsync'ed,
then the folder is renamed: a reader sees a whole checkpoint or none. ``latest_good``
verifies the manifest and falls back to the previous checkpoint, saying why, when one
was truncated or corrupted (e.g. a disk that filled up, a copy that was cut short).

The manifest also records the run's configuration and the grouprl version that wrote it
(``config``, ``grouprl``), so ``--resume`` can tell whether it continues the same
experiment (``grouprl.train.resume``). A full disk during ``save`` removes the temporary
folder and raises ``grouprl.train.diskfull.DiskFullError``; the earlier checkpoints are
untouched (old ones are deleted only after the new one is complete).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grouprl.train.diskfull import DiskFullError, is_disk_full
from grouprl.train.layout import checkpoint_name, list_checkpoints

__all__ = [
    "CheckpointError",
    "Loaded",
    "capture_rng",
    "latest_good",
    "restore_rng",
    "save",
    "verify",
]

_FILES = ("model.pt", "optimizer.pt", "state.pt")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing file, size or checksum mismatch)."""


@dataclass
class Loaded:
    """A verified checkpoint's contents."""

    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    state: dict[str, Any]
    manifest: dict[str, Any] = field(default_factory=dict)
    """``manifest.json``: step, file checksums, and (since grouprl 0.1) ``config`` and
    ``grouprl`` (the version that wrote it)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_write(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Every random state the run draws from: torch (CPU and, when initialised, every CUDA
    device), python, numpy and named generators (on any device)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
    }


def restore_rng(
    saved: dict[str, Any], generators: dict[str, torch.Generator] | None = None
) -> None:
    """Inverse of ``capture_rng`` (named generators present in both are restored)."""
    torch.set_rng_state(saved["torch"])
    if saved.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    for key, gen in (generators or {}).items():
        if key in saved["generators"]:
            gen.set_state(saved["generators"][key])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (all of them, or the LoRA adapters)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable parameters into ``model``; a missing or extra name is an error."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(saved):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise CheckpointError(
            f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
            f"{extra[:5]}; was it written by a run with another model or LoRA setting?"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def save(
    ckpt_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int = 2,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically, then delete all but the newest ``keep_last``.

    ``config``: the run's configuration (``RunConfig.to_dict()``), recorded in the manifest
    with the grouprl version. A full disk raises ``DiskFullError`` after removing the
    temporary folder.
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / checkpoint_name(step)
    tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    writing = [tmp]  # the file being written, for the message of a full disk
    try:
        tmp.mkdir()
        _write_files(tmp, step, model, optimizer, state, config, writing)
        if final.exists():  # re-saving the same step (e.g. a signal right after a periodic save)
            shutil.rmtree(final)
        writing[0] = final
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(err):
            raise DiskFullError(
                writing[0],
                step=step,
                ckpt_dir=ckpt_dir,
                cleaned=f"The partial checkpoint {tmp.name} was removed; "
                "the earlier checkpoints are intact.",
                cause=err,
            ) from err
        raise
    for old in list_checkpoints(ckpt_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_files(
    tmp: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    config: dict[str, Any] | None,
    writing: list[Path],
) -> None:
    """The checkpoint's files and manifest in ``tmp``, fsync'ed; ``writing[0]`` is set to
    each file before it is written."""
    from grouprl import __version__

    payload = {
        "model.pt": trainable_state(model),
        "optimizer.pt": optimizer.state_dict(),
        "state.pt": {**state, "step": step},
    }
    manifest: dict[str, Any] = {"step": step, "format": 1, "files": {}}
    for name in _FILES:
        writing[0] = tmp / name
        _fsync_write(tmp / name, payload[name])
        manifest["files"][name] = {
            "sha256": _sha256(tmp / name),
            "bytes": (tmp / name).stat().st_size,
        }
    manifest["grouprl"] = __version__
    if config is not None:
        manifest["config"] = config
    writing[0] = tmp / "manifest.json"
    _fsync_write_text(tmp / "manifest.json", json.dumps(manifest, indent=1))
    _fsync_dir(tmp)


def verify(path: str | Path) -> int:
    """Check a checkpoint's manifest, sizes and sha256; return its step or raise."""
    return int(_verified_manifest(path)["step"])


def _verified_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: manifest.json missing or unreadable ({err})") from None
    for name in _FILES:
        entry = manifest.get("files", {}).get(name)
        file = path / name
        if entry is None or not file.exists():
            raise CheckpointError(f"{path}: {name} missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{path}: {name} is truncated or corrupt ({size} bytes, manifest says "
                f"{entry['bytes']})"
            )
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{path}: {name} is corrupt (sha256 does not match manifest)")
    return manifest


def load(path: str | Path) -> Loaded:
    """Verify and load one checkpoint (raises ``CheckpointError`` if it is not intact)."""
    path = Path(path)
    manifest = _verified_manifest(path)
    parts = {name: torch.load(path / name, weights_only=False) for name in _FILES}
    return Loaded(
        path,
        int(manifest["step"]),
        parts["model.pt"],
        parts["optimizer.pt"],
        parts["state.pt"],
        manifest,
    )


def latest_good(ckpt_dir: str | Path, *, log: Any = None) -> Loaded | None:
    """The newest intact checkpoint; each rejected one is reported through ``log``."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return load(path)
        except CheckpointError as err:
            log(f"checkpoint rejected: {err}; falling back to the previous one")
        except Exception as err:  # torch.load on bytes that pass the checksum but not unpickling
            log(f"checkpoint rejected: {path}: cannot be loaded ({err}); falling back")
    return None
