"""Learner tests run tiny models on one intra-op thread (see tests/algos/conftest.py: OpenMP spin-waits on a busy
2-core machine make 2 threads many times slower for tensors this small)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Runs each test on one intra-op thread and restores the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
