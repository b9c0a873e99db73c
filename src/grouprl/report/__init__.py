"""HTML reports with embedded matplotlib figures: runs, diagnoses and simulations.

- :func:`write_run_report` ``(run_dir) -> Path``: ``run_dir/report.html`` from metrics.jsonl;
- :mod:`grouprl.report.html`: page, table and figure helpers (figures embedded as base64 PNG).
"""

from __future__ import annotations

from grouprl.report import html
from grouprl.report.run import read_metrics, replay_health, run_blocks, write_run_report

__all__ = ["html", "read_metrics", "replay_health", "run_blocks", "write_run_report"]
