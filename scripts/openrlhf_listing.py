"""Extract OpenRLHF's PPO/GRPO options from its source into tests/data/openrlhf-<version>.json.

OpenRLHF needs DeepSpeed and vLLM to import, so grouprl does not install it; the method table's
(docs/methods.md, tests/test_feature_table.py) checks its OpenRLHF column against this listing
instead. The listing is read from the source with ``ast`` (nothing of OpenRLHF is imported or
copied): every ``--name`` option of ``openrlhf/cli/train_ppo_ray.py`` with its ``choices``
(None for an option without choices), and the advantage estimators the experience maker
dispatches on. Regenerate it for a new OpenRLHF version::

    pip download openrlhf==0.11.2 --no-deps -d /tmp/openrlhf
    python scripts/openrlhf_listing.py /tmp/openrlhf/openrlhf-0.11.2-*.whl
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = "openrlhf/cli/train_ppo_ray.py"
MAKER = "openrlhf/trainer/ppo_utils/experience_maker.py"


def _read(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(member)]
        return z.read(name).decode()


def _literal(node: ast.AST) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def options(source: str) -> dict[str, list[str] | None]:
    """``--name`` -> its ``choices`` (None without) for every ``add_argument`` call."""
    out: dict[str, list[str] | None] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        names = [f[2:] for f in flags if isinstance(f, str) and f.startswith("--")]
        if not names:
            continue  # f-string option names (per-model optimiser settings)
        choices = next((_literal(k.value) for k in node.keywords if k.arg == "choices"), None)
        out[names[0]] = sorted(map(str, choices)) if choices else None
    return dict(sorted(out.items()))


def compared(source: str, attr: str) -> list[str]:
    """String constants compared (==, in) with a name or attribute called ``attr``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        name = getattr(left, "attr", None) or getattr(left, "id", None)
        if name != attr:
            continue
        for comp in node.comparators:
            value = _literal(comp)
            values = value if isinstance(value, (list, tuple, set)) else [value]
            found.update(v for v in values if isinstance(v, str))
    return sorted(found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="the openrlhf-<version>-*.whl from pip download")
    args = ap.parse_args()
    version = re.match(r"openrlhf-([^-]+)-", args.wheel.name).group(1)
    listing = {
        "package": "openrlhf",
        "version": version,
        "source": f"{CLI} (argparse options), {MAKER} (estimator dispatch)",
        "options": options(_read(args.wheel, CLI)),
        "advantage_estimators_dispatched": compared(
            _read(args.wheel, MAKER), "advantage_estimator"
        ),
    }
    out = ROOT / "tests" / "data" / f"openrlhf-{version}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(listing, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}: {len(listing['options'])} options")


if __name__ == "__main__":
    main()
