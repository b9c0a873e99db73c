#!/usr/bin/env bash
# Install the peer frameworks grouprl integrates with (TRL, verl) into ./.venv, so that the
# parity tests and the end-to-end runs in tests/integrations and the adapter benchmark run
# instead of skipping.
#
# - TRL is installed normally (its dependencies are light: datasets, pandas, pyarrow...).
# - verl is installed WITHOUT its dependencies (no vllm, sglang, flash-attn, megatron, wandb):
#   only the pure-Python packages its algorithm code, `compute_advantage` and its own trainer
#   (`python -m verl.trainer.main_ppo`, run on CPU by tests/integrations/test_verl_trainer.py)
#   import are added. `import verl` imports `ray` unconditionally (verl/protocol.py): Ray core
#   is installed (not ray[default]: the end-to-end test starts a local cluster without the
#   dashboard). verl's reward loop imports aiohttp, which verl does not declare.
# - TRL 1.16 and verl 0.9.1 share this environment: verl's model patch would import TRL's
#   removed AutoModelForCausalLMWithValueHead; grouprl.integrations.verl (loaded by verl
#   through the verl.plugins entry point) makes verl see that TRL lacks it (fix_trl_probe).
# - torch is frozen at whatever is installed (a constraint file), so this never pulls a CUDA
#   torch. transformers is held inside verl 0.9.1's own bound (TRANSFORMERS_SPEC, its
#   Requires-Dist; the same bound as the `peers` extra in pyproject.toml): a newer one, which
#   grouprl[models] alone allows, is moved down to it, since verl is installed without its
#   dependencies and would not check. tests/test_packaging.py keeps the three in agreement.
# - OpenRLHF 0.11.2 is installed WITHOUT its dependencies (DeepSpeed, vLLM, flash-attn): it
#   cannot be imported as a package, but tests/advantages/openrlhf_ref.py executes its plain
#   torch functions (advantages, KL, KL controllers, policy loss) from the installed source, so
#   the parity tests compare ours with OpenRLHF's own code.
# Safe to run again: it exits at once when everything already imports at the tested versions.
# Override the tested versions with GROUPRL_TRL_SPEC / GROUPRL_VERL_SPEC / GROUPRL_OPENRLHF_SPEC.
# `install-peers.sh --transformers-spec` prints the transformers bound (scripts/install.sh
# installs grouprl[all] under it, so transformers is downloaded once).
set -euo pipefail
cd "$(dirname "$0")/.."

TRANSFORMERS_SPEC="transformers>=5.5.3,!=5.6.0,<5.11"
if [ "${1:-}" = "--transformers-spec" ]; then echo "$TRANSFORMERS_SPEC"; exit 0; fi

PY=.venv/bin/python
[ -x "$PY" ] || { echo "install-peers.sh: $PY not found; run scripts/install.sh first" >&2; exit 1; }

TRL_SPEC=${GROUPRL_TRL_SPEC:-trl==1.16.0}
VERL_SPEC=${GROUPRL_VERL_SPEC:-verl==0.9.1}
OPENRLHF_SPEC=${GROUPRL_OPENRLHF_SPEC:-openrlhf==0.11.2}
# What `import verl.trainer.ppo.core_algos`, `verl.workers.config` and
# `verl.trainer.ppo.ray_trainer.compute_advantage` and verl's trainer need beyond TRL's own
# dependencies.
VERL_RUNTIME=(
  "ray==2.60.0" "tensordict>=0.8,!=0.9.0,<=0.10.0" "omegaconf>=2.3" "hydra-core>=1.3"
  "codetiming>=1.4" "torchdata>=0.11" "cachetools>=5" "fastapi>=0.110" "uvicorn>=0.29" "dill"
  "pillow" "peft>=0.15" "aiohttp>=3.9"
)

check() {
  HF_HUB_OFFLINE=1 "$PY" - "$@" <<'EOF'
import importlib.metadata as md
import sys
import warnings

from packaging.requirements import Requirement

warnings.filterwarnings("ignore")
want = dict(a.split("==") for a in sys.argv[1:] if "==" in a)
for name, version in want.items():
    have = md.version(name)
    if have != version:
        raise SystemExit(f"{name} {have} installed, {version} wanted")
for spec in sys.argv[1:]:
    if "==" not in spec:
        req = Requirement(spec)
        if md.version(req.name) not in req.specifier:
            raise SystemExit(f"{req.name} {md.version(req.name)} installed, {spec} wanted")
import trl  # noqa: F401
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
import verl.trainer.ppo.core_algos  # noqa: F401
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: F401
from verl.workers.config import ActorConfig  # noqa: F401
# what verl's own trainer imports on top (the end-to-end test runs it)
import aiohttp  # noqa: F401
import verl.experimental.agent_loop  # noqa: F401
import verl.experimental.reward_loop  # noqa: F401
import verl.trainer.main_ppo  # noqa: F401
import verl.workers.engine_workers  # noqa: F401
EOF
}

if check "$TRL_SPEC" "$VERL_SPEC" "$OPENRLHF_SPEC" "$TRANSFORMERS_SPEC" >/dev/null 2>&1; then
  echo "peers already installed: $TRL_SPEC $VERL_SPEC $OPENRLHF_SPEC"
  exit 0
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - >"$constraints" <<'EOF'
import importlib.metadata as md

for name in ("torch",):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
EOF
pip=("$PY" -m pip install --disable-pip-version-check -q -c "$constraints")
quiet() { grep -v -e "^WARNING: Location" -e "dependency resolver" -e "^verl .* requires" || true; }

"${pip[@]}" "$TRL_SPEC" "$TRANSFORMERS_SPEC" "${VERL_RUNTIME[@]}" 2>&1 | quiet
"${pip[@]}" --no-deps "$VERL_SPEC" 2>&1 | quiet
"${pip[@]}" --no-deps "$OPENRLHF_SPEC" 2>&1 | quiet

if ! log=$(check "$TRL_SPEC" "$VERL_SPEC" "$OPENRLHF_SPEC" "$TRANSFORMERS_SPEC" 2>&1); then
  echo "$log" >&2
  echo "install-peers.sh: TRL/verl installed but the import check above failed" >&2
  exit 1
fi
echo "peers installed: $TRL_SPEC $VERL_SPEC $OPENRLHF_SPEC (torch $("$PY" -c 'import torch; print(torch.__version__)'), transformers $("$PY" -c 'import transformers; print(transformers.__version__)'))"
