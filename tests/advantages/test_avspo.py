"""AVSPO virtual samples in each mode, and the adaptive trigger (ALGORITHMS.md §2)."""

import math

import pytest
import torch

from grouprl import advantages
from grouprl.advantages import VirtualTrigger, virtual_count

# G = 4; groups: all-correct, all-wrong, all-correct, all-wrong, mixed [1, 0, 0, 0].
# ACR = 4/5 = 0.8 > τ_adapt = 0.5, so K = ceil(4·sqrt(0.8)) = ceil(3.578) = 4.
BATCH = torch.tensor(
    [[1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64
)


def test_virtual_count():
    assert virtual_count(4, 0.8) == 4
    assert virtual_count(8, 0.25) == 4  # ceil(8 · 0.5)
    assert virtual_count(8, 0.0) == 1  # at least one
    assert virtual_count(8, 1.0) == 8  # at most G


def test_before_virtual_samples_collapsed_groups_are_zero():
    out = advantages.compute("grpo", BATCH)
    assert (out.values[:4] == 0).all()


def test_symmetric_all_correct_and_all_wrong():
    # all-correct: 1,1,1,1 + virtual 0.75, 0.5, 0.25, 0 -> mean 5.5/8 = 0.6875,
    # Σ dev² = 4·0.3125² + 0.0625² + 0.1875² + 0.4375² + 0.6875² = 1.09375,
    # Bessel var 1.09375/7 = 0.15625, σ = 0.3952847 -> A = 0.3125/σ = 0.7905694.
    # all-wrong mirrors it: -0.7905694. The mixed group is untouched: [1.5, -0.5, ...].
    out = advantages.compute("grpo", BATCH, virtual="symmetric")
    a = 0.3125 / (math.sqrt(0.15625) + 1e-6)
    assert out.values[0].tolist() == pytest.approx([a] * 4, abs=1e-9)
    assert out.values[1].tolist() == pytest.approx([-a] * 4, abs=1e-9)
    assert out.values[4].tolist() == pytest.approx(
        advantages.compute("grpo", BATCH).values[4].tolist()
    )
    assert out.stats["virtual/K"] == 4 and out.stats["virtual/triggered_frac"] == pytest.approx(0.8)
    assert out.values.shape == BATCH.shape  # virtual samples have no tokens


def test_symmetric_helps_with_k_equal_one():
    # G = 2 and ACR = 0.2: K = ceil(2·sqrt(0.2)) = 1; symmetric puts v_1 = 0 beside an
    # all-correct group [1, 1]: mean 2/3, Bessel σ = sqrt(1/3) -> A = (1/3)/0.57735 = 0.57735
    r = torch.tensor(
        [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64
    )
    out = advantages.compute("grpo", r, virtual="symmetric", trigger=VirtualTrigger(tau=0.1))
    assert out.stats["virtual/K"] == 1
    assert out.values[0].tolist() == pytest.approx([1 / math.sqrt(3)] * 2, abs=1e-5)


def test_paper_mode_and_its_documented_defect():
    # all-correct: v = r_max·(1 - (k-1)/K) = [1, 0.75, 0.5, 0.25] -> mean 6.5/8 = 0.8125,
    # Σ dev² = 5·0.1875² + 0.0625² + 0.3125² + 0.5625² = 0.59375, var 0.59375/7,
    # σ = 0.2912414 -> A = 0.1875/σ = 0.6437963.
    out = advantages.compute("grpo", BATCH, virtual="paper")
    a = 0.1875 / (math.sqrt(0.59375 / 7) + 1e-6)
    assert out.values[0].tolist() == pytest.approx([a] * 4, abs=1e-9)
    # defect 1: an all-wrong group gets r_max = 0, so every virtual reward is 0: still collapsed
    assert (out.values[1] == 0).all()
    # defect 2: with K = 1 the single virtual sample equals r_max: an all-correct group stays
    # collapsed too (compare test_symmetric_helps_with_k_equal_one)
    r = torch.tensor(
        [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64
    )
    out1 = advantages.compute("grpo", r, virtual="paper", trigger=VirtualTrigger(tau=0.1))
    assert out1.stats["virtual/K"] == 1 and (out1.values[0] == 0).all()


def test_code_mode_fires_only_on_a_uniform_batch():
    # every reward 0: each group gets one virtual 1 -> [0, 0, 0, 0, 1]: mean 0.2,
    # Bessel σ = sqrt((4·0.04 + 0.64)/4) = sqrt(0.2) -> A = -0.2/0.4472136 = -0.4472136
    zeros = torch.zeros(3, 4, dtype=torch.float64)
    out = advantages.compute("grpo", zeros, virtual="code")
    assert out.values.reshape(-1).tolist() == pytest.approx(
        [-0.2 / (math.sqrt(0.2) + 1e-6)] * 12, abs=1e-9
    )
    ones = torch.ones(3, 4, dtype=torch.float64)
    assert (advantages.compute("grpo", ones, virtual="code").values > 0).all()
    # a batch with any mixed reward: nothing is added, even though most groups collapsed
    out = advantages.compute("grpo", BATCH, virtual="code")
    assert torch.equal(out.values, advantages.compute("grpo", BATCH).values)


def test_no_trigger_below_tau_adapt():
    # ACR = 0.8 but τ_adapt = 0.9: nothing fires
    out = advantages.compute("grpo", BATCH, virtual="symmetric", trigger=VirtualTrigger(tau=0.9))
    assert (out.values[:4] == 0).all() and out.stats["virtual/triggered_frac"] == 0


def test_trigger_update_rule():
    # τ ← clip(τ + η·sign(ΔJ)·(ACR − τ), 0.1, 0.9); the first call only sets the reward EMA
    t = VirtualTrigger()
    assert t.update(acr=0.75, mean_reward=0.2) == 0.5
    # reward rises: EMA 0.2 -> 0.9·0.2 + 0.1·0.6 = 0.24, ΔJ > 0: τ = 0.5 + 0.01·(0.75 - 0.5) = 0.5025
    assert t.update(acr=0.75, mean_reward=0.6) == pytest.approx(0.5025)
    assert t.reward_ema == pytest.approx(0.24)
    # reward falls: ΔJ < 0: τ = 0.5025 - 0.01·(0.75 - 0.5025) = 0.5025 - 0.002475 = 0.500025
    assert t.update(acr=0.75, mean_reward=0.0) == pytest.approx(0.500025)
    # clipped to [0.1, 0.9]
    t2 = VirtualTrigger(tau=0.895, eta=1.0)
    t2.update(0.0, 0.0)
    assert t2.update(acr=1.0, mean_reward=1.0) == 0.9


def test_trigger_state_round_trip_and_compute_advances_it():
    t = VirtualTrigger()
    for acr_batch in (BATCH, BATCH * 0 + 1):
        advantages.compute("grpo", acr_batch, virtual="symmetric", trigger=t)
    assert t.steps == 2 and t.tau != 0.5  # reward rose with ACR 1.0 > τ: τ moved up
    clone = VirtualTrigger()
    clone.load_state_dict(t.state_dict())
    assert clone.state_dict() == t.state_dict()


def test_a_fresh_triggers_state_and_one_saved_before_last_delta_existed_load():
    # a trigger saved before its first update has no reward EMA (None stays None); a state
    # saved before ``last_delta`` was added loads with last_delta 0
    fresh = VirtualTrigger()
    fresh.load_state_dict(VirtualTrigger(tau=0.3).state_dict())
    assert (fresh.tau, fresh.reward_ema, fresh.steps, fresh.last_delta) == (0.3, None, 0, 0.0)
    old = VirtualTrigger()
    old.last_delta = 5.0
    old.load_state_dict({"tau": 0.6, "reward_ema": 0.25, "steps": 3})
    assert (old.tau, old.reward_ema, old.steps, old.last_delta) == (0.6, 0.25, 3, 0.0)


def test_code_mode_per_generation_batch_of_groups():
    # groups: all-wrong, all-correct, mixed, all-wrong (G = 4)
    r = torch.tensor([[0.0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    # one group per generation batch (the authors' script): every uniform group fires.
    # All-wrong + one virtual 1: mean 0.2, std (ddof 1) sqrt(0.8 / 4) = sqrt(0.2), so each
    # real sample gets (0 - 0.2)/sqrt(0.2) = -sqrt(0.2); all-correct + a virtual 0: +sqrt(0.2)
    one = advantages.compute("grpo", r, virtual="code", virtual_batch_groups=1)
    s = math.sqrt(0.2)
    torch.testing.assert_close(one.values[0], torch.full((4,), -s), atol=1e-5, rtol=0)
    torch.testing.assert_close(one.values[1], torch.full((4,), s), atol=1e-5, rtol=0)
    torch.testing.assert_close(one.values[3], torch.full((4,), -s), atol=1e-5, rtol=0)
    plain = advantages.compute("grpo", r)
    torch.testing.assert_close(one.values[2], plain.values[2])  # mixed: no virtual sample
    assert one.stats["virtual/triggered_frac"] == 0.75
    # batches of 2 groups: (wrong, correct) is not uniform, (mixed, wrong) neither: nothing fires
    two = advantages.compute("grpo", r, virtual="code", virtual_batch_groups=2)
    assert two.stats["virtual/triggered_frac"] == 0.0
    # the whole batch (the default) fires only when every reward is 0 (or every one 1)
    assert advantages.compute("grpo", r, virtual="code").stats["virtual/triggered_frac"] == 0.0
    # batches of 2 over [wrong, wrong | correct, correct]: both batches fire
    r2 = torch.tensor([[0.0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    both = advantages.compute("grpo", r2, virtual="code", virtual_batch_groups=2)
    assert both.stats["virtual/triggered_frac"] == 1.0
    assert bool((both.values[:2] < 0).all()) and bool((both.values[2:] > 0).all())


def test_code_mode_per_group_equals_a_loop_over_groups():
    gen = torch.Generator().manual_seed(0)
    r = (torch.rand(64, 4, generator=gen) < 0.3).float()
    r[5, 1] = math.nan  # a NaN entry is ignored by the rule
    vec = advantages.compute("grpo", r, virtual="code", virtual_batch_groups=1).values
    loop = torch.cat(
        [advantages.compute("grpo", r[i : i + 1], virtual="code").values for i in range(64)]
    )
    torch.testing.assert_close(vec, loop, atol=1e-6, rtol=0)


def test_batch_groups_is_for_code_mode_only():
    r = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="applies to virtual mode 'code' only"):
        advantages.compute("grpo", r, virtual="symmetric", virtual_batch_groups=1)
    with pytest.raises(ValueError, match="positive number of groups"):
        advantages.compute("grpo", r, virtual="code", virtual_batch_groups=0)


# ----------------------------------------------------------------- virtual_samples by hand
# direct calls of the transform (``compute`` passes every argument; these pin its own defaults,
# its reward range and its tolerance). Float64 throughout, so that the fills are exact.
def _f64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def _same(a, b):
    """Equal, NaN where the other is NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_virtual_samples_defaults_by_hand():
    # defaults: symmetric, τ_adapt 0.5, α 0.5, range [0, 1], ddof 1. [1, 1] and [0, 0] are
    # collapsed, [0, 1] is not (σ = 0.707): ACR = 2/3 > 0.5, K = ⌈2·√(2/3)⌉ = ⌈1.633⌉ = 2.
    # All-correct: v_k = 1 − k/2 = 0.5, 0; all-wrong: v_k = k/2 = 0.5, 1; the mixed group NaN.
    r = _f64([[1, 1], [0, 0], [0, 1]])
    aug, valid, stats = advantages.virtual_samples(r, None)
    nan = math.nan
    assert _same(aug, _f64([[1, 1, 0.5, 0], [0, 0, 0.5, 1], [0, 1, nan, nan]]))
    assert valid.tolist() == [[True] * 4, [True] * 4, [True, True, False, False]]
    assert stats == {
        "virtual/acr": pytest.approx(2 / 3),
        "virtual/tau_adapt": 0.5,
        "virtual/K": 2.0,
        "virtual/triggered_frac": pytest.approx(2 / 3),
    }


def test_virtual_samples_collapse_rule_reads_ddof_and_tau_and_skips_empty_groups():
    # [1, 0]: σ = 0.5 with ddof 0 (< tau = 0.55: collapsed), 0.707 with ddof 1; [1, 1]: 0
    r = _f64([[1, 0], [1, 1]])
    acr = {
        ddof: advantages.virtual_samples(r, None, tau=0.55, ddof=ddof)[2]["virtual/acr"]
        for ddof in (0, 1)
    }
    assert acr == {0: 1.0, 1: 0.5}
    # a group with no valid reward is not a collapsed group: ACR 0, nothing added
    e = _f64([[math.nan, math.nan], [0, 1]])
    aug, _, stats = advantages.virtual_samples(e, ~e.isnan())
    assert stats["virtual/acr"] == 0.0 and aug is e


def test_virtual_samples_fill_the_reward_range_and_its_tolerance():
    # range [-1, 1], atol = 1e-6·(1 − (−1)) = 2e-6: a constant 1 − 1e-6 counts as all-correct,
    # −1 + 1e-6 as all-wrong. ACR = 2/3, K = 2: down = 1 − 2·k/2 = 0, −1; up = −1 + 2·k/2 = 0, 1
    hi, lo = 1 - 1e-6, -1 + 1e-6
    r = _f64([[hi, hi], [lo, lo], [-1, 1]])
    aug, _, stats = advantages.virtual_samples(r, None, reward_range=(-1.0, 1.0))
    assert _same(aug[:, 2:], _f64([[0, -1], [0, 1], [math.nan, math.nan]]))
    # the tolerance is inclusive: on [0, 1] (atol 1e-6) a constant exactly 1 − atol, or
    # exactly 0 + atol, still fires
    edge = _f64([[1.0 - 1e-6] * 2, [0.0 + 1e-6] * 2, [0, 1]])
    aug, _, stats = advantages.virtual_samples(edge, None)
    assert stats["virtual/triggered_frac"] == pytest.approx(2 / 3)
    assert _same(aug[:, 2:], _f64([[0.5, 0], [0.5, 1], [math.nan, math.nan]]))


def test_virtual_samples_are_computed_in_the_rewards_dtype():
    # G = 3, ACR = 2/3: K = ⌈3·√(2/3)⌉ = ⌈2.449⌉ = 3; v_k = 1 − k/3 and k/3 in float64 (a
    # float32 step would give 0.6666667)
    r = _f64([[1, 1, 1], [0, 0, 0], [0, 1, 1]])
    aug, _, _ = advantages.virtual_samples(r, None)
    assert aug[0, 3:].tolist() == [1 - 1 / 3, 1 - 2 / 3, 1 - 3 / 3]
    assert aug[1, 3:].tolist() == [1 / 3, 2 / 3, 3 / 3]


def test_virtual_samples_fire_strictly_above_tau_adapt_with_alpha():
    # ACR = 1/2 (group 0 collapsed, group 1 not): τ_adapt 0.5 does not fire (strictly above);
    # τ_adapt 0.4 fires with K = ⌈4·(1/2)^α⌉: 2 for α = 1, 3 for α = 0.5
    r = _f64([[1, 1, 1, 1], [0, 1, 0, 1]])
    aug, _, stats = advantages.virtual_samples(r, None, tau_adapt=0.5)
    assert aug is r and stats["virtual/triggered_frac"] == 0.0
    for alpha, k in ((1.0, 2), (0.5, 3)):
        aug, _, stats = advantages.virtual_samples(r, None, tau_adapt=0.4, alpha=alpha)
        assert stats["virtual/K"] == k and aug.shape == (2, 4 + k)


def test_paper_mode_fills_from_the_groups_valid_maximum_and_only_collapsed_groups():
    # range [-1, 1]; [-0.5, -0.5, NaN] (r_max over the valid: -0.5) and [0.2, 0.2, 0.2] are
    # collapsed, [0, 1, 0.5] is not: ACR = 2/3, K = 3, v_k = r_max·(1 − (k − 1)/3)
    r = _f64([[-0.5, -0.5, math.nan], [0.2, 0.2, 0.2], [0, 1, 0.5]])
    aug, valid, _ = advantages.virtual_samples(
        r, ~r.isnan(), mode="paper", reward_range=(-1.0, 1.0)
    )
    want = [[-0.5, -0.5 * 2 / 3, -0.5 / 3], [0.2, 0.2 * 2 / 3, 0.2 / 3]]
    torch.testing.assert_close(aug[:2, 3:], _f64(want), rtol=0, atol=1e-15)
    assert aug[2, 3:].isnan().all() and valid[2].tolist() == [True] * 3 + [False] * 3


def test_code_mode_by_hand_nan_padding_and_tolerance():
    # one virtual sample (K = 1). Range [-1, 1]: every valid reward of the batch is −1 (the NaN
    # is left out), so each group gets +1
    r = _f64([[-1, math.nan], [-1, -1]])
    aug, valid, stats = advantages.virtual_samples(
        r, ~r.isnan(), mode="code", reward_range=(-1.0, 1.0)
    )
    assert _same(aug, _f64([[-1, math.nan, 1], [-1, -1, 1]])) and stats["virtual/K"] == 1.0
    assert valid.tolist() == [[True, False, True], [True, True, True]]
    # batches of 2 groups over 3: (mixed, mixed | all-wrong + a padding row): the last fires
    b = _f64([[0, 1], [0, 1], [0, 0]])
    aug, _, _ = advantages.virtual_samples(b, None, mode="code", batch_groups=2)
    assert _same(aug[:, 2], _f64([math.nan, math.nan, 1]))
    # the tolerance is inclusive: a batch exactly at 0 + atol (1e-6) or 1 − atol fires
    for c, fill in ((1e-6, 1.0), (1.0 - 1e-6, 0.0)):
        aug, _, stats = advantages.virtual_samples(_f64([[c, c]]), None, mode="code")
        assert stats["virtual/triggered_frac"] == 1.0 and aug[0, 2].item() == fill


def test_code_modes_fill_is_exact_in_the_rewards_dtype():
    # range [0, 0.1] beside float64 rewards: an all-wrong batch gets exactly 0.1, an all-correct
    # one exactly 0 (the fill was once rounded through float32: 0.10000000149)
    for rows, fill in (([[0.0, 0.0]], 0.1), ([[0.1, 0.1]], 0.0)):
        aug, _, _ = advantages.virtual_samples(
            _f64(rows), None, mode="code", reward_range=(0.0, 0.1)
        )
        assert aug.dtype == torch.float64 and aug[0, 2].item() == fill


def test_trigger_starts_where_the_paper_fixes_it():
    # ACR paper §4.3 and App. A.2: τ_adapt(0) = 0.5, η = 0.01, bounds [0.1, 0.9], the same in
    # every experiment; the authors' README example sets acr_threshold_init=0.5
    t = VirtualTrigger()
    assert (t.tau, t.eta, t.lo, t.hi) == (0.5, 0.01, 0.1, 0.9)
    # Eq. 12 by hand: after the EMA's first reading, a rising reward at ACR 0.3 moves τ by
    # η·(+1)·(0.3 − 0.5) = −0.002
    t.update(0.3, 0.2)
    assert t.tau == 0.5
    t.update(0.3, 0.4)
    assert t.tau == pytest.approx(0.498)
