"""GroupRLGRPOTrainer in two processes (torchrun, gloo on CPU); run by ``test_trl_two_ranks.py``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 trl_two_ranks.py OUT

One run per estimator family (:data:`PRESETS`), then the AVSPO run resumed from the checkpoint
its two processes wrote. Each rank writes what it saw to ``OUT/<run>/rank<k>.json``: its reward
function's outputs (its own slice, in its own order), the advantages TRL's step returned to it,
the advantages its loss consumed, and the AVSPO trigger state. The test rebuilds the global
batch from the two ranks' reward outputs itself; nothing here compares anything.
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


def _cpu_index_deserialize(storage, location):
    """Accept the location ``"cpu:<k>"``. accelerate gives each CPU process
    ``torch.device("cpu", k)`` and transformers 5.10 resumes a multi-process optimizer with
    ``map_location=args.device``, which torch's own CPU deserializer (``location == "cpu"``)
    refuses: a CPU-only upstream gap, unrelated to grouprl (on GPUs the device is ``cuda:k``)."""
    return storage if location.startswith("cpu:") else None


torch.serialization.register_package(11, lambda storage: None, _cpu_index_deserialize)

from trl_doubles import RecordingReward, config, run  # noqa: E402

PRESETS = ("rloo", "maxnorm_rloo", "f_grpo", "avspo")
"""Mean baseline (leave-one-out), MaxNorm scale with resolution, focal weight, virtual samples."""
PER_DEVICE = 6
"""2 ranks x 6 = 12 completions = 3 groups of G = 4: group 1 (rows 4-7) straddles the ranks."""
STEPS = 2
NAN_EVERY = 5
"""Local row 1 of each rank's batch is unscorable: NaN rows cross the gather too."""


def record(trainer, reward) -> dict:
    trig = trainer.grouprl_trigger
    return {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "rewards": reward.calls,
        "produced": [adv.tolist() for _, adv, _ in trainer.produced],
        "consumed": [adv.tolist() for adv in trainer.consumed],
        "trigger": None if trig is None else trig.state_dict(),
        "loaded_state": trainer.loaded_state,
    }


def train(out: Path, preset: str, steps: int, resume: str | None = None, **kw) -> None:
    args = config(out, per_device_train_batch_size=PER_DEVICE, max_steps=steps, **kw)
    trainer, reward = run(
        out, reward=RecordingReward(nan_every=NAN_EVERY), preset=preset, args=args, resume=resume
    )
    path = out / f"rank{trainer.accelerator.process_index}.json"
    path.write_text(json.dumps(record(trainer, reward)))


def main(out: Path) -> None:
    for preset in PRESETS:
        save = {"save_strategy": "steps", "save_steps": STEPS} if preset == "avspo" else {}
        train(out / preset, preset, STEPS, **save)
    checkpoint = out / "avspo" / f"checkpoint-{STEPS}"
    train(out / "avspo-resumed", "avspo", STEPS + 1, resume=str(checkpoint))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Tear the gloo group down before the interpreter exits. Left to the exit-time destructors,
    # one rank of a CI run (2026-12-01, under no other load) aborted with "terminate called
    # without an active exception" after all its runs had finished and written their records.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
