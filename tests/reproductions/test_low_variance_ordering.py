"""The low-variance reproduction's ordering comparison against hand-counted pairs."""

import importlib.util
from pathlib import Path

RUN = Path(__file__).resolve().parents[2] / "reproductions" / "low_variance" / "run.py"


def _load():
    spec = importlib.util.spec_from_file_location("repro_low_variance", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_concordance_counts_pairs_by_hand():
    c = _load().concordance
    paper = {"a": 3.0, "b": 2.0, "c": 1.0}
    assert c({"a": 30.0, "b": 20.0, "c": 10.0}, paper) == (3, 3)  # same order
    assert c({"a": 1.0, "b": 2.0, "c": 3.0}, paper) == (0, 3)  # reversed
    # (a, b) swapped, (a, c) and (b, c) kept: 2 of 3
    assert c({"a": 2.0, "b": 3.0, "c": 1.0}, paper) == (2, 3)
    # a tie in the paper (a = b) is not compared; a tie in ours counts as discordant
    assert c({"a": 1.0, "b": 5.0, "c": 1.0}, {"a": 1.0, "b": 1.0, "c": 0.0}) == (1, 2)
