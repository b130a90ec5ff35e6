"""Tests of the HTML audit report, on tiny run directories written by the store."""

from __future__ import annotations

import base64
import importlib.metadata
import io
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_attack.results.report import REPORT_DIRECTORY, REPORT_FILE, NotARunDirectoryError, main, write_report
from fl_attack.results.store import FILE_MODE, AttackRecord, ReconstructionStore

DATA_PREFIX = "data:image/png;base64,"


class _Images(HTMLParser):
    """Collects the ``src`` of every ``<img>`` and the text of the page."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.scripts = 0
        self.text: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img":
            self.sources.append(values.get("src") or "")
        if tag == "script":
            self.scripts += 1
        if tag == "link" or (tag == "a" and values.get("href")):
            self.links.append(str(values))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _images(count: int, seed: int, channels: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((count, channels, 4, 4))


def _ok(server_round: int, client: str, psnr: list[float], *, seed: int, **fields: object) -> AttackRecord:
    reference = _images(len(psnr), seed)
    reconstructed = np.clip(reference + 0.01 * np.arange(len(psnr))[:, None, None, None], 0, 1)
    values: dict[str, object] = {
        "status": "ok",
        "seconds": 1.0 + seed,
        "inputs": reconstructed.reshape(len(psnr), -1),
        "reconstructed_images": reconstructed,
        "reference_images": reference,
        "attack": {"batch_size": len(psnr), "complete": True, "sparsity_matching": 1.0},
        "quality": {
            "mean_psnr": float(np.mean(psnr)),
            "exact_fraction": float(np.mean([v > 90 for v in psnr])),
            "approx_fraction": float(np.mean([v > 25 for v in psnr])),
        },
        "psnr": psnr,
        "details": {"partition_id": 0, "layer": {"weight": "fc1.weight", "bias": "fc1.bias"}},
    }
    values.update(fields)
    return AttackRecord(server_round=server_round, client=client, **values)  # type: ignore[arg-type]


def _make_run(tmp_path: Path) -> Path:
    """Two rounds, two clients; one failed and one unscored attack; a history."""
    config = {
        "dataset": "digits <script>alert(1)</script>",
        "train-mode": "dpsgd",
        "noise-multiplier": 0.5,
        "max-grad-norm": 2.0,
        "batch-size": 4,
        "width": 16,
        "architecture": "spear++",
        "secagg-group-size": 1,
        "attack-time-budget": 5.0,
        "audit-ground-truth": True,
    }
    store = ReconstructionStore(tmp_path / "run", run_config=config)
    # Round 1: 4 scored samples, 2 exact (> 90), 3 approximate (> 25).
    store.save(_ok(1, "partition-0", [300.0, 120.0, 40.0, 10.0], seed=0))
    store.save(AttackRecord(server_round=1, client="partition-1", status="timeout", seconds=22.5,
                            error="attack exceeded <20 s> & was killed"))
    # Round 2: 3 scored samples, 1 exact, 1 approximate; plus an unscored reconstruction.
    store.save(_ok(2, "partition-0", [95.0, 20.0, 5.0], seed=1))
    unscored = _images(2, 7)
    store.save(AttackRecord(server_round=2, client="partition-1", status="ok", seconds=3.0,
                            inputs=unscored.reshape(2, -1), reconstructed_images=unscored,
                            attack={"batch_size": 2, "complete": False}))
    store.save_history({
        "rounds": [
            {"round": 0, "train": None, "evaluate": None,
             "test": {"test-loss": 2.3, "test-acc": 0.1, "test-examples": 50}},
            {"round": 1, "train": {"train-loss": 2.0}, "evaluate": None,
             "test": {"test-loss": 2.0, "test-acc": 0.25, "test-examples": 50}},
            {"round": 2, "train": {"train-loss": 1.5}, "evaluate": None,
             "test": {"test-loss": 1.6, "test-acc": 0.5, "test-examples": 50}},
        ],
        "final_test": {"test-loss": 1.6, "test-acc": 0.5, "test-examples": 50},
    })
    return store.directory


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """A fresh tiny run directory (see :func:`_make_run`)."""
    return _make_run(tmp_path)


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny run directory and its report, written once for the read-only tests."""
    run = _make_run(tmp_path_factory.mktemp("reported"))
    return run, write_report(run)


def _parse(path: Path) -> _Images:
    parser = _Images()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _decode(source: str) -> Image.Image:
    assert source.startswith(DATA_PREFIX), source[:60]
    data = base64.b64decode(source[len(DATA_PREFIX):], validate=True)
    picture = Image.open(io.BytesIO(data))
    assert picture.format == "PNG"
    picture.load()
    return picture


def _round_row(text: str, server_round: int) -> list[str]:
    """Cells of the per-round table's row for ``server_round``."""
    table = text.split("Leakage and utility per round", 1)[1].split("</table>", 1)[0]
    for row in re.findall(r"<tr>(.*?)</tr>", table, flags=re.S):
        cells = [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)]
        if cells and cells[0] == str(server_round):
            return cells
    raise AssertionError(f"round {server_round} not in the per-round table")


def test_report_is_self_contained_with_embedded_pngs(reported: tuple[Path, Path]) -> None:
    run_dir, path = reported
    assert path == run_dir / REPORT_FILE
    assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE
    page = _parse(path)
    # rounds, psnr, seconds, best, worst, and the unscored grid is not shown (scores exist)
    assert len(page.sources) >= 5
    for source in page.sources:
        picture = _decode(source)
        assert picture.size[0] > 0 and picture.size[1] > 0
    assert page.scripts == 0 and page.links == []
    text = path.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "@import" not in text

    plots = run_dir / REPORT_DIRECTORY
    for name in ("rounds", "psnr", "attack_seconds", "best", "worst"):
        file = plots / f"{name}.png"
        assert file.is_file(), name
        assert stat.S_IMODE(file.stat().st_mode) == FILE_MODE
        with Image.open(file) as picture:
            assert picture.format == "PNG"
    assert not list(plots.glob(".*.tmp"))


def test_report_numbers(reported: tuple[Path, Path]) -> None:
    text = reported[1].read_text(encoding="utf-8")
    # Round 0 (the initial model) has no attack but its test accuracy.
    row0 = _round_row(text, 0)
    assert row0[1:4] == ["0", "0", "0"] and row0[8] == "10.0%"
    # Round 1: 2/4 exact, 3/4 approximate; round 2: 1/3 exact, 1/3 approximate.
    row1 = _round_row(text, 1)
    assert row1[1:4] == ["2", "1", "4"]  # attacked, failed, scored samples
    assert row1[4] == "50.0% (2)" and row1[5] == "75.0% (3)"
    assert row1[8] == "25.0%"  # test accuracy of round 1
    row2 = _round_row(text, 2)
    assert row2[1:4] == ["2", "0", "3"]
    assert row2[4] == "33.3% (1)" and row2[5] == "33.3% (1)"
    assert row2[8] == "50.0%"
    # Over the run: 3 of 7 exact, 4 of 7 approximate.
    assert "<b>42.9%</b> of the 7 scored client samples (3)" in text
    assert "<b>57.1%</b> (4)" in text
    assert "1 failed attack(s) are not counted" in text
    assert "1 successful attack(s) have no score" in text
    # Threat model from the config.
    assert "DP-SGD" in text and "0.5" in text and "No secure aggregation" in text
    assert "<code>fc1.weight</code>" in text
    # Best first: the 300 dB sample; worst: 5 dB.
    best_table = text.split("Best and worst reconstructions", 1)[1]
    assert "300.0" in best_table and "5.0" in best_table


def test_text_is_escaped(reported: tuple[Path, Path]) -> None:
    run_dir, path = reported
    text = path.read_text(encoding="utf-8")
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "attack exceeded &lt;20 s&gt; &amp; was killed" in text
    assert _parse(run_dir / REPORT_FILE).scripts == 0


def test_unscored_run_still_reports(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config={"audit-ground-truth": False, "train-mode": "fedavg"})
    images = _images(3, 3, channels=3)
    store.save(AttackRecord(server_round=1, client="node-5", status="ok", seconds=2.0,
                            inputs=images.reshape(3, -1), reconstructed_images=images,
                            attack={"batch_size": 3, "complete": True}))
    path = write_report(store.directory)
    text = path.read_text(encoding="utf-8")
    assert "Scores are unavailable" in text and "not scored" in text
    assert "FedAvg" in text
    page = _parse(path)
    assert page.sources  # the stored reconstruction grid, and the timing plot
    for source in page.sources:
        _decode(source)


@pytest.mark.parametrize("failed", [False, True])
def test_run_without_successful_attacks(tmp_path: Path, failed: bool) -> None:
    store = ReconstructionStore(tmp_path / "run")  # no run_config.json at all
    if failed:
        store.save(AttackRecord(server_round=1, client="partition-0", status="error", seconds=0.0,
                                error="ValueError: all-zero gradient"))
    text = write_report(store.directory).read_text(encoding="utf-8")
    assert "run_config.json" in text
    if failed:
        assert "Scores are unavailable" in text and "all-zero gradient" in text
    else:
        assert "No client update was attacked" in text


def test_secure_aggregation_members(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run", run_config={"secagg-group-size": 2, "train-mode": "fedsgd"})
    members = {
        "partition-0": {"samples": 2, "mean_psnr": 150.0, "exact_fraction": 1.0, "approx_fraction": 1.0},
        "partition-1": {"samples": 2, "mean_psnr": 30.0, "exact_fraction": 0.0, "approx_fraction": 0.5},
    }
    store.save(_ok(1, "secagg-partition-0_partition-1", [200.0, 100.0, 30.0, 20.0], seed=4,
                   details={"members": members, "secagg_group_size": 2}))
    text = write_report(store.directory).read_text(encoding="utf-8")
    assert "Secure aggregation</b> is simulated with groups of 2" in text
    section = text.split("recovery per member client", 1)[1].split("</table>", 1)[0]
    assert "partition-1" in section and "50.0%" in section and "150.0" in section


def test_store_records_grid_geometry_for_crops(tmp_path: Path) -> None:
    store = ReconstructionStore(tmp_path / "run")
    directory = store.save(_ok(1, "partition-0", [300.0, 40.0], seed=2))
    grid = json.loads((directory / "metrics.json").read_text())["grid"]
    assert grid["rows"] == 2 and grid["columns"] == 2 and grid["column_psnr"] == [300.0, 40.0]
    with Image.open(directory / "reconstruction.png") as picture:
        assert picture.size == (grid["width"], grid["height"])
    # Fewer reconstructions than references: PSNR per column is recomputed from the images.
    record = _ok(1, "partition-1", [300.0, 40.0, 0.0], seed=2)
    record = AttackRecord(**{**record.__dict__, "reconstructed_images": record.reference_images[:2],
                             "reference_images": record.reference_images[:2]})
    grid = json.loads((store.save(record) / "metrics.json").read_text())["grid"]
    assert grid["column_psnr_source"] == "images" and grid["column_psnr"] == [300.0, 300.0]


def test_old_run_without_grid_metadata(run_dir: Path) -> None:
    """Runs stored before metrics.json had ``grid`` still get their crops."""
    for metrics in run_dir.glob("round-*/*/metrics.json"):
        document = json.loads(metrics.read_text())
        document.pop("grid", None)
        metrics.write_text(json.dumps(document))
    text = write_report(run_dir).read_text(encoding="utf-8")
    assert "Best reconstructions" in text or "best reconstructions" in text
    assert (run_dir / REPORT_DIRECTORY / "best.png").is_file()


def test_output_option_and_cli(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "elsewhere" / "audit.html"
    target.parent.mkdir()
    assert main([str(run_dir), "-o", str(target)]) == 0
    assert target.is_file() and (tmp_path / "elsewhere" / "audit-plots" / "psnr.png").is_file()
    assert str(target) in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "elsewhere")])
    assert exit_info.value.code == 2
    assert "is not a run directory" in capsys.readouterr().err
    with pytest.raises(NotARunDirectoryError):
        write_report(tmp_path / "elsewhere")


def test_console_script_is_declared() -> None:
    """``fl-attack-report`` is installed and points at :func:`fl_attack.results.report.entry_point`."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    assert 'fl-attack-report = "fl_attack.results.report:entry_point"' in pyproject
    scripts = importlib.metadata.entry_points(group="console_scripts")
    declared = [script for script in scripts if script.name == "fl-attack-report"]
    if declared:  # installed (pip install -e .)
        assert declared[0].value == "fl_attack.results.report:entry_point"


# ------------------------------------------------------------------ headless browser

_CHECK_SCRIPT = """
<script>
window.addEventListener('load', function () {
  var images = Array.prototype.slice.call(document.images);
  var bad = images.filter(function (img) { return !(img.complete && img.naturalWidth > 0); });
  var out = document.createElement('pre');
  out.id = 'render-check';
  out.textContent = 'IMAGES=' + images.length + ' BROKEN=' + bad.length + ' RENDERED=' +
      images.filter(function (img) { return img.width > 0 && img.height > 0; }).length;
  document.body.appendChild(out);
});
</script>
"""


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_report_renders_in_headless_chromium(reported: tuple[Path, Path], tmp_path: Path) -> None:
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium / google-chrome on PATH")
    run_dir, path = reported
    report = path.read_text(encoding="utf-8")
    # Test-only copy: allow one inline script (images stay restricted to data: URLs by
    # the report's own Content-Security-Policy), moved away from the run's plot files.
    assert "script-src 'none'" in report
    page = report.replace("script-src 'none'", "script-src 'unsafe-inline'")
    page = page.replace("</body>", _CHECK_SCRIPT + "</body>")
    isolated = Path(tempfile.mkdtemp(dir=tmp_path))
    (isolated / "page.html").write_text(page, encoding="utf-8")
    command = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--disable-extensions", f"--user-data-dir={isolated / 'profile'}",
        "--virtual-time-budget=5000", "--dump-dom", (isolated / "page.html").as_uri(),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False,
                                env={**os.environ, "HOME": str(isolated)})
    except subprocess.TimeoutExpired:
        pytest.fail("headless chromium did not finish within 90 s")
    match = re.search(r"IMAGES=(\d+) BROKEN=(\d+) RENDERED=(\d+)", result.stdout)
    assert match, f"no render check in the DOM (rc {result.returncode}): {result.stderr[-2000:]}"
    images, broken, rendered = (int(value) for value in match.groups())
    expected = len(_parse(run_dir / REPORT_FILE).sources)
    assert images == expected >= 5
    assert broken == 0 and rendered == images


def test_broken_image_is_detected_by_the_browser_check(tmp_path: Path) -> None:
    """The browser check can fail: an external (blocked) image counts as broken."""
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium / google-chrome on PATH")
    good = base64.b64encode(_png_bytes()).decode()
    page = (
        "<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" "
        "content=\"default-src 'none'; img-src data:; script-src 'unsafe-inline'\"></head><body>"
        f"<img src=\"data:image/png;base64,{good}\"><img src=\"missing.png\">"
        + _CHECK_SCRIPT + "</body></html>"
    )
    (tmp_path / "page.html").write_text(page, encoding="utf-8")
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
               "--dump-dom", (tmp_path / "page.html").as_uri()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False,
                            env={**os.environ, "HOME": str(tmp_path)})
    assert "IMAGES=2 BROKEN=1" in result.stdout, result.stderr[-2000:]


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (3, 3), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()



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
