"""``compute_tokens``'s contract beyond its values: a sequence-level estimator on tokens is
``compute`` on the sequence rewards (with the lengths and baseline it reads, its parameters
and the reward combination) broadcast over the mask; its statistics; the mask and token
tensors it accepts; parameter checks of the token estimators; ``token_names`` and
``group_std``. Written against the survivors of the mutation run (docs/mutation.md)."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import advantages

P, G, T = 2, 4, 3
R = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.4]], dtype=torch.float64)
MASK = torch.tensor(
    [
        [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]],
        [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]],
    ],
    dtype=torch.bool,
)
DENSE = torch.arange(P * G * T, dtype=torch.float64).reshape(P, G, T) / 100


def _same(a: advantages.Advantages, b: advantages.Advantages) -> None:
    for field in ("values", "keep", "kl_weight", "scale", "updated"):
        x, y = getattr(a, field), getattr(b, field)
        assert x is not None and y is not None, field
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12, msg=field)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("grpo", {"eps": 0.0}),  # the estimator's own parameter reaches it
        ("opo", {}),  # reads the completions' lengths
        ("remax", {"baseline": torch.tensor([0.5, 0.6], dtype=torch.float64)}),
    ],
)
def test_a_sequence_estimator_on_tokens_is_compute_broadcast_over_the_mask(name, kw):
    out = advantages.compute_tokens(name, R, MASK, **kw)
    seq = advantages.compute(name, R, lengths=MASK.sum(-1), **kw)
    _same(out, seq)
    torch.testing.assert_close(out.token_values, seq.values[..., None] * MASK, rtol=0, atol=0)
    assert out.stats["nan_frac"] == 0.0
    assert out.stats["updated_frac"] == pytest.approx(float(seq.updated.float().mean()))
    # a 0/1 float mask is the same mask
    again = advantages.compute_tokens(name, R, MASK.double() * 1.0, **kw)
    torch.testing.assert_close(again.token_values, out.token_values, rtol=0, atol=0)


def test_dense_token_rewards_as_a_score_or_as_a_return():
    # "score" (verl): the dense rewards' sum joins the sequence score before the estimator
    m = MASK.double()
    score = advantages.compute_tokens("grpo", R, MASK, token_rewards=DENSE)
    seq = advantages.compute("grpo", R + (DENSE * m).sum(-1))
    _same(score, seq)
    # "return" (OpenRLHF): the estimator on the outcome, plus the dense rewards' reward-to-go
    ret = advantages.compute_tokens("grpo", R, MASK, token_rewards=DENSE, token_rewards_as="return")
    base = advantages.compute("grpo", R)
    to_go = (DENSE * m).flip(-1).cumsum(-1).flip(-1) * m
    want = base.values[..., None] * m + to_go
    torch.testing.assert_close(ret.token_values, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret.values, want.sum(-1) / m.sum(-1), rtol=0, atol=1e-12)
    assert ret.keep is not None and ret.kl_weight is not None and ret.scale is not None


def test_combined_rewards_on_tokens_and_their_statistics():
    three = torch.stack([R, 1 - R], dim=-1)  # [P, G, 2] two reward functions
    three[0, 1, 0] = math.nan
    for how in ("sum", "normalize_then_sum"):
        out = advantages.compute_tokens("grpo", three, MASK, combine=how, reward_weights=[1.0, 0.5])
        seq = advantages.compute("grpo", three, combine=how, reward_weights=[1.0, 0.5])
        _same(out, seq)
        assert out.stats[f"combine/{how}"] == 1.0
    dense_sum = advantages.compute_tokens(
        "grpo", torch.stack([R, R], -1), MASK, combine="sum", token_rewards=DENSE
    )
    seq = advantages.compute("grpo", 2 * R + (DENSE * MASK).sum(-1))
    _same(dense_sum, seq)
    plain = advantages.compute_tokens("grpo", R, MASK)
    assert not any(k.startswith("combine/") for k in plain.stats)
    holed = R.clone()
    holed[1, 2] = math.nan  # one unscorable sample of 8
    assert advantages.compute_tokens("grpo", holed, MASK).stats["nan_frac"] == 1 / (P * G)


def test_masks_and_token_tensors_are_checked_and_named():
    with pytest.raises(ValueError, match=r"mask \[P, G, T\].*got \(2, 4\)"):
        advantages.compute_tokens("grpo", R, MASK[..., 0])
    with pytest.raises(ValueError, match=r"mask \[P, G, T\].*got \(2, 3, 3\)"):
        advantages.compute_tokens("grpo", R, MASK[:, :3])
    with pytest.raises(ValueError, match=r"mask \[P, G, T\].*got list"):
        advantages.compute_tokens("grpo", R, MASK.tolist())
    with pytest.raises(
        ValueError, match=r"token_rewards must have the mask's shape \(2, 4, 3\), got \(2, 4\)"
    ):
        advantages.compute_tokens("grpo", R, MASK, token_rewards=DENSE[..., 0])
    with pytest.raises(
        ValueError, match=r"token_rewards must have the mask's shape \(2, 4, 3\), got list"
    ):
        advantages.compute_tokens("grpo", R, MASK, token_rewards=DENSE.tolist())
    # a non-finite dense reward at a masked token is padding: accepted
    holed = DENSE.clone()
    holed[0, 1, 2] = math.nan
    advantages.compute_tokens("grpo", R, MASK, token_rewards=holed)
    holed[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="token_rewards"):
        advantages.compute_tokens("grpo", R, MASK, token_rewards=holed)
    with pytest.raises(ValueError, match="optimal token baseline only"):
        advantages.compute_tokens("grpo", R, MASK, is_weights=torch.ones(P, G, T))


def test_token_estimator_parameters():
    # eps and gamma at their bounds are valid; outside them an error names the parameter
    advantages.compute_tokens("reinforce_pp_baseline", R, MASK, eps=0.0)
    advantages.compute_tokens("reinforce_pp_global", R, MASK, gamma=0.0)
    advantages.compute_tokens("reinforce_pp_global", R, MASK, gamma=1.0)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        advantages.compute_tokens("reinforce_pp_baseline", R, MASK, eps=-1.0)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        advantages.compute_tokens("reinforce_pp_global", R, MASK, gamma=-0.1)


def test_results_follow_the_rewards_device_and_dtype_not_torchs_defaults():
    # float64 rewards with float32 dense rewards and a 0/1 float mask, under a default
    # device of "meta" and a default dtype of float32: every result is float64 on the CPU
    dense32, mask_f = DENSE.float(), MASK.float()
    with torch.device("meta"):
        outs = [
            advantages.compute_tokens("grpo", R, mask_f, token_rewards=dense32),
            advantages.compute_tokens(
                "grpo", R, mask_f, token_rewards=dense32, token_rewards_as="return"
            ),
            advantages.compute_tokens("reinforce_pp_baseline", R, mask_f, token_rewards=dense32),
            advantages.compute_tokens("reinforce_pp_global", R, mask_f),
        ]
    for out in outs:
        for t in (out.values, out.token_values):
            assert t.device.type == "cpu" and t.dtype == torch.float64, (t.device, t.dtype)


def test_token_names_lists_the_token_estimators_first_then_every_other_once():
    names = advantages.token_names()
    k = len(advantages.TOKEN_ESTIMATORS)
    assert names[:k] == list(advantages.TOKEN_ESTIMATORS)
    assert set(names) == set(advantages.TOKEN_ESTIMATORS) | set(advantages.names())
    assert len(names) == len(set(names))
    assert all(n in advantages.ESTIMATORS for n in names[k:])


def test_group_std_known_answers():
    rewards = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [1.0, math.nan, math.nan, 0.0], [0.5, math.nan, math.nan, math.nan]],
        dtype=torch.float64,
    )
    # ddof 1: [1,0,0,1] -> √(4·0.25/3); [1, 0] -> √0.5; one valid reward -> NaN
    got = advantages.group_std(rewards)
    assert got[:2].tolist() == pytest.approx([math.sqrt(1 / 3), math.sqrt(0.5)])
    assert math.isnan(got[2])
    # ddof 0: [1,0,0,1] -> 0.5; [1, 0] -> 0.5; two valid rewards are still a std
    got0 = advantages.group_std(rewards, ddof=0)
    assert got0[:2].tolist() == pytest.approx([0.5, 0.5]) and math.isnan(got0[2])
    assert advantages.group_std(torch.tensor([[2.0, 2.0, 2.0]]))[0] == 0.0
    with pytest.raises(ValueError, match="infinite"):
        advantages.group_std(torch.tensor([[1.0, math.inf]]))
