"""Generation backends: ``hf`` (transformers forward loop with a shared prompt KV cache, CPU or
GPU) and ``vllm`` (import-guarded; needs vLLM and a GPU). Both return :class:`grouprl.types.Rollouts`."""
