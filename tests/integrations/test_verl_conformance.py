"""The normalisation conformance matrix through the verl adapter: every grouprl surrogate
registered in verl (and verl's own ``vanilla``) x every ``loss_agg_mode`` of verl's
``agg_loss``, with verl's ``global_batch_info`` (the global token / sequence counts), over
micro-batches of 1, 2 and 3 rows, a fully masked row and ragged masks: the micro-batch
gradients add up to the one-batch gradient. Without the global counts each micro-batch
normalises by its own, and the numbers it is off by are the ones docs/integrations.md lists.
``grouprl_clip_cov`` / ``grouprl_kl_cov`` select tokens within a micro-batch by design (verl's
reading) and are left out."""

import warnings

import pytest
import torch

pytestmark = pytest.mark.peer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from omegaconf import OmegaConf  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from grouprl import losses  # noqa: E402
from grouprl.integrations import verl as gv  # noqa: E402, F401  (registers the losses)

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm"]  # fmt: skip
LOSSES = ["vanilla"] + [
    f"grouprl_{s}" for s in losses.SURROGATES if s not in ("clip_cov", "kl_cov")
]
PARTS = (slice(0, 1), slice(1, 3), slice(3, 6))


def _config(name):
    policy_loss = {"loss_mode": name}
    if name == "grouprl_dro":
        policy_loss["dro_beta"] = 0.2
    cfg = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2,
                      policy_loss=OmegaConf.create(policy_loss))  # fmt: skip
    return cfg


def _inputs(seed=0, n=6, t=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)[:, None].expand(n, t).contiguous()
    lengths = torch.tensor([3, 7, 0, 5, 1, 6])  # row 2 fully masked (rejected / truncated)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    return old, logp, adv * mask, mask


def _grad(name, mode, old, logp, adv, mask, info):
    cfg = _config(name)
    cfg.global_batch_info.update(info)
    lp = logp.clone().requires_grad_(True)
    loss, _ = core_algos.get_policy_loss_fn(name)(old, lp, adv, mask, mode, cfg)
    (g,) = torch.autograd.grad(loss, lp)
    return g


def micro_grads(name, mode, global_info):
    """(one-batch gradient, summed micro-batch gradient) [N, T]."""
    old, logp, adv, mask = _inputs()
    info = {"dp_size": 1, "loss_scale_factor": mask.shape[-1]}
    n_tok, n_seq = mask.sum(), (mask.sum(-1) > 0).sum()
    whole = _grad(name, mode, old, logp, adv, mask,
                  {**info, "batch_num_tokens": n_tok, "global_batch_size": n_seq})  # fmt: skip
    acc = torch.zeros_like(logp)
    for s in PARTS:
        part = (
            {**info, "batch_num_tokens": n_tok, "global_batch_size": n_seq} if global_info else info
        )
        if not bool(mask[s].any()):
            continue
        acc[s] = _grad(name, mode, old[s], logp[s], adv[s], mask[s], part)
    return whole, acc


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_micro_batches_with_verls_global_batch_info_add_up(name, mode):
    whole, acc = micro_grads(name, mode, global_info=True)
    assert float(whole.abs().max()) > 1e-6
    torch.testing.assert_close(acc, whole, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("mode", MODES)
def test_without_the_global_counts_the_means_are_off(mode):
    # each micro-batch divides by its own count: the relative gradient error of vanilla PPO
    whole, acc = micro_grads("vanilla", mode, global_info=False)
    err = float((acc - whole).norm() / whole.norm())
    if mode == "token-sum":  # a sum needs no count
        assert err < 1e-12
    else:  # documented in docs/integrations.md, "Normalisation conformance"
        assert err > 0.1, err
