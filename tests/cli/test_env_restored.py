"""The suite's own hygiene: a test that runs the command line in-process leaves no process
environment behind (tests/conftest.py restores it)."""

import os

from grouprl import cli

START = os.environ.get("THP_MEM_ALLOC_ENABLE")  # the suite's own value (usually unset)


def test_a_cli_call_sets_the_process_environment(capsys):
    cli.main(["list"])
    capsys.readouterr()
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == cli.PROCESS_ENV["THP_MEM_ALLOC_ENABLE"]


def test_and_the_next_test_does_not_see_it():
    # runs after the one above (file order): the fixture gave the key its value back
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == START
