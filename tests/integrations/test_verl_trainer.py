"""verl's own trainer (``python -m verl.trainer.main_ppo``) for 3 steps on a CPU with grouprl.

``algorithm.adv_estimator=grouprl_maxnorm_rloo`` (preset ``maxnorm_rloo``: δ = 0.01) and
``policy_loss.loss_mode=grouprl_ppo_clip``, a tiny Llama, 4 prompts × n = 4 a step. Everything
in the step is verl's driver and worker code (data loader, agent and reward loops,
``balance_batch``, old-log-prob recomputation, ``compute_advantage``, the FSDP2 actor update,
the weight sync) except the sampling, done by the ``hf`` rollout of ``verl_cpu.py`` (the
test-only CPU support, which also records what grouprl's functions were handed). TRL 1.16 is in
the same environment, so the run also shows that verl builds its actor next to it.

Rollouts are sampled with bf16 weights while the FSDP actor trains in fp32, and verl's rollout
correction is on (decoupled mode: token TIS weights, token-k3 rejection).

Checks: the estimator's output in the driver equals ``advantages.compute`` on the groups
rebuilt by uid with a plain loop (they arrive reordered by ``balance_batch``); the loss ran in
the actor worker with gradients, on the advantages the driver computed; verl logged a non-zero
gradient norm each step; the run ended with rc 0; verl's ``rollout_data_dir`` dump reads back
through ``grouprl diagnose``'s reader with the scores the estimator saw; every micro-batch of
the grouprl loss received verl's rollout-correction weights and rewritten mask and its loss is
verl's own vanilla loss of the same inputs; verl's file log of the run shows its mismatch
metrics through ``grouprl diagnose``.
"""

import json
import math
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from procs import run_bounded

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    verl = pytest.importorskip("verl")
    pytest.importorskip("aiohttp", reason="verl's reward loop imports aiohttp")

import grouprl
from grouprl import advantages
from grouprl.diagnostics import external

pytestmark = [pytest.mark.peer, pytest.mark.slow, pytest.mark.e2e]

VERL_VERSION = "0.9.1"  # what verl_cpu.py bends; CI installs it (scripts/install-peers.sh)
if verl.__version__ != VERL_VERSION:
    pytest.skip(
        f"the CPU support in verl_cpu.py is written for verl {VERL_VERSION}, found "
        f"{verl.__version__}",
        allow_module_level=True,
    )

HERE = Path(__file__).parent
STEPS, PROMPTS, N = 3, 4, 4
RS_THRESHOLD = 5e-8
"""token-k3 rejection threshold: bf16 sampling of this 3k-parameter model moves a token's
log-prob by ~2e-4 on average (k3 median 0, p90 ~1e-7), so a share of tokens is rejected."""
TIMEOUT_S = 360  # a bound, not a budget: ~80 s on an idle 2-core machine
WORDS = "abcdefghijklmnop"

OVERRIDES = [
    # grouprl: the estimator under test and a grouprl policy loss
    "algorithm.adv_estimator=grouprl_maxnorm_rloo",
    "+algorithm.grouprl.preset=maxnorm_rloo",
    "actor_rollout_ref.actor.policy_loss.loss_mode=grouprl_ppo_clip",
    # verl's rollout correction (decoupled mode) on bf16 rollouts of an fp32 actor: token TIS
    # weights and a token-k3 rejection that the grouprl loss must honour
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_rs=token_k3",
    f"algorithm.rollout_correction.rollout_rs_threshold={RS_THRESHOLD}",
    # data and model: 4 prompts x n = 4, prompts of 3 words, responses of at most 8 tokens
    f"data.train_batch_size={PROMPTS}",
    "data.max_prompt_length=16",
    "data.max_response_length=8",
    "data.dataloader_num_workers=0",
    "data.shuffle=false",
    "actor_rollout_ref.model.use_remove_padding=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=eager",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "actor_rollout_ref.rollout.name=hf",
    f"actor_rollout_ref.rollout.n={N}",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "reward.num_workers=1",
    f"reward.custom_reward_function.path={HERE / 'ab_reward.py'}",
    # one process, one logical GPU backed by the CPU platform; the legacy (non-v1) trainer
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.use_v1=false",
    "trainer.logger=[console,file]",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    f"trainer.total_training_steps={STEPS}",
    "+ray_kwargs.ray_init.num_gpus=1",
    "ray_kwargs.ray_init.num_cpus=8",
    "+ray_kwargs.ray_init.include_dashboard=false",
]


def write_inputs(folder: Path) -> None:
    import pandas as pd
    from tiny_lm import save_tiny

    save_tiny(folder / "model")
    rows = [
        {
            "data_source": "grouprl_ab",
            "prompt": [
                {"role": "user", "content": " ".join(WORDS[(i + j) % 16] for j in range(3))}
            ],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": "a"},
            "extra_info": {"index": i},
        }
        for i in range(4 * PROMPTS)
    ]
    pd.DataFrame(rows).to_parquet(folder / "train.parquet")
    pd.DataFrame(rows[:PROMPTS]).to_parquet(folder / "val.parquet")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verl-trainer")
    write_inputs(folder)
    (folder / "record").mkdir()
    src = str(Path(grouprl.__file__).resolve().parents[1])
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are capped
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(HERE), src, os.environ.get("PYTHONPATH", "")]),
        VERL_USE_EXTERNAL_MODULES="verl_cpu,grouprl.integrations.verl",
        VERL_PLATFORM="cpu",
        VERL_ENGINE_DEVICE="cuda",  # selects the FSDP engine; the cpu platform runs it on CPU
        GROUPRL_VERL_RECORD=str(folder / "record"),
        GROUPRL_VERL_ROLLOUT_DTYPE="bfloat16",  # rollouts in bf16, the actor in fp32
        VERL_FILE_LOGGER_PATH=str(folder / "verl_metrics.jsonl"),
        RAY_TMPDIR=ray_tmp,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *OVERRIDES]
    cmd += [
        f"data.train_files={folder / 'train.parquet'}",
        f"data.val_files={folder / 'val.parquet'}",
        f"actor_rollout_ref.model.path={folder / 'model'}",
        f"trainer.rollout_data_dir={folder / 'rollouts'}",
        f"trainer.default_local_dir={folder / 'checkpoints'}",
    ]
    try:
        res = run_bounded(cmd, cwd=folder, env=env, timeout=TIMEOUT_S)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    (folder / "main_ppo.log").write_text(res.stdout + res.stderr)
    assert res.returncode == 0, (res.stdout + res.stderr)[-8000:]
    return folder, res.stdout + res.stderr


def records(folder: Path, kind: str) -> tuple[set[str], list[dict]]:
    files = sorted((folder / "record").glob(f"{kind}-*.jsonl"))
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    return {f.stem.split("-")[1] for f in files}, rows


def rebuild_by_uid(uids, scores):
    """Plain-loop reference: groups in first-seen uid order, [P, G] grid, rows of each group."""
    members: dict[str, list[int]] = {}
    for i, u in enumerate(uids):
        members.setdefault(u, []).append(i)
    grid = torch.tensor([[scores[i] for i in rows] for rows in members.values()])
    return grid, list(members.values())


def row_values(adv, mask):
    """The one advantage of each row (verl broadcasts it over the response tokens)."""
    adv, mask = torch.tensor(adv), torch.tensor(mask)
    return (adv * mask).sum(1) / mask.sum(1).clamp(min=1)


def test_the_estimator_in_the_driver_equals_compute_on_groups_rebuilt_by_uid(run):
    folder, _ = run
    pids, steps = records(folder, "estimator")
    assert len(pids) == 1 and len(steps) == STEPS  # one driver, one call per step
    reordered = 0
    for rec in steps:
        scores = torch.tensor(rec["token_level_rewards"]).sum(1).tolist()  # [N]
        grid, members = rebuild_by_uid(rec["uid"], scores)
        assert grid.shape == (PROMPTS, N)
        reordered += any(rows != list(range(rows[0], rows[0] + N)) for rows in members)
        want = advantages.compute("maxnorm_rloo", grid, delta_res=0.01).values  # [P, G]
        flat = torch.empty(len(scores))
        for p, rows in enumerate(members):
            flat[rows] = want[p]
        mask = torch.tensor(rec["response_mask"])
        got = torch.tensor(rec["advantages"])
        torch.testing.assert_close(got, flat[:, None] * mask, atol=1e-6, rtol=0)
        assert (flat != 0).any()
    assert reordered > 0  # balance_batch handed the estimator non-contiguous groups


def test_the_grouprl_loss_ran_in_the_worker_with_gradients(run):
    folder, log = run
    driver, steps = records(folder, "estimator")
    workers, calls = records(folder, "loss")
    assert len(workers) == 1 and workers.isdisjoint(driver)  # another process: the actor
    assert calls and all(c["requires_grad"] and c["log_prob_requires_grad"] for c in calls)
    # micro-batches of each step carry exactly the advantages the driver computed that step
    consumed = iter(calls)
    for rec in steps:
        want = torch.sort(row_values(rec["advantages"], rec["response_mask"])).values
        got = []
        while sum(len(c) for c in got) < len(want):
            c = next(consumed)
            got.append(row_values(c["advantages"], c["response_mask"]))
        torch.testing.assert_close(torch.sort(torch.cat(got)).values, want, atol=1e-6, rtol=0)
    norms = [float(x) for x in re.findall(r"actor/grad_norm:(?:np\.float64\()?([-\d.e]+)", log)]
    assert len(norms) == STEPS and all(math.isfinite(x) and x > 0 for x in norms)


def test_verls_rollout_dump_reads_back_with_the_scores_the_estimator_saw(run):
    folder, _ = run
    _, steps = records(folder, "estimator")
    gf = external.load_verl(folder / "rollouts")
    assert sorted(gf.batches) == list(range(1, STEPS + 1))
    for step, rec in zip(sorted(gf.batches), steps):
        _, rewards = gf.batches[step]
        assert rewards.shape == (PROMPTS, N)
        scores = torch.tensor(rec["token_level_rewards"]).sum(1).double()
        torch.testing.assert_close(
            torch.sort(rewards.reshape(-1)).values, torch.sort(scores).values, atol=1e-6, rtol=0
        )


def test_the_grouprl_loss_honoured_verls_rollout_correction(run):
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    folder, _ = run
    _, calls = records(folder, "loss")
    assert calls and all(c["rollout_is_weights"] is not None for c in calls)
    weights, recomputed = [], 0
    for c in calls:
        mask = torch.tensor(c["response_mask"])
        w = torch.tensor(c["rollout_is_weights"])
        weights.append(w[mask.bool()])
        cfg = ActorConfig(strategy="fsdp2", rollout_n=N, ppo_micro_batch_size_per_gpu=8)
        cfg.global_batch_info.update(
            {k: (int(v) if v is not None else None) for k, v in c["global_batch_info"].items()}
        )
        want, _ = core_algos.get_policy_loss_fn("vanilla")(
            torch.tensor(c["old_log_prob"]),
            torch.tensor(c["log_prob"]),
            torch.tensor(c["advantages"]),
            mask,
            c["loss_agg_mode"],
            cfg,
            rollout_is_weights=w,
        )
        assert c["loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-7)
        recomputed += 1
    w = torch.cat(weights)
    assert recomputed == len(calls)
    assert (w != 1.0).any() and (w <= 2.0).all()  # bf16 rollouts: weights moved off 1


def test_verls_logged_mismatch_reads_through_grouprl_diagnose(run, capsys):
    from grouprl.cli import main

    folder, _ = run
    log = external.load_mismatch(folder / "verl_metrics.jsonl")
    assert log is not None and log.source == "verl" and len(log.rows) == STEPS
    assert all(r["mismatch/kl_k3"] > 0 for r in log.rows)  # bf16 vs fp32: a real mismatch
    assert any(r["corr/rejected_frac"] > 0 for r in log.rows)  # the token-k3 rejection acted
    assert main(["diagnose", str(folder / "verl_metrics.jsonl"), "--no-report"]) == 0
    assert f"Rollout vs trainer mismatch (verl log, {STEPS} steps)" in capsys.readouterr().out
