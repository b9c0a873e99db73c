"""The rules people write by hand on top of their trainers: clip direction, entropy trend,
response-length drift, shaped reward rising without correctness, rewards zeroed by
truncation. Each on a hand-made metric stream with the step and message derived by hand."""

import copy

import pytest
import torch

from grouprl.diagnostics import RunHealth, shaping_metrics
from grouprl.diagnostics.health import CLIP_ADVICE, ENTROPY_ADVICE, LENGTH_ADVICE


def _feed(h, rows, start=0):
    out = []
    for i, m in enumerate(rows):
        out += h.update(start + i, dict(m))
    return out


def test_clip_bound_names_the_bound_that_cuts():
    h = RunHealth()
    # 0.05 + 0.12 = 0.17 <= 0.2: quiet
    assert _feed(h, [{"policy/clip_frac_low": 0.05, "policy/clip_frac_high": 0.12}] * 5) == []
    # 0.05 + 0.25 = 0.30 > 0.2, the high bound holds 0.25 / 0.30 = 83 % >= 2/3
    (line,) = h.update(5, {"policy/clip_frac_low": 0.05, "policy/clip_frac_high": 0.25})
    assert line == (
        "[clip_bound] step 5: 30% of tokens clipped: 25% at the high bound (A > 0, ratio > "
        "1 + eps_high), 5% at the low bound (A < 0, ratio < 1 - eps_low) -> " + CLIP_ADVICE["high"]
    )
    assert "clip-higher" in CLIP_ADVICE["high"] and "do not widen eps_low" in CLIP_ADVICE["low"]
    # the same condition: nothing more; the low bound taking over is a change of kind, printed
    # once `gap` (10) steps after the last line
    assert _feed(h, [{"policy/clip_frac_low": 0.06, "policy/clip_frac_high": 0.25}] * 4, 6) == []
    low = {"policy/clip_frac_low": 0.3, "policy/clip_frac_high": 0.05}
    out = _feed(h, [low] * 10, start=10)
    assert out == [
        "[clip_bound] step 15: still on since step 5, now 35% clipped, low bound (was 30% "
        "clipped, high bound at step 5)"
    ]


def test_clip_bound_without_direction_says_the_log_has_none():
    h = RunHealth()  # verl's pg_clipfrac counts both bounds together
    (line,) = h.update(1, {"policy/clip_frac_region": 0.4})
    assert line.startswith("[clip_bound] step 1: 40% of tokens clipped (this log does not say")
    assert line.endswith(CLIP_ADVICE["unknown"])


def test_entropy_trend_falling_then_collapse_says_it_once():
    h = RunHealth()
    # 10 steps at 1.0, then 0.4: the latest 10-step window is all 0.4 at step 19 (20 values),
    # 0.4 / 1.0 < 0.5
    rows = [{"policy/entropy_mean": 1.0}] * 10 + [{"policy/entropy_mean": 0.4}] * 10
    (line,) = _feed(h, rows)
    assert line == (
        "[entropy_trend] step 19: policy entropy falling: 0.4 over the last 10 steps, 0.4x the "
        "1 of the first 10 -> " + ENTROPY_ADVICE["falling"]
    )
    # below 0.1 x the first value: entropy_collapse opens; the trend rule yields to it
    out = _feed(h, [{"policy/entropy_mean": 0.05}] * 3, start=20)
    assert len(out) == 1 and out[0].startswith("[entropy_collapse] step 20")


def test_entropy_trend_rising_and_silent_on_a_mild_trend():
    h = RunHealth()
    mild = [{"policy/entropy_mean": 1.0 - 0.02 * i} for i in range(30)]  # 0.42 at the end
    # windows: first mean 0.91; at step 29 the last mean is 1 - 0.02 * 24.5 = 0.51: 0.56x
    assert _feed(h, mild) == []
    h = RunHealth()
    rows = [{"policy/entropy_mean": 0.5}] * 10 + [{"policy/entropy_mean": 1.2}] * 10
    (line,) = _feed(h, rows)
    assert line.startswith("[entropy_trend] step 19: policy entropy rising: 1.2 over")
    assert line.endswith(ENTROPY_ADVICE["rising"])


def test_length_drift_growing_and_shrinking():
    h = RunHealth()
    # mean 100 over the first 10 steps, then 260 tokens: the windows stop overlapping at
    # step 19 (20 values), when the latest holds only 260s: 2.6x
    rows = [{"length/mean": 100.0}] * 10 + [{"length/mean": 260.0}] * 10
    out = _feed(h, rows)
    assert out == [
        "[length_drift] step 19: mean response length growing: 260 tokens over the last 10 "
        "steps, 2.6x the 100 of the first 10 -> " + LENGTH_ADVICE["growing"]
    ]
    h = RunHealth()
    rows = [{"length/mean": 100.0}] * 10 + [{"length/mean": 40.0}] * 10
    (line,) = _feed(h, rows)
    assert line.startswith("[length_drift] step 19: mean response length shrinking: 40 tokens")
    assert "Dr. GRPO" in line and "truncation_zeroed" in line
    # 1.9x: quiet
    h = RunHealth()
    assert _feed(h, [{"length/mean": 100.0}] * 10 + [{"length/mean": 190.0}] * 10) == []


def _hack_rows(correct_late):
    # shaped reward 0.2 -> 0.6 (+0.4); correctness 0.30 -> correct_late
    return [{"reward/mean": 0.2, "reward/correct_mean": 0.3}] * 10 + [
        {"reward/mean": 0.6, "reward/correct_mean": correct_late}
    ] * 10


def test_reward_hacking_fires_when_correctness_lags_the_shaped_reward():
    h = RunHealth()
    (line,) = _feed(h, _hack_rows(0.35))  # +0.05 <= 0.25 x 0.4 = 0.1
    assert line.startswith(
        "[reward_hacking] step 19: the shaped reward rose by +0.4 (mean of the last 10 steps "
        "against the first 10) while verified correctness moved by +0.05 -> the policy is "
        "gaming the shaping"
    )
    assert _feed(RunHealth(), _hack_rows(0.42)) == []  # +0.12 > 0.1: correctness follows
    # without a correctness metric the rule cannot judge and stays silent
    rows = [{"reward/mean": r["reward/mean"]} for r in _hack_rows(0.3)]
    assert _feed(RunHealth(), rows) == []


def test_shaping_metrics_known_answer():
    # 2 prompts x 4 samples, 7 scored (one NaN); truncated: (0,2), (0,3), (1,3), all three at
    # the floor 0; the 4 scored finished ones are 1, 0, 1, 1: one at the floor
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, float("nan"), 0.0]])
    cut = torch.tensor([[False, False, True, True], [False, False, False, True]])
    m = shaping_metrics(rewards, cut)
    assert m == {
        "truncated/trained_frac": pytest.approx(3 / 7),
        "truncated/trained_count": 3.0,
        "truncated/floor_frac": 1.0,
        "truncated/finished_floor_frac": pytest.approx(1 / 4),  # (0,1) of 4 scored finished
    }
    shaped = rewards - 0.5 * cut  # a soft penalty: the verifier's own rewards are read
    m2 = shaping_metrics(shaped, cut.reshape(-1), verifier_rewards=rewards)
    assert m2["truncated/floor_frac"] == 1.0
    assert m2["reward/correct_mean"] == pytest.approx(3 / 7)
    # reward range (-1, 1): the floor is -1, nothing is at it
    assert shaping_metrics(rewards, cut, reward_range=(-1.0, 1.0))["truncated/floor_frac"] == 0


def test_truncation_zeroed_fires_on_cut_answers_scored_at_the_floor():
    nan = float("nan")
    # 2 x 8, one NaN: 5 cut completions (row 0's last four, row 1's last), all at 0; of the
    # 10 scored finished ones 2 are at 0. Were truncation irrelevant, all 5 at the floor
    # would have the chance 0.2^5 = 3.2e-4 <= 0.01
    rewards = torch.tensor([[1.0, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, nan, 0]])
    cut = torch.zeros(2, 8, dtype=torch.bool)
    cut[0, 4:] = True
    cut[1, 7] = True
    h = RunHealth()
    (line,) = h.update(3, shaping_metrics(rewards, cut))
    assert line.startswith(
        "[truncation_zeroed] step 3: 33% of the trained completions were cut at the token "
        "limit and 100% of them score the reward floor (20% of finished ones do)"
    )
    assert "overlong='mask'" in line and "mask_truncated_completions=True" in line
    # the same batch with the cut completions masked out of the loss: nothing trained on
    assert RunHealth().update(3, shaping_metrics(rewards, torch.zeros_like(cut))) == []
    # a cut answer that scores 1 (the verifier reads partial answers): 4 of 5 at the floor
    ok = rewards.clone()
    ok[0, 4] = 1.0
    assert RunHealth().update(3, shaping_metrics(ok, cut)) == []
    # only row 1's cut one, at 0, where 6 of the 14 finished are: chance 0.43 > 0.01, quiet
    one = torch.zeros(2, 8, dtype=torch.bool)
    one[1, 7] = True
    assert RunHealth().update(3, shaping_metrics(rewards, one)) == []


def test_the_new_rules_resume_exactly():
    rows = [{"policy/entropy_mean": 1.0, "length/mean": 50.0}] * 10 + [
        {"policy/entropy_mean": 0.3, "length/mean": 150.0}
    ] * 12
    whole = RunHealth()
    want = _feed(whole, rows)
    assert {w.split("]")[0][1:] for w in want} == {"entropy_trend", "length_drift"}
    first = RunHealth()
    got = _feed(first, rows[:13])
    resumed = RunHealth()
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    got += _feed(resumed, rows[13:], start=13)
    assert got == want and resumed.state_dict() == whole.state_dict()


def test_kept_mass_bias_of_a_renormalising_engine_and_the_truncated_sampling_rule():
    from grouprl.diagnostics import mismatch_metrics

    # two positions; top-p 0.7 keeps {0.5, 0.3} of [0.5, 0.3, 0.15, 0.05] (mass above 0.15 is
    # 0.8 >= 0.7) and {0.9} of [0.9, 0.06, 0.04]: kept masses 0.8 and 0.9. An engine returning
    # log(p / M) for the drawn tokens 0, 1 (row 0) and 0 (row 1) against the trainer's log p
    p = [[0.5, 0.3], [0.9, 0.9]]
    mass = [[0.8, 0.8], [0.9, 0.9]]
    train = torch.tensor(p).log()
    roll = (torch.tensor(p) / torch.tensor(mass)).log()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = mismatch_metrics(train, roll, mask)
    assert m["mismatch/ratio_mean"] == pytest.approx((0.8 + 0.8 + 0.9) / 3)
    assert m["mismatch/ratio_le1_frac"] == 1.0 and m["mismatch/ratio_max"] == pytest.approx(0.9)
    (line,) = [x for x in RunHealth().update(1, m) if x.startswith("[truncated_sampling]")]
    assert line.startswith(
        "[truncated_sampling] step 1: no token's ratio pi_train/pi_rollout exceeds 1 (max 0.9, "
        "mean ratio 0.833 = the mean kept mass)"
    )
    # engine noise on both sides of 1: quiet
    g = torch.Generator().manual_seed(0)
    noisy = train + 0.05 * torch.randn(train.shape, generator=g)
    m2 = mismatch_metrics(train, noisy, mask)
    assert m2["mismatch/ratio_max"] > 1
    assert not [x for x in RunHealth().update(1, m2) if x.startswith("[truncated_sampling]")]
    # the same log-probs on both sides (the trainer's own sampler): quiet
    same = mismatch_metrics(train, train, mask)
    assert RunHealth().update(1, same) == []
