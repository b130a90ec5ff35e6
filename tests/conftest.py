"""Shared test setup."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    """The suite runs on two CPU cores, often beside other jobs: keep torch on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
