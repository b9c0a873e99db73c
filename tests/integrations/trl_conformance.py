"""TRL's loss types under accumulation, two processes (torchrun, gloo on CPU); run by
``test_trl_conformance.py``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 trl_conformance.py OUT

One run per case of :data:`CASES`: TRL's own ``GRPOTrainer`` for each of its loss types, and
``GroupRLGRPOTrainer(loss="grouprl")`` (grouprl's loss path under the same config). Every run
has ``steps_per_generation`` (4) ≠ ``gradient_accumulation_steps`` (2), so one generation batch
feeds two optimizer steps, ragged completions (EOS or the length limit) and learning rate 0,
so every micro-batch is scored by the same parameters and the step's gradient depends only on
how the micro-batch losses are normalised. Each rank writes ``OUT/<case>/rank<k>.json``: per
optimizer step, the inputs of each micro-batch its loss consumed and the gradient the optimizer
was about to apply (after DDP's average over the ranks). Nothing here compares anything.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

torch.set_num_threads(1)

from tiny_lm import tiny_model, tiny_tokenizer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_doubles import RecordingReward, config, dataset  # noqa: E402

from grouprl.integrations import trl as gt  # noqa: E402

PER_DEVICE, GENERATIONS, ACCUM, PER_GENERATION, STEPS = 4, 4, 2, 4, 2
"""4 rows a micro-batch, groups of 4, an optimizer step every 2 micro-batches, a generation
every 4: 16 rows a rank per generation, 2 optimizer steps (windows) per generation."""
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
"""TRL 1.16's loss types whose per-token gradient at ratio 1 is −A ∇log π (vespo's weight
depends on the sequence's ratios and is left out)."""
CASES = {
    **{f"trl-{t}": ("trl", {"loss_type": t}) for t in LOSS_TYPES},
    **{f"grouprl-{t}": ("grouprl", {"loss_type": t}) for t in LOSS_TYPES if t != "luspo"},
    "trl-dapo-masked": ("trl", {"loss_type": "dapo", "mask_truncated_completions": True}),
    "grouprl-dapo-masked": ("grouprl", {"loss_type": "dapo", "mask_truncated_completions": True}),
}
"""case -> (trainer, GRPOConfig fields). ``luspo`` runs at the sequence level (its paper's);
grouprl's loss path has no sequence-level ``seq_mean_token_sum`` to compare."""
LEVEL = {"luspo": "sequence"}
EXTRA = {"cispo": {"epsilon_high": 5.0}}
"""CISPO's absolute weight cap: the value TRL's documentation recommends."""


class Grads(TrainerCallback):
    """The gradient each optimizer step is about to apply, flattened in parameter order."""

    def __init__(self):
        self.model = None
        self.grads: list[list[float]] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        flat = [p.grad.reshape(-1) for p in self.model.parameters() if p.grad is not None]
        self.grads.append(torch.cat(flat).tolist())


def recording(base):
    class Recording(base):
        """Keeps the inputs of every micro-batch loss, in the order they were consumed."""

        def _compute_loss(self, model, inputs):
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
            self.micro.append({k: inputs[k].tolist() for k in keys})
            return super()._compute_loss(model, inputs)

    return Recording


def train(out: Path, kind: str, fields: dict) -> None:
    args = config(
        out,
        per_device_train_batch_size=PER_DEVICE,
        num_generations=GENERATIONS,
        gradient_accumulation_steps=ACCUM,
        steps_per_generation=PER_GENERATION,
        max_steps=STEPS,
        max_completion_length=5,
        learning_rate=0.0,
        max_grad_norm=0.0,  # no clipping: the recorded gradient is the one the losses made
        bf16=False,  # fp32 passes, so an exact normaliser agrees to fp32 rounding
        importance_sampling_level=LEVEL.get(fields["loss_type"], "token"),
        **EXTRA.get(fields["loss_type"], {}),
        **fields,
    )
    grads = Grads()
    kw = {"loss": "grouprl"} if kind == "grouprl" else {}
    cls = recording(gt.GroupRLGRPOTrainer if kind == "grouprl" else GRPOTrainer)
    trainer = cls(
        model=tiny_model(),
        reward_funcs=RecordingReward(nan_every=5),
        args=args,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        callbacks=[grads],
        **kw,
    )
    trainer.micro = []
    grads.model = trainer.model
    trainer.train()
    rank = trainer.accelerator.process_index
    record = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "micro": trainer.micro,
        "grads": grads.grads,
        "max_completion_length": args.max_completion_length,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def main(out: Path) -> None:
    for name, (kind, fields) in CASES.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        train(out / name, kind, fields)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
