#!/usr/bin/env bash
# The measurements behind the README's performance section, one command (issue 14):
#   vs TRL on SmolLM2-135M and on the tiny maze model (equal settings, checked), the rollout
#   and training-forward speed-up against the commit before the speed work, and the train
#   step at one thread and at torch's default thread count.
#     bash benchmarks/measure.sh            # writes benchmarks/results/*.json
#   PYTHON=/path/to/python bash benchmarks/measure.sh   # another interpreter
# Run it on a quiet machine: every JSON records the load average before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
out=benchmarks/results
mkdir -p "$out"
echo "load before: $(cat /proc/loadavg)" >&2
"$py" benchmarks/vs_trl.py --model smollm2 > "$out/vs_trl_smollm2.json"
"$py" benchmarks/vs_trl.py --model tiny > "$out/vs_trl.json"
"$py" benchmarks/rollout_speed.py > "$out/rollout_speed.json"
"$py" benchmarks/train_step.py --threads 1 0 > "$out/train_step.json"
echo "load after: $(cat /proc/loadavg)" >&2
