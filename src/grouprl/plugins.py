"""Plugins: a file or a module that registers methods, loaded by name.

    grouprl train --plugin my_method.py --preset my_preset      # a file (or a module name)
    grouprl list --plugin my_method.py
    grouprl.train.run(..., preset="my_preset", plugins=["my_method.py"])

A plugin is ordinary Python that calls the ``register_*`` functions (``grouprl.registry``;
docs/extending.md). The config records it (``run.plugins``), so ``--config`` of a run folder's
config.yaml and ``--resume`` load it again. An installed package announces its plugins in the
entry-point group :data:`ENTRY_POINT_GROUP`::

    [project.entry-points."grouprl.plugins"]
    my_methods = "my_package.methods"      # a module, imported; or a function, called

which every entry point of grouprl loads (:func:`load_entry_points`) before it reads a name.
Loading is idempotent: a file or module is imported once per process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "load", "load_all", "load_entry_points"]

ENTRY_POINT_GROUP = "grouprl.plugins"
"""The entry-point group of installed plugins."""

_LOADED: dict[str, ModuleType] = {}
_ENTRY_POINTS_DONE = False


class PluginError(ImportError):
    """A plugin cannot be found or fails while it is imported (the message says which)."""


def _key(spec: str) -> str:
    if spec.endswith(".py"):
        return str(Path(spec).expanduser().resolve())
    return spec


def load(spec: str | Path) -> ModuleType:
    """Import plugin ``spec``: a ``.py`` file (by path) or a dotted module name."""
    spec = str(spec)
    key = _key(spec)
    if key in _LOADED:
        return _LOADED[key]
    if spec.endswith(".py"):
        path = Path(key)
        if not path.is_file():
            raise PluginError(
                f"plugin file {spec!r} not found (from {Path.cwd()}); give the path of a .py "
                "file, or the dotted name of an importable module"
            )
        name = f"grouprl_plugin_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            sys.modules.pop(name, None)
            raise PluginError(f"plugin {spec!r} failed while loading: {err}") from err
    else:
        try:
            module = importlib.import_module(spec)
        except ModuleNotFoundError as err:
            raise PluginError(
                f"plugin module {spec!r} cannot be imported ({err}); a file needs its .py suffix"
            ) from err
    _LOADED[key] = module
    return module


def load_all(specs: Iterable[str | Path]) -> list[ModuleType]:
    """:func:`load` each of ``specs`` (the installed entry points first)."""
    load_entry_points()
    return [load(s) for s in specs]


def load_entry_points(group: str = ENTRY_POINT_GROUP, *, again: bool = False) -> list[str]:
    """Load every installed plugin of entry-point ``group``: a module is imported, a
    callable is called. Returns the entry points' names. Once per process unless ``again``."""
    global _ENTRY_POINTS_DONE
    if _ENTRY_POINTS_DONE and not again and group == ENTRY_POINT_GROUP:
        return []
    from importlib.metadata import entry_points

    names = []
    for ep in entry_points(group=group):
        key = f"entry-point:{ep.value}"
        if key in _LOADED:
            continue
        try:
            obj: Any = ep.load()
            if callable(obj) and not isinstance(obj, ModuleType):
                obj()
        except Exception as err:
            raise PluginError(
                f"installed plugin {ep.name!r} ({ep.value}, entry point group {group!r}) "
                f"failed while loading: {err}"
            ) from err
        _LOADED[key] = obj if isinstance(obj, ModuleType) else sys.modules[ep.module]
        names.append(ep.name)
    if group == ENTRY_POINT_GROUP:
        _ENTRY_POINTS_DONE = True
    return names
