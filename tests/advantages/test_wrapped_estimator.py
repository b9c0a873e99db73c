"""An estimator wrapped with ``functools.wraps`` (a user's decorator; mutation testing's
trampolines) keeps its parameters: ``compute`` reads them through the wrapper."""

from __future__ import annotations

import functools

import pytest
import torch

from grouprl import advantages


def test_compute_accepts_the_parameters_of_a_wrapped_estimator(monkeypatch):
    original = advantages.ESTIMATORS["grpo"]
    calls = []

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    assert wrapped.__kwdefaults__ is None  # what the wrapper alone would say
    monkeypatch.setitem(advantages.ESTIMATORS, "grpo", wrapped)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    out = advantages.compute("grpo", rewards, eps=0.0)
    assert calls and calls[-1]["eps"] == 0.0
    assert out.values[0].tolist() == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254])
    with pytest.raises(ValueError, match=r"got unknown parameter\(s\) \['delta'\]"):
        advantages.compute("grpo", rewards, delta=1.0)
