"""The trainer paths of the peers' methods, each in a tiny end-to-end run on the toy task:

- ReMax: one greedy completion per prompt, scored, is the baseline (``Batch.baseline``);
- GDPO: the dataset task's reward functions reach the estimator one by one (``[P, G, K]``);
- token-level advantages: the optimal token baseline with Σπ² from the log-prob kernel;
- a KL folded into the reward with the adaptive controller, whose β survives a resume.

Each checks numbers: what the step computed equals the estimator run by hand on the batch.
"""

from __future__ import annotations

import pytest
import torch
from train_toy import make

from grouprl import advantages
from grouprl.train import loop
from grouprl.train.batch import greedy_rewards
from grouprl.train.logprobs import completion_logprobs
from grouprl.train.loop import Timer, collect_batch, step_advantages, train
from grouprl.train.sinks import read_jsonl
from grouprl.train.state import setup


def _run(tmp_path, *extra, task=None):
    cfg, inj = make(tmp_path, *extra, task=task)
    return setup(cfg, **inj)


def _rows(run_dir):
    return list(read_jsonl(run_dir / "metrics.jsonl"))


def test_remax_baseline_is_the_greedy_completions_reward(tmp_path):
    run = _run(tmp_path, "algorithm.preset=remax")
    batch, _ = collect_batch(run, Timer(run.device))
    assert batch.baseline is not None and batch.baseline.shape == (batch.num_prompts,)
    # greedy decoding draws nothing random: the same prompts decode to the same completions
    examples = run.task.examples("train", batch.num_prompts, run.cfg.run.seed)
    by_id = {ex.id: ex for ex in examples}
    exs = [by_id[i] for i in batch.example_ids]
    settings, _ = loop.sampling_at(run.cfg.sampling, 1.0)
    _, want = greedy_rewards(run.policy, run.scorer, exs, settings, run.gen)
    torch.testing.assert_close(batch.baseline, want[:, 0])
    _, adv_n, metrics = step_advantages(run, batch, run.reference.logprobs(run.policy, batch))
    # the remax preset folds verl's k1 KL (β 0.001) into the reward: ReMax's "return" reading
    dense, _ = advantages.kl_reward(
        batch.old_logp, run.reference.logprobs(run.policy, batch), batch.mask, 0.001
    )
    p, g = batch.rewards.shape
    mask = batch.mask.view(p, g, -1) > 0
    want = advantages.compute_tokens(
        "remax", batch.rewards, mask, token_rewards=dense.view(mask.shape),
        baseline=batch.baseline,
    )  # fmt: skip
    torch.testing.assert_close(adv_n, want.per_token.float())
    assert metrics["kl_reward/coef"] == 0.001
    result = train(run.cfg, model=run.model, tokenizer=run.tokenizer, task=run.task)
    assert result.step == 3 and "adv/remax/baseline_nan_frac" in result.metrics


def test_remaxs_greedy_baseline_takes_the_soft_overlong_penalty_of_its_own_length(tmp_path):
    # DAPO's soft overlong penalty over the whole length range (L_max 4, cache 4: −(L − 0)/4
    # for a completion of L tokens): the greedy completion's reward is penalised by its own
    # length, as the samples' are [OURS]
    run = _run(
        tmp_path, "algorithm.preset=remax", "algorithm.overlong=soft",
        "sampling.max_new_tokens=4", "sampling.overlong_cache=4",
    )  # fmt: skip
    batch, _ = collect_batch(run, Timer(run.device))
    by_id = {ex.id: ex for ex in run.task.examples("train", batch.num_prompts, run.cfg.run.seed)}
    exs = [by_id[i] for i in batch.example_ids]
    settings, _ = loop.sampling_at(run.cfg.sampling, 1.0)
    greedy, raw = greedy_rewards(run.policy, run.scorer, exs, settings, run.gen)
    lengths = greedy.completion_mask.sum(-1).float()  # [P] tokens, EOS included
    want = raw[:, 0] - lengths / 4
    assert bool((lengths > 0).all())
    torch.testing.assert_close(batch.baseline, want.to(batch.baseline.dtype))


def test_gdpo_reads_each_reward_function(tmp_path):
    datasets = pytest.importorskip("datasets")
    from grouprl.tasks.dataset import DatasetTask

    def first_a(completions, **kw):
        return [float(c.split()[:1] == ["a"]) for c in completions]

    def short(completions, **kw):  # None for every third completion: not applicable
        return [
            None if i % 3 == 2 else float(len(c.split()) <= 2) for i, c in enumerate(completions)
        ]

    rows = [{"prompt": "<bos> q <sep>"} for _ in range(12)]
    task = DatasetTask(
        datasets.Dataset.from_list(rows), rewards=[first_a, short], reward_weights=[1.0, 0.5]
    )
    run = _run(tmp_path, "algorithm.preset=gdpo", "optim.minibatches=1", task=task)
    batch, _ = collect_batch(run, Timer(run.device))
    parts = batch.reward_parts
    assert parts is not None and parts.shape == (*batch.rewards.shape, 2)
    assert torch.isnan(parts[..., 1]).any() and batch.reward_weights == (1.0, 0.5)
    adv, adv_n, _ = step_advantages(run, batch, None)
    want = advantages.compute("gdpo", parts, reward_weights=[1.0, 0.5])
    torch.testing.assert_close(adv_n, want.per_sample.float())
    # not the sum: GDPO normalises each function before adding them
    summed = advantages.compute("gdpo", batch.rewards)
    assert not torch.allclose(adv.values, summed.values)
    assert train(run.cfg, model=run.model, tokenizer=run.tokenizer, task=task).step == 3


def test_optimal_token_baseline_trains_on_per_token_advantages(tmp_path):
    run = _run(tmp_path, "algorithm.preset=otb")
    batch, _ = collect_batch(run, Timer(run.device))
    _, adv_n, _ = step_advantages(run, batch, None)
    assert adv_n.shape == batch.mask.shape  # [N, T]
    # Σπ² from the kernel equals the full softmax of a plain forward
    b = batch
    lp = completion_logprobs(
        run.model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.mask,
        temperature=b.temperature, sum_pi_squared=True, group_size=1,
    )  # fmt: skip
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    att = torch.cat([b.prompt_mask, b.mask.long()], 1)
    with torch.no_grad():
        logits = run.model(input_ids=ids, attention_mask=att).logits.float()
    tp, t = b.prompt_ids.shape[1], b.completion_ids.shape[1]
    probs = torch.softmax(logits[:, tp - 1 : tp + t - 1] / b.temperature, -1)
    torch.testing.assert_close(
        lp.sum_pi_squared, probs.square().sum(-1) * b.mask, atol=1e-5, rtol=1e-5
    )
    p, g = b.rewards.shape
    mask = b.mask.view(p, g, -1) > 0
    want = advantages.compute_tokens(
        "optimal_token_baseline", b.rewards, mask, old_logp=b.old_logp.view(mask.shape),
        sum_pi_squared=lp.sum_pi_squared.view(mask.shape),
    )  # fmt: skip
    torch.testing.assert_close(adv_n, want.per_token.float(), atol=1e-5, rtol=1e-5)
    assert train(run.cfg, model=run.model, tokenizer=run.tokenizer, task=run.task).step == 3


def test_kl_in_reward_adaptive_controller_resumes_exactly(tmp_path):
    kl = [
        "algorithm.preset=reinforce_pp_global",
        "algorithm.reward_kl_controller=adaptive",
        "algorithm.reward_kl_target=1e-6",  # far below the measured KL: β grows every step
        "algorithm.reward_kl_horizon=10",
        "optim.steps=4",
        "run.threads=1",
    ]
    cfg, inj = make(tmp_path / "straight", *kl)
    train(cfg, **inj)
    straight = _rows(tmp_path / "straight")
    coefs = [r["kl_reward/coef"] for r in straight]
    kls = [r["kl_reward/kl"] for r in straight]
    # β_{t+1} = β_t·(1 + clip(KL_t/target − 1, ±0.2)·N/horizon), N = 16 sequences (verl's rule)
    want = [0.01]
    for k in kls[:-1]:
        want.append(want[-1] * (1 + min(0.2, max(-0.2, k / 1e-6 - 1)) * 16 / 10))
    assert coefs == pytest.approx(want, rel=1e-9) and len(set(coefs)) == 4
    cfg, inj = make(tmp_path / "resumed", *kl, "optim.steps=2", "run.every=1")
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "resumed", *kl, "run.resume=true", "run.every=1")
    train(cfg, **inj)
    resumed = _rows(tmp_path / "resumed")
    assert [r["kl_reward/coef"] for r in resumed] == coefs  # β restored from the checkpoint
    assert [r["kl_reward/kl"] for r in resumed] == [r["kl_reward/kl"] for r in straight]
