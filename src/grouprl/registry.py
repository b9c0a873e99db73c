"""One registration pattern for every axis: a method is a function and its declaration.

    from grouprl.advantages import register_estimator

    @register_estimator("my_adv", reads={"lengths"}, sources={"eps": "my paper §3"})
    def my_adv(rewards, valid, *, lengths=None, eps=1e-6): ...

Every axis (estimators, token estimators, reward combinations, transforms, surrogates,
aggregations, KL estimators, rollout corrections, presets) is an :class:`Axis` over the
package's public table (``advantages.ESTIMATORS``, ``losses.SURROGATES``,
``presets.PRESETS``, ...): registering writes the function into that table and its :class:`Declaration` beside it, so validation,
``grouprl list``, the trainer, the resume guard (``algorithm.overrides`` holds every setting)
and the TRL and verl adapters all read one source. A declaration says

- ``reads``: what the method needs beyond the rewards, as names of :data:`INPUTS`; the trainer
  provides each input by its name (``train/inputs.py``) and never asks which method it serves;
- ``settings``: the keyword parameters of the function with their defaults, types and sources
  (:class:`Setting`, derived from the signature; ``sources=`` cites where a default comes from).

A name that collides with a built-in, a function whose signature does not fit its axis, or a
declared input this axis cannot be given is a ``RegistrationError`` naming the fix, raised at
registration. Plugins (``grouprl.plugins``) are files or installed modules that call these
functions; :func:`on_register` lets an adapter follow later registrations (verl's registry).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "AXES",
    "INPUTS",
    "Axis",
    "Declaration",
    "RegistrationError",
    "Setting",
    "on_register",
]

INPUTS: dict[str, str] = {
    # -- the advantage side: [P, G] per group and sample unless said
    "lengths": "completion tokens per sample [P, G]",
    "baseline": "the reward of one greedy completion per prompt [P] (one extra generation)",
    "reward_parts": "each reward function's rewards [P, G, K] and their weights",
    "verifier_rewards": "the verifier's rewards before any shaping [P, G] (overlong penalty)",
    "draw_weights": "the prompt sampler's importance weight of each group's draw [P]",
    "trigger": "the run's virtual-sample trigger (state advanced once per step)",
    "old_logp": "the behaviour log-probs at every completion token [P, G, T]",
    "sum_pi_squared": "Σ_v π(v)² of the behaviour policy at every completion token [P, G, T]",
    # -- the loss side
    "entropy": "the current policy's token entropies [m, T] of each micro-batch",
    "step_selection": "a token selection over the optimizer step's whole minibatch, made by "
    "the declaration's select= from one no-grad forward before the first backward",
    "current_logp": "the current policy's log-probs (a rollout correction computed per "
    "micro-batch inside the loss, against the rollout engine's log-probs)",
    "train_logp": "the trainer's log-probs of the batch [N, T] (a rollout correction)",
    "rollout_logp": "the rollout engine's log-probs of the batch [N, T] (a rollout correction)",
}
"""Input name -> what the trainer provides under that name (``train/inputs.py`` provides
each one; ``tests/train/test_inputs.py`` holds the two lists equal)."""


class RegistrationError(ValueError):
    """A method cannot be registered as declared (the message says what to change)."""


@dataclass(frozen=True)
class Setting:
    """One typed setting of a method: a keyword parameter, its default and its source."""

    name: str
    default: Any
    type: str = ""
    """The annotation as written (``"float"``, ``"int | None"``), or ``""``."""
    source: str = ""
    """Where the default comes from (a paper section, a peer's file:line), or ``""``."""


@dataclass(frozen=True)
class Declaration:
    """A registered method: ``fn`` and what it reads and takes."""

    axis: str
    name: str
    fn: Any
    reads: frozenset[str] = frozenset()
    settings: tuple[Setting, ...] = ()
    builtin: bool = False
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Axis-specific facts (a surrogate's ``select`` and ``zero_at_zero_advantage``...)."""

    def setting_names(self) -> list[str]:
        return [s.name for s in self.settings]


_LISTENERS: list[Callable[[Declaration], None]] = []


def on_register(callback: Callable[[Declaration], None]) -> None:
    """Call ``callback(declaration)`` after every later registration (adapters use this)."""
    _LISTENERS.append(callback)


def _annotation(p: inspect.Parameter) -> str:
    ann = p.annotation
    if ann is inspect.Parameter.empty:
        return ""
    return ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))


def settings_of(
    fn: Callable, skip: Iterable[str] = (), sources: Mapping[str, str] | None = None
) -> tuple[Setting, ...]:
    """The keyword parameters of ``fn`` with a default, minus ``skip`` (its inputs)."""
    sources, skip = dict(sources or {}), set(skip)
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in skip or p.default is inspect.Parameter.empty:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append(Setting(p.name, p.default, _annotation(p), sources.pop(p.name, "")))
    if sources:
        raise RegistrationError(
            f"sources= names {sorted(sources)}, which are not settings of {fn.__name__} "
            f"(keyword parameters with a default: {[s.name for s in out] or 'none'}); "
            "cite only the function's own settings"
        )
    return tuple(out)


class Axis:
    """One axis of methods over its public table ``table`` (name -> function).

    Args:
        name: what a method of this axis is called in messages (``"estimator"``).
        table: the package's public dict; registration writes into it.
        positional: the positional parameters a function of this axis takes, in order.
        inputs: the names of :data:`INPUTS` this axis may declare in ``reads``.
        skip: keyword parameters that are inputs or call options, not settings.
        example: a one-line signature for the error messages.
    """

    def __init__(
        self,
        name: str,
        table: MutableMapping[str, Any],
        *,
        positional: tuple[str, ...] = (),
        inputs: Iterable[str] = (),
        skip: Iterable[str] = (),
        example: str = "",
        callable_: bool = True,
        keywords: Mapping[str, str | None] | None = None,
    ) -> None:
        self.keywords = dict(keywords or {})
        """Input name -> the keyword it arrives by (default: its own name; None: not a
        keyword, the input changes the call's arguments)."""
        self.name, self.table = name, table
        self.positional, self.inputs = positional, frozenset(inputs)
        self.skip, self.example, self.callable = frozenset(skip), example, callable_
        unknown = self.inputs - set(INPUTS)
        if unknown:
            raise RegistrationError(f"axis {name!r}: inputs {sorted(unknown)} not in INPUTS")
        self.declarations: dict[str, Declaration] = {}
        for key, fn in table.items():  # the built-ins: whatever the table holds now
            self.declarations[key] = Declaration(
                name, key, fn, settings=self._settings(fn, ()), builtin=True
            )
        AXES[name] = self

    def _settings(self, fn: Any, reads: Iterable[str], sources=None) -> tuple[Setting, ...]:
        if not self.callable:
            return ()
        return settings_of(fn, (*self.positional, *self.skip, *reads), sources)

    def declare(self, name: str, *, reads: Iterable[str] = (), **extra: Any) -> None:
        """Say what the built-in ``name`` reads (and its axis facts)."""
        d = self.declarations[name]
        reads = self._check_reads(name, reads)
        self.declarations[name] = Declaration(
            self.name, name, d.fn, reads, d.settings, True, MappingProxyType(dict(extra))
        )

    def _check_reads(self, name: str, reads: Iterable[str]) -> frozenset[str]:
        if isinstance(reads, str):
            reads = {reads}
        reads = frozenset(reads)
        bad = reads - self.inputs
        if bad:
            other = sorted(bad & set(INPUTS))
            hint = (
                f"; {other} exist but not for a {self.name} (another axis reads them)"
                if other
                else ""
            )
            raise RegistrationError(
                f"{self.name} {name!r} declares reads={sorted(bad)}, which the trainer cannot "
                f"provide to a {self.name}{hint}; a {self.name} may read: "
                f"{', '.join(sorted(self.inputs)) or 'nothing beyond its arguments'}"
            )
        return reads

    def _check_signature(self, name: str, fn: Any, reads: frozenset[str]) -> None:
        if not callable(fn):
            raise RegistrationError(
                f"{self.name} {name!r} must be a function {self.example}, got {type(fn).__name__}"
            )
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return  # a builtin without a signature: nothing to check
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
        required = [p for p in positional if p.default is p.empty]
        n = len(self.positional)
        if len(required) > n or (len(positional) < n and not varargs):
            raise RegistrationError(
                f"{self.name} {name!r}: {fn.__name__}{inspect.signature(fn)} does not fit the "
                f"{self.name} signature {self.example}: it must take the {n} positional "
                f"argument(s) ({', '.join(self.positional)}) and give every other parameter a "
                "default (keyword-only settings after *)"
            )
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params}
        wanted = {r: self.keywords.get(r, r) for r in reads}
        missing = sorted(
            k for k in wanted.values() if k is not None and k not in named and not takes_kwargs
        )
        if missing:
            raise RegistrationError(
                f"{self.name} {name!r} declares reads={sorted(reads)} but {fn.__name__} has no "
                f"parameter {', '.join(missing)}: add keyword parameter(s) "
                f"{', '.join(f'{m}=None' for m in missing)} (each input comes by that keyword)"
            )

    def register(
        self,
        name: str,
        fn: Any = None,
        *,
        reads: Iterable[str] = (),
        sources: Mapping[str, str] | None = None,
        replace: bool = False,
        **extra: Any,
    ) -> Any:
        """Register ``fn`` as ``name`` (or, without ``fn``, return a decorator that does).

        ``reads``: names of :data:`INPUTS` the method needs; ``sources``: setting name -> where
        its default comes from; ``replace``: allow re-registering a name registered earlier
        by a plugin (a built-in can never be replaced). Returns ``fn``.
        """
        if fn is None:
            return lambda f: self.register(
                name, f, reads=reads, sources=sources, replace=replace, **extra
            )
        if not isinstance(name, str) or not name.isidentifier():
            raise RegistrationError(
                f"{self.name} name {name!r} must be an identifier (letters, digits, _): it "
                "becomes a config value, a CLI name and verl's grouprl_<name>"
            )
        old = self.declarations.get(name)
        if old is not None and old.builtin:
            raise RegistrationError(
                f"{self.name} {name!r} is a built-in; register yours under another name "
                f"(e.g. 'my_{name}'): built-ins cannot be replaced"
            )
        if old is not None and not replace and old.fn is not fn:
            raise RegistrationError(
                f"{self.name} {name!r} is already registered (by "
                f"{getattr(old.fn, '__module__', '?')}); pick another name, or pass "
                "replace=True to replace your own registration"
            )
        reads = self._check_reads(name, reads)
        if self.callable:
            self._check_signature(name, fn, reads)
        settings = self._settings(fn, reads, sources)
        decl = Declaration(
            self.name, name, fn, reads, settings, False, MappingProxyType(dict(extra))
        )
        self.table[name] = fn
        self.declarations[name] = decl
        for callback in list(_LISTENERS):
            callback(decl)
        return fn

    def get(self, name: str) -> Declaration:
        """The declaration of ``name`` (a ValueError listing the names when unknown)."""
        try:
            return self.declarations[name]
        except KeyError:
            if name in self.table:  # written into the table directly: a bare declaration
                fn = self.table[name]
                return Declaration(self.name, name, fn, settings=self._settings(fn, ()))
            raise ValueError(
                f"unknown {self.name} {name!r}; valid: {', '.join(self.table)}"
            ) from None

    def reads(self, name: str) -> frozenset[str]:
        """What ``name`` reads beyond its arguments (empty for an unknown name)."""
        d = self.declarations.get(name)
        return d.reads if d is not None else frozenset()

    def plugins(self) -> list[str]:
        """The names registered beyond the built-ins, in registration order."""
        return [n for n, d in self.declarations.items() if not d.builtin]

    def __contains__(self, name: object) -> bool:
        return name in self.table

    def names(self) -> list[str]:
        return list(self.table)


AXES: dict[str, Axis] = {}
"""Axis name -> :class:`Axis`, filled as the packages that own them are imported."""
