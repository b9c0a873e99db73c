"""`grouprl list` prints every registry entry with its one-line description."""

import pytest

from grouprl import advantages, cli, losses, presets, simulate, tasks
from grouprl.cli.listing import catalogue, first_line


def test_every_registered_name_is_listed(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    registries = [
        advantages.ESTIMATORS,
        advantages.TRANSFORMS,
        losses.SURROGATES,
        losses.AGGREGATIONS,
        losses.KL_ESTIMATORS,
        losses.CORRECTIONS,
        presets.PRESETS,
        tasks.TASKS,
        simulate.SIMULATIONS,
    ]
    for registry in registries:
        for name in registry:
            assert name in out, name
    assert "F-GRPO" in out and "MaxNorm" in out  # descriptions, not only names
    assert "[low, high]" in out.replace("\n", " ")  # brackets are text, not rich markup


def test_every_entry_has_a_description():
    for title, entries in catalogue().items():
        for name, text in entries.items():
            assert len(text) > 10, (title, name)
            assert "``" not in text


def test_one_section_and_a_bad_section(capsys):
    assert cli.main(["list", "presets"]) == 0
    out = capsys.readouterr().out
    assert "maxnorm_rloo" in out and "Surrogates" not in out
    with pytest.raises(SystemExit):
        cli.main(["list", "bogus"])
    assert "invalid choice" in capsys.readouterr().err


def test_first_line_prefers_a_preset_description():
    assert first_line(presets.get("dapo")).startswith("DAPO")
    assert first_line(advantages.ESTIMATORS["grpo"]).startswith("GRPO")


def test_unknown_command_and_help(capsys):
    assert cli.main([]) == 0
    assert "train" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["trian"])
    assert "unknown command 'trian'" in capsys.readouterr().err
