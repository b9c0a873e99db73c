"""The ACR simulation's pieces: the code mode by hand, the run's bookkeeping, the calibration.

No test reads the simulation's own ``holds`` flags.
"""

import math

import pytest
import torch

from grouprl.simulate.collapse_over_training import (
    METHODS,
    AcrConfig,
    calibrate_pool,
    initial_pool,
    method_advantages,
    run_method,
)


def test_code_mode_advantages_by_hand():
    rewards = torch.tensor([[0.0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    # One group per generation batch (the authors' script): an all-0 group gets a virtual 1:
    # [0,0,0,0,1] has mean 0.2 and Bessel std √0.2, so A = −0.2/(√0.2 + 1e-6) ≈ −√0.2 for every
    # real sample; an all-1 group mirrors it (+√0.2). The mixed group is plain GRPO: mean 1/4,
    # std 1/2 -> (1.5, −0.5, −0.5, −0.5).
    values, fired = method_advantages("avspo_code_g1", rewards, None)
    a = 0.2 / (math.sqrt(0.2) + 1e-6)
    assert values[0].tolist() == pytest.approx([-a] * 4, abs=1e-12)
    assert values[1].tolist() == pytest.approx([a] * 4, abs=1e-12)
    assert values[2].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert fired == pytest.approx(2 / 3)
    # The same three groups as one batch: not every reward of the batch is 0 (or 1), so the
    # code mode does not fire and the collapsed groups get nothing.
    values, fired = method_advantages("avspo_code", rewards, None)
    assert values[:2].abs().max() == 0 and fired == 0.0


def test_acr_runs_raw_acr_against_groups_without_gradient():
    cfg = AcrConfig(prompts=64, batch=8, rounds=25, pool_mean=0.3)
    runs = {m: run_method(m, cfg, 5) for m in METHODS}
    assert len({r["accuracy0"] for r in runs.values()}) == 1  # one initial pool for all
    g = runs["grpo"]
    assert g["wasted"] == g["acr"] and max(g["acr"]) > 0  # GRPO: no gradient iff collapsed
    for r in runs.values():  # binary rewards: every collapsed group is all-wrong or all-right
        split = [w + c for w, c in zip(r["all_wrong"], r["all_correct"])]
        assert split == pytest.approx(r["acr"], abs=1e-12)
    c1 = runs["avspo_code_g1"]  # ... so one group per batch rescues every collapsed group
    assert c1["wasted"] == [0.0] * cfg.rounds and c1["virtual"] == c1["acr"]
    c = runs["avspo_code"]  # fires only on a round whose whole batch is 0 (or 1)
    for acr, wasted, fired in zip(c["acr"], c["wasted"], c["virtual"]):
        assert (fired, wasted) in ((0.0, acr), (1.0, 0.0))
    if sum(c["virtual"]) == 0:  # never fired: exactly GRPO's run
        assert c["accuracy"] == g["accuracy"]
    # common random numbers: the first round's raw rewards do not depend on the method
    assert len({r["acr"][0] for r in runs.values()}) == 1
    assert runs["dynamic_sampling"]["steps"] < g["steps"] == cfg.rounds
    with pytest.raises(ValueError, match="valid methods"):
        run_method("nope", cfg, 0)


def test_initial_pool_is_the_beta_pool():
    # Beta(mκ, (1−m)κ) has mean m and variance m(1−m)/(κ+1).
    cfg = AcrConfig(prompts=40_000, pool_mean=0.3, pool_concentration=1.5)
    p = torch.sigmoid(initial_pool(cfg, 0))
    se = math.sqrt(0.3 * 0.7 / 2.5 / cfg.prompts)
    assert abs(float(p.mean()) - 0.3) < 5 * se
    assert float(p.var()) == pytest.approx(0.3 * 0.7 / 2.5, rel=0.05)
    assert torch.equal(initial_pool(cfg, 0), initial_pool(cfg, 0))
    with pytest.raises(ValueError, match="calibrate_pool"):
        initial_pool(AcrConfig(), 0)


def test_calibrate_pool_lands_on_the_middle_of_the_range():
    cfg = AcrConfig(prompts=512, rounds=30, calib_iters=8)
    m = calibrate_pool(cfg)
    lo, hi = cfg.pool_mean_bracket
    assert lo < m < hi
    run = run_method("grpo", AcrConfig(prompts=512, rounds=30, pool_mean=m), 0)
    acr = sum(run["acr"]) / len(run["acr"])
    assert abs(acr - 0.365) < 0.03  # the bisection's target; a step of m moves it by less
    assert calibrate_pool(AcrConfig(pool_mean=0.2)) == 0.2  # a given mean is kept
