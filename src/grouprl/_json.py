"""JSON helpers shared by the sinks, the simulations and the reproductions, and the one JSONL reader.

Every JSONL file grouprl reads goes through :func:`jsonl_lines` (a run's metrics.jsonl and
rewards.jsonl, ``grouprl diagnose``'s group files, verl's rollout dumps, a dataset's rows);
each reader decides what a line that is not JSON means for it (skipped, listed, an error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

__all__ = ["JsonLine", "json_safe", "jsonl_lines", "read_jsonl"]


class JsonLine(NamedTuple):
    """One non-blank line of a JSONL file: its number (1-based), its value, or why it is not
    JSON (``value`` None then)."""

    no: int
    value: Any
    error: str | None


def jsonl_lines(source: str | Path | IO[str], *, errors: str = "strict") -> Iterator[JsonLine]:
    """Every non-blank line of a UTF-8 JSONL file, parsed, in order (read line by line).

    ``source``: a path, or an open text stream (e.g. ``gzip.open(..., "rt")``). ``errors``:
    how undecodable bytes of a path are handled (``open``'s; ``"strict"`` raises
    ``UnicodeDecodeError``, ``"replace"`` reads them as U+FFFD). ``OSError`` propagates.
    """
    if hasattr(source, "readline"):
        yield from _parsed(source)
        return
    with open(source, encoding="utf-8", errors=errors) as fh:
        yield from _parsed(fh)


def _parsed(lines: Iterable[str]) -> Iterator[JsonLine]:
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield JsonLine(no, json.loads(line), None)
        except ValueError as err:  # json.JSONDecodeError
            yield JsonLine(no, None, str(err))


def read_jsonl(path: str | Path) -> list[Any]:
    """Every JSON line of a file grouprl wrote (metrics.jsonl, rewards.jsonl); a line that is
    not JSON (the torn last line of a killed run) is skipped; [] when there is no file."""
    path = Path(path)
    if not path.exists():
        return []
    return [line.value for line in jsonl_lines(path) if line.error is None]


def json_safe(x: Any) -> Any:
    """JSON-safe copy: NaN/inf floats -> None (JSON has no NaN), tuples -> lists, numpy/torch
    scalars and arrays -> Python numbers and lists, dict keys -> str."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return json_safe(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return x
