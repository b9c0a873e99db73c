"""Generation: ``hf`` (a transformers forward loop with a shared prompt KV cache, CPU or GPU),
returning :class:`grouprl.types.Rollouts`. At GPU scale, generate with vLLM through the TRL
adapter (``GRPOConfig(use_vllm=True)``) or verl: docs/training.md, "On a GPU and beyond"."""
