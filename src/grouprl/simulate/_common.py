"""What every simulation returns, and how it is written to disk."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from grouprl._json import json_safe
from grouprl.report import html as H

__all__ = ["Claim", "SimResult", "write_result"]


@dataclass(frozen=True)
class Claim:
    """A qualitative statement a simulation must show, and whether this run shows it."""

    name: str
    holds: bool
    detail: str


@dataclass
class SimResult:
    """A simulation's outcome: table rows, claims, figures and raw data for the JSON."""

    name: str
    title: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    claims: list[Claim]
    figures: dict[str, Figure] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every claim holds."""
        return all(c.holds for c in self.claims)

    def to_json(self) -> dict[str, Any]:
        return json_safe(
            {
                "name": self.name,
                "title": self.title,
                "config": self.config,
                "rows": self.rows,
                "claims": [
                    {"name": c.name, "holds": c.holds, "detail": c.detail} for c in self.claims
                ],
                "notes": self.notes,
                "seconds": self.seconds,
                "data": self.data,
            }
        )


def write_result(result: SimResult, out: str | Path) -> dict[str, Path]:
    """Write ``NAME.json``, one ``NAME[_fig].png`` per figure and ``NAME.html`` under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    js = out / f"{result.name}.json"
    js.write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")
    paths["json"] = js
    blocks = [H.text(f"config: {json.dumps(json_safe(result.config))}", "sub")]
    blocks.append("<h2>Claims</h2>")
    for c in result.claims:
        mark = "✓" if c.holds else "✗"
        blocks.append(H.text(f"{mark} {c.name}: {c.detail}", "ok" if c.holds else "bad"))
    for key, fig in result.figures.items():
        suffix = "" if key == "main" else f"_{key}"
        png = out / f"{result.name}{suffix}.png"
        png.write_bytes(H.figure_png(fig))
        paths[f"png{suffix}"] = png
        blocks.append(f"<h2>{key}</h2>" + H.img(fig, key))
    blocks.append("<h2>Results</h2>" + H.table(result.rows))
    if result.notes:
        blocks.append("<h2>Notes</h2>" + "".join(H.text(n) for n in result.notes))
    paths["html"] = H.write_page(
        out / f"{result.name}.html", result.title, blocks, f"grouprl simulate {result.name}"
    )
    return paths
