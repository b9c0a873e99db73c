"""Checkpoints: atomic, checksummed, corrupt ones rejected with a message, keep last K."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from grouprl.train import checkpoint as ckpt
from grouprl.train.layout import list_checkpoints


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_parameters_optimizer_state_and_rng(tmp_path):
    model, opt = _model_and_opt()
    gen = torch.Generator().manual_seed(5)
    torch.rand(3, generator=gen)
    state = {"rng": ckpt.capture_rng({"rollout": gen}), "extra": [1, 2]}
    path = ckpt.save(tmp_path, 7, model=model, optimizer=opt, state=state)
    assert path.name == "step_00000007" and ckpt.verify(path) == 7
    expected = (torch.rand(3, generator=gen), torch.rand(2), random.random(), np.random.rand())

    other, other_opt = _model_and_opt(seed=1)
    loaded = ckpt.latest_good(tmp_path)
    assert loaded.step == 7 and loaded.state["extra"] == [1, 2]
    ckpt.load_trainable(other, loaded.model)
    other_opt.load_state_dict(loaded.optimizer)
    ckpt.restore_rng(loaded.state["rng"], {"rollout": gen})
    got = (torch.rand(3, generator=gen), torch.rand(2), random.random(), np.random.rand())
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
    assert got[2:] == expected[2:]
    for a, b in zip(other.parameters(), model.parameters()):
        assert torch.equal(a, b)
    sa, sb = other_opt.state_dict()["state"], opt.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sb)


def test_keep_last_and_no_temporary_leftovers(tmp_path):
    model, opt = _model_and_opt()
    for step in (1, 2, 3, 4):
        ckpt.save(tmp_path, step, model=model, optimizer=opt, state={}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "missing"])
def test_corrupt_checkpoint_is_rejected_and_the_previous_one_used(tmp_path, damage):
    model, opt = _model_and_opt()
    ckpt.save(tmp_path, 1, model=model, optimizer=opt, state={"tag": "good"})
    bad = ckpt.save(tmp_path, 2, model=model, optimizer=opt, state={"tag": "bad"})
    target = bad / "model.pt"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    elif damage == "manifest":
        (bad / "manifest.json").write_text("{not json")
    else:
        target.unlink()
    messages = []
    loaded = ckpt.latest_good(tmp_path, log=messages.append)
    assert loaded.step == 1 and loaded.state["tag"] == "good"
    assert len(messages) == 1 and "step_00000002" in messages[0]
    expected = {
        "truncate": "truncated",
        "flip": "sha256",
        "manifest": "manifest",
        "missing": "missing",
    }
    assert expected[damage] in messages[0] and "falling back" in messages[0]
    with pytest.raises(ckpt.CheckpointError):
        ckpt.verify(bad)


def test_no_good_checkpoint_gives_none_and_mismatched_model_is_an_error(tmp_path):
    assert ckpt.latest_good(tmp_path / "absent") is None
    model, opt = _model_and_opt()
    ckpt.save(tmp_path, 1, model=model, optimizer=opt, state={})
    with pytest.raises(ckpt.CheckpointError, match="does not match the model"):
        ckpt.load_trainable(torch.nn.Linear(4, 2, bias=False), ckpt.latest_good(tmp_path).model)
