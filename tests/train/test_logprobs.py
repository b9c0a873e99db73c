"""Chunked completion log-probs: parity with the naive full-vocabulary computation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.train.logprobs import completion_logprobs, length_buckets, position_ids


def _model(vocab: int = 5000, seed: int = 0, *, kv_heads: int = 4, attn: str | None = None):
    """A 2-layer Llama; ``kv_heads=2`` groups 2 query heads per key/value head (GQA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )
    if attn is not None:
        cfg._attn_implementation = attn
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


# ---- length buckets, the fused head, GQA attention ------------------------------------------


def test_length_buckets_known_answer():
    # lengths 10, 9, 2 with overhead 3 (a bucket of b rows, longest L, costs b·(L-1) + 3):
    #   {10,9,2}: 3·9+3 = 30   {10,9},{2}: 2·9+3 + 1·1+3 = 25   {10},{9,2}: 9+3 + 2·8+3 = 31
    #   {10},{9},{2}: 9+3 + 8+3 + 1+3 = 27   -> the best is {10, 9}, {2}
    assert length_buckets([10, 9, 2], overhead=3) == [[0, 1], [2]]
    # free calls: one bucket per distinct length; rows of length 0 or 1 need no decoder call
    assert length_buckets([5, 0, 2, 5, 1, 2], overhead=0) == [[0, 3], [2, 5]]
    assert length_buckets([5, 0, 2, 5, 1, 2], overhead=100) == [[0, 2, 3, 5]]
    assert length_buckets([1, 0], overhead=0) == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=20),
    st.floats(0, 50, allow_nan=False),
)
def test_length_buckets_partition_and_beat_the_simple_splits(lengths, overhead):
    buckets = length_buckets(lengths, overhead)
    rows = sorted(r for b in buckets for r in b)
    assert rows == [i for i, x in enumerate(lengths) if x > 1]  # a partition of the long rows

    def cost(bs):
        return sum(len(b) * (max(lengths[r] for r in b) - 1) + overhead for b in bs)

    long_rows = [i for i, x in enumerate(lengths) if x > 1]
    if long_rows:
        one = [long_rows]
        per_length = [[i for i in long_rows if lengths[i] == v] for v in set(lengths) if v > 1]
        assert cost(buckets) <= min(cost(one), cost(per_length)) + 1e-9


@pytest.mark.parametrize("gqa", [False, True])
def test_trimmed_buckets_match_the_padded_forward(gqa):
    """Length buckets (forced: overhead 0) = one padded forward = the plain forward."""
    vocab, g = 300, 3
    model = _model(vocab, kv_heads=2, attn="sdpa") if gqa else _model(vocab)
    prompt, pmask, comp, cmask = _batch(vocab)
    prompt, pmask = prompt[[1, 1, 1, 4, 4, 4]], pmask[[1, 1, 1, 4, 4, 4]]  # 2 groups of 3
    comp = torch.cat([comp, comp[:1]])
    cmask = torch.tensor(
        [
            [1, 1, 1, 1, 1, 1, 1],  # full
            [1, 1, 0, 0, 0, 0, 0],  # short
            [0, 0, 0, 0, 0, 0, 0],  # empty (e.g. masked as truncated)
            [1, 1, 1, 0, 1, 0, 0],  # a hole: needs positions up to 5
            [1, 0, 0, 0, 0, 0, 0],  # one token: no decoder call beyond the prompt
            [1, 1, 1, 1, 0, 0, 0],
        ]
    )
    runs = {}
    for name, kw in {
        "plain": {},
        "padded": {"group_size": g, "trim": False},
        "trimmed": {"group_size": g, "bucket_overhead": 0.0},
    }.items():
        model.zero_grad()
        out = completion_logprobs(model, prompt, pmask, comp, cmask, entropy=True, **kw)
        out.logp.sum().backward()
        runs[name] = (out, [p.grad.clone() for p in model.parameters()])
    for name in ("padded", "trimmed"):
        out, grads = runs[name]
        torch.testing.assert_close(out.logp, runs["plain"][0].logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy, runs["plain"][0].entropy, atol=1e-5, rtol=0)
        assert (out.logp[cmask == 0] == 0).all()
        for p, r in zip(grads, runs["plain"][1]):
            torch.testing.assert_close(p, r, atol=1e-5, rtol=1e-4)


def test_bucketing_runs_fewer_decoder_tokens():
    """The trimmed forward feeds the decoder fewer tokens than the padded one (hook count)."""
    vocab, g = 300, 3
    model = _model(vocab)
    prompt, pmask, comp, cmask = _batch(vocab)
    prompt, pmask = prompt[[1, 1, 1, 4, 4, 4]], pmask[[1, 1, 1, 4, 4, 4]]
    comp = torch.cat([comp, comp[:1]])
    cmask = torch.zeros(6, 7, dtype=torch.long)
    cmask[0] = 1  # one long row, five of length 2
    cmask[1:, :2] = 1
    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["input_ids"].numel()), with_kwargs=True
    )
    try:
        for trim in (False, True):
            seen.clear()
            completion_logprobs(
                model, prompt, pmask, comp, cmask, group_size=g, trim=trim, bucket_overhead=0.0
            )
            tokens = sum(seen)
            if trim:
                # prompts 2x6, then a bucket of 1 row x 6 tokens and one of 5 rows x 1 token
                assert tokens == 2 * 6 + 1 * 6 + 5 * 1
            else:
                assert tokens == 2 * 6 + 6 * 6  # prompts, then every row to the longest
    finally:
        hook.remove()


@pytest.mark.parametrize("recompute", [False, True])
def test_fused_head_equals_the_autograd_path_twice_with_retain_graph(recompute, monkeypatch):
    """The fused head's values and gradients equal log_softmax + gather (the fallback path),
    and a second backward through a retained graph gives the same gradients (the kept
    probabilities are not overwritten; diagnostics.reward_kl_balance backpropagates twice)."""
    from grouprl.train import logprobs as lp_mod

    vocab = 700
    model = _model(vocab)
    batch = _batch(vocab)

    def grads(out, retain):
        model.zero_grad()
        (out.logp * torch.linspace(0.5, 2, out.logp.shape[1])).sum().backward(retain_graph=retain)
        return [p.grad.clone() for p in model.parameters()]

    fused = completion_logprobs(
        model, *batch, temperature=0.8, chunk=4, entropy=True, recompute=recompute
    )
    first, second = grads(fused, True), grads(fused, False)
    monkeypatch.setattr(lp_mod, "_fused_head", lambda head, h: False)
    plain = completion_logprobs(model, *batch, temperature=0.8, chunk=4, entropy=True)
    torch.testing.assert_close(fused.logp, plain.logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.entropy, plain.entropy, atol=1e-5, rtol=0)
    for a, b, c in zip(first, second, grads(plain, False)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4)


def test_keep_bytes_decides_recompute(monkeypatch):
    """recompute=None keeps the [M, V] probabilities below keep_bytes, recomputes above."""
    from grouprl.train import logprobs as lp_mod

    calls = []
    original = lp_mod._HeadLogProb.apply

    def spy(*args):
        calls.append(args[5])  # the `keep` flag
        return original(*args)

    monkeypatch.setattr(lp_mod._HeadLogProb, "apply", spy)
    model = _model(300)
    batch = _batch(300)
    m = int(batch[3].sum())  # completion tokens
    completion_logprobs(model, *batch, keep_bytes=m * 300 * 4)
    completion_logprobs(model, *batch, keep_bytes=m * 300 * 4 - 1)
    with torch.no_grad():
        completion_logprobs(model, *batch, keep_bytes=0)  # no gradient: nothing to keep for
    assert calls == [True, False, True]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("recompute", [True, False])
def test_sum_pi_squared_matches_the_full_softmax(fused, recompute, monkeypatch):
    """Σ_v π(v)² at each position (the optimal token baseline's input), fused head or
    log_softmax path, kept or recomputed: the full softmax at the same temperature; the
    gradient of the log-probs is unchanged by asking for it."""
    from grouprl.train import logprobs as lp_mod

    if not fused:
        monkeypatch.setattr(lp_mod, "_fused_head", lambda head, h: False)
    vocab = 700
    model = _model(vocab)
    prompt, pmask, comp, cmask = _batch(vocab)
    ids, mask = torch.cat([prompt, comp], 1), torch.cat([pmask, cmask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    probs = torch.softmax(logits[:, prompt.shape[1] - 1 : -1].float() / 0.7, -1)  # [N, T, V]
    want = probs.square().sum(-1) * cmask
    out = completion_logprobs(
        model, prompt, pmask, comp, cmask, temperature=0.7, chunk=4, recompute=recompute,
        sum_pi_squared=True,
    )  # fmt: skip
    torch.testing.assert_close(out.sum_pi_squared, want, atol=1e-6, rtol=1e-5)
    assert out.sum_pi_squared.requires_grad is False
    plain = completion_logprobs(model, prompt, pmask, comp, cmask, temperature=0.7, chunk=4)
    assert plain.sum_pi_squared is None
    torch.testing.assert_close(out.logp, plain.logp)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 10_000])
def test_recomputed_head_gives_the_kept_heads_gradients_bit_for_bit(temperature, chunk):
    """The fused head without its kept [M, V] probabilities rebuilds them in the backward
    from the row maxima and sums by the forward's own operations: log-probs, entropies and
    every gradient equal the kept path's exactly (chunk 3 splits the 20 tokens unevenly)."""
    vocab = 700
    model = _model(vocab)
    batch = _batch(vocab)
    weight = torch.linspace(0.5, 2, batch[2].shape[1])  # [T] distinct per-position gradients
    outs, grads = [], []
    for recompute in (False, True):
        model.zero_grad()
        out = completion_logprobs(
            model, *batch, temperature=temperature, chunk=chunk, entropy=True,
            recompute=recompute,
        )  # fmt: skip
        (out.logp * weight).sum().backward()
        outs.append(out)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert torch.equal(outs[0].logp, outs[1].logp)
    assert torch.equal(outs[0].entropy, outs[1].entropy)
    for kept, rebuilt in zip(*grads):
        assert torch.equal(kept, rebuilt)


def test_recomputed_head_keeps_no_vocabulary_block(monkeypatch):
    """With recompute the fused head saves the row maxima and sums ([M, 1] each, fp32) in
    place of the [M, V] probabilities: the tensors kept for the backward differ by exactly
    that."""
    from grouprl.train import lean

    vocab = 2000
    model = _model(vocab)
    batch = _batch(vocab)
    m = int(batch[3].sum())  # completion tokens

    def saved_bytes(recompute: bool) -> int:
        seen: dict[int, int] = {}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        real = lean._pack  # the innermost hook inside the training forward: spied on

        def spy(t):
            out = real(t)
            return pack(out) if isinstance(out, torch.Tensor) else out

        with monkeypatch.context() as patch:
            patch.setattr(lean, "_pack", spy)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                completion_logprobs(model, *batch, chunk=10_000, recompute=recompute)
        return sum(seen.values())

    kept, rebuilt = saved_bytes(False), saved_bytes(True)
    assert kept - rebuilt == m * vocab * 4 - 2 * m * 4
