"""DAPO dynamic sampling and overlong shaping: hand-computed cases and the refill limit."""

from __future__ import annotations

import pytest
import torch

from rlray.algos import DynamicSamplingError, dynamic_sampling_shortfall, groups_with_spread, overlong_penalty


def test_groups_with_spread_hand_computed():
    # group 5 (rows 0, 1, 7): [1, 0, 0] spread 1 -> keep; group 9: all right -> drop; group 2: all wrong -> drop;
    # group 4: a single sample -> drop
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([5, 5, 9, 9, 2, 2, 4, 5])
    keep = groups_with_spread(acc, groups)
    assert keep.tolist() == [True, True, False, False, False, False, False, True]


def test_groups_with_spread_ignores_invalid_rows():
    # group 0 = [1, 0, 1]; without its 0 (invalid) the group is constant -> dropped entirely
    acc = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.25])
    groups = torch.tensor([0, 0, 0, 1, 1])
    valid = torch.tensor([True, False, True, True, True])
    assert groups_with_spread(acc, groups, valid_mask=valid).tolist() == [False, False, False, True, True]
    # a threshold: spread 0.25 is not > 0.3
    assert groups_with_spread(acc, groups, min_spread=0.3).tolist() == [True, True, True, False, False]


def test_groups_with_spread_is_permutation_equivariant(gen):
    acc = torch.randint(0, 2, (24,), generator=gen).float()
    groups = torch.arange(24) // 4
    perm = torch.randperm(24, generator=gen)
    assert torch.equal(groups_with_spread(acc[perm], groups[perm]), groups_with_spread(acc, groups)[perm])


def test_shortfall_counts_and_limit():
    # 3 of 4 groups after round 1 of 3 -> 1 missing; full -> 0 even at the limit
    assert dynamic_sampling_shortfall(3, 4, rounds_done=1, max_rounds=3) == 1
    assert dynamic_sampling_shortfall(6, 4, rounds_done=3, max_rounds=3) == 0
    with pytest.raises(DynamicSamplingError, match=r"after 3 rollout round\(s\) \(max_rounds=3\) only 3/4"):
        dynamic_sampling_shortfall(3, 4, rounds_done=3, max_rounds=3)
    with pytest.raises(ValueError, match="max_rounds"):
        dynamic_sampling_shortfall(0, 4, rounds_done=0, max_rounds=0)


def test_refill_loop_drives_to_target(gen):
    # The loop in dapo.py's docstring: keep drawing batches of 4 groups until 6 informative groups are kept.
    kept, rounds = 0, 0
    while missing := dynamic_sampling_shortfall(kept, 6, rounds_done=rounds, max_rounds=10):
        acc = (torch.rand(16, generator=gen) < 0.3).float()
        groups = torch.arange(16) // 4
        rounds += 1
        kept += int(torch.unique(groups[groups_with_spread(acc, groups)]).numel())
        assert missing > 0
    assert kept >= 6 and rounds <= 10


def test_overlong_penalty_hand_computed():
    # L_max 10, L_cache 4 -> L_exp 6: lengths 5, 6 -> 0; 8 -> (6 - 8) / 4 = -0.5; 10 -> -1; 12 -> -1
    lengths = torch.tensor([5, 6, 8, 10, 12])
    expected = torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_response_tokens=10, cache_tokens=4), expected)
    torch.testing.assert_close(
        overlong_penalty(lengths, max_response_tokens=10, cache_tokens=4, penalty_factor=0.5), 0.5 * expected
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_response_tokens": 4, "cache_tokens": 4}, "cache_tokens"),
        ({"max_response_tokens": 10, "cache_tokens": 0}, "cache_tokens"),
        ({"max_response_tokens": 10, "cache_tokens": 2, "penalty_factor": -1.0}, "penalty_factor"),
    ],
)
def test_overlong_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([1, 2]), **kwargs)
    with pytest.raises(ValueError, match="integers"):
        overlong_penalty(torch.tensor([1.0]), max_response_tokens=10, cache_tokens=2)
