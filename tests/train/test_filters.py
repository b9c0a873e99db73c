"""Dynamic sampling and overlong handling."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.train import filters

NAN = math.nan


def test_informative_groups():
    rewards = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],  # all correct -> drop
            [0.0, 0.0, 0.0, 0.0],  # all wrong -> drop
            [1.0, 0.0, 1.0, 1.0],  # mixed -> keep
            [NAN, 1.0, NAN, 0.0],  # two valid, differ -> keep
            [NAN, 1.0, NAN, NAN],  # one valid -> drop
            [0.5, 0.5 + 1e-9, 0.5, 0.5],  # float noise below tau -> drop
        ]
    )
    keep = filters.informative_groups(rewards)
    assert keep.tolist() == [False, False, True, True, False, False]


def test_prompts_to_draw():
    assert filters.prompts_to_draw(0, 32, None, batch_prompts=32) == 32
    # 8 kept so far at keep rate 0.25: need 24 more / 0.25 = 96 -> capped at 4·32 = 128: 96
    assert filters.prompts_to_draw(8, 32, 0.25, batch_prompts=32) == 96
    # tiny keep rate: floor 0.05 -> 24/0.05 = 480 -> cap 128
    assert filters.prompts_to_draw(8, 32, 0.001, batch_prompts=32) == 128
    assert filters.prompts_to_draw(32, 32, 0.5, batch_prompts=32) == 0
    assert filters.prompts_to_draw(31, 32, 0.9, batch_prompts=32) == 2  # ceil(1/0.9)


def _rewards(pattern: list[int], g: int = 4) -> torch.Tensor:
    """1 -> a mixed group, 0 -> a collapsed group."""
    rows = [[1.0, 0.0] + [1.0] * (g - 2) if p else [1.0] * g for p in pattern]
    return torch.tensor(rows)


def test_dynamic_sampler_accumulates_and_trims():
    s = filters.DynamicSampler(target=4, max_tries=5)
    assert s.next_draw() == 4
    idx = s.add(_rewards([1, 0, 1, 0]))  # keeps 0 and 2
    assert idx.tolist() == [0, 2] and not s.done
    assert s.keep_rate == 0.5
    assert s.next_draw() == 4  # (4 - 2) / 0.5
    idx = s.add(_rewards([1, 1, 1, 0]))  # 3 informative, only 2 needed: trimmed
    assert idx.tolist() == [0, 1] and s.done
    assert s.stats() == {"tries": 2.0, "drawn": 8.0, "kept": 4.0, "keep_rate": 5 / 8}
    with pytest.raises(RuntimeError, match="call reset"):
        s.add(_rewards([1]))
    s.reset()
    assert not s.done and s.tries == 0


def test_dynamic_sampler_gives_up_with_clear_message():
    s = filters.DynamicSampler(target=3, max_tries=2)
    s.add(_rewards([0, 0, 1]))
    with pytest.raises(
        filters.DynamicSamplingExhausted, match=r"after 2 generation rounds only 1/3"
    ):
        s.add(_rewards([0, 0, 0]))
    p = filters.DynamicSampler(target=3, max_tries=2, on_exhausted="partial")
    p.add(_rewards([0, 0, 1]))
    assert p.add(_rewards([0, 1, 0])).tolist() == [1]
    assert p.done and p.kept == 2


def test_mask_truncated():
    mask = torch.ones(3, 4)
    out = filters.mask_truncated(mask, torch.tensor([False, True, False]))
    assert out.sum(-1).tolist() == [4.0, 0.0, 4.0]
    with pytest.raises(ValueError, match="truncated must be"):
        filters.mask_truncated(mask, torch.tensor([True]))


def test_overlong_penalty_dapo_shape():
    # L_max 20, L_cache 4: 0 up to 16, then (16 - L)/4: 18 -> -0.5, 20 -> -1, beyond -> -1
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    pen = filters.overlong_penalty(lengths, max_len=20, cache_len=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = filters.overlong_penalty(lengths, max_len=20, cache_len=4, factor=0.5)
    torch.testing.assert_close(half, pen * 0.5)
    rewards = torch.tensor([[1.0, NAN], [0.0, 1.0]])
    out = filters.apply_overlong_penalty(
        rewards, torch.tensor([[18, 20], [10, 17]]), max_len=20, cache_len=4
    )
    assert out[0, 0] == 0.5 and math.isnan(out[0, 1]) and out[1].tolist() == [0.0, 0.75]
    with pytest.raises(ValueError, match="cache_len"):
        filters.overlong_penalty(lengths, max_len=4, cache_len=8)


# ---- the trainer's overlong hook ---------------------------------------------------------------


def test_overlong_hook_soft_adds_dapos_penalty_to_each_rounds_rewards():
    from grouprl.train.filters import Overlong

    hook = Overlong.of("soft", max_new_tokens=10)  # L_cache = 10 // 5 = 2: ramp over 9..10
    assert (hook.max_len, hook.cache_len) == (10, 2)
    rewards = torch.tensor([[1.0, 1.0], [0.0, float("nan")]])  # [P=2, G=2]
    mask = torch.zeros(4, 10)
    for row, length in enumerate([8, 9, 10, 10]):
        mask[row, :length] = 1
    out = hook.rewards(rewards, mask)
    # lengths 8 (≤ 10-2: 0), 9 (-(9-8)/2 = -0.5), 10 (-1), 10 (NaN stays NaN)
    torch.testing.assert_close(out[:, :1], torch.tensor([[1.0], [-1.0]]))
    assert out[0, 1] == 0.5 and torch.isnan(out[1, 1])
    assert hook.mask(mask, torch.tensor([True, False, False, True])) is mask  # soft: no mask
    assert Overlong.of("soft", max_new_tokens=10, cache=4).cache_len == 4


def test_overlong_hook_mask_zeroes_truncated_rows_and_none_changes_nothing():
    from grouprl.train.filters import Overlong

    mask = torch.ones(3, 4)
    truncated = torch.tensor([False, True, False])
    out = Overlong.of("mask", max_new_tokens=4).mask(mask, truncated)
    assert out.sum(-1).tolist() == [4.0, 0.0, 4.0]
    rewards = torch.zeros(1, 3)
    assert Overlong.of("mask", max_new_tokens=4).rewards(rewards, mask) is rewards
    plain = Overlong.of(None, max_new_tokens=4)
    assert plain.mask(mask, truncated) is mask and plain.rewards(rewards, mask) is rewards
    with pytest.raises(ValueError, match=r"unknown overlong handling 'hard'; valid: None, mask"):
        Overlong.of("hard", max_new_tokens=4)
