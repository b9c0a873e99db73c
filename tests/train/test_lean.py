"""train.lean: the gated MLP and the RMSNorm that keep less for the backward give the modules' own
outputs and gradients bit for bit, keep less, and are switched on only inside the block."""

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
@pytest.mark.parametrize("part", ["mlp", "mlp_recomputed", "input_layernorm"])
def test_each_module_equals_its_own_forward_bit_for_bit(dtype, shape, part):
    recompute = part == "mlp_recomputed"
    part = "mlp" if recompute else part
    module = getattr(_llama(dtype=dtype).model.layers[0], part)
    if part != "mlp":
        module.weight.data.normal_(generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, 32, generator=gen).to(dtype)
    grad = torch.randn(*shape, 32, generator=gen).to(dtype)
    runs = []
    for switch in (contextlib.nullcontext(), lean.lean_activations(module, recompute)):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with switch:
            out = module(xi)
        out.backward(grad)
        runs.append([out, xi.grad] + [p.grad.clone() for p in module.parameters()])
    for a, b in zip(*runs):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("recompute_mlp", [False, True])
def test_whole_model_gradients_bit_for_bit_norm_inside_the_residual_stream(recompute_mlp):
    # the norm's input also feeds the residual add: its gradient is a sum of three parts,
    # added in autograd's order only because the norm hands back two edges; with the MLP
    # recomputed its input is the rebuilt norm output, projected again in the backward
    model = _llama()
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(4))
    grads = []
    for switch in (contextlib.nullcontext(), lean.lean_activations(model, recompute_mlp)):
        model.zero_grad(set_to_none=True)
        with switch:
            model(input_ids=ids).logits.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _saved_bytes(fn, monkeypatch) -> int:
    """Bytes of the distinct storages autograd keeps while ``fn`` runs: seen by an outer
    hook, and inside ``lean_activations`` (whose own hook is the innermost, so the one that
    acts) by a spy on what its pack keeps."""
    seen: dict[int, int] = {}

    def note(t):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    real = lean._pack
    with monkeypatch.context() as m:
        m.setattr(lean, "_pack", lambda t: note(real(t)))
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            fn()
    return sum(seen.values())


@pytest.mark.parametrize("recompute_mlp", [False, True])
def test_completion_logprobs_same_values_and_gradients_less_kept(monkeypatch, recompute_mlp):
    model = _llama(kv_heads=2)
    gen = torch.Generator().manual_seed(2)
    for module in lean.lean_modules(model):  # norm weights off 1, where rounding can show
        if hasattr(module, "weight"):
            module.weight.data.normal_(generator=gen)
    prompt = torch.randint(3, 50, (4, 6), generator=gen)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[2:, :2] = 0  # left padding
    comp = torch.randint(3, 50, (4, 7), generator=gen)
    comp_mask = torch.ones(4, 7)
    comp_mask[1, 5:] = 0

    def run():
        model.zero_grad(set_to_none=True)
        lp = logprobs.completion_logprobs(model, prompt, prompt_mask, comp, comp_mask, entropy=True,
                                          recompute_mlp=recompute_mlp)  # fmt: skip
        lp.logp.sum().backward()
        return lp, [p.grad.clone() for p in model.parameters()]

    lean_lp, lean_grads = run()
    lean_kept = _saved_bytes(lambda: logprobs.completion_logprobs(model, prompt, prompt_mask, comp,
                                                                  comp_mask, recompute_mlp=recompute_mlp),
                             monkeypatch)  # fmt: skip
    monkeypatch.setattr(logprobs, "lean_activations", lambda m, r: contextlib.nullcontext(0))
    plain_lp, plain_grads = run()
    plain_kept = _saved_bytes(lambda: logprobs.completion_logprobs(model, prompt, prompt_mask,
                                                                   comp, comp_mask), monkeypatch)  # fmt: skip
    assert torch.equal(lean_lp.logp, plain_lp.logp) and torch.equal(
        lean_lp.entropy, plain_lp.entropy
    )
    assert all(torch.equal(a, b) for a, b in zip(lean_grads, plain_grads))
    # fp32 floats fewer per position (4 rows x 13 prompt and completion positions, padding
    # included): in each of the 2 layers the MLP's 2 x 64 (silu(gate), the product) and, for
    # each of its 2 norms, 32 (x * r) and 32 more (the norm's output, rebuilt in the
    # backward); the final norm 32 (its output is not saved: the head takes a copy); with the
    # MLP recomputed also its gate and up outputs, 2 x 64 more per layer
    positions = 4 * (6 + 7)
    mlp = 4 * 64 if recompute_mlp else 2 * 64
    assert plain_kept - lean_kept == 4 * positions * (2 * (mlp + 2 * (32 + 32)) + 32)


def test_switch_is_scoped_and_leaves_other_modules_alone():
    model = _llama()
    mods = lean.lean_modules(model)
    assert len(mods) == 2 * 3 + 1  # per layer an MLP and two norms; the final norm
    with pytest.raises(RuntimeError), lean.lean_activations(model) as n:
        assert n == 7 and all("forward" in vars(m) for m in mods)
        with lean.lean_activations(model) as inner:  # nested: the outer switch stays
            assert inner == 0
        assert all("forward" in vars(m) for m in mods)
        raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in mods)  # restored on an exception
    biased = _llama()
    biased.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 64, bias=True)
    assert len(lean.lean_modules(biased)) == 6  # a bias: not the form the function computes

    class OtherNorm(torch.nn.Module):  # another forward: left alone
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * (1 + self.weight)

    assert lean.lean_modules(OtherNorm()) == [] and lean.lean_modules(torch.nn.Linear(2, 2)) == []


def test_no_grad_and_autocast_take_the_module_path(monkeypatch):
    model = _llama()
    calls = []
    real = lean._GatedMLP.apply
    monkeypatch.setattr(lean._GatedMLP, "apply", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(3, 50, (2, 5))
    with lean.lean_activations(model):
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
    assert len(lean.lean_modules(model)) == 3 * model.config.num_hidden_layers + 1
