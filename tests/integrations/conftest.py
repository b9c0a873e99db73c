"""Puts this folder on sys.path so the tests (and the scripts they launch) import the tiny
model in ``tiny_lm.py`` and the TRL doubles in ``trl_doubles.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
