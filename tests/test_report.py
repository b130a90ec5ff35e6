"""Tests of the HTML audit report, on tiny run directories written by the store."""

from __future__ import annotations

import base64
import html
import importlib.metadata
import io
import json
import re
import stat
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_attack.results.report import (
    REPORT_DIRECTORY,
    REPORT_FILE,
    SUMMARY_FILE,
    NotARunDirectoryError,
    load_summary,
    main,
    write_report,
)
from fl_attack.results.store import FILE_MODE, AttackRecord, ReconstructionStore
from fl_attack.vocabulary import VERDICT_MEANINGS
from tests.report_runs import add_verdicts, images, make_run, ok_record, simple_run

DATA_PREFIX = "data:image/png;base64,"
FIXTURE_SENTENCE = (
    "The server recovered 43% of the 7 scored client samples exactly (round 1: 50%, round 2: 33%) and 57% "
    "at least approximately; DP-SGD (noise multiplier 0.5, clipping norm 2) was on."
)


class _Page(HTMLParser):
    """Collects images, scripts, links, element ids and the page's text."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.scripts = 0
        self.text: list[str] = []
        self.hrefs: list[str] = []
        self.external: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(str(values["id"]))
        if tag == "img":
            self.sources.append(values.get("src") or "")
        if tag == "script":
            self.scripts += 1
        if tag == "link":
            self.external.append(str(values))
        if tag == "a" and values.get("href"):
            self.hrefs.append(str(values["href"]))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny run directory and its report, written once for the read-only tests."""
    run = make_run(tmp_path_factory.mktemp("reported"))
    return run, write_report(run)


def _parse(path: Path) -> _Page:
    parser = _Page()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _decode(source: str) -> Image.Image:
    assert source.startswith(DATA_PREFIX), source[:60]
    data = base64.b64decode(source[len(DATA_PREFIX) :], validate=True)
    picture = Image.open(io.BytesIO(data))
    assert picture.format == "PNG"
    picture.load()
    return picture


def _cells(row: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]


def _table_rows(text: str, table_id: str) -> list[list[str]]:
    table = text.split(f'<table id="{table_id}">', 1)[1].split("</table>", 1)[0]
    return [_cells(row) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, flags=re.S) if "<td" in row]


def _section(text: str, section_id: str) -> str:
    return text.split(f'<section id="{section_id}">', 1)[1].split("</section>", 1)[0]


def test_report_is_self_contained_with_embedded_pngs(reported: tuple[Path, Path]) -> None:
    run_dir, path = reported
    assert path == run_dir / REPORT_FILE
    assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE
    page = _parse(path)
    # 3 plots (rounds, psnr, timing) + 2 tiles for each of the 4 best and 3 worst of 7 samples.
    assert len(page.sources) == 3 + 2 * (4 + 3)
    for source in page.sources:
        picture = _decode(source)
        assert picture.size[0] > 0 and picture.size[1] > 0
    assert page.scripts == 0 and page.external == []
    assert page.hrefs and all(href.startswith("#") and href[1:] in page.ids for href in page.hrefs)
    text = path.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "@import" not in text
    policy = html.unescape(text)
    assert "default-src 'none'; img-src data:" in policy and "script-src 'none'" in policy

    plots = run_dir / REPORT_DIRECTORY
    for name in ("rounds", "psnr", "attack_seconds", "best", "worst"):
        file = plots / f"{name}.png"
        assert file.is_file(), name
        assert stat.S_IMODE(file.stat().st_mode) == FILE_MODE
        with Image.open(file) as picture:
            assert picture.format == "PNG"
    assert not list(plots.glob(".*.tmp")) and not list(run_dir.glob(".*.tmp"))
    summary_file = run_dir / SUMMARY_FILE
    assert stat.S_IMODE(summary_file.stat().st_mode) == FILE_MODE


def test_page_opens_with_the_verdict(reported: tuple[Path, Path]) -> None:
    run_dir, path = reported
    text = path.read_text(encoding="utf-8")
    assert re.search(r"<body>\s*<section id=\"verdict\">", text)
    verdict = _section(text, "verdict")
    assert f'<p class="sentence">{FIXTURE_SENTENCE}</p>' in verdict
    written = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    assert written["verdict_sentence"] == FIXTURE_SENTENCE
    # The table of contents comes next and names every section present.
    contents = text.split('<nav id="contents">', 1)[1].split("</nav>", 1)[0]
    sections = ("verdict", "recommendations", "threat-model", "verdicts", "rounds", "failures", "settings")
    for section in sections:
        assert f'href="#{section}"' in contents and f'<section id="{section}">' in text
    assert 'href="#secagg"' not in contents  # no secure aggregation in this run


def test_report_numbers(reported: tuple[Path, Path]) -> None:
    text = reported[1].read_text(encoding="utf-8")
    rows = {row[0]: row for row in _table_rows(text, "round-table")}
    # Round 0 (the initial model) has no attack but its test accuracy.
    assert rows["0"][1:4] == ["0", "0", "0"] and rows["0"][8] == "10.0%"
    # Round 1: 2/4 exact, 3/4 approximate; round 2: 1/3 exact, 1/3 approximate.
    assert rows["1"][1:7] == ["2", "1", "4", "50.0% (2)", "75.0% (3)", "117.5 dB"]
    assert rows["1"][8] == "25.0%"
    assert rows["2"][1:7] == ["2", "0", "3", "33.3% (1)", "33.3% (1)", "40.0 dB"]
    assert rows["2"][8] == "50.0%"
    verdict = _section(text, "verdict")
    assert "<b>42.9%</b> of the 7 scored client samples (3)" in verdict
    assert "<b>57.1%</b> (4)" in verdict
    assert "1 failed attack(s) are not counted" in verdict
    assert "1 successful attack(s) have no score" in verdict
    assert "final test accuracy <b>50.0%</b>" in verdict
    # An old run records no input space and no job times: those columns are left out.
    assert "<th>input space</th>" not in text and "<th>queued s</th>" not in text


def test_verdict_table_counts_and_meanings(reported: tuple[Path, Path]) -> None:
    text = reported[1].read_text(encoding="utf-8")
    rows = {row[0]: row for row in _table_rows(text, "verdict-table")}
    assert list(rows) == list(VERDICT_MEANINGS)
    # Old-format run: every verdict derived (2 approximate by PSNR, the timeout, the unscored incomplete one).
    assert [rows[v][1:4] for v in ("exact", "approximate", "failed", "timeout")] == [
        ["0", "0.0%", "0"],
        ["2", "50.0%", "2"],
        ["1", "25.0%", "1"],
        ["1", "25.0%", "1"],
    ]
    for verdict, meaning in VERDICT_MEANINGS.items():
        assert rows[verdict][4] == meaning.replace("'", "&#39;")
    assert "4 verdict(s) were not recorded by this run and are derived" in text


def test_psnr_is_shown_capped_everywhere(reported: tuple[Path, Path]) -> None:
    text = reported[1].read_text(encoding="utf-8")
    assert "300.0" not in text  # the 300 dB sample is shown as "> 150 dB" only
    samples = _section(text, "samples")
    assert "round 1, partition-0, sample 0<br><b>&gt; 150 dB</b>" in samples
    assert "round 2, partition-0, sample 2<br><b>5.0 dB</b>" in samples  # the worst sample
    assert samples.count('<span class="label">truth</span>') == 7
    assert samples.count('<span class="label">recovered</span>') == 7
    assert "the 1 sample(s) above 150 dB (exact up to rounding) share the last bin" in _section(text, "psnr")


def test_failures_list_their_reasons(reported: tuple[Path, Path]) -> None:
    text = reported[1].read_text(encoding="utf-8")
    rows = {(row[0], row[1]): row for row in _table_rows(text, "failure-table")}
    assert set(rows) == {("1", "partition-1"), ("2", "partition-1")}
    timeout = rows[("1", "partition-1")]
    assert timeout[2:4] == ["timeout", "timeout (derived)"]
    assert timeout[4] == (
        "derived from status timeout: the attack was stopped at its limit: attack exceeded &lt;20 s&gt; "
        "&amp; was killed"
    )
    assert rows[("2", "partition-1")][3] == "failed (derived)"


def test_threat_model_card(reported: tuple[Path, Path]) -> None:
    text = _section(reported[1].read_text(encoding="utf-8"), "threat-model")
    card = dict(re.findall(r'<dd id="card-([a-z-]+)">(.*?)</dd>', text, flags=re.S))
    assert card["layer"] == "weight <code>fc1.weight</code> and bias <code>fc1.bias</code>"
    assert card["input-space"] == "not recorded by this run"
    assert card["observed"] == "every client&#39;s individual update (no secure aggregation)"
    assert card["training"].startswith("DP-SGD (Opacus): ")
    assert "clipped to norm 2" in card["training"] and "multiplier 0.5" in card["training"]
    assert card["dp-epsilon"].startswith("epsilon not recorded by this run")
    assert card["secagg"] == "none (the server sees each client&#39;s update)"
    assert card["ground-truth"].startswith("used only to score the reconstructions")
    assert card["targets"] == "every client update, with a search budget of 5 s per update"


def test_settings_that_played_a_part(reported: tuple[Path, Path], tmp_path: Path) -> None:
    text = reported[1].read_text(encoding="utf-8")
    keys = [row[0] for row in _table_rows(text, "settings-table")]
    assert "noise-multiplier" in keys and "max-grad-norm" in keys
    assert "batch-size" not in keys and "secagg-group-size" not in keys  # DP-SGD, no secure aggregation
    omitted = _section(text, "settings").split("Left out", 1)[1]
    assert "<code>batch-size</code>" in omitted and "<code>secagg-group-size</code>" in omitted

    config = {"train-mode": "fedsgd", "batch-size": 8, "noise-multiplier": 1.0, "secagg-group-size": 3}
    fedsgd = write_report(simple_run(tmp_path, config, [[150.0]])).read_text(encoding="utf-8")
    keys = [row[0] for row in _table_rows(fedsgd, "settings-table")]
    assert keys == ["train-mode", "batch-size", "secagg-group-size"]


def test_recommendations(reported: tuple[Path, Path], tmp_path: Path) -> None:
    text = _section(reported[1].read_text(encoding="utf-8"), "recommendations")
    # The run had DP-SGD at noise 0.5: only the stronger measured noise (1.0) and secure aggregation.
    assert "Recovery in this run is 57% of the client samples." in text
    assert "<code>noise-multiplier=1.0</code>" in text and "noise-multiplier=0.01" not in text
    assert "<code>secagg-group-size=3</code>" in text and "<code>secagg-group-size=2</code>" in text
    assert "<code>experiments/results/sweep_noise-multiplier.csv</code>" in text
    assert "test accuracy after 8 rounds 0.125 against 0.203 without the defense (-7.8 points)" in text

    quiet = write_report(simple_run(tmp_path, {"train-mode": "fedsgd"}, [[10.0, 5.0]])).read_text("utf-8")
    section = _section(quiet, "recommendations")
    assert "Recovery is already below 1% of the scored client samples in this run" in section
    assert "no further defense" in section and "<table" not in section


def test_text_is_escaped(reported: tuple[Path, Path]) -> None:
    run_dir, path = reported
    text = path.read_text(encoding="utf-8")
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "attack exceeded &lt;20 s&gt; &amp; was killed" in text
    assert _parse(run_dir / REPORT_FILE).scripts == 0


def test_recorded_verdicts_timing_and_input_space(run_dir: Path) -> None:
    add_verdicts(
        run_dir,
        {
            (1, "partition-0"): {"verdict": "approximate", "verdict_reason": "two <b>samples</b> missing",
                                 "input_space": "inputs", "queued_at": 100.0, "started_at": 102.0,
                                 "finished_at": 103.0},
            (1, "partition-1"): {"verdict": "timeout", "verdict_reason": "spent its 20 s budget",
                                 "input_space": "inputs"},
            (2, "partition-0"): {"verdict": "approximate", "verdict_reason": "noisy",
                                 "input_space": "inputs"},
            (2, "partition-1"): {"verdict": "exact", "verdict_reason": "self-check passed",
                                 "input_space": "inputs"},
        },
    )  # fmt: skip
    text = write_report(run_dir).read_text(encoding="utf-8")
    rows = {row[0]: row for row in _table_rows(text, "verdict-table")}
    assert [rows[v][1:3] for v in ("exact", "approximate", "timeout", "failed")] == [
        ["1", "25.0%"],
        ["2", "50.0%"],
        ["1", "25.0%"],
        ["0", "0.0%"],
    ]
    assert "derived" not in _section(text, "verdicts")
    failures = {(row[0], row[1]): row for row in _table_rows(text, "failure-table")}
    assert failures[("1", "partition-1")][3:5] == ["timeout", "spent its 20 s budget"]
    assert "two &lt;b&gt;samples&lt;/b&gt; missing" in text and "<b>samples</b>" not in text
    attacks = _table_rows(text, "attack-table")
    assert "<th>queued s</th>" in text and attacks[0][:7] == ["1", "partition-0", "ok", "approximate",
                                                              "inputs", "1.0", "2.0"]  # fmt: skip
    assert "the attacked layer is the model&#39;s first" in _section(text, "threat-model")
    assert "<b>25.0%</b> of the attacks exact" in _section(text, "verdict")


def test_unscored_run_still_reports(tmp_path: Path) -> None:
    config = {"audit-ground-truth": False, "train-mode": "fedavg"}
    store = ReconstructionStore(tmp_path / "run", run_config=config)
    pictures = images(3, 3, channels=3)
    store.save(
        AttackRecord(server_round=1, client="node-5", status="ok", seconds=2.0,
                     inputs=pictures.reshape(3, -1), reconstructed_images=pictures,
                     attack={"batch_size": 3, "complete": True})
    )  # fmt: skip
    path = write_report(store.directory)
    text = path.read_text(encoding="utf-8")
    assert "Scores are unavailable" in text and "not scored" in text
    assert "FedAvg" in text
    assert _section(text, "verdict").count("No ground truth scored this run and it records no verdicts") == 1
    page = _parse(path)
    assert len(page.sources) == 2  # the stored reconstruction grid and the timing plot
    for source in page.sources:
        _decode(source)


@pytest.mark.parametrize("failed", [False, True])
def test_run_without_successful_attacks(tmp_path: Path, failed: bool) -> None:
    store = ReconstructionStore(tmp_path / "run")  # no run_config.json at all
    if failed:
        store.save(AttackRecord(server_round=1, client="partition-0", status="error", seconds=0.0,
                                error="ValueError: all-zero gradient"))  # fmt: skip
    text = write_report(store.directory).read_text(encoding="utf-8")
    assert "No run_config.json in this run." in text
    if failed:
        assert "Scores are unavailable" in text and "all-zero gradient" in text
        assert "The server reconstructed none of the 1 attacked client updates (1 failed)" in text
        assert "not that they are safe" in text and "no further defense" not in text
    else:
        assert "No client update was attacked in this run" in text
        assert "Nothing was attacked, so nothing is recommended." in text


def test_secure_aggregation_members(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config={"secagg-group-size": 2, "train-mode": "fedsgd"})
    members = {
        "partition-0": {"samples": 2, "mean_psnr": 150.0, "exact_fraction": 1.0, "approx_fraction": 1.0},
        "partition-1": {"samples": 2, "mean_psnr": 30.0, "exact_fraction": 0.0, "approx_fraction": 0.5},
    }
    store.save(ok_record(1, "secagg-partition-0_partition-1", [200.0, 100.0, 30.0, 20.0], seed=4,
                         details={"members": members, "secagg_group_size": 2}))  # fmt: skip
    text = write_report(store.directory).read_text(encoding="utf-8")
    assert "secure aggregation over groups of 2 clients was on." in _section(text, "verdict")
    assert 'id="card-secagg">groups of 2 clients</dd>' in text
    section = _section(text, "secagg")
    assert "partition-1" in section and "50.0%" in section and "150.0 dB" in section
    assert "secagg-group-size=3" in _section(text, "recommendations")  # a larger group stopped recovery


def test_store_records_grid_geometry_for_crops(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    directory = store.save(ok_record(1, "partition-0", [300.0, 40.0], seed=2))
    grid = json.loads((directory / "metrics.json").read_text())["grid"]
    assert grid["rows"] == 2 and grid["columns"] == 2 and grid["column_psnr"] == [300.0, 40.0]
    with Image.open(directory / "reconstruction.png") as picture:
        assert picture.size == (grid["width"], grid["height"])
    # Fewer reconstructions than references: PSNR per column is recomputed from the images.
    record = ok_record(1, "partition-1", [300.0, 40.0, 0.0], seed=2)
    assert record.reference_images is not None
    record = AttackRecord(**{**record.__dict__, "reconstructed_images": record.reference_images[:2],
                             "reference_images": record.reference_images[:2]})  # fmt: skip
    grid = json.loads((store.save(record) / "metrics.json").read_text())["grid"]
    assert grid["column_psnr_source"] == "images" and grid["column_psnr"] == [300.0, 300.0]


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """A fresh tiny run directory (see :func:`tests.report_runs.make_run`)."""
    return make_run(tmp_path)


def test_old_run_without_grid_metadata(run_dir: Path) -> None:
    """Runs stored before metrics.json had ``grid`` still get their crops."""
    for metrics in run_dir.glob("round-*/*/metrics.json"):
        document = json.loads(metrics.read_text())
        document.pop("grid", None)
        metrics.write_text(json.dumps(document))
    text = write_report(run_dir).read_text(encoding="utf-8")
    assert _section(text, "samples").count('<span class="label">truth</span>') == 7
    assert (run_dir / REPORT_DIRECTORY / "best.png").is_file()


def test_output_option_and_cli(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "elsewhere" / "audit.html"
    target.parent.mkdir()
    assert main([str(run_dir), "-o", str(target)]) == 0
    assert target.is_file() and (tmp_path / "elsewhere" / "audit-plots" / "psnr.png").is_file()
    written = json.loads((tmp_path / "elsewhere" / "audit.json").read_text(encoding="utf-8"))
    assert written == json.loads(json.dumps(load_summary(run_dir)))
    assert str(target) in capsys.readouterr().out
    assert not (run_dir / REPORT_FILE).exists()

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "elsewhere")])
    assert exit_info.value.code == 2
    assert "is not a run directory" in capsys.readouterr().err
    with pytest.raises(NotARunDirectoryError, match="is not a run directory"):
        write_report(tmp_path / "elsewhere")


def test_console_script_is_declared() -> None:
    """``fl-attack-report`` is installed and points at :func:`fl_attack.results.report.entry_point`."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    assert 'fl-attack-report = "fl_attack.results.report:entry_point"' in pyproject
    scripts = importlib.metadata.entry_points(group="console_scripts")
    declared = [script for script in scripts if script.name == "fl-attack-report"]
    if declared:  # installed (pip install -e .)
        assert declared[0].value == "fl_attack.results.report:entry_point"


def test_gallery_png_files_are_labelled_pictures(reported: tuple[Path, Path]) -> None:
    """best.png holds the 4 best samples: truth above recovered, one column each, with a label band."""
    with Image.open(reported[0] / REPORT_DIRECTORY / "best.png") as picture:
        width, height = picture.size
        pixels = np.asarray(picture.convert("L"))
    assert width == 104 + 4 * (96 + 8) and height == 24 + 34 + 2 * 96 + 8
    assert (pixels[:24] < 128).any()  # the title is drawn


def test_failing_report_never_ends_the_audit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ServerApp's report hook logs a failure instead of raising."""
    pytest.importorskip("flwr")
    import fl_attack.results.report
    from strategies import server_app

    def broken(*args: object, **kwargs: object) -> Path:
        raise RuntimeError("disk full")

    store = ReconstructionStore(tmp_path / "run")
    monkeypatch.setattr(fl_attack.results.report, "write_report", broken)
    assert server_app._write_report(store) is None  # pylint: disable=protected-access
    monkeypatch.undo()
    assert server_app._write_report(store) == store.directory / REPORT_FILE  # pylint: disable=protected-access
