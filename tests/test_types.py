"""types.to_floats: 0-dim tensors to floats, each under its own key."""

import torch

from grouprl.types import to_floats


def test_to_floats_keeps_each_value_with_its_key():
    stats = {
        "b": torch.tensor(2.5),
        "a": torch.tensor(-1.0, dtype=torch.float64),
        "c": torch.tensor(7, dtype=torch.int64),  # integers become floats too
        "d": torch.tensor([0.25]),  # one element of any shape
        "e": torch.tensor(1.0, requires_grad=True) * 3,  # detached, not an error
    }
    out = to_floats(stats)
    assert out == {"b": 2.5, "a": -1.0, "c": 7.0, "d": 0.25, "e": 3.0}
    assert list(out) == ["b", "a", "c", "d", "e"]
    assert all(type(v) is float for v in out.values())
    assert to_floats({}) == {}
