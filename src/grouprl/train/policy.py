"""The policy being trained, as one object: how it samples and how it computes log-probs.

A :class:`Policy` holds the model, its tokenizer, the precision every pass runs under and
the sizes of its log-prob passes (micro-batch, vocabulary chunk). Every pass of a step goes
through it, so all of them run under the same precision:

- :meth:`Policy.generate`: rollouts, with the behaviour log-probs of the sampled tokens kept
  at sampling time (``grouprl.rollout.hf.generate``);
- :meth:`Policy.logprobs`: one forward of some rows of a batch, with gradient when the
  caller enables it (the training forward of a micro-batch);
- :meth:`Policy.batch_logprobs`: a whole batch without gradient, in micro-batches (the
  reference's log-probs with the reference's weights, AGPO's entropy and drift passes).

All log-prob passes call :func:`grouprl.train.logprobs.completion_logprobs`, the kernel.

**Precision** (:data:`PRECISIONS`): ``"none"`` computes in the weights' own dtype;
``"bfloat16"`` runs every forward under ``torch.autocast(device, bfloat16)`` while the
weights, gradients and AdamW state stay in their dtype (mixed precision with master
weights, as TRL's ``bf16=True`` through accelerate and verl's FSDP mixed precision). Since
generation, the training forward and the reference all use the same precision, the first
optimizer step is on-policy: its ratio is 1 and its KL to the reference 0, up to the
rounding of two different computations of the same numbers (tests/train/test_policy.py).
Each method takes ``precision=`` to override the policy's own for one call (None = the
policy's): a rollout engine that samples at another precision than the trainer's is that
override on :meth:`generate`, or ``rollout_precision`` (``model.rollout_precision``), which
:meth:`generate` uses by default. With it, the rollouts' log-probs are the *engine's*
(π_rollout) and no longer the trainer's: :attr:`Policy.matched` is False and the step
recomputes the behaviour log-probs at ``precision`` (ALGORITHMS.md §3c).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from grouprl.rollout import hf
from grouprl.train import malloc
from grouprl.train.logprobs import TokenLogProbs, completion_logprobs
from grouprl.types import Rollouts

__all__ = ["PRECISIONS", "Policy", "Sequences"]

PRECISIONS: dict[str, torch.dtype | None] = {
    "none": None,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
"""A precision's name -> the autocast dtype of every forward (None: no autocast, the
weights' dtype); the names ``model.autocast`` accepts."""


class Sequences(Protocol):
    """What a log-prob pass reads of a batch (``grouprl.train.batch.Batch`` is one)."""

    prompt_ids: torch.Tensor  # [N, Tp] left-padded
    prompt_mask: torch.Tensor  # [N, Tp]
    completion_ids: torch.Tensor  # [N, T] right-padded
    mask: torch.Tensor  # [N, T]
    temperature: float  # of every log-prob taken on these sequences
    group_size: int  # G: rows p·G .. p·G+G-1 share a prompt
    # optional ``kept_ids`` [N, T, K]: the sampler's kept sets; every pass then reads the
    # truncated, renormalised distribution (sampling.logprob_support=truncated)


@dataclass
class Policy:
    """The model being trained and how it computes: one precision for every pass.

    Attributes:
        model: a causal LM (transformers, or any module ``completion_logprobs`` accepts).
        tokenizer: its tokenizer.
        precision: a :data:`PRECISIONS` name (``model.autocast``).
        micro_batch_size: sequences per forward of :meth:`batch_logprobs`; 0 = the whole
            batch at once (``optim.micro_batch_size``).
        logprob_chunk: tokens per vocabulary projection block (``optim.logprob_chunk``).
        recompute: what the training forward recomputes in the backward instead of keeping
            it (``optim.recompute``: ``"head"``, ``"mlp"``).
    """

    model: torch.nn.Module
    tokenizer: Any
    precision: str = "none"
    micro_batch_size: int = 0
    logprob_chunk: int = 2048
    recompute: tuple[str, ...] = ()
    rollout_precision: str | None = None
    """The precision of :meth:`generate` (the rollout engine); None = ``precision``."""

    def __post_init__(self) -> None:
        self._check(self.precision)
        if self.rollout_precision is not None:
            self._check(self.rollout_precision)

    @property
    def matched(self) -> bool:
        """True when rollouts are sampled at the training precision: their log-probs are the
        trainer's own, and the first update on them is on-policy."""
        if self.rollout_precision is None:
            return True
        return PRECISIONS[self.rollout_precision] == PRECISIONS[self.precision]

    @staticmethod
    def _check(precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)} (model.autocast)"
            )

    @property
    def device(self) -> torch.device:
        """Where the policy lives; every tensor of a step is created there."""
        return next(self.model.parameters()).device

    def autocast(self, precision: str | None = None) -> contextlib.AbstractContextManager:
        """The context every forward runs in: autocast to the precision's dtype, or nothing.

        ``precision``: None = the policy's own.
        """
        name = self.precision if precision is None else precision
        self._check(name)
        dtype = PRECISIONS[name]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def generate(
        self,
        prompts: list[str],
        group_size: int,
        sampling: hf.Sampling,
        generator: torch.Generator | None,
        *,
        temperatures: torch.Tensor | None = None,
        precision: str | None = None,
    ) -> Rollouts:
        """``group_size`` completions per prompt (``hf.generate``) under the precision
        (``precision``, else ``rollout_precision``, else the policy's).

        The rollouts' ``old_logp`` are the sampler's own log-probs of the drawn tokens, taken
        while sampling; ``temperatures``: ``[P]`` per-prompt sampling temperatures.
        """
        with self.autocast(precision if precision is not None else self.rollout_precision):
            return hf.generate(
                self.model, self.tokenizer, prompts, group_size, sampling, generator,
                temperatures=temperatures,
            )  # fmt: skip

    def logprobs(
        self,
        seqs: Sequences,
        rows: torch.Tensor | None = None,
        *,
        entropy: bool = False,
        model: torch.nn.Module | None = None,
        precision: str | None = None,
        sum_pi_squared: bool = False,
    ) -> TokenLogProbs:
        """Log-probs ``[n, T]`` of sequences ``rows`` (all when None) in one forward.

        With gradient when the caller's grad mode is on (the training forward); ``model``:
        other weights computed the same way (the frozen reference), default the policy's.
        When ``seqs`` carries the sampler's kept sets (``kept_ids``, not None), every pass,
        the reference's included, reads the distribution renormalised over them.
        """
        m = slice(None) if rows is None else rows
        kept = getattr(seqs, "kept_ids", None)
        grad = torch.is_grad_enabled()
        if grad:  # the training forward: free heap pages not resident
            malloc.release_free_memory()
        with self.autocast(precision):
            return completion_logprobs(
                model or self.model, seqs.prompt_ids[m], seqs.prompt_mask[m],
                seqs.completion_ids[m], seqs.mask[m], temperature=seqs.temperature,
                group_size=seqs.group_size, chunk=self.logprob_chunk, entropy=entropy,
                sum_pi_squared=sum_pi_squared, kept_ids=None if kept is None else kept[m],
                recompute=True if grad and "head" in self.recompute else None,
                recompute_mlp=grad and "mlp" in self.recompute,
            )  # fmt: skip

    @torch.no_grad()
    def batch_logprobs(
        self,
        seqs: Sequences,
        *,
        entropy: bool = False,
        model: torch.nn.Module | None = None,
        precision: str | None = None,
        sum_pi_squared: bool = False,
    ) -> TokenLogProbs:
        """Log-probs ``[N, T]`` (and entropies, Σπ²) of every sequence, no gradient, in
        micro-batches of ``micro_batch_size`` sequences."""
        n = seqs.completion_ids.shape[0]
        parts = [
            self.logprobs(
                seqs,
                m,
                entropy=entropy,
                model=model,
                precision=precision,
                sum_pi_squared=sum_pi_squared,
            )
            for m in torch.arange(n, device=seqs.completion_ids.device).split(
                self.micro_batch_size or n
            )
        ]
        return TokenLogProbs(
            torch.cat([p.logp for p in parts]),
            torch.cat([p.entropy for p in parts]) if entropy else None,
            torch.cat([p.sum_pi_squared for p in parts]) if sum_pi_squared else None,
        )
