"""Puts this folder on sys.path so the tests import ``peer_calls.py`` (the peers' own loss code
called on plain tensors, shared with ``benchmarks/losses.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
