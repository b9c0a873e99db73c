"""Maze generator (perfect mazes, unique path) and verifier (hand-derived cases)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl import tasks
from grouprl.tasks import maze as maze_mod
from grouprl.tasks.maze import (
    MOVES,
    Maze,
    MazeTask,
    generate_maze,
    parse_moves,
    path_lengths,
)

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


# ---- path-length bounds ---------------------------------------------------------------------


def test_path_lengths_hand_maze():
    # the serpentine maze above is one corridor 0-1-2-5-4-3-6-7-8: the distance between two
    # cells is the gap between their positions along it
    order = [0, 1, 2, 5, 4, 3, 6, 7, 8]
    d = path_lengths(SERPENT)
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            assert d[a][b] == abs(i - j)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.integers(2, 5),
    lo=st.integers(1, 6),
    span=st.integers(0, 4),
)
def test_bounded_mazes_have_paths_in_range_and_stay_perfect(seed, size, lo, span):
    longest = size * size - 1
    lo = min(lo, longest)
    hi = min(lo + span, longest)
    try:
        maze = generate_maze(size, random.Random(seed), lo, hi)
    except ValueError:  # e.g. 8..8 on 3 x 3 needs a Hamiltonian corridor ending at both cells
        return
    path = maze.solve()
    assert lo <= len(path) <= hi
    assert all_simple_paths(maze) == [path]  # still one correct sequence
    bits = sum(bin(m).count("1") for m in maze.open)
    assert bits == 2 * (size * size - 1)


# A 3 x 3 comb by hand: the centre 4 opens on all four sides, 1 and 7 carry the corners
#   0 - 1 - 2        0: R=8   1: L+R+D=14   2: L=4
#       |            3: R=8   4: U+D+L+R=15 5: L=4
#   3 - 4 - 5        6: R=8   7: U+L+R=13   8: L=4
#       |
#   6 - 7 - 8        longest path: corner to opposite corner, 4 moves
COMB = (8, 14, 4, 8, 15, 4, 8, 13, 4)


def test_bounded_pairs_are_uniform_over_the_allowed_pairs(monkeypatch):
    # with the carving fixed to the comb, (start, goal) must be uniform over the ordered
    # pairs whose path has 2..3 moves, counted here by exhaustive simple-path search
    monkeypatch.setattr(maze_mod, "_carve", lambda size, rng: list(COMB))
    allowed = set()
    for a in range(9):
        for b in range(9):
            if a != b:
                (path,) = all_simple_paths(Maze(3, COMB, a, b))
                if 2 <= len(path) <= 3:
                    allowed.add((a, b))
    # by hand: distance 2 = {0,2,4}, {6,8,4} pairwise (6) and {1,3,5,7} pairwise (6); distance
    # 3 = each corner to the three side cells not next to it (4 x 3): 24 unordered pairs
    assert len(allowed) == 48
    rng, counts = random.Random(5), {}
    draws = 20000
    for _ in range(draws):
        m = generate_maze(3, rng, 2, 3)
        counts[(m.start, m.goal)] = counts.get((m.start, m.goal), 0) + 1
    assert set(counts) == allowed
    # each pair 1/48: 417 expected, binomial sd ~20, so 5 sd is ±100
    assert all(abs(c - draws / 48) < 100 for c in counts.values())


def test_unreachable_range_says_what_to_do(monkeypatch):
    # the comb has no path longer than 4 moves: a task asking for 5..8 redraws, then gives up
    monkeypatch.setattr(maze_mod, "_carve", lambda size, rng: list(COMB))
    monkeypatch.setattr(maze_mod, "MAX_REDRAWS", 5)
    with pytest.raises(ValueError, match="lower min_path or raise max_path"):
        generate_maze(3, random.Random(0), 5, 8)
    assert len(generate_maze(3, random.Random(0), 4, 8).solve()) == 4


def test_unbounded_stream_unchanged_and_bounded_stream_distinct():
    # the unbounded task keeps its config (its SFT cache key) and draws start and goal with
    # rng.sample as before; the bounded task has its own stream and config
    plain, bounded = MazeTask(4), MazeTask(4, 2, 5)
    assert plain.config == {"size": 4} and MazeTask(4, 1, None).config == {"size": 4}
    assert bounded.config == {"size": 4, "min_path": 2, "max_path": 5}
    rng = random.Random(11)
    m = generate_maze(4, rng)
    rng2 = random.Random(11)
    generate_maze(4, rng2, 1, None)
    assert rng.getstate() == rng2.getstate()
    ex = bounded.examples("train", 300, seed=1)
    assert all(2 <= len(e.reference.solve()) <= 5 for e in ex)
    assert {len(e.reference.solve()) for e in ex} == {2, 3, 4, 5}
    assert ex == bounded.examples("train", 300, seed=1)
    assert m.size == 4
    assert tasks.get("maze", size=4, min_path=2, max_path=5).config == bounded.config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size": 3, "min_path": 0}, "min_path"),
        ({"size": 3, "min_path": 9}, "min_path"),  # 3 x 3: at most 8 moves
        ({"size": 3, "min_path": 4, "max_path": 3}, "max_path"),
        ({"size": 3, "max_path": 9}, "max_path"),
        ({"size": 3, "min_path": 1.5}, "min_path"),
    ],
)
def test_bad_path_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MazeTask(**kwargs)


# ---- coordinates in the tokens ----------------------------------------------------------------


def test_coords_rendering_of_the_hand_maze_by_hand():
    """The serpent with coords: a row token before each row, the column in each cell token;
    the tiny tokenizer maps every word to its own id (no <unk>), the answer is unchanged."""
    from grouprl import models

    task = MazeTask(3, coords=True)
    tok = models.task_tokenizer(task)
    ex = tasks.base.Example("serpent", SERPENT.prompt(), SERPENT)
    text = task.render(ex, tok)
    assert text == "<bos> r0 s8c0 occ1 o6c2 r1 oac0 occ1 o5c2 r2 o9c0 occ1 g4c2 <sep>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 2 + 3 + 9 and tok.unk_token_id not in ids
    assert tok.convert_ids_to_tokens(ids)[1:-1] == text.split()[1:-1]
    assert task.demonstration(ex) == PATH and task.verify(PATH, SERPENT) == 1.0
    # 5 specials + 4 moves + 3 rows + 48 cell words in each of 3 columns
    vocab = task.vocabulary()
    assert len(vocab) == len(set(vocab)) == 5 + 4 + 3 + 48 * 3
    # the plain task keeps its rendering and config (its cached warm starts)
    plain = MazeTask(3)
    assert plain.render(ex, models.task_tokenizer(plain)) == f"<bos> {SERPENT.prompt()} <sep>"
    assert plain.config == {"size": 3} and task.config == {"size": 3, "coords": True}
    with pytest.raises(ValueError, match="coords must be true or false"):
        MazeTask(3, coords="yes")


@pytest.mark.parametrize(
    ("task", "prompts", "answers"),
    [
        (
            MazeTask(4, 1, 5),
            [
                "o2 oa oc s6 o3 o9 o6 o3 ob o6 o1 g3 o1 o9 oc o5",
                "oa oe oc o6 o1 g3 oa s5 oa o5 o9 o4 o9 oc oc o4",
                "oa oc oc o6 o3 o8 o6 o3 o3 oa o5 s3 o9 o5 g8 o5",
            ],
            ["D D", "U L L D", "D L"],
        ),
        (
            MazeTask(5),
            [
                "oa oc o6 o8 o6 o9 o6 o9 sc g5 o2 o9 oc o6 o2 o3 oa o6 o3 o3 o9 o5 o9 od o5",
                "oa oc oc o6 o2 o3 o8 oc sd o7 o3 ga o6 o8 o5 ob o5 o3 o8 o6 o9 o4 o9 oc o5",
                "oa o4 oa oc o6 o3 o8 od o6 o1 o9 oc o6 s9 o6 oa o6 o9 oc o7 g1 o9 oc oc o5",
            ],
            ["R", "U L L L D D D R U", "R D D L L L U L D"],
        ),
    ],
)
def test_the_maze_stream_is_pinned(task, prompts, answers):
    """The first training mazes of the default task (4 × 4, 1–5 moves) and of the unbounded
    5 × 5 one, written down from the generator as the cached warm starts, the golden runs and
    every reproduction drew them: a faster carve or BFS must draw the same mazes."""
    ex = task.examples("train", 3, 0)
    assert [e.prompt for e in ex] == prompts
    assert [task.demonstration(e) for e in ex] == answers
