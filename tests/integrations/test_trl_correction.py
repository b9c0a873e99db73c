"""TRL's vLLM importance-sampling correction, run by TRL's own code, against ours.

No vLLM runs here: :class:`trl_doubles.InjectedVLLM` makes TRL believe it sampled with vLLM
and hands it rollout log-probs that differ from the trainer's (the model's own plus noise, one
unscorable token). Then:

- TRL's ``_generate_and_score_completions`` computes ``importance_sampling_ratio`` for each
  of its four ``vllm_importance_sampling_mode``s with their caps; it must equal
  :func:`grouprl.losses.correction.compute` of :func:`~grouprl.losses.correction.trl_mode`
  on the same log-probs, and TRL's ``sampling/*`` metrics our stats and mismatch metrics;
- the adapter's grouprl loss path, which used to refuse the correction, now trains exactly as
  TRL's own loss path with the same settings (vLLM correction and DeepSeek-V3.2's
  off-policy mask on, gradient accumulation, two iterations per generation).
"""

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.peer

os.environ["HF_HUB_OFFLINE"] = "1"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    trl = pytest.importorskip("trl")
from tiny_lm import tiny_model, tiny_tokenizer  # noqa: E402
from trl_doubles import InjectedVLLM, RecordingReward, config, dataset, run  # noqa: E402

from grouprl import diagnostics  # noqa: E402
from grouprl.integrations import trl as gt  # noqa: E402
from grouprl.losses import correction as C  # noqa: E402


class TRLWithInjectedVLLM(InjectedVLLM, trl.GRPOTrainer):
    pass


class OursWithInjectedVLLM(InjectedVLLM, gt.GroupRLGRPOTrainer):
    """Also keeps the correction weights its grouprl loss path applied."""

    def _grouprl_correction_weight(self, inputs, logps, old, mask):
        weight = super()._grouprl_correction_weight(inputs, logps, old, mask)
        self.__dict__.setdefault("weights", []).append((weight, mask))
        return weight


MODES = [
    ("sequence_mask", None, 3.0),  # TRL's default
    ("sequence_truncate", 0.5, 2.0),
    ("token_truncate", None, 1.5),
    ("token_mask", 0.6, 1.6),
]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "clip_min", "clip_max"), MODES)
def test_trls_importance_sampling_ratio_equals_ours(tmp_path, mode, clip_min, clip_max):
    args = config(
        tmp_path,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    trainer = TRLWithInjectedVLLM(
        model=tiny_model(),
        reward_funcs=RecordingReward(),
        args=args,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        noise=0.6,
    )
    trainer.model.train()
    rows = [{"prompt": p} for p in ("a b", "c d") for _ in range(4)]  # 2 prompts x G = 4
    out = trainer._generate_and_score_completions(rows)
    mask = out["completion_mask"].bool()
    old, sampling = out["old_per_token_logps"], out["sampling_per_token_logps"]
    assert torch.isnan(sampling[1, 0]) and mask[1, 0]  # the unscorable token reached TRL
    name, params = C.trl_mode(mode, clip_min, clip_max)
    ours = C.compute((name, params), old, sampling, mask, nan_rollout="neutral")
    theirs = out["importance_sampling_ratio"].expand_as(old)
    torch.testing.assert_close(ours.weight[mask], theirs[mask].float(), atol=1e-6, rtol=1e-5)
    # what TRL logged for this batch, from our stats and mismatch metrics
    m = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for stat in ("min", "mean", "max"):
        got = ours.stats[f"corr/{name}/weight_{stat}"]
        assert got == pytest.approx(m[f"sampling/importance_sampling_ratio/{stat}"], rel=1e-5)
    mm = diagnostics.mismatch_metrics(old, sampling, mask)
    for stat in ("mean", "max"):
        want = m[f"sampling/sampling_logp_difference/{stat}"]
        assert mm[f"mismatch/logp_diff_{stat}"] == pytest.approx(want, rel=1e-5)
    # the raw ratios reach past the caps: the correction acted
    assert mm["mismatch/ratio_max"] > clip_max or mm["mismatch/seq_log_ratio_p99"] > 0.5


def _history(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        # TRL's default mode (sequence_mask) + DeepSeek-V3.2's off-policy mask
        {"off_policy_mask_threshold": 0.05, "vllm_importance_sampling_clip_max": 1.5},
        {
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_min": 0.5,
            "vllm_importance_sampling_clip_max": 1.5,
        },
    ],
)
def test_grouprl_loss_path_applies_trls_vllm_correction_as_trls_loss_does(tmp_path, settings):
    kw = dict(
        gradient_accumulation_steps=2, per_device_train_batch_size=4, num_iterations=2, **settings
    )
    runs = {}
    for loss in ("trl", "grouprl"):
        trainer, _ = run(
            tmp_path / loss,
            trainer_cls=OursWithInjectedVLLM,
            preset="grpo",
            loss=loss,
            args=config(tmp_path / loss, **kw),
            noise=0.6,
        )
        runs[loss] = trainer
    a, b = runs["trl"], runs["grouprl"]
    assert not a._grouprl_loss and b._grouprl_loss
    for x, y in zip(a.injected, b.injected):  # the same rollout log-probs reached both
        assert x == y
    la, lb = _history(a), _history(b)
    assert len(la) == len(lb) == 3
    for x, y in zip(la, lb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-7)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4, abs=1e-7)
        if "reward" in x:  # a generation step: TRL's sampling metrics and ours
            key = "sampling/importance_sampling_ratio/min"
            assert y[key] == x[key]
            assert y["grouprl/mismatch/ratio_p99"] == x["grouprl/mismatch/ratio_p99"]
            assert (
                y["grouprl/corr/weight_mean"]
                == pytest.approx(x["sampling/importance_sampling_ratio/mean"], rel=1e-5)
                or settings.get("vllm_importance_sampling_mode") is None
            )
    # the correction acted: some ratio was cut (masked to 0 or truncated at a cap)
    cut = [h["sampling/importance_sampling_ratio/min"] for h in la if "reward" in h]
    cap_low = settings.get("vllm_importance_sampling_clip_min")
    assert min(cut) == (0.0 if cap_low is None else cap_low)
    # ... and reached our loss: rows zeroed (masked or off-policy) or weights != 1
    applied = torch.cat([w[m.bool()] for w, m in b.weights])
    assert (applied != 1).float().mean() > 0.1


@pytest.mark.slow
def test_grouprl_diagnose_reads_trls_mismatch_metrics_from_its_checkpoint(tmp_path, capsys):
    from grouprl.cli import main
    from grouprl.diagnostics import external

    args = config(
        tmp_path, log_completions=True, save_strategy="steps", save_steps=3, save_only_model=True
    )
    trainer = TRLWithInjectedVLLM(  # TRL's own trainer: only TRL's sampling/* metrics
        model=tiny_model(),
        reward_funcs=RecordingReward(),
        args=args,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        noise=0.6,
    )
    trainer.train()
    logged = [
        h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h
    ]
    log = external.load_mismatch(tmp_path)
    assert log.source == "trl" and not log.metrics_only  # the completions log is there too
    assert len(log.rows) == len(logged) == 3
    for row, h in zip(log.rows, logged):
        assert row["corr/weight_mean"] == h["sampling/importance_sampling_ratio/mean"]
        assert row["mismatch/logp_diff_max"] == h["sampling/sampling_logp_difference/max"]
    assert main(["diagnose", str(tmp_path), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "Per-step collapse" in out  # the groups of TRL's completions log
    assert "Rollout vs trainer mismatch (trl log, 3 steps)" in out
    assert "mismatch/logp_diff_mean" in out and "corr/weight_mean" in out
