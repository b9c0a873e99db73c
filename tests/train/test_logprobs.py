"""Chunked completion log-probs: parity with the naive full-vocabulary computation."""

from __future__ import annotations

import pytest
import torch

from grouprl.train.logprobs import completion_logprobs, position_ids


def _model(vocab: int = 5000, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def _batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n, tp, t = 5, 6, 7
    prompt = torch.randint(1, vocab, (n, tp), generator=g)
    pmask = torch.ones(n, tp, dtype=torch.long)
    pmask[1, :2] = 0  # left padding
    pmask[3, :4] = 0
    comp = torch.randint(1, vocab, (n, t), generator=g)
    cmask = torch.ones(n, t, dtype=torch.long)
    cmask[0, 5:] = 0  # right padding
    cmask[2, 1:] = 0
    return prompt, pmask, comp, cmask


def _naive(model, prompt, pmask, comp, cmask, temperature):
    """The textbook way: full [N, L, V] logits, log_softmax, gather, mask."""
    ids = torch.cat([prompt, comp], 1)
    mask = torch.cat([pmask, cmask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    logits = logits[:, prompt.shape[1] - 1 : -1] / temperature  # [N, T, V]
    logp_all = torch.log_softmax(logits.float(), -1)
    logp = logp_all.gather(-1, comp[..., None]).squeeze(-1) * cmask
    ent = -(logp_all.exp() * logp_all).sum(-1) * cmask
    return logp, ent


@pytest.mark.parametrize(("chunk", "recompute"), [(3, True), (4, False), (10_000, None)])
def test_matches_naive_values_entropy_and_gradients(chunk, recompute):
    vocab = 5000
    model = _model(vocab)
    batch = _batch(vocab)
    ref_logp, ref_ent = _naive(model, *batch, temperature=0.7)
    (ref_logp.sum()).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = completion_logprobs(
        model, *batch, temperature=0.7, chunk=chunk, entropy=True, recompute=recompute
    )
    torch.testing.assert_close(out.logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-4, rtol=0)
    assert (out.logp[batch[3] == 0] == 0).all()  # padding is exactly 0
    out.logp.sum().backward()
    for p, ref in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, ref, atol=1e-5, rtol=1e-4)


def test_left_padding_does_not_change_a_sequence():
    """Positions skip left padding, so padding a prompt leaves its log-probs unchanged."""
    model = _model(300)
    prompt, pmask, comp, cmask = _batch(300)
    a = completion_logprobs(model, prompt[3:4, 4:], pmask[3:4, 4:], comp[3:4], cmask[3:4]).logp
    b = completion_logprobs(model, prompt[3:4], pmask[3:4], comp[3:4], cmask[3:4]).logp
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_peft_wrapped_model_uses_the_adapter():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model(300), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    batch = _batch(300)
    out = completion_logprobs(model, *batch)
    torch.testing.assert_close(out.logp, _naive(model, *batch, 1.0)[0], atol=1e-5, rtol=0)
    with model.disable_adapter():
        base = completion_logprobs(model, *batch).logp
    assert (out.logp - base).abs().max() > 1e-4  # the adapter (random init) changes them


@pytest.mark.parametrize("t", [1, 5])
def test_shared_prompt_forward_matches_the_plain_one(t):
    """One prefill per group (KV cache repeated G times) = the full forward, values and grads."""
    vocab, g = 300, 3
    model = _model(vocab)
    prompt, pmask, comp, cmask = _batch(vocab)
    prompt, pmask = prompt[[1, 1, 1, 4, 4, 4]], pmask[[1, 1, 1, 4, 4, 4]]  # 2 groups of 3
    comp, cmask = torch.cat([comp, comp[:1]])[:, :t], torch.cat([cmask, cmask[:1]])[:, :t]
    plain = completion_logprobs(model, prompt, pmask, comp, cmask, entropy=True)
    plain.logp.sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    shared = completion_logprobs(model, prompt, pmask, comp, cmask, entropy=True, group_size=g)
    torch.testing.assert_close(shared.logp, plain.logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.entropy, plain.entropy, atol=1e-5, rtol=0)
    shared.logp.sum().backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r, atol=1e-5, rtol=1e-4)
