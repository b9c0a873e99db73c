"""Parity with verl 0.9's own functions for the peers' methods (core_algos.py).

Each case feeds the same batch to verl's function and to ours: random rewards, G = 2, groups
whose rewards are all equal, ragged completion lengths (token masks) and, for NaN, verl run
on the batch without the NaN samples (verl has no NaN rule; ours leaves them out of every
statistic, which must equal dropping them) while ours gives them 0. Where verl and ours
differ by design (singleton groups, collapsed groups) the parameter that reproduces verl is
named in the call and the default is tested apart.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grouprl import advantages
from grouprl.control import AdaptiveKLController, FixedKLController

pytestmark = pytest.mark.peer
core = pytest.importorskip("verl.trainer.ppo.core_algos")

T = 7
CASES = ["random", "g2", "equal", "nan"]


def batch(case: str, seed: int = 0, p: int = 6, g: int = 4):
    """``(rewards [P, G] float64, mask [P, G, T] bool)`` for one parity case."""
    rng = np.random.default_rng(seed)
    if case == "g2":
        g = 2
    r = np.where(rng.random((p, g)) < 0.5, rng.integers(0, 2, (p, g)), rng.random((p, g)))
    if case == "equal":
        r[0] = 1.0
        r[1] = 0.0
        r[2] = 0.25
    if case == "nan":
        r[rng.random((p, g)) < 0.25] = np.nan
        r[:, :2] = np.where(np.isnan(r[:, :2]), 0.5, r[:, :2])  # >= 2 valid per group
        r[0, 0], r[0, 1] = 0.0, 1.0
    lengths = rng.integers(1, T + 1, (p, g))
    mask = torch.arange(T)[None, None, :] < torch.tensor(lengths)[..., None]
    return torch.tensor(r, dtype=torch.float64), mask


def flat(rewards, mask, dense=None):
    """verl's view: ``(token_level_rewards [N, T], response_mask [N, T], index [N], keep [N])``
    without the NaN samples (``keep`` marks the rows of the [P·G] batch that remain)."""
    p, g = rewards.shape
    keep = ~torch.isnan(rewards).reshape(-1)
    m = mask.reshape(p * g, -1).double()
    tok = advantages.tokens.outcome_to_tokens(rewards, mask).reshape(p * g, -1)
    if dense is not None:
        tok = tok + dense.reshape(p * g, -1) * m
    index = np.repeat(np.array([f"uid-{i}" for i in range(p)], dtype=object), g)
    return tok[keep], m[keep], index[keep.numpy()], keep


def spread(values_kept, keep, t=None):
    """verl's rows back into the full [P·G(, T)] layout, 0 where a NaN sample was dropped."""
    shape = (keep.shape[0],) if t is None else (keep.shape[0], t)
    out = torch.zeros(shape, dtype=values_kept.dtype)
    out[keep] = values_kept
    return out


def cfg(**kw):
    d = {"norm_adv_by_std_in_grpo": True, "gamma": 1.0, **kw}
    ns = SimpleNamespace(**d)
    ns.get = lambda k, default=None: d.get(k, default)
    return ns


def close(ours, theirs, atol=1e-6):
    torch.testing.assert_close(ours.double(), theirs.double(), atol=atol, rtol=1e-6)


# --------------------------------------------------------------------------- REINFORCE++
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_tokens(case, gamma):
    rewards, mask = batch(case, 1)
    dense = -0.05 * torch.rand(
        mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    tok, m, _, keep = flat(rewards, mask, dense)
    want, _ = core.compute_reinforce_plus_plus_outcome_advantage(tok, m, config=cfg(gamma=gamma))
    out = advantages.compute_tokens(
        "reinforce_pp_global", rewards, mask, token_rewards=dense, gamma=gamma
    )  # defaults = verl's masked_whiten: eps_mode "var", eps 1e-8, ddof 1
    close(out.per_token, spread(want, keep, T))


@pytest.mark.parametrize("case", CASES)
def test_reinforce_plus_plus_outcome_equals_sample_level_token_weighted(case):
    rewards, mask = batch(case, 2)
    tok, m, _, keep = flat(rewards, mask)
    want, _ = core.compute_reinforce_plus_plus_outcome_advantage(tok, m, config=cfg())
    out = advantages.compute(
        "reinforce_pp_global",
        rewards,
        lengths=mask.sum(-1),
        weighting="token",
        eps_mode="var",
        eps=1e-8,
    )
    close((out.values[..., None] * mask).reshape(-1, T), spread(want, keep, T))


@pytest.mark.parametrize("case", CASES)
def test_reinforce_plus_plus_baseline(case):
    rewards, mask = batch(case, 3)
    tok, m, index, keep = flat(rewards, mask)
    want, _ = core.compute_reinforce_plus_plus_baseline_outcome_advantage(tok, m, index)
    out = advantages.compute(
        "reinforce_pp_baseline",
        rewards,
        lengths=mask.sum(-1),
        weighting="token",
        eps_mode="var",
        eps=1e-8,
        zero_collapsed=False,
    )
    close((out.values[..., None] * mask).reshape(-1, T), spread(want, keep, T))
    # the token path with dense rewards, verl's "score" reading
    dense = -0.05 * torch.rand(mask.shape, dtype=torch.float64)
    tok, m, index, keep = flat(rewards, mask, dense)
    want, _ = core.compute_reinforce_plus_plus_baseline_outcome_advantage(tok, m, index)
    out = advantages.compute_tokens(
        "reinforce_pp_baseline", rewards, mask, token_rewards=dense, zero_collapsed=False
    )
    close(out.per_token, spread(want, keep, T))


def test_reinforce_pp_baseline_default_zeroes_collapsed_groups_verl_shifts_them():
    rewards, mask = batch("equal", 3)
    ours = advantages.compute(
        "reinforce_pp_baseline",
        rewards,
        lengths=mask.sum(-1),
        weighting="token",
        eps_mode="var",
        eps=1e-8,
    )
    assert (ours.values[:3] == 0).all()
    tok, m, index, _ = flat(rewards, mask)
    want, _ = core.compute_reinforce_plus_plus_baseline_outcome_advantage(tok, m, index)
    assert want[:12].abs().max() > 1e-3  # verl: (0 - token mean)/s, non-zero


# --------------------------------------------------------------------------- grpo_passk, opo, gpg
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(case, norm):
    rewards, mask = batch(case, 4)
    tok, m, index, keep = flat(rewards, mask)
    want, _ = core.compute_grpo_passk_outcome_advantage(
        tok, m, index, config=cfg(norm_adv_by_std_in_grpo=norm)
    )
    out = advantages.compute("grpo_passk", rewards, norm_by_std=norm)
    close(out.values.reshape(-1), spread(want[:, 0], keep))


@pytest.mark.parametrize("case", CASES)
def test_opo(case):
    rewards, mask = batch(case, 5)
    tok, m, index, keep = flat(rewards, mask)
    want, _ = core.compute_opo_outcome_advantage(tok, m, index)
    out = advantages.compute("opo", rewards, lengths=mask.sum(-1))
    close(out.values.reshape(-1), spread(want[:, 0], keep))


@pytest.mark.parametrize("case", CASES)
def test_gpg_verl_reading(case):
    rewards, mask = batch(case, 6)
    tok, m, index, keep = flat(rewards, mask)
    want, _ = core.compute_gpg_outcome_advantage(tok, m, index)
    out = advantages.compute("gpg", rewards, alpha="verl")
    close(out.values.reshape(-1), spread(want[:, 0], keep))


def test_gpg_paper_and_verl_readings_differ_as_documented():
    # 2 groups of 4: [1, 0, 0, 0] (live) and [0, 0, 0, 0] (collapsed: its 4 samples have A = 0)
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    paper = advantages.compute("gpg", r)  # alpha = B/(B - M) = 8/(8 - 4) = 2
    verl = advantages.compute("gpg", r, alpha="verl")  # alpha = B/#(r != 0) = 8/1 = 8
    assert paper.stats["gpg_alpha"] == 2.0 and verl.stats["gpg_alpha"] == 8.0
    assert paper.values[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert verl.values[0].tolist() == pytest.approx([6.0, -2.0, -2.0, -2.0])
    tok, m, index, _ = flat(r, torch.ones(2, 4, 3, dtype=torch.bool))
    want, _ = core.compute_gpg_outcome_advantage(tok, m, index)
    assert want[:4, 0].tolist() == pytest.approx([6.0, -2.0, -2.0, -2.0])


# --------------------------------------------------------------------------- ReMax
@pytest.mark.parametrize("case", CASES)
def test_remax(case):
    rewards, mask = batch(case, 7)
    base = torch.tensor(np.random.default_rng(7).random(rewards.shape[0]))
    dense = -0.05 * torch.rand(mask.shape, dtype=torch.float64)
    tok, m, _, keep = flat(rewards, mask, dense)
    per_sample = base.repeat_interleave(rewards.shape[1])[keep]  # verl repeats the batch
    want, _ = core.compute_remax_outcome_advantage(tok, per_sample, m)
    # token level: verl's returns minus the baseline ("return" reading, remax's default)
    out = advantages.compute_tokens("remax", rewards, mask, token_rewards=dense, baseline=base)
    close(out.per_token, spread(want, keep, T))
    # outcome only: the sample-level estimator broadcast
    tok, m, _, keep = flat(rewards, mask)
    want, _ = core.compute_remax_outcome_advantage(tok, per_sample, m)
    out = advantages.compute("remax", rewards, baseline=base)
    close((out.values[..., None] * mask).reshape(-1, T), spread(want, keep, T))


# --------------------------------------------------------------------------- GDPO
def _verl_gdpo(r3, mask, weights, keep_rows=None):
    p, g, k = r3.shape
    n = p * g
    lp = 3
    lengths = mask.reshape(n, -1).sum(-1)
    attention = torch.cat([torch.ones(n, lp), mask.reshape(n, -1).float()], 1).long()
    keys = [f"r{i}" for i in range(k)]
    nt = {key: r3[..., i].reshape(-1).numpy() for i, key in enumerate(keys)}
    index = np.repeat(np.array([f"uid-{i}" for i in range(p)], dtype=object), g)
    rows = torch.ones(n, dtype=torch.bool) if keep_rows is None else keep_rows
    nt = {key: v[rows.numpy()] for key, v in nt.items()}
    c = cfg(gdpo_reward_keys=keys, gdpo_reward_weights=list(weights))
    m = mask.reshape(n, -1).double()[rows]
    batch_ = {"prompts": torch.zeros(int(rows.sum()), lp), "attention_mask": attention[rows]}
    assert (lengths > 0).all()
    want, _ = core.compute_gdpo_outcome_advantage(
        torch.zeros_like(m), m, index[rows.numpy()], config=c, non_tensor_batch=nt, batch=batch_
    )
    return want


@pytest.mark.parametrize("case", CASES)
def test_gdpo(case):
    r1, mask = batch(case, 8)
    r2, _ = batch(case, 9)
    if case == "nan":  # a sample is unscorable when every function is NaN
        r2 = torch.where(torch.isnan(r1), torch.full_like(r2, math.nan), r2.nan_to_num(0.3))
    # verl reads float32 scores: rewards on a 1/8 grid are exact there, so what remains is
    # float32 arithmetic (a G = 2 group of near-equal continuous rewards would amplify it)
    r3 = torch.round(torch.stack([r1, r2], -1) * 8) / 8
    weights = [1.0, 0.5]
    keep = ~torch.isnan(r1).reshape(-1)
    want = _verl_gdpo(r3.float(), mask, weights, keep)
    out = advantages.compute(
        "gdpo",
        r3,
        reward_weights=weights,
        combine_params={"eps": 1e-6},
        lengths=mask.sum(-1),
        weighting="token",
        eps_mode="var",
        eps=1e-8,
        zero_collapsed=False,
    )
    ours = (out.values[..., None] * mask).reshape(-1, T)
    close(ours, spread(want.double(), keep, T), atol=1e-5)


# --------------------------------------------------------------------------- optimal token baseline
def _otb_inputs(mask, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*mask.shape, 11, generator=g, dtype=torch.float64) * 2
    logp_all = torch.log_softmax(logits, -1)
    tok = torch.randint(0, 11, mask.shape, generator=g)
    old_logp = logp_all.gather(-1, tok[..., None]).squeeze(-1)
    sum_pi2 = logp_all.exp().square().sum(-1)
    return old_logp, sum_pi2


def _holed(mask, seed):
    """A multi-turn mask: tool-output holes inside some completions."""
    rng = np.random.default_rng(seed)
    m = mask.clone()
    holes = torch.tensor(rng.random(mask.shape) < 0.2) & mask
    holes[..., 0] = False
    return m & ~holes


def _verl_otb(name):
    """verl's function for one of our two optimal token baselines."""
    if name == "optimal_token_baseline":
        return core.compute_optimal_token_baseline_advantage
    return core.compute_multi_turn_optimal_token_baseline_advantage


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baseline(case, name, zero_tail):
    rewards, mask = batch(case, 10)
    if name == "tir_optimal_token_baseline":
        mask = _holed(mask, 10)
    old_logp, sum_pi2 = _otb_inputs(mask, 10)
    dense = -0.02 * torch.rand(mask.shape, dtype=torch.float64)
    isw = 0.5 + torch.rand(mask.shape, dtype=torch.float64)
    tok, m, index, keep = flat(rewards, mask, dense)
    fn = _verl_otb(name)
    n = rewards.numel()
    want, _ = fn(
        tok,
        m,
        index,
        old_logp.reshape(n, T)[keep],
        sum_pi2.reshape(n, T)[keep],
        rollout_is_weights=isw.reshape(n, T)[keep],
        handle_zero_tail=zero_tail,
    )
    out = advantages.compute_tokens(
        name,
        rewards,
        mask,
        token_rewards=dense,
        old_logp=old_logp,
        sum_pi_squared=sum_pi2,
        is_weights=isw,
        handle_zero_tail=zero_tail,
        zero_collapsed=False,
    )
    close(out.per_token, spread(want, keep, T))


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baselines_zero_tail_at_a_tie_and_at_an_empty_second_longest(name):
    # group 0: two longest completions of 3 valid tokens each, holes in different places, both
    # with a token at position 3: a tie, so no zero tail (verl: ``max_length_idx.numel() == 1``
    # fails). Group 1: valid lengths 3 and 0 beside a NaN sample of 2 tokens: the
    # second-longest valid length is 0, so the longest's whole baseline is 0 (the NaN sample's
    # tokens do not count; verl never sees it). Hand-picked masks the random cases never draw.
    rewards = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.5, math.nan]], dtype=torch.float64)
    rows = [[1, 0, 1, 1], [1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    mask = torch.tensor(rows, dtype=torch.bool).reshape(2, 3, 4)
    old_logp, sum_pi2 = _otb_inputs(mask, 12)
    tok, m, index, keep = flat(rewards, mask)
    fn = _verl_otb(name)
    n = rewards.numel()
    want, _ = fn(tok, m, index, old_logp.reshape(n, 4)[keep], sum_pi2.reshape(n, 4)[keep])
    out = advantages.compute_tokens(
        name, rewards, mask, old_logp=old_logp, sum_pi_squared=sum_pi2, zero_collapsed=False
    )
    close(out.per_token, spread(want, keep, 4))
    # the longest of group 1 keeps its whole return (baseline 0): 1 on each of its tokens
    assert out.token_values[1, 0].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_otb_on_prefix_masks_equals_tir():
    rewards, mask = batch("random", 11)
    old_logp, sum_pi2 = _otb_inputs(mask, 11)
    kw = dict(old_logp=old_logp, sum_pi_squared=sum_pi2)
    a = advantages.compute_tokens("optimal_token_baseline", rewards, mask, **kw)
    b = advantages.compute_tokens("tir_optimal_token_baseline", rewards, mask, **kw)
    torch.testing.assert_close(a.token_values, b.token_values)


# --------------------------------------------------------------------------- KL in the reward
def test_kl_controllers_equal_verls():
    ours = AdaptiveKLController(coef=0.05, target=0.1, horizon=500)
    theirs = core.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=500)
    for kl, n in [(0.3, 64), (0.01, 64), (0.1, 32), (0.5, 128), (0.12, 8)]:
        ours.update(kl, n)
        theirs.update(kl, n)
        assert ours.value == pytest.approx(theirs.value, rel=1e-12)
    fixed = FixedKLController(coef=0.02)
    fixed.update(5.0, 100)
    assert fixed.value == core.FixedKLController(kl_coef=0.02).value == 0.02


@pytest.mark.parametrize(("ours", "verl_name"), [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_reward_equals_verl_apply_kl_penalty(ours, verl_name):
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty

    rewards, mask = batch("random", 12)
    n = rewards.numel()
    g = torch.Generator().manual_seed(12)
    old = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    ref = old + 0.3 * torch.randn(n, T, generator=g, dtype=torch.float64)
    m = mask.reshape(n, T)
    scores = advantages.tokens.outcome_to_tokens(rewards, mask).reshape(n, T)
    data = DataProto.from_dict(
        {
            "token_level_scores": scores,
            "old_log_probs": old,
            "ref_log_prob": ref,
            "response_mask": m.double(),
        }
    )
    ctrl_theirs = core.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.05, horizon=100)
    data, metrics = apply_kl_penalty(data, ctrl_theirs, kl_penalty=verl_name)
    ctrl_ours = AdaptiveKLController(coef=0.2, target=0.05, horizon=100)
    dense, current = advantages.kl_reward(old, ref, m, ctrl_ours.value, ours)
    ctrl_ours.update(current, n)
    close(scores + dense, data.batch["token_level_rewards"])
    assert current == pytest.approx(metrics["actor/reward_kl_penalty"], rel=1e-9)
    assert ctrl_ours.value == pytest.approx(ctrl_theirs.value, rel=1e-12)


def test_kl_in_reward_then_grpo_equals_verl_grpo_on_penalised_rewards():
    # verl's use_kl_in_reward + an outcome estimator: the score is the sum of the penalised
    # token rewards; ours: compute_tokens with the dense KL rewards ("score" reading)
    rewards, mask = batch("random", 13)
    n = rewards.numel()
    g = torch.Generator().manual_seed(13)
    old = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    ref = old + 0.3 * torch.randn(n, T, generator=g, dtype=torch.float64)
    dense, _ = advantages.kl_reward(old, ref, mask.reshape(n, T), 0.1)
    dense = dense.view(mask.shape)
    tok, m, index, keep = flat(rewards, mask, dense)
    want, _ = core.compute_grpo_outcome_advantage(tok, m, index)
    out = advantages.compute_tokens("grpo", rewards, mask, token_rewards=dense)
    close(out.per_token, spread(want, keep, T))
