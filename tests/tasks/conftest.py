"""Puts this folder on sys.path so tests import ``trl_doc_rewards`` (TRL's documented rewards)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
