"""Groups whose loss is exactly 0 (collapsed, dropped) skip the backward: same update, same log."""

from __future__ import annotations

import pytest
import torch
from train_toy import make

from grouprl import losses
from grouprl.train import update
from grouprl.train.loop import train
from grouprl.train.sinks import read_jsonl
from grouprl.train.update import gradient_rows


def test_gradient_rows_of_per_token_advantages():
    # [n, T] advantages (token-level estimators): a row lives when any of its tokens does;
    # group 0 is zero on every token, group 1 has one non-zero token in its second row
    adv = torch.zeros(4, 3)
    adv[3, 2] = 0.5
    keep, kl_w = torch.ones(4, dtype=torch.bool), torch.ones(4)
    got = gradient_rows(torch.arange(4), adv=adv, keep=keep, kl_weight=kl_w, beta=0.0, g=2)
    assert got.tolist() == [False, False, True, True]


def test_gradient_rows_known_answer():
    # 3 groups of 2: group 0 collapsed (A = 0), group 1 mixed, group 2 mixed but dropped
    rows = torch.arange(6)
    adv = torch.tensor([0.0, 0.0, 0.7, -0.7, 1.0, -1.0])
    keep = torch.tensor([True, True, True, True, False, False])
    kl_w = torch.ones(6)
    got = gradient_rows(rows, adv=adv, keep=keep, kl_weight=kl_w, beta=0.0, g=2)
    assert got.tolist() == [False, False, True, True, False, False]
    # with a KL term the collapsed group still has a gradient; the dropped one never does
    got = gradient_rows(rows, adv=adv, keep=keep, kl_weight=kl_w, beta=0.04, g=2)
    assert got.tolist() == [True, True, True, True, False, False]
    # ... unless its KL weight is 0 (grpo_beta_comp's weights can vanish)
    kl_w[:2] = 0.0
    got = gradient_rows(rows, adv=adv, keep=keep, kl_weight=kl_w, beta=0.04, g=2)
    assert got.tolist() == [False, False, True, True, False, False]
    # a subset of rows (one minibatch) is judged on its own groups
    got = gradient_rows(torch.tensor([2, 3, 0, 1]), adv=adv, keep=keep, kl_weight=kl_w,
                        beta=0.0, g=2)  # fmt: skip
    assert got.tolist() == [True, True, False, False]
    # KL-Cov's and DRO's penalties act at A = 0: every kept row is live, dropped rows never
    assert set(losses.SURROGATES) - {"kl_cov", "dro"} == losses.ZERO_AT_ZERO_ADVANTAGE
    got = gradient_rows(rows, adv=adv, keep=keep, kl_weight=kl_w, beta=0.0, g=2, every_row=True)
    assert got.tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize("name", sorted(losses.SURROGATES))
def test_zero_advantage_rows_add_nothing_exactly_for_the_listed_surrogates(name):
    # off-policy rows with A = 0: the loss and its gradient vanish iff the surrogate says so
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 5, generator=g, dtype=torch.float64) - 0.1).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    params = {"dro": {"beta": 0.2}, "kl_cov": {"kl_cov_ratio": 0.5}}.get(name, {})
    adv = torch.zeros(4, dtype=torch.float64)
    adv[0] = 1.0  # one live row, so that the covariance centring is not degenerate
    per_token, _ = losses.surrogate(name, logp, old, adv, torch.ones(4, 5), **params)
    (grad,) = torch.autograd.grad(per_token[1:].sum(), logp)
    vanishes = bool((per_token[1:] == 0).all() and (grad == 0).all())
    assert vanishes == (name in losses.ZERO_AT_ZERO_ADVANTAGE)


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "rloo"])  # the three aggregations
def test_skipping_the_backward_of_zero_loss_groups_changes_nothing(tmp_path, preset, monkeypatch):
    """The gradient AdamW receives and every logged metric equal the run that backpropagates
    every group (gradient_rows forced to all True); fewer rows go through autograd. One step:
    after it the two runs' weights differ in the last bits, and Adam's first update
    (≈ lr·sign(g)) turns that into visible differences where g ≈ 0."""
    grads: dict[str, list[list[torch.Tensor]]] = {"skip": [], "all": []}
    grad_rows: dict[str, int] = {"skip": 0, "all": 0}
    real_step, real_rows = torch.optim.AdamW.step, update.gradient_rows

    def recording_step(self, *args, **kwargs):
        grads[mode].append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    rows = {}
    for mode in ("skip", "all"):
        if mode == "all":
            monkeypatch.setattr(update, "gradient_rows", lambda r, **k: torch.ones_like(r).bool())
        cfg, inj = make(tmp_path / mode, "optim.steps=1", f"algorithm.preset={preset}",
                        "sampling.prompts_per_step=16", "optim.micro_batch_size=8",
                        "optim.grad_clip=0")  # fmt: skip

        def count(module, args, kwargs, mode=mode):
            if torch.is_grad_enabled():
                grad_rows[mode] += kwargs["input_ids"].shape[0]

        hook = inj["model"].model.register_forward_pre_hook(count, with_kwargs=True)
        train(cfg, **inj)
        hook.remove()
        rows[mode] = [
            {k: v for k, v in r.items() if not k.startswith("time/")}
            for r in read_jsonl(tmp_path / mode / "metrics.jsonl")
        ]
    monkeypatch.setattr(update, "gradient_rows", real_rows)
    assert any(r["acr/rate"] > 0 for r in rows["all"])  # some group collapsed: a real test
    assert grad_rows["skip"] < grad_rows["all"]
    for i, (a, b) in enumerate(zip(rows["skip"], rows["all"])):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], abs=1e-6, rel=1e-5), (i, key)
    for i, (step_a, step_b) in enumerate(zip(grads["skip"], grads["all"], strict=True)):
        for x, y in zip(step_a, step_b):
            torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-5, msg=f"step {i}")


def test_a_step_where_no_group_has_a_gradient_still_steps_adamw(tmp_path, monkeypatch):
    """All groups collapsed: no backward runs, AdamW still takes its (zero-gradient) step, as
    it did when a backward produced zeros: its step count advances."""
    monkeypatch.setattr(update, "gradient_rows", lambda r, **k: torch.zeros_like(r).bool())
    cfg, inj = make(tmp_path, "optim.steps=2")
    seen = []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        seen.append(
            all(p.grad is not None and not p.grad.any() for p in self.param_groups[0]["params"])
        )
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    train(cfg, **inj)
    assert seen == [True, True]


@pytest.mark.parametrize("surrogate", ["dro", "kl_cov"])
def test_penalty_surrogates_backpropagate_zero_advantage_groups(tmp_path, monkeypatch, surrogate):
    """DRO's and KL-Cov's penalties act on a row with A = 0 once the policy has moved (the
    second minibatch): the trainer must not skip those groups. The gradients AdamW receives
    equal those of the run that backpropagates every group."""
    grads: dict[str, list[list[torch.Tensor]]] = {"plan": [], "all": []}
    real_step, real_rows = torch.optim.AdamW.step, update.gradient_rows

    def recording_step(self, *args, **kwargs):
        grads[mode].append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    params = "beta=0.5" if surrogate == "dro" else "kl_cov_ratio=0.5"
    for mode in ("plan", "all"):
        if mode == "all":
            monkeypatch.setattr(update, "gradient_rows", lambda r, **k: torch.ones_like(r).bool())
        cfg, inj = make(tmp_path / mode, "optim.steps=1", "optim.minibatches=2",
                        "sampling.prompts_per_step=16", "optim.grad_clip=0",
                        f"algorithm.overrides.surrogate={surrogate}",
                        f"algorithm.overrides.surrogate_params.{params}")  # fmt: skip
        train(cfg, **inj)
    monkeypatch.setattr(update, "gradient_rows", real_rows)
    assert len(grads["plan"]) == len(grads["all"]) == 2
    for step_a, step_b in zip(grads["plan"], grads["all"], strict=True):
        for x, y in zip(step_a, step_b):
            torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-5)
