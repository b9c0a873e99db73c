"""The reference policy of the KL term, as one typed object.

Three kinds, chosen once at set-up by :func:`make_reference`:

- :class:`NoReference` when β = 0: there is no KL term and nothing is computed;
- :class:`FrozenCopy`: a frozen deep copy of the initial policy (full fine-tuning), as TRL's
  ``ref_model`` and verl's ``ref`` worker;
- :class:`AdapterOff`: a LoRA policy with its adapter switched off, which *is* the initial
  policy without a second copy of the weights (TRL does the same with peft models).

``reference.logprobs(policy, batch)`` returns the reference log-probs ``[N, T]`` of a batch,
or None when there is no reference. They are computed by the policy
(:meth:`grouprl.train.policy.Policy.batch_logprobs`): the same kernel, micro-batches and
precision as the policy's own log-probs, so at the first step (policy = reference) the KL
is 0 up to rounding.
"""

from __future__ import annotations

import copy

import torch

from grouprl.train.policy import Policy, Sequences

__all__ = ["AdapterOff", "FrozenCopy", "NoReference", "Reference", "make_reference"]


class Reference:
    """Base class: the reference policy's log-probs of a batch, or None (no KL term)."""

    kind: str = "none"

    def logprobs(self, policy: Policy, batch: Sequences) -> torch.Tensor | None:
        raise NotImplementedError


class NoReference(Reference):
    """β = 0: no KL term, no reference forward."""

    kind = "none"

    def logprobs(self, policy: Policy, batch: Sequences) -> None:
        return None


class FrozenCopy(Reference):
    """A frozen copy of the initial policy (eval mode, no gradient), on the policy's device."""

    kind = "frozen-copy"

    def __init__(self, policy: torch.nn.Module) -> None:
        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def logprobs(self, policy: Policy, batch: Sequences) -> torch.Tensor:
        return policy.batch_logprobs(batch, model=self.model).logp


class AdapterOff(Reference):
    """The LoRA policy with its adapter disabled (peft ``disable_adapter``): the base model."""

    kind = "adapter-off"

    def logprobs(self, policy: Policy, batch: Sequences) -> torch.Tensor:
        with policy.model.disable_adapter():
            return policy.batch_logprobs(batch).logp


def make_reference(policy: torch.nn.Module, *, beta: float, lora: bool) -> Reference:
    """The reference for a run: none when β ≤ 0, the adapter switched off under LoRA, else a copy."""
    if beta <= 0:
        return NoReference()
    return AdapterOff() if lora else FrozenCopy(policy)
