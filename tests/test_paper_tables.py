"""The paper tables as data: every table resolves to settings, quick runs are small, options are checked."""

from __future__ import annotations

import pytest

from experiments.config import Cell, parse_cells, parse_option
from experiments.paper_tables import main as alias_main
from experiments.tables import TABLES, get_table, published

PAPER_TABLES = [
    "spear-t1",
    "spear-t2",
    "spear-t3",
    "spear-t4",
    "spear-t9",
    "spear-t10",
    "spear-t11",
    "spearpp-t1",
    "spearpp-t2",
    "spearpp-t3",
    "spearpp-t4",
]


def test_every_paper_table_is_registered() -> None:
    assert set(PAPER_TABLES) <= set(TABLES)
    assert set(TABLES) - set(PAPER_TABLES) == {"secagg", "defended"}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_quick_and_full_options_give_settings(name: str) -> None:
    table = get_table(name)
    full = table.settings(table.resolve(quick=False, overrides={}))
    quick_options = table.resolve(quick=True, overrides={})
    quick = table.settings(quick_options)
    assert full and quick
    assert quick_options["trials"] <= 2 and quick_options["time_budget"] <= 15
    assert sum(s.trials * len(s.methods) for s in quick) <= sum(s.trials * len(s.methods) for s in full)
    for setting in quick:
        assert setting.trials >= 1 and setting.methods


def test_table_settings_follow_the_papers() -> None:
    t1 = get_table("spearpp-t1")
    settings = t1.settings(t1.resolve(quick=False, overrides={}))
    assert [s.cell.label for s in settings] == [
        "20x200",
        "25x200",
        "30x200",
        "65x1000",
        "100x1000",
        "150x1000",
        "100x4000",
        "150x4000",
        "210x4000",
    ]
    assert published("fedsgd", method="l1", **settings[0].fields) == {
        "accuracy": 95,
        "psnr": 120.98,
        "source": "SPEAR++ Tab. 1",
    }
    assert published("fedsgd", method="logcosh", **settings[0].fields)["accuracy"] == 98
    assert t1.resolve(quick=False, overrides={})["known_batch_size"] is False
    # SPEAR cells run first, SPEAR beside l1 on the same gradients; a cell is never attacked twice
    both = t1.settings(
        t1.resolve(quick=False, overrides={"methods": ("l1", "spear"), "cells": parse_cells("10x200,20x200")})
    )
    assert [(s.cell.label, s.methods) for s in both] == [
        ("10x200", ("spear", "l1")),
        ("15x200", ("spear", "l1")),
        ("20x200", ("l1",)),
    ]
    dp = get_table("spearpp-t3")
    noise = dp.settings(dp.resolve(quick=False, overrides={}))
    assert [(s.cell.label, s.params["noise_factor"]) for s in noise] == [
        ("20x200", 0.5),
        ("20x200", 1.0),
        ("20x200", 2.0),
        ("150x4000", 0.5),
        ("150x4000", 1.0),
        ("150x4000", 2.0),
    ]
    assert [published("defended", method="l1", **s.fields).get("accuracy") for s in noise] == [
        None,
        None,
        75,
        None,
        None,
        88,
    ]
    assert {s.threshold_db for s in noise} == {25.0}
    fedavg = get_table("spearpp-t4").settings(get_table("spearpp-t4").resolve(quick=False, overrides={}))
    assert [(s.params["epochs"], s.params["mini_batch_size"]) for s in fedavg] == [(3, 5), (15, 30)]
    secagg = get_table("secagg").settings(get_table("secagg").resolve(quick=False, overrides={}))
    assert [(s.cell, s.threshold_db) for s in secagg] == [
        (Cell(10, 200), 90.0),
        (Cell(20, 200), 90.0),
        (Cell(30, 200), 90.0),
    ]
    depth = get_table("spear-t4").settings(get_table("spear-t4").resolve(quick=True, overrides={}))
    assert [s.params["layer"] for s in depth] == [1, 2, 3, 4, 5, 6]
    assert published("depth", method="l1", **depth[0].fields)["mae"] == 1.06e-6
    assert published("depth", method="l1", **depth[5].fields) == {}


def test_spear_runs_on_its_own_trials() -> None:
    t3 = get_table("spear-t3")
    settings = t3.settings(t3.resolve(quick=False, overrides={"folders": ("tinyimagenet=/data/tiny",)}))
    assert [(s.label, s.methods, s.trials) for s in settings] == [
        ("mnist", ("l1",), 10),
        ("mnist", ("spear",), 3),
        ("cifar10", ("l1",), 10),
        ("cifar10", ("spear",), 3),
        ("tinyimagenet", ("l1",), 10),
        ("tinyimagenet", ("spear",), 3),
    ]
    assert (settings[4].dataset, settings[4].data_root) == ("folder", "/data/tiny")
    assert settings[0].victim_key == settings[1].victim_key  # same batches for both methods


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [
        ("cells", "20y200", "not of the form"),
        ("trials", "0", ">= 1"),
        ("time_budget", "0", "> 0"),
        ("methods", "l1,magic", "unknown or no methods"),
        ("known_batch_size", "maybe", "not a boolean"),
        ("layers", "1,x", "invalid literal"),
        ("nonsense", "1", "unknown option 'nonsense'"),
    ],
)
def test_bad_option_values_are_rejected(key: str, text: str, message: str) -> None:
    allowed = {**get_table("spear-t4").options, "known_batch_size": True}
    with pytest.raises(ValueError, match=message):
        parse_option(key, text, allowed=allowed)


def test_options_parse_and_overrides_are_checked() -> None:
    allowed = get_table("defended").options
    assert parse_option("noise_factors", "0.1, 0.25", allowed=allowed) == (0.1, 0.25)
    assert parse_option("epochs", "none", allowed=allowed) is None
    assert parse_option("grid_cell", "20x200", allowed=allowed) == Cell(20, 200)
    with pytest.raises(ValueError, match="no option"):
        get_table("spearpp-t1").resolve(quick=False, overrides={"layers": (1,)})
    with pytest.raises(ValueError, match="unknown sections"):
        get_table("defended").settings(
            get_table("defended").resolve(quick=False, overrides={"sections": ("dq",)})
        )
    with pytest.raises(ValueError, match="unknown table 'spear-t99'; available: spear-t1"):
        get_table("spear-t99")


def test_alias_lists_and_rejects_unknown_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert alias_main([]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in TABLES)
    with pytest.raises(SystemExit) as exit_info:
        alias_main(["spear-t99"])
    assert exit_info.value.code == 2
    assert "unknown table 'spear-t99'" in capsys.readouterr().err
