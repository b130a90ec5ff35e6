"""The report rendered offline in headless Chromium: a screenshot, the verdict in the DOM, every image loaded.

Skipped when no Chromium / Chrome is installed (``.ci/run`` installs one when it can).
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_attack.results.report import SUMMARY_FILE, load_summary, write_report
from tests.report_runs import make_run, user_shaped_run

WINDOW = (1200, 2000)
#: Colour of the verdict box's border (#08519c).
VERDICT_BORDER = (8, 81, 156)

#: Test-only: appended to a copy of the page, it writes what the browser made of every image into the DOM.
CHECK_SCRIPT = """
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


BROWSER = _browser()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium / google-chrome on PATH")


def _chromium(page: Path, profile: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium offline on ``page`` with its own profile and home directory."""
    assert BROWSER is not None
    command = [
        BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--disable-extensions", f"--user-data-dir={profile}", *arguments,
        page.as_uri(),
    ]  # fmt: skip
    try:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "HOME": str(profile)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("headless chromium did not finish within 120 s")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of the tiny synthetic run of :func:`tests.report_runs.make_run`."""
    return write_report(make_run(tmp_path_factory.mktemp("browser")))


def test_screenshot_shows_the_page(report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    result = _chromium(
        report, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={WINDOW[0]},{WINDOW[1]}"
    )
    assert shot.is_file(), f"no screenshot (rc {result.returncode}): {result.stderr[-2000:]}"
    with Image.open(shot) as picture:
        assert picture.format == "PNG" and picture.size == WINDOW
        pixels = np.asarray(picture.convert("RGB")).astype(int)
    not_white = (pixels < 240).any(axis=2)
    assert not_white.mean() > 0.03, "the screenshot is (nearly) blank"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100  # text, plots and tiles, not a flat page
    # The verdict box opens the page: its border colour is drawn near the top.
    border = (np.abs(pixels[:400] - np.array(VERDICT_BORDER)).sum(axis=2) < 30).sum()
    assert border > 1000


def test_dom_has_the_verdict_and_every_image_loads(report: Path, tmp_path: Path) -> None:
    sentence = load_summary(report.parent)["verdict_sentence"]
    plain = _chromium(report, tmp_path / "plain", "--dump-dom")
    verdict = re.search(r'<section id="verdict">(.*?)</section>', plain.stdout, flags=re.S)
    assert verdict, f"no verdict section in the DOM (rc {plain.returncode}): {plain.stderr[-2000:]}"
    assert f'<p class="sentence">{html.escape(sentence, quote=False)}</p>' in verdict.group(1)
    assert (report.parent / SUMMARY_FILE).is_file()

    count, broken, rendered = _images_in_browser(report, tmp_path)
    assert count == report.read_text(encoding="utf-8").count("<img ") == 17
    assert broken == 0 and rendered == count


def _images_in_browser(report: Path, tmp_path: Path) -> tuple[int, int, int]:
    """Images of the page, those the browser could not decode, and those it drew with a size."""
    # Test-only copy: allow one inline script (images stay restricted to data: URLs by the
    # report's own Content-Security-Policy) to count the images the browser decoded.
    text = report.read_text(encoding="utf-8")
    assert "script-src &#39;none&#39;" in text
    page = tmp_path / "checked.html"
    checked = text.replace("script-src &#39;none&#39;", "script-src &#39;unsafe-inline&#39;")
    page.write_text(checked.replace("</body>", CHECK_SCRIPT + "</body>"), encoding="utf-8")
    result = _chromium(page, tmp_path / "checked", "--virtual-time-budget=5000", "--dump-dom")
    match = re.search(r"IMAGES=(\d+) BROKEN=(\d+) RENDERED=(\d+)", result.stdout)
    assert match, f"no render check in the DOM (rc {result.returncode}): {result.stderr[-2000:]}"
    count, broken, rendered = (int(value) for value in match.groups())
    return count, broken, rendered


def _section(dom: str, name: str) -> str:
    found = re.search(rf'<section id="{name}">(.*?)</section>', dom, flags=re.S)
    assert found, f"no {name} section in the DOM"
    return found.group(1)


@pytest.fixture(scope="module")
def user_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of a user-shaped run: a CNN's fc1 features, no ground truth, no history."""
    return write_report(user_shaped_run(tmp_path_factory.mktemp("user-shaped")))


def test_a_user_shaped_report_states_only_what_its_verdicts_show(user_report: Path, tmp_path: Path) -> None:
    """Without ground truth the page's headline, advice and recommendations match report.json."""
    summary = json.loads((user_report.parent / SUMMARY_FILE).read_text(encoding="utf-8"))
    dom = _chromium(user_report, tmp_path / "plain", "--dump-dom")
    assert '<section id="verdict">' in dom.stdout, f"no DOM (rc {dom.returncode}): {dom.stderr[-2000:]}"
    verdict = _section(dom.stdout, "verdict")
    sentence = re.search(r'<p class="sentence">(.*?)</p>', verdict, flags=re.S)
    assert sentence and html.unescape(sentence.group(1)) == summary["verdict_sentence"]
    counted = re.search(r"(\d+) of (\d+) client updates", summary["verdict_sentence"])
    assert counted and (int(counted.group(1)), int(counted.group(2))) == (
        summary["verdict_counts"]["exact"],
        summary["attacks"],
    )
    assert "by the server's own check" in summary["verdict_sentence"]
    assert "Scores are unavailable" in verdict
    recommendation = _section(dom.stdout, "recommendations")
    assert "no further defense" not in recommendation
    assert html.escape(summary["recommendations"]["message"], quote=False) in recommendation
    verdicts = _section(dom.stdout, "verdicts")
    for advice in summary["verdict_advice"].values():
        assert html.escape(advice, quote=False) in verdicts
    assert "a larger time budget is unlikely to settle these" in verdicts
    count, broken, rendered = _images_in_browser(user_report, tmp_path)
    assert count == user_report.read_text(encoding="utf-8").count("<img ") and count >= 1
    assert broken == 0 and rendered == count


def test_broken_image_is_detected_by_the_browser_check(tmp_path: Path) -> None:
    """The check can fail: an external (blocked) image counts as broken."""
    buffer = io.BytesIO()
    Image.new("RGB", (3, 3), (200, 10, 10)).save(buffer, format="PNG")
    good = base64.b64encode(buffer.getvalue()).decode()
    page = tmp_path / "page.html"
    page.write_text(
        '<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
        "content=\"default-src 'none'; img-src data:; script-src 'unsafe-inline'\"></head><body>"
        f'<img src="data:image/png;base64,{good}"><img src="missing.png">' + CHECK_SCRIPT + "</body></html>",
        encoding="utf-8",
    )
    result = _chromium(page, tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom")
    assert "IMAGES=2 BROKEN=1" in result.stdout, result.stderr[-2000:]
