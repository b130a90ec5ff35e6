"""The README's library example runs as written, and its two first commands stay true."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_library_example_recovers_the_batch() -> None:
    text = README.read_text()
    section = text[text.index("## The attack library") :]
    example = _python_blocks(section)[0]
    assert "SpearPlusPlus" in example and "weight_grad" in example
    exec(compile(example, "README.md", "exec"), {})  # the block ends with an assert on the recovery


def test_readme_starts_with_the_install_and_test_commands() -> None:
    first_block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in first_block.splitlines() if line.strip()]
    assert lines[0].startswith('python3 -m pip install -e ".[test]" && fl-attack-audit')
    assert lines[1].startswith("python3 -m pytest -q")
