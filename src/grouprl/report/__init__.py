"""HTML reports with embedded matplotlib figures: runs, diagnoses and simulations."""

from __future__ import annotations

from grouprl.report import html

__all__ = ["html"]
