"""Normalisation conformance through TRL: each optimizer step's gradient against the one-batch
gradient of the same rows, two processes, ``steps_per_generation`` ≠ accumulation steps.

``trl_conformance.py`` runs TRL's own ``GRPOTrainer`` per loss type and grouprl's loss path
(``GroupRLGRPOTrainer(loss="grouprl")``) under torchrun and records, per optimizer step, every
micro-batch's inputs and the gradient about to be applied. Here each step's rows (both ranks,
both micro-batches) are scored again by the same parameters (the learning rate is 0) and the
loss type's definition is applied to them as ONE batch, written out below from TRL 1.16's
``_compute_loss`` without accumulation: at ratio 1 every per-token loss below has the gradient
−A ∇log π, so the loss types differ only in their normaliser. "Off by" is
‖g − g_one‖ / ‖g_one‖; docs/integrations.md's table holds the values measured here.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
from procs import torchrun

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("trl")

from tiny_lm import tiny_model

pytestmark = [pytest.mark.peer, pytest.mark.slow, pytest.mark.e2e]

SCRIPT = Path(__file__).with_name("trl_conformance.py")
RANKS, ACCUM, STEPS = 2, 2, 2
TIMEOUT_S = 400
EXACT = 1e-5
"""Relative gradient error of an exact normaliser: fp32 rounding of two summation orders."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl-conformance")
    torchrun(SCRIPT, out, RANKS, timeout=TIMEOUT_S)
    return out


def one_batch_loss(loss_type: str, sums, counts, max_len: int) -> torch.Tensor:
    """TRL 1.16's loss of one batch at ratio 1, no accumulation, one process, from each row's
    token sum of −A·log π (``sums`` [B], whose gradient is the row's) and valid tokens
    (``counts`` [B])."""
    if loss_type in ("grpo", "sapo"):  # per-sequence token mean, mean over the rows
        return (sums / counts.clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "cispo"):  # the batch's token mean
        return sums.sum() / counts.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":  # a constant: rows × the generation limit
        return sums.sum() / (sums.shape[0] * max_len)
    if loss_type == "luspo":  # sequence ratio × length: the token sum, mean over the rows
        return sums.mean()
    raise AssertionError(loss_type)


def row_sums(model, micro):
    """Each row's token sum of −A·log π and its valid tokens, scored as TRL scored the
    micro-batch (its own padding: TRL's forward takes positions from the padded layout)."""
    t = torch.tensor
    prompt_ids, prompt_mask = t(micro["prompt_ids"]), t(micro["prompt_mask"])
    completion_ids, mask = t(micro["completion_ids"]), t(micro["completion_mask"])
    ids = torch.cat([prompt_ids, completion_ids], 1)
    logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, mask], 1)).logits
    logits = logits[:, -completion_ids.shape[1] - 1 : -1].float()
    logp = logits.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]  # [b, T]
    adv = t(micro["advantages"])  # [b]
    return (-adv[:, None] * logp * mask).sum(-1), mask.sum(-1).float()  # [b], [b]


def one_batch_grad(loss_type, ranks, step):
    """The gradient of the step's rows (both ranks, both micro-batches) as one batch, and the
    rows' valid tokens."""
    model = tiny_model()  # the learning rate is 0: every step saw these parameters
    micro = [m for d in ranks for m in d["micro"][step * ACCUM : (step + 1) * ACCUM]]
    sums, counts = zip(*(row_sums(model, m) for m in micro))
    sums, counts = torch.cat(sums), torch.cat(counts)  # [B]
    loss = one_batch_loss(loss_type, sums, counts, ranks[0]["max_completion_length"])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]), counts


def off_by(runs, case):
    """Per optimizer step: ‖g − g_one‖ / ‖g_one‖, and the step's tokens per micro-batch."""
    ranks = [json.loads((runs / case / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [d["world"] for d in ranks] == [RANKS, RANKS]
    loss_type = case.split("-")[1]
    out = []
    for step in range(STEPS):
        got = [torch.tensor(d["grads"][step]) for d in ranks]
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)  # DDP: one gradient
        want, _ = one_batch_grad(loss_type, ranks, step)
        out.append(float((got[0] - want).norm() / want.norm()))
    return out


TRL_EXACT = ("grpo", "sapo", "dr_grpo", "luspo")
"""TRL's loss types whose normaliser is exact under accumulation: a mean over rows of equal
micro-batches, or a constant."""
TRL_OFF = ("bnpo", "dapo", "cispo")
"""Normalised by a token count that is not the step's: bnpo by each micro-batch's own, dapo and
cispo by the generation batch's tokens per window (exact only when every window has as many)."""


@pytest.mark.parametrize("loss_type", TRL_EXACT)
def test_trl_loss_types_exact_under_accumulation(runs, loss_type):
    assert max(off_by(runs, f"trl-{loss_type}")) < EXACT


@pytest.mark.parametrize("loss_type", TRL_OFF)
def test_trl_loss_types_off_under_accumulation(runs, loss_type):
    """The batch's windows differ in tokens, so the three token normalisers miss the step's."""
    assert max(off_by(runs, f"trl-{loss_type}")) > 100 * EXACT


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "dr_grpo", "dapo", "cispo"])
def test_grouprl_loss_path_exact_under_accumulation(runs, loss_type):
    """grouprl's loss path normalises a token mean by the step's own tokens (counted over both
    ranks when the generation batch is split), so dapo and cispo are exact there too."""
    assert max(off_by(runs, f"grouprl-{loss_type}")) < EXACT


def test_grouprl_bnpo_is_trls_bnpo(runs):
    """bnpo is a micro-batch token mean by definition: grouprl's path follows TRL's."""
    ours, trl = off_by(runs, "grouprl-bnpo"), off_by(runs, "trl-bnpo")
    assert ours == pytest.approx(trl, rel=1e-4) and min(ours) > 100 * EXACT


def test_masked_truncations_leave_the_normaliser(runs):
    """``mask_truncated_completions``: truncated rows carry no token; grouprl's dapo stays exact."""
    ranks = [json.loads((runs / "trl-dapo-masked" / f"rank{r}.json").read_text()) for r in (0, 1)]
    _, counts = one_batch_grad("dapo", ranks, 0)
    assert bool((counts == 0).any())  # some row was truncated and masked out
    assert max(off_by(runs, "grouprl-dapo-masked")) < EXACT
    assert max(off_by(runs, "trl-dapo-masked")) > 100 * EXACT
