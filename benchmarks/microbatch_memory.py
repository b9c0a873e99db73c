"""Live bytes and resident memory of one SmolLM2 training micro-batch in grouprl's log-prob kernel.

    python benchmarks/microbatch_memory.py                     # 2 prompts x 8, 64 tokens, chunk 256
    python benchmarks/microbatch_memory.py --chunk 256 --recompute
    python benchmarks/microbatch_memory.py --mmap-kib 1024     # glibc's mmap threshold fixed

One micro-batch as ``vs_trl.py --model smollm2`` trains it (2 basic_arithmetic prompts × 8
completions sampled once, seed 0; ``--full`` counts every completion as 64 tokens long, the
longest micro-batch), with the gradient buffers already there (micro-batches 2..4 of a step):
``completion_logprobs`` with gradient, then the backward of the mean log-prob, ``--iters``
times. A thread samples every 2 ms the RSS (``/proc/self/statm``) and glibc's live bytes
(``mallinfo2``: heap blocks in use + mapped blocks) and, at the RSS peak, the heap's size and
its free part. Reported per phase, above the state before the first forward; the first
forward also makes the weights' file pages resident (~490 MiB on SmolLM2), in the RSS only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import threading
import time

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"]]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=256, help="optim.logprob_chunk")
    ap.add_argument("--recompute", action="store_true", help="the head's recompute path")
    ap.add_argument("--recompute-mlp", action="store_true", help="the MLPs' gate/up recompute")
    ap.add_argument("--mmap-kib", type=int, default=0, help="run.mmap_threshold_kib")
    ap.add_argument("--full", action="store_true", help="every completion 64 tokens long")
    ap.add_argument("--iters", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    page = os.sysconf("SC_PAGE_SIZE")

    def sample() -> tuple[float, float, float, float]:  # rss, live, heap size, heap free (MiB)
        m = libc.mallinfo2()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        return tuple(v / 2**20 for v in (rss, m.uordblks + m.hblkhd, m.arena, m.fordblks))

    from grouprl import models, tasks
    from grouprl.rollout import hf
    from grouprl.train import malloc
    from grouprl.train.logprobs import completion_logprobs

    if args.mmap_kib:
        malloc.map_large_blocks(args.mmap_kib * 1024)
    task = tasks.get("basic_arithmetic")
    model, tok = models.load("smollm2", dtype=torch.float32, attn_implementation="sdpa")
    prompts = [task.render(e, tok) for e in task.examples("train", 2, 0)]
    sampling = hf.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=64)
    with torch.no_grad():
        r = hf.generate(model, tok, prompts, 8, sampling, torch.Generator().manual_seed(0))
    # the rollout's tensors are inference tensors (hf.generate): copies that autograd can save
    pids, pmask, cids = (t.clone() for t in (r.prompt_ids, r.prompt_mask, r.completion_ids))
    cmask = torch.ones_like(cids) if args.full else r.completion_mask.clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    peaks: dict[str, list] = {}
    phase = ["idle"]

    def probe() -> None:
        while True:
            now = sample()
            best = peaks.setdefault(phase[0], [now, now[1]])
            if now[0] > best[0][0]:
                best[0] = now
            best[1] = max(best[1], now[1])
            time.sleep(0.002)

    threading.Thread(target=probe, daemon=True).start()
    time.sleep(0.05)
    base = sample()
    cpu = {}
    for it in range(args.iters):
        phase[0], t0 = f"forward{it}", time.process_time()
        lp = completion_logprobs(
            model, pids, pmask, cids, cmask, chunk=args.chunk,
            entropy=True, group_size=8, recompute=True if args.recompute else None,
            recompute_mlp=args.recompute_mlp,
        )  # fmt: skip
        loss = (lp.logp * cmask).sum() / cmask.sum()
        time.sleep(0.01)
        phase[0], t1 = f"backward{it}", time.process_time()
        loss.backward()
        cpu[f"forward{it}"], cpu[f"backward{it}"] = t1 - t0, time.process_time() - t1
        del lp, loss
        time.sleep(0.01)
    phase[0] = "after"
    time.sleep(0.02)
    out = {
        "setting": vars(args),
        "completion_tokens": int(cmask.sum()),
        "before_mib": {"rss": round(base[0]), "live": round(base[1])},
        "above_before_mib": {
            k: {
                "rss": round(v[0][0] - base[0]),
                "live": round(v[1] - base[1]),
                "heap_at_rss_peak": round(v[0][2]),
                "heap_free_at_rss_peak": round(v[0][3]),
            }
            for k, v in peaks.items()
            if k != "idle"
        },
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
