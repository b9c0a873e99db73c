"""Supervised warm start: batch layout, learning, and the on-disk cache."""

from __future__ import annotations

import json
import time

import pytest
import torch

from grouprl import models, tasks
from grouprl.tasks.maze import Maze
from grouprl.train import sft

MAZE = tasks.get("maze")
SPEC = "tiny:d=32,layers=2,heads=2"


def test_sft_batch_layout():
    tok = models.task_tokenizer(MAZE)
    exs = MAZE.examples("train", 3, 0)
    ids, labels = sft.sft_batch(tok, MAZE, exs)
    for row, ex in enumerate(exs):
        moves = ex.reference.solve()
        # prompt: <bos> + 25 cells + <sep> = 27 tokens, all masked out of the loss
        assert (labels[row, :27] == -100).all()
        assert ids[row, 0] == tok.bos_token_id and ids[row, 26] == tok.convert_tokens_to_ids(
            "<sep>"
        )
        target = labels[row, 27 : 27 + len(moves) + 1].tolist()
        assert target == [*tok.convert_tokens_to_ids(moves), tok.eos_token_id]
        assert (labels[row, 28 + len(moves) :] == -100).all()  # padding
        assert (ids[row, 28 + len(moves) :] == tok.pad_token_id).all()
        assert torch.equal(ids[row, 27 : 28 + len(moves)], labels[row, 27 : 28 + len(moves)])


def test_warm_start_learns_and_caches(tmp_path, monkeypatch):
    monkeypatch.delenv("GROUPRL_NO_SFT_CACHE", raising=False)
    model, tok = models.load(SPEC, task=MAZE, seed=0)
    ids, labels = sft.sft_batch(tok, MAZE, MAZE.examples("eval", 64, 0))

    def heldout_loss(m):
        with torch.no_grad():
            logits = m(input_ids=ids).logits[:, :-1]
        return float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        )

    before = heldout_loss(model)
    kwargs = {"steps": 40, "batch_size": 16, "lr": 3e-3, "cache_dir": tmp_path, "progress": False}
    sft.warm_start(model, tok, MAZE, **kwargs)
    after = heldout_loss(model)
    # log(57) ≈ 4.04 at init; 40 steps learn at least the move/EOS format of the answers
    assert before > 3.5 and after < 0.6 * before
    folders = list(tmp_path.iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("maze-")
    meta = json.loads((folders[0] / "meta.json").read_text())
    assert meta["steps"] == 40 and meta["final_loss"] < before

    fresh, _ = models.load(SPEC, task=MAZE, seed=0)
    t0 = time.perf_counter()
    sft.warm_start(fresh, tok, MAZE, **kwargs)  # a cache hit: no training
    assert time.perf_counter() - t0 < 2.0
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    assert len(list(tmp_path.iterdir())) == 1

    # another seed of the initial weights, or another recipe, is another cache entry
    other, _ = models.load(SPEC, task=MAZE, seed=1)
    key = sft.cache_key(other, tok, MAZE, steps=40)
    assert (
        key
        != sft.cache_key(fresh, tok, MAZE, steps=40)
        != sft.cache_key(fresh, tok, MAZE, steps=41)
    )
    assert sft.cache_key(fresh, tok, MAZE, steps=40) != sft.cache_key(
        fresh, tok, tasks.get("maze", size=4), steps=40
    )


def test_no_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GROUPRL_NO_SFT_CACHE", "1")
    model, tok = models.load(SPEC, task=MAZE, seed=0)
    sft.warm_start(model, tok, MAZE, steps=2, batch_size=4, cache_dir=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())
    # a warm start trained here leaves no gradient behind (a cached one has none either), so
    # the first RL step is the same whether or not the cache was warm
    assert all(q.grad is None for q in model.parameters())


def test_bad_arguments():
    model, tok = models.load(SPEC, task=MAZE)
    with pytest.raises(ValueError, match="exactly one"):
        sft.warm_start(model, tok, MAZE)
    with pytest.raises(ValueError, match="exactly one"):
        sft.warm_start(model, tok, MAZE, steps=3, seconds=1.0)
    with pytest.raises(ValueError, match="steps"):
        sft.warm_start(model, tok, MAZE, steps=0)

    class NoDemo:
        name = "nodemo"

    with pytest.raises(ValueError, match="demonstration"):
        sft.warm_start(model, tok, NoDemo(), steps=1)


def test_reference_maze_type():
    assert isinstance(MAZE.examples("train", 1, 0)[0].reference, Maze)
