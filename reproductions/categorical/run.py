"""F-GRPO §5.1 / App. J in miniature: group size vs positive mass and retained positive mass, ± focal.

The paper's categorical world (|A| = 128,000 actions, 10,000 correct; anchor logit 5, other
correct 3, wrong 0), its surrogate L = (1/N) Σ_j r̃_j π(a_j) and **AdamW at η = 1e-2** (App. J:
Hu et al.'s set-up, AdamW, with the lr raised from 1e-3), through
:func:`grouprl.simulate.categorical.simulate` (the code behind ``grouprl simulate
categorical``). Four calls ("parts"):

- **main**: AdamW, η = 1e-2, N = 2, 4, …, 131,072 (17 values), γ ∈ {0, 0.5, 1}, 1000 steps,
  4 seeds at every N (the paper's grid, γ = 0.5 added);
- **hu**: AdamW at Hu et al.'s η = 1e-3, N ∈ {8, 256, 8192, 65536}, γ ∈ {0, 1} (App. J: "at
  the lower learning rate, policy entropy after 1,000 steps remained above 4 even for
  N = 65,536");
- **wd0**: AdamW at η = 1e-2 without weight decay, N ∈ {8, 256, 8192, 131072}, γ ∈ {0, 1}
  (our [OURS] choice of torch's default decay 0.01 tested);
- **plain**: the labelled plain-gradient-ascent option at η = 2e3 and the paper's 1e-2, N ∈
  {8, 256, 8192}, γ ∈ {0, 1} (plain gradient ascent);
- **logprob**: AdamW at η = 1e-2 on the log-probability surrogate L = (1/N) Σ_j r̃_j log π(a_j)
  (the one LLM trainers differentiate) instead of the paper's probability surrogate, N ∈ {2, 16,
  256, 8192, 131,072}, γ ∈ {0, 1}: whether the collapse at large N is the surrogate's.

Per (part, η, N, γ): Q_pos(T), its gain, M_ret(T), min over t of M_ret, entropy H(T), mean ± std
over seeds; for γ > 0, M_ret minus the γ = 0 runs' M_ret at equal N and at the step where their
Q_pos gain equalled this row's (per-seed interpolation; unpaired SE, since each γ draws its own
groups). The checks are the parts of the paper's Fig. 2 (``fig2_claims``) for every part and η.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

HERE = Path(__file__).resolve().parent
GAMMAS = (0.0, 0.5, 1.0)
PAPER_NS = tuple(2**k for k in range(1, 18))  # 2 … 131,072
FULL = {
    "main": {"lr": 1e-2, "group_sizes": PAPER_NS, "gammas": GAMMAS},
    "hu": {"lr": 1e-3, "group_sizes": (8, 256, 8192, 65536), "gammas": (0.0, 1.0)},
    "wd0": {
        "lr": 1e-2,
        "weight_decay": 0.0,
        "group_sizes": (8, 256, 8192, 131072),
        "gammas": (0.0, 1.0),
    },
    "logprob": {
        "surrogate": "logprob",
        "lr": 1e-2,
        "group_sizes": (2, 16, 256, 8192, 131072),
        "gammas": (0.0, 1.0),
    },
    "plain": {
        "optimizer": "plain",
        "lr": 2e3,
        "lr_sweep": (1e-2,),
        "group_sizes": (8, 256, 8192),
        "gammas": (0.0, 1.0),
    },
}
# a hundredth of the actions, 60 steps: a schema check, not a result
_WORLD = {"n_actions": 1_280, "n_correct": 100, "steps": 60, "log_every": 10}
QUICK = {
    "main": {**_WORLD, "lr": 1e-2, "group_sizes": (2, 8, 64, 1024), "gammas": GAMMAS},
    "hu": {**_WORLD, "lr": 1e-3, "group_sizes": (8, 64), "gammas": (0.0, 1.0)},
    "wd0": {
        **_WORLD,
        "lr": 1e-2,
        "weight_decay": 0.0,
        "group_sizes": (8, 64),
        "gammas": (0.0, 1.0),
    },
    "logprob": {
        **_WORLD,
        "surrogate": "logprob",
        "lr": 1e-2,
        "group_sizes": (8, 64),
        "gammas": (0.0, 1.0),
    },
    "plain": {
        **_WORLD,
        "optimizer": "plain",
        "lr": 0.3,
        "lr_sweep": (1e-2,),
        "group_sizes": (8, 64),
        "gammas": (0.0, 1.0),
    },
}
CURVE_NS = (2, 256, 8192, 131072)
"""The group sizes whose seed-mean curves are kept for the figure (F-GRPO Fig. 2a/b's)."""


def _runs(cur: dict, s: int, k: int, key: str) -> torch.Tensor:
    """``[S, T']`` the seeds of γ index ``k`` (rows are gamma-major)."""
    return torch.as_tensor(cur[key])[k * s : (k + 1) * s]


def _se(x: torch.Tensor) -> float:
    return float(x.std() / x.numel() ** 0.5) if x.numel() > 1 else 0.0


def _seeds(cfg: dict, n: int) -> int:
    cut = cfg.get("one_seed_from")
    return 1 if cut is not None and n >= cut else cfg["seeds"]


def _by_lr(cfg: dict, data: dict) -> dict[str, dict]:
    curves = {f"{cfg['lr']:g}": {k: v for k, v in data.items() if k != "lr_sweep"}}
    curves.update(data["lr_sweep"])
    return curves


def summarise(cfg: dict, part: str, data: dict) -> list[dict]:
    """Rows (part, η, N, γ): mean ± std over seeds, and the focal rows' excess over γ = 0 at
    equal N and at equal Q_pos gain (mean, unpaired SE)."""
    from grouprl.simulate.categorical import matched_reference

    rows = []
    for eta, by_n in _by_lr(cfg, data).items():
        for n_key, cur in by_n.items():
            n = int(n_key)
            s = _seeds(cfg, n)
            q0, m0 = _runs(cur, s, 0, "q_pos"), _runs(cur, s, 0, "m_ret")
            for k, gamma in enumerate(cfg["gammas"]):
                q, m = _runs(cur, s, k, "q_pos"), _runs(cur, s, k, "m_ret")
                h, anc = _runs(cur, s, k, "entropy"), _runs(cur, s, k, "anchor")
                row = {
                    "part": part,
                    "optimizer": cfg["optimizer"],
                    "surrogate": cfg.get("surrogate", "prob"),
                    "wd": cfg["weight_decay"] if cfg["optimizer"] == "adamw" else None,
                    "eta": float(eta),
                    "N": n,
                    "gamma": gamma,
                    "seeds": s,
                    "Q_pos(0)": float(q[:, 0].mean()),
                    "Q_pos(T)": C.ms(q[:, -1].tolist()),
                    "Q_pos gain": C.ms((q[:, -1] - q[:, 0]).tolist()),
                    "M_ret(T)": C.ms(m[:, -1].tolist()),
                    "min_t M_ret": C.ms(m.min(1).values.tolist()),
                    "H(T)": C.ms(h[:, -1].tolist()),
                    "π_anchor(T)": C.ms(anc[:, -1].tolist()),
                    "M_ret − γ=0 (same N)": float("nan"),
                    "SE same N": float("nan"),
                    "M_ret − γ=0 at equal gain": float("nan"),
                    "SE": float("nan"),
                }
                if k > 0:
                    row["M_ret − γ=0 (same N)"] = float(m[:, -1].mean() - m0[:, -1].mean())
                    row["SE same N"] = (_se(m[:, -1]) ** 2 + _se(m0[:, -1]) ** 2) ** 0.5
                    target = float((q[:, -1] - q[:, 0]).mean())
                    ref = matched_reference(q0, m0, target)
                    ok = ref[~ref.isnan()]
                    if ok.numel():
                        row["M_ret − γ=0 at equal gain"] = float(m[:, -1].mean() - ok.mean())
                        row["SE"] = (_se(m[:, -1]) ** 2 + _se(ok) ** 2) ** 0.5
                rows.append(row)
    return rows


def curves_for_figure(cfg: dict, data: dict) -> dict:
    """Seed-mean Q_pos(t) and M_ret(t) per γ at :data:`CURVE_NS` (those the grid has)."""
    out = {}
    for n in CURVE_NS:
        cur = data.get(str(n))
        if cur is None:
            continue
        s = _seeds(cfg, n)
        out[str(n)] = {
            "steps": [int(x) for x in cur["steps"]],
            **{
                f"{key}_g{g:g}": _runs(cur, s, k, key).mean(0).tolist()
                for key in ("q_pos", "m_ret")
                for k, g in enumerate(cfg["gammas"])
            },
        }
    return out


def _claims(part: str, result) -> list[dict]:
    return [
        {"name": f"{part}: {c.name}", "holds": c.holds, "detail": c.detail} for c in result.claims
    ]


def _plot_vs_n(ax, rows, part, eta, key, title, gammas=GAMMAS, log=False):
    """Median over seeds (line) and every seed (dots) vs N."""
    for k, gamma in enumerate(gammas):
        sel = [r for r in rows if (r["part"], r["eta"], r["gamma"]) == (part, eta, gamma)]
        if not sel:
            continue
        x = [r["N"] for r in sel]
        style = ("o-", "s--", "^:")[k % 3]
        med = [statistics.median(r[key]["values"]) for r in sel]
        line = ax.plot(x, med, style, ms=3, label=f"{part} η={eta:g} γ={gamma:g}")[0]
        xs = [r["N"] for r in sel for _ in r[key]["values"]]
        ax.scatter(xs, [v for r in sel for v in r[key]["values"]], s=5, alpha=0.4,
                   color=line.get_color())  # fmt: skip
    ax.set_xscale("log", base=2), ax.set_xlabel("group size N")
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9), ax.legend(fontsize=6)


def plot(payload: dict):
    """The figure, from ``payload`` (results.json) alone: ``--figure-only`` redraws it.

    Top: F-GRPO Fig. 2 (a) Q_pos(t), (b) M_ret(t) at a few N (solid γ = 0, dashed γ = 1), (c)
    final Q_pos and M_ret vs N. Bottom: entropy vs N; M_ret(T) of the other parts vs N.
    """
    from grouprl.report.html import figure

    rows, eta = payload["table"], payload["config"]["main"]["lr"]
    fig, ax = figure(3, 2, width=4.4)
    for i, (n, cur) in enumerate(payload["curves"].items()):
        for key, a in (("q_pos", ax[0, 0]), ("m_ret", ax[0, 1])):
            for g, style in ((0, "-"), (1, "--")):
                a.plot(cur["steps"], cur[f"{key}_g{g}"], style, color=f"C{i}",
                       label=f"N={n}" if g == 0 else None)  # fmt: skip
    ax[0, 0].set_title("(a) Q_pos(t), AdamW η=1e-2 (dashed γ=1)", fontsize=9)
    ax[0, 1].set_title("(b) M_ret(t) (dashed γ=1)", fontsize=9)
    for a in ax[0, :2]:
        a.set_xlabel("step"), a.legend(fontsize=6)
    _plot_vs_n(ax[0, 2], rows, "main", eta, "M_ret(T)", "(c) M_ret(T) vs N")
    _plot_vs_n(ax[1, 0], rows, "main", eta, "Q_pos(T)", "(c) Q_pos(T) vs N")
    _plot_vs_n(ax[1, 1], rows, "main", eta, "H(T)", "entropy H(T), nats (H(0) = 10.78)")
    for part in ("hu", "wd0", "logprob", "plain"):
        for e in sorted({r["eta"] for r in rows if r["part"] == part}):
            _plot_vs_n(ax[1, 2], rows, part, e, "M_ret(T)", "M_ret(T), other parts",
                       gammas=(0.0,))  # fmt: skip
    return fig


def readme_block(payload: dict) -> str:
    """The README's generated block: the main table, the other parts, the checks."""
    rows = payload["table"]
    main_eta = payload["config"]["main"]["lr"]
    cols = [
        "N", "gamma", "Q_pos(T)", "Q_pos gain", "M_ret(T)", "min_t M_ret",
        "M_ret − γ=0 (same N)", "SE same N", "M_ret − γ=0 at equal gain", "SE", "H(T)",
    ]  # fmt: skip
    main = C.markdown_table([r for r in rows if r["part"] == "main"], cols)
    other_rows = [r for r in rows if r["part"] != "main"]
    others = C.markdown_table(
        other_rows,
        [
            "part",
            "optimizer",
            "surrogate",
            "wd",
            "eta",
            *cols[:6],
            "M_ret − γ=0 (same N)",
            "SE same N",
            "H(T)",
        ],
    )
    what = {
        "hu": "hu: Hu et al.'s η = 1e-3",
        "wd0": "wd0: no weight decay",
        "logprob": "logprob: the log-probability surrogate",
        "plain": "plain: plain gradient ascent, labelled, not the papers' optimiser",
    }
    ran = [p for p in what if any(r["part"] == p for r in other_rows)]
    other_block = (
        f"**Other parts** ({'; '.join(what[p] for p in ran)}):\n\n{others}\n\n" if ran else ""
    )
    not_run = [p for p in what if p not in ran]
    cfg = payload["config"]["main"]
    # an older results.json has no optimizer field: that run was plain ascent
    opt = cfg.get("optimizer", "plain")
    label = "AdamW" if opt == "adamw" else "plain gradient ascent (labelled, not the papers')"
    return (
        f"**main: {label}, η = {main_eta:g}**, mean ± std over "
        f"{cfg['seeds']} seeds at every N; the γ rows' excess over γ = 0 at the same N and at "
        f"equal Q_pos gain, each with its unpaired SE.\n\n{main}\n\n{other_block}"
        f"{C.checks_block(payload['checks'])}\n\n"
        f"({len(payload['seeds'])} seeds; |A| = {cfg['n_actions']:,}, {cfg['steps']} steps; "
        f"{payload['seconds']:.0f} s wall on {payload.get('threads', 1)} thread(s), shared machine"
        + "".join(
            f", then --add {k} {v:.0f} s" for k, v in payload.get("seconds_added", {}).items()
        )
        + (f"; parts not run: {', '.join(not_run)}" if not_run else "")
        + ")"
    )


def add_parts(args) -> int:
    """``--add``: run the named parts and merge them into the saved results.json (a part run
    before is replaced); the command recorded names every part the file then holds."""
    out = args.out or HERE
    payload = C.load_results(out)
    if payload.get("quick") != args.quick or len(payload["seeds"]) != args.seeds:
        raise SystemExit(
            f"{out / 'results.json'} holds a run with quick={payload.get('quick')} and "
            f"{len(payload['seeds'])} seeds; --add must match them (--seeds, --quick)"
        )
    torch.set_num_threads(args.threads)
    from grouprl.simulate.categorical import simulate

    t0 = time.perf_counter()
    grid = QUICK if args.quick else FULL
    results = C.simulate_parts(simulate, {p: grid[p] for p in args.add}, args)
    keep = [r for r in payload["table"] if r["part"] not in results]
    new_rows = [r for part, res in results.items() for r in summarise(res.config, part, res.data)]
    payload["table"] = keep + new_rows
    payload["checks"] = [
        c for c in payload["checks"] if not any(c["name"].startswith(f"{p}:") for p in results)
    ] + [c for part, res in results.items() for c in _claims(part, res)]
    payload["config"].update({part: res.config for part, res in results.items()})
    parts = [p for p in FULL if p in payload["config"]]
    base = "python reproductions/categorical/run.py" + (" --quick" if args.quick else "")
    payload["command"] = base if parts == list(FULL) else f"{base} --parts {' '.join(parts)}"
    payload["seconds_added"] = {
        **payload.get("seconds_added", {}),
        " ".join(args.add): time.perf_counter() - t0,
    }
    C.publish(out, payload, plot(payload), readme_block)
    # the README block as --readme-only renders it: from the file (NaN saved as null)
    C.update_readme(out, readme_block(C.load_results(out)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = C.parser(__doc__.splitlines()[0], default_seeds=4)
    parser.add_argument(
        "--figure-only", action="store_true", help="only redraw figure.png from results.json"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=list(FULL), default=list(FULL),
        help="the parts to run (default: all; main is required: the figure and the Fig. 2 "
        "checks read it)",
    )  # fmt: skip
    parser.add_argument(
        "--add", nargs="+", choices=[p for p in FULL if p != "main"], default=None,
        help="run only these parts and add them to the existing results.json (its other "
        "parts' rows, checks and curves kept as they are)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.add:
        return add_parts(args)
    if "main" not in args.parts:
        parser.error(f"--parts must include main (the figure reads it); got {args.parts}")
    if args.figure_only:
        folder = args.out or HERE
        plot(C.load_results(folder)).savefig(folder / "figure.png", dpi=110)
        return 0
    out = C.output_folder(args, HERE, readme_block)
    if out is None:
        return 0
    torch.set_num_threads(args.threads)
    from grouprl.simulate.categorical import simulate

    t0 = time.perf_counter()
    grid = QUICK if args.quick else FULL
    results = C.simulate_parts(simulate, {k: v for k, v in grid.items() if k in args.parts}, args)
    rows = [r for part, res in results.items() for r in summarise(res.config, part, res.data)]
    checks = [c for part, res in results.items() for c in _claims(part, res)]
    main_res = results["main"]
    payload = C.make_payload(
        "categorical",
        "F-GRPO §5.1 / Fig. 2: Q_pos rises at every N; M_ret is lowest at intermediate N "
        "(small and very large N retain positive mass; N = 131,072 keeps M_ret ≈ 1 throughout); "
        "the focal weight (γ = 1) retains more M_ret, most in the concentration zone.",
        args,
        results,
        table=rows,
        checks=checks,
        curves=curves_for_figure(main_res.config, main_res.data),
        seconds=time.perf_counter() - t0,
        threads=args.threads,
    )
    if args.parts != list(FULL):
        payload["command"] += " --parts " + " ".join(args.parts)
    return C.publish(out, payload, plot(payload), readme_block)


if __name__ == "__main__":
    sys.exit(main())
