"""F-GRPO §5.1 in miniature: group size vs positive mass and retained positive mass, ± focal.

Calls :func:`grouprl.simulate.categorical.simulate` once with ``seeds`` independent policies
per (N, γ) (batched as rows), then reports mean ± std over the seeds of Q_pos(T), M_ret(T) and
min_t M_ret(t), per group size N and focal exponent γ ∈ {0 (GRPO), 1 (F-GRPO)}.

Full setting: the paper's policy (|A| = 128,000, 10,000 correct, anchor 5.0 / correct 3.0 /
wrong 0.0) for 1000 steps, N = 2 .. 16,384 (the paper goes to 131,072; one step there costs
~0.4 s on this CPU, so it is left out), 3 seeds, lr = 1.0 [OURS, see the simulate module].
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

HERE = Path(__file__).resolve().parent
FULL = {"group_sizes": (2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384), "steps": 1000}
QUICK = {
    "n_actions": 1_280,
    "n_correct": 100,
    "group_sizes": (8, 64, 1024),
    "steps": 60,
    "log_every": 10,
}


def summarise(cfg: dict, data: dict) -> list[dict]:
    """Rows (N, γ) with mean ± std over seeds; data rows are gamma-major (see simulate)."""
    rows = []
    s = cfg["seeds"]
    for n in cfg["group_sizes"]:
        d = data[str(n)]
        q, m = torch.as_tensor(d["q_pos"]), torch.as_tensor(d["m_ret"])  # [R, T']
        for k, gamma in enumerate(cfg["gammas"]):
            sl = slice(k * s, (k + 1) * s)
            rows.append(
                {
                    "N": n,
                    "gamma": gamma,
                    "Q_pos(0)": float(q[sl, 0].mean()),
                    "Q_pos(T)": C.ms(q[sl, -1].tolist()),
                    "M_ret(T)": C.ms(m[sl, -1].tolist()),
                    "min_t M_ret": C.ms(m[sl].min(dim=1).values.tolist()),
                }
            )
    return rows


def checks(rows: list[dict]) -> list[dict]:
    """The paper's three qualitative statements, judged on the seed means."""
    by = {(r["N"], r["gamma"]): r for r in rows}
    ns = sorted({r["N"] for r in rows})
    small = [n for n in ns if n <= 64] or ns[:1]
    worst = min(small, key=lambda n: by[(n, 0.0)]["M_ret(T)"]["mean"])
    g0 = by[(worst, 0.0)]
    focal_better = [
        n for n in small if by[(n, 1.0)]["M_ret(T)"]["mean"] > by[(n, 0.0)]["M_ret(T)"]["mean"]
    ]
    big = by[(ns[-1], 0.0)]
    return [
        {
            "name": "grpo_raises_q_pos_while_forgetting",
            "holds": g0["Q_pos(T)"]["mean"] > g0["Q_pos(0)"] and g0["M_ret(T)"]["mean"] < 0.999,
            "detail": f"N={worst}, γ=0: Q_pos {g0['Q_pos(0)']:.4f} -> "
            f"{C.fmt(g0['Q_pos(T)'])}, M_ret(T) {C.fmt(g0['M_ret(T)'])}",
        },
        {
            "name": "focal_keeps_more_m_ret_at_small_n",
            "holds": len(focal_better) == len(small),
            "detail": f"γ=1 keeps more M_ret than γ=0 at {len(focal_better)}/{len(small)} "
            f"of N in {small}",
        },
        {
            "name": "largest_n_keeps_m_ret",
            "holds": big["M_ret(T)"]["mean"] >= 0.999,
            "detail": f"N={ns[-1]}, γ=0: M_ret(T) = {C.fmt(big['M_ret(T)'], 6)}",
        },
    ]


def plot(cfg: dict, rows: list[dict], data: dict):
    from grouprl.report.html import figure

    fig, ax = figure(3, 1, width=4.4)
    for gamma, style in ((0.0, "o-"), (1.0, "s--")):
        sel = [r for r in rows if r["gamma"] == gamma]
        x = [r["N"] for r in sel]
        for j, key in enumerate(("Q_pos(T)", "M_ret(T)")):
            ax[0, j].errorbar(
                x,
                [r[key]["mean"] for r in sel],
                yerr=[r[key]["std"] for r in sel],
                fmt=style,
                ms=3,
                capsize=2,
                label=f"γ={gamma:g}" + (" (GRPO)" if gamma == 0 else " (F-GRPO)"),
            )
    ax[0, 0].axhline(rows[0]["Q_pos(0)"], color="grey", ls=":", label="Q_pos(0)")
    for j, t in enumerate(("Q_pos after T steps", "M_ret after T steps")):
        ax[0, j].set_xscale("log", base=2)
        ax[0, j].set_xlabel("group size N")
        ax[0, j].set_title(t + f" (mean ± std, {cfg['seeds']} seeds)", fontsize=9)
        ax[0, j].legend(fontsize=7)
    s = cfg["seeds"]
    ns = cfg["group_sizes"]
    for n in dict.fromkeys([ns[0], ns[len(ns) // 2], ns[-1]]):
        d = data[str(n)]
        m = torch.as_tensor(d["m_ret"])
        for k, gamma in enumerate(cfg["gammas"]):
            ax[0, 2].plot(
                d["steps"],
                m[k * s : (k + 1) * s].mean(0),
                ls="-" if k == 0 else "--",
                label=f"N={n}, γ={gamma:g}",
            )
    ax[0, 2].set_xlabel("step"), ax[0, 2].set_title("M_ret(t), seed mean", fontsize=9)
    ax[0, 2].legend(fontsize=7)
    return fig


def readme_block(payload: dict) -> str:
    """The README's generated block: the table and the checks of ``payload``."""
    rows = payload["table"]
    table = C.markdown_table(
        rows, ["N", "gamma", "Q_pos(0)", "Q_pos(T)", "M_ret(T)", "min_t M_ret"]
    )
    return (
        f"{table}\n\n{C.checks_block(payload['checks'])}\n\n"
        f"({len(payload['seeds'])} seeds, mean ± std; |A| = {payload['config']['n_actions']:,}, "
        f"{payload['config']['steps']} steps, lr {payload['config']['lr']:g}; "
        f"{payload['seconds']:.0f} s on one thread)"
    )


def main(argv: list[str] | None = None) -> int:
    args = C.parser(__doc__.splitlines()[0]).parse_args(argv)
    out = C.output_folder(args, HERE, readme_block)
    if out is None:
        return 0
    torch.set_num_threads(args.threads)
    from grouprl.simulate.categorical import simulate

    t0 = time.perf_counter()
    res = simulate(quick=args.quick, seed=0, seeds=args.seeds, **(QUICK if args.quick else FULL))
    cfg = res.config
    rows = summarise(cfg, res.data)
    chk = checks(rows)
    payload = {
        "name": "categorical",
        "claim": "F-GRPO §5.1: at moderate group size GRPO raises Q_pos while losing "
        "unsampled correct mass (M_ret < 1); the focal weight (γ = 1) retains more; "
        "very large N retains almost all.",
        "command": "python reproductions/categorical/run.py" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "seeds": list(range(args.seeds)),
        "config": cfg,
        "table": rows,
        "checks": chk,
        "seconds": time.perf_counter() - t0,
    }
    return C.publish(out, payload, plot(cfg, rows, res.data), readme_block)


if __name__ == "__main__":
    sys.exit(main())
