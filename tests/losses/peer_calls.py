"""Calling the peers' own loss code on plain tensors: shared by the parity tests
(``test_peer_parity_methods.py``) and ``benchmarks/losses.py``.

- :func:`verl_config`: verl's ``ActorConfig`` (with its ``PolicyLossConfig``) for a policy loss.
- :func:`trl_loss`: TRL's ``GRPOTrainer._compute_loss`` (or the experimental
  ``GMPOTrainer``'s) run on a stand-in ``self`` that holds only what the method reads, with the
  model forward replaced by the given log-prob tensor: the code that runs is TRL's.
- :func:`openrlhf_functions`: OpenRLHF's ``compute_approx_kl`` and ``PolicyLoss`` executed from
  its installed source by ``tests/advantages/openrlhf_ref.py`` (OpenRLHF's package imports
  DeepSpeed and vLLM); None when OpenRLHF is not installed.

Each raises ImportError when its peer is missing; the tests turn that into a skip.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

ACTOR_FIELDS = ("tau_pos", "tau_neg")
"""Keyword arguments of :func:`verl_config` that go to ``ActorConfig``, not ``PolicyLossConfig``."""


def verl_config(clip=(0.2, 0.2), c=3.0, **loss_kw):
    """verl ``ActorConfig`` with clip bounds ``clip``, dual clip ``c`` and policy-loss fields."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from verl.workers import config
    actor = {k: v for k, v in loss_kw.items() if k in ACTOR_FIELDS}
    policy = {k: v for k, v in loss_kw.items() if k not in ACTOR_FIELDS}
    return config.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        clip_ratio=clip[0],
        clip_ratio_low=clip[0],
        clip_ratio_high=clip[1],
        clip_ratio_c=c,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=config.PolicyLossConfig(**policy),
        **actor,
    )


def _trl_stub(trainer_cls, logp, entropy, *, loss_type, eps, beta, level="token", **args):
    """A stand-in ``self`` holding what ``_compute_loss`` reads; TRL's methods bound to it."""
    t = args.pop("max_len", None) or logp.shape[1]
    targs = SimpleNamespace(
        use_bias_correction_kl=args.pop("bias_kl", False),
        delta=args.pop("delta", None),
        steps_per_generation=1,
        sapo_temperature_pos=args.pop("tau_pos", 1.0),
        sapo_temperature_neg=args.pop("tau_neg", 1.05),
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        entropy_target=0.2,
    )
    stub = SimpleNamespace(
        top_entropy_quantile=args.pop("quantile", 1.0),
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=targs,
        loss_type=loss_type,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=args.pop("accum", 1),
        max_completion_length=t,
        accelerator=SimpleNamespace(
            num_processes=1,
            gather=lambda x: x,
            gather_for_metrics=lambda x: x,
            reduce=lambda x, reduction="sum": x,
            pad_across_processes=lambda x, dim=0, pad_index=0: x,
            sync_gradients=True,
        ),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    stub.get_high_entropy_mask = types.MethodType(trainer_cls.get_high_entropy_mask, stub)
    stub.get_gamma_weights = trainer_cls.get_gamma_weights
    if args:
        raise TypeError(f"unused stub arguments {sorted(args)}")
    return stub


def trl_loss(
    lp, old, ref, adv, mask, *, trainer="grpo", entropy=None, num_items=None, metrics=None, **kw
):
    """TRL's ``_compute_loss`` on log-probs ``lp`` (the graph runs through them).

    ``kw``: ``loss_type``, ``eps`` (TRL's epsilon_low, epsilon_high), ``beta``, ``level``
    (importance_sampling_level), and ``bias_kl``, ``delta``, ``tau_pos``, ``tau_neg``,
    ``quantile`` (top_entropy_quantile), ``accum`` (gradient accumulation steps), ``max_len``
    (max_completion_length; default the padded width). ``metrics``: a dict that receives TRL's
    logged training metrics.
    """
    from trl.trainer.grpo_trainer import GRPOTrainer

    cls = GRPOTrainer
    if trainer == "gmpo":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from trl.experimental.gmpo import GMPOTrainer
        cls = GMPOTrainer
    n, t = lp.shape
    ent = torch.zeros_like(lp) if entropy is None else entropy
    stub = _trl_stub(cls, lp, ent, **kw)
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum() if num_items is None else num_items,
    }
    loss = cls._compute_loss(stub, None, inputs)
    if metrics is not None:
        metrics.update(stub._metrics["train"])
    return loss


def openrlhf_functions() -> SimpleNamespace | None:
    """``.compute_approx_kl`` and ``.PolicyLoss`` of the installed OpenRLHF (None: not installed)."""
    ref = sys.modules.get("openrlhf_ref")
    if ref is None:
        path = Path(__file__).parents[1] / "advantages" / "openrlhf_ref.py"
        spec = importlib.util.spec_from_file_location("openrlhf_ref", path)
        ref = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)
    if not ref.available():
        return None
    masked_mean = ref.load("models/utils.py", {"masked_mean"})["masked_mean"]
    loss = ref.load(
        "models/loss.py",
        {"PolicyLoss", "aggregate_loss"},
        nn=torch.nn,
        dist=torch.distributed,
        masked_mean=masked_mean,
    )
    return SimpleNamespace(compute_approx_kl=ref.compute_approx_kl(), PolicyLoss=loss["PolicyLoss"])
