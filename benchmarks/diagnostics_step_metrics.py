"""Cost of ``diagnostics.step_metrics`` per call, to compare with a training step (target < 1 %).

Prints one JSON object: milliseconds per call for several batch shapes, and the same for
``advantages.compute("grpo")`` as a yardstick. Run on an idle machine:
``python benchmarks/diagnostics_step_metrics.py``.
"""

from __future__ import annotations

import json
import time

import torch

from grouprl import advantages, diagnostics


def _time(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    out = {"threads": 1, "shapes": []}
    for p, g in ((64, 8), (512, 16), (8192, 16)):
        rewards = (torch.rand(p, g, generator=gen) < 0.3).float()
        rewards[0, 0] = float("nan")
        adv = advantages.compute("grpo", rewards)
        repeat = 200 if p * g < 100_000 else 20
        out["shapes"].append(
            {
                "P": p,
                "G": g,
                "step_metrics_ms": round(
                    _time(lambda r=rewards, a=adv: diagnostics.step_metrics(r, a), repeat), 3
                ),
                "grpo_compute_ms": round(
                    _time(lambda r=rewards: advantages.compute("grpo", r), repeat), 3
                ),
            }
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
