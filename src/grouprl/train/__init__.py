"""The compact trainer: config, the loop, chunked log-probs, checkpoints, sinks.

    from grouprl.train import config, loop
    cfg = config.load_config("configs/maze.yaml", overrides=["optim.lr=1e-4"])
    result = loop.train(cfg)          # or: grouprl train --config configs/maze.yaml

    from grouprl.train import run     # your dataset + TRL-style reward functions
    result = run(model="smollm2", dataset=ds, reward_funcs=[correct], preset="f_grpo",
                 optim={"lr": 1e-5})  # grouprl.train.api

Modules are imported on use (``grouprl.train.loop`` pulls in torch and the task stack).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # ``run`` is imported on use, like the modules, so ``import grouprl.train`` stays cheap.
    if name == "run":
        from grouprl.train.api import run

        return run
    raise AttributeError(f"module 'grouprl.train' has no attribute {name!r}")
