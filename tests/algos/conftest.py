"""Shared helpers for the rlray.algos tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Runs each test on one intra-op thread and restores the setting afterwards.

    These tensors are tiny: with 2 threads on a busy 2-core machine, OpenMP spin-waits made the learning
    tests ~50x slower (110 s instead of 2 s).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator, so every test draws the same random tensors."""
    return torch.Generator().manual_seed(1234)


def _ragged_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


@pytest.fixture
def ragged_mask():
    """Returns f(lengths, width) -> [B, width] bool mask with the first lengths[b] positions True."""
    return _ragged_mask
