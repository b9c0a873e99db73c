"""Plain progress lines for output that is not a terminal (a piped run must not print its
first line and then nothing for 20 minutes)."""

import io

from grouprl._progress import ProgressLines, clock_text, use_bar


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_every_tenth_or_every_30_seconds_and_at_the_end():
    clock, out = _Clock(), io.StringIO()
    p = ProgressLines("train", 300, stream=out, clock=clock)
    printed = []
    for step in range(1, 301):
        clock.t += 1.0  # 1 s a step: the 30-s rule fires before each tenth (30 steps)
        if step == 150:
            clock.t += 100.0  # a slow step: a line at once
        if p.update(step, f"reward {step / 300:.2f}"):
            printed.append(step)
    # every 30 steps (30 s and 1/10 of 300 coincide), the slow step 150, the end
    assert printed == [30, 60, 90, 120, 150, 180, 210, 240, 270, 300]
    lines = out.getvalue().splitlines()
    assert lines[0] == "train 30/300  reward 0.10  (0:30, ~4:30 left)"
    assert lines[4] == "train 150/300  reward 0.50  (4:10, ~4:10 left)"
    assert lines[-1] == "train 300/300  reward 1.00  (6:40)"


def test_a_slow_run_prints_every_30_seconds():
    clock, out = _Clock(), io.StringIO()
    p = ProgressLines("SFT warm start", 1000, stream=out, clock=clock)
    printed = []
    for step in range(1, 60):
        clock.t += 7.0  # 7 s a step: 30 s pass every 5 steps, long before a tenth (100)
        if p.update(step):
            printed.append(step)
    assert printed == list(range(5, 60, 5))
    assert out.getvalue().splitlines()[0] == "SFT warm start 5/1000  (0:35, ~1:56:05 left)"


def test_a_resumed_run_estimates_from_the_steps_it_ran():
    clock, out = _Clock(), io.StringIO()
    p = ProgressLines("train", 100, start=50, stream=out, clock=clock)
    clock.t += 20.0
    assert p.update(60)  # crossed the tenth at 60
    assert out.getvalue() == "train 60/100  (0:20, ~1:20 left)\n"  # 2 s a step, 40 to go


def test_bar_only_on_a_terminal_and_clock_text():
    assert use_bar(True, _Tty()) and not use_bar(False, _Tty())
    assert not use_bar(True, io.StringIO())  # a file or a pipe: plain lines
    assert [clock_text(s) for s in (0, 59.6, 61, 3600 + 62)] == ["0:00", "1:00", "1:01", "1:01:02"]
