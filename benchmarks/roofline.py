"""This machine's limits, and how close grouprl's stages on a real model come to them; prints JSON.

    python benchmarks/roofline.py                    # GEMM + bandwidth at 1 and 2 threads, SmolLM2 stages
    python benchmarks/roofline.py --quick            # smaller sizes (about two minutes on SmolLM2)
    python benchmarks/roofline.py --no-model         # the machine only
    python benchmarks/roofline.py --dtypes float32 bfloat16 --threads 1 2

**The limits.** ``gemm``: sustained GFLOP/s of one matmul shape, repeated for at least
``--seconds`` and the best of five rounds, per dtype (fp32; bf16 where the CPU has native
bf16) and thread count, on the shapes that matter: 1024³ and the decode shapes of SmolLM2
at batch 64 in ``nn.Linear``'s layout (``x [M, K] @ W[N, K]^T``: the MLP's 576 -> 1536 and
1536 -> 576, the attention's 576 -> 576 and 576 -> 192, the lm head's 576 -> 49,152).
``bandwidth``: GB/s of a 256 MiB copy (read + write), sum (read) and triad
(``a = b + 2c``, two reads and a write). ``limit_gflops``: the best GEMM rate per dtype and
thread count, the denominator of every fraction.

**The stages** (``--model``, one dtype at a time: the model's parameters in that dtype, no
autocast), on the vs_trl setting (8 prompts × 8 samples, 64 new tokens, micro-batch 16):

- ``generate``: ``rollout.hf.generate`` of the batch (prefill, decode, compaction, as in
  training); ``useful_gflop``: each prompt's prefill once, then for every generated token
  but the first the forward at its context length, and the lm head at the last prompt
  position and every decode step.
- ``decode_b64``: one decode step with all 64 rows running (EOS switched off), from the
  difference of two runs of ``--decode-steps`` lengths, so prefill and set-up cancel; the
  FLOPs of a step at the mean context length of the extra steps.
- ``logprob_forward`` / ``backward``: ``train.logprobs.completion_logprobs`` with gradient
  on the generated batch in micro-batches of 16, then ``backward`` of their sum; the
  forward's FLOPs are the prompts once per micro-batch's groups, every completion token but
  the last through the decoder, and the head at every completion token; the backward's are
  twice the forward's (gradients of the activations and of the weights).

FLOPs are counted from the model's config: per token and layer ``2 x`` the linear weights
(q, k, v, o, gate, up, down) plus ``4 H d_head c`` for attention over ``c`` positions (QK^T
and AV); the head ``2 d V`` per predicted position; norms, rotary and softmax are left out.
``fraction`` = achieved GFLOP/s / ``limit_gflops`` of that dtype at that thread count.
``decode_b64.shape_bound_gflops``: the step's own GEMM limit, each linear at the rate measured
for its shape (``shape_bound``), and ``fraction_of_shape_bound``. ``--clock cpu`` times
everything in this process's CPU seconds (``CLOCKS``: a shared machine).
``profile``: the largest operators of one decode run by self time (torch.profiler), and
the share of matmuls: what bounds the decode when it is not the GEMM.

The machine is shared: every timing carries the load average (before, after) of its block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import machine  # the same machine block as vs_trl's JSON

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_DECODE_SHAPES = {
    "mlp_up_576x1536": (64, 576, 1536),
    "mlp_down_1536x576": (64, 1536, 576),
    "attn_q_576x576": (64, 576, 576),
    "attn_kv_576x192": (64, 576, 192),
    "lm_head_576x49152": (64, 576, 49152),
}
"""The ``nn.Linear`` shapes (M rows, K in, N out) of one SmolLM2-135M decode step at batch 64."""


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: ``wall`` seconds, or ``cpu`` seconds of this process (all its threads). [OURS]
On a shared machine the wall clock also counts the time other processes held the core, and the
load moves between the limit's measurement and the stages'; one thread's CPU seconds count only
the work (cache and memory-bus contention from the other processes aside). At ``n`` threads a
``cpu`` rate is per CPU second: an idle machine's wall rate is up to ``n`` times it."""
_CLOCK = [time.perf_counter]


def shape_bound(rates: dict[str, float], layers: int) -> float:
    """GFLOP/s of one SmolLM2 decode step at batch 64 if every linear ran at the rate measured
    for its own shape (``rates``: ``gemm``'s output): per layer q and o at 576 -> 576, k and v
    at 576 -> 192, gate and up at 576 -> 1536, down at 1536 -> 576, then the lm head. The
    step's own GEMM limit: small shapes run below the 1024^3 rate that ``limit_gflops`` takes."""
    per_layer = {"attn_q_576x576": 2, "attn_kv_576x192": 2, "mlp_up_576x1536": 2,
                 "mlp_down_1536x576": 1}  # fmt: skip
    flop = seconds = 0.0
    for name, count in [*((k, layers * c) for k, c in per_layer.items()), ("lm_head_576x49152", 1)]:
        m, k, n = SMOLLM2_DECODE_SHAPES[name]
        flop += count * 2 * m * k * n
        seconds += count * 2 * m * k * n / (rates[f"linear_{name}"] * 1e9)
    return flop / seconds / 1e9


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _rate(fn, flop: float, seconds: float) -> float:
    """Best GFLOP/s over five rounds of at least ``seconds`` / 5 each (one warm-up call)."""
    fn()
    t0 = _CLOCK[0]()
    fn()
    once = max(_CLOCK[0]() - t0, 1e-6)
    reps = max(1, int(seconds / 5 / once))
    best = float("inf")
    for _ in range(5):
        t0 = _CLOCK[0]()
        for _ in range(reps):
            fn()
        best = min(best, (_CLOCK[0]() - t0) / reps)
    return flop / best / 1e9


def gemm(dtype: torch.dtype, seconds: float, shapes: dict[str, tuple[int, int, int]]) -> dict:
    """GFLOP/s per shape: ``linear(x [M, K], W [N, K])`` (``mm`` for the square one)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    a = torch.randn(1024, 1024, generator=gen).to(dtype)
    b = torch.randn(1024, 1024, generator=gen).to(dtype)
    c = torch.empty(1024, 1024, dtype=dtype)
    out["mm_1024x1024x1024"] = _rate(lambda: torch.mm(a, b, out=c), 2 * 1024**3, seconds)
    for name, (m, k, n) in shapes.items():
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        out[f"linear_{name}"] = _rate(
            lambda x=x, w=w: torch.nn.functional.linear(x, w), 2 * m * k * n, seconds
        )
    return {k: round(v, 1) for k, v in out.items()}


def bandwidth(seconds: float, mib: int = 256) -> dict[str, float]:
    """GB/s of copy (read + write), sum (read) and triad (2 reads + 1 write) on ``mib`` arrays."""
    n = mib * 2**20 // 4
    b, c = torch.rand(n), torch.rand(n)
    a = torch.empty(n)
    nbytes = 4 * n

    def gbs(fn, moved: int) -> float:
        return round(_rate(fn, moved, seconds), 2)  # _rate's "flop" = bytes here

    return {
        "copy_gbs": gbs(lambda: a.copy_(b), 2 * nbytes),
        "read_gbs": gbs(lambda: b.sum(), nbytes),
        "triad_gbs": gbs(lambda: torch.add(b, c, alpha=2.0, out=a), 3 * nbytes),
    }


# ---- FLOPs from the model's shapes --------------------------------------------------------------


class Flops:
    """FLOPs of a Llama-style decoder from its config (module docstring)."""

    def __init__(self, config: Any) -> None:
        d = config.hidden_size
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        hd = getattr(config, "head_dim", None) or d // heads
        ff = config.intermediate_size
        self.layers = config.num_hidden_layers
        self.linear = 2 * self.layers * (2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ff)
        self.attn_per_pos = 4 * self.layers * heads * hd  # x context length
        self.head = 2 * d * config.vocab_size

    def tokens(self, n: int, start: int, count: int) -> float:
        """``n`` rows × tokens at positions ``start .. start+count-1`` (causal attention: the
        token at position i attends to i + 1 positions), no head."""
        positions = count * start + count * (count + 1) / 2  # Σ (i + 1)
        return n * (count * self.linear + self.attn_per_pos * positions)


def generate_flops(f: Flops, roll: Any) -> float:
    """Useful FLOPs of a rollout batch: prefill once per prompt, then each generated token
    after the first through the decoder at its context, and the head at every token drawn."""
    g = roll.group_size
    plen = roll.prompt_mask.sum(-1)[::g].tolist()  # [P]
    lengths = roll.completion_mask.sum(-1).tolist()  # [N]
    total = sum(f.tokens(1, 0, int(tp)) for tp in plen)
    for row, length in enumerate(lengths):
        tp = int(plen[row // g])
        total += f.tokens(1, tp, max(int(length) - 1, 0)) + int(length) * f.head
    return total


def logprob_flops(f: Flops, roll: Any, micro: int) -> float:
    """Useful forward FLOPs of the log-probs in micro-batches of ``micro`` sequences: each
    micro-batch's prompts once per group, the completions, the head at each completion token."""
    g = roll.group_size
    plen = roll.prompt_mask.sum(-1).tolist()
    lengths = roll.completion_mask.sum(-1).tolist()
    total = 0.0
    for start in range(0, len(lengths), micro):
        rows = range(start, min(start + micro, len(lengths)))
        total += sum(f.tokens(1, 0, int(plen[r])) for r in rows if r % g == 0 or r == start)
        for r in rows:
            total += f.tokens(1, int(plen[r]), max(int(lengths[r]) - 1, 0)) + lengths[r] * f.head
    return total


# ---- the stages ----------------------------------------------------------------------------


def _load_model(name: str, dtype: torch.dtype):
    from grouprl import models, tasks

    task = tasks.get("basic_arithmetic" if name == "smollm2" else "maze")
    model, tok = models.load(name, task=task, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(dtype).eval()
    prompts = [task.render(e, tok) for e in task.examples("train", 8, 0)]
    return model, tok, prompts


class _NoEos:
    """A tokenizer proxy with an EOS id no token has: every row decodes to max_new_tokens."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_id = -1
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._tok(*a, **k)


def _timed(fn) -> tuple[Any, float]:
    t0 = _CLOCK[0]()
    out = fn()
    return out, _CLOCK[0]() - t0


def stages(args: argparse.Namespace, dtype: torch.dtype, limit: float) -> dict[str, Any]:
    from grouprl.rollout import hf
    from grouprl.train.logprobs import completion_logprobs

    model, tok, prompts = _load_model(args.model, dtype)
    f = Flops(model.config)
    group, max_new, micro = 8, args.max_new, 16
    sampling = hf.Sampling(1.0, 1.0, max_new)
    out: dict[str, Any] = {"load_before": load(), "layers": f.layers}
    hf.generate(model, tok, prompts[:1], 1, hf.Sampling(1.0, 1.0, 2))  # warm-up

    # generate, as in training
    roll, sec = _timed(lambda: hf.generate(model, tok, prompts, group, sampling,
                                           torch.Generator().manual_seed(0)))  # fmt: skip
    roll = replace(
        roll,
        **{
            k: getattr(roll, k).clone()
            for k in (  # inference -> plain tensors
                "prompt_ids",
                "prompt_mask",
                "completion_ids",
                "completion_mask",
            )
        },
    )
    flop = generate_flops(f, roll)
    out["generate"] = _stage(sec, flop, limit, tokens=int(roll.completion_mask.sum()))

    # one decode step at batch 64, every row running
    gen_cfg = model.generation_config
    saved = gen_cfg.eos_token_id
    gen_cfg.eos_token_id = None
    try:
        short, long_ = args.decode_steps
        times = {}
        for steps in (short, long_, short, long_):
            _, sec = _timed(lambda s=steps: hf.generate(
                model, _NoEos(tok), prompts, group, hf.Sampling(1.0, 1.0, s),
                torch.Generator().manual_seed(1)))  # fmt: skip
            times.setdefault(steps, []).append(sec)
    finally:
        gen_cfg.eos_token_id = saved
    n = len(prompts) * group
    plen = float(roll.prompt_mask.sum(-1).float().mean())
    step_s = (min(times[long_]) - min(times[short])) / (long_ - short)
    mid = plen + (short + long_) / 2  # mean context of the extra steps
    step_flop = n * (f.linear + f.attn_per_pos * mid + f.head)
    out["decode_b64"] = {
        **_stage(step_s, step_flop, limit, tokens=n),
        "context_mean": round(mid, 1),
        "runs_s": {str(k): [round(x, 3) for x in v] for k, v in times.items()},
    }

    # the training forward and backward on the generated batch
    fwd_s = bwd_s = 0.0
    model.zero_grad(set_to_none=True)
    for start in range(0, n, micro):
        m = slice(start, start + micro)
        lp, sec = _timed(lambda m=m: completion_logprobs(
            model, roll.prompt_ids[m], roll.prompt_mask[m], roll.completion_ids[m],
            roll.completion_mask[m].float(), chunk=1024, group_size=group, entropy=True))  # fmt: skip
        fwd_s += sec
        _, sec = _timed(lambda lp=lp: lp.logp.sum().backward())
        bwd_s += sec
    model.zero_grad(set_to_none=True)
    fwd_flop = logprob_flops(f, roll, micro)
    tokens = int(roll.completion_mask.sum())
    out["logprob_forward"] = _stage(fwd_s, fwd_flop, limit, tokens=tokens)
    out["backward"] = _stage(bwd_s, 2 * fwd_flop, limit, tokens=tokens)
    if args.profile:
        out["profile"] = _profile(model, tok, prompts, group, min(16, max_new))
    out["load_after"] = load()
    return out


def _stage(seconds: float, flop: float, limit: float, tokens: int) -> dict[str, Any]:
    gflops = flop / seconds / 1e9
    return {
        "seconds": round(seconds, 4),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 2),
        "gflop": round(flop / 1e9, 3),
        "gflops": round(gflops, 2),
        "fraction_of_gemm_limit": round(gflops / limit, 3),
    }


def _profile(model, tok, prompts, group: int, steps: int) -> dict[str, Any]:
    """Top operators by self CPU time of one decode of ``steps`` tokens, all rows running."""
    from torch.profiler import ProfilerActivity, profile

    from grouprl.rollout import hf

    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            hf.generate(model, _NoEos(tok), prompts, group, hf.Sampling(1.0, 1.0, steps),
                        torch.Generator().manual_seed(2))  # fmt: skip
    finally:
        model.generation_config.eos_token_id = saved
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) or 1.0
    matmul = sum(e.self_cpu_time_total for e in rows if e.key in MATMULS)
    return {
        "steps": steps,
        "matmul_share": round(matmul / total, 3),
        "top": {e.key: round(e.self_cpu_time_total / total, 3) for e in rows[:12]},
    }


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
           "mkldnn::_linear_pointwise", "aten::_mkldnn_linear")  # fmt: skip


# ---- main ----------------------------------------------------------------------------------


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--seconds", type=float, default=2.0, help="per GEMM / bandwidth measurement")
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--no-model", action="store_true", help="the machine's limits only")
    ap.add_argument("--stage-threads", type=int, default=1, help="torch threads for the stages")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, nargs=2, default=[8, 40], metavar=("SHORT", "LONG"))
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--quick", action="store_true", help="0.5 s per measurement, 16 new tokens")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall seconds, or this process's CPU seconds (a shared machine)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.max_new, args.decode_steps = 0.5, 16, [4, 12]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _CLOCK[0] = CLOCKS[args.clock]
    flags = machine()
    dtypes = [d for d in args.dtypes if d != "bfloat16" or "avx512_bf16" in flags["cpu_flags"]
              or "amx_bf16" in flags["cpu_flags"]]  # fmt: skip
    out: dict[str, Any] = {
        "benchmark": "roofline",
        "machine": flags,
        "torch": torch.__version__,
        "command": "python benchmarks/roofline.py " + " ".join(sys.argv[1:]),
        "clock": args.clock,
        "gemm_gflops": {},
        "bandwidth": {},
        "limit_gflops": {},
    }
    shapes = SMOLLM2_DECODE_SHAPES
    for threads in args.threads:
        torch.set_num_threads(threads)
        key = f"{threads}_thread" + ("s" if threads > 1 else "")
        before = load()
        for name in dtypes:
            rates = gemm(DTYPES[name], args.seconds, shapes)
            out["gemm_gflops"].setdefault(name, {})[key] = {**rates, "load": [before, load()]}
            out["limit_gflops"].setdefault(name, {})[key] = max(rates.values())
        out["bandwidth"][key] = {**bandwidth(args.seconds), "load": [before, load()]}
    if not args.no_model:
        torch.set_num_threads(args.stage_threads)
        key = f"{args.stage_threads}_thread" + ("s" if args.stage_threads > 1 else "")
        out["stages"] = {"model": args.model, "threads": args.stage_threads,
                         "setting": "8 prompts x 8 samples, basic_arithmetic, T=1, top-p 1, "
                                    f"{args.max_new} new tokens, micro-batch 16"}  # fmt: skip
        for name in dtypes:
            limit = out["limit_gflops"].get(name, {}).get(key)
            if limit is None:  # the stage thread count was not measured above: measure it
                limit = max(gemm(DTYPES[name], args.seconds, shapes).values())
                out["limit_gflops"].setdefault(name, {})[key] = limit
            out["stages"][name] = stages(args, DTYPES[name], limit)
            rates = out["gemm_gflops"].get(name, {}).get(key)
            if args.model == "smollm2" and rates:
                dec = out["stages"][name]["decode_b64"]
                bound = shape_bound(rates, out["stages"][name]["layers"])
                dec["shape_bound_gflops"] = round(bound, 2)
                dec["fraction_of_shape_bound"] = round(dec["gflops"] / bound, 3)
    out["summary"] = summary(out)
    print(json.dumps(out, indent=1))
    return 0


def summary(out: dict[str, Any]) -> dict[str, Any]:
    """The fractions the README quotes, one line per dtype and stage."""
    rows = {}
    for name, res in (out.get("stages") or {}).items():
        if not isinstance(res, dict) or name not in DTYPES:
            continue
        for stage in ("generate", "decode_b64", "logprob_forward", "backward"):
            if stage in res:
                rows[f"{name} {stage}"] = res[stage]["fraction_of_gemm_limit"]
    lim = out.get("limit_gflops", {})
    rows["limits (GFLOP/s)"] = {k: v for k, v in lim.items()}
    return rows


if __name__ == "__main__":
    sys.exit(main())
