"""JSON helpers shared by the sinks, the simulations and the reproductions."""

from __future__ import annotations

import math
from typing import Any


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
