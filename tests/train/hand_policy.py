"""A policy small enough to train by hand, and the hand-derived update it must receive.

The known-answer step tests (``test_step_*.py``) train this policy for one step through the
public entry point ``grouprl.train.loop.train(cfg, model=, tokenizer=, task=)`` and compare
every parameter with the update derived here, in plain float64 Python, from the completions
the task's verifier saw.

**The policy.** Vocabulary ``<eos> a b q z n`` (ids 0-5; ``<eos>`` is also the padding). At
every position, whatever the context, the logits are ``(θ_eos, θ_a, θ_b, −1e4, −1e4, −1e4)``:
the three parameters θ are the whole model, and ``q``, ``z``, ``n`` (prompt words) are never sampled
(``exp(−1e4)`` is 0 in float32). A completion is a run of i.i.d. draws from
``π = softmax(θ / τ)`` until ``<eos>`` or the length limit, so at log-prob temperature 1

    log π(y) = θ_y − log Σ_v exp θ_v,        ∂ log π(y) / ∂θ = e_y − π            (1)

for every token y of every completion (e_y: the one-hot of y over the three parameters).

**Poison.** Outside generation (which runs under ``torch.inference_mode``), a row whose
context holds the word ``z`` gets NaN logits (a non-finite loss); while gradients are on, a
row that holds ``n`` gets finite logits whose gradient is NaN (a finite loss with a
non-finite gradient): a prompt ``z`` or ``n`` poisons a step on command.

**The update** (:func:`expected_update`): per token, the policy-gradient term of the PPO
clip surrogate ``ℓ = −min(ρA, clip(ρ, 1−ε_lo, 1+ε_hi)A)`` with ρ = π_θ(y)/π_old(y) has

    ∂ℓ/∂θ = −A·ρ·(e_y − π)  unless the clip is active (A > 0, ρ > 1+ε_hi or
                                                      A < 0, ρ < 1−ε_lo), then 0   (2)

and the KL term β·w·KL has ``β·w·(e_y − π)`` (k1 = log π − log π_ref) or
``β·w·(1 − π_ref(y)/π(y))·(e_y − π)`` (k3 = π_ref/π − log(π_ref/π) − 1). The aggregation
weighs each token: ``token_mean`` by 1/M (M the minibatch's kept tokens),
``seq_mean_token_mean`` by 1/(S·L_i) (S its kept sequences, L_i the row's length),
``seq_mean_token_sum_norm`` by 1/(S·L_max) (L_max the generation limit). Then the
global-norm clip ``g ← g·min(1, c/(‖g‖ + 1e-6))`` (torch's ``clip_grad_norm_``) and AdamW:
with m ← β₁m + (1−β₁)g, v ← β₂v + (1−β₂)g², t the step count,

    θ ← θ(1 − lr·wd) − lr · (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + eps)                      (3)

so the first step is ``−lr·g/(|g| + eps)`` per parameter: with eps = 1 (the tests' setting)
the update keeps the gradient's size, where the default 1e-8 would keep only its sign.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from grouprl.tasks.base import Example, Task

VOCAB = ("<eos>", "a", "b", "q", "z", "n")
EOS, A, B, Q, Z, NAN_GRAD = range(6)
LEARNED = 3
"""θ holds the logits of <eos>, a, b."""


class HandTokenizer:
    """Words to ids and back; ``<eos>`` is the end and the padding."""

    eos_token_id = EOS
    pad_token_id = EOS

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [VOCAB.index(w) for w in text.split()]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


class _Cache:
    """The KV cache generation asks for; the policy has no context to keep."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        return None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        return None


class HandPolicy(torch.nn.Module):
    """Logits ``(θ_eos, θ_a, θ_b, −1e4, −1e4, −1e4)`` at every position (module docstring)."""

    def __init__(self, theta: Sequence[float] = (-0.5, 0.3, 0.0)) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(theta, dtype=torch.float32))
        self.register_buffer("fixed", torch.full((len(VOCAB) - LEARNED,), -1e4))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> SimpleNamespace:
        n, length = input_ids.shape
        row = torch.cat([self.theta, self.fixed])  # [V]
        logits = row.expand(n, length, len(VOCAB))  # [N, L, V]
        if not torch.is_inference_mode_enabled():  # not generation (hf.generate)
            poisoned = (input_ids == Z).any(-1)[:, None, None]  # [N, 1, 1]
            logits = torch.where(poisoned, torch.full_like(logits, math.nan), logits)
        if torch.is_grad_enabled():
            nan_grad = (input_ids == NAN_GRAD).any(-1)[:, None, None]  # [N, 1, 1]
            if nan_grad.any():  # sqrt(0·θ) is 0 and its gradient 0·∞ = NaN
                zero = torch.sqrt(self.theta[:1] * 0.0)
                logits = logits + torch.where(nan_grad, zero, torch.zeros_like(zero))
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        cache = (past_key_values or _Cache()) if use_cache else None
        return SimpleNamespace(logits=logits, past_key_values=cache)


@dataclass(frozen=True)
class Call:
    """One verifier call: the example it scored, the completion, the reward returned."""

    example_id: str
    table: str
    text: str
    reward: float


class HandTask(Task):
    """Prompts and rewards the test chooses; the verifier records every call in order.

    ``tables``: table name -> reward of a completion's words (e.g. ``first == "a"``);
    ``plan(split, seed, i) -> (prompt word, table name)`` chooses example ``i`` of a draw
    (default: prompt ``q`` and the first table). The trainer's train stream of (run seed s,
    step t, round r) is drawn with seed ``(s·1000003 + t)·64 + r`` (``train.prompts``):
    :func:`step_round` reads it back.
    """

    name = "hand"

    def __init__(
        self,
        tables: dict[str, Callable[[list[str]], float]],
        plan: Callable[[str, int, int], tuple[str, str]] | None = None,
        reward_range: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        self.tables = tables
        self.plan = plan or (lambda split, seed, i: ("q", next(iter(tables))))
        self.reward_range = reward_range
        self.config: dict[str, Any] = {}
        self.calls: list[Call] = []

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        out = []
        for i in range(n):
            prompt, table = self.plan(split, seed, i)
            ex_id = f"hand/{split}/{seed}/{i}"
            out.append(Example(ex_id, prompt, (table, ex_id)))
        return out

    def verify(self, completion: str, reference: Any) -> float:
        table, example_id = reference
        reward = float(self.tables[table](completion.split()))
        self.calls.append(Call(example_id, table, completion, reward))
        return reward

    def render(self, example: Example, tokenizer: Any) -> str:
        return example.prompt


def step_round(seed: int, run_seed: int = 0) -> tuple[int, int]:
    """(step, round) of a train draw's seed (``train.prompts.prompt_seed`` inverted)."""
    base, round_ = divmod(seed, 64)
    return base - run_seed * 1_000_003, round_


def first_is(word: str, value: float = 1.0, other: float = 0.0, empty: float = 0.0):
    """A reward table: ``value`` when the completion starts with ``word``, ``empty`` for the
    empty completion (``<eos>`` first), ``other`` else."""

    def table(words: list[str]) -> float:
        if not words:
            return empty
        return value if words[0] == word else other

    return table


# ---- the hand-derived update ------------------------------------------------------------


def softmax(theta: Sequence[float], temperature: float = 1.0) -> list[float]:
    """π over the learned tokens (<eos>, a, b); q and z have probability 0 (exp(−1e4))."""
    z = [t / temperature for t in theta]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    s = sum(e)
    return [x / s for x in e]


def log_prob(theta: Sequence[float], token: int, temperature: float = 1.0) -> float:
    return math.log(softmax(theta, temperature)[token])


def completion_tokens(text: str, max_new_tokens: int) -> list[int]:
    """The sampled ids of a decoded completion: its words, then <eos> unless it hit the limit."""
    ids = [VOCAB.index(w) for w in text.split()]
    return ids if len(ids) == max_new_tokens else [*ids, EOS]


def grpo_advantages(rewards: Sequence[float], eps: float = 1e-6, tau: float = 1e-6) -> list:
    """GRPO per group: (r − mean)/(std + eps) over the valid (non-NaN) rewards, std with
    ddof 1; 0 at NaN rewards and in a group whose std < tau or with fewer than 2 rewards."""
    valid = [r for r in rewards if not math.isnan(r)]
    if len(valid) < 2:
        return [0.0] * len(rewards)
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
    if std < tau:
        return [0.0] * len(rewards)
    return [0.0 if math.isnan(r) else (r - mean) / (std + eps) for r in rewards]


def group_std(rewards: Sequence[float]) -> float:
    """The std (ddof 1) of a group's valid rewards; NaN with fewer than 2."""
    valid = [r for r in rewards if not math.isnan(r)]
    if len(valid) < 2:
        return math.nan
    mean = sum(valid) / len(valid)
    return math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))


@dataclass
class Row:
    """One sequence of the update: its tokens (the loss mask's tokens), advantage, the
    behaviour policy's θ, and its clip bounds and KL weight."""

    tokens: list[int]
    adv: float
    old_theta: Sequence[float]
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_weight: float = 1.0


@dataclass
class AdamW:
    """torch.optim.AdamW's update (3), one parameter vector, in float64."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0
    weight_decay: float = 0.0
    t: int = 0
    m: list[float] = field(default_factory=lambda: [0.0] * LEARNED)
    v: list[float] = field(default_factory=lambda: [0.0] * LEARNED)

    def step(self, theta: list[float], g: Sequence[float]) -> list[float]:
        b1, b2 = self.betas
        self.t += 1
        self.m = [b1 * m + (1 - b1) * x for m, x in zip(self.m, g)]
        self.v = [b2 * v + (1 - b2) * x * x for v, x in zip(self.v, g)]
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        return [
            th * (1 - self.lr * self.weight_decay)
            - self.lr * (m / c1) / (math.sqrt(v / c2) + self.eps)
            for th, m, v in zip(theta, self.m, self.v)
        ]


def gradient(
    theta: Sequence[float],
    rows: Sequence[Row],
    *,
    aggregation: str,
    beta: float = 0.0,
    kl: str = "k3",
    ref_theta: Sequence[float] | None = None,
    temperature: float = 1.0,
    max_len: int = 0,
    kl_correction: str | None = None,
) -> list[float]:
    """∇θ of one minibatch's loss, from (1) and (2); ``rows`` are its kept rows; ``max_len``
    is L_max of ``seq_mean_token_sum_norm``.

    ``kl_correction`` (``algorithm.kl_correction``): ``ratio`` makes the KL term ρ·KL, whose
    ∂/∂ log π is ρ·(KL + ∂KL/∂ log π); ``straight_through`` keeps the KL's value with the
    gradient of min(ρ, 10)·k2, i.e. min(ρ, 10)·(log π − log π_ref)."""
    p = softmax(theta, temperature)
    tokens = sum(len(r.tokens) for r in rows)
    seqs = sum(1 for r in rows if r.tokens)
    g = [0.0] * LEARNED
    for r in rows:
        if aggregation == "token_mean":
            weight = 1 / tokens
        elif aggregation == "seq_mean_token_mean":
            weight = 1 / (seqs * len(r.tokens))
        elif aggregation == "seq_mean_token_sum_norm":
            weight = 1 / (seqs * max_len)
        else:
            raise ValueError(f"no hand derivation for the aggregation {aggregation!r}")
        for y in r.tokens:
            rho = math.exp(log_prob(theta, y, temperature) - log_prob(r.old_theta, y, temperature))
            clipped = (r.adv > 0 and rho > 1 + r.eps_high) or (r.adv < 0 and rho < 1 - r.eps_low)
            coeff = 0.0 if clipped else -r.adv * rho  # ∂ℓ/∂ log π(y), (2)
            if beta > 0:
                coeff += beta * r.kl_weight * _kl_slope(
                    log_prob(theta, y, temperature), log_prob(ref_theta, y, temperature),
                    kl, kl_correction, rho,
                )  # fmt: skip
            for k in range(LEARNED):
                g[k] += weight * coeff * ((k == y) - p[k]) / temperature
    return g


def _kl_slope(lp: float, ref: float, kl: str, correction: str | None, rho: float) -> float:
    """∂/∂ log π of one token's KL term (k1 = log π − log π_ref; k3 = u − log u − 1 with
    u = π_ref/π, whose derivative is 1 − u), under the correction."""
    value, slope = (
        (lp - ref, 1.0)
        if kl == "k1"
        else (math.exp(ref - lp) - (ref - lp) - 1, 1 - math.exp(ref - lp))
    )
    if correction == "ratio":
        return rho * (value + slope)
    if correction == "straight_through":
        return min(rho, 10.0) * (lp - ref)
    return slope


def clip_norm(g: Sequence[float], max_norm: float) -> tuple[list[float], float]:
    """torch's ``clip_grad_norm_``: g·min(1, max_norm/(‖g‖ + 1e-6)), and ‖g‖."""
    norm = math.sqrt(sum(x * x for x in g))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return [x * coef for x in g], norm


def expected_update(
    theta: Sequence[float],
    minibatches: Sequence[Sequence[Row]],
    *,
    aggregation: str,
    opt: AdamW,
    grad_clip: float = 0.0,
    **loss: Any,
) -> tuple[list[float], list[float]]:
    """θ after one AdamW step per minibatch, in order, and each step's gradient norm."""
    theta = list(theta)
    norms = []
    for rows in minibatches:
        g = gradient(theta, rows, aggregation=aggregation, **loss)
        g, norm = clip_norm(g, grad_clip if grad_clip > 0 else math.inf)
        norms.append(norm)
        theta = opt.step(theta, g)
    return theta, norms


def groups(calls: Sequence[Call], g: int) -> list[list[Call]]:
    """Verifier calls in order, as groups of ``g`` (prompt-major, as the trainer scores)."""
    return [list(calls[i : i + g]) for i in range(0, len(calls), g)]


# ---- running one step ----------------------------------------------------------------------

BASE = [
    "sampling.prompts_per_step=2",
    "sampling.group_size=4",
    "sampling.max_new_tokens=1",
    "sampling.verify_timeout_s=0",
    "optim.steps=1",
    "optim.lr=0.1",
    "optim.eps=1.0",
    "optim.grad_clip=0",
    "optim.fused=false",
    "eval.every=0",
    "run.every=0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
    "run.save_final=false",
]
"""Overrides of every step test: 2 prompts × 4 completions of one token, lr 0.1, AdamW eps 1
(the update keeps the gradient's size, (3)), no gradient clip unless a test sets one."""


def train_hand(tmp_path, task: HandTask, *overrides: str, theta=(-0.5, 0.3, 0.0)):
    """``train()`` on the hand policy with ``BASE`` + ``overrides``; (result, policy, θ₀)."""
    from grouprl.train.config import load_config
    from grouprl.train.loop import train

    cfg = load_config(None, [*BASE, f"run.out={tmp_path}", *overrides], validate=False)
    policy = HandPolicy(theta)
    result = train(cfg, model=policy, tokenizer=HandTokenizer(), task=task)
    return result, policy, list(theta)


def theta_of(policy: HandPolicy) -> list[float]:
    return [float(x) for x in policy.theta.detach()]
