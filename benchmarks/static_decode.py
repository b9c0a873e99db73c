"""A static KV cache and a compiled decode step on SmolLM2-135M, against grouprl's decode; JSON.

    python benchmarks/static_decode.py                 # SmolLM2 fp32, batch 64, one thread
    python benchmarks/static_decode.py --repeats 2 --steps 4 20

The question: does a static cache with a ``torch.compile``-d decode step pay on this
machine? Three decoders of the same 64 rows (8 basic_arithmetic prompts × 8, the vs_trl
setting; EOS switched off so every row decodes every step), timed in this process's CPU
seconds (``time.process_time``: the machine is shared), interleaved (A B C A B C ...) so that a
change of load hits all three:

- ``current``: ``grouprl.rollout.hf.generate`` (one prefill per prompt, the in-place growing
  cache of ``hf._InPlaceLayer``, eager);
- ``static_eager``: transformers' ``StaticCache`` of ``prompt + max`` positions, prefill at
  batch 64, every decode step the same shapes (a full-width attention mask, positions past the
  current one masked by ``cache_position``), eager;
- ``static_compiled``: the same step through ``torch.compile(model.forward, dynamic=False)``
  (inductor's defaults: the linears stay calls of torch's GEMM, the elementwise work around
  them is fused). ``--freezing`` turns on inductor's ``freezing`` (weights folded and
  pre-packed for oneDNN); with torch 2.13 and transformers 5.10 its kernel indexed the static
  cache out of bounds on the second decode run (measured 2026-12-01), so it is off by default.

The decode step's cost is the difference of two runs of ``--steps SHORT LONG`` tokens over
``LONG - SHORT`` (prefill and set-up cancel), the best of ``--repeats``; ``tokens_per_cpu_s``
= 64 / step. ``first_call``: the compiled decoder's first call (compilation, one process:
``TORCHINDUCTOR_COMPILE_THREADS=1`` so the compiler's CPU seconds are this process's), with
inductor's on-disk cache in a fresh folder unless ``--warm-cache`` (a second run in the same
cache compiles ~4x faster: 14.2 against 55.5 CPU seconds here).
``amortisation``: the decode CPU seconds compiling saves over ``--run-steps`` training
steps if each decoded 64 tokens at batch 64 (an upper bound: the trainer compacts finished
rows away, a static batch cannot), against the first call's CPU seconds.
``same_tokens``: the sampled tokens of ``static_eager`` and ``static_compiled`` (same seed,
``--steps`` SHORT tokens), and of ``current`` and ``static_eager``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "--warm-cache" not in sys.argv:  # a cold first call: inductor's on-disk cache starts empty
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="grouprl-inductor-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import _load_model, _NoEos  # the roofline's SmolLM2 set-up

GROUP = 8
MAX_NEW = 64


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Decoders:
    """The three decoders on one model and one batch of prompts (module docstring)."""

    def __init__(self, model: Any, tok: Any, prompts: list[str]) -> None:
        from grouprl.rollout import hf

        self.hf, self.model, self.tok, self.prompts = hf, model, _NoEos(tok), prompts
        ids, mask = hf._encode(tok, prompts, self.tok.pad_token_id, torch.device("cpu"))
        self.ids = ids.repeat_interleave(GROUP, 0)  # [N, Tp]
        self.mask = mask.repeat_interleave(GROUP, 0)  # [N, Tp]
        self.compiled = None

    def current(self, steps: int, seed: int = 1, keep: list | None = None) -> float:
        t0 = time.process_time()
        roll = self.hf.generate(self.model, self.tok, self.prompts, GROUP,
                                self.hf.Sampling(1.0, 1.0, steps),
                                torch.Generator().manual_seed(seed))  # fmt: skip
        seconds = time.process_time() - t0
        if keep is not None:
            keep.extend(roll.completion_ids.t().unbind(0))
        return seconds

    @torch.inference_mode()
    def static(self, forward: Any, steps: int, seed: int = 1, keep: list | None = None) -> float:
        """Prefill at batch 64 into a StaticCache, then ``steps`` tokens through ``forward``."""
        from transformers import StaticCache

        n, tp = self.ids.shape
        cap = tp + MAX_NEW
        cache = StaticCache(config=self.model.config, max_cache_len=cap)
        pad = torch.zeros(n, cap - tp, dtype=self.mask.dtype)
        full = torch.cat([self.mask, pad + 1], 1)  # [N, cap]: the causal part masks the future
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        sampling = self.hf.Sampling(1.0, 1.0, MAX_NEW)
        generator = torch.Generator().manual_seed(seed)
        t0 = time.process_time()
        with self.hf.gqa_attention(self.model):
            out = self.model(input_ids=self.ids, attention_mask=torch.cat([self.mask, pad], 1),
                             position_ids=positions, past_key_values=cache, use_cache=True,
                             cache_position=torch.arange(tp), logits_to_keep=1)  # fmt: skip
            logits, start = out.logits[:, -1], self.mask.sum(-1)
            for step in range(steps):
                tok, _ = self.hf.sample_tokens(logits, sampling, generator)
                if keep is not None:
                    keep.append(tok)
                out = forward(input_ids=tok[:, None], attention_mask=full,
                              position_ids=(start + step)[:, None], past_key_values=cache,
                              use_cache=True, cache_position=torch.tensor([tp + step]))  # fmt: skip
                logits = out.logits[:, -1]
        return time.process_time() - t0

    def compile(self, freezing: bool) -> dict[str, Any]:
        import torch._inductor.config as inductor

        inductor.freezing = freezing
        self.compiled = torch.compile(self.model.forward, dynamic=False)
        load0, w0, c0 = _load(), time.perf_counter(), time.process_time()
        self.static(self.compiled, 2)
        return {"cpu_s": round(time.process_time() - c0, 2),
                "wall_s": round(time.perf_counter() - w0, 2), "load": [load0, _load()]}  # fmt: skip


def amortisation(current: float, compiled: float, first_call: float, run_steps: int) -> dict:
    """What compiling saves over ``run_steps`` training steps, each decoding ``MAX_NEW`` tokens
    at batch 64 (an upper bound: the trainer compacts finished rows away), against the first
    call; ``current`` / ``compiled``: CPU seconds of one decode step of each."""
    saved = (current - compiled) * MAX_NEW  # per training step, at most
    return {
        "run_steps": run_steps,
        "decode_cpu_s_saved_per_train_step_at_most": round(saved, 2),
        "saved_over_run_cpu_s": round(saved * run_steps, 1),
        "first_call_cpu_s": first_call,
        "pays": saved * run_steps > first_call,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model, tok, prompts = _load_model("smollm2", torch.float32)
    model.generation_config.eos_token_id = None
    d = Decoders(model, tok, prompts)
    d.current(2)  # warm-up
    d.static(model.forward, 2)
    first = d.compile(args.freezing)
    paths = {
        "current": d.current,
        "static_eager": lambda s: d.static(model.forward, s),
        "static_compiled": lambda s: d.static(d.compiled, s),
    }
    short, long_ = args.steps
    runs: dict[str, dict[int, list[float]]] = {k: {short: [], long_: []} for k in paths}
    load0 = _load()
    for _ in range(args.repeats):
        for steps in (short, long_):
            for name, fn in paths.items():
                runs[name][steps].append(round(fn(steps), 3))
    out: dict[str, Any] = {"first_call": first, "load_during_timing": [load0, _load()]}
    for name in paths:
        step = (min(runs[name][long_]) - min(runs[name][short])) / (long_ - short)
        out[name] = {"step_cpu_s": round(step, 4), "tokens_per_cpu_s": round(64 / step, 1),
                     "runs_cpu_s": {str(k): v for k, v in runs[name].items()}}  # fmt: skip
    base = out["current"]["step_cpu_s"]
    for name in ("static_eager", "static_compiled"):
        out[name]["speedup_vs_current"] = round(base / out[name]["step_cpu_s"], 3)
    out["amortisation"] = amortisation(
        base, out["static_compiled"]["step_cpu_s"], first["cpu_s"], args.run_steps
    )
    a, b, c = [], [], []
    d.static(model.forward, short, keep=a)
    d.static(d.compiled, short, keep=b)
    d.current(short, keep=c)
    out["same_tokens"] = {
        "static_eager_vs_compiled": all(torch.equal(x, y) for x, y in zip(a, b)),
        "current_vs_static_eager": all(torch.equal(x, y) for x, y in zip(a, c)),
        "tokens_compared": len(a) * 64,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs=2, default=[8, 40], metavar=("SHORT", "LONG"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--freezing", action="store_true", help="inductor's freezing (module doc)")
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache")
    ap.add_argument("--run-steps", type=int, default=300, help="training steps to amortise over")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = {
        "benchmark": "static_decode",
        "model": "smollm2 fp32",
        "batch": 64,
        "threads": 1,
        "clock": "cpu (time.process_time)",
        "torch": torch.__version__,
        "command": "python benchmarks/static_decode.py " + " ".join(sys.argv[1:]),
        **measure(args),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
