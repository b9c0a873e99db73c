"""The training loop end to end on a tiny model: every preset, learning, determinism, resume,
non-finite steps, unscorable rewards, exact gradient accumulation."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from train_toy import ToyTask, make

from grouprl import presets
from grouprl.tasks.verify import UnscorableError
from grouprl.train.loop import TrainingError, train
from grouprl.train.sinks import read_jsonl


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rows(run_dir, drop=("time/",)):
    return [
        {k: v for k, v in r.items() if not k.startswith(drop)}
        for r in read_jsonl(run_dir / "metrics.jsonl")
    ]


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_runs_three_steps(tmp_path, name):
    cfg, inj = make(tmp_path, f"algorithm.preset={name}")
    before = _snapshot(inj["model"])
    result = train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and result.step == 3
    for r in rows:
        assert math.isfinite(r["loss/total"]) and r["optim/skipped_steps"] == 0
        assert {"acr/rate", "reward/mean", "policy/ratio_mean", "time/step"} <= set(r)
    changed = max((p - before[n]).abs().max().item() for n, p in inj["model"].named_parameters())
    assert changed > 1e-4
    assert len(read_jsonl(tmp_path / "rewards.jsonl")) >= 3  # one line per group and step


def test_reward_rises_on_a_trivially_learnable_task(tmp_path):
    cfg, inj = make(tmp_path, "optim.steps=30", "sampling.prompts_per_step=8")
    train(cfg, **inj)
    reward = [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert last > first + 0.3 and last > 0.6, (first, last)


def test_two_seeded_runs_give_identical_metrics(tmp_path):
    for sub in ("a", "b"):
        cfg, inj = make(
            tmp_path / sub,
            "optim.steps=4",
            "eval.every=2",
            "eval.prompts=3",
            "eval.samples=4",
            "eval.ks=[1,4]",
        )
        train(cfg, **inj)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a == b and [r["step"] for r in a] == [0, 1, 2, 3, 4] and "eval/pass@4" in a[2]
    assert set(a[0]) == {"step", "eval/pass@1", "eval/pass@4", "eval/reward_mean"}  # the start
    assert read_jsonl(tmp_path / "a/rewards.jsonl") == read_jsonl(tmp_path / "b/rewards.jsonl")
    # another seed gives other numbers (the comparison above can fail)
    cfg, inj = make(tmp_path / "c", "optim.steps=4", "run.seed=1")
    train(cfg, **inj)
    assert _rows(tmp_path / "c") != _rows(tmp_path / "a")


@pytest.mark.parametrize("preset", ["avspo", "agpo"])  # controllers with state
def test_resume_equals_no_resume(tmp_path, preset):
    common = [
        "optim.steps=6",
        "run.every=2",
        "eval.every=2",
        "eval.prompts=2",
        "eval.samples=4",
        "eval.ks=[1,2]",
        f"algorithm.preset={preset}",
    ]
    cfg, inj = make(tmp_path / "full", *common)
    train(cfg, **inj)
    full = _snapshot(inj["model"])
    # the same run stopped at step 4, then resumed to 6 in a fresh model object
    cfg, inj = make(tmp_path / "parts", *common, "optim.steps=4")
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "parts", *common, "run.resume=true")
    result = train(cfg, **inj)
    assert result.step == 6
    assert _rows(tmp_path / "parts") == _rows(tmp_path / "full")
    assert read_jsonl(tmp_path / "parts/rewards.jsonl") == read_jsonl(
        tmp_path / "full/rewards.jsonl"
    )
    for name, p in inj["model"].named_parameters():
        assert torch.equal(p, full[name]), name


def test_truncated_checkpoint_is_rejected_and_the_run_falls_back(tmp_path, capsys):
    common = ["optim.steps=5", "run.every=1", "run.keep_last=3"]
    cfg, inj = make(tmp_path / "full", *common)
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "cut", *common, "optim.steps=4")
    train(cfg, **inj)
    latest = tmp_path / "cut/checkpoints/step_00000004/optimizer.pt"
    latest.write_bytes(latest.read_bytes()[:100])  # a copy cut short
    cfg, inj = make(tmp_path / "cut", *common, "run.resume=true")
    train(cfg, **inj)
    err = capsys.readouterr()
    assert "checkpoint rejected" in err.err and "optimizer.pt is truncated" in err.err
    assert "continuing after step 3" in err.out
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "full")


def _nan_after(model, calls):
    """Make the final norm output NaN on the given grad-enabled decoder calls (1-based).

    One training forward of a micro-batch is two decoder calls (the prompts once, then the
    completions on the shared cache), so step k of a one-micro-batch run is calls 2k-1, 2k.
    """
    count = {"n": 0}

    def hook(module, args, output):
        if not torch.is_grad_enabled():
            return output
        count["n"] += 1
        return output * math.nan if count["n"] in calls else output

    model.model.norm.register_forward_hook(hook)


def test_non_finite_loss_skips_the_step_and_counts_it(tmp_path):
    cfg, inj = make(tmp_path, "optim.steps=3")
    _nan_after(inj["model"], calls={3})
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["optim/skipped_steps"] for r in rows] == [0, 1, 0]
    assert rows[-1]["optim/skipped_total"] == 1
    assert all(torch.isfinite(p).all() for p in inj["model"].parameters())


def test_k_non_finite_steps_in_a_row_stop_the_run(tmp_path):
    cfg, inj = make(tmp_path, "optim.steps=6", "optim.max_nonfinite_steps=2")
    _nan_after(inj["model"], calls=set(range(3, 100)))
    with pytest.raises(TrainingError, match="2 optimizer steps in a row had a non-finite"):
        train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")  # step 2 skipped and logged, 3 stops
    assert [r["optim/skipped_steps"] for r in rows] == [0, 1]


@pytest.mark.parametrize("timeout", [0, 5])  # in-process; forked workers under a timeout
def test_unscorable_rewards_are_counted_and_too_many_stop(tmp_path, timeout, capsys):
    cfg, inj = make(
        tmp_path / "some", f"sampling.verify_timeout_s={timeout}", task=ToyTask(raise_word="b")
    )
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "some/metrics.jsonl")
    assert sum(r["reward/unscorable_frac"] for r in rows) > 0  # counted, not scored 0
    assert all(r["reward/nan_count"] == r["reward/unscorable_frac"] * 16 for r in rows)
    assert "verifier crashed" in capsys.readouterr().out  # a sample of the errors is logged
    cfg, inj = make(
        tmp_path / "all",
        "sampling.max_unscorable_frac=0.0",
        f"sampling.verify_timeout_s={timeout}",
        task=ToyTask(nan_word="b"),
    )
    with pytest.raises(UnscorableError, match="could not be scored"):
        train(cfg, **inj)


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "rloo"])  # the three aggregations
def test_gradient_accumulation_is_exact_at_the_loop_level(tmp_path, preset, monkeypatch):
    """The gradient AdamW receives is the same for 1, 2 or 4 micro-batches per step."""
    grads: dict[int, list[torch.Tensor]] = {}
    real_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        grads[micro] = [p.grad.clone() for g in self.param_groups for p in g["params"]]
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    losses = {}
    for micro in (0, 4, 8, 12):  # one batch; 4 x 1 group; 2 x 2 groups; 3 + 1 groups
        cfg, inj = make(
            tmp_path / str(micro),
            "optim.steps=1",
            f"algorithm.preset={preset}",
            f"optim.micro_batch_size={micro}",
            "optim.grad_clip=0",
        )
        train(cfg, **inj)
        row = read_jsonl(tmp_path / str(micro) / "metrics.jsonl")[0]
        assert row["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        losses[micro] = row["loss/pg"]
    for micro in (4, 8, 12):
        assert losses[micro] == pytest.approx(losses[0], abs=1e-7)
        for g, ref in zip(grads[micro], grads[0]):
            torch.testing.assert_close(g, ref, atol=1e-7, rtol=1e-5)
    assert max(g.abs().max() for g in grads[0]) > 1e-3  # a real gradient was compared


def test_ppo_epochs_minibatches_and_lora_with_reference(tmp_path):
    cfg, inj = make(
        tmp_path,
        "optim.ppo_epochs=2",
        "optim.minibatches=2",
        "model.lora_rank=2",
        "algorithm.beta=0.1",
        "optim.steps=2",
    )
    before = _snapshot(inj["model"])
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(r["loss/kl"] >= 0 and math.isfinite(r["loss/total"]) for r in rows)
    assert rows[-1]["kl/mean"] > 0  # off-policy minibatches moved away from the reference
    for name, p in inj["model"].named_parameters():
        base = name.replace("base_model.model.", "").replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(p, before[base]), name  # frozen weights unchanged


def test_reward_kl_balance_and_kl_tail_are_logged_when_beta_is_set(tmp_path):
    cfg, inj = make(
        tmp_path, "algorithm.beta=0.1", "eval.balance_every=2", "optim.steps=4",
        "optim.ppo_epochs=2",
    )  # fmt: skip
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    measured = [r for r in rows if "balance/batch/r_over_kl" in r]
    assert 0 < len(measured) < len(rows)  # every 2nd step only
    for r in measured:
        # R/KL = |g_R| / (beta |g_KL|), once per step (not averaged over minibatches)
        want = r["balance/batch/reward_grad_norm"] / (0.1 * r["balance/batch/kl_grad_norm"])
        assert r["balance/batch/r_over_kl"] == pytest.approx(want, rel=1e-9)
        assert -1 <= r["balance/batch/cosine"] <= 1
        # binary rewards: no updated group has σ < 1e-2, so Table 3's subset is empty
        assert r["balance/low_sigma/rows"] == 0 and "balance/low_sigma/r_over_kl" not in r
    assert all(r["kl/p95"] >= 0 and r["kl/max"] >= r["kl/p95"] for r in rows)
    # without beta there is no KL branch and nothing to balance
    cfg0, inj0 = make(tmp_path / "b0", "optim.steps=2", "eval.balance_every=1")
    train(cfg0, **inj0)
    assert not any(
        k.startswith("balance/") for r in read_jsonl(tmp_path / "b0" / "metrics.jsonl") for k in r
    )


def test_sampled_acr_counts_the_groups_dynamic_sampling_dropped(tmp_path):
    # grpo trains on every generated group: both ACRs are the same number
    cfg, inj = make(tmp_path / "grpo", "optim.steps=2")
    train(cfg, **inj)
    for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl"):
        assert r["acr/sampled_rate"] == pytest.approx(r["acr/rate"], abs=1e-12)
    # dapo drops collapsed groups before training: acr/rate is of the kept batch, while
    # acr/sampled_rate counts every group it generated (the rollouts the filter wasted)
    cfg, inj = make(tmp_path / "dapo", "algorithm.preset=dapo", "optim.steps=3")
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "dapo" / "metrics.jsonl")
    for r in rows:
        drawn, kept = r["dynamic/drawn"], r["dynamic/kept"]
        collapsed = r["acr/sampled_rate"] * drawn
        assert collapsed == pytest.approx(round(collapsed), abs=1e-9)  # a count of groups
        assert kept <= drawn - round(collapsed)  # only informative groups are kept
    assert any(r["acr/sampled_rate"] > r["acr/rate"] for r in rows)  # the toy model collapses


class _MostlyRight(ToyTask):
    """Correct unless the first word is ``d``: groups with μ̂ well above 0 (the focal weight
    then differs between the verifier's rewards and shaped ones)."""

    def verify(self, completion, reference):
        return float((completion.split() or [""])[0] != "d")


def test_focal_mu_hat_reads_the_verifier_not_the_overlong_shaped_rewards(tmp_path, monkeypatch):
    # F-GRPO eq. 11: μ̂ = X/N from the verifier. The soft overlong penalty is replaced here by
    # a known shaping (−0.25 on every reward), so the verifier's rewards are shaped + 0.25.
    from grouprl import advantages
    from grouprl.train import filters, loop
    from grouprl.train.state import setup

    def shaped(self, rewards, completion_mask):
        return rewards - 0.25 if self.mode == "soft" else rewards

    monkeypatch.setattr(filters.Overlong, "rewards", shaped)
    seen = []
    real = advantages.compute
    monkeypatch.setattr(
        loop.advantages, "compute", lambda *a, **k: seen.append((a, k)) or real(*a, **k)
    )
    cfg, inj = make(
        tmp_path, "algorithm.preset=f_grpo", "algorithm.overlong=soft",
        "algorithm.focal_gamma=1.0", "sampling.group_size=8", task=_MostlyRight(),
    )  # fmt: skip
    run = setup(cfg, **inj)
    run.step = 1
    m = loop.train_step(run)
    (args, kw) = seen[0]
    rewards = args[1]  # [P, G] what the estimator reads: the shaped rewards
    raw = rewards + 0.25  # the verifier's
    assert torch.equal(kw["verifier_rewards"], raw)
    want = float((1.0 - raw.mean(1)).mean())  # (1 − μ̂)^1 per group, μ̂ = X/N
    from_shaped = float((1.0 - rewards.mean(1).clamp(0, 1)).mean())  # the old behaviour
    assert m["adv/focal/mean_weight"] == pytest.approx(want, abs=1e-6)
    assert abs(from_shaped - want) > 0.1  # the test can tell them apart
    # without the penalty the verifier's rewards are the rewards: no second tensor is passed
    seen.clear()
    cfg, inj = make(tmp_path / "b", "algorithm.preset=f_grpo", task=_MostlyRight())
    run = setup(cfg, **inj)
    run.step = 1
    loop.train_step(run)
    assert seen[0][1]["verifier_rewards"] is None


class _LowSigma(ToyTask):
    """Even examples: reward 0.5 + 0.001·(crc32 of the completion mod 7), σ_q < 1e-2 (Table 3's
    low-variance groups); odd examples: the binary toy reward (σ_q ≥ 0.35 when mixed)."""

    def examples(self, split, n, seed):
        from grouprl.tasks.base import Example

        return [Example(f"low/{split}/{seed}/{i}", "q", i % 2) for i in range(n)]

    def verify(self, completion, reference):
        if reference == 0:  # a deterministic function of the whole completion, spread 0.006
            return 0.5 + 0.001 * (zlib.crc32(completion.encode()) % 7)
        return float((completion.split() or [""])[0] == "a")


def test_r_over_kl_on_table3s_subset_and_on_the_batch_under_their_own_names(tmp_path, monkeypatch):
    # MaxNorm Table 3 measures R/KL on updated groups with σ_q < 1e-2: logged as
    # balance/low_sigma/*, the whole micro-batch as balance/batch/*.
    from grouprl import advantages
    from grouprl.train import loop
    from grouprl.train.state import setup

    seen = []
    real = advantages.compute
    monkeypatch.setattr(
        loop.advantages, "compute", lambda *a, **k: seen.append(a[1]) or real(*a, **k)
    )
    cfg, inj = make(
        tmp_path, "algorithm.beta=0.1", "eval.balance_every=1", "sampling.group_size=8",
        "sampling.prompts_per_step=6", task=_LowSigma(),
    )  # fmt: skip
    run = setup(cfg, **inj)
    for run.step in (1, 2):  # step 1 is at the reference (k3's gradient is 0): step 2 has a KL
        got = loop.train_step(run)
    rewards = seen[1]  # [6, 8], groups in draw order: even = low-σ kind
    low = [p for p in range(6) if p % 2 == 0 and rewards[p].max() > rewards[p].min()]
    assert all(float(rewards[p].std()) < 1e-2 for p in low) and low  # the subset is not empty
    assert got["balance/low_sigma/rows"] == 8 * len(low)  # by hand: 8 rows per group
    assert {"balance/batch/r_over_kl", "balance/low_sigma/r_over_kl"} <= set(got)
    assert "balance/r_over_kl" not in got
    for sub in ("low_sigma", "batch"):
        want = got[f"balance/{sub}/reward_grad_norm"] / (0.1 * got[f"balance/{sub}/kl_grad_norm"])
        assert got[f"balance/{sub}/r_over_kl"] == pytest.approx(want, rel=1e-9)
    # the binary groups are in the batch, not the subset: the two numbers differ
    assert got["balance/low_sigma/r_over_kl"] != pytest.approx(got["balance/batch/r_over_kl"])

    class _AllLow(_LowSigma):  # every group low-σ: the subset is the whole batch
        def examples(self, split, n, seed):
            return [e.__class__(e.id, e.prompt, 0) for e in super().examples(split, n, seed)]

    seen.clear()
    cfg, inj = make(
        tmp_path / "all", "algorithm.beta=0.1", "eval.balance_every=1", "sampling.group_size=8",
        task=_AllLow(),
    )  # fmt: skip
    run = setup(cfg, **inj)
    for run.step in (1, 2):
        both = loop.train_step(run)
    mixed = sum(bool(r.max() > r.min()) for r in seen[1])
    assert both["balance/low_sigma/rows"] == 8 * mixed
    if mixed == 4:  # no group came out constant: same rows, same aggregation, same number
        assert both["balance/low_sigma/r_over_kl"] == pytest.approx(
            both["balance/batch/r_over_kl"], rel=1e-6
        )
