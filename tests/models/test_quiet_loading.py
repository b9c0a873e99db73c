"""Loading a model folder prints nothing a user must learn to ignore, and names a missing one."""

from __future__ import annotations

import logging

import pytest

from grouprl import cli, models


def _bpe_folder(tmp_path):
    """An HF folder: a tiny Llama and a BPE tokenizer saved with
    ``clean_up_tokenization_spaces: true``, as SmolLM2's converted GGUF tokenizer is."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    model, _ = models.load("tiny:d=16,layers=1,heads=2,ctx=32")
    model.save_pretrained(tmp_path)
    vocab = {c: i for i, c in enumerate(["<eos>", "a", "b", ".", " "])}
    bpe = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    bpe.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    bpe.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<eos>", clean_up_tokenization_spaces=True
    ).save_pretrained(tmp_path)
    return tmp_path


def test_a_bpe_tokenizer_with_cleanup_on_loads_without_the_cleanup_warning(tmp_path):
    folder = _bpe_folder(tmp_path)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)  # it does not propagate to root
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process
    try:
        _, tok = models.load(str(folder))
        text = tok.decode(tok("a . b", add_special_tokens=False)["input_ids"])
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    warnings = [r.getMessage() for r in records if "clean_up_tokenization" in r.getMessage()]
    assert warnings == []
    assert tok.clean_up_tokenization_spaces is False
    assert text == "a . b"  # exactly the sampled tokens, the space before "." kept


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("./no/such/model", "model path './no/such/model' does not exist; pass an HF model"),
        ("{tmp}/m.gguf", "GGUF file '{tmp}/m.gguf' does not exist"),
        ("{tmp}", "folder '{tmp}' has no config.json: not an HF model folder"),
    ],
)
def test_a_missing_model_path_is_one_line_and_exit_2_before_the_run_folder_exists(
    tmp_path, capsys, spec, message
):
    spec, message = spec.format(tmp=tmp_path), message.format(tmp=tmp_path)
    out = tmp_path / "run"
    assert cli.main(["train", "--model", spec, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grouprl train: {message}") and err.count("\n") == 1
    assert not out.exists()  # refused at load_config, before anything was created
    with pytest.raises(models.ModelError, match="pass an HF model folder"):
        models.check_spec(spec)
