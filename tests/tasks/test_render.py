"""Rendering: chat templates when the tokenizer has one, the plain prompt otherwise."""

from __future__ import annotations

from grouprl import models, tasks
from grouprl.tasks.base import Example, chat_render

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_chat_template_used_when_present():
    tok = models.char_tokenizer()
    assert chat_render("2+2?", tok) == "2+2?"  # no template: unchanged
    tok.chat_template = TEMPLATE
    assert chat_render("2+2?", tok) == "[user]2+2?\n[assistant]"
    assert (
        chat_render("2+2?", tok, system="Be brief.") == "[system]Be brief.\n[user]2+2?\n[assistant]"
    )
    task = tasks.get("basic_arithmetic", system="S")
    ex = Example("x", "Calculate 1 + 1.", {"answer": "2"})
    assert task.render(ex, tok) == "[system]S\n[user]Calculate 1 + 1.\n[assistant]"


def test_maze_render_for_maze_vocab_and_for_other_tokenizers():
    task = tasks.get("maze")
    ex = task.examples("train", 1, 0)[0]
    maze_tok = models.task_tokenizer(task)
    text = task.render(ex, maze_tok)
    assert text == f"<bos> {ex.prompt} <sep>"
    ids = maze_tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 27 and maze_tok.unk_token_id not in ids
    other = models.char_tokenizer()
    other.chat_template = TEMPLATE
    described = task.render(ex, other)
    assert described.startswith("[user]Solve this 5x5 maze") and ex.prompt.split()[0] in described
