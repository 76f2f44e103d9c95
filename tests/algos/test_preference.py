"""Preference losses: hand-computed values and errors. (TRL cross-checks: test_trl_reference.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from rlray.algos import (
    PAIRWISE_LOSSES,
    bradley_terry_loss,
    dpo_hinge_loss,
    dpo_sigmoid_loss,
    ipo_loss,
    kto_kl_estimate,
    kto_loss,
    orpo_odds_ratio_loss,
    robust_dpo_loss,
    sequence_logps,
    simpo_loss,
)

ATOL = 1e-6


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=0.0)


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


# pair 0: log-ratios chosen -10 - (-11) = 1, rejected -12 - (-11) = -1 -> margin 2; pair 1: margin 0
CHOSEN, REJECTED = torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -6.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-11.0, -5.0]), torch.tensor([-11.0, -6.0])
PAIRS = (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)


def test_dpo_sigmoid_hand_computed():
    # beta 0.5: -log sigmoid(0.5 * 2) = log(1 + e^-1) = 0.3132617; margin 0 -> log 2
    close(dpo_sigmoid_loss(*PAIRS, beta=0.5), [softplus(-1.0), math.log(2.0)])


def test_dpo_hinge_hand_computed():
    # relu(1 - 0.5 * 2) = 0; relu(1 - 0) = 1
    close(dpo_hinge_loss(*PAIRS, beta=0.5), [0.0, 1.0])


def test_ipo_hand_computed():
    # beta 0.25 -> target 1 / (2 * 0.25) = 2: (2 - 2)^2 = 0, (0 - 2)^2 = 4
    close(ipo_loss(*PAIRS, beta=0.25), [0.0, 4.0])
    # per-token form, lengths chosen [2, 1], rejected [1, 1]: pair 0 margin 1/2 - (-1)/1 = 1.5 -> (1.5 - 2)^2 = 0.25
    out = ipo_loss(*PAIRS, beta=0.25, chosen_num_tokens=torch.tensor([2, 1]), rejected_num_tokens=torch.tensor([1, 1]))
    close(out, [0.25, 4.0])


def test_robust_dpo_hand_computed():
    # e = 0.1, beta 0.5, margin 2: (0.9 * softplus(-1) - 0.1 * softplus(1)) / 0.8 = 0.1882616
    expected0 = (0.9 * softplus(-1.0) - 0.1 * softplus(1.0)) / 0.8
    # margin 0: (0.9 - 0.1) * log 2 / 0.8 = log 2
    close(robust_dpo_loss(*PAIRS, beta=0.5, label_smoothing=0.1), [expected0, math.log(2.0)])
    close(robust_dpo_loss(*PAIRS, beta=0.5), dpo_sigmoid_loss(*PAIRS, beta=0.5))


def test_pairwise_dict_shares_one_signature():
    for name, fn in PAIRWISE_LOSSES.items():
        out = fn(*PAIRS, beta=0.5)
        assert out.shape == (2,) and torch.isfinite(out).all(), name


def test_kto_hand_computed():
    # beta 0.5, z = 0.2. desirable r = 1: 1 - sigmoid(0.5 * 0.8) = 0.4013123
    # undesirable r = -1, weight 2: 2 * (1 - sigmoid(0.5 * 1.2)) = 0.7086874
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    out = kto_loss(
        torch.tensor([-4.0, -6.0]),
        torch.tensor([-5.0, -5.0]),
        torch.tensor([True, False]),
        torch.tensor(0.2),
        beta=0.5,
        undesirable_weight=2.0,
    )
    close(out, [1 - sig(0.4), 2 * (1 - sig(0.6))])


def test_kto_kl_estimate_hand_computed():
    # mean(0.5, -1.5) = -0.5 -> clamped to 0; mean(1, 0.2) = 0.6
    close(kto_kl_estimate(torch.tensor([0.5, -1.5]), torch.zeros(2)), 0.0)
    close(kto_kl_estimate(torch.tensor([1.0, 0.2]), torch.zeros(2)), 0.6)


def test_orpo_hand_computed():
    # p_chosen 0.5 -> log odds 0; p_rejected 0.2 -> log(0.2 / 0.8) = -log 4; sigmoid(log 4) = 0.8
    # beta 0.1: -0.1 * log 0.8 = 0.0223144
    out = orpo_odds_ratio_loss(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)]), beta=0.1)
    close(out, [-0.1 * math.log(0.8)])


def test_simpo_hand_computed():
    # beta 2, gamma 0.5: 2 * (-0.5 - (-1.0)) - 0.5 = 0.5 -> log(1 + e^-0.5) = 0.4740770
    close(simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), beta=2.0, gamma=0.5), [softplus(-0.5)])


def test_bradley_terry_hand_computed():
    # r_c 2, r_r 1: log(1 + e^-1) = 0.3132617; centering 0.01 * (2 + 1)^2 = 0.09; margin 0.5 -> log(1 + e^-0.5)
    c, r = torch.tensor([2.0]), torch.tensor([1.0])
    close(bradley_terry_loss(c, r), [softplus(-1.0)])
    close(bradley_terry_loss(c, r, center_coef=0.01), [softplus(-1.0) + 0.09])
    close(bradley_terry_loss(c, r, margin=torch.tensor([0.5])), [softplus(-0.5)])


def test_sequence_logps_hand_computed():
    # sum over valid tokens -1 - 2 = -3 (the padded 50 is ignored); average over 2 tokens = -1.5; empty row -> 0
    lp = torch.tensor([[-1.0, -2.0, 50.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    close(sequence_logps(lp, mask), [-3.0, 0.0])
    close(sequence_logps(lp, mask, average=True), [-1.5, 0.0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: dpo_sigmoid_loss(CHOSEN, REJECTED[:1], REF_CHOSEN, REF_REJECTED, beta=0.1), "one shape"),
        (lambda: dpo_sigmoid_loss(*PAIRS, beta=0.0), "beta"),
        (lambda: robust_dpo_loss(*PAIRS, beta=0.1, label_smoothing=0.5), "label_smoothing"),
        (lambda: ipo_loss(*PAIRS, beta=0.1, chosen_num_tokens=torch.ones(2)), "both"),
        (lambda: kto_loss(CHOSEN, REF_CHOSEN, torch.ones(2), 0.0, beta=0.1), "bool"),
        (lambda: orpo_odds_ratio_loss(torch.tensor([0.0]), torch.tensor([-1.0]), beta=0.1), "< 0"),
        (lambda: bradley_terry_loss(CHOSEN, REJECTED, center_coef=-1.0), "center_coef"),
        (lambda: sequence_logps(torch.zeros(2, 3), torch.ones(2, 3)), "bool"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
