"""train.lean: the gated MLP that keeps half its activations gives the module's own outputs and
gradients bit for bit, keeps less, and is switched on only inside the block."""

from __future__ import annotations

import contextlib

import pytest
import torch

from grouprl import models
from grouprl.train import lean, logprobs


def _llama(kv_heads: int = 2, d: int = 32, ff: int = 64, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=50, hidden_size=d, intermediate_size=ff, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 9), (1, 1), (3, 17)])
def test_gated_mlp_equals_the_module_bit_for_bit(dtype, shape):
    mlp = _llama(dtype=dtype).model.layers[0].mlp
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, 32, generator=gen).to(dtype)
    grad = torch.randn(*shape, 32, generator=gen).to(dtype)
    runs = []
    for switch in (contextlib.nullcontext(), lean.lean_mlp(mlp)):
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with switch:
            out = mlp(xi)
        out.backward(grad)
        runs.append([out, xi.grad] + [p.grad.clone() for p in mlp.parameters()])
    for a, b in zip(*runs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_completion_logprobs_same_values_and_gradients_less_kept(monkeypatch):
    model = _llama(kv_heads=2)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 50, (4, 6), generator=gen)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[2:, :2] = 0  # left padding
    comp = torch.randint(3, 50, (4, 7), generator=gen)
    comp_mask = torch.ones(4, 7)
    comp_mask[1, 5:] = 0

    def run():
        model.zero_grad(set_to_none=True)
        lp = logprobs.completion_logprobs(model, prompt, prompt_mask, comp, comp_mask, entropy=True)
        lp.logp.sum().backward()
        return lp, [p.grad.clone() for p in model.parameters()]

    lean_lp, lean_grads = run()
    lean_kept = _saved_bytes(lambda: logprobs.completion_logprobs(model, prompt, prompt_mask, comp,
                                                                  comp_mask))  # fmt: skip
    monkeypatch.setattr(logprobs, "lean_mlp", lambda m: contextlib.nullcontext(0))
    plain_lp, plain_grads = run()
    plain_kept = _saved_bytes(lambda: logprobs.completion_logprobs(model, prompt, prompt_mask,
                                                                   comp, comp_mask))  # fmt: skip
    assert torch.equal(lean_lp.logp, plain_lp.logp) and torch.equal(lean_lp.entropy, plain_lp.entropy)
    assert all(torch.equal(a, b) for a, b in zip(lean_grads, plain_grads))
    # per layer and token the MLP keeps 2 x 64 floats instead of 4 x 64: 2 layers x 13 tokens/row
    tokens = int(prompt_mask.sum() + comp_mask.sum())
    assert plain_kept - lean_kept >= 2 * 2 * 64 * 4 * (tokens - 4 * 2)  # minus padding slack


def test_switch_is_scoped_and_leaves_other_modules_alone():
    model = _llama()
    mlps = lean.lean_mlps(model)
    assert len(mlps) == 2
    with pytest.raises(RuntimeError), lean.lean_mlp(model) as n:
        assert n == 2 and all("forward" in vars(m) for m in mlps)
        with lean.lean_mlp(model) as inner:  # nested: the outer switch stays
            assert inner == 0
        assert all("forward" in vars(m) for m in mlps)
        raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in mlps)  # restored on an exception
    biased = _llama()
    biased.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 64, bias=True)
    assert len(lean.lean_mlps(biased)) == 1  # a bias: not this function's form
    assert lean.lean_mlps(torch.nn.Linear(2, 2)) == []


def test_no_grad_and_autocast_take_the_module_path(monkeypatch):
    model = _llama()
    calls = []
    real = lean._GatedMLP.apply
    monkeypatch.setattr(lean._GatedMLP, "apply", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(3, 50, (2, 5))
    with lean.lean_mlp(model):
        with torch.no_grad():
            model(input_ids=ids)
        assert not calls
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
        assert not calls
        model(input_ids=ids)
        assert len(calls) == 2


def test_the_maze_model_is_switched():
    model, _ = models.load("tiny", seed=0)
    assert len(lean.lean_mlps(model)) == model.config.num_hidden_layers
