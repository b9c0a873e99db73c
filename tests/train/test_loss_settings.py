"""The algorithm section's loss options reach the update: ``kl_correction``,
``top_entropy_quantile`` and the batch their selections span (``selection``).

- ``kl_correction``: one ``train()`` step of the hand policy (``hand_policy.py``) whose second
  minibatch is off-policy and away from the reference, against the update derived by hand
  with the corrected KL gradient, and against the plain one it must differ from.
- the top-entropy threshold and KL-Cov's / Clip-Cov's selection, step-level: the gradient
  one optimizer step accumulates over four micro-batches of the toy model equals the
  gradient of the same objective on the whole minibatch as one batch; with
  ``selection=micro_batch`` (or the setting ignored) it is a different gradient.
- the config's errors.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hand_policy import (
    AdamW,
    HandTask,
    Row,
    completion_tokens,
    expected_update,
    first_is,
    groups,
    grpo_advantages,
    theta_of,
    train_hand,
)
from train_toy import WORDS, ToyTask, make

from grouprl import losses
from grouprl.tasks.base import Example
from grouprl.train import update
from grouprl.train.config import ConfigError, load_config
from grouprl.train.loop import Timer, UpdateLog, collect_batch, step_advantages
from grouprl.train.state import setup
from grouprl.train.targets import Targets
from grouprl.train.update import LossSpec

G = 4


def _far(a, b, margin=1e-3) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) > margin


# ---- kl_correction: a known answer through train() -------------------------------------------


@pytest.mark.parametrize("correction", ["ratio", "straight_through"])
def test_kl_correction_changes_the_kl_gradient_as_derived(tmp_path, correction):
    # two minibatches of one group, in the order the seeded shuffle gives ([1, 0] at seed 3):
    # the second is taken at θ1 ≠ θ0 = the reference, so ρ ≠ 1 and KL ≠ 0 there, and the
    # corrected KL gradient (ρ·(KL + KL') or min(ρ, 10)·(log π − log π_ref)) differs from k3's
    seed = 3
    order = torch.randperm(2, generator=torch.Generator().manual_seed(seed * 1_000_003 + 1))
    task = HandTask({"ab": first_is("a", empty=0.5)})
    _, policy, theta0 = train_hand(
        tmp_path, task, f"run.seed={seed}", "optim.minibatches=2", "optim.lr=1.0",
        "algorithm.beta=2.0", "algorithm.kl=k3", f"algorithm.kl_correction={correction}",
    )  # fmt: skip
    calls = groups(task.calls, G)
    assert all(len({c.reward for c in grp}) > 1 for grp in calls)  # both minibatches move θ
    per_group = [
        [
            Row(completion_tokens(c.text, 1), a, theta0)
            for c, a in zip(grp, grpo_advantages([c.reward for c in grp]))
        ]
        for grp in calls
    ]
    batches = [per_group[p] for p in order.tolist()]
    loss = {"aggregation": "seq_mean_token_mean", "beta": 2.0, "kl": "k3", "ref_theta": theta0}
    want, _ = expected_update(theta0, batches, opt=AdamW(lr=1.0), kl_correction=correction, **loss)
    plain, _ = expected_update(theta0, batches, opt=AdamW(lr=1.0), **loss)
    assert _far(want, plain, 1e-4)
    assert theta_of(policy) == pytest.approx(want, abs=1e-6)


# ---- the step-level selections: one batch's gradient ------------------------------------------


class _VariedTask(ToyTask):
    """The toy task with a different prompt per group, so that token entropies differ
    between groups (the same prompt would tie them at each position)."""

    def examples(self, split, n, seed):
        return [
            Example(f"varied/{split}/{seed}/{i}", " ".join(WORDS[: 1 + (i + seed) % 4]), "a")
            for i in range(n)
        ]


def _step_inputs(tmp_path, *extra):
    """A run of the toy model at four micro-batches of one group, its first batch, and the
    step's Targets, built as ``train_step`` builds them; ``old_logp`` moved off-policy and
    the reference away from the policy."""
    cfg, inj = make(tmp_path, "optim.micro_batch_size=4", *extra, task=_VariedTask())
    run = setup(cfg, **inj)
    batch, _ = collect_batch(run, Timer(run.device))
    g = torch.Generator().manual_seed(0)
    noise = 0.3 * torch.randn((2, *batch.old_logp.shape), generator=g) * batch.mask
    batch = dataclasses.replace(batch, old_logp=batch.old_logp + noise[0])
    ref = run.reference.logprobs(run.policy, batch)
    ref = None if ref is None else ref + noise[1]
    adv, adv_n, _ = step_advantages(run, batch, ref)
    keep = adv.keep.repeat_interleave(batch.group_size) & ~torch.isnan(batch.rewards).reshape(-1)
    clip, _ = run.controller.clip_params(run.policy, batch, dict(run.preset.surrogate_params))
    kl_weight = adv.kl_weight.float().repeat_interleave(batch.group_size)
    beta = run.preset.beta
    targets = Targets(adv_n, keep, kl_weight, ref if beta > 0 else None, clip)
    return run, batch, targets


def _trainer_gradient(run, batch, targets, monkeypatch) -> torch.Tensor:
    """The gradient one ``optimizer_step`` over every row hands to AdamW (the step itself is
    not taken), flattened."""
    seen = {}

    def capture(params, optimizer, spec, *, finite, timer):
        seen["grad"] = torch.cat([q.grad.reshape(-1) for q in params])
        optimizer.zero_grad(set_to_none=True)
        return 0.0

    monkeypatch.setattr(update, "guarded_step", capture)
    rows = torch.arange(batch.mask.shape[0])
    torch.manual_seed(7)  # Clip-Cov's draw
    update.optimizer_step(
        run.policy, run.optimizer, batch, targets, LossSpec.of(run.preset, run.cfg), rows,
        timer=Timer(run.device), log=UpdateLog(),
    )  # fmt: skip
    return seen["grad"]


def _one_batch_gradient(run, batch, targets, algo=None) -> torch.Tensor:
    """The gradient of the run's objective on all rows as one batch (selections and the
    quantile taken in that one call), the rows in the order the loop's own split puts them;
    ``algo``: other algorithm options than the run's."""
    p, algo = run.preset, algo or run.cfg.algorithm
    micro = update.micro_batches(
        torch.arange(batch.mask.shape[0]), targets, beta=p.beta, g=batch.group_size, size=0,
        every_row=p.surrogate not in losses.ZERO_AT_ZERO_ADVANTAGE,
    )  # fmt: skip
    rows = torch.cat([m for m, _ in micro])  # the order the step's lists are built in
    lp = run.policy.logprobs(batch, rows, entropy=True)
    t = targets.rows(rows)
    totals = losses.step_totals(
        batch.mask[rows], keep=t.keep,
        max_len=max(run.cfg.sampling.max_new_tokens, batch.mask.shape[1]),
    )  # fmt: skip
    torch.manual_seed(7)
    obj = losses.objective(
        lp.logp, batch.old_logp[rows], t.adv, batch.mask[rows], surrogate=p.surrogate,
        surrogate_params=dict(t.clip), aggregation=p.aggregation, totals=totals, keep=t.keep,
        ref_logp=t.ref_logp, kl=p.kl, beta=p.beta, kl_weight=t.kl_weight,
        kl_correction=algo.kl_correction, entropy=lp.entropy,
        top_entropy_quantile=algo.top_entropy_quantile,
    )  # fmt: skip
    params = [q for q in run.model.parameters() if q.requires_grad]
    grads = torch.autograd.grad(obj.loss, params)
    return torch.cat([x.reshape(-1) for x in grads])


def _assert_close(a, b):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def _differ(a, b):
    return (a - b).abs().max() > 1e-4 * b.abs().max()


def test_top_entropy_step_threshold_gives_the_one_batch_gradient(tmp_path, monkeypatch):
    run, batch, targets = _step_inputs(tmp_path / "s", "algorithm.top_entropy_quantile=0.3")
    assert len(update.micro_batches(torch.arange(16), targets, beta=0.0, g=4, size=4)) > 1
    got = _trainer_gradient(run, batch, targets, monkeypatch)
    want = _one_batch_gradient(run, batch, targets)
    _assert_close(got, want)
    # ignored (every token) and per-micro-batch thresholds are other gradients
    full = dataclasses.replace(run.cfg.algorithm, top_entropy_quantile=1.0)
    run.cfg = dataclasses.replace(run.cfg, algorithm=full)
    assert _differ(_trainer_gradient(run, batch, targets, monkeypatch), want)
    local = dataclasses.replace(full, top_entropy_quantile=0.3, selection="micro_batch")
    run.cfg = dataclasses.replace(run.cfg, algorithm=local)
    assert _differ(_trainer_gradient(run, batch, targets, monkeypatch), want)


@pytest.mark.parametrize(
    ("surrogate", "params"),
    [
        ("kl_cov", "{kl_cov_ratio: 0.1, ppo_kl_coef: 1.0}"),
        ("clip_cov", "{clip_cov_ratio: 0.1, clip_cov_lb: -10.0, clip_cov_ub: 10.0}"),
    ],
)
def test_covariance_selection_over_the_step_gives_the_one_batch_gradient(
    tmp_path, monkeypatch, surrogate, params
):
    run, batch, targets = _step_inputs(
        tmp_path, f"algorithm.surrogate={surrogate}", f"algorithm.surrogate_params={params}"
    )
    got = _trainer_gradient(run, batch, targets, monkeypatch)
    want = _one_batch_gradient(run, batch, targets)
    _assert_close(got, want)
    local = dataclasses.replace(run.cfg.algorithm, selection="micro_batch")
    run.cfg = dataclasses.replace(run.cfg, algorithm=local)
    assert _differ(_trainer_gradient(run, batch, targets, monkeypatch), want)


def test_kl_correction_reaches_the_micro_batch_objective(tmp_path, monkeypatch):
    run, batch, targets = _step_inputs(
        tmp_path, "algorithm.beta=0.1", "algorithm.kl_correction=ratio"
    )
    got = _trainer_gradient(run, batch, targets, monkeypatch)
    _assert_close(got, _one_batch_gradient(run, batch, targets))
    plain = dataclasses.replace(run.cfg.algorithm, kl_correction=None)
    assert _differ(got, _one_batch_gradient(run, batch, targets, plain))


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.kl_correction=ratios", "valid: ratio, sequence_ratio, straight_through"),
        ("algorithm.kl_correction=ratio", "set algorithm.beta > 0"),
        ("algorithm.top_entropy_quantile=0", r"must be in \(0, 1\]"),
        ("algorithm.top_entropy_quantile=1.5", r"must be in \(0, 1\]"),
        ("algorithm.selection=batch", "must be one of step, micro_batch"),
        ("algorithm.top_entropy_quantile=high", "must be float"),
    ],
)
def test_bad_loss_options_are_clear_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.name=tiny", override])


def test_the_loss_options_load_and_default_to_the_plain_loss():
    cfg = load_config(None, ["model.name=tiny"])
    a = cfg.algorithm
    assert (a.kl_correction, a.top_entropy_quantile, a.selection) == (None, 1.0, "step")
    cfg = load_config(
        None,
        ["model.name=tiny", "algorithm.beta=0.04", "algorithm.kl_correction=straight_through",
         "algorithm.top_entropy_quantile=0.2", "algorithm.selection=micro_batch"],
    )  # fmt: skip
    a = cfg.algorithm
    assert (a.kl_correction, a.top_entropy_quantile, a.selection) == (
        "straight_through", 0.2, "micro_batch",
    )  # fmt: skip
    assert math.isclose(cfg.algorithm.resolve().beta, 0.04)
