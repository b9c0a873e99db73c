"""The version bounds pyproject.toml declares match what each extra really needs.

Installs nothing: reads pyproject.toml, scripts/install-peers.sh and the installed peers'
own metadata. The rule it keeps: ``grouprl[models]`` once copied verl 0.9.1's transformers cap (<5.11), so
installing it into an existing environment pushed a current transformers down although only
the verl integration needs the cap. A bound that only a peer needs lives with that peer.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest

requirements = pytest.importorskip("packaging.requirements")
specifiers = pytest.importorskip("packaging.specifiers")
tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]

PEER_BOUNDS = {("peers", "transformers")}
"""(extra, package) pairs allowed an upper bound: verl's transformers cap, in `peers` only."""

CHECKED_TRANSFORMERS = "5.24.0"
"""The newest transformers grouprl's own tests were run against (tests/models and
tests/rollout, with transformers 5.24.0 and tokenizers 0.23.3 put ahead of the shared
environment's 5.10.4 on PYTHONPATH); grouprl[models] must admit it."""


def _extras() -> dict[str, list]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = data["project"]["optional-dependencies"]
    return {
        extra: [requirements.Requirement(r) for r in reqs if not r.startswith("grouprl[")]
        for extra, reqs in deps.items()
    }


def _spec(extra: str, name: str):
    (req,) = [r for r in _extras()[extra] if r.name == name]
    return req.specifier


def _upper_bounded(spec) -> bool:
    return any(s.operator in ("<", "<=", "==", "~=", "===") for s in spec)


def test_only_a_peer_extra_caps_a_version():
    capped = {
        (e, r.name) for e, reqs in _extras().items() for r in reqs if _upper_bounded(r.specifier)
    }
    assert capped == PEER_BOUNDS


def test_models_extra_admits_current_transformers():
    spec = _spec("models", "transformers")
    assert CHECKED_TRANSFORMERS in spec and "5.11.0" in spec
    assert "4.55.0" not in spec  # TRL 1.x needs >= 4.56.2; grouprl's own floor is 4.56


def test_peers_bound_is_verls_own_and_install_peers_agrees():
    ours = _spec("peers", "transformers")
    script = (ROOT / "scripts" / "install-peers.sh").read_text()
    (line,) = re.findall(r'^TRANSFORMERS_SPEC="([^"]+)"$', script, flags=re.M)
    assert requirements.Requirement(line).specifier == ours
    # the pinned verl's own declared range (known answer from verl 0.9.1's METADATA)
    assert ours == specifiers.SpecifierSet(">=5.5.3,!=5.6.0,<5.11")
    assert "5.10.4" in ours and "5.6.0" not in ours and "5.11.0" not in ours


def test_peers_bound_matches_the_installed_verl():
    try:
        meta = md.metadata("verl")
    except md.PackageNotFoundError:
        pytest.skip("verl is not installed (scripts/install-peers.sh installs it)")
    theirs = [
        requirements.Requirement(r)
        for r in meta.get_all("Requires-Dist") or []
        if r.startswith("transformers") and "extra ==" not in r
    ]
    assert len(theirs) == 1
    assert theirs[0].specifier == _spec("peers", "transformers"), (
        f"verl {meta['Version']} declares {theirs[0]}: update the peers extra and "
        "TRANSFORMERS_SPEC in scripts/install-peers.sh together"
    )
    # the environment the tests run in holds a transformers both verl and grouprl accept
    have = md.version("transformers")
    assert have in theirs[0].specifier and have in _spec("models", "transformers")
