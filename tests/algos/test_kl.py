"""KL estimators k1, k2, k3: hand-computed values, Monte-Carlo unbiasedness, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlray.algos import KL_ESTIMATORS, LOG_RATIO_BOUND, kl_penalty

ATOL = 1e-6


def test_kl_hand_computed():
    # d = logprobs - ref = [0.5, -1.0]
    # k1 = d; k2 = d^2 / 2 = [0.125, 0.5]; k3 = exp(-d) - 1 + d = [e^-0.5 - 0.5, e^1 - 2] = [0.1065307, 0.7182818]
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    expected = {
        "k1": [[0.5, -1.0]],
        "k2": [[0.125, 0.5]],
        "k3": [[math.exp(-0.5) - 0.5, math.e - 2.0]],
    }
    for name, value in expected.items():
        torch.testing.assert_close(kl_penalty(logprobs, ref, name), torch.tensor(value), atol=ATOL, rtol=0)


def test_k3_is_trl_formula(gen):
    # TRL 1.16 GRPOTrainer._compute_loss (grpo_trainer.py lines 3100-3101):
    # exp(ref - logp) - (ref - logp) - 1
    logp, ref = -torch.rand(4, 6, generator=gen) * 3, -torch.rand(4, 6, generator=gen) * 3
    trl = torch.exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), trl, atol=ATOL, rtol=0)


def test_k1_and_k3_are_unbiased_and_k2_k3_nonnegative(gen):
    # Sample 400k tokens from p = softmax(a); E_p[k1] = E_p[k3] = KL(p || q) exactly; k2, k3 >= 0 pointwise.
    p_logits, q_logits = torch.tensor([1.0, 0.2, -0.5, 0.0, 0.7]), torch.tensor([0.3, 0.9, -0.1, 0.4, -0.6])
    logp_all, logq_all = torch.log_softmax(p_logits, 0), torch.log_softmax(q_logits, 0)
    true_kl = float((logp_all.exp() * (logp_all - logq_all)).sum())  # 0.2987 nats
    tokens = torch.multinomial(logp_all.exp(), 400_000, replacement=True, generator=gen)
    logp, logq = logp_all[tokens][None], logq_all[tokens][None]
    for name in ("k1", "k3"):
        est = kl_penalty(logp, logq, name)
        stderr = float(est.std() / math.sqrt(est.numel()))
        assert abs(float(est.mean()) - true_kl) < 4 * stderr, (name, float(est.mean()), true_kl)
    for name in ("k2", "k3"):
        assert (kl_penalty(logp, logq, name) >= 0).all()
    assert KL_ESTIMATORS == ("k1", "k2", "k3")


def test_kl_errors():
    with pytest.raises(ValueError, match="unknown estimator 'k4'"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")
    with pytest.raises(ValueError, match="differ"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3), "k1")


FP32_MAX = float(torch.finfo(torch.float32).max)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    log_ratio=st.one_of(st.sampled_from([20.0, -20.0, 88.8, -88.8, -104.0, 2e19, -2e19, FP32_MAX, -FP32_MAX]),
                        st.floats(-FP32_MAX, FP32_MAX, width=32)),  # fmt: skip
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    estimator=st.sampled_from(KL_ESTIMATORS),
)
def test_kl_is_finite_with_a_finite_gradient_for_any_log_ratio(log_ratio, dtype, estimator):
    # k3's exp(-d) overflows fp32 below -88.7 nats and k2's d**2 past 1.8e19: both clamp d to +-20 nats first
    lp = torch.full((1, 1), -1.0, dtype=dtype, requires_grad=True)
    ref = (torch.full((1, 1), -1.0, dtype=torch.float64) - log_ratio).to(dtype)
    if not torch.isfinite(ref).all():  # beyond bfloat16's range
        return
    kl = kl_penalty(lp, ref, estimator)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all(), (kl, lp.grad)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(d=st.floats(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
def test_kl_inside_the_bound_is_the_unclamped_formula(d):
    # float64, d = logprobs - ref within +-20 nats: exactly Schulman's k1, k2, k3 (TRL's k3), no clamping visible
    lp, ref = torch.zeros(1, 1, dtype=torch.float64), torch.full((1, 1), -d, dtype=torch.float64)
    diff = lp - ref
    assert torch.equal(kl_penalty(lp, ref, "k1"), diff)
    assert torch.equal(kl_penalty(lp, ref, "k2"), 0.5 * diff.square())
    assert torch.equal(kl_penalty(lp, ref, "k3"), torch.exp(-diff) + diff - 1.0)
