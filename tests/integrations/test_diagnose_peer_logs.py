"""``grouprl diagnose`` on rollout logs written by the peers' own code.

- TRL: a real ``GRPOTrainer`` (TRL's own, not ours) with ``log_completions=True`` and two
  weighted reward functions writes ``completions/completions_<step>.parquet``; the groups read
  back must be what the reward functions returned, combined with TRL's weights.
- verl: ``RayPPOTrainer._write_generations``, the function verl's trainer dumps
  ``trainer.rollout_data_dir`` with, writes the JSONL files. (``test_verl_trainer.py`` reads the
  files verl's whole trainer wrote.)
"""

import math
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.peer

os.environ["HF_HUB_OFFLINE"] = "1"

from grouprl.cli import main  # noqa: E402
from grouprl.diagnostics import external  # noqa: E402
from grouprl.diagnostics.diagnose import diagnose_groups  # noqa: E402

G = 4
WEIGHTS = (1.0, 0.5)


class LengthReward:
    """Second reward function: words / 4; None at i % 6 in (1, 2). With ``RecordingReward(
    nan_every=3)`` (None at i % 3 == 1) rows 1, 7 have no score at all, rows 2, 8 a partial one."""

    __name__ = "length"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, **kwargs):
        out = [None if i % 6 in (1, 2) else len(c.split()) / 4 for i, c in enumerate(completions)]
        self.calls.append((list(prompts), out))
        return out


def combined(a, b):
    """TRL's rule with weights (1, 0.5): nansum, NaN when both are None."""
    vals = [w * v for w, v in zip(WEIGHTS, (a, b)) if v is not None]
    return sum(vals) if vals else math.nan


@pytest.mark.slow
def test_trl_completions_logged_by_grpo_trainer_read_back(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trl = pytest.importorskip("trl")
    from tiny_lm import tiny_model, tiny_tokenizer
    from trl_doubles import RecordingReward, config, dataset

    ab, length = RecordingReward(nan_every=3), LengthReward()
    args = config(
        tmp_path,
        max_steps=4,
        num_iterations=2,  # a generation is trained on (and logged) at two steps
        log_completions=True,
        reward_weights=list(WEIGHTS),
    )
    trainer = trl.GRPOTrainer(
        model=tiny_model(),
        reward_funcs=[ab, length],
        args=args,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    files = sorted((tmp_path / "completions").glob("completions_*.parquet"))
    assert [f.name for f in files] == [f"completions_{s:05d}.parquet" for s in (1, 2, 3, 4)]
    gf = external.load_trl(tmp_path, reward_weights=WEIGHTS)
    assert sorted(gf.batches) == [1, 3]  # steps 2 and 4 repeat the batch of steps 1 and 3
    assert sum("repeats the previous file" in n for n in gf.notes) == 2
    assert len(ab.calls) == len(length.calls) == 2
    saw_nan = False
    for step, ab_out, (prompts, len_out) in zip((1, 3), ab.calls, length.calls):
        want: dict[str, list[float]] = {}
        for p, a, b in zip(prompts, ab_out, len_out):
            want.setdefault(p, []).append(combined(a, b))
        ids, rewards = gf.batches[step]
        assert ids == list(want) and rewards.shape == (len(want), G)
        expected = torch.tensor(list(want.values()), dtype=torch.float64)
        torch.testing.assert_close(rewards, expected, equal_nan=True, atol=1e-6, rtol=0)
        saw_nan |= bool(torch.isnan(expected).any())
    assert saw_nan  # a row where both functions returned None is NaN, not 0
    assert main(["diagnose", str(tmp_path), "--reward-weights", "1", "0.5", "--no-report"]) == 0
    assert "Per-step collapse (2 steps, 4 groups)" in capsys.readouterr().out


def test_verl_rollout_dump_written_by_verls_writer_reads_back(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    write = ray_trainer.RayPPOTrainer._write_generations
    dump = tmp_path / "rollouts"
    # step 1: prompts A (scores 1, 0, 0, 1) and B (all 0), interleaved as balance_batch leaves
    # them; step 2: A alone, all 1. "acc" is a reward extra info, as verl's managers add.
    inputs1 = ["A", "B", "B", "A", "A", "B", "B", "A"]
    scores1 = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    acc1 = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    write(inputs1, ["o"] * 8, ["g"] * 8, scores1, {"acc": acc1}, str(dump), 1)
    write(["A"] * 4, ["o"] * 4, ["g"] * 4, [1.0] * 4, {"acc": [1.0] * 4}, str(dump), 2)
    assert external.detect(dump) == "verl"
    gf = external.load_verl(dump)
    assert sorted(gf.batches) == [1, 2] and gf.n_errors == 0
    assert gf.batches[1][0] == ["A", "B"]
    want1 = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(gf.batches[1][1], want1)
    torch.testing.assert_close(gf.batches[2][1], torch.ones(1, 4, dtype=torch.float64))
    acc = external.load_verl(dump, score_key="acc")
    want_acc = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(acc.batches[1][1], want_acc)
    # step 1: B all wrong (collapsed), A mixed -> ACR 0.5; step 2: A all correct -> ACR 1
    steps = diagnose_groups(gf).steps
    assert [r["acr/rate"] for r in steps] == [0.5, 1.0]
    assert [r["acr/all_wrong"] for r in steps] == [0.5, 0.0]
    assert main(["diagnose", str(dump), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "Per-step collapse (2 steps, 3 groups)" in out
    assert "verl's rollout_data_dir holds no log-probs" in out  # says where they are instead


def test_verl_file_logger_mismatch_metrics_are_shown(tmp_path, monkeypatch, capsys):
    # verl's own FileLogger writes what its trainer logs; the metrics are verl's own
    # rollout_corr/* of two batches (decoupled mode, token TIS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracking = pytest.importorskip("verl.utils.tracking")
        rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    path = tmp_path / "exp.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = tracking.FileLogger("proj", "exp")
    g = torch.Generator().manual_seed(0)
    logged = []
    for step, spread in ((1, 0.05), (2, 0.5)):
        old = -torch.rand(6, 5, generator=g) * 2
        rollout = old + spread * torch.randn(6, 5, generator=g)
        _, _, metrics = rch.compute_rollout_correction_and_rejection_mask(
            old, rollout, torch.ones(6, 5), rollout_is="token", rollout_is_threshold=2.0
        )
        logger.log({**metrics, "actor/lr": 1e-6}, step)
        logged.append(metrics)
    logger.finish()
    log = external.load_mismatch(path)
    assert log.source == "verl" and log.metrics_only and len(log.rows) == 2
    assert log.rows[1]["mismatch/kl_k3"] == pytest.approx(logged[1]["rollout_corr/k3_kl"])
    assert log.rows[0]["corr/weight_mean"] == pytest.approx(
        logged[0]["rollout_corr/rollout_is_mean"]
    )
    assert main(["diagnose", str(path), "--out", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "Rollout vs trainer mismatch (verl log, 2 steps)" in out and "mismatch/kl_k3" in out
    assert "[rollout_mismatch] step 2" in out  # the spread-0.5 batch: KL well above 1e-3
    assert "Rollout vs trainer mismatch" in (tmp_path / "r.html").read_text()


# ---------------------------------------------------------------- the hand-written rules
def _ramp(early, late, n=10):
    """n steps at ``early`` then n at ``late``: the trend rules' windows see the two apart."""
    return [early] * n + [late] * n


def test_trl_trainer_state_feeds_the_clip_entropy_length_and_hacking_rules(tmp_path, capsys):
    # trainer_state.json written by transformers' own TrainerState, with the keys TRL 1.16's
    # GRPOTrainer logs: the high bound clips 30 % of tokens from step 5, the entropy halves
    # and more, the length grows 3x, the summed reward rises by 0.5 while
    # rewards/accuracy_reward/mean stays at 0.3 (the format function is being gamed)
    transformers = pytest.importorskip("transformers")
    history = []
    for i, (ent, length, fmt) in enumerate(
        zip(_ramp(1.2, 0.5), _ramp(40.0, 120.0), _ramp(0.2, 0.7)), start=1
    ):
        history.append(
            {
                "step": i,
                "loss": 0.01,
                "reward": 0.3 + fmt,
                "rewards/accuracy_reward/mean": 0.3,
                "rewards/format_reward/mean": fmt,
                "entropy": ent,
                "completions/mean_length": length,
                "completions/clipped_ratio": 0.0,
                "clip_ratio/low_mean": 0.02,
                "clip_ratio/high_mean": 0.3 if i >= 5 else 0.0,
                "clip_ratio/region_mean": 0.32 if i >= 5 else 0.02,
            }
        )
    transformers.TrainerState(log_history=history).save_to_json(
        str(tmp_path / "trainer_state.json")
    )
    log = external.load_mismatch(tmp_path)
    assert log.source == "trl" and log.metrics_only and len(log.rows) == 20
    r = log.rows[4]
    assert r["policy/clip_frac_high"] == 0.3 and r["policy/clip_frac_low"] == 0.02
    assert r["reward/correct_mean"] == 0.3 and r["reward/mean"] == pytest.approx(0.5)
    assert main(["diagnose", str(tmp_path), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "[clip_bound] step 5: 32% of tokens clipped: 30% at the high bound" in out
    assert "[entropy_trend] step 20: policy entropy falling" in out
    assert "[length_drift] step 20: mean response length growing: 120 tokens" in out
    assert "[reward_hacking] step 20: the shaped reward rose by +0.5" in out
    assert "moved by +0" in out
    # one reward function only: it is the correctness, nothing to compare
    for h in history:
        del h["rewards/accuracy_reward/mean"]
    transformers.TrainerState(log_history=history).save_to_json(
        str(tmp_path / "trainer_state.json")
    )
    assert "reward/correct_mean" not in external.load_mismatch(tmp_path).rows[0]


def test_verl_file_logger_feeds_clip_entropy_and_length_rules(tmp_path, monkeypatch, capsys):
    # verl's FileLogger with the keys verl 0.9.1's trainer logs (core_algos' actor/pg_clipfrac,
    # both bounds together; metric_utils' response_length/mean, critic/score/mean)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracking = pytest.importorskip("verl.utils.tracking")
    path = tmp_path / "exp.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = tracking.FileLogger("proj", "exp")
    for step, (ent, length) in enumerate(zip(_ramp(0.8, 0.3), _ramp(300.0, 100.0)), start=1):
        logger.log(
            {
                "actor/pg_clipfrac": 0.25,
                "actor/pg_clipfrac_lower": 0.0,
                "actor/entropy": ent,
                "response_length/mean": length,
                "response_length/clip_ratio": 0.0,
                "critic/score/mean": 0.4,
            },
            step,
        )
    logger.finish()
    log = external.load_mismatch(path)
    assert (
        log.rows[0]["policy/clip_frac_region"] == 0.25 and "policy/clip_frac_low" not in log.rows[0]
    )
    assert main(["diagnose", str(path), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "no rollout-vs-trainer mismatch metrics" in out
    assert (
        "[clip_bound] step 1: 25% of tokens clipped (this log does not say at which bound)" in out
    )
    assert "[entropy_trend] step 20: policy entropy falling: 0.3" in out
    assert "[length_drift] step 20: mean response length shrinking: 100 tokens" in out


def test_verl_rollout_dump_score_rising_while_acc_does_not(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer")
    write = ray_trainer.RayPPOTrainer._write_generations
    dump = tmp_path / "rollouts"
    # 2 prompts x 4 samples a step; acc = 1 on sample 0 of each prompt (0.25) throughout; the
    # score adds a shaping bonus: 0.1 for the first 10 steps, 0.6 after
    for step, bonus in enumerate(_ramp(0.1, 0.6), start=1):
        acc = [1.0, 0.0, 0.0, 0.0] * 2
        write(["A"] * 4 + ["B"] * 4, ["o"] * 8, ["g"] * 8, [a + bonus for a in acc],
              {"acc": acc}, str(dump), step)  # fmt: skip
    gf = external.load_verl(dump)
    assert gf.step_metrics[1] == {"reward/correct_mean": 0.25}
    assert any("verified correctness = 'acc'" in n for n in gf.notes)
    warnings_ = diagnose_groups(gf, reward_range=(0.0, 2.0)).warnings
    (hack,) = [w for w in warnings_ if w.startswith("[reward_hacking]")]
    assert hack.startswith(
        "[reward_hacking] step 20: the shaped reward rose by +0.5 (mean of the last 10 steps "
        "against the first 10) while verified correctness moved by +0"
    )
    # honest shaping: acc rising with the score -> quiet
    dump2 = tmp_path / "honest"
    for step, p in enumerate(_ramp(0.0, 1.0), start=1):
        acc = [1.0, p, p, 0.0] * 2
        write(["A"] * 4 + ["B"] * 4, ["o"] * 8, ["g"] * 8, [a + 0.1 for a in acc],
              {"acc": acc}, str(dump2), step)  # fmt: skip
    quiet = diagnose_groups(external.load_verl(dump2), reward_range=(0.0, 2.0)).warnings
    assert not [w for w in quiet if w.startswith("[reward_hacking]")]


def test_trl_completions_with_an_accuracy_column_feed_the_hacking_rule(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "completions"
    folder.mkdir()
    # TRL's table layout: step, prompt, completion, <reward functions>, advantage
    for step, fmt in enumerate(_ramp(0.0, 1.0), start=1):
        n = 8
        cols = {
            "step": [step] * n,
            "prompt": ["A"] * 4 + ["B"] * 4,
            "completion": [f"c{step}-{i}" for i in range(n)],
            "format_reward": [fmt] * n,
            "accuracy_reward": [1.0, 0.0, 0.0, 1.0] * 2,
            "advantage": [0.0] * n,
        }
        pq.write_table(pa.table(cols), folder / f"completions_{step:05d}.parquet")
    gf = external.load_trl(tmp_path)
    assert gf.step_metrics[3] == {"reward/correct_mean": 0.5}
    d = diagnose_groups(gf, reward_range=(0.0, 2.0))
    (hack,) = [w for w in d.warnings if w.startswith("[reward_hacking]")]
    assert "rose by +1 " in hack and "moved by +0 " in hack


def test_truncated_sampling_read_from_trl_and_verl_logs(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    # TRL's logged IS ratios of a vLLM that renormalised over top-p: all <= 1
    history = [
        {
            "step": 1,
            "sampling/sampling_logp_difference/mean": 0.08,
            "sampling/sampling_logp_difference/max": 0.4,
            "sampling/importance_sampling_ratio/min": 0.67,
            "sampling/importance_sampling_ratio/mean": 0.92,
            "sampling/importance_sampling_ratio/max": 1.0,
        }
    ]
    trl_dir = tmp_path / "trl"
    trl_dir.mkdir()
    transformers.TrainerState(log_history=history).save_to_json(str(trl_dir / "trainer_state.json"))
    assert main(["diagnose", str(trl_dir), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert (
        "[truncated_sampling] step 1: no token's ratio pi_train/pi_rollout exceeds 1 (max 1" in out
    )
    assert "mean ratio 0.92 = the mean kept mass" in out
    # verl's own rollout_corr metrics where the engine's log-probs sit above the trainer's by
    # the log of a kept mass (0.9 at every token)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracking = pytest.importorskip("verl.utils.tracking")
        rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    path = tmp_path / "exp.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = tracking.FileLogger("proj", "exp")
    old = -torch.rand(6, 5, generator=torch.Generator().manual_seed(0)) * 2
    _, _, metrics = rch.compute_rollout_correction_and_rejection_mask(
        old, old - math.log(0.9), torch.ones(6, 5), rollout_is="token", rollout_is_threshold=2.0
    )
    logger.log(metrics, 1)
    logger.finish()
    assert main(["diagnose", str(path), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "[truncated_sampling] step 1" in out and "mean ratio 0.9 =" in out
