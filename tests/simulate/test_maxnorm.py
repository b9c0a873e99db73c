"""The MaxNorm accuracy simulation's pieces against hand answers, sampling and properties.

No test reads the simulation's own verdicts: the reward of hand-built answers, the exact
accuracy against Monte Carlo, the world's jitter and gaps against the Protocol's resolution,
and the multi-token reading of the gradient diagnostics against the one-token one.
"""

import math

import pytest
import torch

from grouprl import advantages
from grouprl.simulate import maxnorm as mn
from grouprl.simulate.low_variance import subset_gradients


def test_reward_by_hand():
    # κ = 0.1, L = 4: all right → 0.9 + 0.1 = 1; three right → 0.1·3/4 = 0.075; none → 0.
    right = torch.tensor([[0, 1, 2, 3]])
    acts = torch.tensor([[[0, 1, 2, 3, 5], [0, 1, 2, 0, 0], [1, 2, 3, 4, 7], [0, 1, 2, 3, 0]]])
    value, correct = mn.rewards_of(acts, right, 0.1)
    assert value[0].tolist() == pytest.approx([1.0, 0.075, 0.0, 1.0])
    assert correct.tolist() == [[1.0, 0.0, 0.0, 1.0]]  # the last token (the form) is ignored


def test_exact_accuracy_matches_sampling():
    cfg = mn.MaxNormConfig(prompts=16, test_prompts=8)
    world = mn.make_world(cfg, torch.Generator().manual_seed(3))
    theta, shape = mn._params(world, cfg, torch.Generator().manual_seed(4))
    with torch.no_grad():
        theta[shape[0] :] = 0.3 * torch.randn(theta.numel() - shape[0], dtype=torch.float64)
    a, b = mn._views(theta.detach(), shape)
    rows = torch.arange(world.x.shape[0])
    acc, credit = mn.accuracy(world, rows, a, b)
    lsm = mn._logits(world, rows, a, b)  # [Q, L + 1, K]
    n = 4000
    gen = torch.Generator().manual_seed(5)
    act = torch.multinomial(lsm.exp().reshape(-1, lsm.shape[-1]), n, True, generator=gen)
    act = act.view(len(rows), lsm.shape[1], n).transpose(1, 2)  # [Q, n, L + 1]
    _, correct = mn.rewards_of(act, world.right[rows], cfg.credit)
    hits = (act[..., : cfg.slots] == world.right[rows][:, None]).double().mean((1, 2))
    se = math.sqrt(acc * (1 - acc) / (n * len(rows)))
    assert abs(float(correct.mean()) - acc) < 4 * se
    assert abs(float(hits.mean()) - credit) < 4 * math.sqrt(0.25 / (n * len(rows)))


def test_world_jitter_is_sub_resolution_and_gaps_credible():
    cfg = mn.MaxNormConfig()
    world = mn.make_world(cfg, torch.Generator().manual_seed(0))
    s = world.jitter
    on = s > 0
    assert abs(float(on.double().mean()) - cfg.jitter_share) < 0.03
    assert float(s[on].min()) >= cfg.jitter_lo and float(s.max()) <= 3e-3 < 1e-2 / 3
    assert cfg.credit / cfg.slots == pytest.approx(0.025)  # one right slot: 2.5·δ_res


def test_protocol_keeps_the_credit_gap_and_drops_the_jitter():
    # the largest jitter of the world (3e-3) on a group with two credit levels 0.025 apart:
    # the Protocol restores the two levels exactly, and a one-level group is skipped.
    gen = torch.Generator().manual_seed(0)
    levels = torch.tensor([0.05] * 15 + [0.075], dtype=torch.float64)
    noisy = torch.stack([levels, torch.full((16,), 0.05, dtype=torch.float64)])
    noisy = noisy + 3e-3 * torch.randn(2, 16, generator=gen, dtype=torch.float64)
    out = advantages.compute("maxnorm_rloo", noisy, delta_res=1e-2)
    assert out.keep.tolist() == [True, False]
    clean = advantages.compute("maxnorm_rloo", levels[None])
    assert out.values[0].tolist() == pytest.approx(clean.values[0].tolist(), abs=1e-12)
    assert out.values[0].abs().max() == pytest.approx(1.0)  # the outlier gets the full unit


def test_multi_token_diagnostics_reduce_to_the_one_token_case():
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    lp = torch.nn.functional.logsigmoid(x @ w)  # [S, G]
    ref = torch.randn(3, 4, dtype=torch.float64).clamp_max(-0.1)
    adv, card = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    one = subset_gradients(w, lp, ref, adv, card, 0.5)
    many = subset_gradients(w, lp[..., None], ref[..., None], adv, card, 0.5)
    assert many == pytest.approx(one)


def test_two_tokens_average_like_the_loss():
    # token mean: a second, identical token per answer leaves every ratio and cosine unchanged
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    lp = torch.nn.functional.logsigmoid(x @ w)
    ref = torch.full((3, 4), -0.7, dtype=torch.float64)
    adv, card = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    one = subset_gradients(w, lp, ref, adv, card, 0.5)
    two = subset_gradients(
        w, torch.stack([lp, lp], -1), torch.stack([ref, ref], -1), adv, card, 0.5
    )
    assert two == pytest.approx(one)


def test_bad_world_is_refused_with_the_field():
    with pytest.raises(ValueError, match="options >= 2"):
        mn.make_world(mn.MaxNormConfig(options=1), torch.Generator())
    with pytest.raises(ValueError, match="credit must be in"):
        mn.make_world(mn.MaxNormConfig(credit=1.5), torch.Generator())
    world = mn.make_world(mn.QUICK, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        mn.train("nope", world, mn.QUICK, seed=0)
