"""Time grouprl's losses against the peers' own implementations on the same tensors; prints JSON.

    .venv/bin/python benchmarks/losses.py [--n 256] [--t 1024] [--repeats 21] [--rows SUBSTR ...]

Every row is one loss computed by grouprl (``losses.objective``: surrogate + aggregation, or
the KL term alone) and by each installed peer that ships it: verl 0.9.1's
``compute_policy_loss_*`` / ``kl_penalty`` + ``agg_loss``, TRL 1.16's own
``GRPOTrainer._compute_loss`` (and the experimental ``GMPOTrainer``'s) on a stand-in trainer
(its metric logging included, as it runs in TRL), OpenRLHF 0.11.2's ``PolicyLoss`` and
``compute_approx_kl`` (executed from its installed source). The peers are called through
``tests/losses/peer_calls.py``, the same calls the parity tests make. grouprl runs twice:
``grouprl`` with its statistics (``stats=True``, the default, what the trainer logs: ratio
mean/min/max, clip fractions, approx. KL, the branch values) and ``grouprl_loss_only``
(``stats=False``); ``peer_stats`` says whether the peer's own call computes statistics too.

Timed: forward + backward, a fresh leaf each call, float32, one torch thread, all in one
process. Each row runs its implementations interleaved (one call of each, ``--repeats``
rounds, after one warm-up call of each), so that they meet the same allocator state: on a
CPU a fresh ``[N, T]`` buffer costs more in page faults than the arithmetic on it, and
glibc's heap trimming makes that depend on what ran just before. Reported: the median
thread CPU time (``*_cpu_ms``: the work done, unaffected by waiting for a core on a loaded
machine) and the median wall time (``*_ms``); ``*_over_grouprl`` ratios are peer / grouprl
CPU time (> 1: grouprl is faster). ``equal`` says the two losses agree (relative 1e-4) on
these inputs. The load average before and after the run is in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from grouprl import losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "losses"))
import peer_calls

SMTM, TM = "seq_mean_token_mean", "token_mean"


def _time_row(
    impls: dict[str, Callable[[torch.Tensor], torch.Tensor]], base: torch.Tensor, repeats: int
) -> dict[str, float]:
    """Median wall and thread-CPU ms of forward + backward per implementation, interleaved,
    and each loss value."""

    def once(fn):
        lp = base.clone().requires_grad_()
        torch.manual_seed(0)  # Clip-Cov's random draw: the same on every side
        loss = fn(lp)
        loss.backward()
        return float(loss.detach())

    row: dict[str, float] = {}
    wall: dict[str, list[float]] = {name: [] for name in impls}
    cpu: dict[str, list[float]] = {name: [] for name in impls}
    for name, fn in impls.items():
        row[f"{name}_loss"] = once(fn)  # warm-up
    for _ in range(repeats):
        for name, fn in impls.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            once(fn)
            cpu[name].append((time.thread_time() - c0) * 1e3)
            wall[name].append((time.perf_counter() - t0) * 1e3)
    for name in impls:
        row[f"{name}_ms"] = statistics.median(wall[name])
        row[f"{name}_cpu_ms"] = statistics.median(cpu[name])
    return row


def _peers():
    """The peers' modules that are installed: {"verl": core_algos, "trl": True, "openrlhf": ns}."""
    out = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from verl.trainer.ppo import core_algos

        out["verl"] = core_algos
    except ImportError:
        pass
    try:
        import trl  # noqa: F401

        out["trl"] = True
    except ImportError:
        pass
    fns = peer_calls.openrlhf_functions()
    if fns is not None:
        out["openrlhf"] = fns
    return out


def _rows(x: dict, peers: dict) -> dict[str, dict[str, Callable]]:
    """Row name -> {implementation: fn(logp) -> scalar loss}."""
    old, ref, adv, mask, ent = x["old"], x["ref"], x["adv"], x["mask"], x["entropy"]
    adv_tok = adv[:, None] * mask

    def ours(surrogate, params, agg, **kw):
        def fn(stats):
            return lambda lp: losses.objective(
                lp, old, adv, mask, surrogate=surrogate, surrogate_params=params,
                aggregation=agg, stats=stats, **kw,
            ).loss  # fmt: skip

        return fn

    def verl(name, agg="token-mean", **cfg):
        if "verl" not in peers:
            return None
        fn, config = peers["verl"].get_policy_loss_fn(name), peer_calls.verl_config(**cfg)
        return lambda lp: fn(old, lp, adv_tok, mask, loss_agg_mode=agg, config=config)[0]

    def trl(**kw):
        if "trl" not in peers:
            return None
        return lambda lp: peer_calls.trl_loss(lp, old, ref, adv, mask, **kw)

    def orlhf(loss_type, token_level, dual=None, eps=(0.2, 0.28)):
        if "openrlhf" not in peers:
            return None
        fn = peers["openrlhf"].PolicyLoss(
            clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip=dual,
            token_level_loss=token_level, policy_loss_type=loss_type,
        )  # fmt: skip
        return lambda lp: fn(lp, old, adv_tok, action_mask=mask)[0]

    dapo = {"eps_low": 0.2, "eps_high": 0.28}
    gspo = {"eps_low": 3e-4, "eps_high": 4e-4}
    rows = {
        "ppo_clip (dual clip 3), token_mean": {
            "grouprl": ours("ppo_clip", {**dapo, "clip_ratio_c": 3.0}, TM),
            "verl": verl("vanilla", clip=(0.2, 0.28)),
            "trl": trl(loss_type="dapo", eps=(0.2, 0.28), beta=0.0, delta=3.0),
            "openrlhf": orlhf("ppo", True, dual=3.0),
        },
        "cispo, token_mean": {
            "grouprl": ours("cispo", {"eps_low": 1.0, "eps_high": 5.0}, TM),
            "verl": verl("cispo", clip=(1.0, 5.0)),
            "trl": trl(loss_type="cispo", eps=(0.2, 6.0), beta=0.0),
        },
        "gspo, seq_mean_token_mean": {
            "grouprl": ours("gspo", gspo, SMTM),
            "verl": verl("gspo", "seq-mean-token-mean", clip=(3e-4, 4e-4)),
            "trl": trl(loss_type="grpo", eps=(3e-4, 4e-4), beta=0.0, level="sequence"),
            "openrlhf": orlhf("gspo", False, eps=(3e-4, 4e-4)),
        },
        "sapo, seq_mean_token_mean": {
            "grouprl": ours("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, SMTM),
            "verl": verl("sapo", "seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05),
            "trl": trl(loss_type="sapo", eps=(0.2, 0.2), beta=0.0),
        },
        "gmpo, seq_mean_token_mean": {
            "grouprl": ours("gmpo", {"eps_low": 0.4, "eps_high": 0.4}, SMTM),
            "verl": verl("geo_mean", clip=(0.4, 0.4)),
            "trl": trl(trainer="gmpo", loss_type="grpo", eps=(0.4, 0.4), beta=0.0),
        },
        "vespo, token_mean": {
            "grouprl": ours("vespo", {}, TM),
            "trl": trl(loss_type="vespo", eps=(0.2, 0.2), beta=0.0),
        },
        "luspo (gspo, seq_mean_token_sum)": {
            "grouprl": ours("gspo", gspo, "seq_mean_token_sum"),
            "trl": trl(loss_type="luspo", eps=(3e-4, 4e-4), beta=0.0, level="sequence"),
        },
        "reinforce (verl gpg), token_mean": {
            "grouprl": ours("reinforce", {}, TM),
            "verl": verl("gpg"),
        },
        "clip_cov, token_mean": {
            "grouprl": ours("clip_cov", {}, TM),
            "verl": verl("clip_cov"),
        },
        "kl_cov, token_mean": {
            "grouprl": ours("kl_cov", {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 1.0}, TM),
            "verl": verl("kl_cov", kl_cov_ratio=2e-4, ppo_kl_coef=1.0),
        },
        "dppo_tv, token_mean": {
            "grouprl": ours("dppo_tv", {"clip_ratio_c": 3.0}, TM),
            "verl": verl("dppo_tv"),
        },
        "dppo_kl, token_mean": {
            "grouprl": ours("dppo_kl", {"clip_ratio_c": 3.0}, TM),
            "verl": verl("dppo_kl"),
        },
        "dro, token_mean": {
            "grouprl": ours("dro", {"beta": 0.1}, TM),
            "verl": verl("dro", dro_beta=0.1),
        },
        "ppo_clip + top-entropy mask 0.2, token_mean": {
            "grouprl": ours(
                "ppo_clip", {**dapo, "clip_ratio_c": 3.0}, TM, entropy=ent, top_entropy_quantile=0.2
            ),
            "trl": trl(
                loss_type="dapo", eps=(0.2, 0.28), beta=0.0, delta=3.0, quantile=0.2, entropy=ent
            ),
        },
        "ppo_clip + rho-weighted k3 KL, seq_mean_token_mean": {
            "grouprl": ours(
                "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, SMTM, ref_logp=ref, beta=0.04,
                kl_correction="ratio",
            ),
            "trl": trl(loss_type="grpo", eps=(0.2, 0.2), beta=0.04, bias_kl=True),
        },
    }  # fmt: skip
    rows["KL k3+ (value k3, gradient k2), token_mean"] = {
        "grouprl": lambda lp: losses.aggregate(TM, losses.kl("k3+", lp, ref), mask),
        "verl": None
        if "verl" not in peers
        else lambda lp: peers["verl"].agg_loss(
            peers["verl"].kl_penalty(lp, ref, "k3+"), mask, "token-mean"
        ),
    }
    rows["KL k3, straight-through unbiased gradient, token_mean"] = {
        "grouprl": lambda lp: losses.aggregate(
            TM, losses.kl_corrected("k3", lp, ref, old, mask, correction="straight_through"), mask
        ),
        "openrlhf": None
        if "openrlhf" not in peers
        else lambda lp: (
            (
                peers["openrlhf"].compute_approx_kl(
                    lp, ref, old, kl_estimator="k3", unbiased_gradient=True
                )
                * mask
            ).sum()
            / mask.sum()
        ),
    }
    out = {}
    for name, row in rows.items():
        impls = {k: v for k, v in row.items() if v is not None}
        ours_fn = impls.pop("grouprl")
        if name.startswith("KL "):  # the KL term alone: no statistics on either side
            out[name] = {"grouprl": ours_fn, **impls}
        else:
            out[name] = {"grouprl": ours_fn(True), "grouprl_loss_only": ours_fn(False), **impls}
    return out


PEERS_WITHOUT_STATS = {("reinforce (verl gpg), token_mean", "verl")}
"""(row, peer) pairs whose peer call computes no statistics (verl's gpg returns ``{}``); every
other policy-loss call of verl, TRL and OpenRLHF computes clip fractions or the approximate KL
(TRL also the entropy mean), and the KL rows compute none on either side."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--rows", nargs="*", default=[], help="only the rows whose name holds one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    n, t = args.n, args.t
    lengths = torch.randint(t // 4, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(n, t, generator=g) * 2 - 0.05
    base = (old + 0.1 * torch.randn(n, t, generator=g)).clamp(max=-1e-3)
    x = {
        "old": old,
        "ref": base + 0.1 * torch.randn(n, t, generator=g),
        "adv": torch.randn(n, generator=g),
        "mask": mask,
        "entropy": torch.rand(n, t, generator=g) * 3,
    }
    peers = _peers()
    results: dict[str, dict] = {}
    for name, impls in _rows(x, peers).items():
        if args.rows and not any(sel in name for sel in args.rows):
            continue
        row = _time_row(impls, base, args.repeats)
        for impl in impls:
            if impl.startswith("grouprl"):
                continue
            ours, theirs = row["grouprl_loss"], row[f"{impl}_loss"]
            with_stats = not name.startswith("KL ") and (name, impl) not in PEERS_WITHOUT_STATS
            row[f"{impl}_stats"] = with_stats
            row[f"{impl}_over_grouprl"] = row[f"{impl}_cpu_ms"] / row["grouprl_cpu_ms"]
            if "grouprl_loss_only_cpu_ms" in row:
                row[f"{impl}_over_grouprl_loss_only"] = (
                    row[f"{impl}_cpu_ms"] / row["grouprl_loss_only_cpu_ms"]
                )
            row[f"{impl}_equal"] = abs(ours - theirs) <= 1e-4 * max(1.0, abs(theirs))
        results[name] = row
    out = {
        "benchmark": "losses",
        "n": n,
        "t": t,
        "valid_tokens": int(mask.sum()),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "peers": sorted(peers),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "torch": torch.__version__,
        "results": results,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
