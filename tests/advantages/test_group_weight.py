"""``group_weight`` (the prompt sampler's importance weights): hand values and bad weights."""

import pytest
import torch

from grouprl import advantages

# r = [1, 0, 0, 0] and [1, 1, 0, 0]; dr_grpo centres on the group mean (no σ):
# [0.75, -0.25, -0.25, -0.25] and [0.5, 0.5, -0.5, -0.5]
R = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_each_groups_advantages_are_multiplied_by_its_weight_and_the_mean_is_logged(
    under_wide_meta_defaults,
):
    # weights 2 and 0.5: [1.5, -0.5, -0.5, -0.5] and [0.25, 0.25, -0.25, -0.25], mean 1.25;
    # given as a list under a default device of "meta": the weights land on the rewards' device
    out = under_wide_meta_defaults(advantages.compute, "dr_grpo", R, group_weight=[2.0, 0.5])
    want = [[1.5, -0.5, -0.5, -0.5], [0.25, 0.25, -0.25, -0.25]]
    assert (out.values.device.type, out.values.dtype) == ("cpu", torch.float32)
    assert out.values.tolist() == want
    assert out.stats["sampler/importance_weight_mean"] == 1.25


@pytest.mark.parametrize(
    "weight",
    [
        [1.0, 0.0],  # not positive
        [1.0, -2.0],
        [1.0, float("nan")],
        [1.0, float("inf")],
        [1.0, 1.0, 1.0, 1.0],  # one per sample [G], not one per group [P]
        [1.0],
    ],
)
def test_a_weight_that_is_not_one_positive_finite_value_per_group_is_refused(weight):
    with pytest.raises(ValueError, match=r"group_weight must be \[P\] = \[2\] positive finite"):
        advantages.compute("dr_grpo", R, group_weight=torch.tensor(weight))
