"""The offline objectives as the learner composes them (rlray.learner.preference), on hand-computed values.

The micro-batch holds P=2 pairs as 4 rows, the chosen responses first; T=3 response tokens. Masked
positions hold values that would change every result if they were read (100.0).
"""

import dataclasses
import math

import pytest
import torch

from rlray.learner.preference import PAIR_OBJECTIVES, PairNormaliser, PreferenceSpec
from rlray.schema import PairBatch
from tests.learner.batches import pair_batch

LOGPROBS = torch.tensor(
    [
        [-1.0, -2.0, 100.0],  # chosen 0: 2 tokens, sum -3, mean -1.5
        [-0.5, -0.5, -0.5],  # chosen 1: 3 tokens, sum -1.5, mean -0.5
        [-0.1, 100.0, 100.0],  # rejected 0: 1 token, mean -0.1
        [-4.0, -4.0, -4.0],  # rejected 1: 3 tokens, mean -4.0
    ]
)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)


def _mb(rows: list[int]) -> tuple[torch.Tensor, PairBatch]:
    return LOGPROBS[rows], pair_batch(MASK[rows])


def test_sft_is_the_token_mean_nll_of_the_chosen_responses():
    # chosen NLL sum = 3 + 1.5 = 4.5 over 2 + 3 = 5 chosen tokens -> 0.9; rejected rows never enter the loss.
    lp, mb = _mb([0, 1, 2, 3])
    loss, stats = PAIR_OBJECTIVES["sft"](lp, mb, PreferenceSpec(), PairNormaliser(num_pairs=2, num_chosen_tokens=5))
    assert loss.item() == pytest.approx(0.9, abs=1e-6)
    # accuracy on mean token logprobs: -1.5 > -0.1 no, -0.5 > -4.0 yes; margins (-1.4) + (3.5) = 2.1
    assert stats["correct"].item() == 1.0 and stats["pairs"].item() == 2.0
    assert (stats["chosen_reward_sum"] - stats["rejected_reward_sum"]).item() == pytest.approx(2.1, abs=1e-6)


def test_sft_shares_over_micro_batches_and_ranks_sum_to_the_step_loss():
    # Each micro-batch divides by the step's global token count; DDP averages over ranks, so a share is
    # scaled by world_size: two ranks holding one pair each average to the one-rank loss 0.9.
    whole = PairNormaliser(num_pairs=2, num_chosen_tokens=5, world_size=2)
    share_0, _ = PAIR_OBJECTIVES["sft"](*_mb([0, 2]), PreferenceSpec(), whole)
    share_1, _ = PAIR_OBJECTIVES["sft"](*_mb([1, 3]), PreferenceSpec(), whole)
    assert share_0.item() == pytest.approx(3.0 / 5 * 2, abs=1e-6)
    assert ((share_0 + share_1) / 2).item() == pytest.approx(0.9, abs=1e-6)


def test_sft_gradient_reaches_only_chosen_valid_tokens():
    lp = LOGPROBS.clone().requires_grad_(True)
    loss, _ = PAIR_OBJECTIVES["sft"](lp, pair_batch(MASK), PreferenceSpec(), PairNormaliser(2, 5))
    loss.backward()
    expected = torch.zeros(4, 3)
    expected[:2] = -MASK[:2].float() / 5  # d(-sum/5)/d logprob on each chosen valid token
    torch.testing.assert_close(lp.grad, expected, atol=1e-7, rtol=0)


def test_orpo_full_loss_is_nll_plus_the_mean_odds_ratio_term():
    # Hong et al. 2024 eqs. 4, 6-7: L = NLL(chosen, token-mean) + lambda * mean(-log sigmoid(log OR)),
    # log odds(y) = m - log(1 - e^m) with m the mean token logprob.
    beta = 0.25

    def log_odds(m: float) -> float:
        return m - math.log1p(-math.exp(m))

    odds_terms = [
        -beta * math.log(1 / (1 + math.exp(-(log_odds(c) - log_odds(r))))) for c, r in [(-1.5, -0.1), (-0.5, -4.0)]
    ]
    expected = 0.9 + sum(odds_terms) / 2
    loss, stats = PAIR_OBJECTIVES["orpo"](*_mb([0, 1, 2, 3]), PreferenceSpec(beta=beta), PairNormaliser(2, 5))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["chosen_reward_sum"].item() == pytest.approx(beta * (-1.5 - 0.5), abs=1e-6)


@pytest.mark.parametrize("dpo_loss", ["hinge", "robust"])
def test_dpo_variants_are_dispatched_through_the_learner_objective(dpo_loss):
    # Sequence log ratios: chosen (-3 - -2.5) = -0.5 and (-1.5 - -2) = 0.5; rejected (-0.1 - -1) = 0.9 and
    # (-12 - -11) = -1. With beta 0.5: z = beta * (chosen ratio - rejected ratio) = -0.7 and 0.75.
    lp, mb = _mb([0, 1, 2, 3])
    mb = dataclasses.replace(mb, ref_chosen_logps=torch.tensor([-2.5, -2.0]), ref_rejected_logps=torch.tensor([-1.0, -11.0]))
    spec = PreferenceSpec(beta=0.5, dpo_loss=dpo_loss, label_smoothing=0.2)
    loss, stats = PAIR_OBJECTIVES["dpo"](lp, mb, spec, PairNormaliser(num_pairs=2, num_chosen_tokens=5))
    z = [-0.7, 0.75]
    if dpo_loss == "hinge":  # SLiC hinge: relu(1 - z) -> 1.7 and 0.25
        per_pair = [max(0.0, 1 - v) for v in z]
    else:  # rDPO (Chowdhury et al. 2024 eq. 7): (-(1-e) log s(z) + e log s(-z)) / (1 - 2e)
        eps = 0.2
        ls = lambda v: -math.log1p(math.exp(-v))  # noqa: E731 - log sigmoid
        per_pair = [(-(1 - eps) * ls(v) + eps * ls(-v)) / (1 - 2 * eps) for v in z]
    assert loss.item() == pytest.approx(sum(per_pair) / 2, abs=1e-6)
    assert stats["correct"].item() == 1.0  # implicit rewards beta*ratio: -0.25 < 0.45; 0.25 > -0.5
