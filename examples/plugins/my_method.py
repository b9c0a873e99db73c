"""An estimator, a surrogate and a preset of your own, in one file (docs/extending.md).

grouprl train --plugin examples/plugins/my_method.py --preset my_method
"""

import torch

from grouprl.advantages import register_estimator
from grouprl.losses import register_surrogate
from grouprl.presets import register_preset
from grouprl.types import Advantages


@register_estimator("mean_centered", sources={"scale": "1: the plain deviation"})
def mean_centered(rewards, valid, *, scale: float = 1.0):
    """A_i = (r_i − mean of the group's valid rewards) / scale; 0 where the reward is NaN."""
    valid = ~rewards.isnan() if valid is None else valid  # [P, G]
    r = rewards.nan_to_num(0.0) * valid
    mean = r.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)  # [P, 1]
    ones = torch.ones(rewards.shape[0], device=rewards.device)  # [P]
    values = (r - mean) * valid / scale  # [P, G]
    return Advantages(values, keep=ones.bool(), kl_weight=ones, scale=ones * scale)


@register_surrogate("clipped_reinforce", sources={"clip": "5: |A| of a few σ"})
def clipped_reinforce(logp, old_logp, adv, mask, *, clip: float = 5.0, stats: bool = True):
    """REINFORCE with bounded advantages: −clamp(A, −clip, clip)·logp per token."""
    a = adv if adv.dim() == 2 else adv[:, None]  # [N, T] or [N, 1]
    return -a.clamp(-clip, clip) * logp * mask, {}


register_preset(
    name="my_method",
    description="mean-centered advantages, clipped REINFORCE, token mean",
    estimator="mean_centered",
    surrogate="clipped_reinforce",
    surrogate_params={"clip": 5.0},
    aggregation="token_mean",
    sources={"estimator": "my paper §2", "surrogate": "my paper §3"},
)
