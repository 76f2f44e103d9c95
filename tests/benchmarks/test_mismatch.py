"""benchmarks/mismatch.py: the mismatch statistics on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def mismatch():
    yield load_bench("mismatch")


def test_mismatch_stats_hand_computed(mismatch):
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    learner = torch.tensor([[-1.0, -1.5, -3.2], [-0.5, -0.2, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # the 5.0 - 0.0 at the masked position counts nowhere
    got = mismatch.mismatch_stats(rollout, learner, mask)
    # d = learner - rollout on the 5 valid tokens: 0, 0.5, -0.2, 0, 0.3; k3 = exp(d) - d - 1 per token:
    # 0, e^0.5 - 1.5 = 0.1487212707, e^-0.2 - 0.8 = 0.0187307531, 0, e^0.3 - 1.3 = 0.0498588076; mean over 5
    k3 = (math.exp(0.5) - 1.5 + math.exp(-0.2) - 0.8 + math.exp(0.3) - 1.3) / 5
    assert got["tokens"] == 5
    assert got["k3_kl"] == pytest.approx(k3, rel=1e-6)  # 0.0434621663
    assert got["k3_kl_float32"] == pytest.approx(k3, rel=1e-5)  # float32 arithmetic is enough at these gaps
    assert got["mean_abs_diff"] == pytest.approx(1.0 / 5, rel=1e-6)  # (0.5 + 0.2 + 0.3) / 5
    assert got["max_abs_diff"] == pytest.approx(0.5, rel=1e-6)
    # sorted |d|: 0, 0, 0.2, 0.3, 0.5; the 0.99 quantile sits at 3.96 of 0..4: 0.3 + 0.96 * 0.2
    assert got["p99_abs_diff"] == pytest.approx(0.492, rel=1e-6)
    assert got["frac_abs_diff_gt_0.1"] == pytest.approx(3 / 5)
    assert got["frac_truncated"] == 0.0  # no ratio above 2 (d > ln 2 = 0.693)
    assert mismatch.mismatch_stats(rollout, learner, mask, ratio_max=1.5)["frac_truncated"] == pytest.approx(1 / 5)


def test_mismatch_stats_keep_float32_inputs_tiny_gaps(mismatch):
    """A float32 gap of 2^-20 nats (what float32 kernels leave) gives k3 = d^2 / 2 to 1e-6, where float32 arithmetic
    would round exp(d) - d - 1 to 0 or to noise of ~6e-8: the statistics run in float64."""
    rollout = torch.full((2, 4), -1.0)
    learner = rollout + 2.0**-20  # exactly representable in float32 near -1
    got = mismatch.mismatch_stats(rollout, learner, torch.ones(2, 4, dtype=torch.bool))
    d = 2.0**-20
    assert got["k3_kl"] == pytest.approx(math.expm1(d) - d, rel=1e-6)  # ~4.547e-13
    assert got["mean_abs_diff"] == pytest.approx(d, rel=1e-9)


def test_mismatch_stats_reject_bad_input(mismatch):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shapes"):
        mismatch.mismatch_stats(x, torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no valid token"):
        mismatch.mismatch_stats(x, x, torch.zeros(2, 3, dtype=torch.bool))
