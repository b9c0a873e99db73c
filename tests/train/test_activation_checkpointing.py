"""optim.activation_checkpointing: the same loss and gradients, fewer tensors kept for the
backward, nothing changed where grad is off, and a clear error for a model without layers."""

import pytest
import torch
from train_toy import make

from grouprl import models, tasks
from grouprl.train import checkpointing
from grouprl.train.config import ConfigError
from grouprl.train.loop import train
from grouprl.train.sinks import read_jsonl
from grouprl.train.state import setup


def _model():
    return models.load("tiny:d=32,layers=3,heads=2,ctx=64", task=tasks.get("maze"), seed=0)[0]


def _loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _saved_bytes(model, ids):
    """Bytes of the tensors autograd keeps for the backward of one forward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum()
    return total[0]


def test_same_gradients_and_less_kept_for_the_backward():
    ids = torch.randint(0, 10, (4, 24), generator=torch.Generator().manual_seed(0))
    plain, wrapped = _model(), _model()
    assert checkpointing.checkpoint_layers(wrapped) == 3  # the three LlamaDecoderLayer
    loss0, g0 = _loss_and_grads(plain, ids)
    loss1, g1 = _loss_and_grads(wrapped, ids)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    kept0, kept1 = _saved_bytes(plain, ids), _saved_bytes(wrapped, ids)
    assert kept1 < 0.6 * kept0, (kept0, kept1)
    with torch.no_grad():  # sampling: the layers run as they are
        assert torch.equal(plain(input_ids=ids).logits, wrapped(input_ids=ids).logits)
    assert checkpointing.checkpoint_layers(wrapped) == 3  # wrapping twice wraps once


def test_a_model_without_decoder_layers_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match=r"optim\.activation_checkpointing=false"):
        checkpointing.checkpoint_layers(torch.nn.Linear(2, 2))
    cfg, inj = make(tmp_path / "run", "optim.activation_checkpointing=true")
    inj["model"] = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="no decoder layer found"):
        setup(cfg, **inj)


def test_a_run_with_it_ends_with_the_same_metrics_and_weights(tmp_path):
    runs = {}
    for on in (False, True):
        cfg, inj = make(tmp_path / str(on), "optim.steps=3", f"optim.activation_checkpointing={on}")
        train(cfg, **inj)
        rows = [{k: v for k, v in r.items() if "time" not in k and not k.endswith("_s")}
                for r in read_jsonl(tmp_path / str(on) / "metrics.jsonl")]  # fmt: skip
        runs[on] = rows, [p.detach().clone() for p in inj["model"].parameters()]
    assert runs[False][0] == runs[True][0] and len(runs[True][0]) >= 3
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
