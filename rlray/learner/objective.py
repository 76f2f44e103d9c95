"""The RL objective of one micro-batch, composed from ``rlray.algos`` pieces.

Legend: B sequences in the micro-batch, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlray import algos
from rlray.schema import StepBatch

STAT_KEYS = (
    "pg_loss_sum", "kl_sum", "clipped_sum", "dual_clipped_sum", "entropy_sum", "is_weight_sum", "rollout_diff_sum",
    "rollout_kl_sum", "corrected_tokens", "corrected_sequences", "sequences", "tokens", "rollout_ratio_max", "jsd_sum",
)  # fmt: skip
# Statistics reduced by max (over micro-batches, mini-batches and ranks); every other one is summed.
MAX_STAT_KEYS = ("rollout_ratio_max",)


def reduce_stat(key: str, total: float | None, value: float) -> float:
    """Returns ``total`` combined with ``value``: the max for ``MAX_STAT_KEYS``, else the sum (None: first value)."""
    if total is None:
        return value
    return max(total, value) if key in MAX_STAT_KEYS else total + value


@dataclass(frozen=True)
class LossSpec:
    """Plain values that choose and parametrise the policy objective (built from the config by
    ``rlray.run.build.update_spec``; the policy loss is the algorithm registry's ``Algorithm.policy_loss``).

    Attributes:
        clip_eps_low / clip_eps_high: ratio clip range [1 - low, 1 + high] (DAPO clip-higher).
        kl_coef: weight of the per-token KL-to-reference term added to the loss (0 disables it; the build step
            passes 0 when the KL sits in the reward instead).
        kl_estimator: "k1" | "k2" | "k3".
        loss_agg: aggregation mode of ``algos.aggregate_loss``.
        max_response_tokens: the constant of "seq-mean-token-sum-norm" (rollout.max_new_tokens).
        policy_loss: a key of ``algos.POLICY_LOSSES`` ("ppo_clip", "gspo", "cispo").
        dual_clip: dual-clip constant c > 1 for "ppo_clip", or None.
        entropy_coef: weight of the entropy bonus (0 disables it and skips computing the entropy).
        correction: rollout-correction mode, "none" or a key of ``algos.ROLLOUT_CORRECTION_MODES``
            (``algos.rollout_correction_weights``).
        correction_min / correction_max: its bounds [C_min, C_max] on pi_old / pi_rollout (None: unbounded).
        jsd_weight: weight of the per-token generalized JSD to a teacher added to the loss (teacher.weight with
            teacher.divergence=jsd; 0 disables it and skips the teacher's logits).
        jsd_beta: its beta in [0, 1] (teacher.beta; ``algos.generalized_jsd``).
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
    correction: str = "none"
    correction_min: float | None = None
    correction_max: float | None = None
    jsd_weight: float = 0.0
    jsd_beta: float = 0.5


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


def _policy_loss(logprobs: torch.Tensor, mb: StepBatch, spec: LossSpec):
    extra = {"dual_clip": spec.dual_clip} if spec.policy_loss == "ppo_clip" else {}
    return algos.POLICY_LOSSES[spec.policy_loss](
        logprobs,
        mb.old_logprobs,
        mb.advantages,
        mb.response_mask,
        clip_eps_low=spec.clip_eps_low,
        clip_eps_high=spec.clip_eps_high,
        **extra,
    )


def policy_objective(
    logprobs: torch.Tensor,
    mb: StepBatch,
    spec: LossSpec,
    norm: Normaliser,
    *,
    entropy: torch.Tensor | None = None,
    jsd: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns the micro-batch's share of the mini-batch loss, and per-token-summed diagnostics.

    loss = aggregate(w * policy_loss(logprobs, old_logprobs, A) + kl_coef * KL(logprobs, ref_logprobs)
    - entropy_coef * H + jsd_weight * JSD_beta(student || teacher)), following GRPO (Shao et al. 2024, eq. 3) with TRL GRPOTrainer's placement of the
    KL inside the per-token loss (grpo_trainer.py lines 3146-3150: the IS weight multiplies the policy loss
    only, then the KL is added). Summing the returned loss over the micro-batches of a mini-batch (and
    averaging gradients over ranks) gives the full mini-batch loss.

    What is corrected against what (``spec.correction``): three policies meet here. pi_rollout sampled the
    tokens (the engine's numerics; in async mode also a policy up to rollout.max_staleness versions older),
    pi_old is the learner's policy at the start of the step (``old_logprobs``), pi_theta the one being
    updated. w = f(pi_old / pi_rollout) (``algos.rollout_correction_weights``) corrects the behaviour
    mismatch, staleness included, and is detached; the policy loss's own ratio pi_theta / pi_old (PPO's clip,
    CISPO's weight, GSPO's length-normalised sequence ratio exp(mean_t log(pi_theta / pi_old))) keeps the
    trust region around pi_old. The two multiply (decoupled PPO: Hilton et al. 2022, "Batch size-invariance
    for policy optimization", Sec. 3; TRL applies its vLLM IS ratio the same way): a token clipped by PPO
    stays clipped whatever w is, and w scales the gradient of the others. With GSPO and a sequence mode, the
    sequence weight is the unnormalised product prod_t pi_old / pi_rollout (TRL's), not GSPO's mean; with a
    token mode, GSPO-token's token t carries w_t on its own gradient, where TRL's sequence form spreads
    mean_t(w_t) over the row (same value and same per-row gradient sum; pinned in test_trl_reference.py). On-policy
    (one epoch, one mini-batch) pi_old is the detached pi_theta, so only w departs from 1.

    Args:
        logprobs: [B, T] float32 current policy logprobs (with grad).
        mb: the micro-batch (``StepBatch``): old_logprobs [B, T], advantages [B, T], response_mask [B, T] bool,
            ref_logprobs [B, T] when there is a reference model (else None), rollout_logprobs [B, T] when the
            engine reported them (required with a correction mode).
        spec: objective choice and coefficients.
        norm: global denominators of the mini-batch.
        entropy: [B, T] float32 per-token policy entropy in nats (with grad); required when
            ``spec.entropy_coef > 0``.
        jsd: [B, T] float32 per-token generalized JSD to the teacher in nats (with grad; ``algos.generalized_jsd``),
            required when ``spec.jsd_weight > 0``. It is aggregated with the policy loss under the same mask and
            ``loss_agg`` (TRL's DistillationTrainer: token-mean), so observation tokens are never distilled.

    Returns:
        loss: scalar float32 to call backward on.
        stats: ``STAT_KEYS`` as 0-dim tensors, sums over this micro-batch's valid tokens unless said otherwise
            (``_stats``).

    Raises:
        ValueError: entropy_coef > 0 without ``entropy``, jsd_weight > 0 without ``jsd``, or a correction mode
            without rollout_logprobs.
    """
    mask = mb.response_mask
    pg_loss, diag = _policy_loss(logprobs, mb, spec)
    per_token = pg_loss
    weights = corrected = None
    if spec.correction != "none":
        if mb.rollout_logprobs is None:
            raise ValueError(f"policy_objective: rollout correction {spec.correction!r} needs rollout_logprobs")
        weights, corrected = algos.rollout_correction_weights(
            mb.old_logprobs, mb.rollout_logprobs, mask,
            mode=spec.correction, ratio_min=spec.correction_min, ratio_max=spec.correction_max,
        )  # fmt: skip
        per_token = per_token * weights
    kl_k3 = None  # the logged algo/kl (and the KL guard's input) is always the k3 estimate, whatever the loss uses
    if mb.ref_logprobs is not None:
        kl = algos.kl_penalty(logprobs, mb.ref_logprobs, spec.kl_estimator)
        kl_k3 = kl if spec.kl_estimator == "k3" else algos.kl_penalty(logprobs.detach(), mb.ref_logprobs, "k3")
        if spec.kl_coef > 0:
            per_token = per_token + spec.kl_coef * kl
    if spec.entropy_coef > 0:
        if entropy is None:
            raise ValueError("policy_objective: entropy_coef > 0 needs the per-token entropy")
        per_token = per_token + algos.entropy_bonus_loss(entropy, mask, coef=spec.entropy_coef)
    if spec.jsd_weight > 0:
        if jsd is None:
            raise ValueError("policy_objective: jsd_weight > 0 needs the per-token JSD to the teacher")
        per_token = per_token + spec.jsd_weight * jsd
    loss = algos.aggregate_loss(
        per_token,
        mask,
        spec.loss_agg,
        num_tokens=norm.num_tokens,
        num_sequences=norm.num_sequences,
        max_response_tokens=spec.max_response_tokens,
    ) * norm.world_size
    stats = _stats(mask, pg_loss, diag, kl_k3, entropy)
    stats["jsd_sum"] = _masked_sum(jsd, mask)
    stats.update(_mismatch_stats(mb, mask, weights, corrected))
    return loss, stats


def _stats(mask, pg_loss, diag, kl, entropy) -> dict[str, torch.Tensor]:
    return {
        "pg_loss_sum": _masked_sum(pg_loss, mask),
        "kl_sum": _masked_sum(kl, mask),
        "clipped_sum": _masked_sum(diag["clipped_low"] + diag["clipped_high"], mask),
        "dual_clipped_sum": _masked_sum(diag.get("dual_clipped"), mask),
        "entropy_sum": _masked_sum(entropy, mask),
        "tokens": mask.float().sum(),
    }


def _masked_sum(x: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    if x is None:
        return torch.zeros(())
    return torch.where(mask, x.detach().float(), torch.zeros_like(x, dtype=torch.float32)).sum()


def _mismatch_stats(mb: StepBatch, mask, weights, corrected) -> dict[str, torch.Tensor]:
    """Returns the rollout/learner mismatch statistics of a micro-batch (0 where rollout_logprobs are absent).

    rollout_diff_sum: sum of |rollout - old| (nats); rollout_kl_sum: sum of the k3 estimate of
    KL(pi_rollout || pi_old) on the sampled tokens, exp(old - rollout) - (old - rollout) - 1 (nats; Schulman
    2020, samples from pi_rollout); rollout_ratio_max: the largest token ratio pi_old / pi_rollout (log-ratio
    bounded at LOG_RATIO_BOUND; a max, not a sum); is_weight_sum: sum of the correction weights;
    corrected_tokens: valid tokens truncated or masked; corrected_sequences: rows with one or more such
    tokens; sequences: rows with one or more valid tokens.
    """
    zero = torch.zeros(())
    out = {"sequences": mask.any(dim=-1).float().sum(), "is_weight_sum": _masked_sum(weights, mask)}
    out["corrected_tokens"] = zero if corrected is None else corrected.float().sum()
    out["corrected_sequences"] = zero if corrected is None else corrected.any(dim=-1).float().sum()
    if mb.rollout_logprobs is None:
        return {**out, "rollout_diff_sum": zero, "rollout_kl_sum": zero, "rollout_ratio_max": zero}
    rollout, old = mb.rollout_logprobs.float(), mb.old_logprobs.float()
    log_ratio = torch.where(mask, old - rollout, torch.zeros_like(old)).clamp(-algos.LOG_RATIO_BOUND, algos.LOG_RATIO_BOUND)
    ratio_max = torch.exp(log_ratio[mask]).max() if bool(mask.any()) else zero
    out["rollout_diff_sum"] = _masked_sum((rollout - old).abs(), mask)
    # k3 = exp(d) - d - 1 in float64: in float32 a gap of ~1e-5 nats cancels to noise and read -4.5e-10 (a KL below 0)
    out["rollout_kl_sum"] = _masked_sum(algos.kl_penalty(rollout.double(), old.double(), "k3"), mask)
    out["rollout_ratio_max"] = ratio_max
    return out
