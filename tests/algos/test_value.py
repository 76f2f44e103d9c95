"""GAE and the clipped value loss: hand-computed values, a textbook reference on ragged masks, errors."""

from __future__ import annotations

import pytest
import torch

from rlray.algos import gae_advantages, value_loss

ATOL = 1e-6


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=0.0)


def test_gae_hand_computed():
    # gamma 0.9, lambda 0.8. Row 0 (2 tokens), rewards [0, 1], values [0.5, 0.8]:
    #   t=1: delta = 1 + 0.9*0 - 0.8 = 0.2 -> A1 = 0.2
    #   t=0: delta = 0 + 0.9*0.8 - 0.5 = 0.22 -> A0 = 0.22 + 0.9*0.8*0.2 = 0.364; returns A + V = [0.864, 1.0]
    # Row 1, a hole at t=1 (mask [1, 0, 1]): the same numbers, the hole is skipped.
    # Row 2, one token then padding: A0 = 2 - 1 = 1, returns [2].
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 9.0, 1.0], [2.0, 5.0, 5.0]])
    values = torch.tensor([[0.5, 0.8, 0.0], [0.5, 9.0, 0.8], [1.0, 7.0, 7.0]])
    mask = torch.tensor([[True, True, False], [True, False, True], [True, False, False]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.364, 0.2, 0.0], [0.364, 0.0, 0.2], [1.0, 0.0, 0.0]])
    close(ret, [[0.864, 1.0, 0.0], [0.864, 0.0, 1.0], [2.0, 0.0, 0.0]])


def _textbook_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """Schulman et al. 2016 eq. 16 by its definition: A_t = sum_l (gamma lam)^l delta_{t+l}, V after the end = 0."""
    deltas = [r + gamma * (values[t + 1] if t + 1 < len(values) else 0.0) - values[t] for t, r in enumerate(rewards)]
    return [sum((gamma * lam) ** k * d for k, d in enumerate(deltas[t:])) for t in range(len(deltas))]


def test_gae_matches_textbook_definition_on_ragged_rows(gen):
    mask = torch.rand(6, 9, generator=gen) > 0.3
    mask[2] = False  # a fully masked row
    rewards, values = torch.randn(6, 9, generator=gen), torch.randn(6, 9, generator=gen)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    for b in range(6):
        idx = mask[b].nonzero().squeeze(1)
        expected = _textbook_gae(rewards[b, idx].tolist(), values[b, idx].tolist(), 0.95, 0.9)
        close(adv[b, idx], expected)
        close(ret[b, idx], (torch.tensor(expected) + values[b, idx]).tolist())
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_masked_values_do_not_matter(gen):
    mask = torch.rand(4, 7, generator=gen) > 0.4
    rewards, values = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    nan = torch.full_like(values, float("nan"))
    a1, r1 = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95)
    a2, r2 = gae_advantages(torch.where(mask, rewards, nan), torch.where(mask, values, nan), mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)


def test_gae_lambda_one_is_monte_carlo():
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t; rewards [1, 2, 3], V [0.5, 0.5, 0.5] -> [5.5, 4.5, 2.5]
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, _ = gae_advantages(torch.tensor([[1.0, 2.0, 3.0]]), torch.full((1, 3), 0.5), mask, gamma=1.0, lam=1.0)
    close(adv, [[5.5, 4.5, 2.5]])


def test_value_loss_hand_computed():
    # pos 0: (1 - 1.5)^2 = 0.25; V_clip = 0.8 + clamp(0.2, +-0.1) = 0.9 -> (0.9 - 1.5)^2 = 0.36 -> 0.5*0.36, clipped
    # pos 1: (2 - 1.2)^2 = 0.64; V_clip = 1.1 -> 0.01 -> 0.5*0.64
    # pos 2: (0 - 0.5)^2 = 0.25 both ways -> 0.125, not counted as clipped; pos 3 masked -> 0
    values = torch.tensor([[1.0, 2.0, 0.0, 9.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0, 0.0, 0.0]])
    returns = torch.tensor([[1.5, 1.2, 0.5, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, diag = value_loss(values, old, returns, mask, clip_eps=0.1)
    close(loss.detach(), [[0.18, 0.32, 0.125, 0.0]])
    close(diag["clipped"], [[1.0, 0.0, 0.0, 0.0]])
    loss.sum().backward()
    # grads: pos 0 clipped branch with V outside the clip range -> 0; pos 1: (2 - 1.2) = 0.8; pos 2: (0 - 0.5)
    close(values.grad, [[0.0, 0.8, -0.5, 0.0]])
    unclipped, _ = value_loss(values, old, returns, mask, clip_eps=None)
    close(unclipped.detach(), [[0.125, 0.32, 0.125, 0.0]])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), m, gamma=1.0, lam=1.0), "must all be"),
        (lambda m: gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), m, gamma=1.0, lam=1.2), "lam"),
        (lambda m: value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), m, clip_eps=0.0), "clip_eps"),
        (
            lambda m: value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), m.float(), clip_eps=None),
            "bool",
        ),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.ones(2, 3, dtype=torch.bool))
