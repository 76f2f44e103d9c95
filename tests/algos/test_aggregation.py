"""Loss aggregation: hand-computed modes, global normalisers, gradient accumulation and DP equivalence."""

from __future__ import annotations

import pytest
import torch

from rlray.algos import AGGREGATION_MODES, aggregate_loss, masked_mean

ATOL = 1e-6

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])  # row 2 fully masked


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 valid tokens
        ("seq-mean-token-mean", 2.75),  # ((1 + 2) / 2 + 4 / 1) / 2 sequences with a token
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2
        ("seq-mean-token-sum-norm", 0.875),  # (3 / 4 + 4 / 4) / 2 with max_response_tokens = 4
    ],
)
def test_local_modes_hand_computed(mode, expected):
    out = aggregate_loss(LOSS, MASK, mode, max_response_tokens=4)
    torch.testing.assert_close(out, torch.tensor(expected), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 0.7),  # 7 / num_tokens 10
        ("seq-mean-token-mean", 1.1),  # 5.5 / num_sequences 5
        ("seq-mean-token-sum", 1.4),  # 7 / 5
        ("seq-mean-token-sum-norm", 0.35),  # 1.75 / 5
    ],
)
def test_global_normalisers_hand_computed(mode, expected):
    out = aggregate_loss(LOSS, MASK, mode, num_tokens=10, num_sequences=5, max_response_tokens=4)
    torch.testing.assert_close(out, torch.tensor(expected), atol=ATOL, rtol=0)


def test_fully_masked_input_gives_zero_not_nan():
    for mode in AGGREGATION_MODES:
        out = aggregate_loss(LOSS, torch.zeros(3, 3, dtype=torch.bool), mode, max_response_tokens=3)
        assert out.item() == 0.0, mode


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_masked_values_do_not_change_value_or_gradient(mode, gen):
    weights = torch.randn(3, 3, generator=gen, requires_grad=True)
    garbage = torch.where(MASK, torch.zeros(3, 3), torch.tensor([[float("nan"), float("inf"), -float("inf")]] * 3))
    outs, grads = [], []
    for extra in (torch.zeros(3, 3), garbage):
        weights.grad = None
        out = aggregate_loss(weights.square() + extra, MASK, mode, max_response_tokens=4)
        out.backward()
        outs.append(out.detach())
        grads.append(weights.grad.clone())
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(grads[0], grads[1])
    assert torch.isfinite(grads[1]).all()


def _per_token_loss(params: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """A small nonlinear per-token loss [B, T] from features [B, T, D] and params [D]."""
    return torch.tanh(features @ params) ** 2 - 0.3 * (features @ params)


def _full_and_split_grads(mode: str, gen: torch.Generator, world_size: int, splits: list[list[int]]):
    lengths = [5, 0, 2, 7, 1, 0, 4, 3]  # ragged, with fully masked rows
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    features = torch.randn(8, 7, 3, generator=gen)
    params = torch.randn(3, generator=gen, requires_grad=True)
    aggregate_loss(_per_token_loss(params, features), mask, mode, max_response_tokens=7).backward()
    full = params.grad.clone()
    # the driver counts the global normalisers after all masking
    num_tokens, num_sequences = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    rank_grads = []
    for rank_rows in splits:  # one list of micro-batches (row indices) per rank
        params.grad = None
        for rows in rank_rows:
            idx = torch.tensor(rows, dtype=torch.long)
            part = aggregate_loss(
                _per_token_loss(params, features[idx]),
                mask[idx],
                mode,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
                max_response_tokens=7,
            )
            (part * world_size).backward()  # DDP averages over ranks, so scale by world_size
        rank_grads.append(params.grad.clone())
    return full, torch.stack(rank_grads).mean(0)  # the all-reduce average


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_accumulation_equals_full_batch(mode, gen):
    # k = 3 micro-batches of uneven size; micro-batch [1, 5] holds only fully masked rows
    full, accumulated = _full_and_split_grads(mode, gen, 1, [[[0, 2, 3], [1, 5], [4, 6, 7]]])
    torch.testing.assert_close(accumulated, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_data_parallel_accumulation_equals_full_batch(mode, gen):
    # 2 ranks x 2 micro-batches each, ragged; rank 1's first micro-batch is fully masked
    splits = [[[0, 2], [3, 4, 6]], [[1, 5], [7]]]
    full, averaged = _full_and_split_grads(mode, gen, 2, splits)
    torch.testing.assert_close(averaged, full, atol=ATOL, rtol=0)


def test_masked_mean_hand_computed():
    # (1 + 2 + 4) / 3
    torch.testing.assert_close(masked_mean(LOSS, MASK), torch.tensor(7.0 / 3.0), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "sum"}, "unknown mode"),
        ({"mode": "seq-mean-token-sum-norm"}, "max_response_tokens"),
        ({"mode": "token-mean", "num_tokens": -1}, "num_tokens"),
        ({"mode": "token-mean", "response_mask": MASK.float()}, "bool"),
        ({"mode": "token-mean", "response_mask": MASK[:2]}, r"\[B, T\]"),
    ],
)
def test_errors(kwargs, match):
    kwargs = {"per_token_loss": LOSS, "response_mask": MASK, **kwargs}
    with pytest.raises(ValueError, match=match):
        aggregate_loss(**kwargs)
