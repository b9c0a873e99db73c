"""TOPR through grouprl's trainer, with no trainer code of its own."""

from __future__ import annotations

from train_toy import make

from grouprl.train import loop
from grouprl.train.state import setup

MODEL = "model.name=tiny:d=64,layers=2,heads=4,ctx=32"


def test_topr_trains_and_its_taper_acts_after_the_first_minibatch(tmp_path):
    cfg, inj = make(
        tmp_path,
        MODEL,
        "sampling.prompts_per_step=4",
        "sampling.group_size=4",
        "sampling.max_new_tokens=6",
        "algorithm.surrogate=topr",
        "algorithm.surrogate_params={}",
        "algorithm.aggregation=seq_mean_token_mean",
        "optim.minibatches=2",
        "optim.lr=0.05",
    )
    run = setup(cfg, **inj)
    run.step = 1
    m = loop.train_step(run)
    # the first minibatch is on-policy (w = 1); the second sees the moved policy, where a
    # negative sequence's tapered ratio is below 1 unless its ratio rose
    assert 0.0 <= m["policy/taper_weight_mean"] <= 1.0
    assert m["policy/negative_frac"] > 0
    assert m["policy/taper_weight_mean"] < 1.0
