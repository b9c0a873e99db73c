"""Progress a person can see where a progress bar cannot be drawn.

A rich bar redraws one line in place, which needs a terminal; with stdout piped to a file
or a CI log it prints nothing until the end. :class:`ProgressLines` prints a plain line
instead, every ``every_s`` seconds or every ``fraction`` of the total, whichever comes first,
and at the end [OURS: a long warm start must not be silent in a log file]. :func:`use_bar` says which of the two a stream gets.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["EVERY_S", "ProgressLines", "clock_text", "use_bar"]

EVERY_S = 30.0
"""Seconds between two plain progress lines at most (while the work goes on) [OURS]."""


def use_bar(enabled: bool, stream: TextIO | None = None) -> bool:
    """A redrawn bar only when asked for and ``stream`` (stdout) is a terminal."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(enabled and isatty is not None and isatty())


def clock_text(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLines:
    """Plain progress lines: ``label done/total  info  (elapsed, ~left)``.

    A line is printed by :meth:`update` when ``done`` reaches the total, when ``every_s``
    seconds have passed since the last line, or when ``done`` crosses the next multiple of
    ``ceil(fraction × total)`` (ten lines over a run by default). ``start``: the count
    already done (a resumed run); the time left is estimated from the work done since.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        start: int = 0,
        every_s: float = EVERY_S,
        fraction: float = 0.1,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.every_s = label, max(int(total), 1), every_s
        self.stride = max(1, math.ceil(fraction * self.total))
        self._stream, self._clock = stream, clock
        self._t0 = self._last = clock()
        self._start = self._done = int(start)

    def _print(self, text: str) -> None:
        print(text, file=self._stream or sys.stdout, flush=True)

    def update(self, done: int, info: str = "") -> bool:
        """Record progress; print a line when one is due. Returns whether it printed."""
        now, before = self._clock(), self._done
        self._done = int(done)
        due = (
            self._done >= self.total
            or now - self._last >= self.every_s
            or self._done // self.stride > before // self.stride
        )
        if not due:
            return False
        self._last = now
        self._print(self.line(info, now))
        return True

    def line(self, info: str = "", now: float | None = None) -> str:
        """The text of a line at ``now`` (the clock's time by default)."""
        now = self._clock() if now is None else now
        elapsed = now - self._t0
        timing = clock_text(elapsed)
        done_here = self._done - self._start
        if done_here > 0 and self._done < self.total:
            timing += f", ~{clock_text(elapsed / done_here * (self.total - self._done))} left"
        text = f"{self.label} {self._done}/{self.total}"
        if info:
            text += f"  {info}"
        return f"{text}  ({timing})"
