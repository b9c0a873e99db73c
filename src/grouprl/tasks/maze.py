"""The maze task of F-GRPO §5.2 in miniature: perfect mazes, one correct move sequence each.

[OURS] generator (F-GRPO follows the MaxRL setup, whose generator is not ours to copy):

- a *perfect* maze on ``size × size`` cells, carved by randomised depth-first search
  (recursive backtracker) from a random cell, so the open passages form a spanning tree
  and between any two cells there is exactly one simple path;
- start and goal are two distinct cells drawn uniformly; the answer is the unique simple
  path as moves ``U`` / ``D`` / ``L`` / ``R`` (mean 7.5 moves on 5 × 5, at most 24);
- optionally the path length is bounded, ``min_path ≤ moves ≤ max_path``: the maze is
  carved as above, then (start, goal) is drawn uniformly among the ordered pairs of cells
  whose tree distance lies in the range (the law of a uniform pair conditioned on the
  range); a maze without such a pair is discarded and carved again (:func:`path_lengths`,
  :func:`generate_maze`). Used to make the task easier (short paths on a small grid) so
  the warm-started policy solves about half of the mazes, the high-success regime of
  F-GRPO §5.2;
- one token per cell: a kind letter (``s`` start, ``g`` goal, ``o`` other) and one hex
  digit of open sides (bit 1 = up, 2 = down, 4 = left, 8 = right), cells row by row;
  with the tiny models' word-level tokenizer the prompt is ``<bos> c00 … c44 <sep>``
  (27 tokens on 5 × 5) and the completion ``U R … <eos>``;
- optionally (``coords=True``) the tiny models see coordinates: a row token ``r<i>`` before
  each row and the column in every cell token (``s9c0 o3c1 …``), so ``<bos> r0 s9c0 … r4 …
  <sep>``. The maze, the answer and the verifier are unchanged; only the rendering and the
  vocabulary differ (:meth:`MazeTask.render`).

The verifier simulates the moves: every move must go through an open side, no cell may
be visited twice, and the walk must end on the goal. In a perfect maze this accepts
exactly the unique path (tested against it), so the reward is binary with one correct
sequence per maze, as the paper requires.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from grouprl.tasks.base import Example, Task, chat_render, check_n, split_rng

__all__ = ["MOVES", "Maze", "MazeTask", "generate_maze", "parse_moves", "path_lengths"]

MOVES: dict[str, tuple[int, int, int]] = {
    "U": (-1, 0, 1),
    "D": (1, 0, 2),
    "L": (0, -1, 4),
    "R": (0, 1, 8),
}
"""Move -> (row step, column step, open-side bit of the cell being left)."""

_OPPOSITE = {"U": "D", "D": "U", "L": "R", "R": "L"}
_KINDS = ("o", "s", "g")
_CELL = re.compile(r"^([osg])([0-9a-f])$")

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<unk>", "<bos>", "<sep>", "<eos>")
"""Special tokens of the maze vocabulary, in id order (pad = 0)."""


@dataclass(frozen=True)
class Maze:
    """A perfect maze: ``open[i]`` is the open-sides bit mask of cell ``i = row * size + col``."""

    size: int
    open: tuple[int, ...]
    start: int
    goal: int

    def cell_tokens(self) -> list[str]:
        """One token per cell, row by row: kind letter + hex open-sides mask (``s9``, ``oc``...)."""
        kinds = ["o"] * (self.size * self.size)
        kinds[self.start], kinds[self.goal] = "s", "g"
        return [f"{k}{m:x}" for k, m in zip(kinds, self.open)]

    def prompt(self) -> str:
        """The cell tokens joined by spaces (the Example's prompt and the parseable reference)."""
        return " ".join(self.cell_tokens())

    @classmethod
    def from_prompt(cls, text: str) -> Maze:
        """Parse :meth:`prompt` back into a Maze (ValueError when it is not one)."""
        tokens = text.split()
        size = round(len(tokens) ** 0.5)
        if size < 2 or size * size != len(tokens) or not all(_CELL.match(t) for t in tokens):
            raise ValueError(f"not a maze prompt: {text[:80]!r}")
        kinds = [t[0] for t in tokens]
        if kinds.count("s") != 1 or kinds.count("g") != 1:
            raise ValueError("a maze prompt needs exactly one start (s) and one goal (g) cell")
        return cls(size, tuple(int(t[1], 16) for t in tokens), kinds.index("s"), kinds.index("g"))

    def step(self, cell: int, move: str) -> int | None:
        """The cell reached by ``move`` from ``cell``, or None when a wall is in the way."""
        dr, dc, bit = MOVES[move]
        if not self.open[cell] & bit:
            return None
        r, c = divmod(cell, self.size)
        r, c = r + dr, c + dc
        if not (0 <= r < self.size and 0 <= c < self.size):  # open to the outside: never built
            return None
        return r * self.size + c

    def solve(self) -> list[str]:
        """The unique simple path from start to goal, as moves (depth-first search of the tree)."""
        stack: list[tuple[int, int | None, list[str]]] = [(self.start, None, [])]
        while stack:
            cell, parent, path = stack.pop()
            if cell == self.goal:
                return path
            for move in MOVES:
                nxt = self.step(cell, move)
                if nxt is not None and nxt != parent:
                    stack.append((nxt, cell, [*path, move]))
        raise ValueError("the goal is not reachable: not a perfect maze")

    def walk(self, moves: list[str]) -> bool:
        """Simulate ``moves``: True iff no wall is hit, no cell is revisited, and it ends on the goal."""
        cell, seen = self.start, {self.start}
        for move in moves:
            nxt = self.step(cell, move)
            if nxt is None or nxt in seen:
                return False
            cell = nxt
            seen.add(cell)
        return cell == self.goal


@functools.cache
def _grid(size: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per cell of a ``size × size`` grid, its in-grid neighbours in :data:`MOVES` order as
    ``(neighbour, open-side bit towards it, the neighbour's bit back)``."""
    out = []
    for cell in range(size * size):
        r, c = divmod(cell, size)
        out.append(
            tuple(
                ((r + dr) * size + c + dc, bit, MOVES[_OPPOSITE[move]][2])
                for move, (dr, dc, bit) in MOVES.items()
                if 0 <= r + dr < size and 0 <= c + dc < size
            )
        )
    return tuple(out)


def _carve(size: int, rng: Any) -> list[int]:
    """Open-sides masks of a perfect ``size × size`` maze by randomised DFS (recursive backtracker).

    From a random cell, repeatedly knock down the wall to a random unvisited neighbour and
    move there, backtracking when none is left; the passages form a spanning tree of the
    grid (``size² − 1`` passages). The unvisited neighbours are offered in :data:`MOVES`
    order, so a seeded ``rng`` always carves the same maze.
    """
    n = size * size
    grid = _grid(size)
    masks = [0] * n
    first = rng.randrange(n)
    seen = [False] * n
    seen[first] = True
    stack = [first]
    while stack:
        cell = stack[-1]
        options = [o for o in grid[cell] if not seen[o[0]]]
        if not options:
            stack.pop()
            continue
        nxt, bit, back = options[rng.randrange(len(options))]
        masks[cell] |= bit
        masks[nxt] |= back
        seen[nxt] = True
        stack.append(nxt)
    return masks


def path_lengths(maze: Maze) -> list[list[int]]:
    """``d[a][b]`` = moves on the unique path from cell ``a`` to cell ``b`` (BFS from every cell).

    In a perfect maze the passages form a tree, so the BFS distance is the length of the one
    simple path. ``size⁴`` work: 625 entries on 5 × 5.
    """
    n = maze.size * maze.size
    nbrs = [
        [b for b, bit, _ in row if maze.open[a] & bit] for a, row in enumerate(_grid(maze.size))
    ]
    out = []
    for a in range(n):
        dist = [-1] * n
        dist[a], frontier, d = 0, [a], 0
        while frontier:
            d += 1
            nxt_frontier = []
            for cell in frontier:
                for nxt in nbrs[cell]:
                    if dist[nxt] < 0:
                        dist[nxt] = d
                        nxt_frontier.append(nxt)
            frontier = nxt_frontier
        out.append(dist)
    return out


MAX_REDRAWS = 1000
"""Mazes carved in a row without a (start, goal) pair in the path-length range before
:func:`generate_maze` gives up (a range no maze of the size can meet, e.g. min_path 15 on 4 × 4
needs a near-Hamiltonian tree)."""


def generate_maze(size: int, rng: Any, min_path: int = 1, max_path: int | None = None) -> Maze:
    """A perfect ``size × size`` maze by randomised DFS, with distinct random start and goal.

    ``rng`` is a ``random.Random``. Without a path-length bound (``min_path=1``,
    ``max_path=None``) start and goal are two distinct cells drawn uniformly
    (``rng.sample``), so the stream of mazes is the one the task has always drawn. With a
    bound, (start, goal) is drawn uniformly among the ordered pairs whose path has
    ``min_path ≤ moves ≤ max_path`` (:func:`path_lengths`), and a maze without such a pair
    is carved again, at most :data:`MAX_REDRAWS` times (then a ValueError).
    """
    n = size * size
    if min_path == 1 and max_path is None:
        masks = _carve(size, rng)
        start, goal = rng.sample(range(n), 2)
        return Maze(size, tuple(masks), start, goal)
    hi = n - 1 if max_path is None else max_path
    for _ in range(MAX_REDRAWS):
        maze = Maze(size, tuple(_carve(size, rng)), 0, 0)
        dist = path_lengths(maze)
        pairs = [
            (a, b) for a, row in enumerate(dist) for b, d in enumerate(row) if min_path <= d <= hi
        ]
        if pairs:
            start, goal = pairs[rng.randrange(len(pairs))]
            return Maze(size, maze.open, start, goal)
    raise ValueError(
        f"no {size}x{size} maze in {MAX_REDRAWS} draws had a path of {min_path}..{hi} moves; "
        "lower min_path or raise max_path"
    )


def parse_moves(text: str) -> list[str] | None:
    """Moves from a completion: ``U R D`` (spaces or commas) or ``URD``; None when it is anything else.

    [OURS] Strict on content, lenient on separators: a stray word makes the answer
    malformed (reward 0), as the tiny model's vocabulary has nothing but moves to say.
    """
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if len(parts) == 1 and len(parts[0]) > 1:
        parts = list(parts[0])
    if not parts or any(p not in MOVES for p in parts):
        return None
    return parts


class MazeTask(Task):
    """Perfect mazes (F-GRPO §5.2 miniature): emit the unique start-to-goal move sequence.

    Args:
        size: the grid is ``size × size`` cells (>= 2).
        min_path, max_path: bounds on the number of moves of the answer (inclusive; None =
            up to ``size² − 1``). [OURS] (start, goal) is drawn uniformly among the pairs
            whose unique path has that length, a maze without one is carved again
            (:func:`generate_maze`). The defaults (1, None) draw the unbounded stream.
        coords: [OURS] render for the tiny models with a row token before each row and the
            column inside each cell token (``r0 s9c0 o3c1 … r1 …``; ``size`` + 48·``size``
            extra words). F-GRPO App. K says only "symbolic grid tokens". The idea: the tiny
            models are RoPE-only, so an attention value carries a token's content but not its
            place, and with the plain tokens a 1.2M model barely learns where the start and
            goal lie (≤ 7 % of 1–3-move 9 × 9 mazes solved after 600 SFT steps); with
            coordinates the place is content. Measured (reproductions/maze/appk README):
            after 300 SFT steps on ≤ 2-move mazes no better than the plain tokens (1-move
            mazes 13 % vs 17 %: each of the 48·size words is seen ``size`` times less often);
            longer runs not measured. Off by default, which keeps the plain rendering (and
            its cached warm starts).
    """

    name = "maze"
    reward_range = (0.0, 1.0)

    def __init__(
        self, size: int = 5, min_path: int = 1, max_path: int | None = None, coords: bool = False
    ) -> None:
        if int(size) != size or size < 2:
            raise ValueError(f"maze size must be an integer >= 2, got {size!r}")
        self.size = int(size)
        longest = self.size * self.size - 1
        if int(min_path) != min_path or not 1 <= min_path <= longest:
            raise ValueError(
                f"min_path must be an integer in 1..{longest} (a path on a {size}x{size} maze "
                f"has 1 to {longest} moves), got {min_path!r}"
            )
        hi = longest if max_path is None else max_path
        if int(hi) != hi or not min_path <= hi <= longest:
            raise ValueError(
                f"max_path must be an integer in min_path..{longest} (min_path={min_path}), "
                f"or None for no bound; got {max_path!r}"
            )
        self.min_path = int(min_path)
        self.max_path = None if max_path is None else int(max_path)
        if not isinstance(coords, bool):
            raise ValueError(f"coords must be true or false, got {coords!r}")
        self.coords = coords
        self.config: dict[str, Any] = {"size": self.size}
        if self.bounded:  # the unbounded task keeps its config (and its SFT cache key)
            self.config.update(min_path=self.min_path, max_path=self.max_path)
        if coords:
            self.config["coords"] = True

    @property
    def bounded(self) -> bool:
        """True when a path-length bound is set."""
        return self.min_path != 1 or self.max_path is not None

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """``n`` mazes from the ``(split, seed)`` stream; the reference is the :class:`Maze`."""
        stream = f"maze{self.size}"
        if self.bounded:
            stream += f"-path{self.min_path}-{self.max_path}"
        rng = split_rng(stream, split, seed)
        mazes = [
            generate_maze(self.size, rng, self.min_path, self.max_path) for _ in range(check_n(n))
        ]
        return [Example(f"maze/{split}/{seed}/{i}", m.prompt(), m) for i, m in enumerate(mazes)]

    def verify(self, completion: str, reference: Any) -> float:
        """1.0 when the moves walk from start to goal through open sides without revisiting, else 0.0."""
        maze = reference if isinstance(reference, Maze) else Maze.from_prompt(str(reference))
        moves = parse_moves(completion)
        return 0.0 if moves is None else float(maze.walk(moves))

    def demonstration(self, example: Example) -> str:
        """The unique path as space-separated moves (the SFT target, EOS appended by the caller)."""
        maze = example.reference
        if not isinstance(maze, Maze):
            maze = Maze.from_prompt(str(maze))
        return " ".join(maze.solve())

    def vocabulary(self) -> list[str]:
        """The word-level vocabulary of the tiny models: specials, moves, every cell token."""
        cells = [f"{k}{m:x}" for k in _KINDS for m in range(16)]
        if self.coords:  # the row tokens, then every cell token in every column
            rows = [f"r{i}" for i in range(self.size)]
            cells = [f"{cell}c{c}" for c in range(self.size) for cell in cells]
            return [*SPECIAL_TOKENS, *MOVES, *rows, *cells]
        return [*SPECIAL_TOKENS, *MOVES, *cells]

    def render(self, example: Example, tokenizer: Any) -> str:
        """``<bos> cells <sep>`` for the maze vocabulary (``<bos> r0 s9c0 … <sep>`` with
        ``coords``); a described prompt for any other tokenizer."""
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        if self.coords and "<sep>" in vocab and "r0" in vocab:
            cells, n = example.prompt.split(), self.size
            rows = [
                " ".join([f"r{i}", *(f"{t}c{c}" for c, t in enumerate(cells[i * n : i * n + n]))])
                for i in range(n)
            ]
            return f"<bos> {' '.join(rows)} <sep>"
        if "<sep>" in vocab and "s1" in vocab:
            return f"<bos> {example.prompt} <sep>"
        rows = example.prompt.split()
        grid = "\n".join(" ".join(rows[i : i + self.size]) for i in range(0, len(rows), self.size))
        text = (
            f"Solve this {self.size}x{self.size} maze. Cells are listed row by row; each code is "
            "a letter (s = start, g = goal, o = other) and a hex digit whose bits say which "
            "sides are open (1 = up, 2 = down, 4 = left, 8 = right). Reply with the moves "
            "from start to goal as U, D, L, R separated by spaces, and nothing else.\n\n" + grid
        )
        return chat_render(text, tokenizer)
