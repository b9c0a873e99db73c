"""The trainer's prompt source: a stream, or a finite pool and a prompt sampler (IS-GRPO)."""

from __future__ import annotations

import math

import pytest
import torch
from train_toy import ToyTask, make

from grouprl.tasks.base import Example, Task
from grouprl.train.config import ConfigError, load_config
from grouprl.train.loop import train
from grouprl.train.prompts import DEFAULT_POOL, Prompts, prompt_seed
from grouprl.train.sinks import read_jsonl
from grouprl.train.state import setup


class _Rows(Task):
    """A finite dataset task of ``n`` rows that cycles through them, as MathTask does."""

    name = "rows"

    def __init__(self, n: int) -> None:
        self.n, self.config = n, {"n": n}

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return [Example(f"rows/{i % self.n}", f"q{i % self.n}", "a") for i in range(n)]

    def verify(self, completion: str, reference) -> float:
        return 0.0


def test_uniform_without_a_pool_is_the_task_stream():
    task = ToyTask()
    p = Prompts(task, sampler="uniform", pool_size=0, seed=3)
    assert p.mode == "stream" and p.state_dict() is None and p.metrics() == {}
    examples, idx = p.draw(4, step=7, round_=1)
    assert idx is None
    assert [e.id for e in examples] == [
        e.id for e in task.examples("train", 4, prompt_seed(3, 7, 1))
    ]


def test_a_pool_keeps_each_dataset_row_once_and_sigma_gets_a_default_pool():
    assert len(Prompts(_Rows(5), sampler="uniform", pool_size=64, seed=0).pool) == 5
    p = Prompts(ToyTask(), sampler="sigma", pool_size=0, seed=0)
    # ToyTask's ids are unique per index: the default pool is DEFAULT_POOL examples
    assert p.mode == "pool" and len(p.pool) == DEFAULT_POOL == p.sampler.pool_size


def test_observe_feeds_each_groups_std_to_the_sampler():
    p = Prompts(_Rows(6), sampler="sigma", pool_size=6, seed=0)
    examples, idx = p.draw(3, step=1, round_=0)
    assert [e.id for e in examples] == [f"rows/{i}" for i in idx.tolist()]
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 1, math.nan, 1]])
    p.observe(idx, rewards)
    # hand values, ddof 1: [1,0,0,0] -> 0.5; constant -> 0; [0,1,1] -> sqrt(1/3)
    want = {0: 0.5, 1: 0.0, 2: math.sqrt(1 / 3)}
    for row, i in enumerate(idx.tolist()):
        if list(idx.tolist()).count(i) == 1:  # a prompt drawn twice is averaged by the EMA
            assert float(p.sampler.sigma_hat[i]) == pytest.approx(want[row], abs=1e-6)
    assert int(p.sampler.visits.sum()) == 3


def test_draws_depend_on_seed_step_round_only():
    a = Prompts(_Rows(50), sampler="uniform", pool_size=50, seed=1)
    b = Prompts(_Rows(50), sampler="uniform", pool_size=50, seed=1)
    assert torch.equal(a.draw(8, 4, 0)[1], b.draw(8, 4, 0)[1])
    assert not torch.equal(a.draw(8, 4, 0)[1], a.draw(8, 5, 0)[1])
    assert len(set(a.draw(8, 4, 0)[1].tolist())) == 8  # uniform: no repeats within a draw


def test_is_grpo_trains_from_a_pool_with_the_sigma_sampler(tmp_path):
    cfg, inj = make(tmp_path, "algorithm.preset=is_grpo", "sampling.pool_size=12",
                    "optim.steps=4")  # fmt: skip
    run = setup(cfg, **inj)
    assert run.preset.estimator == "grpo" and run.preset.sampler == "sigma"
    assert run.prompts.mode == "pool" and run.prompts.sampler.pool_size == 12
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all("sampler/effective_pool" in r for r in rows)
    assert 0 < rows[-1]["sampler/visited_frac"] <= 1
    ids = {r["prompt_id"] for r in read_jsonl(tmp_path / "rewards.jsonl")}
    pool_ids = {e.id for e in run.prompts.pool}
    assert ids <= pool_ids  # every trained prompt came from the pool


def test_is_grpo_resume_equals_no_resume(tmp_path):
    common = ["algorithm.preset=is_grpo", "sampling.pool_size=8", "optim.steps=5", "run.every=2"]
    cfg, inj = make(tmp_path / "full", *common)
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "parts", *common, "optim.steps=2")
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "parts", *common, "run.resume=true")
    train(cfg, **inj)

    def rows(d):
        return [{k: v for k, v in r.items() if not k.startswith("time/")}
                for r in read_jsonl(d / "metrics.jsonl")]  # fmt: skip

    assert rows(tmp_path / "parts") == rows(tmp_path / "full")


def test_pool_and_sampler_config_errors():
    with pytest.raises(ConfigError, match=r"sampling\.pool_size must be 0 .* at least"):
        load_config(None, ["sampling.pool_size=4", "sampling.prompts_per_step=8"])
    with pytest.raises(
        ConfigError, match=r"unknown sampler 'bogus'; valid: uniform, sigma, curriculum"
    ):
        load_config(None, ["algorithm.sampler=bogus"])


def test_is_grpo_and_its_baseline_train_on_the_same_pool(tmp_path):
    # is_grpo_baseline is GRPO over is_grpo's pool (Preset.pool_size), drawn
    # uniformly; plain grpo streams fresh prompts
    runs = {}
    for name in ("is_grpo", "is_grpo_baseline", "is_grpo_exact", "grpo"):
        cfg, inj = make(tmp_path / name, f"algorithm.preset={name}")
        runs[name] = setup(cfg, **inj)
    ids = {n: [e.id for e in r.prompts.pool] if r.prompts.pool else None for n, r in runs.items()}
    assert len(ids["is_grpo"]) == 1024 and ids["is_grpo"] == ids["is_grpo_baseline"]
    assert ids["is_grpo_exact"] == ids["is_grpo"]
    assert runs["is_grpo_baseline"].prompts.sampler.name == "uniform"
    assert runs["grpo"].prompts.mode == "stream"
    # sampling.pool_size still overrides the preset's
    cfg, inj = make(tmp_path / "p64", "algorithm.preset=is_grpo_baseline", "sampling.pool_size=64")
    assert len(setup(cfg, **inj).prompts.pool) == 64


def test_is_grpo_exact_weights_each_group_by_its_draw(tmp_path, monkeypatch):
    # The advantages of step 2 get group_weight = 1/(|pool|·p_x) with p the sampler's
    # probabilities *before* step 2's draw (after step 1's observations), recomputed here
    # from a snapshot of the sampler and the step's own generator seed.
    from grouprl import advantages, sampling
    from grouprl.train import loop

    seen = []
    real = advantages.compute

    def spy(*args, **kw):
        seen.append(kw.get("group_weight"))
        return real(*args, **kw)

    monkeypatch.setattr(loop.advantages, "compute", spy)
    cfg, inj = make(tmp_path, "algorithm.preset=is_grpo_exact", "sampling.pool_size=16")
    run = setup(cfg, **inj)
    run.step = 1
    loop.train_step(run)
    assert torch.equal(seen[0], torch.ones(4, dtype=torch.float64))  # unvisited: uniform
    before = sampling.load(run.prompts.sampler.state_dict())
    idx = before.sample(4, torch.Generator().manual_seed(prompt_seed(cfg.run.seed, 2, 0)))
    want = 1.0 / (16 * before.probabilities()[idx])
    run.step = 2
    loop.train_step(run)
    assert torch.allclose(seen[1], want, rtol=0, atol=1e-12)
    assert not torch.allclose(want, torch.ones_like(want))  # the sampler has moved
    # is_grpo (no sampler_weight) passes none
    cfg, inj = make(tmp_path / "plain", "algorithm.preset=is_grpo", "sampling.pool_size=16")
    run = setup(cfg, **inj)
    run.step = 1
    loop.train_step(run)
    assert seen[-1] is None


def test_curriculum_with_dynamic_sampling_draws_each_prompt_once_per_step(tmp_path, monkeypatch):
    cfg, inj = make(tmp_path, "algorithm.preset=dapo", "algorithm.sampler=curriculum",
                    "sampling.pool_size=12", "optim.steps=4", "sampling.max_resample_tries=3",
                    "sampling.curriculum_revisit=2")  # fmt: skip
    run = setup(cfg, **inj)
    assert run.prompts.sampler.name == "curriculum" and run.prompts.sampler.revisit == 2
    drawn: dict[int, list[int]] = {}
    real = Prompts.draw

    def spy(self, n, step, round_):
        examples, idx = real(self, n, step, round_)
        drawn.setdefault(step, []).extend(idx.tolist())
        return examples, idx

    monkeypatch.setattr(Prompts, "draw", spy)
    train(cfg, **inj)
    assert len(drawn) == 4
    assert any(len(v) > cfg.sampling.prompts_per_step for v in drawn.values())  # resampled
    assert all(len(v) == len(set(v)) for v in drawn.values())  # never twice in a step
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all("sampler/eligible_frac" in r for r in rows if "loss/total" in r)


def test_curriculum_resume_equals_no_resume(tmp_path):
    common = ["algorithm.preset=dapo", "algorithm.sampler=curriculum", "sampling.pool_size=10",
              "optim.steps=6", "run.every=2", "sampling.curriculum_revisit=2"]  # fmt: skip
    cfg, inj = make(tmp_path / "full", *common)
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "parts", *common, "optim.steps=2")
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "parts", *common, "run.resume=true")
    train(cfg, **inj)

    def rows(d):
        return [{k: v for k, v in r.items() if not k.startswith("time/")}
                for r in read_jsonl(d / "metrics.jsonl")]  # fmt: skip

    full = rows(tmp_path / "full")
    assert rows(tmp_path / "parts") == full
    assert any(r["sampler/eligible_frac"] < 1 for r in full)  # prompts were set aside


def test_curriculum_config_errors():
    with pytest.raises(ConfigError, match="curriculum gives no importance weight"):
        load_config(None, ["algorithm.sampler=curriculum", "algorithm.sampler_weight=true"])
