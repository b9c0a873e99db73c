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
