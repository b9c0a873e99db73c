"""Training forwards that keep less for the backward, with the same gradients bit for bit.

A transformers Llama-style decoder layer under autograd keeps, per token, the gated MLP's four
``[tokens, intermediate]`` tensors (the gate's output for SiLU's derivative, SiLU's output and
the up projection for the product's, the product for ``down``'s weight) and, in each
RMSNorm, the input, ``rsqrt(mean(x²) + eps)`` and the normalised input. On SmolLM2
(intermediate 1536, hidden 576) that is 43.7 KB per token and layer, 1.28 MB per token over
30 layers (measured with ``torch.autograd.graph.saved_tensors_hooks``), the MLP 55 % of it.

- :class:`_GatedMLP` keeps the MLP's input and the gate and up outputs and recomputes
  ``silu(gate)`` and the product in the backward (two elementwise passes, no matmul).
- :class:`_RMSNorm` keeps the input and ``rsqrt(...)`` and recomputes the normalised input.
- A norm's output, which the layers after it save as their input (the attention's q/k/v
  projections, the MLP), is kept as a reference to the norm's node and rebuilt in the
  backward from the norm's own ``x`` and ``r`` (``weight * (x * r)``, the forward's
  operations: the same floats) [OURS]; what it saves on SmolLM2 is in docs/results.md
  ("Peak memory, where it goes").

[OURS] The trade of fused SwiGLU / RMSNorm kernels (e.g. Liger-Kernel's), not gradient
checkpointing: no matmul is redone. The backwards call the ATen operations autograd calls, on
the same operands, in its order: ``nn.Linear`` without bias on a 3-D input (``mm`` on the
flattened rows, the weight's gradient as the transpose of ``input^T @ grad``), SiLU
(``silu_backward``), and RMSNorm's chain (mul, rsqrt ``-0.5 * grad * r^3``, mean, pow). The
norm hands back the two gradients of its input on two edges (the input passed twice), so that
autograd adds them to the residual stream's gradient in the order it does for the module:
outputs and every gradient equal the modules' own bit for bit (tests/train/test_lean.py,
scripts/golden_runs.py).

:func:`lean_activations` switches the modules whose ``forward`` is transformers' Llama form
(compared by source) for the duration of a block: the training forward of
``completion_logprobs``, with gradient, without autocast, in fp32 for the norm.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["lean_activations", "lean_modules"]

F = torch.nn.functional


class _GatedMLP(torch.autograd.Function):
    """``down(silu(x @ Wg^T) * (x @ Wu^T))``, keeping x, the gate and the up outputs, or
    only x with ``recompute`` (the two projections run again in the backward)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, recompute):  # x [..., H]; W [I, H], [I, H], [H, I]
        gate = F.linear(x, w_gate)  # [..., I]
        up = F.linear(x, w_up)  # [..., I]
        out = F.linear(F.silu(gate) * up, w_down)  # [..., H]
        ctx.recompute = recompute
        kept = () if recompute else (gate, up)
        ctx.save_for_backward(x, w_gate, w_up, w_down, *kept)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down, *kept = ctx.saved_tensors
        # the forward's own calls on the same operands: the same floats
        gate, up = (F.linear(x, w_gate), F.linear(x, w_up)) if ctx.recompute else kept
        i, h = gate.shape[-1], x.shape[-1]
        gate2, up2, x2 = gate.reshape(-1, i), up.reshape(-1, i), x.reshape(-1, h)  # [M, .]
        act = F.silu(gate2)  # [M, I] recomputed
        grad2 = grad_out.reshape(-1, h)  # [M, H]
        need_x, need_g, need_u, need_d, _ = ctx.needs_input_grad
        grad_prod = grad2.mm(w_down)  # [M, I] d out / d (silu(g) * u)
        grad_up = grad_prod * act
        grad_gate = torch.ops.aten.silu_backward(grad_prod * up2, gate2)
        grad_x = grad_gate.mm(w_gate) + grad_up.mm(w_up) if need_x else None
        return (
            None if grad_x is None else grad_x.view(x.shape),
            x2.t().mm(grad_gate).t() if need_g else None,
            x2.t().mm(grad_up).t() if need_u else None,
            (act * up2).t().mm(grad2).t() if need_d else None,
            None,
        )


class _RMSNorm(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x²) + eps))``, keeping x and the rsqrt; x is passed twice
    (``x_pow``: its gradient through ``mean(x²)``, on a second edge, as autograd's)."""

    @staticmethod
    def forward(ctx, x, x_pow, weight, eps):  # x [..., D], weight [D]
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, r, weight)
        return weight * (x * r)

    @staticmethod
    def backward(ctx, grad):
        x, r, weight = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[2]:
            dims = tuple(range(grad.dim() - 1))
            grad_w = (grad * (x * r)).sum(dims, keepdim=True).view(weight.shape)
        grad_n = grad * weight
        grad_r = (grad_n * x).sum(-1, keepdim=True)  # [..., 1]
        grad_sq = (-0.5 * grad_r * r.pow(3)).expand(x.shape) / x.shape[-1]
        return grad_n * r, grad_sq * (2 * x.pow(1)), grad_w, None


@functools.cache
def _llama_sources() -> dict[str, str]:
    """The source of transformers' LlamaMLP / LlamaRMSNorm ``forward`` (empty without them)."""
    try:
        from transformers.models.llama import modeling_llama as llama
    except ImportError:
        return {}
    return {kind: _source(cls.forward) for kind, cls in
            (("mlp", llama.LlamaMLP), ("norm", llama.LlamaRMSNorm))}  # fmt: skip


@functools.cache
def _source(fn: Callable) -> str:
    try:
        return inspect.getsource(fn).strip()
    except (OSError, TypeError):
        return ""


def _kind(module: torch.nn.Module) -> str | None:
    """``"mlp"`` / ``"norm"`` when the module's forward is transformers' Llama form (and its
    layers are the plain ones that form assumes), else None."""
    sources = _llama_sources()
    src = _source(type(module).forward) if sources else ""
    if src and src == sources.get("mlp"):
        layers = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        act = getattr(module, "act_fn", None)
        plain = all(type(lin) is torch.nn.Linear and lin.bias is None for lin in layers)
        silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
        if plain and silu and len({lin.weight.dtype for lin in layers}) == 1:
            return "mlp"
    if (
        src
        and src == sources.get("norm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
    ):
        return "norm"
    return None


def lean_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's modules that :func:`lean_activations` switches."""
    return [m for m in model.modules() if _kind(m) is not None]


def _forward(
    module: torch.nn.Module, kind: str, recompute_mlp: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    plain = type(module).forward

    def mlp(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
            return plain(module, x)  # no backward, or autocast's own casts
        return _GatedMLP.apply(
            x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight,
            recompute_mlp,
        )  # fmt: skip

    def norm(x: torch.Tensor) -> torch.Tensor:
        fp32 = x.dtype == module.weight.dtype == torch.float32
        if not fp32 or not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
            return plain(module, x)
        return _RMSNorm.apply(x, x, module.weight, module.variance_epsilon)

    return mlp if kind == "mlp" else norm


class _Rebuilt:
    """A saved norm output, kept as the norm's node: the backward rebuilds the tensor (or
    the view of it that was saved) from the norm's own saved ``x`` and ``r``."""

    __slots__ = ("node", "offset", "size", "stride")

    def __init__(self, node: Any, t: torch.Tensor) -> None:
        self.node, self.size, self.stride, self.offset = (
            node,
            t.size(),
            t.stride(),
            t.storage_offset(),
        )

    def tensor(self) -> torch.Tensor:
        x, r, weight = self.node.saved_tensors
        out = weight * (x * r)  # the forward's operations on the same operands: the same floats
        return out.as_strided(self.size, self.stride, self.offset)


def _pack(t: torch.Tensor) -> Any:
    """What autograd keeps of ``t``: a :class:`_Rebuilt` for an output of :class:`_RMSNorm`
    (the linears after a norm save its output, or a flattened view of it), else ``t``."""
    base = t if t._base is None else t._base
    node = base.grad_fn
    if type(node) is not _RMSNorm._backward_cls or not base.is_contiguous():
        return t
    if t.dtype != base.dtype or (t._base is not None and not _within(t, base)):
        return t
    return _Rebuilt(node, t)


def _within(view: torch.Tensor, base: torch.Tensor) -> bool:
    """True when ``view`` addresses only elements of the contiguous ``base``."""
    last = view.storage_offset() + sum((n - 1) * s for n, s in zip(view.size(), view.stride()))
    return view.storage_offset() >= 0 and last < base.numel()


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor() if isinstance(saved, _Rebuilt) else saved


@contextlib.contextmanager
def lean_activations(model: Any, recompute_mlp: bool = False) -> Iterator[int]:
    """Within the block, the model's Llama-form MLPs and RMSNorms keep less for the backward
    (module docstring); yields how many modules were switched. The switch is an instance
    attribute, removed on exit, also on an exception; a nested block leaves the outer one.

    ``recompute_mlp``: each MLP keeps only its input (itself a rebuilt norm output in a
    Llama layer) and runs its gate and up projections again in the backward: two of its
    three matmuls once more, for two ``[tokens, intermediate]`` tensors per layer fewer.

    A norm's output saved by the layers after it (the attention's q/k/v projections, the MLP)
    is kept as the norm's node and rebuilt in the backward (:func:`_pack`): one
    ``[tokens, hidden]`` tensor per norm fewer, for two elementwise products at each use."""
    switched = []
    for module in model.modules() if isinstance(model, torch.nn.Module) else []:
        kind = _kind(module)
        if kind is None or "forward" in vars(module):  # not ours, switched, or user-patched
            continue
        module.forward = _forward(module, kind, recompute_mlp)
        switched.append(module)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield len(switched)
    finally:
        for module in switched:
            del module.forward
