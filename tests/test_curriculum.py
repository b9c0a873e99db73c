"""The pass-rate curriculum sampler: online pass rates with a prior, the band, the revisit
schedule, distinct draws per step with backfill, exact checkpoints; hand-derived answers."""

from __future__ import annotations

import pytest
import torch

from grouprl import sampling


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _observe(s, idx, succ, trials):
    idx = torch.tensor(idx)
    s.observe_groups(idx, torch.zeros(len(idx), dtype=torch.float64),
                     torch.tensor(succ, dtype=torch.float64),
                     torch.tensor(trials, dtype=torch.float64))  # fmt: skip


def test_pass_rates_follow_the_decayed_beta_counts_with_the_pool_prior():
    s = sampling.make("curriculum", 4)
    assert torch.equal(s.pass_rate(), torch.full((4,), 0.5, dtype=torch.float64))  # prior 0.5
    # prompt 0, 3 of 4: a = 0.5 * (2 * 0.5) + 3 = 3.5, b = 0.5 * 1 + 1 = 1.5 -> 0.7
    _observe(s, [0], [3.0], [4.0])
    assert float(s.pass_rate()[0]) == pytest.approx(0.7)
    assert float(s.pass_rate()[2]) == pytest.approx(0.7)  # unseen: the visited mean
    # prompt 1, 0 of 4, starting from the prior Beta(2 * 0.7, 2 * 0.3):
    # a = 0.5 * 1.4 = 0.7, b = 0.5 * 0.6 + 4 = 4.3 -> 0.14 (in the band)
    _observe(s, [1], [0.0], [4.0])
    assert float(s.pass_rate()[1]) == pytest.approx(0.14)
    assert bool(s.eligible()[1])
    # again 0 of 4: a = 0.35, b = 2.15 + 4 = 6.15 -> 0.0538 > 0.05: still in
    _observe(s, [1], [0.0], [4.0])
    assert float(s.pass_rate()[1]) == pytest.approx(0.35 / 6.5)
    # a third time: a = 0.175, b = 3.075 + 4 = 7.075 -> 0.0241 < 0.05: set aside
    _observe(s, [1], [0.0], [4.0])
    assert float(s.pass_rate()[1]) == pytest.approx(0.175 / 7.25)
    assert not bool(s.eligible()[1])
    # no valid reward (trials 0): not a visit
    _observe(s, [3], [0.0], [0.0])
    assert int(s.visits[3]) == 0


def test_set_aside_prompts_wait_revisit_steps_then_return():
    s = sampling.make("curriculum", 6, revisit=3)
    s.begin_step(5)
    _observe(s, [2], [16.0], [16.0])  # all correct at step 5: p = (0.5 + 16) / 17 = 0.97
    assert not bool(s.eligible()[2])
    for step in (6, 7, 8):  # the `revisit` steps after it
        s.begin_step(step)
        assert 2 not in s.sample(5, _gen(step)).tolist()  # 5 of the 5 eligible
    s.begin_step(9)
    assert bool(s.eligible()[2])
    assert sorted(s.sample(6, _gen(9)).tolist()) == list(range(6))


def test_distinct_prompts_within_a_step_and_backfill_soonest_due_first():
    s = sampling.make("curriculum", 6, revisit=10)
    s.begin_step(1)
    _observe(s, [0], [0.0], [32.0])  # aside until 12
    s.begin_step(3)
    _observe(s, [1], [0.0], [32.0])  # aside until 14
    s.begin_step(4)
    _observe(s, [2], [0.0], [32.0])  # aside until 15
    assert s.aside_until.tolist()[:3] == [12, 14, 15]
    first = s.sample(2, _gen(1))  # two of the three eligible 3, 4, 5
    assert set(first.tolist()) <= {3, 4, 5} and s.backfilled == 0
    # dynamic sampling's second round in the same step: the last eligible one, then the
    # set-aside prompts by due step (0 before 1)
    second = s.sample(3, _gen(2))
    assert set(second[:1].tolist()) == {3, 4, 5} - set(first.tolist())
    assert second[1:].tolist() == [0, 1] and s.backfilled == 2
    assert len(set(first.tolist() + second.tolist())) == 5
    # one prompt left this step (2, set aside): it, then a repeat, an eligible one first
    third = s.sample(2, _gen(3))
    assert third[0] == 2 and int(third[1]) in {3, 4, 5}
    assert (s.backfilled, s.repeated) == (1, 1)
    s.begin_step(5)  # a new step: everything may be drawn again
    assert len(s.sample(6, _gen(4))) == 6


def test_state_dict_round_trip_continues_the_draws_exactly():
    a = sampling.make("curriculum", 20, band=(0.1, 0.9), revisit=2, decay=0.8)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        a.begin_step(step)
        idx = a.sample(6, _gen(step))
        succ = torch.randint(0, 5, (6,), generator=g).double()
        a.observe_groups(idx, torch.zeros(6, dtype=torch.float64), succ, torch.full((6,), 4.0))
    b = sampling.load(a.state_dict())
    assert b.band == (0.1, 0.9) and b.revisit == 2 and b.decay == 0.8
    for step in range(4, 8):
        for s in (a, b):
            s.begin_step(step)
        ia, ib = a.sample(6, _gen(step)), b.sample(6, _gen(step))
        assert torch.equal(ia, ib)
        succ = torch.randint(0, 5, (6,), generator=g).double()
        for s in (a, b):
            s.observe_groups(ia, torch.zeros(6, dtype=torch.float64), succ, torch.full((6,), 4.0))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        assert torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k], k


def test_curriculum_errors_and_no_importance_weight():
    with pytest.raises(ValueError, match="band must be"):
        sampling.make("curriculum", 4, band=(0.9, 0.1))
    with pytest.raises(ValueError, match="revisit must be a positive"):
        sampling.make("curriculum", 4, revisit=0)
    with pytest.raises(ValueError, match="unknown parameter"):
        sampling.make("curriculum", 4, floor=1)
    w = sampling.make("curriculum", 4).importance_weights(torch.tensor([0, 1]))
    assert bool(torch.isnan(w).all())
