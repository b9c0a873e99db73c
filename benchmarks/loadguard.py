"""Headline numbers are idle numbers: where a benchmark's JSON goes, given the machine's load.

A benchmark records the 1-minute load average before and after its run; with ``--out FILE``
it writes its JSON there only when both are at most :data:`MAX_LOAD`. A run on a busier
machine is kept under its own name, ``FILE`` with ``_loaded`` before the suffix
(``vs_trl_smollm2.json`` -> ``vs_trl_smollm2_loaded.json``), and the headline file is left as
it was, unless ``--allow-loaded`` says to overwrite it (the file then says ``"loaded": true``).
Without ``--out`` the JSON goes to stdout as before, with the same load fields [OURS].

    python benchmarks/vs_trl.py --model smollm2 --steps 3 --threads 1 \\
        --out benchmarks/results/vs_trl_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["MAX_LOAD", "add_arguments", "cpu", "load_average", "loaded_name", "write"]

MAX_LOAD = 2.0
"""The highest 1-minute load average, before or after, of a run whose figures may stand in a
headline results file (the machine's own benchmark process adds about 1) [OURS]."""


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 0.01 ([] where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return []


def cpu() -> dict[str, Any]:
    """The processor a run's figures belong to: ``{"model", "cores", "avx512", "amx"}`` from
    ``/proc/cpuinfo`` (model ``platform.processor()`` and no flags where there is none).

    [OURS] A ratio of two CPU functions moves with the processor (one AVX2-only host gave
    verl's vectorized GRPO 0.6x the time it took on an AVX-512 one): a figure names its CPU.
    """
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {
        "model": model,
        "cores": os.cpu_count(),
        "avx512": "avx512f" in flags,
        "amx": "amx_tile" in flags,
    }


def loaded_name(path: str | Path) -> Path:
    """``results/x.json`` -> ``results/x_loaded.json``: where a loaded run is kept."""
    path = Path(path)
    return path.with_name(f"{path.stem}_loaded{path.suffix}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out FILE`` and ``--allow-loaded`` (this module's docstring)."""
    parser.add_argument(
        "--out",
        type=Path,
        help=f"write the JSON here when the load stayed <= {MAX_LOAD} (else to FILE_loaded.json)",
    )
    parser.add_argument(
        "--allow-loaded",
        action="store_true",
        help="with --out: write FILE even at a load above the limit (recorded as loaded)",
    )


def write(
    result: dict[str, Any],
    load_before: list[float],
    *,
    out: str | Path | None,
    allow_loaded: bool = False,
    load_after: list[float] | None = None,
    indent: int | None = 1,
) -> Path | None:
    """Add the load fields to ``result`` and write it: to stdout when ``out`` is None, else to
    ``out`` or, when the run was loaded and ``allow_loaded`` is false, to ``loaded_name(out)``
    (a line on stderr says which and why). Returns the path written (None for stdout)."""
    after = load_average() if load_after is None else load_after
    worst = max([x[0] for x in (load_before, after) if x], default=0.0)
    result["load_average_before"] = list(load_before)
    result["load_average_after"] = list(after)
    result["loaded"] = worst > MAX_LOAD
    result.setdefault("cpu", cpu())
    text = json.dumps(result, indent=indent) + "\n"
    if out is None:
        sys.stdout.write(text)
        return None
    path = Path(out)
    if result["loaded"] and not allow_loaded:
        path = loaded_name(out)
        print(
            f"load average {worst:.2f} > {MAX_LOAD}: {out} left as it is; this run is in "
            f"{path} (--allow-loaded to overwrite {Path(out).name} anyway)",
            file=sys.stderr,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} (load average {load_before[:1]} -> {after[:1]})", file=sys.stderr)
    return path
