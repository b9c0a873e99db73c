"""Answer spans inside a model's reply, shared by the task verifiers and the AGPO vote keys."""

from __future__ import annotations

import re

__all__ = ["last_boxed"]

_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` in ``text``, nested braces allowed.

    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``, where a flat ``\\boxed\\{([^{}]*)\\}``
    regex finds nothing and the caller falls back to the whole reply. Braces are
    counted from each ``\\boxed{`` to its matching ``}``; when the last one is never closed the
    one before it is tried. None when there is no closed ``\\boxed{}``. Whitespace between
    ``\\boxed`` and ``{`` is allowed (LaTeX accepts it). [OURS]
    """
    for start in reversed([m.end() for m in _BOXED.finditer(text)]):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None
