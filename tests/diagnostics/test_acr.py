"""ACR and its split on hand-made batches; parity with a plain per-group loop."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.diagnostics import acr, collapse_split

NAN = float("nan")


def test_acr_hand_made_batch():
    # 5 groups of 4: all-correct, all-wrong, mixed, constant 0.5 (other), mixed with a NaN.
    # Collapsed: groups 0, 1, 3 -> ACR = 3/5; split 1/1/1 of 5.
    r = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],
            [0.0, 0.0, 0.0, 0.0],
            [1.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.5, 0.5],
            [1.0, NAN, 0.0, 1.0],
        ]
    )
    assert acr(r) == pytest.approx(0.6, abs=1e-12)
    s = collapse_split(r)
    assert s["collapsed"].tolist() == [True, True, False, True, False]
    assert s["all_correct"].tolist() == [True, False, False, False, False]
    assert s["all_wrong"].tolist() == [False, True, False, False, False]
    assert s["other"].tolist() == [False, False, False, True, False]


def test_nan_never_read_as_zero():
    # [1, 1, NaN, 1]: valid rewards are all 1 -> collapsed all-correct. Reading NaN as 0
    # would make it mixed.
    r = torch.tensor([[1.0, 1.0, NAN, 1.0]])
    s = collapse_split(r)
    assert s["all_correct"].item() and acr(r) == 1.0


def test_singleton_and_empty_groups_are_collapsed():
    # One valid reward: σ undefined with ddof=1 -> collapsed (ALGORITHMS §0: advantage 0).
    # No valid reward: collapsed, counted as "other" (neither correct nor wrong).
    r = torch.tensor([[1.0, NAN, NAN], [NAN, NAN, NAN], [0.0, 1.0, NAN]])
    s = collapse_split(r)
    assert s["collapsed"].tolist() == [True, True, False]
    assert s["insufficient"].tolist() == [True, True, False]
    assert s["all_correct"].tolist() == [True, False, False]
    assert s["other"].tolist() == [False, True, False]


def test_float_noise_is_collapsed_not_mixed():
    # A "constant" group with float32 noise of 1e-8 has σ ≈ 1e-8 > 0 but < tau = 1e-6.
    r = torch.tensor([[0.3, 0.3 + 1e-8, 0.3, 0.3]], dtype=torch.float32)
    assert acr(r) == 1.0
    # ... while a real gap of 1e-3 is not collapsed.
    assert acr(torch.tensor([[0.3, 0.301, 0.3, 0.3]])) == 0.0


def test_custom_reward_range():
    r = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]])
    s = collapse_split(r, reward_range=(-1.0, 1.0))
    assert s["all_wrong"].tolist() == [True, False, False]
    assert s["all_correct"].tolist() == [False, True, False]
    assert s["other"].tolist() == [False, False, True]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="infinite"):
        acr(torch.tensor([[1.0, math.inf]]))
    with pytest.raises(ValueError, match="2-D"):
        acr(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="reward_range"):
        collapse_split(torch.zeros(2, 2), reward_range=(1.0, 0.0))


def _loop_acr(rows, tau=1e-6):
    collapsed = 0
    for row in rows:
        vals = [x for x in row if not math.isnan(x)]
        if len(vals) < 2:
            collapsed += 1
            continue
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((x - m) ** 2 for x in vals) / (len(vals) - 1))
        collapsed += sd < tau
    return collapsed / len(rows)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda g: st.lists(
            st.lists(st.sampled_from([0.0, 1.0, 0.5, NAN]), min_size=g, max_size=g),
            min_size=1,
            max_size=8,
        )
    )
)
def test_parity_with_loop(rows):
    r = torch.tensor(rows, dtype=torch.float64)
    assert acr(r) == pytest.approx(_loop_acr(rows), abs=1e-12)
    s = collapse_split(r)
    # The split partitions the collapsed groups.
    total = s["all_correct"].int() + s["all_wrong"].int() + s["other"].int()
    assert torch.equal(total.bool(), s["collapsed"]) and int(total.max()) <= 1
