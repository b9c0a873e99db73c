"""GroupRLGRPOTrainer in two processes (torchrun, gloo on CPU), one preset per estimator family.

``trl_two_ranks.py`` runs the trainers and records; every comparison is here. The global batch
is rebuilt from what each rank's reward function returned (rank 0's rows, then rank 1's, as
accelerate's ``gather`` concatenates them), so the check does not read the adapter's gathered
matrix: each rank must train on exactly its slice of ``advantages.compute`` over that batch.
With 6 completions per rank and G = 4, group 1 (global rows 4-7) is split 2 + 2 across ranks.
"""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from procs import torchrun

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("trl")

from grouprl import advantages
from grouprl.integrations import trl as gt

pytestmark = [pytest.mark.peer, pytest.mark.slow, pytest.mark.e2e]

SCRIPT = Path(__file__).with_name("trl_two_ranks.py")
RANKS, PER_RANK, G, STEPS = 2, 6, 4, 2
FAMILIES = {
    # preset -> (estimator, keywords) written out from docs/ALGORITHMS.md, not read from presets
    "rloo": ("rloo", {}),
    "maxnorm_rloo": ("maxnorm_rloo", {"delta_res": 0.01}),
    "f_grpo": ("grpo", {"focal_gamma": 0.5}),
    "avspo": ("grpo", {"virtual": "symmetric"}),
}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl-two-ranks")
    torchrun(SCRIPT, out, RANKS, timeout=TIMEOUT_S)
    return out


def load(out, run):
    ranks = [json.loads((out / run / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [d["rank"] for d in ranks] == [0, 1] and all(d["world"] == RANKS for d in ranks)
    return ranks


def global_grid(ranks, k):
    """[P, G] rewards of generation k: rank 0's rows then rank 1's, None -> NaN."""
    rows = [math.nan if r is None else r for d in ranks for r in d["rewards"][k]]
    return torch.tensor(rows, dtype=torch.float32).view(-1, G)


def check_generation(ranks, k, estimator, kwargs, trigger=None):
    grid = global_grid(ranks, k)  # [3, 4]
    assert grid.shape == (RANKS * PER_RANK // G, G)
    assert torch.isnan(grid).any()  # NaN rows crossed the gather
    want = advantages.compute(estimator, grid, trigger=trigger, **kwargs).values.reshape(-1)
    for r, d in enumerate(ranks):
        got = torch.tensor(d["produced"][k])
        torch.testing.assert_close(got, want[r * PER_RANK : (r + 1) * PER_RANK], atol=1e-6, rtol=0)
        # TRL shuffles the rows inside a rank before the loss: same multiset
        consumed = torch.sort(torch.tensor(d["consumed"][k])).values
        torch.testing.assert_close(consumed, torch.sort(got).values, atol=1e-6, rtol=0)
    return grid


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_each_rank_trains_on_its_slice_of_the_global_advantages(runs, preset):
    estimator, kwargs = FAMILIES[preset]
    ranks = load(runs, preset)
    replay = advantages.VirtualTrigger() if "virtual" in kwargs else None
    straddled = False
    for k in range(STEPS):
        assert all(len(d["rewards"]) == STEPS and d["global_step"] == STEPS for d in ranks)
        grid = check_generation(ranks, k, estimator, kwargs, trigger=replay)
        split = grid[1][~torch.isnan(grid[1])]  # the group split 2 + 2 across the ranks
        straddled |= bool(split.numel() > 1 and split.std() > 0)
    assert straddled  # the split group carried signal, so both slices depended on both ranks
    if replay is not None:  # the AVSPO trigger saw the same global batch on both ranks
        assert ranks[0]["trigger"] == ranks[1]["trigger"] == replay.state_dict()
        assert replay.steps == STEPS


def test_a_two_process_checkpoint_resumes_the_trigger_on_both_ranks(runs):
    estimator, kwargs = FAMILIES["avspo"]
    first = load(runs, "avspo")
    replay = advantages.VirtualTrigger()
    for k in range(STEPS):
        advantages.compute(estimator, global_grid(first, k), trigger=replay, **kwargs)
    saved = json.loads((runs / "avspo" / f"checkpoint-{STEPS}" / gt.STATE_FILE).read_text())
    assert saved["trigger"] == replay.state_dict()
    resumed = load(runs, "avspo-resumed")
    for d in resumed:
        assert d["loaded_state"]["trigger"] == saved["trigger"]  # each rank read the file
        assert d["global_step"] == STEPS + 1 and len(d["produced"]) == 1  # one new step only
    check_generation(resumed, 0, estimator, kwargs, trigger=replay)  # continues from the file
    assert resumed[0]["trigger"] == resumed[1]["trigger"] == replay.state_dict()
    assert replay.steps == STEPS + 1
