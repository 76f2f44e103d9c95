"""The RL objective of one micro-batch, composed from ``rlray.algos`` pieces.

Legend: B sequences in the micro-batch, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlray import algos

# The policy loss of each online algorithm (a key of ``algos.POLICY_LOSSES``).
POLICY_LOSS_OF: dict[str, str] = {
    "grpo": "ppo_clip",
    "dr_grpo": "ppo_clip",
    "dapo": "ppo_clip",
    "gspo": "gspo",
    "cispo": "cispo",
    "rloo": "ppo_clip",
    "reinforce_pp": "ppo_clip",
    "reinforce_pp_baseline": "ppo_clip",
    "remax": "ppo_clip",
    "ppo": "ppo_clip",
}

STAT_KEYS = (
    "pg_loss_sum", "kl_sum", "clipped_sum", "dual_clipped_sum", "entropy_sum", "tis_weight_sum", "rollout_diff_sum",
    "tokens",
)  # fmt: skip


@dataclass(frozen=True)
class LossSpec:
    """Plain values that choose and parametrise the policy objective (built from the config by the loop).

    Attributes:
        clip_eps_low / clip_eps_high: ratio clip range [1 - low, 1 + high] (DAPO clip-higher).
        kl_coef: weight of the per-token KL-to-reference term added to the loss (0 disables it; the loop
            passes 0 when the KL sits in the reward instead).
        kl_estimator: "k1" | "k2" | "k3".
        loss_agg: aggregation mode of ``algos.aggregate_loss``.
        max_response_tokens: the constant of "seq-mean-token-sum-norm" (rollout.max_new_tokens).
        policy_loss: a key of ``algos.POLICY_LOSSES`` ("ppo_clip", "gspo", "cispo").
        dual_clip: dual-clip constant c > 1 for "ppo_clip", or None.
        entropy_coef: weight of the entropy bonus (0 disables it and skips computing the entropy).
        tis_cap: truncated importance-sampling cap on pi_learner / pi_rollout, or None.
        tis_level: "token" | "sequence".
    """

    clip_eps_low: float
    clip_eps_high: float
    kl_coef: float
    kl_estimator: str
    loss_agg: str
    max_response_tokens: int
    policy_loss: str = "ppo_clip"
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    tis_level: str = "token"


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


def _policy_loss(logprobs: torch.Tensor, mb: dict[str, torch.Tensor], spec: LossSpec):
    extra = {"dual_clip": spec.dual_clip} if spec.policy_loss == "ppo_clip" else {}
    return algos.POLICY_LOSSES[spec.policy_loss](
        logprobs,
        mb["old_logprobs"],
        mb["advantages"],
        mb["response_mask"],
        clip_eps_low=spec.clip_eps_low,
        clip_eps_high=spec.clip_eps_high,
        **extra,
    )


def policy_objective(
    logprobs: torch.Tensor,
    mb: dict[str, torch.Tensor],
    spec: LossSpec,
    norm: Normaliser,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns the micro-batch's share of the mini-batch loss, and per-token-summed diagnostics.

    loss = aggregate(w * policy_loss(logprobs, old_logprobs, A) + kl_coef * KL(logprobs, ref_logprobs)
    - entropy_coef * H), following GRPO (Shao et al. 2024, eq. 3) with TRL GRPOTrainer's placement of the
    KL inside the per-token loss, and w the truncated IS weight min(exp(old - rollout), tis_cap) of Yao et
    al. 2025 (1 when tis_cap is None). Summing the returned loss over the micro-batches of a mini-batch (and
    averaging gradients over ranks) gives the full mini-batch loss.

    Args:
        logprobs: [B, T] float32 current policy logprobs (with grad).
        mb: collated micro-batch: old_logprobs [B, T], advantages [B, T], response_mask [B, T] bool,
            ref_logprobs [B, T] when there is a reference model, rollout_logprobs [B, T] when the engine
            reported them (required with tis_cap).
        spec: objective choice and coefficients.
        norm: global denominators of the mini-batch.
        entropy: [B, T] float32 per-token policy entropy in nats (with grad); required when
            ``spec.entropy_coef > 0``.

    Returns:
        loss: scalar float32 to call backward on.
        stats: sums over valid tokens (``*_sum``, keys ``STAT_KEYS``) for the caller to divide by the token
            count: pg_loss_sum, kl_sum (k3 estimator, whatever ``spec.kl_estimator`` is), clipped_sum, dual_clipped_sum, entropy_sum, tis_weight_sum,
            rollout_diff_sum (|rollout - old logprobs|, the engine/learner mismatch); and tokens.

    Raises:
        ValueError: entropy_coef > 0 without ``entropy``, or tis_cap without rollout_logprobs.
    """
    mask = mb["response_mask"]
    pg_loss, diag = _policy_loss(logprobs, mb, spec)
    per_token = pg_loss
    tis = None
    if spec.tis_cap is not None:
        if "rollout_logprobs" not in mb:
            raise ValueError("policy_objective: tis_cap needs rollout_logprobs in the micro-batch")
        tis = algos.truncated_is_weights(
            mb["old_logprobs"], mb["rollout_logprobs"], mask, cap=spec.tis_cap, level=spec.tis_level
        )
        per_token = per_token * tis
    kl_k3 = None  # the logged algo/kl (and the KL guard's input) is always the k3 estimate, whatever the loss uses
    if "ref_logprobs" in mb:
        kl = algos.kl_penalty(logprobs, mb["ref_logprobs"], spec.kl_estimator)
        kl_k3 = kl if spec.kl_estimator == "k3" else algos.kl_penalty(logprobs.detach(), mb["ref_logprobs"], "k3")
        if spec.kl_coef > 0:
            per_token = per_token + spec.kl_coef * kl
    if spec.entropy_coef > 0:
        if entropy is None:
            raise ValueError("policy_objective: entropy_coef > 0 needs the per-token entropy")
        per_token = per_token + algos.entropy_bonus_loss(entropy, mask, coef=spec.entropy_coef)
    loss = algos.aggregate_loss(
        per_token,
        mask,
        spec.loss_agg,
        num_tokens=norm.num_tokens,
        num_sequences=norm.num_sequences,
        max_response_tokens=spec.max_response_tokens,
    ) * norm.world_size
    return loss, _stats(mb, mask, pg_loss, diag, kl_k3, entropy, tis)


def _stats(mb, mask, pg_loss, diag, kl, entropy, tis) -> dict[str, torch.Tensor]:
    zero = torch.zeros(())

    def masked_sum(x: torch.Tensor | None) -> torch.Tensor:
        return zero if x is None else torch.where(mask, x.detach().float(), torch.zeros_like(x.float())).sum()

    rollout_diff = (mb["rollout_logprobs"] - mb["old_logprobs"]).abs() if "rollout_logprobs" in mb else None
    return {
        "pg_loss_sum": masked_sum(pg_loss),
        "kl_sum": masked_sum(kl),
        "clipped_sum": masked_sum(diag["clipped_low"] + diag["clipped_high"]),
        "dual_clipped_sum": masked_sum(diag.get("dual_clipped")),
        "entropy_sum": masked_sum(entropy),
        "tis_weight_sum": masked_sum(tis),
        "rollout_diff_sum": masked_sum(rollout_diff),
        "tokens": mask.float().sum(),
    }
