"""A tiny Llama built from a config and a word-level tokenizer made here: no download.

Used by the TRL tests (in process and under torchrun) and by the verl end-to-end run, which
needs them on disk (``save_tiny``) with a chat template, as verl's data loader applies one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = list("abcdefghijklmnop")
"""The vocabulary beyond the three special tokens: one letter a word."""

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)
"""Messages joined by spaces: enough for verl's ``apply_chat_template`` [OURS]."""


def tiny_tokenizer(chat_template: bool = False) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    if chat_template:
        out.chat_template = CHAT_TEMPLATE
    return out


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return LlamaForCausalLM(cfg)


def save_tiny(folder: str | Path, seed: int = 0) -> Path:
    """Model and tokenizer (with the chat template) in ``folder``, as from_pretrained reads them."""
    folder = Path(folder)
    tiny_model(seed).save_pretrained(folder)
    tiny_tokenizer(chat_template=True).save_pretrained(folder)
    return folder
