"""Maze generator (perfect mazes, unique path) and verifier (hand-derived cases)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl import tasks
from grouprl.tasks.maze import MOVES, Maze, MazeTask, generate_maze, parse_moves

# A 3 × 3 serpentine maze, by hand (open bits: U=1, D=2, L=4, R=8):
#   0 - 1 - 2        0: R=8      1: L+R=12   2: L+D=6
#           |        3: R+D=10   4: L+R=12   5: U+L=5
#   3 - 4 - 5        6: U+R=9    7: L+R=12   8: L=4
#   |
#   6 - 7 - 8        start 0, goal 8: the only path is R R D L L D R R.
SERPENT = Maze(3, (8, 12, 6, 10, 12, 5, 9, 12, 4), start=0, goal=8)
PATH = "R R D L L D R R"


def all_simple_paths(maze: Maze) -> list[list[str]]:
    """Every simple path start -> goal, by exhaustive search (the test's own plain loop)."""
    found, stack = [], [(maze.start, [maze.start], [])]
    while stack:
        cell, seen, moves = stack.pop()
        if cell == maze.goal:
            found.append(moves)
            continue
        for move in MOVES:
            nxt = maze.step(cell, move)
            if nxt is not None and nxt not in seen:
                stack.append((nxt, [*seen, nxt], [*moves, move]))
    return found


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        (PATH, 1.0),  # the unique path
        ("RRDLLDRR", 1.0),  # no separators
        ("R, R, D, L, L, D, R, R", 1.0),  # commas
        ("D", 0.0),  # cell 0 has no down opening: wall
        ("R L", 0.0),  # back to cell 0: revisit
        ("R R", 0.0),  # stops on cell 2, not the goal
        (PATH + " L", 0.0),  # passes the goal and steps back onto 7: revisit
        ("R R D L L D R R R", 0.0),  # 8 has no right opening: wall
        ("U", 0.0),  # the border is closed
        ("", 0.0),  # nothing
        ("the path is R R D L L D R R", 0.0),  # stray words: malformed
        ("<unk> R", 0.0),
    ],
)
def test_verifier_hand_cases(completion, reward):
    task = MazeTask()
    assert task.verify(completion, SERPENT) == reward
    assert task.verify(completion, SERPENT.prompt()) == reward  # serialised reference


def test_hand_maze_solution_and_tokens():
    assert SERPENT.solve() == PATH.split()
    assert all_simple_paths(SERPENT) == [PATH.split()]
    # cell 0 is the start with mask 8, cell 8 the goal with mask 4, others plain
    assert SERPENT.cell_tokens() == ["s8", "oc", "o6", "oa", "oc", "o5", "o9", "oc", "g4"]
    assert Maze.from_prompt(SERPENT.prompt()) == SERPENT


def test_parse_moves():
    assert parse_moves(" U  d") is None  # lower case is not a move
    assert parse_moves("UDLR") == ["U", "D", "L", "R"]
    assert parse_moves("U\nD") == ["U", "D"]
    assert parse_moves("   ") is None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 6))
def test_generated_mazes_are_perfect_with_unique_path(seed, size):
    maze = generate_maze(size, random.Random(seed))
    # a spanning tree of size² cells has size² - 1 passages; each passage sets two bits
    bits = sum(bin(m).count("1") for m in maze.open)
    assert bits == 2 * (size * size - 1)
    # passages are symmetric and never open onto the border
    for cell in range(size * size):
        for move, opposite in (("U", "D"), ("D", "U"), ("L", "R"), ("R", "L")):
            nxt = maze.step(cell, move)
            if maze.open[cell] & MOVES[move][2]:
                assert nxt is not None and maze.step(nxt, opposite) == cell
    assert maze.start != maze.goal
    paths = all_simple_paths(maze)
    assert paths == [maze.solve()]
    assert MazeTask(size).verify(" ".join(paths[0]), maze) == 1.0


def test_walk_equals_unique_path_on_random_move_strings():
    """Simulation accepts exactly the unique path: random prefixes/mutations of it all fail."""
    rng = random.Random(0)
    task = MazeTask()
    for ex in task.examples("train", 100, seed=3):
        path = ex.reference.solve()
        for _ in range(10):
            moves = [rng.choice("UDLR") for _ in range(rng.randint(1, 12))]
            assert task.verify(" ".join(moves), ex.reference) == float(moves == path)
        if len(path) > 1:
            assert task.verify(" ".join(path[:-1]), ex.reference) == 0.0


def test_examples_deterministic_and_splits_disjoint():
    task = tasks.get("maze")
    a = task.examples("train", 50, seed=7)
    assert a == task.examples("train", 50, seed=7)
    assert a != task.examples("train", 50, seed=8)
    train = {e.prompt for e in task.examples("train", 500, seed=0)}
    held = {e.prompt for e in task.examples("eval", 500, seed=0)}
    assert not train & held
    assert len({e.id for e in a}) == 50
    with pytest.raises(ValueError, match="split"):
        task.examples("validation", 1, 0)


def test_path_length_statistics():
    # docs/models.md: mean 7.35 (train) / 7.40 (eval) moves over 4,000 mazes on 5 × 5
    lengths = [len(e.reference.solve()) for e in MazeTask().examples("train", 2000, 0)]
    assert 6.5 < sum(lengths) / len(lengths) < 8.5
    assert max(lengths) <= 24  # a simple path visits at most 25 cells


def test_demonstration_is_verified_and_vocabulary():
    task = MazeTask()
    ex = task.examples("eval", 20, 0)
    assert all(task.verify(task.demonstration(e), e.reference) == 1.0 for e in ex)
    vocab = task.vocabulary()
    assert len(vocab) == len(set(vocab)) == 5 + 4 + 48
    assert all(t in vocab for e in ex for t in e.prompt.split())


def test_bad_size():
    with pytest.raises(ValueError, match="size"):
        MazeTask(size=1)
