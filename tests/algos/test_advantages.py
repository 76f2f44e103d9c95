"""Advantage estimators: hand-computed values, invariances and errors. (TRL cross-checks: test_trl_reference.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlray.algos import (
    GROUP_ADVANTAGES,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)
from rlray.algos.advantages import group_mean_count

ATOL = 1e-6


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0.0)


# Groups deliberately interleaved and ragged: group 7 = rows 1,3,5 (rewards 1,2,3), group 3 = rows 0,4 (5,5),
# group -2 = row 2 (0).
REWARDS = torch.tensor([5.0, 1.0, 0.0, 2.0, 5.0, 3.0])
GROUPS = torch.tensor([3, 7, -2, 7, 3, 7])


# --------------------------------------------------------------------------------------------
# Hand-computed cases
# --------------------------------------------------------------------------------------------
def test_grpo_group_std_hand_computed():
    # group 7: mean 2, unbiased std sqrt(((1-2)^2 + 0 + (3-2)^2) / (3-1)) = 1 -> (r - 2) / (1 + 1e-6)
    # group 3: constant -> 0 (no NaN); group -2: one sample -> std 0, deviation 0 -> 0
    d = 1.0 / (1.0 + 1e-6)
    close(grpo_advantages(REWARDS, GROUPS), [0.0, -d, 0.0, 0.0, 0.0, d])


def test_grpo_batch_std_hand_computed():
    # batch mean 16/6; sum of squared deviations = 21 1/3; unbiased var = 21.333.../5 = 4.2666...
    # std = sqrt(64/15) = 2.0655911; group deviations as above: -1, 0, +1 in group 7, 0 elsewhere
    std = math.sqrt(64.0 / 15.0)
    d = 1.0 / (std + 1e-6)
    close(grpo_advantages(REWARDS, GROUPS, std_scale="batch"), [0.0, -d, 0.0, 0.0, 0.0, d])


def test_dr_grpo_is_mean_centred_only():
    # no division: group 7 -> -1, 0, 1; the rest 0
    expected = [0.0, -1.0, 0.0, 0.0, 0.0, 1.0]
    close(grpo_advantages(REWARDS, GROUPS, std_scale="none"), expected)
    close(dr_grpo_advantages(REWARDS, GROUPS), expected)


def test_grpo_eps_matches_given_value():
    # rewards 0, 1 in one group: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / (0.70710678 + 1e-4)
    r, g = torch.tensor([0.0, 1.0]), torch.tensor([0, 0])
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    close(grpo_advantages(r, g, eps=1e-4), [-a, a])


def test_rloo_hand_computed():
    # group 7: r - mean(others): 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5
    # group 3: 5 - 5 = 0; singleton group -2: no baseline -> 0
    close(rloo_advantages(REWARDS, GROUPS), [0.0, -1.5, 0.0, 0.0, 0.0, 1.5])


def test_remax_hand_computed():
    # r - r_greedy: 1 - 0.25 = 0.75, 0.5 - 0.5 = 0, invalid row -> 0
    adv = remax_advantages(
        torch.tensor([1.0, 0.5, 9.0]), torch.tensor([0.25, 0.5, 1.0]), valid_mask=torch.tensor([True, True, False])
    )
    close(adv, [0.75, 0.0, 0.0])


def test_token_level_rewards_hand_computed():
    # -0.5 * kl on valid tokens, sequence reward added on the last valid token:
    # row 0 (2 tokens): [-0.05, -0.1 + 1, 0]; row 1 (3 tokens): [-0.15, -0.2, -0.25 + 2]; row 2: empty -> zeros
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    kl = torch.tensor([[0.1, 0.2, 99.0], [0.3, 0.4, 0.5], [1.0, 1.0, 1.0]])
    out = token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl=kl, kl_coef=0.5)
    close(out, [[-0.05, 0.9, 0.0], [-0.15, -0.2, 1.75], [0.0, 0.0, 0.0]])


def test_token_level_rewards_with_mid_sequence_hole():
    # the reward goes on the last True position (index 2), not after the hole
    mask = torch.tensor([[True, False, True, False]])
    close(token_level_rewards(torch.tensor([4.0]), mask), [[0.0, 0.0, 4.0, 0.0]])


def test_whiten_hand_computed():
    # valid values 1, 2, 3: mean 2, unbiased var 1 -> (x - 2) * rsqrt(1 + 1e-8); padding -> 0
    x = torch.tensor([[1.0, 2.0], [3.0, 50.0]])
    mask = torch.tensor([[True, True], [True, False]])
    s = 1.0 / math.sqrt(1.0 + 1e-8)
    close(whiten(x, mask), [[-s, 0.0], [s, 0.0]])
    close(whiten(x, mask, shift_mean=False), [[2.0 - s, 2.0], [2.0 + s, 0.0]])


def test_reinforce_pp_hand_computed(ragged_mask):
    # gamma 1: row 0 rewards [0.5, 1] -> returns [1.5, 1]; row 1 [2, pad] -> [2]
    # valid returns 1.5, 1, 2: mean 1.5, unbiased var (0 + 0.25 + 0.25) / 2 = 0.25 -> x2 scale
    mask = ragged_mask([2, 1], 2)
    s = 1.0 / math.sqrt(0.25 + 1e-8)
    adv = reinforce_pp_advantages(torch.tensor([[0.5, 1.0], [2.0, 7.0]]), mask, gamma=1.0)
    close(adv, [[0.0, -0.5 * s], [0.5 * s, 0.0]])


def test_reinforce_pp_discount_skips_masked_gap():
    # gamma 0.5. Row 0, mask [1, 0, 1], rewards [1, (100), 2]: G_2 = 2, G_0 = 1 + 0.5 * 2 = 2 (the hole neither
    # adds nor discounts). Row 1, rewards [0, 0, 4]: G = [0.25 * 4, 0.5 * 4, 4] = [1, 2, 4]
    # valid returns 2, 2, 1, 2, 4: mean 11/5 = 2.2; unbiased var = (0.04+0.04+1.44+0.04+3.24)/4 = 1.2
    mask = torch.tensor([[True, False, True], [True, True, True]])
    rewards = torch.tensor([[1.0, 100.0, 2.0], [0.0, 0.0, 4.0]])
    s = 1.0 / math.sqrt(1.2 + 1e-8)
    expected = [[(2 - 2.2) * s, 0.0, (2 - 2.2) * s], [(1 - 2.2) * s, (2 - 2.2) * s, (4 - 2.2) * s]]
    close(reinforce_pp_advantages(rewards, mask, gamma=0.5), expected)


def test_reinforce_pp_baseline_hand_computed(ragged_mask):
    # centred rewards: group 0 [1, 3] -> [-1, 1]; group 1 [2, 2] -> [0, 0]
    # token values (lengths 2, 1, 1, 3): -1, -1, 1, 0, 0, 0, 0 -> mean -1/7, unbiased var (20/7) / 6 = 10/21
    mask = ragged_mask([2, 1, 1, 3], 3)
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]), mask)
    m, s = -1.0 / 7.0, 1.0 / math.sqrt(10.0 / 21.0 + 1e-8)
    lo, hi, mid = (-1 - m) * s, (1 - m) * s, (0 - m) * s
    close(adv, [[lo, lo, 0.0], [hi, 0.0, 0.0], [mid, 0.0, 0.0], [mid, mid, mid]])


def test_group_dict_shares_one_signature():
    for name, fn in GROUP_ADVANTAGES.items():
        out = fn(REWARDS, GROUPS, valid_mask=torch.ones(6, dtype=torch.bool))
        assert out.shape == (6,), name
        assert torch.isfinite(out).all(), name


# --------------------------------------------------------------------------------------------
# Invariances
# --------------------------------------------------------------------------------------------
GROUP_FNS = {
    "grpo_group": lambda r, g, v: grpo_advantages(r, g, valid_mask=v),
    "grpo_batch": lambda r, g, v: grpo_advantages(r, g, std_scale="batch", valid_mask=v),
    "dr_grpo": lambda r, g, v: dr_grpo_advantages(r, g, valid_mask=v),
    "rloo": lambda r, g, v: rloo_advantages(r, g, valid_mask=v),
}


def _random_groups(gen: torch.Generator, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    group_ids = torch.cat([torch.full((n,), 10 * i + 3) for i, n in enumerate(sizes)])
    rewards = torch.randint(0, 4, (group_ids.numel(),), generator=gen).float() / 3
    return rewards, group_ids


@pytest.mark.parametrize("name", sorted(GROUP_FNS))
def test_permuting_rows_permutes_results(name, gen):
    rewards, group_ids = _random_groups(gen, [4, 3, 5, 1, 4])
    valid = torch.rand(rewards.shape, generator=gen) > 0.2
    fn = GROUP_FNS[name]
    base = fn(rewards, group_ids, valid)
    perm = torch.randperm(rewards.numel(), generator=gen)
    torch.testing.assert_close(fn(rewards[perm], group_ids[perm], valid[perm]), base[perm], atol=ATOL, rtol=0)


def test_reinforce_pp_baseline_permutation(gen, ragged_mask):
    rewards, group_ids = _random_groups(gen, [4, 3, 5])
    mask = ragged_mask(torch.randint(0, 6, (12,), generator=gen).tolist(), 6)
    base = reinforce_pp_baseline_advantages(rewards, group_ids, mask)
    perm = torch.randperm(12, generator=gen)
    out = reinforce_pp_baseline_advantages(rewards[perm], group_ids[perm], mask[perm])
    torch.testing.assert_close(out, base[perm], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(GROUP_FNS))
def test_invalid_row_does_not_move_group_statistics(name, gen):
    rewards, group_ids = _random_groups(gen, [4, 4, 4])
    fn = GROUP_FNS[name]
    keep = torch.ones(12, dtype=torch.bool)
    keep[5] = False
    without = fn(rewards[keep], group_ids[keep], None)
    garbage = rewards.clone()
    garbage[5] = float("nan")  # a failed reward: its value must not matter
    with_row = fn(garbage, group_ids, keep)
    torch.testing.assert_close(with_row[keep], without, atol=ATOL, rtol=0)
    assert with_row[5] == 0.0


@pytest.mark.parametrize("name", sorted(GROUP_FNS))
def test_constant_group_gives_zero_without_nan(name):
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.0, 0.0, 0.0])
    out = GROUP_FNS[name](rewards, torch.tensor([1, 1, 1, 2, 2, 2]), None)
    assert torch.isfinite(out).all()
    close(out, [0.0] * 6)


def test_fully_masked_row_does_not_move_group_statistics(gen, ragged_mask):
    # REINFORCE++-baseline reads response_mask: a row the learner masked out entirely (here reward 100) must not
    # shift its group's mean or the batch whitening; it gets 0 everywhere.
    rewards, group_ids = _random_groups(gen, [4, 4, 4])
    mask = ragged_mask([3, 5, 2, 4, 1, 5, 5, 2, 3, 4, 2, 1], 5)
    mask[6] = False
    rewards[6] = 100.0
    keep = torch.arange(12) != 6
    out = reinforce_pp_baseline_advantages(rewards, group_ids, mask)
    expected = reinforce_pp_baseline_advantages(rewards[keep], group_ids[keep], mask[keep])
    torch.testing.assert_close(out[keep], expected, atol=ATOL, rtol=0)
    assert (out[6] == 0).all()
    # the group estimators take the same rows out through valid_mask = response_mask.any(-1)
    for fn in GROUP_FNS.values():
        actual = fn(rewards, group_ids, mask.any(-1))[keep]
        torch.testing.assert_close(actual, fn(rewards[keep], group_ids[keep], None), atol=ATOL, rtol=0)


def test_reinforce_pp_masked_values_do_not_matter(gen, ragged_mask):
    mask = ragged_mask([3, 1, 4, 2], 4)
    rewards = torch.randn(4, 4, generator=gen)
    noisy = torch.where(mask, rewards, torch.full_like(rewards, float("inf")))
    torch.testing.assert_close(reinforce_pp_advantages(noisy, mask), reinforce_pp_advantages(rewards, mask))
    kl = torch.where(mask, torch.rand(4, 4, generator=gen), torch.full((4, 4), float("nan")))
    assert torch.isfinite(token_level_rewards(torch.ones(4), mask, kl=kl, kl_coef=0.1)).all()


# --------------------------------------------------------------------------------------------
# Properties (hypothesis): constant groups give exactly 0 in every group-baseline estimator
# --------------------------------------------------------------------------------------------
# Every estimator with a group baseline: GRPO with each std scale and eps (dapo, gspo and cispo use GRPO's),
# Dr.GRPO and RLOO.
BASELINE_FNS = {
    **{
        f"grpo_{scale}_{eps:g}": (lambda s, e: lambda r, g, v: grpo_advantages(r, g, std_scale=s, eps=e, valid_mask=v))(
            scale, eps
        )
        for scale in ("group", "batch", "none")
        for eps in (1e-8, 1e-6, 1e-4)
    },
    "dr_grpo": lambda r, g, v: dr_grpo_advantages(r, g, valid_mask=v),
    "rloo": lambda r, g, v: rloo_advantages(r, g, valid_mask=v),
}
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# rewards people use (fractions of a rubric, 0/1, +-1, shaped scores) and any float32 value
REWARD_VALUES = st.one_of(
    st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0, -1.0, -0.5, 1 / 3, 2 / 3, 0.05, 5.3, 100.1, 1e-3]),
    st.floats(-1e4, 1e4, allow_nan=False, width=32),
)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    size=st.integers(1, 64),
    value=REWARD_VALUES,
    dtype=st.sampled_from(DTYPES),
    other=st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, -2.0]), min_size=0, max_size=6),
    invalid=st.lists(st.booleans(), min_size=64, max_size=64),
)
def test_constant_group_is_exactly_zero_in_every_group_estimator(size, value, dtype, other, invalid):
    # a constant group (rows 0..size-1, some rows invalid with garbage rewards) next to an optional other group,
    # so that the batch std is the other group's; the constant group's advantages must be exactly 0
    rewards = torch.tensor([value] * size + other, dtype=torch.float64).to(dtype)
    group_ids = torch.tensor([5] * size + [2] * len(other))
    valid = torch.ones(rewards.shape, dtype=torch.bool)
    valid[:size] = ~torch.tensor(invalid[:size]) | (torch.arange(size) == 0)  # at least one valid row
    rewards[:size] = torch.where(valid[:size], rewards[:size], torch.tensor(float("nan"), dtype=dtype))
    for name, fn in BASELINE_FNS.items():
        out = fn(rewards, group_ids, valid)
        assert out.dtype == dtype, name
        assert torch.isfinite(out).all(), name
        assert (out[:size] == 0).all(), (name, out[:size].tolist())


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    rewards=st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.7, 1.0, 1 / 3, -1.0]), min_size=2, max_size=32),
    dtype=st.sampled_from(DTYPES),
)
def test_group_mean_of_a_non_constant_group_is_sum_over_count(rewards, dtype):
    # the exact-mean rule only touches constant groups: every other group keeps sum / count, bit for bit
    r = torch.tensor(rewards, dtype=torch.float64).to(dtype)
    group_ids = torch.zeros(len(rewards), dtype=torch.int64)
    _, mean, count = group_mean_count(r, group_ids, torch.ones_like(r, dtype=torch.bool))
    index_add_sum = torch.zeros(1, dtype=dtype).index_add_(0, group_ids, r)[0]  # the summation order of before
    expected = index_add_sum / torch.tensor(float(len(rewards)), dtype=dtype) if r.max() != r.min() else r[0]
    assert count[0] == len(rewards)
    assert (mean == expected).all()


@settings(derandomize=True, max_examples=100, deadline=None)
@given(size=st.integers(1, 32), value=REWARD_VALUES, dtype=st.sampled_from(DTYPES))
def test_estimators_without_a_group_baseline_follow_their_definitions(size, value, dtype):
    # REINFORCE++-baseline centres a constant group to exactly 0, and whitening maps that 0 to -mean/std of the
    # batch's centred tokens; with a second group [0, 1] and equal lengths that mean is 0, so the output is 0
    rewards = torch.tensor([value] * size + [0.0, 1.0], dtype=torch.float64).to(dtype)
    group_ids = torch.tensor([1] * size + [0, 0])
    mask = torch.ones(size + 2, 3, dtype=torch.bool)
    out = reinforce_pp_baseline_advantages(rewards, group_ids, mask)
    assert torch.isfinite(out).all() and (out[:size] == 0).all()
    # ReMax: r - r_greedy, 0 only where the greedy response scores the same
    base = torch.full_like(rewards, value)
    assert (remax_advantages(rewards, base)[:size] == 0).all()
    # REINFORCE++ has no baseline: it whitens the returns of the batch, finite even for one constant group
    assert torch.isfinite(reinforce_pp_advantages(token_level_rewards(rewards[:size], mask[:size]), mask[:size])).all()


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
def test_nan_reward_on_valid_row_names_the_row():
    with pytest.raises(ValueError, match=r"rewards\[2\]=nan.*valid_mask"):
        grpo_advantages(torch.tensor([1.0, 0.0, float("nan")]), torch.tensor([0, 0, 0]))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: grpo_advantages(REWARDS, GROUPS, std_scale="global"), "std_scale"),
        (lambda: grpo_advantages(REWARDS, GROUPS, eps=0.0), "eps"),
        (lambda: grpo_advantages(REWARDS, GROUPS[:3]), "group_ids"),
        (lambda: grpo_advantages(REWARDS, GROUPS.float()), "group_ids"),
        (lambda: rloo_advantages(REWARDS, GROUPS, valid_mask=torch.ones(6)), "valid_mask"),
        (lambda: remax_advantages(REWARDS, REWARDS[:2]), "baseline_rewards"),
        (lambda: reinforce_pp_advantages(torch.zeros(2, 3), torch.ones(2, 3)), "response_mask"),
        (lambda: reinforce_pp_advantages(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), gamma=1.5), "gamma"),
        (lambda: token_level_rewards(torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), kl_coef=-1.0), "kl_coef"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
