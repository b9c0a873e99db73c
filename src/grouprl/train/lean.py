"""A gated MLP that keeps half the activations for the backward, with the same gradients.

A Llama-style MLP, ``down(silu(gate(x)) * up(x))``, under autograd keeps four ``[tokens,
intermediate]`` tensors for the backward: the gate's output (for SiLU's derivative), SiLU's
output and the up projection (for the product's), and the product (for ``down``'s weight).
On SmolLM2 (intermediate 1536, hidden 576) that is 55 % of everything a training forward
keeps per token and layer (measured with ``torch.autograd.graph.saved_tensors_hooks``:
43.7 KB of 30 layers x 1.28 MB per token). :class:`_GatedMLP` keeps the gate and up outputs
and recomputes ``silu(gate)`` and the product in the backward: two elementwise passes, no
matmul, half the MLP's activations. [OURS] (the same trade as fused SwiGLU kernels, e.g.
Liger-Kernel's ``LigerSiLUMulFunction``; not gradient checkpointing: no matmul is redone.)

The backward calls the same ATen operations on the same operands, in the order autograd
does for ``nn.Linear`` (without bias) on a 3-D input (``mm`` on the flattened rows; the
weight's gradient as the transpose of ``input^T @ grad``) and for SiLU (``silu_backward``),
so outputs and gradients equal the module's own bit for bit (tests/train/test_lean.py).

:func:`lean_mlp` switches every such MLP of a model to it for the duration of a block (the
training forward of ``completion_logprobs``); other MLPs are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["lean_mlp", "lean_mlps"]

F = torch.nn.functional


class _GatedMLP(torch.autograd.Function):
    """``down(silu(x @ Wg^T) * (x @ Wu^T))``, keeping x, the gate and the up outputs."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):  # x [..., H]; W [I, H], [I, H], [H, I]
        gate = F.linear(x, w_gate)  # [..., I]
        up = F.linear(x, w_up)  # [..., I]
        out = F.linear(F.silu(gate) * up, w_down)  # [..., H]
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        i, h = gate.shape[-1], x.shape[-1]
        gate2, up2, x2 = gate.reshape(-1, i), up.reshape(-1, i), x.reshape(-1, h)  # [M, .]
        act = F.silu(gate2)  # [M, I] recomputed
        grad2 = grad_out.reshape(-1, h)  # [M, H]
        need_x, need_g, need_u, need_d = ctx.needs_input_grad
        grad_prod = grad2.mm(w_down)  # [M, I] d out / d (silu(g) * u)
        grad_up = grad_prod * act
        grad_gate = torch.ops.aten.silu_backward(grad_prod * up2, gate2)
        grad_x = grad_gate.mm(w_gate) + grad_up.mm(w_up) if need_x else None
        return (
            None if grad_x is None else grad_x.view(x.shape),
            x2.t().mm(grad_gate).t() if need_g else None,
            x2.t().mm(grad_up).t() if need_u else None,
            (act * up2).t().mm(grad2).t() if need_d else None,
        )


def _is_gated_silu(module: torch.nn.Module) -> bool:
    """A transformers gated MLP this function reproduces: ``gate_proj``, ``up_proj`` and
    ``down_proj`` plain bias-free ``nn.Linear`` layers of one dtype and ``act_fn`` SiLU."""
    layers = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(lin) is torch.nn.Linear and lin.bias is None for lin in layers):
        return False
    if len({lin.weight.dtype for lin in layers}) != 1:
        return False
    act = getattr(module, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def lean_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MLPs that :func:`lean_mlp` switches (see :func:`_is_gated_silu`)."""
    return [m for m in model.modules() if _is_gated_silu(m)]


def _forward(module: torch.nn.Module):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
            return type(module).forward(module, x)  # no backward, or autocast's own casts
        return _GatedMLP.apply(
            x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
        )

    return forward


@contextlib.contextmanager
def lean_mlp(model: Any) -> Iterator[int]:
    """Within the block, the model's gated SiLU MLPs keep half their activations (module
    docstring); yields how many were switched. The switch is an instance attribute, removed
    on exit, also on an exception; nested blocks leave the outer switch in place."""
    switched = []
    for module in lean_mlps(model) if isinstance(model, torch.nn.Module) else []:
        if "forward" in vars(module):  # already switched (a nested block) or user-patched
            continue
        module.forward = _forward(module)
        switched.append(module)
    try:
        yield len(switched)
    finally:
        for module in switched:
            del module.forward
