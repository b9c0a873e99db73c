"""last_boxed: the one \\boxed{} parser, shared by reasoning-gym extraction and AGPO vote keys."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grouprl.control.agpo import extract_answer_key
from grouprl.tasks.answers import last_boxed
from grouprl.tasks.reasoning_gym import extract_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces: the flat regex found none
        ("\\boxed{\\sqrt{\\frac{a}{b}}} done", "\\sqrt{\\frac{a}{b}}"),  # two levels
        ("\\boxed{3} then \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # the last box wins
        ("\\boxed {7}", "7"),  # LaTeX allows a space before the brace
        ("\\boxed{}", ""),  # present but empty: "" (not None)
        ("\\boxed{1} and \\boxed{2", "1"),  # the last box is never closed: the one before
        ("\\boxed{x \\boxed{y", None),  # nothing closed
        ("no box here {1}", None),
        ("\\boxed", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


_BALANCED = st.recursive(
    st.text(alphabet="ab1 \\+-", max_size=4),
    lambda inner: st.builds(lambda a, b: a + "{" + b + "}", inner, inner),
    max_leaves=6,
)


@given(prefix=st.text(alphabet="xy {}", max_size=6), content=_BALANCED)
def test_last_boxed_returns_any_balanced_content(prefix, content):
    # Whatever stands before it, the last box's balanced content comes back whole.
    assert last_boxed(f"{prefix} \\boxed{{{content}}} tail") == content


def test_both_callers_read_nested_braces():
    # reasoning-gym (non-numeric gold): the box's content, not the reply's last line.
    assert extract_answer("I get \\boxed{\\frac{1}{2}}", numeric=False) == "\\frac{1}{2}"
    # numeric gold: the last number inside the box (4, the denominator: the number parser
    # is unchanged), not the 9 after the box as the flat regex's whole-reply fallback gave.
    assert extract_answer("\\boxed{\\frac{3}{4}} or 9", numeric=True) == "4"
    # AGPO's vote key: the same content, lower-cased.
    assert extract_answer_key("so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
