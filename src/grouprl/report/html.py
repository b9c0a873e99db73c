"""Self-contained HTML pages with embedded PNG figures (no external files, no JavaScript)."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

__all__ = ["figure", "figure_png", "img", "page", "table", "text", "write_page"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;
margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.6em;
border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.sub{color:#666}.warn{background:#fff4e0;border-left:4px solid #e69500;padding:.4em .8em;
margin:.3em 0}.ok{color:#1a7f37}.bad{color:#c0392b}img{max-width:100%}
code,pre{background:#f6f8fa;padding:.1em .3em;border-radius:3px}
.lead{font-size:1.1em}.warn p{margin:.2em 0}.warn ul{margin:.2em 0}
"""


def figure(ncols: int = 1, nrows: int = 1, *, width: float = 5.0, height: float = 3.4):
    """A matplotlib ``Figure`` and its axes array, built without pyplot (no global backend)."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def figure_png(fig: Figure, *, dpi: int = 110) -> bytes:
    """The PNG bytes of a figure."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def img(fig: Figure, alt: str = "") -> str:
    """An ``<img>`` tag with the figure embedded as base64 PNG."""
    data = base64.b64encode(figure_png(fig)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4g}"
    return html.escape(str(v))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """An HTML table from a list of dicts (columns: the first row's keys unless given)."""
    if not rows:
        return "<p class='sub'>(no rows)</p>"
    cols = list(columns or rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{_fmt(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def text(s: str, cls: str | None = None, tag: str = "p") -> str:
    """An escaped paragraph (or other tag) with an optional CSS class."""
    c = f' class="{cls}"' if cls else ""
    return f"<{tag}{c}>{html.escape(s)}</{tag}>"


def page(title: str, blocks: Iterable[str], subtitle: str | None = None) -> str:
    """A complete HTML document from already-rendered blocks."""
    sub = f"<p class='sub'>{html.escape(subtitle)}</p>" if subtitle else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{sub}{''.join(blocks)}</body></html>"
    )


def write_page(
    path: str | Path, title: str, blocks: Iterable[str], subtitle: str | None = None
) -> Path:
    """Write :func:`page` to ``path`` (parents created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(title, blocks, subtitle), encoding="utf-8")
    return path
