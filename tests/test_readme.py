"""The README's library example runs as written, its first commands and headline table stay true,
and the documentation site's generated parts come from the project's own files."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def _docs_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generated", ROOT / "docs" / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_library_example_recovers_the_batch() -> None:
    text = README.read_text()
    section = text[text.index("## The attack library") :]
    example = _python_blocks(section)[0]
    assert "SpearPlusPlus" in example and "weight_grad" in example
    exec(compile(example, "README.md", "exec"), {})  # the block ends with an assert on the recovery


def _first_commands() -> list[str]:
    first_block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in first_block.splitlines() if line.strip()]


def test_readme_starts_with_the_install_and_test_commands() -> None:
    lines = _first_commands()
    assert lines[0].startswith('python3 -m pip install -e ".[test]" && fl-attack-audit')
    assert lines[1].startswith("python3 -m pytest -q")


def test_ci_runs_the_readmes_test_command_and_then_the_slow_tier() -> None:
    """The README's command is the fast tier; CI runs it as written, then the rest (``-m slow``)."""
    command = _first_commands()[1].split("#", 1)[0].strip()
    assert command == 'python3 -m pytest -q -m "not slow"'
    ci = [line.split("python3 ", 1)[-1] for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    fast, slow = ci.index(command.removeprefix("python3 ")), ci.index("-m pytest -q -m slow")
    assert fast < slow
    with open(ROOT / "pyproject.toml", "rb") as handle:
        markers = tomllib.load(handle)["tool"]["pytest"]["ini_options"]["markers"]
    assert [marker.split(":", 1)[0] for marker in markers] == ["slow"]


def test_readme_stays_short_and_its_links_exist() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for path in ("experiments/README.md", "examples/README.md", "docs/"):
        assert (ROOT / path).exists(), path
        assert f"`{path}`" in text, path
    assert (ROOT / "mkdocs.yml").is_file() and (ROOT / "docs" / "index.md").is_file()


def test_readme_headline_table_is_the_one_built_from_the_result_files() -> None:
    text = README.read_text()
    start = text.index("<!-- headline table: python docs/hooks/generated.py headline -->\n")
    end = text.index("<!-- end of headline table -->")
    table = text[start:end].split("\n", 1)[1]
    assert table == _docs_hook().headline_markdown(), "rerun: python docs/hooks/generated.py headline"


def test_every_paper_table_has_a_headline_row() -> None:
    papers = {row["paper"].split(" (")[0] for row in _docs_hook().headline_rows()}
    for table in ("SPEAR++ Tab. 1", "SPEAR++ Tab. 3", "SPEAR++ Tab. 4", "SPEAR Tab. 1", "SPEAR Tab. 2"):
        assert table in papers
    for table in ("SPEAR Tab. 3", "SPEAR Tab. 4", "SPEAR Tab. 9", "SPEAR Tab. 10", "SPEAR Tab. 11"):
        assert table in papers


def test_generated_blocks_fail_on_a_missing_result_or_an_unknown_block() -> None:
    hook = _docs_hook()
    with pytest.raises(hook.GeneratedError, match="no_such_table.md does not exist"):
        hook.render("<!-- generated: result no_such_table -->")
    with pytest.raises(hook.GeneratedError, match="unknown generated block"):
        hook.render("<!-- generated: everything -->")
    with pytest.raises(hook.GeneratedError, match="0 rows of experiments/results/table1_m200 match"):
        hook.pooled_row(["table1_m200"], {"b": 7})


def test_settings_page_lists_every_run_config_key() -> None:
    from strategies.run_config import SETTINGS

    page = _docs_hook().render("<!-- generated: settings -->")
    for setting in SETTINGS:
        assert f"| `{setting.key}` |" in page


def test_docs_markers_name_existing_result_files() -> None:
    hook = _docs_hook()
    for page in (ROOT / "docs").rglob("*.md"):
        for found in hook.MARKER.finditer(page.read_text()):
            if found.group("what") == "result":
                assert (hook.RESULTS / f"{found.group('argument')}.md").is_file(), (page, found.group(0))
