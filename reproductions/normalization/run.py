"""Why GRPO needs normalisation, in miniature: rollouts to 80 % under homogeneous vs heterogeneous σ.

Calls :func:`grouprl.simulate.normalization.simulate` (the code behind ``grouprl simulate
normalization``) twice:

- **shared** (the test): 64 prompts × 8 answers, a softmax policy over shared random features
  (d = 512), P = 16 prompts × G = 8 answers per step, plain SGD; two pools with the same mean
  reward std at the start (homogeneous J = 0.116 everywhere; heterogeneous: half at 0.5, half
  at 0.02) and the control that stays homogeneous (identical: the homogeneous pool with one
  feature set for every prompt); REINFORCE (``dr_grpo``), global normalisation (``batch_std``), GRPO and IS-GRPO
  (GRPO + the ``sigma`` prompt sampler); lr tuned per (pool, method) on 20·√2^k, k = 0..7;
- **tabular** (the control the brief's "tabular prompts" asked for): one logit table per
  prompt, the same pools and methods, lr on 16·4^k, k = 0..7.

Per (pool, method): the best lr, rollouts to 80 % pool accuracy at it (mean ± std over seeds;
a run that never gets there counts as the budget), the gain over REINFORCE as the per-seed
ratio of rollouts (seeds are paired: a seed fixes the features, the uniform prompt draws and
the answer uniforms for every method and lr), its paired SE, and the same gain with the lr
chosen on seeds 0..S/2−1 and measured on the others (held out).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

HERE = Path(__file__).resolve().parent
# log_every = 2 steps (256 rollouts): fine enough to see how fast the pools' σ spread apart
FULL = {
    "shared": {"log_every": 2},
    "tabular": {
        "features": "tabular",
        "lrs": tuple(16.0 * 4.0**k for k in range(8)),
        "log_every": 2,
    },
    "identical": {"pools": ("identical",), "log_every": 2},
    "blocks": {
        "features": "blocks",
        "lrs": tuple(64.0 * 2.0**k for k in range(8)),
        "max_steps": 1000,
        "log_every": 2,
    },
}
QUICK = {
    "shared": {},
    "tabular": {"features": "tabular", "lrs": (64.0, 1024.0)},
    "identical": {"pools": ("identical",)},
    "blocks": {"features": "blocks", "lrs": (256.0, 1024.0)},
}
CV_AT = (0, 512, 1024, 2048, 4096, 8192)
"""Rollouts at which the table reports the spread (CV) of σ_x over the pool."""


def _config(res):
    from grouprl.simulate import normalization as nz

    return nz.NormalizationConfig(
        **{k: v for k, v in res.config.items() if k != "homogeneous_success"}
    )


def _runs(res) -> dict:
    """``{(pool, method): {"rollouts": [L·S]}}``, the shape the simulation's paired helpers read."""
    return {
        tuple(key.split("/")): {"rollouts": d["rollouts"].reshape(-1)}
        for key, d in res.data.items()
    }


def cv_at(cfg, sigma_cv: torch.Tensor, rollouts: int) -> float:
    """The pool's CV of σ_x (mean over seeds) at the last log at or before ``rollouts``; NaN
    when the runs had stopped (all reached the target) before then."""
    i = rollouts // (cfg.log_every * cfg.batch * cfg.group_size)
    return float(sigma_cv[i]) if i < sigma_cv.numel() else math.nan


def summarise(part: str, res) -> list[dict]:
    """One row per (pool, method) of one call."""
    from grouprl.diagnostics.compare import paired_stats
    from grouprl.simulate import normalization as nz

    cfg = _config(res)
    budget = cfg.max_steps * cfg.batch * cfg.group_size
    runs = _runs(res)
    half = cfg.seeds // 2
    rows = []
    for (pool, method), run in runs.items():
        li = nz.best_lr(cfg, run["rollouts"])
        ro = run["rollouts"].view(len(cfg.lrs), cfg.seeds)
        coll = res.data[f"{pool}/{method}"]["collapsed"][li]
        gain = nz.paired_gain(cfg, runs, pool, method)
        stats = paired_stats(gain["per_seed"].tolist())
        held = (
            nz.paired_gain(
                cfg, runs, pool, method, select=slice(0, half), evaluate=slice(half, None)
            )
            if half >= 1
            else {"log_gain": math.nan, "se": math.nan}
        )
        cv = torch.as_tensor(res.data[f"{pool}/{method}"]["sigma_cv"])[li]  # [T'']
        rows.append(
            {
                "part": part,
                "pool": pool,
                "method": method,
                "best lr": nz.pool_lrs(cfg, pool)[li],
                "best lr at grid edge": li in (0, len(cfg.lrs) - 1),
                "rollouts to 80%": C.ms(nz.censored(ro[li], budget).tolist()),
                "reached": int((~ro[li].isnan()).sum()),
                "collapsed groups": C.ms(coll.tolist()),
                "gain vs reinforce": gain["gain"],
                "log gain": gain["log_gain"],
                "paired SE": gain["se"],
                "paired": {
                    k: stats[k]
                    for k in ("positive", "negative", "zero", "ci_low", "ci_high", "diffs")
                },
                "held-out log gain": held["log_gain"],
                "held-out SE": held["se"],
                "sigma cv at": {str(r): cv_at(cfg, cv, r) for r in CV_AT},
                "sigma cv max": float(cv.max()),
                "grid": [float(v) for v in nz.censored(ro, budget).mean(1)],
                "grid lrs": list(nz.pool_lrs(cfg, pool)),
            }
        )
    return rows


def _per_seed(res, pool: str, method: str, base: str) -> list[float]:
    from grouprl.simulate import normalization as nz

    d = nz.paired_gain(_config(res), _runs(res), pool, method, base=base)["per_seed"]
    return [float(v) for v in d]


COMPARISONS = (
    ("heterogeneous", "grpo", "reinforce"),
    ("homogeneous", "grpo", "reinforce"),
    ("identical", "grpo", "reinforce"),
    ("heterogeneous", "is_grpo_exact", "reinforce"),
    ("heterogeneous", "is_grpo_exact", "grpo"),
    ("heterogeneous", "is_grpo_exact", "is_grpo"),
    ("homogeneous", "is_grpo_exact", "grpo"),
    ("homogeneous", "is_grpo_exact", "is_grpo"),
    ("heterogeneous", "batch_std", "reinforce"),
)
"""(pool, method, baseline) pairs the verdicts read; those absent from a part are skipped."""


def paired_verdicts(results: dict) -> list[dict]:
    """Paired statistics (``grouprl.diagnostics.compare.paired_stats``) of the per-seed log
    rollout ratios log(baseline / method), each at its own best lr: mean, SE (ddof 1), sign
    count, 95 % bootstrap interval, and the power statement: 2·SE is the smallest log gain
    whose estimate would clear 2 SE, 2.84·SE the one detected with 80 % probability (a normal
    paired mean: 2 + z_0.8 = 2 + 0.84)."""
    from grouprl.diagnostics.compare import paired_stats

    items = []
    for part, res in results.items():
        have = {tuple(k.split("/")) for k in res.data}
        for pool, method, base in COMPARISONS:
            if {(pool, method), (pool, base)} <= have:
                items.append((f"{part}: {pool}", f"{method} vs {base}",
                              _per_seed(res, pool, method, base)))  # fmt: skip
        if {("heterogeneous", "grpo"), ("homogeneous", "grpo")} <= have:
            het = _per_seed(res, "heterogeneous", "grpo", "reinforce")
            hom = _per_seed(res, "homogeneous", "grpo", "reinforce")
            items.append((f"{part}: heterogeneous − homogeneous", "grpo gain",
                          [a - b for a, b in zip(het, hom)]))  # fmt: skip
    if "shared" in results and "identical" in results:
        # the identical part draws every prompt's features from the same seed streams as the
        # shared part's pools, so its seeds pair with theirs
        het = _per_seed(results["shared"], "heterogeneous", "grpo", "reinforce")
        ide = _per_seed(results["identical"], "identical", "grpo", "reinforce")
        items.append(("shared: heterogeneous − identical", "grpo gain",
                      [a - b for a, b in zip(het, ide)]))  # fmt: skip
    rows = []
    for where, what, d in items:
        st = paired_stats(d)
        rows.append({"where": where, "comparison": what, **st,
                     "detectable at 2 SE": 2 * st["se"],
                     "detectable, 80 % power": 2.84 * st["se"]})  # fmt: skip
    return rows


def _claims(part: str, res) -> list[dict]:
    return [
        {"name": f"{c.name} [{part}]", "holds": c.holds, "detail": c.detail} for c in res.claims
    ]


def interior(rows: list[dict], part: str) -> dict:
    """Whether every best lr of ``part`` lies inside its grid (the tuning means something)."""
    edge = [f"{r['pool']}/{r['method']}" for r in rows if r["part"] == part
            and r["best lr at grid edge"]]  # fmt: skip
    return {
        "name": f"best_lr_inside_the_grid [{part}]",
        "holds": not edge,
        "detail": "every best lr is inside the grid" if not edge else f"at the edge: {edge}",
    }


HOMOGENEOUS_CV = 0.1
"""[OURS] a pool counts as still homogeneous while the CV of σ_x over its prompts is below 0.1
(σ_x within about ±10 % of the pool mean); the heterogeneous pool starts at 0.57."""


def homogeneity_checks(rows: list[dict]) -> list[dict]:
    """Per part, whether each pool meant to be homogeneous stays so: the largest CV of σ_x over
    the logged steps (mean over seeds, at REINFORCE's and GRPO's best lr; the logs run until
    every run of the method reached 80 % or the budget)."""
    out = []
    for part in dict.fromkeys(r["part"] for r in rows):
        for pool in ("homogeneous", "identical"):
            sel = [r for r in rows if (r["part"], r["pool"]) == (part, pool)
                   and r["method"] in ("reinforce", "grpo")]  # fmt: skip
            if not sel:
                continue
            cv = {r["method"]: r["sigma cv max"] for r in sel}
            worst = max(cv.values())
            out.append({
                "name": f"pool_stays_homogeneous [{part}: {pool}]",
                "holds": bool(worst < HOMOGENEOUS_CV),
                "detail": "largest CV of σ_x over the pool along training, at the best lr: "
                + ", ".join(f"{m} {v:.3f}" for m, v in cv.items())
                + f" (needs < {HOMOGENEOUS_CV} throughout)",
            })  # fmt: skip
    return out


def exact_checks(verdicts: list[dict]) -> list[dict]:
    """IS-GRPO's small lead (the paper's 7B result), read with ``is_grpo_exact`` (one σ draws
    and divides) against GRPO and against ``is_grpo`` on the heterogeneous pool."""
    out = []
    for v in verdicts:
        if v["where"].endswith(": heterogeneous") and v["comparison"] in (
            "is_grpo_exact vs grpo", "is_grpo_exact vs is_grpo"):  # fmt: skip
            part = v["where"].split(":")[0]
            base = v["comparison"].split(" vs ")[1]
            out.append({
                "name": f"is_grpo_exact_beats_{base}_under_heterogeneity [{part}]",
                "holds": bool(v["mean"] > 2 * v["se"]),
                "detail": f"log({base}/is_grpo_exact rollouts) = {v['mean']:+.3f} ± "
                f"{v['se']:.3f} ({v['positive']}+/{v['negative']}− of {v['n']} seeds; 95 % "
                f"bootstrap [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]; needs > 2 SE)",
            })  # fmt: skip
    return out


POOLS = ("homogeneous", "heterogeneous", "identical")
POOL_LINES = {"homogeneous": "--", "heterogeneous": "-", "identical": ":"}


def plot(payload: dict, data: dict):
    from grouprl.report.html import figure

    fig, ax = figure(5, 2, width=4.0)
    cfg = payload["config"]["shared"]
    step = cfg["batch"] * cfg["group_size"]
    shared = [r for r in payload["table"] if r["part"] in ("shared", "identical")]
    for j, pool in enumerate(POOLS):
        for r in (r for r in payload["table"] if r["pool"] == pool):
            if r["part"] == "blocks":
                ax[1, 4].plot(r["grid lrs"], r["grid"], "o-" if j else "s--", ms=3,
                              label=f"{pool[:3]} {r['method']}")  # fmt: skip
            elif r["part"] != "tabular":
                acc = torch.as_tensor(data[r["part"]][f"{pool}/{r['method']}"]["accuracy_best"])
                ax[0, j].plot(
                    torch.arange(acc.numel()) * step,
                    acc,
                    label=f"{r['method']} (lr {r['best lr']:.3g})",
                )
                ax[1, j].plot(r["grid lrs"], r["grid"], "o-", ms=3, label=r["method"])
            else:
                ax[1, 3].plot(
                    r["grid lrs"],
                    r["grid"],
                    "o-" if j else "s--",
                    ms=3,
                    label=f"{pool[:3]} {r['method']}",
                )
        ax[0, j].axhline(cfg["target"], color="grey", ls=":")
        xmax = max(r["rollouts to 80%"]["mean"] for r in shared if r["pool"] == pool)
        ax[0, j].set_xlim(0, 3 * xmax)
        ax[0, j].set_title(f"shared, {pool}: accuracy at the best lr", fontsize=9)
        ax[0, j].set_xlabel("rollouts"), ax[0, j].legend(fontsize=7)
        ax[1, j].set_xscale("log", base=2), ax[1, j].set_yscale("log")
        ax[1, j].set_title(f"shared, {pool}: rollouts to 80 % vs lr", fontsize=9)
        ax[1, j].set_xlabel("lr"), ax[1, j].legend(fontsize=7)
    cv_rows = [
        next(r for r in shared if (r["pool"], r["method"]) == (pool, method))
        for pool in POOLS
        for method in ("reinforce", "grpo")
    ]
    _sigma_cv_panel(ax[0, 3], cv_rows, data, cfg["log_every"] * step)
    ax[0, 3].set_xlim(0, 3 * max(r["rollouts to 80%"]["mean"] for r in shared))
    _cv_and_lr_titles(ax, 3, "CV over prompts of σ_x = √(J(1−J)), best lr", "tabular")
    blocks = [r for r in payload["table"] if r["part"] == "blocks"]
    bcfg = payload["config"].get("blocks")
    if blocks:
        cv_rows = [r for r in blocks if r["method"] in ("reinforce", "grpo")]
        _sigma_cv_panel(ax[0, 4], cv_rows, data, bcfg["log_every"] * step)
        ax[0, 4].set_xlim(0, 3 * max(r["rollouts to 80%"]["mean"] for r in blocks))
    _cv_and_lr_titles(ax, 4, "blocks: CV over prompts of σ_x, best lr", "blocks")
    return fig


def _cv_and_lr_titles(ax: Any, j: int, cv_title: str, part: str) -> None:
    """Column ``j``'s titles, axes and legends: the σ_x CV panel above, the rollouts-to-80 %
    against lr panel (log-log) below."""
    ax[0, j].set_title(cv_title, fontsize=9)
    ax[0, j].set_xlabel("rollouts"), ax[0, j].legend(fontsize=7)
    ax[1, j].set_xscale("log", base=2), ax[1, j].set_yscale("log")
    ax[1, j].set_title(f"{part}: rollouts to 80 % vs lr", fontsize=9)
    ax[1, j].set_xlabel("lr"), ax[1, j].legend(fontsize=6)


def _sigma_cv_panel(a: Any, rows: list[dict], data: dict, every: int) -> None:
    """The CV over prompts of σ_x along training for each row at its best lr (logged every
    ``every`` rollouts), one line style per pool."""
    for r in rows:
        li = r["grid lrs"].index(r["best lr"])
        cv = torch.as_tensor(data[r["part"]][f"{r['pool']}/{r['method']}"]["sigma_cv"])[li]
        a.plot(torch.arange(cv.numel()) * every, cv, ls=POOL_LINES[r["pool"]],
               label=f"{r['pool'][:3]} {r['method']}")  # fmt: skip


def _gain(r: dict) -> str:
    if r["method"] == "reinforce":
        return "1 (reference)"
    return f"{r['gain vs reinforce']:.3f} (log {r['log gain']:+.3f} ± {r['paired SE']:.3f})"


def _held(r: dict) -> str:
    if r["method"] == "reinforce" or r["held-out log gain"] != r["held-out log gain"]:
        return "–"
    return f"{r['held-out log gain']:+.3f} ± {r['held-out SE']:.3f}"


def spread_block(payload: dict) -> str:
    """The table of the pools' σ spread (CV at checkpoints); "" for results without it."""
    rows = [
        r for r in payload["table"] if "sigma cv at" in r and r["method"] in ("reinforce", "grpo")
    ]
    if not rows:
        return ""
    return (
        "**Spread of σ_x = √(J_x(1 − J_x)) over the pool** (coefficient of variation over the "
        "prompts, mean over seeds, at the method's best lr; – = every run had reached 80 % and "
        "stopped):\n\n"
        + C.markdown_table(
            [
                {"part": r["part"], "pool": r["pool"], "method": r["method"],
                 **{f"{int(k):,} rollouts": v for k, v in r["sigma cv at"].items()}}
                for r in rows
            ]
        )
    )  # fmt: skip


def verdict_block(payload: dict) -> str:
    """The paired verdicts with the study's power; "" for results without them."""
    if not payload.get("verdicts"):
        return ""
    return (
        "**Paired verdicts** (`grouprl.diagnostics.compare.paired_stats` on the per-seed "
        "log(baseline rollouts / method rollouts), each at its own best lr; positive = the method "
        "needs fewer; SE ddof 1; sign count +/−/0; 95 % percentile bootstrap; the last two "
        "columns are the study's power: the smallest log gain whose estimate clears 2 SE, and "
        "the one found with 80 % probability):\n\n"
        + C.markdown_table(
            [
                {"where": v["where"], "comparison": v["comparison"],
                 "log gain": f"{v['mean']:+.3f} ± {v['se']:.3f}",
                 "gain": f"{math.exp(v['mean']):.3f}×",
                 "signs": f"{v['positive']}/{v['negative']}/{v['zero']}",
                 "95 % bootstrap": f"[{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]",
                 "> 2 SE": "yes" if abs(v["mean"]) > 2 * v["se"] else "no",
                 "detectable at 2 SE": f"{v['detectable at 2 SE']:.3f} "
                 f"({math.exp(v['detectable at 2 SE']):.2f}×)",
                 "80 % power": f"{v['detectable, 80 % power']:.3f} "
                 f"({math.exp(v['detectable, 80 % power']):.2f}×)"}
                for v in payload["verdicts"]
            ]
        )
    )  # fmt: skip


def readme_block(payload: dict) -> str:
    """The README's generated block: per-part tables, the lr grids and the checks."""
    out = []
    for part in (p for p in ("shared", "tabular", "identical", "blocks") if p in payload["config"]):
        cfg = payload["config"][part]
        rows = [
            {
                "pool": r["pool"],
                "method": r["method"],
                "best lr": f"{r['best lr']:.3g}" + (" (edge)" if r["best lr at grid edge"] else ""),
                "rollouts to 80%": r["rollouts to 80%"],
                "reached": f"{r['reached']}/{len(payload['seeds'])}",
                "collapsed groups": r["collapsed groups"],
                "gain vs REINFORCE (paired)": _gain(r),
                "held-out log gain": _held(r),
            }
            for r in payload["table"]
            if r["part"] == part
        ]
        grid = [
            {"pool": r["pool"] + (f" (lr ÷ {cfg['batch']})" if r["pool"] == "identical" else ""),
             "method": r["method"],
             **{f"{lr:.3g}": round(v) for lr, v in zip(cfg["lrs"], r["grid"])}}
            for r in payload["table"] if r["part"] == part
        ]  # fmt: skip
        out.append(
            f"**{part}** (features {cfg['features']!r}"
            + (f", d = {cfg['dim']}" if cfg["features"] == "shared" else "")
            + (f", block m = {cfg['block_dim']}" if cfg["features"] == "blocks" else "")
            + f"; budget {cfg['max_steps'] * cfg['batch'] * cfg['group_size']:,} rollouts):\n\n"
            + C.markdown_table(rows)
            + "\n\nMean rollouts to 80 % at each lr (the grid; budget where not reached):\n\n"
            + C.markdown_table(grid)
        )
    out += [t for t in (spread_block(payload), verdict_block(payload)) if t]
    out.append(C.checks_block(payload["checks"]))
    out.append(
        f"({len(payload['seeds'])} seeds, paired; mean ± std over seeds unless marked; gains are "
        f"REINFORCE's rollouts over the method's, geometric mean over seeds; "
        f"{payload['seconds']:.0f} s wall on one thread, shared machine)"
    )
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = C.parser(__doc__.splitlines()[0], default_seeds=20).parse_args(argv)
    out = C.output_folder(args, HERE, readme_block)
    if out is None:
        return 0
    torch.set_num_threads(args.threads)
    from grouprl.simulate.normalization import simulate

    t0 = time.perf_counter()
    results = C.simulate_parts(simulate, QUICK if args.quick else FULL, args)
    rows = [r for part, res in results.items() for r in summarise(part, res)]
    verdicts = paired_verdicts(results)
    checks = [c for part, res in results.items() for c in _claims(part, res)]
    checks += exact_checks(verdicts) + homogeneity_checks(rows)
    payload = C.make_payload(
        "normalization",
        "Why GRPO needs normalization (arXiv 2601.23135): per-prompt std normalisation speeds "
        "learning over unnormalised REINFORCE, and the gain requires heterogeneous per-prompt "
        "reward std.",
        args,
        results,
        table=rows,
        verdicts=verdicts,
        checks=[*checks, *(interior(rows, part) for part in results)],
        seconds=time.perf_counter() - t0,
    )
    data = {part: res.data for part, res in results.items()}
    return C.publish(out, payload, plot(payload, data), readme_block)


if __name__ == "__main__":
    sys.exit(main())
