"""The dataset task: every data source, text and chat prompts as TRL renders them, splits,
scoring through TRL-style reward functions, and each mistake a clear error up front."""

from __future__ import annotations

import json
import math

import pytest
import trl_doc_rewards as docs

from grouprl import models, tasks
from grouprl.tasks.dataset import DatasetTask, load_table

datasets = pytest.importorskip("datasets")  # the `data` extra; not one of our modules
pyarrow = pytest.importorskip("pyarrow")

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(20)]
CHAT = [
    {"prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Say {w}."}], "word": w}
    for w in ("yes", "no", "maybe", "sure")
]  # fmt: skip
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def _key(rows):
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def test_every_source_gives_the_same_rows(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.to_csv(str(tmp_path / "rows.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    sources = [ds, ROWS, ds.to_pandas(), *(str(tmp_path / n) for n in
               ("rows.jsonl", "rows.parquet", "saved"))]  # fmt: skip
    for source in sources:
        rows, held = load_table(source)
        assert _key(rows) == _key(ROWS) and held is None, type(source)
    csv_rows, _ = load_table(tmp_path / "rows.csv")  # CSV infers types: "2" reads as 2
    assert [r["prompt"] for r in csv_rows] == [r["prompt"] for r in ROWS]


def test_a_dataset_dict_holds_out_its_test_split(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:15]),
                               "test": datasets.Dataset.from_list(ROWS[15:])})  # fmt: skip
    dd.save_to_disk(str(tmp_path / "dd"))
    for source in (dd, str(tmp_path / "dd")):
        task = DatasetTask(source, rewards=[exact])
        assert len(task._rows["train"]) == 15 and _key(task._rows["eval"]) == _key(ROWS[15:])


def test_parquet_task_scores_with_columns(tmp_path):
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.parquet"))
    task = tasks.get("dataset", data=str(tmp_path / "rows.parquet"), rewards=[exact])
    ex = task.examples("train", 3, seed=0)
    refs = [e.reference for e in ex for _ in range(2)]  # G = 2, prompt-major
    texts = [r["answer"] if i % 2 == 0 else "wrong" for i, r in enumerate(refs)]
    out = task.reward_batch(texts, refs, [[1]] * 6, step=1, max_steps=5)
    assert out.rewards == [1.0, 0.0] * 3 and out.unscorable == 0
    assert task.verify(ex[0].reference["answer"], ex[0].reference) == 1.0
    assert task.reward_range == (0.0, 1.0)


def test_splits_are_fixed_disjoint_and_never_empty():
    a = DatasetTask(datasets.Dataset.from_list(ROWS), rewards=[exact], eval_fraction=0.25)
    b = DatasetTask(list(ROWS), rewards=[exact], eval_fraction=0.25)
    assert _key(a._rows["eval"]) == _key(b._rows["eval"])  # chosen by content, not by source
    assert not set(_key(a._rows["eval"])) & set(_key(a._rows["train"]))
    assert len(a._rows["eval"]) + len(a._rows["train"]) == len(ROWS)
    two = DatasetTask(ROWS[:2], rewards=[exact])  # 10 % of 2 rows: still one held out
    assert len(two._rows["eval"]) == 1 and len(two._rows["train"]) == 1
    none = DatasetTask(ROWS, rewards=[exact], eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"'eval' split of the data is empty.*eval.every=0"):
        none.examples("eval", 2, 0)
    held = DatasetTask(ROWS[:5], rewards=[exact], eval_data=ROWS[5:8])
    assert len(held._rows["train"]) == 5 and len(held.examples("eval", 6, 0)) == 6
    ids = [e.reference["prompt"] for e in a.examples("train", len(a._rows["train"]), 3)]
    assert sorted(ids) == sorted(r["prompt"] for r in a._rows["train"])  # a shuffle, no repeats


def test_text_prompt_is_rendered_as_trl_tokenises_it():
    from tokenizers import processors

    task = DatasetTask(ROWS, rewards=[exact])
    ex = task.examples("train", 1, 0)[0]
    tok = models.char_tokenizer()
    tok.chat_template = TEMPLATE  # TRL ignores the template for text prompts; so do we
    assert task.render(ex, tok) == ex.reference["prompt"]
    bos = models.char_tokenizer()
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos.bos_token_id)]
    )
    text = task.render(ex, bos)
    # TRL: processing_class(text=prompts)["input_ids"]; the rollout: add_special_tokens=False
    ours = bos(text, add_special_tokens=False)["input_ids"]
    assert ours == bos(ex.reference["prompt"])["input_ids"] and ours[0] == bos.bos_token_id


def test_chat_prompts_use_the_template_and_reach_rewards_as_messages():
    def said(prompts, completions, word, **kwargs):
        assert prompts[0][0] == {"role": "system", "content": "Be brief."}
        return [float(c[0]["content"] == w and c[0]["role"] == "assistant")
                for c, w in zip(completions, word)]  # fmt: skip

    task = DatasetTask(datasets.Dataset.from_list(CHAT), rewards=[said, docs.format_reward_func],
                       reward_weights=[1.0, 0.5], eval_fraction=0.0)  # fmt: skip
    tok = models.char_tokenizer()
    tok.chat_template = TEMPLATE
    ex = task.examples("train", 2, 0)
    w = ex[0].reference["word"]
    assert task.render(ex[0], tok) == f"[system]Be brief.\n[user]Say {w}.\n[assistant]"
    texts = [w, "<think>a</think><answer>b</answer>"]
    out = task.reward_batch(texts, [ex[0].reference] * 2, [[1], [2]])
    assert out.rewards == [1.0, 0.5]  # said 1 ·1 ; format 1 · 0.5
    with pytest.raises(ValueError, match="no chat template"):
        task.render(ex[0], models.char_tokenizer())


@pytest.mark.parametrize(
    ("data", "kwargs", "message"),
    [
        ([{"question": "x"}], {}, r"no 'prompt' column; its columns are: question"),
        ([], {}, "has no rows"),
        ([{"prompt": ""}], {}, "must be a non-empty text or a list of"),
        ([{"prompt": 3}], {}, "must be a non-empty text"),
        ([CHAT[0], {"prompt": "text"}], {}, "row 1: the prompts are chat messages"),
        ("rows.txt", {}, "unknown file type"),
        ("missing.jsonl", {}, "does not exist"),
        (".", {}, "is not a saved dataset"),
        (ROWS, {"demonstration": "solution"}, "demonstration column 'solution' is missing"),
        (ROWS, {"eval_fraction": 1.0}, r"eval_fraction must be in \[0, 1\)"),
        (ROWS, {"rewards": []}, "no reward function given"),
        (ROWS, {"rewards": [docs.boxed_reward_func]}, r"needs argument\(s\) \['ground_truth'\]"),
        (ROWS, {"reward_range": (1, 0)}, "lo < hi"),
        (None, {}, "needs data="),
    ],
)
def test_mistakes_are_clear_errors(data, kwargs, message):
    kwargs = {"rewards": [exact], **kwargs}
    with pytest.raises(ValueError, match=message):
        DatasetTask(data, **kwargs)


def test_a_reward_returning_the_wrong_length_fails_at_build():
    def short(completions, **kwargs):
        return [0.0]

    with pytest.raises(
        ValueError, match=r"'short' failed on a trial call.*returned 1 rewards for 2"
    ):
        DatasetTask(ROWS, rewards=[short])
    DatasetTask(ROWS, rewards=[short], probe=False)  # the trial call can be skipped


def test_verify_raises_on_failure_and_is_nan_when_nothing_applies():
    def picky(completions, **kwargs):
        if completions[0] == "boom":
            raise RuntimeError("no")
        return [None]

    task = DatasetTask(ROWS, rewards=[picky], probe=False)
    ref = task.examples("train", 1, 0)[0].reference
    assert math.isnan(task.verify("ok", ref))
    with pytest.raises(RuntimeError, match="picky: RuntimeError: no"):
        task.verify("boom", ref)


def test_scoring_makes_no_tensor_on_the_default_device():
    # the trainer's device test trick: a tensor made on the default device lands on "meta"
    # and fails when read; reward bookkeeping stays on the CPU whatever the default device
    import torch

    task = DatasetTask(ROWS, rewards=[exact, docs.reward_func], reward_weights=[1, 0.5])
    ref = task.examples("train", 1, 0)[0].reference
    torch.set_default_device("meta")
    try:
        out = task.reward_batch([ref["answer"], "no"], [ref, ref], [[1], [2]], timeout_s=0)
        one = task.verify(ref["answer"], ref)
    finally:
        torch.set_default_device(None)
    n = len(ref["answer"])
    assert out.rewards == [1.0 + 0.5 * n, 1.0] and one == 1.0 + 0.5 * n
