"""The RL objective of one micro-batch, composed from ``rlray.algos`` pieces.

Legend: B sequences in the micro-batch, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlray import algos


@dataclass(frozen=True)
class LossSpec:
    """Plain values that choose and parametrise the policy objective (built from the config by the loop).

    Attributes:
        clip_eps_low / clip_eps_high: PPO ratio clip range [1 - low, 1 + high] (DAPO clip-higher).
        kl_coef: weight of the per-token KL-to-reference term added to the loss (0 disables it).
        kl_estimator: "k1" | "k2" | "k3".
        loss_agg: aggregation mode of ``algos.aggregate_loss``.
        max_response_tokens: the constant of "seq-mean-token-sum-norm" (rollout.max_new_tokens).
        is_level: truncated importance-sampling correction for the behaviour policy (the rollout
            engine, possibly stale in async mode): "off", "token" or "sequence".
        is_cap: truncation cap C of those weights.
    """

    clip_eps_low: float
    clip_eps_high: float
    kl_coef: float
    kl_estimator: str
    loss_agg: str
    max_response_tokens: int
    is_level: str = "off"
    is_cap: float = 2.0


@dataclass(frozen=True)
class Normaliser:
    """Global denominators of one mini-batch, counted by the driver over all ranks after masking.

    Attributes:
        num_tokens: valid response tokens in the whole mini-batch (all micro-batches, all ranks).
        num_sequences: sequences in the whole mini-batch.
        world_size: data-parallel ranks; DDP averages gradients, so each rank's partial sum is scaled
            by it to make the averaged gradient equal the full-batch gradient.
    """

    num_tokens: float
    num_sequences: float
    world_size: int = 1


def policy_objective(
    logprobs: torch.Tensor, mb: dict[str, torch.Tensor], spec: LossSpec, norm: Normaliser
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns the micro-batch's share of the mini-batch loss, and per-token-summed diagnostics.

    loss = aggregate(w * ppo_clip(logprobs, old_logprobs, A) + kl_coef * KL(logprobs, ref_logprobs)),
    following GRPO (Shao et al. 2024, eq. 3) with TRL GRPOTrainer's placement of the KL inside the
    per-token loss, and w the truncated importance weights of ``spec.is_level`` (1 when "off"):
    min(exp(old - rollout logprobs), C), which correct for samples drawn by the rollout engine's
    (possibly stale) policy, as TRL's vllm_importance_sampling_correction does. Summing the returned loss over the micro-batches of a mini-batch (and averaging
    gradients over ranks) gives the full mini-batch loss.

    Args:
        logprobs: [B, T] float32 current policy logprobs (with grad).
        mb: collated micro-batch: old_logprobs [B, T], advantages [B, T], response_mask [B, T] bool,
            and ref_logprobs [B, T] when ``spec.kl_coef > 0``.
        spec: objective choice and coefficients.
        norm: global denominators of the mini-batch.

    Returns:
        loss: scalar float32 to call backward on.
        stats: sums over valid tokens (``*_sum``) for the caller to divide by the token count:
            pg_loss_sum, kl_sum, clipped_sum, rollout_diff_sum (|rollout - old logprobs|, the
            engine/learner mismatch); and tokens (count of valid tokens in this micro-batch).
    """
    mask = mb["response_mask"]
    pg_loss, diag = algos.ppo_clip_loss(
        logprobs,
        mb["old_logprobs"],
        mb["advantages"],
        mask,
        clip_eps_low=spec.clip_eps_low,
        clip_eps_high=spec.clip_eps_high,
    )
    if spec.is_level != "off" and "rollout_logprobs" in mb:
        # rollout.is_correction: w = min(pi_old / pi_rollout, C), detached (algos.truncated_is_weights)
        pg_loss = pg_loss * algos.truncated_is_weights(
            mb["old_logprobs"], mb["rollout_logprobs"], mask, cap=spec.is_cap, level=spec.is_level
        )
    per_token = pg_loss
    kl = None
    if "ref_logprobs" in mb:
        kl = algos.kl_penalty(logprobs, mb["ref_logprobs"], spec.kl_estimator)
        if spec.kl_coef > 0:
            per_token = per_token + spec.kl_coef * kl
    loss = algos.aggregate_loss(
        per_token,
        mask,
        spec.loss_agg,
        num_tokens=norm.num_tokens,
        num_sequences=norm.num_sequences,
        max_response_tokens=spec.max_response_tokens,
    ) * norm.world_size
    fmask = mask.float()
    stats = {
        "pg_loss_sum": (pg_loss.detach() * fmask).sum(),
        "kl_sum": (kl.detach() * fmask).sum() if kl is not None else torch.zeros(()),
        "clipped_sum": ((diag["clipped_low"] + diag["clipped_high"]) * fmask).sum(),
        "rollout_diff_sum": ((mb["rollout_logprobs"] - mb["old_logprobs"]).abs() * fmask).sum()
        if "rollout_logprobs" in mb
        else torch.zeros(()),
        "tokens": fmask.sum(),
    }
    return loss, stats
