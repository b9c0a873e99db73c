"""Mismatch metrics (hand-derived) and the rollout_mismatch health rule."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import diagnostics
from grouprl.diagnostics import mismatch

LN2 = math.log(2.0)


def test_hand_values_one_sequence_of_two_tokens():
    # log rho = [ln 2, -ln 2]: rho = 2 and 0.5, product 1
    train = torch.tensor([[-0.5, -1.0, 9.0]])
    rollout = train - torch.tensor([[LN2, -LN2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third is padding (holds 9.0)
    m = diagnostics.mismatch_metrics(train, rollout, mask)
    assert set(m) == set(mismatch.MISMATCH_KEYS)
    want = {
        "kl_k1": 0.0,  # mean(-log rho)
        "kl_k3": ((2 - 1 - LN2) + (0.5 - 1 + LN2)) / 2,  # = 0.25
        "chi2_token": (4 + 0.25) / 2 - 1,
        "chi2_seq": 0.0,  # (2 * 0.5)^2 - 1
        "ppl_train": math.exp(0.75),
        "ppl_rollout": math.exp(0.75),  # same mean log-prob
        "ppl_ratio": 1.0,
        "ess_token": 2.5**2 / (2 * 4.25),
        "ess_seq": 1.0,  # one sequence
        "logp_diff_mean": LN2,
        "logp_diff_max": LN2,
        "ratio_min": 0.5,
        "ratio_p50": 1.25,  # linear interpolation between 0.5 and 2
        "ratio_max": 2.0,
        "seq_log_ratio_p01": 0.0,
    }
    for key, value in want.items():
        assert m[f"mismatch/{key}"] == pytest.approx(value, abs=1e-6), key


def test_matched_log_probs_give_zero_mismatch():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g)
    m = diagnostics.mismatch_metrics(logp, logp.clone(), torch.ones(6, 5))
    for key in ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "logp_diff_max"):
        assert m[f"mismatch/{key}"] == 0.0
    assert m["mismatch/ess_token"] == pytest.approx(1.0) and m["mismatch/ratio_max"] == 1.0


def test_quantiles_equal_torch_quantile():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(101, generator=g)
    got = mismatch.quantiles(x, {"a": 0.01, "b": 0.5, "c": 0.973})
    want = torch.quantile(x, torch.tensor([0.01, 0.5, 0.973]))
    torch.testing.assert_close(torch.stack(list(got.values())), want)


def test_nan_rollout_tokens_are_left_out_or_refused():
    train = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-1.0 - LN2, float("nan")]])
    m = diagnostics.mismatch_metrics(train, rollout, torch.ones(1, 2))
    assert m["mismatch/ratio_max"] == pytest.approx(2.0) and m[
        "mismatch/ratio_min"
    ] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="1 NaN value"):
        diagnostics.mismatch_metrics(train, rollout, torch.ones(1, 2), nan_rollout="error")
    with pytest.raises(ValueError, match="rollout_logp must have the shape"):
        diagnostics.mismatch_metrics(train, rollout[:, :1], torch.ones(1, 2))


def test_effective_sample_size_bounds():
    mask = torch.ones(4, dtype=torch.bool)
    assert float(diagnostics.effective_sample_size(torch.ones(4), mask)) == pytest.approx(1.0)
    one = torch.tensor([5.0, 0.0, 0.0, 0.0])
    assert float(diagnostics.effective_sample_size(one, mask)) == pytest.approx(0.25)
    assert float(diagnostics.effective_sample_size(torch.zeros(4), mask)) == 0.0


# --------------------------------------------------------------------------- the health rule
def _feed(health, steps, kl, **extra):
    out = []
    for s in steps:
        out += health.update(s, {"mismatch/kl_k3": kl, "mismatch/ratio_p99": 1.3, **extra})
    return out


def test_rollout_mismatch_is_said_once_then_on_doubling_then_anew_after_it_went():
    h = diagnostics.RunHealth()
    assert _feed(h, range(1, 5), 5e-4) == []  # under the 1e-3 limit
    first = _feed(h, range(5, 40), 2e-3)
    assert len(first) == 1 and first[0].startswith("[rollout_mismatch] step 5: KL(rollout||train)")
    assert "algorithm.rollout_correction=icepop" in first[0]
    assert _feed(h, range(40, 60), 3.9e-3) == []  # not yet doubled
    grown = _feed(h, [60], 4.5e-3)
    assert len(grown) == 1 and "grew to" in grown[0] and "was 0.002" in grown[0]
    assert _feed(h, [61], 4e-4) == []  # below half the limit: over
    again = _feed(h, [62], 1.5e-3)
    assert len(again) == 1 and "grew" not in again[0]
    assert h.fired_total["rollout_mismatch"] == 3


def test_rollout_mismatch_with_the_correction_on_says_how_much_it_drops():
    h = diagnostics.RunHealth()
    (line,) = _feed(h, [3], 5e-3, **{"corr/weight_mean": 0.9, "corr/zeroed_frac": 0.02})
    assert "the correction is on (2.0% of tokens zeroed or rejected)" in line


def test_rollout_mismatch_state_survives_a_checkpoint():
    h = diagnostics.RunHealth()
    _feed(h, [1], 2e-3)
    h2 = diagnostics.RunHealth()
    h2.load_state_dict(h.state_dict())
    assert _feed(h2, [2], 2.5e-3) == []  # already said, not doubled


def test_diagnose_shows_a_grouprl_runs_mismatch(tmp_path, capsys):
    import json

    from grouprl.cli import main

    rows = [
        {"step": 1, "mismatch/kl_k3": 2e-4, "mismatch/ratio_p99": 1.1, "reward/mean": 0.1},
        {"step": 2, "mismatch/kl_k3": 3e-3, "mismatch/ratio_p99": 1.9, "corr/weight_mean": 0.97},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["diagnose", str(tmp_path), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "Rollout vs trainer mismatch (grouprl log, 2 steps)" in out
    assert out.count("[rollout_mismatch] step 2") == 1  # replayed once, not twice
    summary = mismatch.summarize(rows)
    kl = next(r for r in summary if r["quantity"] == "mismatch/kl_k3")
    assert kl == {
        "quantity": "mismatch/kl_k3",
        "steps": 2,
        "first": 2e-4,
        "last": 3e-3,
        "max": 3e-3,
    }
