"""The token estimators' column layout ``[T, N]`` (advantages/tokens.py): the last-token
index in every integer width, the discount factors by bits and by ``masked_fill`` (types
without an integer twin), garbage at masked tokens, and the whitening's precision at a
large batch, each against a plain reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import advantages
from grouprl.advantages import tokens


def _last_by_hand(mask: torch.Tensor) -> list[int]:
    out = []
    for row in mask.reshape(-1, mask.shape[-1]).tolist():
        hits = [t for t, v in enumerate(row) if v]
        out.append(hits[-1] if hits else -1)
    return out


@pytest.mark.parametrize("t", [1, 16, 254, 255, 300])
def test_the_last_token_of_each_sample_in_every_integer_width(t):
    # uint8 below 255 positions, int16 above: the index is right either side of the switch
    gen = torch.Generator().manual_seed(t)
    mask = torch.rand(5, 4, t, generator=gen) < 0.3
    mask[0, 0] = False  # an empty completion: -1
    mask[0, 1] = False
    mask[0, 1, t - 1] = True  # only the last position
    mask[1, 0] = True  # every position
    got = tokens._last_token(tokens._mask_columns(mask))
    assert got.tolist() == _last_by_hand(mask)
    assert got.dtype == torch.long


def _rtg_by_hand(x: list[float], m: list[bool], gamma: float) -> list[float]:
    out, run = [0.0] * len(x), 0.0
    for t in range(len(x) - 1, -1, -1):
        if m[t]:
            run = x[t] + gamma * run
            out[t] = run
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.0])
def test_reward_to_go_by_hand_in_every_float_type(dtype, gamma):
    # float16 and bfloat16 have no integer twin in the bit masks: masked_fill builds the
    # discount factors there; the values are multiples of 1/8, exact in every type
    x = torch.tensor([[0.5, 0.25, 0.125, 1.0, 0.5], [1.0, 0.0, 0.5, 0.25, 0.125]], dtype=dtype)
    x[1, 1] = math.nan  # garbage at a masked token: never read
    m = torch.tensor([[True, False, True, True, False], [True, False, True, False, True]])
    want = [
        _rtg_by_hand([0.0 if not v else float(a) for a, v in zip(xr, mr)], mr, gamma)
        for xr, mr in zip(x.tolist(), m.tolist())
    ]
    got = tokens.reward_to_go(x, m, gamma)
    assert got.dtype == dtype
    assert got.double().tolist() == want


def test_the_estimator_reads_no_masked_token_and_counts_the_outcome_once():
    # token rewards passed to the estimator directly (not through compute_tokens' check)
    # may hold anything at masked tokens; the outcome sits on the last valid token only
    r = torch.tensor([[1.0, 0.0], [0.5, 1.0]], dtype=torch.float64)
    mask = torch.tensor(
        [[[1, 1, 0], [1, 0, 1]], [[0, 0, 0], [1, 1, 1]]], dtype=torch.bool
    )  # a hole, an empty completion
    dense = torch.full((2, 2, 3), -0.25, dtype=torch.float64)
    dense[~mask] = math.inf
    out = tokens.reinforce_pp_global_tokens(r, None, mask, dense, gamma=0.5)
    ret = {}
    for p in range(2):
        for g in range(2):
            xs = [(-0.25 if mask[p, g, t] else 0.0) for t in range(3)]
            last = _last_by_hand(mask[p, g][None, None])[0]
            if last >= 0:
                xs[last] += float(r[p, g])
            for t, v in enumerate(_rtg_by_hand(xs, mask[p, g].tolist(), 0.5)):
                if mask[p, g, t]:
                    ret[p, g, t] = v
    vals = list(ret.values())
    mu = sum(vals) / len(vals)
    s = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1) + 1e-8)
    want = torch.zeros(2, 2, 3, dtype=torch.float64)
    for k, v in ret.items():
        want[k] = (v - mu) / s
    torch.testing.assert_close(out.token_values, want, rtol=0, atol=1e-12)
    seq = torch.tensor(
        [
            [sum(want[p, g].tolist()) / max(1, int(mask[p, g].sum())) for g in range(2)]
            for p in range(2)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out.values, seq, rtol=0, atol=1e-12)
    assert out.stats["batch_mean"] == pytest.approx(mu, abs=1e-12)


def test_a_nan_reward_sample_leaves_the_statistics_but_not_the_others_returns():
    r = torch.tensor([[1.0, math.nan, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, 2, dtype=torch.bool)
    out = advantages.compute_tokens("reinforce_pp_global", r, mask, gamma=0.5)
    alone = advantages.compute_tokens(
        "reinforce_pp_global", r[:, [0, 2]], mask[:, [0, 2]], gamma=0.5
    )
    torch.testing.assert_close(out.token_values[:, [0, 2]], alone.token_values, rtol=0, atol=0)
    assert out.token_values[0, 1].tolist() == [0.0, 0.0]
    assert out.values[0, 1] == 0.0


def test_the_whitening_of_a_million_float32_tokens_is_as_precise_as_float64s():
    # Σ (x − μ)² row by row keeps float32 within its rounding of a float64 run (a float32
    # vector_norm of the same tokens was 3e-5 off)
    gen = torch.Generator().manual_seed(0)
    p, g, t = 8192, 8, 16
    r = (torch.rand(p, g, generator=gen) < 0.4).double()
    lengths = torch.randint(1, t + 1, (p, g), generator=gen)
    mask = torch.arange(t)[None, None, :] < lengths[..., None]
    dense = -0.01 * torch.rand(p, g, t, generator=gen, dtype=torch.float64) + 3.0
    kw = dict(token_rewards=dense, gamma=0.99)
    hi = advantages.compute_tokens("reinforce_pp_global", r, mask, **kw)
    lo = advantages.compute_tokens("reinforce_pp_global", r.float(), mask, **kw)
    assert lo.scale[0].item() == pytest.approx(hi.scale[0].item(), rel=5e-7)
    assert lo.stats["batch_mean"] == pytest.approx(hi.stats["batch_mean"], rel=5e-7)
    torch.testing.assert_close(lo.token_values.double(), hi.token_values, rtol=0, atol=1e-5)
