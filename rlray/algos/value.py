"""Critic-side math for PPO: generalised advantage estimation and the clipped value loss.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

Token t of a response is the action taken in state (prompt, response[:t]); ``values[:, t]`` is the critic's
estimate V(s_t) of the return from that state, in reward units. The episode ends after the last valid token.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Returns (advantages [B, T], returns [B, T]) float32 by GAE(gamma, lambda); 0 at masked positions.

    Over the valid tokens of each row, in order: delta_t = r_t + gamma * V(next valid) - V_t (V after the last
    valid token is 0: terminal), A_t = delta_t + gamma * lam * A_(next valid); returns = A + V. Masked positions
    (padding, or tokens masked mid-sequence such as tool output) are skipped: they neither add reward nor
    discount, and their ``values`` are never read. Advantages are not whitened; call
    ``advantages.whiten(advantages, response_mask)`` for PPO's usual normalisation.

    Args:
        token_rewards: [B, T] float32 per-token rewards (``token_level_rewards``: KL penalty plus the outcome
            reward on the last valid token); masked values are ignored.
        values: [B, T] float32 critic values V(s_t) at rollout time (old values); masked values are ignored.
        response_mask: [B, T] bool, True on tokens that count.
        gamma: discount per valid token, in [0, 1].
        lam: GAE lambda, in [0, 1] (1 gives Monte-Carlo returns minus V, 0 gives one-step TD errors).

    Raises:
        ValueError: shapes differ, the mask is not bool, or gamma/lam outside [0, 1].

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16; verl
    ``compute_gae_advantage_return`` (masked variant); OpenRLHF ``get_advantages_and_returns``.
    """
    if not (token_rewards.shape == values.shape == response_mask.shape) or response_mask.dtype != torch.bool:
        raise ValueError(
            f"gae_advantages: token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and bool "
            f"response_mask {tuple(response_mask.shape)} ({response_mask.dtype}) must all be [B, T]"
        )
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"gae_advantages: {name}={x} must be in [0, 1]")
    zero_row = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    next_value, next_adv = zero_row, zero_row
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        valid = response_mask[:, t]
        value_t = torch.where(valid, values[:, t], zero_row)
        reward_t = torch.where(valid, token_rewards[:, t], zero_row)
        adv_t = reward_t + gamma * next_value - value_t + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv_t, zero_row)
        next_value = torch.where(valid, value_t, next_value)
        next_adv = torch.where(valid, adv_t, next_adv)
    returns = torch.where(response_mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Returns (per-token value loss [B, T], diagnostics) with PPO's clipped value objective.

    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old, -clip_eps, clip_eps);
    with ``clip_eps=None`` it is the plain 0.5 * (V - R)^2. Masked positions hold 0. Reduce it with
    ``aggregate_loss`` and weight it with the critic's coefficient.

    Args:
        values: [B, T] float32 current critic values (with grad).
        old_values: [B, T] float32 critic values at rollout time (detached).
        returns: [B, T] float32 targets, e.g. from ``gae_advantages`` (detached).
        response_mask: [B, T] bool, True on tokens that count.
        clip_eps: clip range in reward units, > 0, or None for no clipping.

    Returns:
        (loss [B, T], {"clipped": [B, T] float32, 1 where the clipped branch is the larger one}).

    Raises:
        ValueError: shapes differ, the mask is not bool, or clip_eps <= 0.

    Source: OpenAI baselines ppo2 ``vf_loss`` (Schulman et al. 2017 implementation); verl
    ``compute_value_loss``; OpenRLHF ``ValueLoss``.
    """
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError(
            f"value_loss: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and response_mask {tuple(response_mask.shape)} must all be [B, T]"
        )
    if response_mask.dtype != torch.bool:
        raise ValueError(f"value_loss: response_mask must be bool, got {response_mask.dtype}")
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"value_loss: clip_eps={clip_eps} must be > 0 or None")
    zero = torch.zeros_like(values)
    values = torch.where(response_mask, values, zero)
    old_values = torch.where(response_mask, old_values, zero)
    returns = torch.where(response_mask, returns, zero)
    unclipped = (values - returns).square()
    if clip_eps is None:
        clipped_frac = zero.detach()
        loss = 0.5 * unclipped
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (values_clipped - returns).square()
        clipped_frac = ((clipped > unclipped) & response_mask).to(values.dtype).detach()
        loss = 0.5 * torch.maximum(unclipped, clipped)
    return torch.where(response_mask, loss, zero), {"clipped": clipped_frac}
