"""The MaxNorm accuracy reproduction's statistics against hand answers: the verdict rule, the
paired comparison, the interpolation that reads an arm at another arm's KL."""

import importlib.util
import math
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[2] / "reproductions" / "maxnorm" / "run.py"


def _load():
    spec = importlib.util.spec_from_file_location("repro_maxnorm", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_verdict_rule_by_hand():
    v = _load().verdict_of
    d = {"n": 5, "mean": 3.0, "se": 1.0, "positive": 5, "negative": 0}
    assert v(d) == "reproduced"  # 3 > 2·1 and 5/5 seeds above 0
    assert v({**d, "se": 2.0}).startswith("not reproduced")  # 3 < 2·2
    assert v({**d, "positive": 4, "negative": 1}).startswith("not reproduced")
    assert v({**d, "mean": -3.0, "positive": 0, "negative": 5}) == "reversed"
    assert v({**d, "se": float("nan")}).startswith("not reproduced")  # one seed: no SE


def test_comparisons_pair_by_seed_in_points():
    mod = _load()
    names = [*mod.PAPER_DELTA, "maxnorm_rloo", "maxnorm_dr_grpo"]
    runs = {m: [{"accuracy": 0.5}, {"accuracy": 0.6}, {"accuracy": 0.7}] for m in names}
    # MaxNorm-RLOO 1, 2 and 4 points above GRPO on seeds 0, 1, 2: mean 7/3, sd √(7/3)
    runs["maxnorm_rloo"] = [{"accuracy": a} for a in (0.51, 0.62, 0.74)]
    out = {c["comparison"]: c for c in mod.comparisons(runs)}
    st = out["MaxNorm-RLOO over grpo"]["stats"]
    assert st["diffs"] == pytest.approx([1.0, 2.0, 4.0])
    assert st["mean"] == pytest.approx(7 / 3)
    assert st["se"] == pytest.approx((7 / 3) ** 0.5 / 3**0.5)
    assert (st["positive"], st["negative"]) == (3, 0)
    assert out["MaxNorm-RLOO over grpo"]["verdict"] == "reproduced"  # 2.33 > 2·0.88


def test_interpolation_in_log_kl_by_hand():
    interp = _load()._interp
    # KL 0.01 → 40, 0.1 → 60: at KL 10^-1.5 (halfway in log) the accuracy is 50
    assert interp(10**-1.5, [0.1, 0.01], [60.0, 40.0]) == (pytest.approx(50.0), True)
    assert interp(1.0, [0.1, 0.01], [60.0, 40.0]) == (pytest.approx(60.0), False)  # clamped


def test_matched_kl_reads_the_baseline_at_maxnorms_kl_by_hand():
    mod = _load()
    # every baseline arm: KL 0.1/f at β·f and accuracy 0.8 + 0.1·log10(KL), linear in log KL,
    # so the interpolation is exact: at MaxNorm-RLOO's KL 0.07 the baseline reads
    # 0.8 + 0.1·log10(0.07) = 0.684510, and MaxNorm-RLOO's 0.75 is 6.549 points above it.
    key = "mean KL, all updated"
    tuning = {m: {"lr": 0.01, "runner-up lr": 0.03} for m in mod.FRONTIER}
    runs = {mod.TARGET: [{key: 0.07, "accuracy": 0.75}] * 2}
    for m in mod._baselines():
        for lr2 in (None, 0.03):
            for f in mod._factors():
                kl = 0.1 / f
                runs[mod._arm(m, f, lr2)] = [{key: kl, "accuracy": 0.8 + 0.1 * math.log10(kl)}] * 2
    out = mod.matched_kl(runs, tuning)
    assert len(out) == 2 * len(mod._baselines())
    want = 100 * (0.75 - (0.8 + 0.1 * math.log10(0.07)))
    for row in out:
        assert row["stats"]["diffs"] == pytest.approx([want, want])
        assert row["inside the β range"] == "2/2 seeds"
