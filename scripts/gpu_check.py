#!/usr/bin/env python
"""One prepared check for a machine with a GPU: grouprl and TRL on a SmolLM2-shaped model, then the device tests.

    python scripts/gpu_check.py                       # cuda, SmolLM2-135M shape, bf16 (< 8 min)
    python scripts/gpu_check.py --out gpu_check.json  # also write the numbers as JSON
    python scripts/gpu_check.py --device cpu --tiny   # the same path on a tiny shape, on a CPU

What it does, in order (each stage says what it did; nothing is downloaded):

1. Builds a Llama with SmolLM2-135M's configuration (30 layers, width 576, 9 heads with 3
   KV heads, MLP 1536, tied embeddings, vocabulary 49,152: 134.5M parameters) at random
   init (seed 0), with a character tokenizer of 49,152 characters (printable ASCII, then
   Unicode letters and symbols), so the embedding and the LM head have SmolLM2's shape
   and no weights need to travel. ``--tiny``: a 2-layer, width-64 model on printable ASCII.
2. Trains it for ``--steps`` (5) grouprl steps (``grouprl.train.run``, preset ``grpo``) at
   16 prompts × 8 completions × 128 new tokens, and the same setting with TRL's
   ``GRPOTrainer`` (the equivalent loss: ``grouprl.integrations.trl.trl_loss_settings``; one
   optimizer step per generation batch, lr 1e-6, β = 0), each from the same initial
   weights, on the same prompts and reward. Precision on a GPU is the same for both: fp32
   master weights with bf16 autocast (grouprl ``model.dtype=float32, model.autocast=
   bfloat16``; TRL ``bf16=True``); on a CPU, fp32. Attention: SDPA for both.
3. Prints, per trainer: completion tokens per second of step time, the step's time split
   (grouprl: generate, score, log-probs + loss forward, backward, optimizer, as its
   ``time/*`` metrics; TRL: ``_generate``, ``_calculate_rewards``, the rest of
   ``_generate_and_score_completions``, ``compute_loss``, and backward + optimizer as the
   remainder of the step, each wrapped with a device synchronisation), peak GPU memory
   (``torch.cuda.max_memory_allocated``, reset before each trainer), and the ratios
   grouprl / TRL. The first step of each warms up kernels and caches: it is reported but
   not averaged.
4. Runs the device-sensitive tests (``tests/train/test_device.py`` and
   ``tests/train/test_loop.py``: their runs use ``model.device=auto``, the first GPU torch
   sees); ``--tests "..."`` runs other pytest arguments, ``--skip-tests`` none.

If one trainer fails, the script reports the error and goes on with the other and the tests.

**Carrying TRL to a GPU machine without network.** Such a machine has torch,
transformers, accelerate and peft; TRL also needs ``datasets`` and its small dependencies.
On a machine with network and the same Python (3.11 here) and platform::

    pip download --no-deps --only-binary=:all: --python-version 3.11 \\
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d wheels/ \\
        trl==1.16.0 datasets==5.2.0 pyarrow dill multiprocess xxhash fsspec \\
        pandas huggingface_hub tqdm psutil jinja2 markupsafe python-dateutil tzdata httpx

(``--no-deps`` keeps torch and transformers out: they are on the GPU machine already; run
``pip install --no-index --find-links wheels/ trl`` once there, and add any package pip
then names as missing to the download list). Copy ``wheels/`` and this repository over,
then ``pip install --no-index --find-links wheels/ trl datasets && pip install --no-deps -e .``
and run the script. Without TRL the script still runs the grouprl half and the tests, and
says that TRL was not found.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import string
import subprocess
import sys
import tempfile
import time
import unicodedata
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[1]

SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}
"""SmolLM2-135M-Instruct's configuration (its config.json, as converted by grouprl.models)."""

TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
"""``--tiny``: the shape the CPU test runs (vocabulary: printable ASCII + specials)."""


def char_vocabulary(size: int) -> str:
    """``size`` distinct characters: printable ASCII, then non-space Unicode letters and symbols."""
    chars = dict.fromkeys(string.printable)
    code = 0xA1
    while len(chars) < size:
        c = chr(code)
        if unicodedata.category(c)[0] in "LNPS":  # letters, numbers, punctuation, symbols
            chars.setdefault(c)
        code += 1
    return "".join(list(chars)[:size])


def build(tiny: bool, seed: int = 0) -> tuple[Any, Any]:
    """The random-init policy (float32, on the CPU) and its character tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grouprl import models

    shape = dict(TINY if tiny else SMOLLM2_135M)
    specials = 5  # grouprl.models' <pad> <unk> <bos> <sep> <eos>
    vocab = shape.pop("vocab_size", None)
    tok = models.char_tokenizer(None if vocab is None else char_vocabulary(vocab - specials))
    config = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **shape,
    )
    config._attn_implementation = "sdpa"  # what grouprl's loader and TRL's default use
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval(), tok


def prompts(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows: ``Repeat: <word>`` prompts with the word as a column."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
        rows.append({"prompt": f"Repeat the word: {word}\n", "word": word})
    return rows


def letters(completions, word, **kwargs):
    """The share of the word's letters among the completion's first characters (cheap, smooth)."""
    return [sum(ch in w for ch in c[: len(w)]) / len(w) for c, w in zip(completions, word)]


# ---- grouprl --------------------------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def run_grouprl(model: Any, tok: Any, rows: list, args: argparse.Namespace, out: Path) -> dict:
    """``args.steps`` grouprl steps; per-step times, tokens/s, peak memory."""
    from grouprl.train import run
    from grouprl.train.sinks import read_jsonl

    model_section = {"device": args.device, "dtype": "float32", "autocast": args.autocast}
    _peak_reset(args.device)
    t0 = time.perf_counter()
    run(
        model=model,
        tokenizer=tok,
        dataset=rows,
        reward_funcs=[letters],
        preset="grpo",
        task={"eval_fraction": 0.0},
        model_config=model_section,
        sampling={
            "prompts_per_step": args.prompts,
            "group_size": args.group,
            "max_new_tokens": args.tokens,
            "verify_timeout_s": 0.0,
        },
        optim={"steps": args.steps, "lr": 1e-6, "micro_batch_size": 0},
        eval={"every": 0},
        run={
            "out": str(out / "grouprl"),
            "progress": False,
            "tensorboard": False,
            "report": False,
            "every": 0,
            "save_final": False,
            "threads": args.threads,
        },
    )
    _sync(args.device)
    wall = time.perf_counter() - t0
    steps = [r for r in read_jsonl(out / "grouprl" / "metrics.jsonl") if r["step"] > 0]
    n = args.prompts * args.group
    per_step = [
        {
            "step_s": r["time/step"],
            "tokens": r["length/mean"] * n,
            "split_s": {
                "generate": r["time/generate"],
                "score": r["time/score"],
                "logprobs+loss forward": r["time/logprobs"],
                "backward": r["time/backward"],
                "optimizer": r["time/optimizer"],
            },
        }
        for r in steps
    ]
    return {"wall_s": wall, "steps": per_step, "peak_gpu_gib": _peak_gib(args.device)}


# ---- TRL ------------------------------------------------------------------------------------


def _timed(obj: Any, name: str, bucket: dict[str, float], device: str) -> None:
    """Wrap ``obj.name`` so its wall time (device-synchronised) adds up in ``bucket[name]``."""
    inner = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        _sync(device)
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            _sync(device)
            bucket[name] = bucket.get(name, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def run_trl(model: Any, tok: Any, rows: list, args: argparse.Namespace, out: Path) -> dict:
    """The same setting in TRL's GRPOTrainer; per-step times from a callback and wrappers."""
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        return {"skipped": f"TRL not importable ({err}); see the docstring to carry its wheel"}
    from grouprl import presets
    from grouprl.integrations.trl import trl_loss_settings

    cuda = args.device.startswith("cuda")
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.tokens,
        temperature=1.0,
        top_p=1.0,
        max_steps=args.steps,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",  # transformers' default; grouprl optim.fused
        num_iterations=1,
        logging_steps=1,
        report_to=[],
        use_cpu=not cuda,
        bf16=args.autocast == "bfloat16",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **trl_loss_settings(presets.get("grpo")),
    )
    times: list[dict[str, float]] = []
    bucket: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            _sync(args.device)
            bucket.clear()
            bucket["start"] = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            _sync(args.device)
            times.append({**bucket, "step": time.perf_counter() - bucket.pop("start")})

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=letters,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[Clock()],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the per-step log dicts; the summary says enough
    for name in ("_generate", "_calculate_rewards", "_generate_and_score_completions"):
        _timed(trainer, name, bucket, args.device)
    _timed(trainer, "compute_loss", bucket, args.device)
    _peak_reset(args.device)
    t0 = time.perf_counter()
    trainer.train()
    _sync(args.device)
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    n = args.prompts * args.group
    per_step = []
    for t, h in zip(times, logs):
        prep = t.get("_generate_and_score_completions", 0.0)
        gen, score = t.get("_generate", 0.0), t.get("_calculate_rewards", 0.0)
        loss = t.get("compute_loss", 0.0)
        per_step.append(
            {
                "step_s": t["step"],
                "tokens": h["completions/mean_length"] * n,
                "split_s": {
                    "generate": gen,
                    "score": score,
                    "other preparation (log-probs)": max(0.0, prep - gen - score),
                    "compute_loss (forward)": loss,
                    "backward+optimizer (rest)": max(0.0, t["step"] - prep - loss),
                },
            }
        )
    return {"wall_s": wall, "steps": per_step, "peak_gpu_gib": _peak_gib(args.device)}


# ---- report ---------------------------------------------------------------------------------


def summarise(result: dict) -> dict:
    """Means over the steps after the first: step seconds, tokens/s, each part of the split."""
    steps = result.get("steps") or []
    timed = steps[1:] or steps
    if not timed:
        return {}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    step_s = mean([s["step_s"] for s in timed])
    return {
        "step_s": step_s,
        "tokens_per_s": mean([s["tokens"] for s in timed]) / step_s,
        "split_s": {k: mean([s["split_s"][k] for s in timed]) for k in timed[0]["split_s"]},
        "first_step_s": steps[0]["step_s"],
        "peak_gpu_gib": result.get("peak_gpu_gib"),
    }


DEVICE_TESTS = "tests/train/test_device.py tests/train/test_loop.py"
"""The tests that exercise the trainer's device placement (their runs use ``model.device=auto``)."""


def run_tests(args: argparse.Namespace) -> dict:
    """The device tests (:data:`DEVICE_TESTS`, or ``--tests``) in a child pytest."""
    if args.skip_tests:
        return {"skipped": "--skip-tests"}
    argv = (args.tests or DEVICE_TESTS).split()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(cmd[2:]), "rc": proc.returncode, "seconds": time.perf_counter() - t0,
            "tail": tail}  # fmt: skip


def _print(report: dict) -> None:
    print(f"\n== gpu_check on {report['device']} ({report['device_name']}), {report['precision']}, "
          f"{report['parameters'] / 1e6:.1f}M parameters, vocabulary {report['vocab']}")  # fmt: skip
    print(f"   {report['prompts']} prompts x {report['group']} x {report['tokens']} new tokens, "
          f"{report['steps']} steps (means over steps 2..{report['steps']})")  # fmt: skip
    for name in ("grouprl", "trl"):
        s = report["summary"].get(name) or {}
        if not s:
            print(f"{name:>8}: {report['results'][name].get('skipped', 'no steps')}")
            continue
        peak = "-" if s["peak_gpu_gib"] is None else f"{s['peak_gpu_gib']:.2f} GiB"
        print(f"{name:>8}: step {s['step_s']:.3f} s, {s['tokens_per_s']:.0f} completion tokens/s, "
              f"peak GPU memory {peak}, first step {s['first_step_s']:.2f} s")  # fmt: skip
        print("          " + ", ".join(f"{k} {v:.3f}" for k, v in s["split_s"].items()))
    if report.get("ratio"):
        r = report["ratio"]
        print(f"   grouprl / TRL: step time {r['step_s']:.2f}x, tokens/s {r['tokens_per_s']:.2f}x")
    tests = report["tests"]
    if "rc" in tests:
        print(f"   tests ({tests['command']}): rc {tests['rc']} in {tests['seconds']:.0f} s")
        print("   " + "\n   ".join(tests["tail"][-3:]))
    else:
        print(f"   tests: skipped ({tests['skipped']})")


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer width-64 model")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="max new tokens")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--tests", help=f"pytest arguments (default: {DEVICE_TESTS})")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; use --device cpu --tiny on a CPU")
        return 2
    args.autocast = "bfloat16" if args.device.startswith("cuda") else "none"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = args.threads or torch.get_num_threads()
    print(f"gpu_check: building the {'tiny' if args.tiny else 'SmolLM2-135M'}-shaped model",
          flush=True)  # fmt: skip
    model, tok = build(args.tiny)
    rows = prompts(args.prompts * max(args.steps, 4))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name, fn in (("grouprl", run_grouprl), ("trl", run_trl)):
            if name == "trl" and args.skip_trl:
                results[name] = {"skipped": "--skip-trl"}
                continue
            print(f"gpu_check: {args.steps} steps with {name}", flush=True)
            policy = copy.deepcopy(model).to(args.device)
            try:
                results[name] = fn(policy, tok, rows, args, Path(tmp))
            except Exception as err:  # report and go on: the other half still measures
                results[name] = {"skipped": f"failed: {type(err).__name__}: {err}"[:500]}
            del policy
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    summary = {k: summarise(v) for k, v in results.items()}
    g, t = summary.get("grouprl"), summary.get("trl")
    ratio = (
        {"step_s": g["step_s"] / t["step_s"], "tokens_per_s": g["tokens_per_s"] / t["tokens_per_s"]}
        if g and t
        else None
    )
    print("gpu_check: device tests", flush=True)
    report = {
        "device": args.device,
        "device_name": _device_name(args.device),
        "precision": "fp32 weights, bf16 autocast" if args.autocast != "none" else "fp32",
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": len(tok),
        "prompts": args.prompts,
        "group": args.group,
        "tokens": args.tokens,
        "steps": args.steps,
        "torch": torch.__version__,
        "results": results,
        "summary": summary,
        "ratio": ratio,
        "tests": run_tests(args),
    }
    _print(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    ok = bool(g) and (report["tests"].get("rc", 0) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
