"""Rollouts at another precision than the trainer's: the mismatch is logged and corrected.

``model.rollout_precision=bfloat16`` with fp32 training is the mismatch a vLLM-bf16 + FSDP-fp32
stack has. Known answers: after the trainer recomputes the behaviour log-probs at its own
precision, step 1 is on-policy *for the trainer* (ratio 1 to fp32 rounding) while the rollout
log-probs differ (mismatch/* > 0); the weights reaching the loss are exactly
``correction.compute`` of the batch's two log-probs; matched precision leaves every number of
the step unchanged, correction set or not.
"""

from __future__ import annotations

import pytest
import torch
from train_toy import make

from grouprl import losses
from grouprl.losses import correction
from grouprl.train import loop, update
from grouprl.train.config import ConfigError, load_config
from grouprl.train.state import setup

MODEL = "model.name=tiny:d=64,layers=2,heads=4,ctx=32"
BIG = [MODEL, "sampling.prompts_per_step=8", "sampling.group_size=8", "sampling.max_new_tokens=8"]


def _run(tmp_path, *extra):
    cfg, inj = make(tmp_path, *BIG, *extra)
    run = setup(cfg, **inj)
    run.step = 1
    return run


def _record(monkeypatch):
    """Keeps the batch of stage 2b and every ``losses.objective`` call's correction."""
    seen: dict[str, list] = {"batch": [], "weight": [], "keep": [], "rows": []}
    real_rc, real_obj, real_mbl = loop.rollout_correction, losses.objective, update.micro_batch_loss

    def rc(run, batch, timer):
        out = real_rc(run, batch, timer)
        seen["batch"].append(out[0])
        return out

    def obj(*a, **k):
        seen["weight"].append(k.get("correction_weight"))
        seen["keep"].append(k.get("correction_keep"))
        return real_obj(*a, **k)

    def mbl(policy, batch, targets, spec, m, totals, *, timer, selected=None):
        seen["rows"].append(m.clone())
        return real_mbl(policy, batch, targets, spec, m, totals, timer=timer, selected=selected)

    monkeypatch.setattr(loop, "rollout_correction", rc)
    monkeypatch.setattr(loop.losses, "objective", obj)
    monkeypatch.setattr(update, "micro_batch_loss", mbl)
    return seen


def test_bf16_rollouts_log_their_mismatch_and_step_one_is_on_policy_for_the_trainer(tmp_path):
    m = loop.train_step(_run(tmp_path, "model.rollout_precision=bfloat16"))
    assert m["mismatch/logp_diff_max"] > 1e-4  # bf16 sampling moved the log-probs
    assert m["mismatch/kl_k3"] > 0 and m["mismatch/ratio_max"] > 1 > m["mismatch/ratio_min"]
    # the ratio of the update is against the trainer's recomputation: on-policy at step 1
    assert abs(m["policy/ratio_max"] - 1) < 1e-5 and abs(m["policy/ratio_min"] - 1) < 1e-5
    assert "time/correction" in m and not any(k.startswith("corr/") for k in m)


@pytest.mark.parametrize(
    "spec",
    [
        "token_tis:cap=1.0005",
        "icepop:low=0.9995,high=1.0005",
        "seq_mis:cap=1.001",
        "binary_kl:threshold=1e-7,level=token,drop=zero,is_weight=true",
    ],
)
def test_the_corrections_weights_reach_the_loss(tmp_path, monkeypatch, spec):
    seen = _record(monkeypatch)
    m = loop.train_step(
        _run(
            tmp_path,
            "model.rollout_precision=bfloat16",
            f"algorithm.rollout_correction={spec}",
            "optim.micro_batch_size=16",
        )
    )
    (batch,) = seen["batch"]
    assert batch.rollout_logp is not None and not torch.equal(batch.rollout_logp, batch.old_logp)
    want = correction.compute(spec, batch.old_logp, batch.rollout_logp, batch.mask)
    assert want.stats["corr/weight_mean"] != 1.0  # the tight caps act on this mismatch
    assert len(seen["rows"]) == len(seen["weight"]) > 1  # several micro-batches
    for rows, w in zip(seen["rows"], seen["weight"]):
        torch.testing.assert_close(w, want.weight[rows], atol=0, rtol=0)
    assert m["corr/weight_mean"] == pytest.approx(want.stats["corr/weight_mean"])


def test_rejection_leaves_the_normalisers_and_accumulation_stays_exact(tmp_path, monkeypatch):
    spec = "rejection:stat=k3,level=token,threshold=1e-7"
    common = ("model.rollout_precision=bfloat16", f"algorithm.rollout_correction={spec}",
              "algorithm.aggregation=token_mean")  # fmt: skip
    seen = _record(monkeypatch)
    counted: list[torch.Tensor] = []
    real_totals = losses.step_totals
    monkeypatch.setattr(
        loop.losses,
        "step_totals",
        lambda masks, **k: counted.append(masks) or real_totals(masks, **k),
    )
    whole = loop.train_step(_run(tmp_path / "a", *common, "optim.micro_batch_size=0"))
    (batch,) = seen["batch"]
    corr = correction.compute(spec, batch.old_logp, batch.rollout_logp, batch.mask)
    (mask,) = counted  # one optimizer step over every row: the rejected tokens are not counted
    torch.testing.assert_close(mask, corr.loss_mask(batch.mask))
    assert float(mask.sum()) < float(batch.mask.sum())
    monkeypatch.undo()
    parts = loop.train_step(_run(tmp_path / "b", *common, "optim.micro_batch_size=8"))
    assert 0 < whole["corr/rejected_frac"] < 1
    assert whole["loss/pg"] == pytest.approx(parts["loss/pg"], rel=1e-5, abs=1e-8)


def test_opsm_runs_in_the_loss_on_the_current_policy(tmp_path, monkeypatch):
    seen = _record(monkeypatch)
    calls: list[torch.Tensor] = []
    real = correction.compute

    def compute(spec, train, rollout, mask, **k):
        calls.append(train)
        return real(spec, train, rollout, mask, **k)

    monkeypatch.setattr(correction, "compute", compute)
    loop.train_step(
        _run(
            tmp_path,
            "model.rollout_precision=bfloat16",
            "algorithm.rollout_correction=opsm:threshold=0",
        )
    )
    assert calls and all(not c.requires_grad for c in calls)  # logp.detach() of each micro-batch
    zeroed = torch.cat([w[:, 0] == 0 for w in seen["weight"] if w is not None])
    assert zeroed.any()  # negative-advantage sequences that drifted were dropped


def test_matched_precision_is_unchanged_by_a_correction_setting(tmp_path, capsys):
    a = loop.train_step(_run(tmp_path / "a"))
    b = loop.train_step(_run(tmp_path / "b", "algorithm.rollout_correction=icepop"))
    drop = {k for k in a if k.startswith("time/")}
    assert {k: v for k, v in a.items() if k not in drop} == {
        k: v for k, v in b.items() if k not in drop
    }
    assert not any(k.startswith(("mismatch/", "corr/")) for k in b)
    c = loop.train_step(
        _run(tmp_path / "c", "model.autocast=bfloat16", "model.rollout_precision=bf16")
    )
    assert "mismatch/kl_k3" not in c  # bf16 and bf16: one engine


def test_a_correction_with_matched_precision_says_so(tmp_path, capsys):
    cfg, inj = make(tmp_path, *BIG, "algorithm.rollout_correction=icepop", "optim.steps=1")
    loop.train(cfg, **inj)
    assert "algorithm.rollout_correction='icepop' has nothing to correct" in capsys.readouterr().out


def test_bad_settings_are_config_errors(tmp_path):
    with pytest.raises(
        ConfigError, match=r"model\.rollout_precision must be one of same, none, bfloat16"
    ):
        load_config(None, ["model.rollout_precision=fp8", f"run.out={tmp_path}"])
    with pytest.raises(ConfigError, match="unknown rollout correction 'icepo'; valid corrections"):
        load_config(None, ["algorithm.rollout_correction=icepo", f"run.out={tmp_path}"])
    with pytest.raises(ConfigError, match="the upper cap must be a finite number >= 1"):
        load_config(None, ["algorithm.rollout_correction=seq_tis:cap=0.5", f"run.out={tmp_path}"])
