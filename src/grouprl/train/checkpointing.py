"""Activation checkpointing of the training forward: keep each decoder layer's input, not its
activations, and run the layer again during the backward.

``optim.activation_checkpointing``: the training forward of a micro-batch then holds one
``[B, L, d]`` hidden state per layer instead of every layer's attention and MLP intermediates,
at the price of a second forward of each layer in the backward (torch.utils.checkpoint,
``use_reentrant=False``). The policy runs in eval mode (no dropout), so the recomputed
activations, hence the gradients, are the same floats (a KV cache the layer appends to is
put back before its recomputation: ``_checkpointed``). transformers' own
``gradient_checkpointing_enable`` acts only in train mode, so the layers are wrapped here
[OURS]; where grad is off (sampling, the reference, the behaviour log-probs) a wrapped layer
runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["LAYER_SUFFIXES", "checkpoint_layers"]

LAYER_SUFFIXES = ("DecoderLayer", "Block")
"""Class-name endings of the repeated transformer layers (``LlamaDecoderLayer``,
``GPT2Block``, ...): the modules :func:`checkpoint_layers` wraps."""


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(LAYER_SUFFIXES)]


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Wrap every decoder layer of ``model`` (in place) so that, where grad is enabled, its
    forward runs under ``torch.utils.checkpoint``; returns how many were wrapped. A model with
    no such layer is a ``ValueError`` naming what to turn off."""
    layers = _layers(model)
    if not layers:
        raise ValueError(
            f"optim.activation_checkpointing: no decoder layer found in {type(model).__name__} "
            f"(a module whose class name ends with {' or '.join(LAYER_SUFFIXES)}); set "
            "optim.activation_checkpointing=false"
        )
    for layer in layers:
        if getattr(layer, "_grouprl_checkpointed", False):
            continue
        layer.forward = _checkpointed(layer, layer.forward, _layer_index(layer))
        layer._grouprl_checkpointed = True
    return len(layers)


def _layer_index(layer: torch.nn.Module) -> int | None:
    """The ``layer_idx`` under which the layer's attention keeps its keys and values in a
    transformers ``Cache`` (None when no submodule says)."""
    for m in layer.modules():
        if isinstance(getattr(m, "layer_idx", None), int):
            return m.layer_idx
    return None


def _checkpointed(layer: torch.nn.Module, forward: Any, index: int | None) -> Any:
    """``forward`` under ``torch.utils.checkpoint`` where grad is enabled; the recomputation
    runs in the state the forward ran in (:func:`_snapshot`, :func:`_reenter`)."""

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        if cache is not None and getattr(cache, "layers", None) is None:
            return forward(*args, **kwargs)  # a cache we cannot put back: as it is

        def contexts() -> tuple[Any, Any]:  # called as the forward runs
            return contextlib.nullcontext(), _reenter(*_snapshot(layer, cache, index))

        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return wrapped


def _snapshot(layer: torch.nn.Module, cache: Any, index: int | None) -> tuple[dict, dict, dict]:
    """What the layer's forward depends on besides its inputs, as it runs:
    - the instance ``forward`` of its submodules (``train.lean.lean_activations`` switches
      MLPs and norms within the training forward only);
    - each config's attention kernel (``rollout.hf.gqa_attention`` switches it likewise);
    - the KV cache entry it appends to (the prefill shared by a group's completions,
      ``train.logprobs``), shallow: the tensors as they are before the append."""
    subs = [m for m in layer.modules() if m is not layer]
    forwards = {m: vars(m)["forward"] for m in subs if "forward" in vars(m)}
    configs = {}
    for m in subs:
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = (config, config._attn_implementation)
    entries = getattr(cache, "layers", None) or []
    which = [index] if index is not None and index < len(entries) else range(len(entries))
    return forwards, configs, {id(entries[i]): (entries[i], dict(vars(entries[i]))) for i in which}


@contextlib.contextmanager
def _reenter(forwards: dict, configs: dict, entries: dict) -> Iterator[None]:
    """The recomputation's context: the forwards and attention kernels set as they were
    (and restored after), the cache entries put back, so that the layer appends the same
    keys and values to the same prefix."""
    for _, (entry, state) in entries.items():
        vars(entry).clear()
        vars(entry).update(state)
    set_here = [m for m in forwards if "forward" not in vars(m)]
    for m in set_here:
        m.forward = forwards[m]
    old = {k: c._attn_implementation for k, (c, _) in configs.items()}
    for c, impl in configs.values():
        c._attn_implementation = impl
    try:
        yield
    finally:
        for m in set_here:
            del m.forward
        for k, (c, _) in configs.items():
            c._attn_implementation = old[k]
