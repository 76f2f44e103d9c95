"""Per-token KL estimators between the current policy and the reference policy.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

With the log ratio ``d = logprobs - ref_logprobs`` (nats) of a token sampled from the current policy:
    k1 = d                          unbiased for KL(pi || ref), high variance, can be negative
    k2 = d**2 / 2                   biased, low variance, >= 0; its gradient is the gradient of KL(pi || ref)
    k3 = exp(-d) - 1 + d            unbiased, low variance, >= 0 (TRL's GRPO KL)
Source: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
k2 and k3 use d clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] (20 nats, policy_losses.py): exp(-d) overflows fp32
below -88.7 nats (k3 inf, gradient -inf) and d**2 past 1.8e19. Inside the bound nothing changes; outside it the
estimate is that of the bound and passes no gradient. verl's ``kl_penalty`` clamps k3's d to [-20, 20] as well.

Two ways to use them (``algo.kl_in``): in the reward, ``token_level_rewards(..., kl=kl_penalty(...), kl_coef=beta)``
(REINFORCE++, PPO; see advantages.py), or in the loss, ``per_token_loss + beta * kl_penalty(...)``
before ``aggregate_loss`` (GRPO and TRL's GRPOTrainer).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlray.algos.policy_losses import LOG_RATIO_BOUND

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Returns the [B, T] per-token KL estimate, in nats, of the current policy from the reference.

    Args:
        logprobs: [B, T] float32 log-probabilities of the sampled tokens under the current policy.
        ref_logprobs: [B, T] float32 log-probabilities of the same tokens under the reference policy.
        estimator: "k1" | "k2" | "k3" (module docstring).

    Returns:
        [B, T] tensor, same dtype. Values at padded positions are whatever the inputs give there: mask them
        (``aggregate_loss`` or ``token_level_rewards`` do). Gradients flow through ``logprobs`` only if the
        caller leaves them attached; ``ref_logprobs`` is expected to be detached.

    Raises:
        ValueError: unknown estimator or shapes differ.

    Source: Schulman (2020); k3 is TRL 1.16 ``GRPOTrainer._compute_loss`` (grpo_trainer.py lines 3098-3101),
    k1 the log ratio TRL's RLOOTrainer puts in the reward. k2 and k3 clamp d to +-LOG_RATIO_BOUND nats (module
    docstring; verl clamps k3's d to [-20, 20], then k3 itself to [-10, 10], which we do not), so they are finite,
    with a finite gradient, for any finite log ratio; TRL 1.16 does not clamp. k1 is not clamped.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty: logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
        )
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if estimator == "k2":
        return 0.5 * bounded.square()
    if estimator == "k3":
        return torch.exp(-bounded) + bounded - 1.0
    raise ValueError(f"kl_penalty: unknown estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
