"""Known answers of a whole run, on the hand policy of ``hand_policy.py`` through ``train()``:
when it evaluates and what (pass@k from the completions the verifier saw), when it
checkpoints, how a signal stops it, the R/KL balance of a step with a KL term (by hand), and
what it logs per group and says at the start."""

from __future__ import annotations

import math
import os
import signal
from math import comb

import pytest
from hand_policy import (
    BASE,
    AdamW,
    HandTask,
    Row,
    completion_tokens,
    expected_update,
    first_is,
    gradient,
    groups,
    grpo_advantages,
    step_round,
    train_hand,
)

from grouprl.train.sinks import read_jsonl

G = 4


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


def test_evaluation_runs_at_the_start_every_k_steps_and_at_the_end(tmp_path, capsys):
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, _, _ = train_hand(
        tmp_path, task, "optim.steps=3", "eval.every=2", "eval.prompts=2", "eval.samples=4",
        "eval.ks=[1,4]", theta=(-0.5, 0.3, 0.0),
    )  # fmt: skip
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"step", "eval/pass@1", "eval/pass@4", "eval/reward_mean"}
    assert not any(k.startswith("eval/") for k in rows[1])
    assert sorted(result.evals) == [0, 2, 3]
    # each evaluation: 2 held-out prompts × 4 samples; a sample is correct at the top of
    # the reward range (1: the completion starts with a); pass@k = 1 − C(n−c, k)/C(n, k)
    evals = [c for c in task.calls if "/eval/" in c.example_id]
    assert len(evals) == 3 * 2 * G
    for i, step in enumerate([0, 2, 3]):
        calls = evals[i * 2 * G : (i + 1) * 2 * G]
        correct = [sum(c.reward >= 1.0 for c in grp) for grp in groups(calls, G)]
        want = {
            "eval/pass@1": sum(_pass_at_k(G, c, 1) for c in correct) / 2,
            "eval/pass@4": sum(_pass_at_k(G, c, 4) for c in correct) / 2,
            "eval/reward_mean": sum(c.reward for c in calls) / len(calls),
        }
        assert result.evals[step] == pytest.approx(want, abs=1e-6)
        assert {k: rows[step][k] for k in want} == pytest.approx(want, abs=1e-6)
    # the same prompts and the same random stream at every evaluation (a paired comparison)
    assert [c.example_id for c in evals[: 2 * G]] == [c.example_id for c in evals[2 * G : 4 * G]]
    out = capsys.readouterr().out
    for step in (0, 2, 3):
        e = result.evals[step]
        line = f"eval step {step}: pass@1 {e['eval/pass@1']:.3f}  pass@4 {e['eval/pass@4']:.3f}"
        assert f"{line}  reward_mean {e['eval/reward_mean']:.3f}\n" in out


def test_checkpoints_follow_run_every_and_the_last_step(tmp_path):
    task = HandTask({"ab": first_is("a", empty=0.5)})
    train_hand(tmp_path, task, "optim.steps=5", "run.every=2", "run.keep_last=10")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"step_{s:08d}" for s in (2, 4, 5)]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # one rewards.jsonl line per group and step: the rewards the verifier returned
    lines = read_jsonl(tmp_path / "rewards.jsonl")
    assert [line["step"] for line in lines] == [s for s in range(1, 6) for _ in range(2)]
    assert [line["rewards"] for line in lines] == [
        [c.reward for c in grp] for grp in groups(task.calls, G)
    ]


def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint_to_resume(tmp_path, capsys):
    class Interrupting(HandTask):  # SIGTERM to this process while step 2 scores
        def verify(self, completion, reference):
            _, example_id = reference
            if step_round(int(example_id.split("/")[2]))[0] == 2 and not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)
            return super().verify(completion, reference)

    task = Interrupting({"ab": first_is("a", empty=0.5)})
    task.sent = False
    result, _, _ = train_hand(tmp_path, task, "optim.steps=4", "run.every=0")
    assert (result.step, result.stopped_by) == (2, signal.SIGTERM)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000002"]
    out = capsys.readouterr().out
    assert f"stopped by signal {signal.SIGTERM} after step 2; resume with --resume --out" in out
    resumed, _, _ = train_hand(tmp_path, task, "optim.steps=4", "run.resume=true")
    assert (resumed.step, resumed.stopped_by) == (4, None)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def _balance(rows, theta0, **agg):
    """(‖g_R‖, ‖g_KL‖, cosine) of rows at step 1: g_R from (2) of hand_policy.py, g_KL the
    unweighted k1 branch Σ w_t (e_y − π), w_t the aggregation's weights over these rows."""
    g_r = gradient(theta0, rows, **agg)
    g_kl = gradient(
        theta0, [Row(r.tokens, 0.0, theta0) for r in rows], beta=1.0, kl="k1",
        ref_theta=theta0, **agg,
    )  # fmt: skip
    norm_r, norm_kl = math.hypot(*g_r), math.hypot(*g_kl)
    return norm_r, norm_kl, sum(a * b for a, b in zip(g_r, g_kl)) / (norm_r * norm_kl)


@pytest.mark.parametrize(
    "aggregation, every, micro",
    [
        ("token_mean", 1, 0),
        ("seq_mean_token_sum_norm", 1, 0),
        ("token_mean", 2, 0),
        ("seq_mean_token_sum_norm", 1, G),
    ],
)
def test_the_reward_kl_balance_of_a_step_by_hand(tmp_path, aggregation, every, micro):
    # β = 0.5, k1, RLOO; group 0 has rewards 0 / 0.5 / 1 (σ ≈ 0.5), group 1 0.995 / 1 and an
    # unscorable <eos> (σ < 1e-2: MaxNorm Table 3's low-σ subset). R/KL = ‖g_R‖/(β‖g_KL‖) on
    # the whole minibatch (balance/batch/*) and on the subset's kept rows alone, aggregated
    # over them (balance/low_sigma/*). Completions of up to 2 tokens (L_max = 2). Measured
    # every eval.balance_every steps: step 1 is not a multiple of 2. One group per micro-batch
    # (micro = G): the subset is measured in the second micro-batch, under its own totals, the
    # same numbers; balance/batch/* is then the first micro-batch's group alone (not checked)
    tables = {
        "ab": first_is("a", empty=0.5),
        "tiny": first_is("a", other=0.995, empty=math.nan),
    }
    task = HandTask(tables, plan=lambda split, seed, i: ("q", ["ab", "tiny"][i]))
    result, policy, theta0 = train_hand(
        tmp_path, task, "algorithm.preset=rloo", "algorithm.beta=0.5", "algorithm.kl=k1",
        f"algorithm.aggregation={aggregation}", f"eval.balance_every={every}", "run.seed=2",
        "sampling.max_new_tokens=2", "sampling.max_unscorable_frac=1",
        f"optim.micro_batch_size={micro}", theta=(0.0, 0.3, 0.0),
    )  # fmt: skip
    m = result.metrics
    if every == 2:
        assert not any(k.startswith("balance/") for k in m)
        return
    per_group = []
    for grp in groups(task.calls, G):
        valid = [c for c in grp if not math.isnan(c.reward)]
        mean = sum(c.reward for c in valid) / len(valid)  # RLOO over the valid rewards
        per_group.append(
            [
                Row(
                    completion_tokens(c.text, 2),
                    len(valid) / (len(valid) - 1) * (c.reward - mean),
                    theta0,
                )
                for c in valid
            ]
        )
    nan_rows = sum(math.isnan(c.reward) for c in task.calls[G:])
    assert nan_rows and len({r.adv for r in per_group[1]}) > 1, [c.text for c in task.calls]
    rows = per_group[0] + per_group[1]
    agg = {"aggregation": aggregation, "max_len": 2}
    for subset, part in (("batch", rows), ("low_sigma", per_group[1]))[1 if micro else 0 :]:
        norm_r, norm_kl, cos = _balance(part, theta0, **agg)
        assert norm_r > 1e-4 and norm_kl > 0.01
        assert m[f"balance/{subset}/reward_grad_norm"] == pytest.approx(norm_r, rel=1e-4)
        assert m[f"balance/{subset}/kl_grad_norm"] == pytest.approx(norm_kl, rel=1e-5)
        assert m[f"balance/{subset}/r_over_kl"] == pytest.approx(norm_r / (0.5 * norm_kl), rel=1e-4)
        assert m[f"balance/{subset}/cosine"] == pytest.approx(cos, abs=1e-4)
    assert m["balance/low_sigma/rows"] == G  # the subset's rows, the unscorable one included
    # and the step itself: both branches, AdamW eps 1
    want, _ = expected_update(
        theta0, [rows], opt=AdamW(lr=0.1), beta=0.5, kl="k1", ref_theta=theta0, **agg
    )
    assert [float(x) for x in policy.theta.detach()] == pytest.approx(want, abs=1e-6)
    assert m["kl/max"] == 0.0 and m["kl/p95"] == 0.0  # the behaviour policy is the reference


def test_the_run_says_when_its_schedule_leaves_the_clip_idle(tmp_path, capsys):
    task = HandTask({"ab": first_is("a", empty=0.5)})
    train_hand(tmp_path / "a", task)  # grpo's own schedule: one step per batch, a note
    out = capsys.readouterr().out
    assert "note: grpo takes one optimizer step per generation batch" in out
    assert "warning:" not in out
    # a schedule set to one step for a preset whose sources take more: a warning
    train_hand(tmp_path / "b", task, "algorithm.preset=dapo", "optim.minibatches=1")
    assert "warning: surrogate 'ppo_clip' runs one optimizer step" in capsys.readouterr().out
    train_hand(tmp_path / "c", task, "optim.minibatches=2")  # the clip can act: nothing
    out = capsys.readouterr().out
    assert "note:" not in out and "warning:" not in out
    # a preset's minibatch count that does not divide the prompts is lowered, with a note
    train_hand(tmp_path / "d", task, "algorithm.preset=gspo")
    assert "schedule: preset 'gspo' takes 4 minibatches" in capsys.readouterr().out


def test_the_steps_metrics_are_those_of_its_rewards_and_completions(tmp_path):
    # the step's metrics carry the diagnostics of the rewards the verifier returned
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, _, _ = train_hand(tmp_path, task)
    rewards = [c.reward for c in task.calls]
    m = result.metrics
    assert m["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    collapsed = [
        all(a == 0 for a in grpo_advantages([c.reward for c in grp]))
        for grp in groups(task.calls, G)
    ]
    assert m["acr/rate"] == pytest.approx(sum(collapsed) / len(collapsed))
    assert m["optim/lr"] == 0.1 and m["optim/steps"] == 1.0 and m["optim/skipped_total"] == 0.0
    lengths = [len(completion_tokens(c.text, 1)) for c in task.calls]
    assert m["length/mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert {f"time/{k}" for k in ("generate", "score", "logprobs", "backward", "optimizer")} <= set(
        m
    )


def test_the_run_folder_gets_its_configuration_and_the_sinks_it_asked_for(tmp_path, capsys):
    import yaml

    from grouprl.train.config import load_config

    task = HandTask({"ab": first_is("a", empty=0.5)})
    extra = ["optim.steps=2", "run.tensorboard=true", "run.progress=true"]
    result, _, _ = train_hand(tmp_path, task, *extra)
    assert list((tmp_path / "tb").glob("events.*"))  # TensorBoard, as asked
    assert "step 2/2" in capsys.readouterr().out  # the progress line
    cfg = load_config(None, [*BASE, f"run.out={tmp_path}", *extra], validate=False)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == cfg.to_dict()
    # resuming a finished run runs no step: the same step, no metrics
    again, _, _ = train_hand(tmp_path, task, *extra, "run.resume=true")
    assert (again.step, again.metrics, again.stopped_by) == (2, {}, None)
    assert result.metrics and [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_the_truncated_share_counts_the_cut_completions_the_loss_trains_on(tmp_path):
    # completions of up to 2 tokens: "a b" (no <eos> within the limit) is cut, "a" and ""
    # ended; every one trains (no overlong shaping), so the trained cut share is the cut one's
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, _, _ = train_hand(tmp_path, task, "sampling.max_new_tokens=2", theta=(0.0, 0.3, 0.0))
    cut = [len(c.text.split()) == 2 for c in task.calls]
    assert 0 < sum(cut) < len(cut), [c.text for c in task.calls]
    m = result.metrics
    assert m["truncated/trained_count"] == sum(cut)
    assert m["truncated/trained_frac"] == pytest.approx(sum(cut) / len(cut))
