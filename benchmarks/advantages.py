"""Time every advantage estimator and transform at P = 131,072, G = 8 (≈ 1M samples), against
verl's ``grpo`` (a Python loop over prompt ids) and ``grpo_vectorized`` and a floor
(``rewards.mean(1)``) on the same tensor, in one run. Prints JSON.

    python benchmarks/advantages.py [--prompts 131072] [--group 8] [--repeat 5] [--no-verl-loop] [--clock cpu] [--malloc default|keep|map]

Targets: every estimator >= 100x faster than verl's grpo, >= 2x faster than
grpo_vectorized, within 10x of the floor. The estimators are timed round-robin, each call
right before its own call of verl's grpo_vectorized (:func:`timeit_rounds`); a speed-up is the
median of those per-pair ratios. ``methods``: each method a peer ships,
ours beside the peer's own function on the same input in this run — sequence level at the
same P × G (verl's Python loops timed once), token level at ``--token-prompts`` × G × T. ``adapter_grouprl_grpo`` is our grpo called through
the verl adapter on verl's flat input (its flat -> [P, G] mapping included); it is reported
beside the direct path and not held to the floor target.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import loadguard  # benchmarks/loadguard.py: headline files only from idle runs
import numpy as np
import torch

from grouprl import advantages


def _map_large() -> bool:
    from grouprl.train import malloc

    return malloc.map_large_blocks(128 * 1024)


def _keep_freed() -> bool:
    from grouprl.train import malloc

    return malloc.keep_freed_blocks()


MALLOC_MODES = {"default": lambda: True, "keep": _keep_freed, "map": _map_large}
"""``--malloc``: glibc's regime for every tensor of both sides. [OURS] A fresh ``[P, G]``
tensor costs ~1,000 page faults (4 MiB) when its memory is new to the process, nothing when
the heap kept a freed block of its size; by default glibc does one or the other by the
process's history (its dynamic mmap threshold and the trims), so a call's time moved up to
2x between runs. ``keep`` (:func:`grouprl.train.malloc.keep_freed_blocks`: no page faults,
what a long-lived process reaches) and ``map`` (a fixed 128 KiB threshold, every block
mapped fresh: grouprl's ``pretrained`` training profile) fix it."""

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: wall seconds, or this process's CPU seconds. [OURS] On a shared machine the wall
clock also counts the time other processes held the core; one thread's CPU seconds do not."""
_CLOCK = [time.perf_counter]


def timeit(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = _CLOCK[0]()
        fn()
        times.append(_CLOCK[0]() - t0)
    return statistics.median(times)


def timeit_paired(fn, ref, repeat: int) -> tuple[float, float, float]:
    """``(median of fn, median of ref, median of ref/fn)``: the two called in turn, each pair
    on the same host second. [OURS] On a shared machine the speed of both drifts by ±30 %
    within minutes; the per-pair ratio cancels what both see."""
    return timeit_rounds({"fn": fn}, ref, repeat)["fn"]


def timeit_rounds(calls: dict, ref, repeat: int) -> dict[str, tuple[float, float, float]]:
    """:func:`timeit_paired` of every call in ``calls`` against ``ref``, round-robin: each
    of the ``repeat`` rounds times every call once, each right before its own ``ref``.

    [OURS] A slow phase of the host (seconds to minutes of a neighbour's load) then touches
    one sample of every call instead of all the samples of the calls that ran during it;
    the per-pair ratio cancels what a pair shares. ``{name: (median, ref median, median
    ratio)}``."""
    for fn in calls.values():  # warm-up
        fn(), ref()
    a: dict[str, list[float]] = {k: [] for k in calls}
    b: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeat):
        for name, fn in calls.items():
            t0 = _CLOCK[0]()
            fn()
            t1 = _CLOCK[0]()
            ref()
            b[name].append(_CLOCK[0]() - t1)
            a[name].append(t1 - t0)
    return {
        k: (
            statistics.median(a[k]),
            statistics.median(b[k]),
            statistics.median(y / x for x, y in zip(a[k], b[k])),
        )
        for k in calls
    }


def profile_call(fn, top: int = 8) -> dict[str, float]:
    """Share of self CPU time of the ``top`` operators of one call (after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) or 1.0
    return {e.key: round(e.self_cpu_time_total / total, 3) for e in rows[:top]}


def part_floors(rewards: torch.Tensor, repeat: int) -> dict[str, float]:
    """The parts the slow members cannot skip, each timed alone: a member
    costs at least the sum of its parts. ``floor_moments``: the group moments every estimator
    starts from (count, mean, centred rewards, std, collapse flag); ``floor_gopo_pairs``:
    gopo's Σ_j sign(r_i − r_j) over the G(G−1)/2 pairs, its definition; ``floor_resolution``:
    the resolution protocol's binning (the plain-group check on the sorted values, then the
    exact bins of the other groups: network with recorded exchanges, scan, exchanges undone);
    ``floor_normalize_then_sum``: gdpo's first stage (a normalisation per reward function);
    ``floor_sort_network``: the G columns sorted by the sorting network alone, values only (no
    positions carried), the least any binning of each group costs here (``torch.sort`` of the
    rows is ``floor_sort``, ~8× more); with ``maxnorm_rloo`` itself it bounds the resolution
    protocol's composition from below."""
    from grouprl.advantages import _groups, combine, ranking, transforms

    columns = list(_groups.transposed(rewards).unbind(0))  # G x [P]

    return {
        "floor_moments": timeit(lambda: _groups.group_moments(rewards, None), repeat),
        "floor_gopo_pairs": timeit(lambda: ranking._sign_sums(rewards, None), repeat),
        "floor_resolution": timeit(lambda: transforms.resolution(rewards, None, 1e-2), repeat),
        "floor_normalize_then_sum": timeit(
            lambda: combine.normalize_then_sum(rewards.unsqueeze(-1)), repeat
        ),
        "floor_sort_network": timeit(lambda: _groups.sort_columns(list(columns)), repeat),
    }


def make_rewards(p: int, g: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    binary = (torch.rand(p, g, generator=gen) < torch.rand(p, 1, generator=gen)).float()
    partial = torch.rand(p, g, generator=gen)
    return torch.where(torch.rand(p, 1, generator=gen) < 0.7, binary, partial)  # [P, G]


def _verl_flat(rewards: torch.Tensor):
    """verl's view of ``rewards [P, G]`` as one-token responses: ``(token_level_rewards
    [P·G, 1], response_mask [P·G, 1], index [P·G])``."""
    p, g = rewards.shape
    tokens = rewards.reshape(-1, 1).clone()
    return tokens, torch.ones_like(tokens), np.repeat(np.arange(p), g)


def verl_vectorized(rewards: torch.Tensor):
    """verl's ``compute_grpo_vectorized_outcome_advantage`` on the flat view of ``rewards``,
    as a call (None without verl): the reference every estimator is timed against."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        return None
    tokens, mask, index = _verl_flat(rewards)
    return lambda: core_algos.compute_grpo_vectorized_outcome_advantage(tokens, mask, index)


def verl_paths(rewards: torch.Tensor, repeat: int, loop: bool, ref) -> tuple[dict, dict]:
    """``(seconds, paired ratios)`` of our grpo through the verl adapter (paired with ``ref``)
    and, with ``loop``, verl's Python-loop ``grpo`` (timed once)."""
    from verl.trainer.ppo import core_algos

    tokens, mask, index = _verl_flat(rewards)
    # our estimator through the verl adapter (grouprl.integrations.verl), called as verl's
    # compute_advantage calls it, on the same flat input: the flat -> [P, G] mapping included
    from omegaconf import OmegaConf

    from grouprl.integrations import verl as _registers  # noqa: F401  (grouprl_<name>)

    cfg = OmegaConf.create({"adv_estimator": "grouprl_grpo", "grouprl": {}})
    adapter = core_algos.get_adv_estimator_fn("grouprl_grpo")
    ours, _, ratio = timeit_paired(
        lambda: adapter(token_level_rewards=tokens, response_mask=mask, index=index, config=cfg),
        ref,
        repeat,
    )
    out, paired = {"adapter_grouprl_grpo": ours}, {"adapter_grouprl_grpo": ratio}
    if loop:  # a Python loop over 1M samples: timed once
        t0 = time.perf_counter()
        core_algos.compute_grpo_outcome_advantage(tokens.clone(), mask, index)
        out["verl_grpo"] = time.perf_counter() - t0
    return out, paired


def _flat(rewards: torch.Tensor, t: int, seed: int = 2):
    """verl's flat view of ``rewards [P, G]`` with ragged completions of up to ``t`` tokens."""
    p, g = rewards.shape
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (p, g), generator=gen)
    mask = torch.arange(t)[None, None, :] < lengths[..., None]  # [P, G, T]
    tok = advantages.tokens.outcome_to_tokens(rewards, mask).reshape(p * g, t)
    return mask, lengths, tok, mask.reshape(p * g, t).float(), np.repeat(np.arange(p), g)


def paired_method(ours, theirs, peer: str, repeat: int) -> dict[str, float]:
    """``{"ours", peer, "speedup_vs_<peer>"}``: :func:`timeit_paired`'s medians and its
    median per-pair ratio."""
    a, b, ratio = timeit_paired(ours, theirs, repeat)
    return {"ours": a, peer: b, f"speedup_vs_{peer}": ratio}


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peer_methods(rewards: torch.Tensor, repeat: int, token_prompts: int, t: int) -> dict:
    """Issue-22 methods, ours beside the peers' own functions: ``{method: {ours, peer...}}``."""
    p, g = rewards.shape
    _, lengths, tok, m, index = _flat(rewards, t)
    base = torch.rand(p, generator=torch.Generator().manual_seed(3))
    out: dict[str, dict[str, float]] = {}

    def ours(name, **kw):
        return timeit(lambda: advantages.compute(name, rewards, **kw), repeat)

    verl_kw = dict(lengths=lengths, weighting="token", eps_mode="var", eps=1e-8)
    out["reinforce_pp_baseline"] = {"ours": ours("reinforce_pp_baseline", **verl_kw)}
    out["flash_reinforce"] = {"ours": ours("flash_reinforce")}
    out["grpo_passk"] = {"ours": ours("grpo_passk")}
    out["gpg"] = {"ours": ours("gpg", alpha="verl")}
    out["opo"] = {"ours": ours("opo", lengths=lengths)}
    r3 = torch.stack([rewards, rewards.roll(1, 0)], -1)  # two reward functions
    out["gdpo"] = {"ours": timeit(lambda: advantages.compute("gdpo", r3), repeat)}
    try:
        from verl.trainer.ppo import core_algos as c
    except ImportError:  # ours alone; with verl, these two are timed paired below
        out["reinforce_pp_global"] = {"ours": ours("reinforce_pp_global", **verl_kw)}
        out["remax"] = {"ours": ours("remax", baseline=base)}
        return out
    cfg = type("Cfg", (), {"get": lambda self, k, d=None: {"gamma": 1.0}.get(k, d), "gamma": 1.0})()
    out["reinforce_pp_baseline"]["verl"] = _once(
        lambda: c.compute_reinforce_plus_plus_baseline_outcome_advantage(tok.clone(), m, index)
    )
    out["reinforce_pp_global"] = paired_method(
        lambda: advantages.compute("reinforce_pp_global", rewards, **verl_kw),
        lambda: c.compute_reinforce_plus_plus_outcome_advantage(tok, m, config=cfg),
        "verl",
        repeat,
    )
    out["grpo_passk"]["verl"] = _once(
        lambda: c.compute_grpo_passk_outcome_advantage(tok, m, index, config=cfg)
    )
    out["gpg"]["verl"] = _once(lambda: c.compute_gpg_outcome_advantage(tok.clone(), m, index))
    out["opo"]["verl"] = _once(lambda: c.compute_opo_outcome_advantage(tok.clone(), m, index))
    per_sample = base.repeat_interleave(g)
    out["remax"] = paired_method(
        lambda: advantages.compute("remax", rewards, baseline=base),
        lambda: c.compute_remax_outcome_advantage(tok, per_sample, m),
        "verl",
        repeat,
    )
    prompts = torch.zeros(p * g, 1)
    att = torch.cat([torch.ones(p * g, 1), m], 1).long()
    nt = {"a": r3[..., 0].reshape(-1).numpy(), "b": r3[..., 1].reshape(-1).numpy()}
    gcfg = type(
        "Cfg", (), {"get": lambda self, k, d=None: {"gdpo_reward_keys": ["a", "b"]}.get(k, d)}
    )()
    out["gdpo"]["verl"] = _once(
        lambda: c.compute_gdpo_outcome_advantage(
            tok,
            m,
            index,
            config=gcfg,
            non_tensor_batch=nt,
            batch={"prompts": prompts, "attention_mask": att},
        )
    )
    out.update(token_methods(rewards[:token_prompts], repeat, t, c))
    return out


def token_methods(rewards: torch.Tensor, repeat: int, t: int, c) -> dict:
    """Token-level methods on a smaller batch (verl's OTB loops over groups, TIR over samples)."""
    p, g = rewards.shape
    mask, _, tok, m, index = _flat(rewards, t, seed=4)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(p, g, t, 16, generator=gen)
    logp_all = torch.log_softmax(logits, -1)
    old = logp_all[..., 0]
    spi = logp_all.exp().square().sum(-1)
    dense = -0.01 * torch.rand(p, g, t, generator=gen) * mask
    n = p * g
    kw = dict(old_logp=old, sum_pi_squared=spi, zero_collapsed=False)
    out = {}
    for name, fn in (
        ("optimal_token_baseline", c.compute_optimal_token_baseline_advantage),
        ("tir_optimal_token_baseline", c.compute_multi_turn_optimal_token_baseline_advantage),
    ):
        out[f"{name} (tokens)"] = {
            "ours": timeit(
                lambda nm=name: advantages.compute_tokens(nm, rewards, mask, **kw), repeat
            ),
            "verl": _once(lambda f=fn: f(tok, m, index, old.reshape(n, t), spi.reshape(n, t))),
        }
    cfg = type("Cfg", (), {"gamma": 0.99})()
    flat_tok = tok + dense.reshape(n, t)
    out["reinforce_pp_global (tokens, KL, gamma 0.99)"] = paired_method(
        lambda: advantages.compute_tokens(
            "reinforce_pp_global", rewards, mask, token_rewards=dense, gamma=0.99
        ),
        lambda: c.compute_reinforce_plus_plus_outcome_advantage(flat_tok, m, config=cfg),
        "verl",
        repeat,
    )
    out.update(openrlhf_methods(rewards, mask, dense, repeat))
    return out


def openrlhf_methods(rewards, mask, dense, repeat) -> dict:
    """OpenRLHF 0.11's own ``compute_advantages_and_returns`` (run from its installed source by
    tests/advantages/openrlhf_ref.py: it imports DeepSpeed, so it is not imported) on the same
    token batch, the KL folded into the reward with β = 0.01."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "advantages"))
    import openrlhf_ref as ref

    if not ref.available():
        return {}
    n, t = rewards.numel(), mask.shape[-1]
    kl = -dense.reshape(n, t) / 0.01  # the KL whose −0.01·KL is ``dense``
    am = mask.reshape(n, t)
    clamp = dict(eps_mode="var_clamp", ddof=0, eps=1e-8)
    pairs = (
        ("reinforce", "reinforce_pp_global", clamp),
        (
            "reinforce_baseline",
            "reinforce_pp_baseline",
            dict(token_rewards_as="return", zero_collapsed=False, **clamp),
        ),
        ("flash_reinforce", "flash_reinforce", dict(token_rewards_as="return")),
    )
    out = {}
    for theirs, name, kw in pairs:
        out[f"{name} (tokens, KL; OpenRLHF {theirs})"] = paired_method(
            lambda nm=name, k=kw: advantages.compute_tokens(
                nm, rewards, mask, token_rewards=dense, **k
            ),
            lambda th=theirs: ref.advantages(th, rewards, am, kl, 0.01),
            "openrlhf",
            repeat,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=131_072)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-verl-loop", action="store_true", help="skip verl's slow loop version")
    ap.add_argument("--no-methods", action="store_true", help="skip the peers' methods")
    ap.add_argument("--token-prompts", type=int, default=16_384, help="token-level batch P")
    ap.add_argument("--tokens", type=int, default=16, help="completion tokens T")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    ap.add_argument("--profile", nargs="*", default=[], metavar="NAME",
                    help="estimators whose operators to profile (torch.profiler, one call)")  # fmt: skip
    ap.add_argument("--malloc", choices=MALLOC_MODES, default="default",
                    help="glibc's allocator regime for both sides (MALLOC_MODES)")  # fmt: skip
    loadguard.add_arguments(ap)
    args = ap.parse_args()
    if not MALLOC_MODES[args.malloc]():
        ap.error(f"--malloc {args.malloc}: glibc's mallopt is not available here")
    _CLOCK[0] = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    load0 = loadguard.load_average()
    rewards = make_rewards(args.prompts, args.group)
    with_nan = rewards.clone()
    with_nan[torch.rand(rewards.shape, generator=torch.Generator().manual_seed(1)) < 0.05] = float(
        "nan"
    )

    seconds: dict[str, float] = {"floor_mean": timeit(lambda: rewards.mean(1), args.repeat)}
    # torch.sort of every group: what an order statistic costs through torch's sort (p90 uses
    # a sorting network instead, advantages.scale._row_quantile); a reference, not a target
    seconds["floor_sort"] = timeit(lambda: rewards.sort(1), args.repeat)
    seconds.update(part_floors(rewards, args.repeat))
    calls = {
        name: (lambda n=name: advantages.compute(n, rewards))
        for name in advantages.names()
        if not advantages.needs(name)  # opo, remax: timed with their inputs in ``methods``
    }
    calls["grpo+nan"] = lambda: advantages.compute("grpo", with_nan)
    calls["grpo+focal"] = lambda: advantages.compute("grpo", rewards, focal_gamma=0.5)
    calls["maxnorm_rloo+delta_res"] = lambda: advantages.compute(
        "maxnorm_rloo", rewards, delta_res=1e-2
    )
    for mode in advantages.transforms.VIRTUAL_MODES:
        calls[f"grpo+virtual_{mode}"] = lambda m=mode: advantages.compute(
            "grpo", rewards, virtual=m
        )
    ref = verl_vectorized(rewards)
    paired: dict[str, float] = {}  # ours paired with verl's vectorized call: ref/ours per pair
    verl_times = []
    if ref is None:
        seconds.update({name: timeit(fn, args.repeat) for name, fn in calls.items()})
    else:
        for name, (ours_s, ref_s, ratio) in timeit_rounds(calls, ref, args.repeat).items():
            seconds[name], paired[name] = ours_s, ratio
            verl_times.append(ref_s)
    if ref is not None:
        seconds["verl_grpo_vectorized"] = statistics.median(verl_times)
        more, more_paired = verl_paths(rewards, args.repeat, not args.no_verl_loop, ref)
        seconds.update(more)
        paired.update(more_paired)
    methods = (
        {}
        if args.no_methods
        else peer_methods(rewards, args.repeat, args.token_prompts, args.tokens)
    )

    profiles = {
        name: profile_call(lambda n=name: advantages.compute(n, rewards)) for name in args.profile
    }
    if args.profile:
        profiles["maxnorm_rloo+delta_res"] = profile_call(
            lambda: advantages.compute("maxnorm_rloo", rewards, delta_res=1e-2)
        )
    ours = [k for k in seconds if not k.startswith(("floor", "verl"))]
    direct = [k for k in ours if not k.startswith("adapter")]  # the targets are for these
    floor = seconds["floor_mean"]
    ratios = {k: {"x_floor": seconds[k] / floor} for k in ours}
    for k in ours:
        if "verl_grpo" in seconds:
            ratios[k]["speedup_vs_verl_grpo"] = seconds["verl_grpo"] / seconds[k]
        if k in paired:  # the median of the paired ratios (timeit_paired)
            ratios[k]["speedup_vs_verl_grpo_vectorized"] = paired[k]
    met = [ratios[k] for k in direct]
    targets = {
        "within_10x_floor": all(r["x_floor"] <= 10 for r in met),
        "ge_100x_verl_grpo": all(r.get("speedup_vs_verl_grpo", 1e9) >= 100 for r in met),
        "ge_2x_verl_grpo_vectorized": all(
            r.get("speedup_vs_verl_grpo_vectorized", 1e9) >= 2 for r in met
        ),
    }
    loadguard.write(
        {
            "benchmark": "advantages",
            "prompts": args.prompts,
            "group": args.group,
            "samples": args.prompts * args.group,
            "threads": args.threads,
            "clock": args.clock,
            "malloc": args.malloc,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "seconds": seconds,
            "ratios": ratios,
            "targets_met": targets,
            "below_2x_verl_grpo_vectorized": [
                k for k in direct if ratios[k].get("speedup_vs_verl_grpo_vectorized", 9) < 2
            ],
            "load_average": [load0, loadguard.load_average()],
            "methods": {
                k: {
                    **v,
                    **{  # a paired method keeps its per-pair ratio
                        f"speedup_vs_{peer}": v.get(f"speedup_vs_{peer}", v[peer] / v["ours"])
                        for peer in ("verl", "openrlhf")
                        if peer in v
                    },
                }
                for k, v in methods.items()
            },
            "profiles": profiles,
            "token_prompts": args.token_prompts,
            "tokens": args.tokens,
        },
        load0,
        out=args.out,
        allow_loaded=args.allow_loaded,
        indent=2,
    )


if __name__ == "__main__":
    main()
