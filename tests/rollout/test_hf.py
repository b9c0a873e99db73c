"""rollout.hf.generate: shapes, masks, EOS, finish reasons, determinism, behaviour log-probs."""

from __future__ import annotations

import pytest
import torch

from grouprl import models, tasks
from grouprl.rollout.hf import Sampling, generate, sample_tokens

PROMPTS = ["Calculate 1 + 2.", "2+2=", "What is 10 - 3 ? Be quick."]  # different lengths


@pytest.fixture(scope="module")
def char_model():
    model, tok = models.load("tiny:d=32,layers=2,heads=2", seed=0)
    # [test-only] make stopping likely: any of 12 common characters counts as EOS
    stops = [tok.eos_token_id, *tok.convert_tokens_to_ids(list("aeiou 0123456"))[:11]]
    model.generation_config.eos_token_id = stops
    return model, tok, set(stops)


def recompute_logp(model, rollouts, temperature):
    """Full forward over prompt + completion, positions from the mask: the trainer's recipe."""
    ids = torch.cat([rollouts.prompt_ids, rollouts.completion_ids], dim=1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.completion_mask], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    tp = rollouts.prompt_ids.shape[1]
    logits = logits[:, tp - 1 : -1].float() / temperature  # [N, T, V] predicting completion
    logp = torch.log_softmax(logits, -1).gather(-1, rollouts.completion_ids[..., None])[..., 0]
    return logp * rollouts.completion_mask


def test_shapes_masks_eos_finish_reasons(char_model):
    model, tok, stops = char_model
    g, t_max = 4, 10
    out = generate(
        model, tok, PROMPTS, g, Sampling(1.0, 1.0, t_max), torch.Generator().manual_seed(1)
    )
    n = len(PROMPTS) * g
    assert out.group_size == g and out.num_prompts == len(PROMPTS)
    assert out.completion_ids.shape == out.completion_mask.shape == out.old_logp.shape
    assert out.completion_ids.shape[0] == n and out.completion_ids.shape[1] <= t_max
    assert out.prompt_ids.shape[0] == n and len(out.texts) == len(out.finish_reason) == n
    for p, prompt in enumerate(PROMPTS):  # prompt-major, left-padded
        for row in range(p * g, (p + 1) * g):
            real = out.prompt_ids[row][out.prompt_mask[row].bool()].tolist()
            assert tok.decode(real) == prompt
    assert set(out.finish_reason) == {"stop", "length"}  # the fixture makes both happen
    for row in range(n):
        ids, mask = out.completion_ids[row].tolist(), out.completion_mask[row].tolist()
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)  # a prefix
        first_stop = next((i for i, x in enumerate(ids[:length]) if x in stops), None)
        if out.finish_reason[row] == "stop":
            assert first_stop == length - 1  # EOS included in the mask, nothing after it
        else:
            assert first_stop is None and length == t_max
        assert all(x == tok.pad_token_id for x in ids[length:])
        assert (out.old_logp[row, length:] == 0).all() and (out.old_logp[row, :length] < 0).all()
        body = ids[: length - 1] if out.finish_reason[row] == "stop" else ids[:length]
        assert out.texts[row] == tok.decode(body, skip_special_tokens=True)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_old_logp_equals_recomputed_forward(char_model, temperature, top_p):
    model, tok, _ = char_model
    out = generate(
        model, tok, PROMPTS, 3, Sampling(temperature, top_p, 12), torch.Generator().manual_seed(2)
    )
    expected = recompute_logp(model, out, temperature)
    assert torch.allclose(out.old_logp, expected, atol=1e-5, rtol=0)


def test_old_logp_on_the_maze_unpadded_path():
    task = tasks.get("maze")
    model, tok = models.load("tiny", task=task)
    prompts = [task.render(e, tok) for e in task.examples("train", 4, 0)]
    out = generate(model, tok, prompts, 5, Sampling(1.0, 1.0, 8), torch.Generator().manual_seed(0))
    assert out.prompt_mask.all() and out.prompt_ids.shape[1] == 27
    assert torch.allclose(out.old_logp, recompute_logp(model, out, 1.0), atol=1e-5, rtol=0)


def test_deterministic_given_generator(char_model):
    model, tok, _ = char_model
    s = Sampling(1.0, 0.95, 10)
    a = generate(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(7))
    b = generate(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(7))
    c = generate(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.old_logp, b.old_logp)
    assert a.texts == b.texts and a.finish_reason == b.finish_reason
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_greedy_matches_hf_generate(char_model):
    model, tok, stops = char_model
    prompt = PROMPTS[2]
    out = generate(model, tok, [prompt], 3, Sampling(0.0, 1.0, 8))
    assert out.texts[0] == out.texts[1] == out.texts[2]
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    ref = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=8,
        eos_token_id=sorted(stops),
        pad_token_id=tok.pad_token_id,
    )[0, ids.shape[1] :]
    n = int(out.completion_mask[0].sum())
    assert out.completion_ids[0, :n].tolist() == ref[:n].tolist()


def test_sample_tokens_top_p_and_logp_before_truncation():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20_000, 4)
    gen = torch.Generator().manual_seed(0)
    # top_p 0.7: mass above token 1 is 0.5 < 0.7 (kept), above token 2 is 0.8 >= 0.7 (dropped)
    tok, logp = sample_tokens(logits, Sampling(1.0, 0.7, 1), gen)
    assert set(tok.tolist()) == {0, 1}
    freq0 = (tok == 0).float().mean().item()
    assert abs(freq0 - 0.5 / 0.8) < 0.015  # renormalised over the nucleus for drawing
    assert torch.allclose(logp, probs.log()[tok], atol=1e-6)  # but old_logp is NOT renormalised
    # top_p 0.45: the mass above token 1 is 0.5 >= 0.45, so only token 0 survives
    tok, _ = sample_tokens(logits, Sampling(1.0, 0.45, 1), gen)
    assert set(tok.tolist()) == {0}
    # temperature 2: p ∝ sqrt(probs); frequencies match, logp = log_softmax(logits / 2)
    tok, logp = sample_tokens(logits, Sampling(2.0, 1.0, 1), gen)
    hot = probs.sqrt() / probs.sqrt().sum()
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    assert torch.allclose(freq, hot, atol=0.015)
    assert torch.allclose(logp, hot.log()[tok], atol=1e-6)


def test_bad_input(char_model):
    model, tok, _ = char_model
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sampling(max_new_tokens=0)
    with pytest.raises(ValueError, match="group_size"):
        generate(model, tok, PROMPTS, 0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, tok, [""], 2)
    assert Sampling.of({"temperature": 0.5}).temperature == 0.5


def test_compaction_changes_nothing_but_speed(char_model):
    model, tok, _ = char_model
    s = Sampling(0.0, 1.0, 12)  # greedy: the draw does not depend on the batch layout
    never = generate(model, tok, PROMPTS, 2, s, compact_below=0.0)
    always = generate(model, tok, PROMPTS, 2, s, compact_below=1.0)
    assert torch.equal(never.completion_ids, always.completion_ids)
    assert torch.equal(never.completion_mask, always.completion_mask)
    assert torch.allclose(never.old_logp, always.old_logp, atol=1e-6)
    assert never.finish_reason == always.finish_reason
    out = generate(
        model,
        tok,
        PROMPTS,
        4,
        Sampling(1.0, 1.0, 12),
        torch.Generator().manual_seed(3),
        compact_below=1.0,
    )
    assert torch.allclose(out.old_logp, recompute_logp(model, out, 1.0), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- per-prompt τ


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_per_row_temperature_equals_separate_per_prompt_sampling(top_p):
    # Two prompts × G = 3 rows, at τ = 0.5 and 1.7. One batched draw with per-row temperatures
    # must give the tokens and log-probs of drawing prompt 0's rows at 0.5, then prompt 1's at
    # 1.7, from the same generator stream: both draws consume the stream row by row, so the
    # batched call is exactly the two calls in sequence.
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    taus = torch.tensor([0.5, 0.5, 0.5, 1.7, 1.7, 1.7])
    batched = sample_tokens(logits, Sampling(1.0, top_p, 1), torch.Generator().manual_seed(4), taus)
    gen = torch.Generator().manual_seed(4)
    a = sample_tokens(logits[:3], Sampling(0.5, top_p, 1), gen)
    b = sample_tokens(logits[3:], Sampling(1.7, top_p, 1), gen)
    assert torch.equal(batched[0], torch.cat([a[0], b[0]]))
    assert torch.equal(batched[1], torch.cat([a[1], b[1]]))
    # and the log-probs are those of each row's own sampling distribution (the inverse-CDF
    # draw takes the normaliser from its float64 running sum: within an ulp of log_softmax)
    expected = torch.log_softmax(logits / taus[:, None], -1).gather(-1, batched[0][:, None])
    torch.testing.assert_close(batched[1], expected[:, 0], atol=1e-6, rtol=0)


def test_per_row_temperature_frequencies():
    # logits (0, 1): P(token 1) = sigmoid(1/τ) = 0.8808 at τ = 0.5 and 0.6225 at τ = 2
    logits = torch.tensor([0.0, 1.0]).expand(40_000, 2)
    taus = torch.tensor([0.5, 2.0]).repeat_interleave(20_000)
    tok, _ = sample_tokens(logits, Sampling(), torch.Generator().manual_seed(0), taus)
    for half, p1 in ((tok[:20_000], 0.880797), (tok[20_000:], 0.622459)):
        se = (p1 * (1 - p1) / 20_000) ** 0.5
        assert abs(half.float().mean().item() - p1) < 4 * se


def test_logprob_temperature_one_records_raw_logit_logp():
    # AGPO's convention: draw at τ = 0.6, record log_softmax(logits) (T = 1) at the drawn token.
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(5))
    hot = sample_tokens(logits, Sampling(0.6), torch.Generator().manual_seed(6))
    raw = sample_tokens(
        logits, Sampling(0.6, logprob_temperature=1.0), torch.Generator().manual_seed(6)
    )
    assert torch.equal(hot[0], raw[0])  # the same draws: only the recorded log-prob changes
    expected = torch.log_softmax(logits, -1).gather(-1, raw[0][:, None])[:, 0]
    torch.testing.assert_close(raw[1], expected, atol=0, rtol=0)
    assert not torch.allclose(hot[1], raw[1])
    # greedy decoding records at logprob_temperature too
    tok, lp = sample_tokens(logits, Sampling(0.0, logprob_temperature=2.0), None)
    expected = torch.log_softmax(logits / 2.0, -1).gather(-1, tok[:, None])[:, 0]
    assert torch.equal(tok, logits.argmax(-1)) and torch.allclose(lp, expected)


def test_generate_per_prompt_temperatures(char_model):
    model, tok, _ = char_model
    taus = [0.6, 1.4, 1.0]
    out = generate(model, tok, PROMPTS, 3, Sampling(1.0, 1.0, 12), torch.Generator().manual_seed(2),
                   temperatures=taus)  # fmt: skip
    # each group's behaviour log-probs are those of its own temperature
    for p, tau in enumerate(taus):
        rows = slice(3 * p, 3 * p + 3)
        expected = recompute_logp(model, out, tau)[rows]
        assert torch.allclose(out.old_logp[rows], expected, atol=1e-5, rtol=0)
    # AGPO: sampled at τ_p, recorded at T = 1 -> the trainer's T = 1 forward gives ratio 1
    raw = generate(model, tok, PROMPTS, 3, Sampling(1.0, 1.0, 12, logprob_temperature=1.0),
                   torch.Generator().manual_seed(2), temperatures=taus)  # fmt: skip
    assert torch.equal(raw.completion_ids, out.completion_ids)  # same draws as above
    ratio = torch.exp(recompute_logp(model, raw, 1.0) - raw.old_logp)[raw.completion_mask.bool()]
    assert (ratio - 1).abs().max() < 1e-4
    # and not 1 had the trainer divided by the sampling temperature of the hot group
    hot = recompute_logp(model, raw, 1.4)[3:6][raw.completion_mask[3:6].bool()]
    assert (hot - raw.old_logp[3:6][raw.completion_mask[3:6].bool()]).abs().max() > 1e-2
    # equal per-prompt temperatures are the scalar temperature, bit for bit
    same = generate(model, tok, PROMPTS, 3, Sampling(0.8, 0.9, 12), torch.Generator().manual_seed(9),
                    temperatures=[0.8, 0.8, 0.8])  # fmt: skip
    ref = generate(model, tok, PROMPTS, 3, Sampling(0.8, 0.9, 12), torch.Generator().manual_seed(9))
    assert torch.equal(same.completion_ids, ref.completion_ids)
    assert torch.equal(same.old_logp, ref.old_logp)


def test_per_prompt_temperature_bad_input(char_model):
    model, tok, _ = char_model
    with pytest.raises(ValueError, match="one value per prompt"):
        generate(model, tok, PROMPTS, 2, temperatures=[1.0, 1.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        generate(model, tok, PROMPTS, 2, temperatures=[1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="logprob_temperature"):
        Sampling(logprob_temperature=0.0)
    assert Sampling.of({"logprob_temperature": 1.0}).logprob_temperature == 1.0


def _gqa_char_model(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = models.load("tiny:d=32,layers=2,heads=2", seed=0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), tok


def test_gqa_attention_gives_the_same_tokens_and_logp(monkeypatch):
    """Grouped key/value heads read in the kernel (enable_gqa) = transformers' repeat_kv path:
    same tokens for the same seed, same behaviour log-probs; the config is restored."""
    from grouprl.rollout.hf import gqa_attention

    model, tok = _gqa_char_model()
    s = Sampling(1.0, 1.0, 12)
    sdpa, flags = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        flags.append((kwargs.get("enable_gqa", False), kwargs.get("attn_mask") is not None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    fast = generate(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(5))
    assert flags and all(gqa for gqa, _ in flags) and any(m for _, m in flags)  # masked + GQA
    flags.clear()
    plain = generate.__wrapped__(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(5))
    assert not any(gqa for gqa, m in flags if m)  # transformers repeats K/V when masked
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.old_logp, plain.old_logp, atol=1e-6, rtol=0)
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(fast.old_logp, recompute_logp(model, fast, 1.0), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError), gqa_attention(model) as switched:
        assert switched and model.config._attn_implementation != "sdpa"
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"  # restored on an exception too


def test_gqa_attention_leaves_other_models_alone(char_model):
    from grouprl.rollout.hf import gqa_attention

    model, _, _ = char_model  # as many key/value heads as query heads
    eager, _ = _gqa_char_model("eager")
    for m in (model, eager):
        before = m.config._attn_implementation
        with gqa_attention(m) as switched:
            assert not switched and m.config._attn_implementation == before
