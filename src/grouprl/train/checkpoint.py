"""Checkpoints that survive being killed: temporary name, sha256 manifest, atomic rename.

Layout: ``RUN_DIR/checkpoints/step_00000042/`` holds ``model.pt`` (trainable parameters
only: the frozen ones come back from the model's source), ``optimizer.pt``, ``state.pt``
(step, controllers, run health, RNG states) and ``manifest.json`` (sha256 and size of each
file). A checkpoint is first written to ``.tmp-step_00000042-PID``, every file fsync'ed,
then the folder is renamed: a reader sees a whole checkpoint or none. ``latest_good``
verifies the manifest and falls back to the previous checkpoint, saying why, when one
was truncated or corrupted (e.g. a disk that filled up, a copy that was cut short).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "Loaded",
    "capture_rng",
    "latest_good",
    "list_checkpoints",
    "restore_rng",
    "save",
    "verify",
]

_FILES = ("model.pt", "optimizer.pt", "state.pt")
_PREFIX = "step_"


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
) -> Path:
    """Write checkpoint ``step`` atomically, then delete all but the newest ``keep_last``."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"{_PREFIX}{step:08d}"
    tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    payload = {
        "model.pt": trainable_state(model),
        "optimizer.pt": optimizer.state_dict(),
        "state.pt": {**state, "step": step},
    }
    manifest: dict[str, Any] = {"step": step, "format": 1, "files": {}}
    for name in _FILES:
        _fsync_write(tmp / name, payload[name])
        manifest["files"][name] = {
            "sha256": _sha256(tmp / name),
            "bytes": (tmp / name).stat().st_size,
        }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. a signal right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    for old in list_checkpoints(ckpt_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (temporary folders are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def verify(path: str | Path) -> int:
    """Check a checkpoint's manifest, sizes and sha256; return its step or raise."""
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
    return int(manifest["step"])


def load(path: str | Path) -> Loaded:
    """Verify and load one checkpoint (raises ``CheckpointError`` if it is not intact)."""
    path = Path(path)
    step = verify(path)
    parts = {name: torch.load(path / name, weights_only=False) for name in _FILES}
    return Loaded(path, step, parts["model.pt"], parts["optimizer.pt"], parts["state.pt"])


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
