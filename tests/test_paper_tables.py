"""The paper-table index points at scripts that exist and accept the table's arguments."""

from __future__ import annotations

import pytest

from experiments.paper_tables import PAPER_TABLES, main


@pytest.mark.parametrize("name", sorted(PAPER_TABLES))
def test_every_table_command_parses(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage:") and PAPER_TABLES[name].module in usage


def test_listing_and_unknown_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    listing = capsys.readouterr().out
    assert all(table.command in listing for table in PAPER_TABLES.values())
    assert main(["spear-t99"]) == 2
    assert "unknown table 'spear-t99'" in capsys.readouterr().err
