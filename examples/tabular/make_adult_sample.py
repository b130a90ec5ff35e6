"""Write ``tabular_example/adult_sample.json``: 600 random complete rows of UCI Adult's ``adult.data``.

Run once with the UCI files present (``fl-attack-data fetch adult``)::

    python make_adult_sample.py [--root DIR]

UCI Adult (Becker & Kohavi, 1996) is licensed CC BY 4.0; the sample keeps its attribution.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from fl_attack.data.adult import ADULT_FEATURES, MISSING
from fl_attack.data.locate import locate_dataset

ROWS = 600
SEED = 0
TARGET = Path(__file__).parent / "tabular_example" / "adult_sample.json"


def read_rows(path: Path) -> list[list[str | int]]:
    """Complete rows of a UCI Adult file: 14 features (numbers as int) and the income label."""
    continuous = [categories is None for _, categories in ADULT_FEATURES]
    rows: list[list[str | int]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != len(ADULT_FEATURES) + 1 or MISSING in fields:
            continue
        values: list[str | int] = [
            int(v) if number else v for v, number in zip(fields, continuous, strict=False)
        ]
        rows.append([*values, fields[-1].rstrip(".")])
    return rows


def main() -> None:
    """Draw the sample and write it with its provenance."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default=None, help="data root holding adult/adult.data")
    directory = locate_dataset("adult", root=parser.parse_args().root)
    rows = read_rows(directory / "adult.data")
    chosen = np.random.default_rng(SEED).choice(len(rows), size=ROWS, replace=False)
    document = {
        "source": "UCI Adult (Census Income), adult.data; Becker, B. & Kohavi, R. (1996), "
        "https://doi.org/10.24432/C5XW20",
        "license": "CC BY 4.0",
        "sample": f"{ROWS} rows drawn at random (numpy seed {SEED}) from the rows without missing values",
        "features": [name for name, _ in ADULT_FEATURES],
        "label": "income",
        "rows": [rows[int(index)] for index in sorted(chosen)],
    }
    TARGET.write_text(json.dumps(document, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {ROWS} rows to {TARGET}")


if __name__ == "__main__":
    main()
