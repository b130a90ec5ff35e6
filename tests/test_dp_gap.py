"""The DP gap analysis's own pieces (experiments.dp_gap): the subspace ceiling and its options."""

from __future__ import annotations

import pytest
import torch

from experiments.config import Cell, Setting
from experiments.dp_gap import (
    BLEND_COSINE,
    batch_gap,
    direction_census,
    implied_column_cosines,
    main,
    subspace_ceiling,
)
from experiments.runner import load_data
from fl_attack.data.images import ImageData
from fl_attack.pipeline.spectrum.decompose import decompose


def test_subspace_ceiling_recovers_a_clean_batch_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(5, 30, generator=generator, dtype=torch.float64)
    columns = torch.randn(5, 60, generator=generator, dtype=torch.float64)
    columns = columns * (torch.rand(5, 60, generator=generator, dtype=torch.float64) > 0.5)
    recovered = subspace_ceiling(
        columns=columns, weight_grad=columns.T @ inputs, bias_grad=columns.sum(dim=0)
    )
    torch.testing.assert_close(recovered, inputs, rtol=0, atol=1e-9)


def test_subspace_ceiling_keeps_the_scale_the_bias_gradient_gives() -> None:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4, 20, generator=generator, dtype=torch.float64)
    columns = torch.randn(4, 50, generator=generator, dtype=torch.float64)
    # a bias gradient twice the true one doubles every column's scale and halves every input
    recovered = subspace_ceiling(
        columns=columns, weight_grad=columns.T @ inputs, bias_grad=2 * columns.sum(dim=0)
    )
    torch.testing.assert_close(recovered, inputs / 2, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cell", "20x200,150x4000"], "--cell must be exactly one cell"),
        (["--cell", "fourbythree"], "--cell:"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--noise-factor", "0"], "--noise-factor must be positive, got 0.0"),
    ],
)
def test_bad_options_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def _sparse_batch(seed: int, b: int = 6, n: int = 40, m: int = 80) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(b, n, generator=generator, dtype=torch.float64)
    columns = torch.randn(b, m, generator=generator, dtype=torch.float64)
    columns = columns * (torch.rand(b, m, generator=generator, dtype=torch.float64) > 0.5)
    return inputs, columns


def test_exact_rows_imply_the_true_columns() -> None:
    inputs, columns = _sparse_batch(2)
    grad = columns.T @ inputs
    left = decompose(grad, batch_size=inputs.shape[0]).left
    cosines = implied_column_cosines(inputs=inputs, columns=columns, weight_grad=grad, left=left)
    torch.testing.assert_close(cosines, torch.ones_like(cosines), rtol=0, atol=1e-9)
    # a rescaled row implies a rescaled column: the cosine does not see the scale
    rescaled = inputs.clone()
    rescaled[1] *= 3.0
    cosines = implied_column_cosines(inputs=rescaled, columns=columns, weight_grad=grad, left=left)
    torch.testing.assert_close(cosines, torch.ones_like(cosines), rtol=0, atol=1e-9)


def test_a_blended_direction_is_counted_as_a_blend_and_an_unclaimed_row_as_missing() -> None:
    inputs, columns = _sparse_batch(3)
    grad = columns.T @ inputs
    left = decompose(grad, batch_size=inputs.shape[0]).left
    # the attack's direction for sample 0 mixes in sample 1; the rows follow from it by least squares
    found = columns.clone()
    found[0] = columns[0] + 0.8 * columns[1]
    blended = torch.linalg.lstsq(found.T, grad).solution
    cosines = implied_column_cosines(inputs=blended, columns=columns, weight_grad=grad, left=left)
    assert float(cosines[0]) < BLEND_COSINE
    claimed = torch.tensor([True, True, True, True, True, False])
    census = direction_census(cosines, claimed)
    assert census["missing"] == 1.0
    assert census["blends"] == 1.0
    unblended = direction_census(
        implied_column_cosines(inputs=inputs, columns=columns, weight_grad=grad, left=left), claimed
    )
    assert unblended == {"missing": 1.0, "blends": 0.0, "column_cos": pytest.approx(1.0, abs=1e-9)}


def test_one_true_column_per_row_is_required() -> None:
    inputs, columns = _sparse_batch(4)
    grad = columns.T @ inputs
    left = decompose(grad, batch_size=inputs.shape[0]).left
    with pytest.raises(ValueError, match="one true column per row: 6 rows, 5 columns"):
        implied_column_cosines(inputs=inputs, columns=columns[:5], weight_grad=grad, left=left)


def test_a_whole_batch_is_scored_on_bundled_digits() -> None:
    cell = Cell(5, 100)
    setting = Setting("dp", cell, ("l1",), 1, dataset="digits")
    data = load_data([setting])[setting.data_key]
    assert isinstance(data, ImageData)
    row = batch_gap(0, factor=0.05, budget=20.0, data=data, cell=cell)
    # light noise on a small batch: every direction is found, none of them a blend
    assert (row["missing"], row["blends"]) == (0.0, 0.0)
    assert row["column_cos"] > 0.99
    assert row["ours"] > 40.0 and row["rows_above"] == 5.0
    assert row["oracle"] > row["ours"]
