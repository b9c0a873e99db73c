"""Run TRL's own GRPO trainer tests against GroupRLGRPOTrainer, offline, and count the outcomes.

    python scripts/trl_suite.py --trl-repo /path/to/trl-checkout --variant none [--variant trl ...]

TRL's ``tests/test_grpo_trainer.py`` (with its ``testing_utils.py`` and ``conftest.py``) is
copied from a TRL checkout into a temporary folder, never into this repository. The copy
gets two lines after its imports: ``GRPOTrainer`` becomes the variant's class and
``load_dataset`` a stand-in for the hub datasets. Every ``trl-internal-testing/<name>`` model,
tokenizer or processor id is served from a folder built here from a config (a tiny Qwen2 of
the same head — causal LM or sequence classifier — with a BPE tokenizer trained on the Zen
of Python and a chat template); ``trl-internal-testing/zen`` is the Zen of Python in the
requested format. Tests needing what the stand-ins do not provide (images, remote code,
vLLM, PEFT...) fail or skip in every variant alike; compare a variant with ``trl`` (TRL's
own class under the same stand-ins).

Variants: ``trl`` (TRL's GRPOTrainer), ``none`` (GroupRLGRPOTrainer, no keyword),
``preset:<name>`` (GroupRLGRPOTrainer with that preset; ``preset:<name>:override`` also
passes ``override_config=True``). Prints one line per variant: passed / failed / skipped /
xfailed / errors, and the names of the tests that pass under ``trl`` but not the variant.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

SHIM = r'''
"""Stand-ins for the hub (written by grouprl's scripts/trl_suite.py)."""
import os
import re
from pathlib import Path

import torch
import transformers
from datasets import Dataset, DatasetDict

ZEN = [
    "Beautiful is better than ugly.", "Explicit is better than implicit.",
    "Simple is better than complex.", "Complex is better than complicated.",
    "Flat is better than nested.", "Sparse is better than dense.", "Readability counts.",
    "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.", "Errors should never pass silently.",
    "Unless explicitly silenced.", "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.",
    "Now is better than never.", "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] if m['content'] is string "
    "else '' }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
ROOT = Path(os.environ["GROUPRL_TRL_SUITE_MODELS"])


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(ZEN * 4 + ["user assistant system"], trainer)
    out = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
    )
    out.chat_template = CHAT
    return out


def local(name_or_path):
    """The local folder for a ``trl-internal-testing/<name>`` id, built on first use."""
    if not isinstance(name_or_path, str) or not name_or_path.startswith("trl-internal-testing/"):
        return name_or_path
    name = name_or_path.split("/", 1)[1]
    folder = ROOT / name
    if (folder / "config.json").exists():
        return str(folder)
    if "ForCausalLM" not in name and "ForSequenceClassification" not in name:
        raise OSError(f"offline stand-in: no tiny model for {name_or_path}")
    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_labels=1,
        tie_word_embeddings=False,
    )
    head = "ForSequenceClassification" if "ForSequenceClassification" in name else "ForCausalLM"
    model = getattr(transformers, "Qwen2" + head)(cfg)
    model.generation_config = transformers.GenerationConfig(
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    ) if head == "ForCausalLM" else None
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _wrap(owner, attr="from_pretrained"):
    original = getattr(owner, attr).__func__

    def from_pretrained(cls, name, *args, **kwargs):
        return original(cls, local(name), *args, **kwargs)

    setattr(owner, attr, classmethod(from_pretrained))


for _owner in (
    transformers.PreTrainedModel, transformers.PretrainedConfig, transformers.AutoConfig,
    transformers.AutoTokenizer, transformers.AutoProcessor,
    transformers.tokenization_utils_base.PreTrainedTokenizerBase,
):
    _wrap(_owner)
from transformers.models.auto.auto_factory import _BaseAutoModelClass  # noqa: E402

_wrap(_BaseAutoModelClass)


def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    if path != "trl-internal-testing/zen" or name not in (
        "standard_prompt_only", "conversational_prompt_only"
    ):
        raise OSError(f"offline stand-in: no dataset {path!r} / {name!r}")
    def make(lines):
        if name == "standard_prompt_only":
            return Dataset.from_dict({"prompt": lines})
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": x}] for x in lines]})
    parts = DatasetDict({"train": make(ZEN), "test": make(ZEN[:2])})
    if streaming:
        parts = {k: v.to_iterable_dataset() for k, v in parts.items()}
        if split is None:
            from datasets import IterableDatasetDict
            return IterableDatasetDict(parts)
    return parts if split is None else parts[split]


VARIANT = os.environ.get("GROUPRL_TRL_SUITE_VARIANT", "trl")
if VARIANT == "trl":
    from trl import GRPOTrainer
elif VARIANT == "none":
    from grouprl.integrations.trl import GroupRLGRPOTrainer as GRPOTrainer
else:
    from grouprl.integrations.trl import GroupRLGRPOTrainer as _Ours

    _parts = VARIANT.split(":")
    _kw = {"preset": _parts[1]}
    if _parts[2:] == ["override"]:
        _kw["override_config"] = True

    class GRPOTrainer(_Ours):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**_kw, **kwargs})
'''


def _older_trl(source: str) -> str:
    """Names the checkout's tests import from ``trl.import_utils`` that the installed TRL lacks
    (a newer checkout) are defined as "not available" before the import."""
    names: list[str] = []
    for block in re.findall(r"from trl\.import_utils import \(?([^)]*?)\)?\n(?=\S)", source):
        names += [n.strip() for n in block.replace("\n", ",").split(",") if n.strip()]
    if not names:
        return source
    head = (
        "import trl.import_utils as _grouprl_iu  # grouprl swap: names this TRL lacks\n"
        f"for _n in {sorted(set(names))!r}:\n"
        "    if not hasattr(_grouprl_iu, _n):\n"
        "        setattr(_grouprl_iu, _n, lambda: False)\n"
    )
    first = re.search(r"^(import |from )", source, flags=re.M)
    return source[: first.start()] + head + source[first.start() :]


def prepare(trl_repo: Path, work: Path) -> Path:
    tests = work / "tests"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    for name in ("testing_utils.py", "testing_constants.py", "conftest.py"):
        text = subprocess.run(
            ["git", "--git-dir", str(trl_repo), "show", f"HEAD:tests/{name}"],
            capture_output=True,
            text=True,
        )
        if text.returncode == 0:
            (tests / name).write_text(_older_trl(text.stdout))
    source = subprocess.run(
        ["git", "--git-dir", str(trl_repo), "show", "HEAD:tests/test_grpo_trainer.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (tests / "_swap.py").write_text(SHIM)
    swap = "from ._swap import GRPOTrainer, load_dataset  # noqa: E402,F811 (grouprl swap)\n\n\n"
    first = re.search(r"^(def |class |@)", source, flags=re.M)
    source = source[: first.start()] + swap + source[first.start() :]
    (tests / "test_grpo_trainer.py").write_text(_older_trl(source))
    return tests / "test_grpo_trainer.py"


def run(test_file: Path, variant: str, models: Path, extra: list[str]) -> dict[str, str]:
    report = test_file.parent / f"junit-{variant.replace(':', '_')}.xml"
    env = {
        **os.environ,
        "GROUPRL_TRL_SUITE_VARIANT": variant,
        "GROUPRL_TRL_SUITE_MODELS": str(models),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-W",
        "ignore",
        f"--junitxml={report}",
        "--rootdir",
        str(test_file.parent.parent),
        str(test_file),
        *extra,
    ]
    subprocess.run(cmd, cwd=test_file.parent.parent, env=env, capture_output=True)
    outcome: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        kinds = [c.tag for c in case]
        if "skipped" in kinds:
            msg = next(c for c in case if c.tag == "skipped").get("type", "")
            outcome[name] = "xfailed" if "xfail" in msg else "skipped"
        elif "failure" in kinds:
            outcome[name] = "failed"
        elif "error" in kinds:
            outcome[name] = "error"
        else:
            outcome[name] = "passed"
    return outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-repo", required=True, type=Path, help="a TRL git directory")
    ap.add_argument("--variant", action="append", default=None)
    ap.add_argument("-k", default=None, help="pytest -k expression")
    cli = ap.parse_args()
    variants = cli.variant or ["trl", "none"]
    if "trl" not in variants:
        variants = ["trl", *variants]
    extra = ["-k", cli.k] if cli.k else []
    with tempfile.TemporaryDirectory() as tmp:
        test_file = prepare(cli.trl_repo, Path(tmp) / "suite")
        models = Path(tmp) / "models"
        results = {v: run(test_file, v, models, extra) for v in variants}
    base = results["trl"]
    for variant, outcome in results.items():
        counts = {
            k: sum(1 for v in outcome.values() if v == k)
            for k in ("passed", "failed", "error", "skipped", "xfailed")
        }
        applicable = [n for n, v in base.items() if v == "passed"]
        kept = sum(1 for n in applicable if outcome.get(n) == "passed")
        print(
            f"{variant}: {counts} | of the {len(applicable)} tests passing with TRL's class: "
            f"{kept} pass"
        )
        lost = sorted(n for n in applicable if outcome.get(n) != "passed")
        if variant != "trl" and lost:
            print("  not passing:", ", ".join(lost))


if __name__ == "__main__":
    main()
