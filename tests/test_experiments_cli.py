"""``python -m experiments``: listing, where runs write, --update-results, missing datasets, status rows.

The runs use the bundled ``digits`` dataset (8x8 images), so no download is needed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path

import pytest

from experiments import output
from experiments.cli import main
from experiments.config import Cell
from experiments.output import RESULTS_DIR, ResultsWriter
from experiments.runner import csv_fields, load_data, run_settings, summary_rows
from experiments.tables import TABLES, get_table

SMALL = ["--set", "dataset=digits", "--set", "secagg_clients=2"]


def _tracked_results() -> dict[str, str]:
    return {
        str(path.relative_to(RESULTS_DIR)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(RESULTS_DIR.rglob("*"))
        if path.is_file()
    }


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_list_names_every_table_and_the_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    for table in TABLES.values():
        assert f"{table.name}  " in listing and table.source in listing
    assert "python -m experiments sweep --list" in listing
    assert main(["list", "spearpp-t3"]) == 0
    options = capsys.readouterr().out
    assert (
        "noise_factors" in options
        and "0.5,1,2" in options
        and re.search(r"\n  cells +20x200,150x4000 +20x200\n", options)
    )


def test_quick_run_writes_its_folder_and_never_the_committed_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tracked_results()
    monkeypatch.chdir(tmp_path)
    assert main(["run", "secagg", "--quick", *SMALL]) == 0
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0].startswith("QUICK RUN of secagg (1 trial(s), 6 s budgets): a smoke test")
    folder = tmp_path / "outputs" / "experiments" / "secagg_quick"
    assert sorted(p.name for p in folder.iterdir()) == [
        "secagg_quick.csv",
        "secagg_quick.json",
        "secagg_quick.md",
    ]
    markdown = (folder / "secagg_quick.md").read_text()
    assert markdown.startswith(
        "# secure aggregation: k clients' gradients summed, attacked as one batch (quick run, "
        "not the paper comparison)\n\n> QUICK RUN of secagg"
    )
    assert "| 10 | 200 | 2 | 5 | 100 | 100 | 100% (1/1) |" in markdown  # both clients recovered exactly
    (row,) = _rows(folder / "secagg_quick.csv")
    assert (row["section"], row["dataset"], row["b"], row["method"], row["ok"]) == (
        "secagg",
        "digits",
        "10",
        "l1",
        "1",
    )
    assert row["client_fractions"] == "1.00;1.00" and float(row["min_psnr"]) > 90 and row["error"] == ""
    summary = json.loads((folder / "secagg_quick.json").read_text())
    assert (
        summary["quick"] is True
        and summary["options"]["trials"] == 1
        and summary["rows"][0]["accuracy"] == 100
    )
    assert _tracked_results() == before


def test_update_results_is_required_to_write_the_committed_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "secagg", "--quick", "--out", str(RESULTS_DIR / "here"), *SMALL])
    assert exit_info.value.code == 2
    assert "holds the committed results: pass --update-results" in capsys.readouterr().err
    committed = tmp_path / "results"
    monkeypatch.setattr(output, "RESULTS_DIR", committed)
    assert main(["run", "secagg", "--quick", "--update-results", "--name", "mine", *SMALL]) == 0
    assert sorted(p.name for p in committed.iterdir()) == ["mine.csv", "mine.json", "mine.md"]
    with pytest.raises(SystemExit):
        main(["run", "secagg", "--update-results", "--out", str(tmp_path), *SMALL])
    assert "do not combine it with --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("table", "dataset"), [("spearpp-t1", "cifar10"), ("spear-t2", "adult"), ("spear-t3", "mnist")]
)
def test_missing_dataset_exits_2_with_one_line(
    table: str, dataset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["run", table, "--quick", "--data-root", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"error: {dataset} ") and f"fl-attack-data fetch {dataset}`" in line.lower()
    assert not out.exists()


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for arguments, message in (
        (["run", "spear-t99"], "unknown table 'spear-t99'"),
        (["run", "secagg", "--set", "trials"], "--set takes KEY=VALUE"),
        (["run", "secagg", "--set", "layers=1"], "unknown option 'layers'"),
        (["run", "spearpp-t1", "--cells", "20y200"], "not of the form <b>x<m>"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(arguments)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_a_layer_that_cannot_be_attacked_is_a_status_row(tmp_path: Path) -> None:
    table = get_table("spear-t4")
    options = table.resolve(
        quick=True,
        overrides={"dataset": "digits", "layers": (2, 6), "cells": (Cell(5, 40),), "time_budget": 10.0},
    )
    settings = table.settings(options)
    data = load_data(settings)
    with ResultsWriter(tmp_path, name="depth", fields=csv_fields(settings, data)) as writer:
        results = run_settings(settings, data, options=options, writer=writer)
    exact, refused = summary_rows(results, family="depth")
    assert (exact["layer"], exact["status"], exact["accuracy"], exact["errors"]) == (2, "run", 100.0, 0)
    assert exact["mae"] < 1e-6 and 0 < exact["input_similarity"] < 1
    assert refused["layer"] == 6 and refused["status"].startswith("not attackable: linear layer 6")
    assert "output layer" in refused["status"] and "paper_mae" not in refused
    rows = _rows(tmp_path / "depth.csv")
    assert [(r["layer"], r["ok"]) for r in rows] == [("2", "1"), ("6", "0")]
    assert rows[1]["error"].startswith("update: linear layer 6")
