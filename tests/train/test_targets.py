"""The update's seams: frozen Targets and their rows, the micro-batch plan, and a group with
no loss token (every completion masked) inside a step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from train_toy import make

from grouprl.train import loop, update
from grouprl.train.state import setup
from grouprl.train.targets import Targets


def _targets(n=4, t=3):
    return Targets(
        adv=torch.arange(n, dtype=torch.float32),
        keep=torch.tensor([True, False, True, True][:n]),
        kl_weight=torch.full((n,), 2.0),
        ref_logp=torch.arange(n * t, dtype=torch.float32).view(n, t),
        clip={"eps_low": 0.2, "eps_high": torch.tensor([0.1, 0.2, 0.3, 0.4][:n])},
    )


def test_rows_select_every_per_sequence_value_and_keep_the_floats():
    t = _targets().rows(torch.tensor([3, 1]))
    assert t.adv.tolist() == [3.0, 1.0] and t.keep.tolist() == [True, False]
    assert t.kl_weight.tolist() == [2.0, 2.0] and t.ref_logp.tolist() == [[9, 10, 11], [3, 4, 5]]
    assert t.clip["eps_low"] == 0.2 and t.clip["eps_high"].tolist() == pytest.approx([0.4, 0.2])
    assert dataclasses.replace(_targets(), ref_logp=None).rows(torch.tensor([0])).ref_logp is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.adv = torch.zeros(2)


def test_targets_refuse_rows_of_different_lengths():
    good = _targets()
    with pytest.raises(ValueError, match=r"adv, keep and kl_weight must be \[N\] alike"):
        dataclasses.replace(good, keep=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"ref_logp must be \[N=4, T\]"):
        dataclasses.replace(good, ref_logp=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"clip\['eps_high'\] must be a float or \[N=4\]"):
        dataclasses.replace(good, clip={"eps_high": torch.ones(2)})


def test_micro_batch_plan_puts_gradient_groups_first_in_size_chunks():
    # groups of 2: group 0 has advantages, group 1 is collapsed (A = 0), group 2 has A
    t = Targets(
        adv=torch.tensor([1.0, -1.0, 0.0, 0.0, 0.5, -0.5]),
        keep=torch.ones(6, dtype=torch.bool),
        kl_weight=torch.ones(6),
        ref_logp=None,
        clip={},
    )
    rows = torch.arange(6)
    plan = update.micro_batches(rows, t, beta=0.0, g=2, size=2)
    assert [(m.tolist(), grad) for m, grad in plan] == [
        ([0, 1], True), ([4, 5], True), ([2, 3], False)
    ]  # fmt: skip
    whole = update.micro_batches(rows, t, beta=0.0, g=2, size=0)
    assert [(m.tolist(), grad) for m, grad in whole] == [([0, 1, 4, 5], True), ([2, 3], False)]
    # with a KL term every kept group has a gradient
    assert [g for _, g in update.micro_batches(rows, t, beta=0.1, g=2, size=0)] == [True]


def _step(tmp_path, batch_fn):
    """One update of a fixed batch (after ``batch_fn``), from the same model: metrics, params."""
    cfg, inj = make(tmp_path, "sampling.prompts_per_step=4", "sampling.group_size=4")
    run = setup(cfg, **inj)
    run.step = 1
    batch, _ = loop.collect_batch(run, loop.Timer(run.device))
    batch, adv = batch_fn(batch)
    n = batch.size
    targets = Targets(adv, torch.ones(n, dtype=torch.bool), torch.ones(n), None, {"eps_low": 0.2, "eps_high": 0.2})  # fmt: skip
    log = update.update_policy(
        run.policy, run.optimizer, batch, targets, update.LossSpec.of(run.preset, run.cfg),
        schedule=run.cfg.schedule(run.preset), shuffle=torch.Generator().manual_seed(0),
        timer=loop.Timer(run.device),
    )  # fmt: skip
    return log.metrics(), [p.detach().clone() for p in run.model.parameters()]


def test_a_group_without_a_loss_token_adds_nothing_to_the_step(tmp_path):
    """Found by the golden runs: a collapsed group whose completions were all cut by DAPO's
    overlong mask reached the loss as an all-zero mask and stopped the run. It has no token:
    the step must equal the step without it (parameters to the bit, statistics to rounding)."""
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])  # group 0's advantages; group 1 collapsed

    def with_masked_group(batch):
        rows = torch.arange(8)  # groups 0 and 1
        mask = batch.mask[rows].clone()
        mask[4:] = 0  # every completion of group 1 masked
        sub = dataclasses.replace(
            batch, prompt_ids=batch.prompt_ids[rows], prompt_mask=batch.prompt_mask[rows],
            completion_ids=batch.completion_ids[rows], mask=mask, old_logp=batch.old_logp[rows],
            truncated=batch.truncated[rows], rewards=batch.rewards[:2], example_ids=batch.example_ids[:2],
        )  # fmt: skip
        return sub, torch.cat([adv, torch.zeros(4)])

    def without(batch):
        sub, _ = with_masked_group(batch)
        rows = torch.arange(4)
        return dataclasses.replace(
            sub, prompt_ids=sub.prompt_ids[rows], prompt_mask=sub.prompt_mask[rows],
            completion_ids=sub.completion_ids[rows], mask=sub.mask[rows],
            old_logp=sub.old_logp[rows], truncated=sub.truncated[rows], rewards=sub.rewards[:1],
            example_ids=sub.example_ids[:1],
        ), adv  # fmt: skip

    m_with, p_with = _step(tmp_path / "a", with_masked_group)
    m_without, p_without = _step(tmp_path / "b", without)
    assert m_with["optim/steps"] == 1.0 and m_with["optim/skipped_steps"] == 0.0
    for a, b in zip(p_with, p_without):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    for key in ("policy/ratio_mean", "policy/ratio_max", "loss/pg", "optim/grad_norm"):
        assert m_with[key] == pytest.approx(m_without[key], rel=1e-6, abs=1e-9), key


def test_per_token_advantages_follow_the_rows_and_decide_the_gradient_groups():
    # [N, T] advantages (a token-level estimator): rows() slices them like every [N] value,
    # and a group lives when any token of any of its rows has a non-zero advantage
    adv = torch.zeros(6, 3)
    adv[1, 2] = 0.5  # group 0 (rows 0-1): one token
    adv[4] = -1.0  # group 2 (rows 4-5)
    t = Targets(adv, torch.ones(6, dtype=torch.bool), torch.ones(6), None, {})
    assert t.rows(torch.tensor([4, 1])).adv.tolist() == [[-1.0] * 3, [0.0, 0.0, 0.5]]
    plan = update.micro_batches(torch.arange(6), t, beta=0.0, g=2, size=0)
    assert [(m.tolist(), grad) for m, grad in plan] == [([0, 1, 4, 5], True), ([2, 3], False)]
    with pytest.raises(ValueError, match=r"adv may be \[N, T\] per token"):
        Targets(torch.zeros(6, 3, 2), torch.ones(6, dtype=torch.bool), torch.ones(6), None, {})
