"""Known answers of whole training steps, part 2: how the batch is drawn.

Dynamic sampling's refill, AGPO's controllers (temperature from the probe, clip ε from the
probe and the policy's entropy) and IS-GRPO's prompt sampler, each on the hand policy of
``hand_policy.py`` through ``train()``, against numbers derived by hand from what the
verifier saw (the formulas are in each test's comments).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hand_policy import (
    AdamW,
    HandPolicy,
    HandTask,
    HandTokenizer,
    Row,
    completion_tokens,
    expected_update,
    first_is,
    group_std,
    groups,
    grpo_advantages,
    log_prob,
    softmax,
    step_round,
    theta_of,
    train_hand,
)

from grouprl.rollout import hf

G = 4
TOL = 1e-6


def _far(a, b, margin=1e-3) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) > margin


def _rows(calls, theta0, **kw):
    out = []
    for grp in groups(calls, G):
        adv = grpo_advantages([c.reward for c in grp])
        out += [Row(completion_tokens(c.text, 1), a, theta0, **kw) for c, a in zip(grp, adv)]
    return out


# ---- DAPO's dynamic sampling ------------------------------------------------------------------


def test_dynamic_sampling_refills_the_batch_with_the_first_informative_groups(tmp_path):
    # round 0 draws P = 2: a constant group (collapsed, dropped) and an informative one;
    # keep rate 1/2, so round 1 draws ceil((2 − 1)/(1/2)) = 2 prompts, both informative,
    # and keeps the first: the batch is [round 0 group 1, round 1 group 0]
    tables = {"const": lambda words: 1.0, "ab": first_is("a"), "ba": first_is("b", empty=0.5)}

    def plan(split, seed, i):
        round_ = step_round(seed)[1]
        return "q", (["const", "ab"] if round_ == 0 else ["ba", "ab"])[i]

    task = HandTask(tables, plan=plan)
    result, policy, theta0 = train_hand(
        tmp_path,
        task,
        "algorithm.preset=dapo",
        "algorithm.overlong=null",
        "optim.minibatches=1",
        "run.seed=2",
    )
    drawn = groups(task.calls, G)
    assert [grp[0].table for grp in drawn] == ["const", "ab", "ba", "ab"]
    assert all(len({c.reward for c in grp}) > 1 for grp in drawn[1:]), [
        [c.text for c in grp] for grp in drawn
    ]
    rows = _rows(drawn[1] + drawn[2], theta0)  # DAPO: token mean over the kept groups
    want, _ = expected_update(theta0, [rows], aggregation="token_mean", opt=AdamW(lr=0.1))
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    for wrong in (drawn[1], drawn[1] + drawn[3], drawn[0] + drawn[1]):  # no refill, the
        bug, _ = expected_update(  # last informative group, the collapsed one kept
            theta0, [_rows(wrong, theta0)], aggregation="token_mean", opt=AdamW(lr=0.1)
        )
        assert _far(want, bug, 1e-4)
    m = result.metrics
    assert (m["dynamic/tries"], m["dynamic/drawn"], m["dynamic/kept"]) == (2, 4, 2)
    assert m["dynamic/keep_rate"] == pytest.approx(3 / 4)  # informative groups / drawn
    assert m["acr/sampled_rate"] == pytest.approx(1 / 4)  # the dropped group shows here
    assert m["acr/rate"] == 0.0  # ... and not in the batch


# ---- AGPO's controllers -----------------------------------------------------------------------


def _vote_entropy(texts) -> float:
    """−Σ p ln p over the completions' answers (here the text itself: no number, no box)."""
    counts = Counter(texts)
    return -sum(c / len(texts) * math.log(c / len(texts)) for c in counts.values())


def _entropy(theta) -> float:
    return -sum(p * math.log(p) for p in softmax(theta))


AGPO_TABLES = {"ab": first_is("a", empty=0.5), "quarter": first_is("a", other=0.25)}


def _agpo_step(tmp_path, theta0, seed, lr=0.1, g=G, max_new=1, draw="inverse_cdf"):
    """One AGPO step on prompts with the tables ab and quarter, groups of ``g``; (result,
    policy, task, the probe's σ and E per prompt, τ per prompt derived by hand)."""
    task = HandTask(AGPO_TABLES, plan=lambda split, s, i: ("q", ["ab", "quarter"][i]))
    result, policy, _ = train_hand(
        tmp_path, task, "algorithm.preset=agpo", f"optim.lr={lr}", f"run.seed={seed}",
        f"sampling.group_size={g}", f"sampling.max_new_tokens={max_new}", f"sampling.draw={draw}",
        theta=theta0,
    )  # fmt: skip
    probe = groups(task.calls[: 2 * g], g)
    assert len(task.calls) == 4 * g  # the probe, then the training groups
    # the probe (G completions per prompt at τ_base = 1, never trained on): per prompt the
    # reward std σ (ddof 1) and the vote entropy E; uncertainty U = σ + E (AGPO weights
    # w_r = w_e = 1, w_k = 0)
    sigma = [group_std([c.reward for c in grp]) for grp in probe]
    ent = [_vote_entropy([c.text for c in grp]) for grp in probe]
    u = [s + e for s, e in zip(sigma, ent)]
    assert u[0] > 0.1 and abs(u[1] - u[0]) > 0.05, (sigma, ent)
    # temperature: the first prompt starts the EMA (c = 0, τ = τ_base = 1); the second has
    # c = (U_2 − U_1)/(U_1 + 1e-8) and τ = clip(1 + 0.15·c, 0.5, 1.5)
    c2 = (u[1] - u[0]) / (u[0] + 1e-8)
    tau = [1.0, min(max(1 + 0.15 * c2, 0.5), 1.5)]
    return result, policy, task, sigma, ent, tau


def test_agpo_samples_each_training_group_at_its_probes_temperature(tmp_path):
    # groups of 8 completions of up to 3 tokens: enough draws for τ to change some of them.
    # torch.multinomial's draw: the inverse-CDF draw (one uniform per token) couples the
    # samples at nearby temperatures so tightly that τ here changes none of them
    theta0, seed, g, max_new, draw = (-1.0, 1.5, 0.0), 2, 8, 3, "multinomial"
    result, _, task, _, _, tau = _agpo_step(tmp_path, theta0, seed, g=g, max_new=max_new, draw=draw)
    m = result.metrics
    assert m["sampling/temperature"] == pytest.approx(sum(tau) / 2, abs=1e-6)
    assert (m["agpo/temperature_min"], m["agpo/temperature_max"]) == pytest.approx(
        (min(tau), max(tau)), abs=1e-6
    )
    # the training groups are the rollouts at those temperatures: generate() with the run's
    # generator (seeded by run.seed), the probe drawn first at τ_base
    gen = torch.Generator().manual_seed(seed)
    tok, model = HandTokenizer(), HandPolicy(theta0)
    probe = hf.generate(model, tok, ["q", "q"], g, hf.Sampling(1.0, 1.0, max_new, draw=draw), gen)
    assert probe.texts == [c.text for c in task.calls[: 2 * g]]
    state = gen.get_state()
    sampling = hf.Sampling(sum(tau) / 2, 1.0, max_new, logprob_temperature=1.0, draw=draw)
    at_tau = hf.generate(model, tok, ["q", "q"], g, sampling, gen, temperatures=torch.tensor(tau))
    trained = [c.text for c in task.calls[2 * g :]]
    assert at_tau.texts == trained
    gen.set_state(state)
    sampling = hf.Sampling(1.0, 1.0, max_new, logprob_temperature=1.0, draw=draw)
    at_base = hf.generate(model, tok, ["q", "q"], g, sampling, gen)
    assert at_base.texts != trained  # the seed is chosen so that τ changes some samples


def test_agpo_clips_each_prompt_at_its_epsilon_and_measures_the_drift(tmp_path):
    theta0, lr = (0.2, 0.3, 0.0), 0.65
    result, policy, task, sigma, ent, _ = _agpo_step(tmp_path, theta0, 3, lr)
    train_calls = task.calls[2 * G :]
    m = result.metrics
    # clip: H = the policy's token entropy before the update (every token has the entropy of
    # softmax(θ₀) at T = 1), h = H/(H_ref + 1e-8) with H_ref = H (the first prompt sets it);
    # ε_p = clip(0.2·h·(1 + 0.1·E_p)/(1 + σ_p + 0.5·D), 0.05, 0.4), the drift D = 0 at step 1
    h = _entropy(theta0) / (_entropy(theta0) + 1e-8)
    eps = [min(max(0.2 * h * (1 + 0.1 * e) / (1 + s), 0.05), 0.4) for s, e in zip(sigma, ent)]
    assert m["clip/eps_low"] == pytest.approx(sum(eps) / 2, abs=1e-6)
    assert (m["agpo/eps_min"], m["agpo/eps_max"]) == pytest.approx((min(eps), max(eps)), abs=1e-6)
    # the update: 4 epochs of one minibatch, ppo_clip with each prompt's ε on its rows, k1
    # KL (β = 0.03) to the initial policy, per-sequence token mean, log-probs at T = 1; at
    # lr 0.65 the second epoch's ratio of a token with A > 0 is about 1.17, above 1 + ε_p
    # and below 1.2: the per-prompt ε and the preset's 0.2 give different updates
    rows = [
        Row(completion_tokens(c.text, 1), a, theta0, eps_low=eps[p], eps_high=eps[p])
        for p, grp in enumerate(groups(train_calls, G))
        for c, a in zip(grp, grpo_advantages([c.reward for c in grp]))
    ]
    loss = {"aggregation": "seq_mean_token_mean", "beta": 0.03, "kl": "k1", "ref_theta": theta0}
    want, _ = expected_update(theta0, [rows] * 4, opt=AdamW(lr=lr), **loss)
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    fixed = [Row(r.tokens, r.adv, theta0) for r in rows]  # the preset's ε = 0.2 everywhere
    assert _far(want, expected_update(theta0, [fixed] * 4, opt=AdamW(lr=lr), **loss)[0], 1e-4)
    # after the update: drift = mean over groups of max(0, token mean of old − new log-prob)
    drift = [
        max(0.0, sum(log_prob(theta0, t) - log_prob(want, t) for t in toks) / len(toks))
        for toks in (
            [t for c in grp for t in completion_tokens(c.text, 1)] for grp in groups(train_calls, G)
        )
    ]
    assert m["agpo/step_drift"] == pytest.approx(sum(drift) / 2, abs=1e-5)
    assert m["agpo/drift_ema"] == pytest.approx(0.1 * sum(drift) / 2, abs=1e-6)


# ---- IS-GRPO's prompt sampler -----------------------------------------------------------------


def test_is_grpo_sampler_observes_each_drawn_groups_sigma(tmp_path):
    # a pool of 4 prompts with different reward tables; after the step each drawn prompt's
    # σ̂ is the std of its group's rewards (the first visit sets it; a second draw of the
    # same prompt in the step moves it halfway, momentum 0.5)
    tables = {
        "t0": first_is("a"),
        "t1": first_is("b", empty=0.5),
        "t2": first_is("a", other=0.25),
        "t3": first_is(None, empty=1.0),  # 1 only for the empty completion
    }
    task = HandTask(tables, plan=lambda split, s, i: ("q", f"t{i % 4}"))
    seed = 6  # step 1 draws two prompts whose groups have different σ
    result, _, _ = train_hand(
        tmp_path, task, "algorithm.preset=is_grpo", "sampling.pool_size=4", "optim.steps=2",
        f"run.seed={seed}", theta=(0.3, 0.3, 0.0),
    )  # fmt: skip
    metrics = read_step(tmp_path, 1)
    step1 = groups(task.calls, G)[:2]
    sigma_hat: dict[int, float] = {}
    for grp in step1:
        index, s = int(grp[0].table[1]), group_std([c.reward for c in grp])
        if not math.isnan(s):
            sigma_hat[index] = s if index not in sigma_hat else 0.5 * sigma_hat[index] + 0.5 * s
    assert sigma_hat, [[c.text for c in grp] for grp in step1]
    # weights max(σ̂, 0.05), an unvisited prompt at the mean σ̂ of the visited ones
    fill = sum(sigma_hat.values()) / len(sigma_hat)
    w = [max(sigma_hat.get(i, fill), 0.05) for i in range(4)]
    p = [x / sum(w) for x in w]
    assert metrics["sampler/visited_frac"] == pytest.approx(len(sigma_hat) / 4)
    assert metrics["sampler/sigma_hat_mean"] == pytest.approx(fill, rel=1e-6)
    assert metrics["sampler/p_max_over_uniform"] == pytest.approx(max(p) * 4, rel=1e-6)
    assert metrics["sampler/effective_pool"] == pytest.approx(1 / sum(x * x for x in p), rel=1e-6)
    assert len(set(p)) > 1  # the observations changed the draw probabilities
    # step 2 draws from them: the sampler's multinomial with the (seed, step, round) stream
    gen = torch.Generator().manual_seed((seed * 1_000_003 + 2) * 64 + 0)
    drawn2 = torch.multinomial(torch.tensor(p, dtype=torch.float64), 2, True, generator=gen)
    assert [int(grp[0].table[1]) for grp in groups(task.calls, G)[2:4]] == drawn2.tolist()
    assert result.step == 2


def read_step(run_dir, step: int) -> dict:
    from grouprl.train.sinks import read_jsonl

    return next(r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == step)
