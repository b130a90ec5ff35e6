"""The supported Flower versions: declared once, checked when the Flower-facing packages are imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flwr
import pytest
import tomllib

from strategies.flower_version import SUPPORTED_FLOWER, UnsupportedFlowerError, check_flower_version

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_checked_range() -> None:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    assert f"flwr[simulation]{SUPPORTED_FLOWER}" in dependencies


def test_the_installed_flower_is_supported() -> None:
    assert check_flower_version() == flwr.__version__


@pytest.mark.skipif("FL_ATTACK_EXPECT_FLOWER" not in os.environ, reason="CI names the Flower it installed")
def test_ci_runs_the_flower_it_installed() -> None:
    assert flwr.__version__ == os.environ["FL_ATTACK_EXPECT_FLOWER"], flwr.__file__


@pytest.mark.parametrize("version", ["1.41.0", "1.42.0", "1.99.3"])
def test_versions_in_the_range_pass(version: str) -> None:
    assert check_flower_version(version) == version


@pytest.mark.parametrize("version", ["1.40.2", "2.0.0", "1.28.0", "not-a-version"])
def test_versions_outside_the_range_name_it_in_one_line(version: str) -> None:
    with pytest.raises(UnsupportedFlowerError) as raised:
        check_flower_version(version)
    assert str(raised.value) == (
        f"fl-attack supports flwr>=1.41,<2, but flwr {version} is installed: "
        'pip install "flwr[simulation]>=1.41,<2"'
    )


@pytest.mark.parametrize("package", ["strategies", "clients"])
def test_importing_with_an_old_flower_fails_with_that_line(tmp_path: Path, package: str) -> None:
    fake = tmp_path / "flwr"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "1.40.0"\n', encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    completed = subprocess.run(
        [sys.executable, "-c", f"import {package}"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1] == (
        "strategies.flower_version.UnsupportedFlowerError: fl-attack supports flwr>=1.41,<2, "
        'but flwr 1.40.0 is installed: pip install "flwr[simulation]>=1.41,<2"'
    )
