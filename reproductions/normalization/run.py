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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

HERE = Path(__file__).resolve().parent
FULL = {
    "shared": {},
    "tabular": {"features": "tabular", "lrs": tuple(16.0 * 4.0**k for k in range(8))},
    "identical": {"pools": ("identical",)},
}
QUICK = {
    "shared": {},
    "tabular": {"features": "tabular", "lrs": (64.0, 1024.0)},
    "identical": {"pools": ("identical",)},
}


def summarise(part: str, res) -> list[dict]:
    """One row per (pool, method) of one call."""
    from grouprl.simulate import normalization as nz

    cfg = nz.NormalizationConfig(
        **{k: v for k, v in res.config.items() if k != "homogeneous_success"}
    )
    budget = cfg.max_steps * cfg.batch * cfg.group_size
    runs = {
        tuple(key.split("/")): {"rollouts": d["rollouts"].reshape(-1)}
        for key, d in res.data.items()
    }
    half = cfg.seeds // 2
    rows = []
    for (pool, method), run in runs.items():
        li = nz.best_lr(cfg, run["rollouts"])
        ro = run["rollouts"].view(len(cfg.lrs), cfg.seeds)
        coll = res.data[f"{pool}/{method}"]["collapsed"][li]
        gain = nz.paired_gain(cfg, runs, pool, method)
        held = (
            nz.paired_gain(
                cfg, runs, pool, method, select=slice(0, half), evaluate=slice(half, None)
            )
            if half >= 1
            else {"log_gain": math.nan, "se": math.nan}
        )
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
                "held-out log gain": held["log_gain"],
                "held-out SE": held["se"],
                "grid": [float(v) for v in nz.censored(ro, budget).mean(1)],
                "grid lrs": list(nz.pool_lrs(cfg, pool)),
            }
        )
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


POOLS = ("homogeneous", "heterogeneous", "identical")


def plot(payload: dict, data: dict):
    from grouprl.report.html import figure

    fig, ax = figure(4, 2, width=4.0)
    cfg = payload["config"]["shared"]
    step = cfg["batch"] * cfg["group_size"]
    shared = [r for r in payload["table"] if r["part"] in ("shared", "identical")]
    for j, pool in enumerate(POOLS):
        for r in (r for r in payload["table"] if r["pool"] == pool):
            if r["part"] != "tabular":
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
    for pool, ls in zip(POOLS, ("--", "-", ":")):
        for method in ("reinforce", "grpo"):
            row = next(r for r in shared if (r["pool"], r["method"]) == (pool, method))
            li = row["grid lrs"].index(row["best lr"])
            cv = torch.as_tensor(data[row["part"]][f"{pool}/{method}"]["sigma_cv"])[li]
            x = torch.arange(cv.numel()) * cfg["log_every"] * step
            ax[0, 3].plot(x, cv, ls=ls, label=f"{pool[:3]} {method}")
    ax[0, 3].set_xlim(0, 3 * max(r["rollouts to 80%"]["mean"] for r in shared))
    ax[0, 3].set_title("CV over prompts of σ_x = √(J(1−J)), best lr", fontsize=9)
    ax[0, 3].set_xlabel("rollouts"), ax[0, 3].legend(fontsize=7)
    ax[1, 3].set_xscale("log", base=2), ax[1, 3].set_yscale("log")
    ax[1, 3].set_title("tabular: rollouts to 80 % vs lr", fontsize=9)
    ax[1, 3].set_xlabel("lr"), ax[1, 3].legend(fontsize=6)
    return fig


def _gain(r: dict) -> str:
    if r["method"] == "reinforce":
        return "1 (reference)"
    return f"{r['gain vs reinforce']:.3f} (log {r['log gain']:+.3f} ± {r['paired SE']:.3f})"


def _held(r: dict) -> str:
    if r["method"] == "reinforce" or r["held-out log gain"] != r["held-out log gain"]:
        return "–"
    return f"{r['held-out log gain']:+.3f} ± {r['held-out SE']:.3f}"


def readme_block(payload: dict) -> str:
    """The README's generated block: per-part tables, the lr grids and the checks."""
    out = []
    for part in ("shared", "tabular", "identical"):
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
            + f"; budget {cfg['max_steps'] * cfg['batch'] * cfg['group_size']:,} rollouts):\n\n"
            + C.markdown_table(rows)
            + "\n\nMean rollouts to 80 % at each lr (the grid; budget where not reached):\n\n"
            + C.markdown_table(grid)
        )
    out.append(C.checks_block(payload["checks"]))
    out.append(
        f"({len(payload['seeds'])} seeds, paired; mean ± std over seeds unless marked; gains are "
        f"REINFORCE's rollouts over the method's, geometric mean over seeds; "
        f"{payload['seconds']:.0f} s wall on one thread, shared machine)"
    )
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = C.parser(__doc__.splitlines()[0], default_seeds=10).parse_args(argv)
    out = C.output_folder(args, HERE, readme_block)
    if out is None:
        return 0
    torch.set_num_threads(args.threads)
    from grouprl.simulate.normalization import simulate

    t0 = time.perf_counter()
    results = C.simulate_parts(simulate, QUICK if args.quick else FULL, args)
    rows = [r for part, res in results.items() for r in summarise(part, res)]
    checks = [c for part, res in results.items() for c in _claims(part, res)]
    payload = C.make_payload(
        "normalization",
        "Why GRPO needs normalization (arXiv 2601.23135): per-prompt std normalisation speeds "
        "learning over unnormalised REINFORCE, and the gain requires heterogeneous per-prompt "
        "reward std.",
        args,
        results,
        table=rows,
        checks=[*checks, *(interior(rows, part) for part in results)],
        seconds=time.perf_counter() - t0,
    )
    data = {part: res.data for part, res in results.items()}
    return C.publish(out, payload, plot(payload, data), readme_block)


if __name__ == "__main__":
    sys.exit(main())
