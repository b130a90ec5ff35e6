"""The DP gap analysis's own pieces (experiments.dp_gap): the subspace ceiling and its options."""

from __future__ import annotations

import pytest
import torch

from experiments.dp_gap import main, subspace_ceiling


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
