"""Cost of containment: run_untrusted per call, score_batch per item, HumanEval throughput (JSON).

    python benchmarks/sandbox_overhead.py [--calls 30] [--skip-humaneval]

``run_untrusted_ms`` is the wall time of one sandboxed ``pass`` (launch, namespaces,
interpreter start, clean-up); ``bare_python_ms`` is ``python -I -S -c pass`` through
``subprocess.run``, the floor any process-based sandbox pays. Run on an idle machine: a
busy 2-core box doubles every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

from grouprl.tasks.sandbox import _python, detect_isolation, run_untrusted
from grouprl.tasks.verify import score_batch


def _quantiles_ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    pick = lambda q: round(1000 * s[min(len(s) - 1, int(q * len(s)))], 2)  # noqa: E731
    return {"p10": pick(0.1), "median": round(1000 * statistics.median(s), 2), "p90": pick(0.9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--skip-humaneval", action="store_true")
    args = parser.parse_args()

    out: dict[str, object] = {"isolation": detect_isolation()}
    run_untrusted("pass", timeout_s=5, memory_mb=256)  # warm the page cache
    sandboxed = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        run_untrusted("pass", timeout_s=5, memory_mb=256)
        sandboxed.append(time.perf_counter() - t0)
    bare = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        subprocess.run([_python(), "-I", "-S", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t0)
    out["run_untrusted_ms"] = _quantiles_ms(sandboxed)
    out["bare_python_ms"] = _quantiles_ms(bare)

    n = 2000
    t0 = time.perf_counter()
    scores = score_batch(lambda c, r: float(c == r), ["a"] * n, ["a"] * n, workers=2)
    elapsed = time.perf_counter() - t0
    assert scores.unscorable == 0
    out["score_batch_us_per_item"] = round(1e6 * elapsed / n, 1)
    t0 = time.perf_counter()
    score_batch(lambda c, r: 1.0, ["a"], ["a"], workers=1)
    out["score_batch_fixed_ms"] = round(1000 * (time.perf_counter() - t0), 2)

    if not args.skip_humaneval:
        from grouprl.tasks.code import HumanEvalTask, load_humaneval

        task = HumanEvalTask()
        refs = [HumanEvalTask._example(p).reference for p in load_humaneval()]
        for workers in (2, 4):
            t0 = time.perf_counter()
            s = score_batch(
                task.verify,
                [r["canonical_solution"] for r in refs],
                refs,
                timeout_s=task.verify_timeout_s,
                workers=workers,
            )
            out[f"humaneval_164_canonical_s_workers{workers}"] = round(time.perf_counter() - t0, 2)
            out[f"humaneval_pass_workers{workers}"] = sum(s.rewards)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
