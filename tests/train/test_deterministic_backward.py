"""The training step's backward sums in a fixed order, so a run's numbers do not depend on the
machine's load.

A differentiable gather with repeated indices (``x[idx]`` where ``idx`` repeats a row) has
a backward that scatters with ``index_put_(accumulate=True)``; on the CPU, for tensors past
torch's grain size and more than one thread, that is a parallel loop of atomic float adds
whose order follows the threads' timing. On an idle machine the timing happens to repeat; beside
other processes it does not, and the same command and seed drifted apart by rounding. These
tests look at the operations the backward runs (a dispatch mode sees every ATen call), so they
fail on the unordered sum whatever the machine's load, and check the ordered sum's value.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from train_toy import make

from grouprl.train import logprobs, loop
from grouprl.train.state import setup


class RepeatedIndexSums(TorchDispatchMode):
    """Records every ``index_put`` with ``accumulate=True`` whose indices hit an element twice."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("index_put", "index_put_", "_index_put_impl_"):
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            indices = [i for i in args[1] if i is not None]
            if accumulate and indices and _repeats(indices):
                self.calls.append(tuple(args[0].shape))
        return func(*args, **kwargs)


def _repeats(indices: list[torch.Tensor]) -> bool:
    if any(i.dtype == torch.bool for i in indices):
        return False  # a mask selects each element at most once
    flat = torch.stack([i.reshape(-1) for i in torch.broadcast_tensors(*indices)], -1)  # [n, k]
    return flat.unique(dim=0).shape[0] < flat.shape[0]


def test_the_recorder_sees_the_unordered_sum():
    # the planted case: advanced indexing with a repeated row, what Cache.batch_select_indices does
    x = torch.randn(3, 5, requires_grad=True)
    with RepeatedIndexSums() as seen:
        x[torch.tensor([0, 0, 2])].sum().backward()
    assert seen.calls == [(3, 5)]
    with RepeatedIndexSums() as seen:  # index_select sums in index order (index_add_)
        x.index_select(0, torch.tensor([0, 0, 2])).sum().backward()
    assert seen.calls == []


def _cache(p: int, requires_grad: bool = True):
    from transformers import DynamicCache

    torch.manual_seed(0)
    cache = DynamicCache()
    leaves = []
    for layer in range(2):
        k = torch.randn(p, 2, 3, 4, dtype=torch.float64, requires_grad=requires_grad)
        v = torch.randn(p, 2, 3, 4, dtype=torch.float64, requires_grad=requires_grad)
        cache.update(k, v, layer)
        leaves += [k, v]
    return cache, leaves


def test_select_cache_gathers_rows_and_sums_their_gradients_in_order():
    p = 4
    cache, leaves = _cache(p)
    rows = torch.tensor([0, 0, 0, 2, 2, 3])  # prompt of each selected completion row (// g)
    with RepeatedIndexSums() as seen:
        out = logprobs._select_cache(cache, rows)
        weights = torch.arange(1.0, 7.0, dtype=torch.float64)[:, None, None, None]  # [6,1,1,1]
        total = sum(((lay.keys + 2 * lay.values) * weights).sum() for lay in out.layers)
        total.backward()
    assert seen.calls == []
    for layer, lay in enumerate(out.layers):  # the selected rows, the original's untouched
        assert torch.equal(lay.keys, leaves[2 * layer][rows])
        assert cache.layers[layer].keys.shape[0] == p
    # d total / d keys[q] = Σ_{r: rows[r] = q} weight_r: by hand 1+2+3, 0, 4+5, 6
    want = torch.tensor([6.0, 0.0, 9.0, 6.0], dtype=torch.float64)
    for k, v in zip(leaves[::2], leaves[1::2]):
        assert torch.equal(k.grad[:, 0, 0, 0], want)
        assert torch.equal(v.grad[:, 0, 0, 0], 2 * want)


def test_a_training_step_has_no_unordered_sum(tmp_path, monkeypatch):
    # the trainer's own step on the tiny model: prompts share one prefill whose cache every
    # completion bucket selects from (repeated rows), the path that drifted under load
    selected = []
    real = logprobs._select_cache
    monkeypatch.setattr(
        logprobs, "_select_cache", lambda c, r: selected.append(len(r)) or real(c, r)
    )
    for preset in ("grpo", "dapo"):
        cfg, inj = make(tmp_path / preset, f"algorithm.preset={preset}", "optim.steps=1")
        run = setup(cfg, **inj)
        with RepeatedIndexSums() as seen:
            loop.train_step(run)
        assert seen.calls == [], (preset, seen.calls)
    assert selected, "the step did not take the shared-prefill path this test is about"
