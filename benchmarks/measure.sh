#!/usr/bin/env bash
# The measurements behind the README's performance section (docs/results.md), one command:
#   the machine's limits and the stages' fractions of them (roofline), vs TRL on SmolLM2-135M
#   in fp32, bf16 autocast and bf16 and on the tiny maze model (equal settings, checked), the
#   peak memory with run.mmap_threshold_kib=128, the advantage layer against verl, the rollout
#   and training-forward speed-up against the commit before the speed work, and the train
#   step at one thread and at torch's default thread count, the static-cache decode and bf16 rollouts.
#     bash benchmarks/measure.sh            # writes benchmarks/results/*.json
#     STEPS=2 CLOCK=cpu bash benchmarks/measure.sh   # the README's runs (a shared machine)
#   PYTHON=/path/to/python bash benchmarks/measure.sh   # another interpreter
# Run it on a quiet machine: every JSON records the load average before and after, and the
# vs_trl children their CPU seconds beside the wall clock. The headline files (vs_trl_smollm2,
# advantages, train_step) are written with --out (benchmarks/loadguard.py): from a run at a load
# above 2 they go to *_loaded.json instead; ALLOW_LOADED=1 overwrites the headline files anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
steps=${STEPS:-5}
clock=${CLOCK:-wall}
guard=()
[[ -n "${ALLOW_LOADED:-}" ]] && guard=(--allow-loaded)
out=benchmarks/results
mkdir -p "$out"
echo "load before: $(cat /proc/loadavg)" >&2
"$py" benchmarks/roofline.py --clock "$clock" > "$out/roofline.json"
"$py" benchmarks/vs_trl.py --model smollm2 --precision fp32 --steps "$steps" \
  --out "$out/vs_trl_smollm2.json" "${guard[@]}"
for precision in bf16_autocast bf16; do
  "$py" benchmarks/vs_trl.py --model smollm2 --precision "$precision" --steps "$steps" \
    > "$out/vs_trl_smollm2_$precision.json"
done
for kib in 0 128; do  # grouprl alone: peak RSS and CPU seconds at glibc's default and at 128 KiB
  "$py" benchmarks/vs_trl.py --model smollm2 --precision fp32 --steps "$steps" --only grouprl \
    --grouprl-set "run.mmap_threshold_kib=$kib" > "$out/vs_trl_smollm2_mmap$kib.json"
done
"$py" benchmarks/vs_trl.py --model tiny > "$out/vs_trl.json"  # vs_trl_tiny_run2.json: a second run
"$py" benchmarks/advantages.py --threads 1 --no-verl-loop --no-methods --repeat 9 --clock "$clock" \
  --profile gopo gdpo grpo_passk reinforce_pp_baseline grpo --out "$out/advantages.json" "${guard[@]}"
"$py" benchmarks/rollout_speed.py > "$out/rollout_speed.json"
"$py" benchmarks/rollout_speed.py --models tiny --baseline 6c44c79 --repeats 5 --no-reference \
  > "$out/rollout_speed_tiny_6c44c79.json"
"$py" benchmarks/train_step.py --threads 1 0 --out "$out/train_step.json" "${guard[@]}"
# a static cache + compiled decode on SmolLM2 (a cold compile), and bf16
# rollouts with fp32 master weights and the rollout correction against fp32 rollouts
"$py" benchmarks/static_decode.py --repeats 2 > "$out/static_decode_smollm2.json"
"$py" benchmarks/roofline.py --no-model --threads 1 --dtypes float32 --clock "$clock" \
  > "$out/roofline_limit_fp32_static_decode.json"
"$py" benchmarks/bf16_rollouts.py --model smollm2 --steps "$steps" > "$out/bf16_rollouts_smollm2.json"
echo "load after: $(cat /proc/loadavg)" >&2
