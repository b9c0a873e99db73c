"""``<run>/final/``: the policy and tokenizer as transformers (and peft) load them back."""

from __future__ import annotations

import json

import pytest
import torch
from train_toy import TINY, ToyTask, make

from grouprl import models
from grouprl.train.config import ConfigError
from grouprl.train.export import save_final
from grouprl.train.loop import train

transformers = pytest.importorskip("transformers")
IDS = torch.tensor([[2, 9, 3, 5, 6, 7], [2, 9, 3, 8, 5, 5]])  # <bos> q <sep> a b c ... (word ids)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_final_policy_loads_with_transformers_and_gives_the_same_logits(tmp_path):
    cfg, inj = make(tmp_path, "optim.steps=2")
    train(cfg, **inj)
    final = tmp_path / "final"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    torch.testing.assert_close(_logits(loaded), _logits(inj["model"]), rtol=0, atol=0)
    tok = transformers.AutoTokenizer.from_pretrained(final)
    text = "<bos> q <sep> a b"
    assert (
        tok(text, add_special_tokens=False)["input_ids"]
        == inj["tokenizer"](text, add_special_tokens=False)["input_ids"]
    )
    meta = json.loads((final / "grouprl_final.json").read_text())
    assert meta["step"] == 2 and meta["preset"] == "grpo" and meta["lora_adapter"] is False
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))


@pytest.mark.parametrize("vocab", ["char", "word"])
def test_tokenizers_made_on_the_spot_round_trip(tmp_path, vocab):
    task = None if vocab == "char" else ToyTask()
    model, tok = models.load(TINY, task=task)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    save_final(model, tok, tmp_path)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "final")
    samples = (
        ["Letter: c\nAnswer: c", "  spaces\tand 123!?"] if vocab == "char" else ["q a b <eos>"]
    )
    for s in samples:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert back(s, add_special_tokens=False)["input_ids"] == ids
        assert back.decode(ids) == tok.decode(ids)
    assert back.get_vocab() == tok.get_vocab() and back.chat_template == tok.chat_template
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    assert [getattr(back, s) for s in specials] == [getattr(tok, s) for s in specials]


def test_lora_run_saves_the_adapter_and_the_merged_model(tmp_path):
    peft = pytest.importorskip("peft")
    cfg, inj = make(tmp_path, "optim.steps=2", "optim.lr=0.05", "model.lora_rank=2",
                    "run.merge_lora=true")  # fmt: skip
    train(cfg, **inj)
    trained = _logits(inj["model"])  # the base model, adapters injected in place
    base, _ = models.load(TINY, task=ToyTask(), seed=cfg.run.seed)
    assert (_logits(base) - trained).abs().max() > 1e-4  # the adapter changed something
    adapter = peft.PeftModel.from_pretrained(base, tmp_path / "final")
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    torch.testing.assert_close(_logits(adapter.eval()), trained, rtol=1e-5, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final_merged")
    torch.testing.assert_close(_logits(merged.eval()), trained, rtol=1e-5, atol=1e-5)
    assert not any("lora" in k for k in merged.state_dict())


def test_switches_and_misuse(tmp_path):
    cfg, inj = make(tmp_path, "optim.steps=1", "run.save_final=false")
    train(cfg, **inj)
    assert not (tmp_path / "final").exists()
    cfg, _ = make(tmp_path, "run.merge_lora=true")
    with pytest.raises(ConfigError, match="merge_lora=true needs a LoRA run"):
        cfg.validate(check_names=False)
    with pytest.raises(ValueError, match="no save_pretrained"):
        save_final(torch.nn.Linear(2, 2), None, tmp_path)
