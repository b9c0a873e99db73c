"""run.threads = 0 (auto): the cores the load leaves free, told to OpenMP before torch loads."""

import os

import pytest

from grouprl import _threads as T


def test_auto_threads_known_answers():
    assert T.auto_threads(2, 0.0) == 2  # an idle 2-core machine: both
    assert T.auto_threads(2, 0.4) == 2  # floor(2 − 0.4 + 0.5) = 2
    assert T.auto_threads(2, 0.6) == 1  # floor(1.9) = 1
    assert T.auto_threads(2, 6.0) == 1  # a busy shared machine: one, never 0
    assert T.auto_threads(8, 1.5) == 7  # a laptop with one busy core
    assert T.auto_threads(8, 0.0, cap=4) == 4  # at most torch's own count
    assert T.auto_threads(2, -1.0) == 2


@pytest.fixture
def machine(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)

    def set_load(x):
        monkeypatch.setattr(T.os, "getloadavg", lambda: (x, x, x))

    return set_load


def test_choose_threads(machine, monkeypatch):
    machine(5.3)
    assert T.choose_threads(0) == (1, "auto: 2 cores, load average 5.3")
    machine(0.1)
    assert T.choose_threads(0) == (2, "auto: 2 cores, load average 0.1")
    assert T.choose_threads(3) == (3, "run.threads")  # an explicit count is kept
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert T.choose_threads(0) == (4, "auto: OMP_NUM_THREADS")  # the user's setting wins


def test_tell_openmp_sets_the_choice_but_keeps_the_users(machine, monkeypatch):
    machine(3.0)
    assert T.tell_openmp(0) == (1, "auto: 2 cores, load average 3.0")
    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # waiting threads sleep, not spin
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("MKL_NUM_THREADS")
    assert T.tell_openmp(0)[0] == 2 and os.environ["MKL_NUM_THREADS"] == "2"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice is kept
