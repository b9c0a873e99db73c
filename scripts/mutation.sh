#!/usr/bin/env bash
# Mutation testing with mutmut 3 (not in CI: hours on two cores). docs/design.md, "How the code
# is tested", holds the last scores and the triage of the surviving mutants.
#
#   scripts/mutation.sh                      # every module: losses advantages diagnostics train
#   scripts/mutation.sh losses advantages    # some of them
#   scripts/mutation.sh train/loop.py        # one file, against the tests chosen for it
#   scripts/mutation.sh train/update.py      # (also train/inputs.py, registry.py)
#   scripts/mutation.sh losses/objective.py  # (also losses/aggregation.py: against tests/losses)
#   scripts/mutation.sh advantages/ranking.py  # any file of advantages/, against tests/advantages
#   scripts/mutation.sh --report losses      # the scores and survivors of an earlier run only
#   MUTATION_SAMPLE=300 scripts/mutation.sh train/loop.py   # a uniform random sample of mutants
#   MUTATION_NAMES=names.txt scripts/mutation.sh advantages  # only the mutants named there
#
# MUTATION_SAMPLE=N runs a uniform random sample of N of the module's mutants (without
# replacement; MUTATION_SEED, default 24, seeds the draw) instead of all of them, in chunks of
# 100 in the drawn order (`mutmut run <names>`): stopped early, the chunks that finished are
# still a uniform sample (mutmut reorders the mutants inside a chunk, fastest first). The
# score is then an estimate: report it with its binomial interval. The drawn order is in
# .mutation/<module>/sample_order.txt.
#
# Each module runs in its own scratch copy of the repository (.mutation/<module>/, ignored by
# git) with its own mutmut configuration: only that module's files are mutated, and only its
# relevant tests run (TESTS below; mutmut then runs, for each mutant, only the tests that call
# the mutated function). One mutmut child at a time, under `nice`, so that the run can sit in
# the background of a shared machine. Each module writes .mutation/<module>/survivors.txt
# (every surviving mutant with its diff) and a line per file in .mutation/scores.txt.
# Raise statements are not mutated: a mutant of an error message's wording is not a wrong
# result (the messages are pinned where they matter by the tests of user errors); the
# condition that raises is mutated like any other line.
#
# mutmut is in the dev extra (pip install -e '.[dev]'); PYTHON picks the interpreter
# (default: .venv/bin/python, else python3).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
OUT="${MUTATION_DIR:-$ROOT/.mutation}"
NICE="${MUTATION_NICE:-10}"
CHILDREN="${MUTATION_CHILDREN:-1}"  # mutmut children at once (2 only on an idle machine)
SAMPLE="${MUTATION_SAMPLE:-}"  # N: a uniform random sample of N mutants (header)
SEED="${MUTATION_SEED:-24}"

# module (or one file) -> the tests that exercise it (pytest paths, relative to the root)
declare -A TESTS=(
    [losses]="tests/losses"
    [advantages]="tests/advantages"
    [diagnostics]="tests/diagnostics"
    [train]="tests/train"
    [losses/objective.py]="tests/losses"
    [losses/aggregation.py]="tests/losses"
    [advantages/__init__.py]="tests/advantages"
    [advantages/_groups.py]="tests/advantages"
    [advantages/baseline.py]="tests/advantages"
    [advantages/combine.py]="tests/advantages"
    [advantages/global_norm.py]="tests/advantages"
    [advantages/ranking.py]="tests/advantages"
    [advantages/reweighted.py]="tests/advantages"
    [advantages/scale.py]="tests/advantages"
    [advantages/tokens.py]="tests/advantages"
    [advantages/transforms.py]="tests/advantages"
    [train/loop.py]="tests/train/test_step_update.py tests/train/test_step_sampling.py tests/train/test_step_run.py tests/train/test_gradient_rows.py tests/train/test_schedule.py tests/train/test_loop_inputs.py tests/train/test_loop.py tests/train/test_peer_methods_train.py tests/train/test_rollout_correction.py tests/train/test_loss_settings.py tests/train/test_sinks.py"
    [train/update.py]="tests/train/test_step_update.py tests/train/test_step_run.py tests/train/test_gradient_rows.py tests/train/test_schedule.py tests/train/test_loop_inputs.py tests/train/test_loop.py tests/train/test_rollout_correction.py tests/train/test_loss_settings.py tests/train/test_inputs.py tests/train/test_topr_trains.py"
    [train/inputs.py]="tests/train/test_inputs.py tests/train/test_loop_inputs.py tests/train/test_peer_methods_train.py tests/train/test_step_update.py"
    [registry.py]="tests/test_registry.py tests/test_plugins.py tests/train/test_inputs.py tests/test_presets.py"
)
# pytest options for every module's run: the trainer's subprocess and end-to-end tests would
# run the unmutated code in child processes or take minutes per mutant
declare -A EXTRA=(
    [losses]=""
    [advantages]=""
    [diagnostics]=""
    [train]="-m not slow and not e2e"
    [losses/objective.py]=""
    [losses/aggregation.py]=""
    [advantages/__init__.py]=""
    [advantages/_groups.py]=""
    [advantages/baseline.py]=""
    [advantages/combine.py]=""
    [advantages/global_norm.py]=""
    [advantages/ranking.py]=""
    [advantages/reweighted.py]=""
    [advantages/scale.py]=""
    [advantages/tokens.py]=""
    [advantages/transforms.py]=""
    [train/loop.py]="-m not slow and not e2e"
    [train/update.py]="-m not slow and not e2e"
    [train/inputs.py]="-m not slow and not e2e"
    [registry.py]="-m not slow and not e2e"
)

report_only=0
if [ "${1:-}" = "--report" ]; then report_only=1; shift; fi
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(losses advantages diagnostics train)
for mod in "${modules[@]}"; do
    if [ -z "${TESTS[$mod]+x}" ]; then
        echo "unknown module '$mod'; valid: ${!TESTS[*]}" >&2
        exit 2
    fi
done
if ! "$PY" -c "import mutmut" 2>/dev/null; then
    echo "mutmut is not installed for $PY: pip install -e '.[dev]' (or pip install 'mutmut>=3.3')" >&2
    exit 2
fi
MUTMUT=("$PY" -c "import sys; from mutmut.__main__ import cli; sys.argv[0] = 'mutmut'; cli()")

prepare() {  # a scratch copy of the repository with this module's mutmut configuration
    local mod="$1" work="$2"
    rm -rf "$work"
    mkdir -p "$work"
    (cd "$ROOT" && tar --exclude='__pycache__' --exclude='*.pyc' -cf - src tests examples docs pyproject.toml) |
        (cd "$work" && tar -xf -)
    {
        echo "[mutmut]"
        echo "source_paths=src"
        echo "also_copy="  # read by tests (the example plugin and its page)
        echo "    examples"
        echo "    docs"
        if [[ "$mod" == *.py ]]; then echo "only_mutate=src/grouprl/$mod"; else echo "only_mutate=src/grouprl/$mod/*"; fi
        # the wording of error messages is not mutated (a raise statement and its message);
        # the conditions that raise still are, and the tests provoke them
        echo "do_not_mutate_patterns="
        echo "    ^\\s*raise\\b"
        echo "pytest_add_cli_args_test_selection="
        for t in ${TESTS[$mod]}; do echo "    $t"; done
        echo "pytest_add_cli_args="
        echo "    -p"
        echo "    no:cacheprovider"
        echo "    -q"
        if [ -n "${EXTRA[$mod]}" ]; then
            echo "    -m"
            echo "    ${EXTRA[$mod]#-m }"
        fi
    } >"$work/setup.cfg"
}

score() {  # per-file killed / tested from mutmut's .meta files; survivors with their diffs
    local mod="$1" work="$2"
    (cd "$work" && "$PY" - "$mod" "$OUT/scores.txt" <<'EOF'
import json, sys, time
from pathlib import Path

mod, scores = sys.argv[1], Path(sys.argv[2])
from mutmut.stats import status_by_exit_code as STATUS

KILLED = {"killed", "timeout", "segfault", "caught by type check"}
lines, survivors = [], []
total_k = total_t = 0
metas = Path("mutants/src/grouprl", mod)
for meta in sorted([Path(f"{metas}.meta")] if mod.endswith(".py") else metas.rglob("*.py.meta")):
    codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
    status = {k: STATUS[v] for k, v in codes.items()}
    counted = {k: s for k, s in status.items() if s not in ("skipped", "not checked")}
    killed = sum(s in KILLED for s in counted.values())
    name = str(meta.relative_to("mutants/src/grouprl"))[: -len(".meta")]
    uncovered = sum(s == "no tests" for s in counted.values())
    pct = 100.0 * killed / len(counted) if counted else 100.0
    lines.append(f"{name:40s} {killed:5d}/{len(counted):<5d} killed {pct:5.1f} %"
                 f"  ({uncovered} reached by no test)")
    total_k += killed
    total_t += len(counted)
    source = Path("src/grouprl", name)
    survivors += [(f"{k} ({s})", source) for k, s in counted.items() if s not in KILLED]
stamp = time.strftime("%Y-%m-%d %H:%M")
head = f"# {mod} {stamp}: {total_k}/{total_t} killed"
print(head, *lines, sep="\n")
with scores.open("a") as f:
    print(head, *lines, sep="\n", file=f)
from mutmut.mutation.diff_apply import get_diff_for_mutant

with open("survivors.txt", "w") as f:
    for key, source in survivors:
        try:
            diff = get_diff_for_mutant(key.split(" (")[0], path=source)
        except Exception as err:  # a diff mutmut cannot rebuild: the name is still listed
            diff = f"(no diff: {err})"
        print(f"## {key}\n{diff}\n", file=f)
print(f"{len(survivors)} survivors with their diffs: {Path('survivors.txt').resolve()}")
EOF
    )
}

mutmut_run() {  # mutmut run [names...] in the scratch copy, into one log; exits on a failure
    local mod="$1" work="$2" log="$3"
    shift 3
    (cd "$work" && env -u PYTHONPATH OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        nice -n "$NICE" "${MUTMUT[@]}" run --max-children "$CHILDREN" "$@" >"$log" 2>&1) || {
        echo "mutmut failed for $mod; the end of $log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    }
}

sample() {  # MUTATION_SAMPLE: the mutants' names, a seeded uniform draw, chunks of 100
    local mod="$1" work="$2" prefix total i
    prefix="grouprl.${mod//\//.}"
    prefix="${prefix%.py}"
    # mutmut generates the mutants and records which tests reach which function before it
    # filters the names: a pattern that matches no mutant leaves exactly that (and fails)
    (cd "$work" && env -u PYTHONPATH OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n "$NICE" \
        "${MUTMUT[@]}" run "$prefix.x_no_such_function_*" >"$work/generate.log" 2>&1) || true
    (cd "$work" && "$PY" -c '
import json, random, sys
from pathlib import Path

n, seed = int(sys.argv[1]), int(sys.argv[2])
names = sorted(k for meta in Path("mutants").rglob("*.py.meta")
               for k in json.loads(meta.read_text()).get("exit_code_by_key", {}))
if not names:
    sys.exit("no mutants were generated: see generate.log")
random.Random(seed).shuffle(names)
Path("sample_order.txt").write_text("\n".join(names[:n]) + "\n")
print(f"   {min(n, len(names))} of {len(names)} mutants drawn (seed {seed})")
' "$SAMPLE" "$SEED")
    total=$(wc -l <"$work/sample_order.txt")
    for ((i = 0; i < total; i += 100)); do
        mapfile -t names < <(sed -n "$((i + 1)),$((i + 100))p" "$work/sample_order.txt")
        echo "   chunk $((i / 100 + 1)): mutants $((i + 1))-$((i + ${#names[@]})) of $total" \
            "($(date -u +%H:%M) UTC, load $(cut -d' ' -f1 /proc/loadavg))"
        mutmut_run "$mod" "$work" "$work/chunk_$((i / 100 + 1)).log" "${names[@]}"
    done
}

# MUTATION_NAMES: a file of mutant names (one a line, as mutmut names them; a sample drawn
# over several files, docs/mutation.md) to run instead of every mutant; the others stay "not
# checked" and are left out of the score
names=()
if [ -n "${MUTATION_NAMES:-}" ]; then mapfile -t names <"$MUTATION_NAMES"; fi
mkdir -p "$OUT"
for mod in "${modules[@]}"; do
    work="$OUT/${mod//\//_}"
    if [ "$report_only" -eq 0 ]; then
        prepare "$mod" "$work"
        echo "== $mod: mutating src/grouprl/$mod against ${TESTS[$mod]} (log: $work/mutmut.log)"
        if [ -n "$SAMPLE" ]; then
            sample "$mod" "$work"
        else
            mutmut_run "$mod" "$work" "$work/mutmut.log" "${names[@]}"
        fi
    fi
    score "$mod" "$work"
done
