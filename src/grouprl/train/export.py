"""The trained policy as a folder that transformers, TRL and vLLM load: ``save_pretrained`` + tokenizer.

    RUN_DIR/final/          the policy: config.json, model.safetensors, generation_config.json,
                            the tokenizer (tokenizer.json, tokenizer_config.json, chat template)
                            and grouprl_final.json (step, preset, model, task)
    RUN_DIR/final_merged/   LoRA runs with ``run.merge_lora: true``: the adapter merged into
                            the base weights, a plain model folder like the one above

``AutoModelForCausalLM.from_pretrained(RUN_DIR / "final")`` and
``AutoTokenizer.from_pretrained(RUN_DIR / "final")`` give back the policy and its tokenizer
(tested: same logits, same token ids); ``vllm serve RUN_DIR/final`` and
``GRPOTrainer(model="RUN_DIR/final", ...)`` read the same folder. The tiny models' tokenizers
are made on the spot (``grouprl.models``) but are ordinary ``PreTrainedTokenizerFast``
objects, so ``save_pretrained`` writes them whole (vocabulary, pre-tokenizer, decoder,
special tokens) and they load back without grouprl.

LoRA runs (``model.lora_rank > 0``) write the adapter to ``final/`` (peft's
``adapter_config.json`` + ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base,
RUN_DIR / "final")`` with the base model named by ``model.name``) and, with
``run.merge_lora``, the merged model to ``final_merged/`` (a copy of the policy is merged,
so for a moment the weights are in memory twice). A model built from scratch (``tiny``) has
no base on disk: merge it to get something others can load.

Written at the end of a finished run (not when a signal stops it) to a temporary folder
that is then renamed, so a reader never sees half a model. [OURS]
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["FINAL", "MERGED", "save_final", "save_run"]

FINAL = "final"
MERGED = "final_merged"


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def _replace(tmp: Path, target: Path) -> None:
    """Move ``tmp`` to ``target``, replacing an older ``target`` (a rename per step)."""
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' progress bars off for the block, as they were after it."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - a model with save_pretrained implies transformers
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _write(model: Any, tokenizer: Any, target: Path, meta: dict[str, Any]) -> Path:
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _no_progress_bar():  # transformers' "Writing model shards" bar, noise in a log
            model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "grouprl_final.json").write_text(json.dumps(meta, indent=1, default=str))
        _replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_final(
    model: Any,
    tokenizer: Any,
    run_dir: str | Path,
    *,
    merge_lora: bool = False,
    meta: dict[str, Any] | None = None,
) -> list[Path]:
    """Write ``model`` and ``tokenizer`` to ``run_dir/final`` (and ``final_merged``); the folders.

    ``model`` is a transformers ``PreTrainedModel`` or a peft ``PeftModel`` (then ``final``
    holds the adapter and ``merge_lora`` adds ``final_merged``). ``meta`` goes into
    ``grouprl_final.json``.
    """
    if not hasattr(model, "save_pretrained"):
        raise ValueError(
            f"the policy ({type(model).__name__}) has no save_pretrained: only transformers "
            "and peft models can be exported; set run.save_final=false"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    peft = _is_peft(model)
    meta = {**(meta or {}), "lora_adapter": peft}
    out = [_write(model, tokenizer, run_dir / FINAL, meta)]
    if peft and merge_lora:
        merged = copy.deepcopy(model).merge_and_unload()
        out.append(_write(merged, tokenizer, run_dir / MERGED, {**meta, "lora_adapter": False}))
    elif merge_lora:
        raise ValueError("run.merge_lora is set but the policy has no LoRA adapter to merge")
    return out


def save_run(run: Any, say: Any = print) -> list[Path]:
    """:func:`save_final` for a trainer ``Run`` (its model, tokenizer, run folder, config).

    Says where the folders went; a policy without ``save_pretrained`` (a plain torch module
    handed to the trainer) is not written, and it says so instead of failing the run.
    """
    cfg = run.cfg
    if not hasattr(run.model, "save_pretrained"):
        say(f"final policy not written: {type(run.model).__name__} has no save_pretrained")
        return []
    meta = {
        "step": run.step,
        "preset": cfg.algorithm.preset,
        "model": cfg.model.name,
        "task": cfg.task.name,
        "task_params": dict(cfg.task.params),
    }
    try:
        out = save_final(
            run.model, run.tokenizer, run.run_dir, merge_lora=cfg.run.merge_lora, meta=meta
        )
    except OSError as err:  # a full disk: the message train.diskfull gives every writer
        from grouprl.train.diskfull import DiskFullError, is_disk_full

        if not is_disk_full(err):
            raise
        raise DiskFullError(
            Path(run.run_dir) / FINAL,
            step=run.step,
            ckpt_dir=Path(run.run_dir) / "checkpoints",
            cleaned="The partial export was removed; the final checkpoint is complete, so "
            "--resume only writes the export again.",
            cause=err,
        ) from err
    for folder in out:
        say(f"final policy: {folder} (save_pretrained + tokenizer)")
    return out
