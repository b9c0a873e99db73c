"""The registered ``grouprl_<name>`` called the way verl's own unit tests call verl's functions.

verl's ``tests/trainer/ppo/`` call its estimators with keyword arguments (``epsilon``,
``norm_adv_by_std_in_grpo``), without ``index`` where verl's function takes none, in float64
with tolerances down to 1e-12, and read the second output (``returns``). Each test here calls
verl's installed function as the reference on the same tensors.
"""

import warnings

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.peer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from omegaconf import OmegaConf  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from grouprl import advantages  # noqa: E402
from grouprl.integrations import verl as gv  # noqa: E402

N, T = 24, 7


def batch(seed, dtype=torch.float64, groups=6, outcome=False):
    """verl-style flat batch: ``uid`` runs of ``N / groups``, right-padded masks.

    ``outcome``: one score on the last valid token (verl's reward managers); otherwise dense
    token rewards (e.g. with verl's KL in the reward).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    if outcome:
        tlr = torch.zeros(N, T, dtype=dtype)
        tlr[torch.arange(N), lengths - 1] = torch.randint(0, 3, (N,), generator=g).to(dtype) / 2
    else:
        tlr = torch.randn(N, T, generator=g, dtype=dtype) * mask
    index = np.array([f"u{i * groups // N}" for i in range(N)], dtype=object)
    return tlr, mask, index


def ours(name):
    return core_algos.get_adv_estimator_fn(f"grouprl_{name}")


# --------------------------------------------------------------------------- (a) keywords
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("epsilon", [1e-6, 1e-2])
def test_grpo_honours_norm_adv_by_std_in_grpo_and_epsilon(norm, epsilon):
    tlr, mask, index = batch(0)
    kw = {"norm_adv_by_std_in_grpo": norm, "epsilon": epsilon}
    want, want_ret = core_algos.compute_grpo_outcome_advantage(tlr, mask, index, **kw)
    got, got_ret = ours("grpo")(tlr, mask, index, **kw)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_ret, want_ret, atol=1e-12, rtol=1e-12)


def test_norm_adv_by_std_in_grpo_from_the_config_reaches_grpo_and_grpo_passk():
    tlr, mask, index = batch(1, outcome=True)
    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": False})
    want, _ = core_algos.compute_grpo_outcome_advantage(
        tlr, mask, index, norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(ours("grpo")(tlr, mask, index, config=cfg)[0], want)
    for norm in (True, False):
        cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": norm})
        want, _ = core_algos.compute_grpo_passk_outcome_advantage(tlr, mask, index, config=cfg)
        got, _ = ours("grpo_passk")(tlr, mask, index, config=cfg)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_a_keyword_the_estimator_cannot_honour_is_refused_by_name():
    tlr, mask, index = batch(2)
    with pytest.raises(ValueError, match="does not take lam"):
        ours("grpo")(tlr, mask, index, lam=0.95)
    with pytest.raises(ValueError, match="grouprl_rloo has no epsilon"):
        ours("rloo")(tlr, mask, index, epsilon=1e-6)
    with pytest.raises(ValueError, match="does not take reward_baselines"):
        ours("grpo")(tlr, mask, index, reward_baselines=torch.zeros(N))
    with pytest.raises(ValueError, match="norm_adv_by_std_in_grpo=False does not change"):
        ours("grpo_beta_comp")(tlr, mask, index, norm_adv_by_std_in_grpo=False)


# --------------------------------------------------------------------------- (b) dtype
@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "reinforce_pp_baseline"])
def test_float64_is_computed_in_float64(name):
    tlr, mask, index = batch(3)
    fn = {
        "grpo": core_algos.compute_grpo_outcome_advantage,
        "rloo": core_algos.compute_rloo_outcome_advantage,
        "opo": core_algos.compute_opo_outcome_advantage,
        "reinforce_pp_baseline": core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage,
    }[name]
    want, _ = fn(tlr, mask, index, config=OmegaConf.create({"gamma": 1.0}))
    got, _ = ours(name)(tlr, mask, index, config=OmegaConf.create({"gamma": 1.0}))
    assert got.dtype == torch.float64
    # verl's masked_whiten divides by (count + 1e-8): ≤ |x|·1e-8/count off the exact mean
    tol = 1e-9 if name == "reinforce_pp_baseline" else 1e-12
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_float32_stays_float32():
    tlr, mask, index = batch(3, dtype=torch.float32)
    got, ret = ours("grpo")(tlr, mask, index)
    assert got.dtype == ret.dtype == torch.float32


# --------------------------------------------------------------------------- (c), (d)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_global_without_index_returns_verls_advantages_and_returns(gamma):
    tlr, mask, _ = batch(4)
    mask[3, 2] = 0.0  # a hole (tool output): the return is carried through it
    tlr = tlr * mask
    cfg = OmegaConf.create({"gamma": gamma})
    want, want_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(tlr, mask, config=cfg)
    got, got_ret = ours("reinforce_pp_global")(tlr, mask, config=cfg)
    torch.testing.assert_close(got_ret, want_ret, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)  # masked_whiten's +1e-8
    assert not torch.equal(got, got_ret)


def test_return_to_go_hand_case():
    # rewards [1, 2, 4] on three valid tokens, γ = 0.5: G = [1 + 0.5·(2 + 0.5·4), 2 + 2, 4]
    tlr = torch.tensor([[1.0, 2.0, 4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    tlr2 = torch.cat([tlr, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)])
    mask2 = torch.cat([mask, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)])
    _, ret = ours("reinforce_pp_global")(tlr2, mask2, config=OmegaConf.create({"gamma": 0.5}))
    assert ret[0].tolist() == [3.0, 4.0, 4.0, 0.0]


def test_reinforce_pp_baseline_returns_its_advantages_as_verl_does():
    tlr, mask, index = batch(5, outcome=True)
    want, want_ret = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        tlr, mask, index
    )
    got, got_ret = ours("reinforce_pp_baseline")(tlr, mask, index)
    assert torch.equal(got, got_ret) and torch.equal(want, want_ret)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_remax_without_index_on_outcome_rewards_equals_verls():
    tlr, mask, index = batch(6, outcome=True)
    by_uid = {u: k / 4 for k, u in enumerate(dict.fromkeys(index))}
    base = torch.tensor([by_uid[u] for u in index], dtype=torch.float64)
    want, want_ret = core_algos.compute_remax_outcome_advantage(tlr, base, mask)
    for idx in (None, index):  # verl's trainer passes uid when it has it
        got, got_ret = ours("remax")(tlr, mask, index=idx, reward_baselines=base)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(got_ret, want_ret, atol=1e-12, rtol=1e-12)


def test_remax_on_dense_rewards_is_sequence_level_where_verls_is_reward_to_go():
    # the two readings: ours A = (Σ_t r_t − b)·m at every token (ReMax Alg. 1, one reward
    # per sequence); verl's A_t = Σ_{s≥t} r_s·m_s − b·m_t. Equal on the first token.
    tlr, mask, _ = batch(7)
    base = torch.full((N,), 0.25, dtype=torch.float64)
    want, want_ret = core_algos.compute_remax_outcome_advantage(tlr, base, mask)
    got, got_ret = ours("remax")(tlr, mask, reward_baselines=base)
    seq = (tlr.sum(-1) - base)[:, None] * mask
    torch.testing.assert_close(got, seq, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got[:, 0], want[:, 0], atol=1e-12, rtol=1e-12)
    assert (got - want).abs().max() > 0.1
    torch.testing.assert_close(got_ret, want_ret, atol=1e-12, rtol=1e-12)


def test_remax_refuses_baselines_that_differ_within_a_group():
    tlr, mask, index = batch(6, outcome=True)
    base = torch.arange(N, dtype=torch.float64)
    with pytest.raises(ValueError, match="differ within a group"):
        ours("remax")(tlr, mask, index=index, reward_baselines=base)


def test_group_estimators_still_need_index():
    tlr, mask, _ = batch(8)
    with pytest.raises(ValueError, match="uid"):
        ours("rloo")(tlr, mask)


# --------------------------------------------------------------------------- (e) kl_reward
def test_kl_reward_selects_with_the_mask():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -float("inf"), float("nan")]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    rewards, current = advantages.kl_reward(logp, ref, mask, coef=0.1)
    # k1 = logp − ref: [0.5, −1.0] and [0.0]; reward −0.1·k1; current = mean of token means
    want = torch.tensor([[-0.05, 0.1, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, want)
    assert current == pytest.approx(((0.5 - 1.0) / 2 + 0.0) / 2, abs=1e-6)
    # verl's kl_penalty agrees where finite
    verl_k = core_algos.kl_penalty(logp, ref, "kl")
    fin = mask & torch.isfinite(verl_k)
    torch.testing.assert_close(rewards[fin], -0.1 * verl_k[fin])


# --------------------------------------------------------------------------- (f) gmpo weights
def test_gmpo_with_rollout_is_weights_weights_the_sequence_by_their_geometric_mean():
    g = torch.Generator().manual_seed(9)
    n, t = 6, 5
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[0, 3:] = 0.0
    mask[4, 1:] = 0.0
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) - 0.2
    logp = (old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, t) * mask
    w = torch.rand(n, t, generator=g, dtype=torch.float64) * 1.5 + 0.1
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    want, _ = core_algos.compute_policy_loss_geo_mean(
        old, logp, adv, mask, "seq-mean-token-mean", cfg, rollout_is_weights=w
    )
    (want_grad,) = torch.autograd.grad(want, logp)
    fn = core_algos.get_policy_loss_fn("grouprl_gmpo")
    got, _ = fn(old, logp, adv, mask, "seq-mean-token-mean", cfg, rollout_is_weights=w)
    (got_grad,) = torch.autograd.grad(got, logp)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-7)  # verl's 1e-8 in the means
    torch.testing.assert_close(got_grad, want_grad, atol=1e-7, rtol=1e-7)
    # hand: the sequence weight is the geometric mean of its valid token weights
    seq_w = gv._is_weights("gmpo", w, mask)[:, 0]
    torch.testing.assert_close(seq_w[4], w[4, 0], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(seq_w[0], (w[0, :3].prod()) ** (1 / 3), atol=1e-8, rtol=1e-8)
    assert torch.equal(gv._is_weights("ppo_clip", w, mask), w)  # every other loss: per token
