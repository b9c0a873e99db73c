"""Plant plausible trainer bugs one at a time and check that the step tests catch each.

    python scripts/planted_bugs.py                 # every bug against the known-answer step tests
    python scripts/planted_bugs.py --only clip     # the bugs whose name contains "clip"
    python scripts/planted_bugs.py --tests tests/train/test_loop.py

Each bug is one textual replacement in a copy of ``src/`` (a temporary folder; the checkout is
never touched); the tests then run against that copy (``PYTHONPATH``) and the script prints
which of them failed. A bug whose text no longer matches the source says ``stale`` (the
code moved: update the replacement). Among them are the review's that survived
every test before the step tests existed: the per-group KL weight ignored, NaN-reward
samples kept in the loss, DAPO's overlong masking skipped. Not in CI: it runs the step
tests once per bug (a few minutes); docs/mutation.md holds the last result.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_TESTS = ["tests/train/test_step_update.py", "tests/train/test_step_sampling.py"]

LOOP = "train/loop.py"
UPDATE = "train/update.py"
BUGS: dict[str, tuple[str, str, str]] = {
    # name: (file under src/grouprl, text, replacement)
    "per-group KL weight ignored": (
        LOOP,
        "kl_weight_n = adv.kl_weight.float().repeat_interleave(g)",
        "kl_weight_n = torch.ones_like(adv.kl_weight).float().repeat_interleave(g)",
    ),
    "NaN-reward samples kept in the loss": (
        LOOP,
        "keep_n = adv.keep.repeat_interleave(g) & ~torch.isnan(rewards).reshape(-1)",
        "keep_n = adv.keep.repeat_interleave(g)",
    ),
    "NaN-reward samples counted in the normaliser": (
        UPDATE,
        "loss_mask[rows], keep=targets.keep[rows],",
        "loss_mask[rows],",
    ),
    "DAPO overlong masking skipped": (
        LOOP,
        "batch = replace(batch, mask=overlong.mask(batch.mask, batch.truncated))",
        "batch = batch",
    ),
    "DAPO soft overlong penalty skipped": (
        LOOP,
        "rewards = overlong.rewards(verified, roll.completion_mask)",
        "rewards = verified",
    ),
    "overlong_cache ignored (always max_new_tokens // 5)": (
        "train/filters.py",
        "return cls(mode, max_new_tokens, cache or max(1, max_new_tokens // 5))",
        "return cls(mode, max_new_tokens, max(1, max_new_tokens // 5))",
    ),
    "dynamic sampling keeps every group": (
        LOOP,
        "kept = torch.arange(n, device=rewards.device) if sampler is None else sampler.add(rewards)",
        "kept = torch.arange(n, device=rewards.device) if sampler is None or "
        "sampler.add(rewards) is None else torch.arange(n, device=rewards.device)",
    ),
    "dynamic sampling never refills": (
        LOOP,
        "while not rounds or (sampler is not None and not sampler.done):",
        "while not rounds:",
    ),
    "dynamic sampling keeps the last informative groups": (
        "train/filters.py",
        "idx = torch.nonzero(informative).flatten()[: self.target - self.kept]",
        "idx = torch.nonzero(informative).flatten()[-(self.target - self.kept) :]",
    ),
    "gradient clip ignored": (
        UPDATE,
        "max_norm = spec.grad_clip if spec.grad_clip > 0 else math.inf",
        "max_norm = math.inf",
    ),
    "non-finite streak never reset": (UPDATE, "    log.streak = 0\n", ""),
    "non-finite limit off by one": (
        UPDATE,
        "log.diverged = log.streak >= spec.max_nonfinite_steps",
        "log.diverged = log.streak > spec.max_nonfinite_steps",
    ),
    "a skipped step keeps its gradient": (
        UPDATE,
        "            optimizer.step()\n        optimizer.zero_grad(set_to_none=True)\n",
        "            optimizer.step()\n            optimizer.zero_grad(set_to_none=True)\n",
    ),
    "a skipped step still steps AdamW": (
        UPDATE,
        "        if ok:\n            optimizer.step()\n",
        "        if not ok:\n            for q in params:\n"
        "                q.grad = torch.zeros_like(q)\n        optimizer.step()\n",
    ),
    "groups never shuffled": (
        UPDATE,
        'order = torch.randperm(batch.num_prompts, generator=shuffle, device="cpu")',
        "order = torch.arange(batch.num_prompts)",
    ),
    "one permutation for every epoch": (
        UPDATE,
        '        order = torch.randperm(batch.num_prompts, generator=shuffle, device="cpu")',
        "        shuffle = torch.Generator().manual_seed(shuffle.initial_seed())\n"
        '        order = torch.randperm(batch.num_prompts, generator=shuffle, device="cpu")',
    ),
    "epochs ignored": (UPDATE, "for _ in range(schedule.ppo_epochs):", "for _ in range(1):"),
    "minibatch normalised over the whole batch": (
        UPDATE,
        "loss_mask[rows], keep=targets.keep[rows],",
        "loss_mask, keep=targets.keep,",
    ),
    "AGPO clip bounds ignored": (
        LOOP,
        "targets = Targets(adv_n, keep_n, kl_weight_n, loss_ref, clip, correction=corr)",
        "targets = Targets(\n        adv_n, keep_n, kl_weight_n, loss_ref, dict(preset.surrogate_params), correction=corr\n    )",
    ),
    "AGPO temperature not used for sampling": (
        LOOP,
        "settings, per_prompt = sampling_at(s, temperature, logprob_t)",
        "settings, per_prompt = sampling_at(s, s.temperature, logprob_t)",
    ),
    "AGPO log-probs at the sampling temperature": (
        LOOP,
        "batch = join_rounds(rounds, pad_id, temperature if logprob_t is None else logprob_t)",
        "batch = join_rounds(rounds, pad_id, _mean(temperature))",
    ),
    "AGPO ε of the first prompt for all": (
        "control/agpo.py",
        "        eps = self.clip.update_batch(self.last_stats, h)  # [P]",
        "        eps = self.clip.update_batch(self.last_stats, h)[:1].expand(p).clone()  # [P]",
    ),
    "IS-GRPO sampler never observes": (
        "train/prompts.py",
        "        self.sampler.observe_groups(indices, sigma, successes, trials)",
        "        pass",
    ),
    "IS-GRPO observes the population std": (
        "train/prompts.py",
        "advantages.group_std(rewards).cpu()",
        "advantages.group_std(rewards, ddof=0).cpu()",
    ),
}


def plant(name: str, tests: list[str]) -> str:
    """Run ``tests`` against a copy of src/ with bug ``name`` planted; a one-line verdict."""
    file, text, replacement = BUGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
        target = src / "grouprl" / file
        code = target.read_text()
        if code.count(text) != 1:
            return f"stale: the text appears {code.count(text)} times in {file}"
        target.write_text(code.replace(text, replacement))
        env = {**os.environ, "PYTHONPATH": str(src)}
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
    failed = sorted(set(re.findall(r"FAILED \S+::(\w+)", run.stdout)))
    return "caught by " + ", ".join(failed) if failed else "SURVIVED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="the bugs whose name contains this")
    parser.add_argument("--tests", nargs="*", default=STEP_TESTS)
    args = parser.parse_args()
    survived = 0
    for name in BUGS:
        if args.only in name:
            verdict = plant(name, args.tests)
            survived += not verdict.startswith("caught")
            print(f"{name}: {verdict}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
