"""The compact trainer: config, the loop, chunked log-probs, checkpoints, sinks.

    from grouprl.train import config, loop
    cfg = config.load_config("configs/maze.yaml", overrides=["optim.lr=1e-4"])
    result = loop.train(cfg)          # or: grouprl train --config configs/maze.yaml

Modules are imported on use (``grouprl.train.loop`` pulls in torch and the task stack).
"""
