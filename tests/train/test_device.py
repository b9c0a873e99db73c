"""Devices, dtypes and the step's typed seams (reference, controller, update log).

The device test needs no GPU: with ``torch.set_default_device("meta")`` any tensor the step
creates without an explicit device lands on the meta device, and the first operation that
mixes it with the policy's (CPU) tensors, or reads its value, fails. So a tensor created on
"the default device" instead of the policy's fails here exactly as it would put a CPU tensor
next to CUDA ones on a GPU machine.
"""

from __future__ import annotations

import math

import pytest
import torch
from train_toy import make

from grouprl.train import checkpoint
from grouprl.train.batch import evaluate
from grouprl.train.config import ConfigError, load_config
from grouprl.train.controllers import AGPOController, NoController, make_controller
from grouprl.train.loop import UpdateLog, train_step
from grouprl.train.reference import AdapterOff, FrozenCopy, NoReference
from grouprl.train.state import resolve_device, setup


@pytest.fixture
def meta_default():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.preset=grpo"],
        ["algorithm.preset=dapo", "algorithm.overlong=mask"],
        ["algorithm.preset=avspo"],
        ["algorithm.preset=agpo"],
        ["algorithm.preset=maxnorm_rloo", "algorithm.beta=0.1", "eval.balance_every=1"],
        ["algorithm.preset=gspo", "optim.ppo_epochs=2", "optim.minibatches=2",
         "optim.micro_batch_size=4"],
    ],
    ids=["grpo", "dapo-mask", "avspo", "agpo", "maxnorm-beta-balance", "gspo-minibatches"],
)  # fmt: skip
def test_the_step_creates_no_tensor_on_the_default_device(tmp_path, extra, meta_default):
    torch.set_default_device(None)  # build the run normally, on the CPU
    cfg, inj = make(tmp_path, "model.device=cpu", *extra)
    run = setup(cfg, **inj)
    torch.set_default_device("meta")
    run.step = 1
    metrics = train_step(run)
    assert math.isfinite(metrics["loss/total"])
    assert all(p.device.type == "cpu" for p in run.model.parameters())


def test_evaluation_creates_no_tensor_on_the_default_device(tmp_path, meta_default):
    torch.set_default_device(None)
    cfg, inj = make(tmp_path, "model.device=cpu", "eval.prompts=3", "eval.samples=4",
                    "eval.ks=[1,4]")  # fmt: skip
    run = setup(cfg, **inj)
    torch.set_default_device("meta")
    out = evaluate(run.policy, run.scorer, run.cfg)
    assert 0.0 <= out["eval/pass@1"] <= out["eval/pass@4"] <= 1.0


def test_device_resolution_and_clear_errors():
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(resolve_device("auto")) == want
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"model.device='cuda:1' but torch sees 0 CUDA"):
            resolve_device("cuda:1")
    for bad in ("gpu", "cuda:x", "tpu"):
        with pytest.raises(ConfigError, match=r"model\.device must be auto, cpu, cuda or cuda:N"):
            load_config(None, [f"model.device={bad}"])
    with pytest.raises(ConfigError, match=r"model\.dtype must be one of"):
        load_config(None, ["model.dtype=int8"])
    with pytest.raises(ConfigError, match=r"model\.autocast must be one of none, bfloat16"):
        load_config(None, ["model.autocast=fp8"])
    assert load_config(None, ["model.dtype=bf16"]).model.torch_dtype is torch.bfloat16


def test_bf16_autocast_runs_forwards_in_bf16_with_fp32_master_weights(tmp_path):
    cfg, inj = make(tmp_path, "model.autocast=bfloat16")
    run = setup(cfg, **inj)
    seen: list[torch.dtype] = []
    run.model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda mod, args, out: seen.append(out.dtype)
    )
    run.step = 1
    metrics = train_step(run)
    assert math.isfinite(metrics["loss/total"])
    assert torch.bfloat16 in seen  # the training forward ran under autocast
    assert all(p.dtype == torch.float32 for p in run.model.parameters())  # master weights
    state = run.optimizer.state[next(iter(run.model.parameters()))]
    assert state["exp_avg"].dtype == torch.float32


def test_plain_bf16_weights_train(tmp_path):
    cfg, inj = make(tmp_path, "model.dtype=bfloat16")
    inj["model"] = inj["model"].to(torch.bfloat16)
    run = setup(cfg, **inj)
    before = [p.detach().clone() for p in run.model.parameters()]
    run.step = 1
    train_step(run)
    assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, run.model.parameters()))


def test_rng_capture_has_a_cuda_slot_and_restores(tmp_path):
    gen = torch.Generator().manual_seed(3)
    saved = checkpoint.capture_rng({"rollout": gen})
    assert "cuda" in saved  # None without an initialised CUDA context
    a = torch.rand(3, generator=gen)
    checkpoint.restore_rng(saved, {"rollout": gen})
    assert torch.equal(torch.rand(3, generator=gen), a)


# ---- typed seams ---------------------------------------------------------------------------


def test_reference_kind_follows_beta_and_lora(tmp_path):
    cfg, inj = make(tmp_path / "a")
    assert isinstance(setup(cfg, **inj).reference, NoReference)
    cfg, inj = make(tmp_path / "b", "algorithm.beta=0.1")
    run = setup(cfg, **inj)
    assert isinstance(run.reference, FrozenCopy)
    assert run.reference.model is not run.model
    assert not any(p.requires_grad for p in run.reference.model.parameters())
    cfg, inj = make(tmp_path / "c", "algorithm.beta=0.1", "model.lora_rank=2")
    assert isinstance(setup(cfg, **inj).reference, AdapterOff)


def test_frozen_reference_equals_the_initial_policy_and_stays_put(tmp_path):
    cfg, inj = make(tmp_path, "algorithm.beta=0.1", "optim.lr=0.1")
    run = setup(cfg, **inj)
    run.step = 1
    from grouprl.train.loop import collect_batch

    batch, _ = collect_batch(run, _NullTimer())
    ref0 = run.reference.logprobs(run.policy, batch)
    torch.testing.assert_close(ref0, run.policy.batch_logprobs(batch).logp, atol=1e-6, rtol=0)
    train_step(run)
    torch.testing.assert_close(run.reference.logprobs(run.policy, batch), ref0, atol=0, rtol=0)
    assert not torch.allclose(run.policy.batch_logprobs(batch).logp, ref0, atol=1e-4)  # moved


def test_controller_protocol_defaults_change_nothing(tmp_path):
    cfg, inj = make(tmp_path, "sampling.temperature=0.7")
    run = setup(cfg, **inj)
    ctl = make_controller(None, cfg)
    assert isinstance(ctl, NoController) and isinstance(run.controller, NoController)
    assert ctl.temperature([], None) == (0.7, {})
    params = {"eps_low": 0.2, "eps_high": 0.28}
    assert ctl.clip_params(run.policy, None, params) == (params, {})
    assert ctl.after_update(run.policy, None) == {} and ctl.state_dict() is None
    assert isinstance(make_controller("agpo", cfg), AGPOController)
    with pytest.raises(ValueError, match="unknown controller 'pid'; valid: None, agpo"):
        make_controller("pid", cfg)


def test_update_log_means_are_over_the_optimizer_steps_taken():
    # two steps taken (pg 0.5 and 1.5, grad norms 2 and 4), one skipped, one empty:
    # means over the 2 taken steps, never diluted by the other two
    log = UpdateLog(
        taken=2, skipped=1, empty=1, grad_norm=6.0,
        losses={"pg": 2.0, "kl": 0.2}, policy={"ratio_mean": 2.0, "kl_mean": 0.04},
        balance={"balance/r_over_kl": 3.0},
    )  # fmt: skip
    m = log.metrics()
    assert m["loss/pg"] == 1.0 and m["loss/kl"] == pytest.approx(0.1)
    assert m["loss/total"] == pytest.approx(1.1)
    assert m["policy/ratio_mean"] == 1.0 and m["kl/mean"] == pytest.approx(0.02)
    assert "policy/kl_mean" not in m
    assert m["optim/grad_norm"] == 3.0
    assert m["optim/skipped_steps"] == 1.0 and m["optim/empty_steps"] == 1.0
    assert m["balance/r_over_kl"] == 3.0  # once per step, not averaged
    empty = UpdateLog(empty=2).metrics()
    assert "optim/grad_norm" not in empty and empty["loss/total"] == 0.0


def test_empty_minibatches_do_not_dilute_the_logged_loss(tmp_path):
    # maxnorm_rloo skips groups that fall in one resolution bin; a minibatch of only such
    # groups is empty. The logged loss is the mean over the steps that ran.
    cfg, inj = make(tmp_path, "algorithm.preset=maxnorm_rloo", "optim.minibatches=4",
                    "optim.steps=4")  # fmt: skip
    run = setup(cfg, **inj)
    seen_empty = False
    for step in range(1, 5):
        run.step = step
        m = train_step(run)
        assert m["optim/empty_steps"] + m["optim/skipped_steps"] <= 4
        seen_empty |= m["optim/empty_steps"] > 0
        kept = 1 - m["adv/resolution/skipped_frac"]
        assert (m["optim/empty_steps"] == 4) == (kept == 0)
    assert seen_empty  # the toy model collapses groups: the case was exercised


class _NullTimer:
    def __call__(self, stage):
        import contextlib

        return contextlib.nullcontext()


def test_a_checkpoint_from_another_device_type_reseeds_the_generator(tmp_path, capsys):
    cfg, inj = make(tmp_path, "model.device=cpu", "run.seed=5")
    run = setup(cfg, **inj)
    state = run.state()
    same = run.gen.get_state().clone()
    run.load_state({**state, "step": 3})  # same device type: the generator is restored
    assert torch.equal(run.gen.get_state(), same)
    run.load_state({**state, "device": "cuda:0", "step": 3})  # written on a GPU
    want = torch.Generator().manual_seed(5 * 1_000_003 + 3).get_state()
    assert torch.equal(run.gen.get_state(), want)
    assert "written on cuda:0 and this run is on cpu" in capsys.readouterr().out


def test_adamw_is_fused_where_torch_has_the_kernel_and_updates_like_the_loop(tmp_path):
    cfg, inj = make(tmp_path)
    run = setup(cfg, **inj)
    assert run.optimizer.param_groups[0]["fused"] is True  # optim.fused defaults on; CPU fp32
    cfg_off, inj_off = make(tmp_path / "off", "optim.fused=false")
    assert not setup(cfg_off, **inj_off).optimizer.param_groups[0]["fused"]
    # the same update as the for-loop AdamW (torch's reference) up to rounding
    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(30))]
    w2 = [torch.nn.Parameter(p.detach().clone()) for p in w]
    fused = torch.optim.AdamW(w, lr=1e-2, weight_decay=0.1, fused=True)
    loop = torch.optim.AdamW(w2, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        g = [torch.randn_like(p) for p in w]
        for p, q, gi in zip(w, w2, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        fused.step()
        loop.step()
    for p, q in zip(w, w2):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fused_adamw_support_is_read_from_the_parameters():
    from grouprl.train.state import fused_adamw_supported

    assert fused_adamw_supported([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)])
    assert not fused_adamw_supported([torch.zeros(2, device="meta")])
    assert not fused_adamw_supported([torch.zeros(2, dtype=torch.int64)])
    assert not fused_adamw_supported([])
