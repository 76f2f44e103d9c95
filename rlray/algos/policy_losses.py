"""Per-token policy-gradient losses (PPO clip, GSPO, CISPO), rollout-mismatch correction and entropy.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

Shared signature of the policy losses (``rlray.algos.POLICY_LOSSES``):
    loss_fn(logprobs, old_logprobs, advantages, response_mask, *, clip_eps_low, clip_eps_high)
        -> (per_token_loss [B, T], diagnostics {name: [B, T] float32})
``logprobs`` [B, T] float32 carry the gradient; ``old_logprobs`` [B, T] float32 (the policy that sampled the
batch, as recomputed by the learner) and ``advantages`` [B, T] float32 (a per-sequence advantage broadcast by
the caller) are detached; ``response_mask`` [B, T] bool. Losses and diagnostics are 0 at masked positions and
values there never reach the result (``torch.where``, not products). Reduce with ``aggregate_loss`` (and
``masked_mean`` for diagnostics).

The ratio is exp(logprobs - old_logprobs) with each token's log-ratio first clamped to
[-LOG_RATIO_BOUND, LOG_RATIO_BOUND] nats (also in GSPO, CISPO and truncated IS): exp overflows fp32 past
88.7 nats, and an inf ratio made PPO's loss inf and its gradient inf or NaN (0 * inf in the backward of a
``torch.where`` or ``maximum``), as stale old or rollout logprobs can produce. Inside the bound nothing changes;
outside it the ratio is e^+-20 and the clamped log-ratio passes no gradient. Source: verl ``core_algos.py
compute_policy_loss`` clamps negative_approx_kl to [-20, 20] before exp. TRL 1.16 does not clamp.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_RATIO_BOUND = 20.0
"""Nats: every log-ratio is clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] before exp (ratio <= 4.85e8), as verl."""


def _log_ratio(logprobs: Tensor, other_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Returns [B, T] logprobs - other_logprobs clamped to +-LOG_RATIO_BOUND nats, 0 at masked positions."""
    diff = torch.where(response_mask, logprobs - other_logprobs, torch.zeros_like(logprobs))
    return diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _check(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, fn: str) -> None:
    shapes = {
        n: tuple(x.shape)
        for n, x in (
            ("logprobs", logprobs),
            ("old_logprobs", old_logprobs),
            ("advantages", advantages),
            ("response_mask", response_mask),
        )
    }
    if len(set(shapes.values())) != 1 or logprobs.dim() != 2:
        raise ValueError(f"{fn}: all inputs must be [B, T] of one shape, got {shapes}")
    if response_mask.dtype != torch.bool:
        raise ValueError(f"{fn}: response_mask must be bool (True = counts), got {response_mask.dtype}")


def _check_eps(clip_eps_low: float, clip_eps_high: float, fn: str) -> None:
    if not 0.0 <= clip_eps_low <= 1.0:
        raise ValueError(f"{fn}: clip_eps_low={clip_eps_low} must be in [0, 1] (ratio >= 1 - clip_eps_low)")
    if clip_eps_high < 0.0:
        raise ValueError(f"{fn}: clip_eps_high={clip_eps_high} must be >= 0 (ratio <= 1 + clip_eps_high)")


def _clip_loss(ratio: Tensor, advantages: Tensor, low: float, high: float) -> Tensor:
    """Returns max(-A * r, -A * clip(r, low, high)), the negated PPO surrogate."""
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(low, high))


def _diagnostics(ratio: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float) -> dict[str, Tensor]:
    zero = torch.zeros_like(ratio)
    return {
        "ratio": torch.where(mask, ratio, zero).detach(),
        "clipped_low": ((ratio < low) & (advantages < 0) & mask).to(ratio.dtype).detach(),
        "clipped_high": ((ratio > high) & (advantages > 0) & mask).to(ratio.dtype).detach(),
    }


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Returns (per-token loss [B, T], diagnostics) of PPO's clipped surrogate with clip-higher and dual-clip.

    loss_t = max(-A r, -A clip(r, 1 - clip_eps_low, 1 + clip_eps_high)), r = exp(logprobs - old_logprobs)
    with the log-ratio clamped to +-LOG_RATIO_BOUND nats (module docstring; verl does the same), so the loss and
    its gradient are finite for any finite log-ratio. With ``dual_clip = c`` (> 1), tokens with A < 0 use
    min(loss_t, -c A), bounding the loss when r >> 1.

    Args:
        logprobs: [B, T] float32 current-policy log-probabilities of the sampled tokens, with grad.
        old_logprobs: [B, T] float32 log-probabilities under the policy that sampled the batch, detached.
        advantages: [B, T] float32 per-token advantages (a per-sequence one broadcast by the caller), detached.
        response_mask: [B, T] bool, True on tokens that count; values elsewhere are ignored.
        clip_eps_low: lower clip range, in [0, 1] (PPO 0.2).
        clip_eps_high: upper clip range, >= 0 (DAPO's clip-higher uses 0.28).
        dual_clip: the dual-clip constant c > 1 (3.0 in verl), or None to disable.

    Returns:
        (loss [B, T], diagnostics): "ratio"; "clipped_low" (r < 1 - eps_low and A < 0); "clipped_high"
        (r > 1 + eps_high and A > 0); "dual_clipped" (A < 0 and the -c A bound is active); each [B, T] float32.
        "ratio" is the bounded ratio, in [e^-20, e^20].

    Raises:
        ValueError: shapes differ, mask not bool, eps out of range, or dual_clip <= 1.

    Source: Schulman et al. 2017 (PPO) eq. 7; Yu et al. 2025 (DAPO) Sec. 3.1 (clip-higher); Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep RL" (dual-clip PPO); verl ``compute_policy_loss``;
    TRL 1.16 ``GRPOTrainer._compute_loss`` (grpo_trainer.py lines 3112-3120, clip metrics 3274-3275).
    """
    _check(logprobs, old_logprobs, advantages, response_mask, "ppo_clip_loss")
    _check_eps(clip_eps_low, clip_eps_high, "ppo_clip_loss")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"ppo_clip_loss: dual_clip={dual_clip} must be > 1 (or None)")
    zero = torch.zeros_like(logprobs)
    advantages = torch.where(response_mask, advantages, torch.zeros_like(advantages))
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, response_mask))
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    loss = _clip_loss(ratio, advantages, low, high)
    diagnostics = _diagnostics(ratio, advantages, response_mask, low, high)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
        diagnostics["dual_clipped"] = (dual_active & response_mask).to(loss.dtype).detach()
    else:
        diagnostics["dual_clipped"] = zero.detach()
    return torch.where(response_mask, loss, zero), diagnostics


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Returns (per-token loss [B, T], diagnostics) of GSPO's clipped sequence-level-ratio objective.

    s_i = exp(mean over valid tokens of (logprobs - old_logprobs)), the length-normalised sequence ratio, with
    each token's log-ratio clamped to +-LOG_RATIO_BOUND nats first (so the mean, and s_i, are bounded too, and
    the sum cannot overflow; verl's GSPO clamps the sequence log-ratio at 10 instead).
    Token form (GSPO-token): s_it = sg(s_i) * exp(logprobs_t - sg(logprobs_t)), whose value is s_i and whose
    gradient flows through token t only; loss_t = max(-A_t s_it, -A_t clip(s_it, 1 - eps_low, 1 + eps_high)).
    With a per-sequence advantage and ``seq-mean-token-mean`` aggregation this is exactly GSPO's objective
    (value and gradient). The paper uses tiny clip ranges (3e-4, 4e-4).

    Args:
        logprobs: [B, T] float32 current-policy log-probabilities of the sampled tokens, with grad.
        old_logprobs: [B, T] float32 log-probabilities under the policy that sampled the batch, detached.
        advantages: [B, T] float32 per-token advantages (a per-sequence one broadcast by the caller), detached.
        response_mask: [B, T] bool, True on tokens that count; values elsewhere are ignored.
        clip_eps_low: lower clip range of the sequence ratio, in [0, 1].
        clip_eps_high: upper clip range, >= 0.

    Returns:
        (loss [B, T], {"ratio" (s_i on each valid token), "clipped_low", "clipped_high"}), [B, T] float32.

    Raises:
        ValueError: shapes differ, mask not bool, or eps out of range.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization", Sec. 4.1 (GSPO) and 4.3 (GSPO-token);
    TRL 1.16 ``GRPOTrainer._compute_loss`` with importance_sampling_level="sequence" (grpo_trainer.py lines 3084-3089).
    """
    _check(logprobs, old_logprobs, advantages, response_mask, "gspo_loss")
    _check_eps(clip_eps_low, clip_eps_high, "gspo_loss")
    zero = torch.zeros_like(logprobs)
    log_ratio = _log_ratio(logprobs, old_logprobs, response_mask)
    num_tokens = response_mask.sum(dim=-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / num_tokens).detach()
    token_logprobs = torch.where(response_mask, logprobs, zero)
    ratio = torch.exp(seq_log_ratio + token_logprobs - token_logprobs.detach())
    advantages = torch.where(response_mask, advantages, torch.zeros_like(advantages))
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    loss = _clip_loss(ratio, advantages, low, high)
    return torch.where(response_mask, loss, zero), _diagnostics(ratio, advantages, response_mask, low, high)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Returns (per-token loss [B, T], diagnostics) of CISPO: a REINFORCE loss weighted by a clipped, detached IS ratio.

    loss_t = -sg(clip(r_t, 1 - clip_eps_low, 1 + clip_eps_high)) * A_t * logprobs_t, the log-ratio of r_t clamped
    to +-LOG_RATIO_BOUND nats (module docstring: the weight stays finite even with a huge clip_eps_high; with no
    lower clip a ratio below e^-20 weighs e^-20). Unlike PPO no token loses
    its gradient; the clip only bounds the weight. ``clip_eps_low=1.0`` disables the lower bound (MiniMax-M1
    and TRL use none); TRL's ``epsilon_high`` (an absolute cap, e.g. 5.0) is ``1 + clip_eps_high`` here.

    Args:
        logprobs: [B, T] float32 current-policy log-probabilities of the sampled tokens, with grad.
        old_logprobs: [B, T] float32 log-probabilities under the policy that sampled the batch, detached.
        advantages: [B, T] float32 per-token advantages (a per-sequence one broadcast by the caller), detached.
        response_mask: [B, T] bool, True on tokens that count; values elsewhere are ignored.
        clip_eps_low: lower clip range of the weight, in [0, 1].
        clip_eps_high: upper clip range of the weight, >= 0.

    Returns:
        (loss [B, T], {"ratio", "clipped_low" (r < 1 - eps_low), "clipped_high" (r > 1 + eps_high)}),
        [B, T] float32; CISPO's clip counts regardless of the advantage's sign.

    Raises:
        ValueError: shapes differ, mask not bool, or eps out of range.

    Source: MiniMax 2025, "MiniMax-M1" Sec. 3.1 (CISPO); TRL 1.16 ``GRPOTrainer._compute_loss`` loss_type
    "cispo" (grpo_trainer.py lines 3109-3111).
    """
    _check(logprobs, old_logprobs, advantages, response_mask, "cispo_loss")
    _check_eps(clip_eps_low, clip_eps_high, "cispo_loss")
    zero = torch.zeros_like(logprobs)
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, response_mask)).detach()
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    weight = ratio.clamp(low, high)
    advantages = torch.where(response_mask, advantages, torch.zeros_like(advantages))
    loss = -weight * advantages * torch.where(response_mask, logprobs, zero)
    diagnostics = {
        "ratio": torch.where(response_mask, ratio, zero),
        "clipped_low": ((ratio < low) & response_mask).to(ratio.dtype),
        "clipped_high": ((ratio > high) & response_mask).to(ratio.dtype),
    }
    return torch.where(response_mask, loss, zero), diagnostics


POLICY_LOSSES = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
"""The policy losses by name, one signature (above); "ppo_clip" also takes dual_clip=."""

ROLLOUT_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""The four rollout-correction modes of TRL 1.16 (``GRPOConfig.vllm_importance_sampling_mode``)."""


@torch.no_grad()
def rollout_correction_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    mode: str,
    ratio_min: float | None = None,
    ratio_max: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns ([B, T] float32 detached importance weights, [B, T] bool corrected) for the rollout/learner mismatch.

    The batch was sampled by the rollout engine (pi_rollout: vLLM kernels and precision, and in async mode a
    policy up to rollout.max_staleness versions older); the learner's objective is about pi_old, its own
    recomputation of the policy at the start of the step. The weight corrects against the behaviour policy
    that really sampled: r = pi_old / pi_rollout of the sampled token ("token_*": r_t = exp(old_t - rollout_t))
    or of the whole response ("sequence_*": r = exp(sum over valid tokens of (old_t - rollout_t)), the same
    value on every token of the row). Then, with bounds [C_min, C_max] (None = unbounded on that side):
        *_truncate: w = clip(r, C_min, C_max)                  (truncated IS; keeps every sample)
        *_mask:     w = r if C_min <= r <= C_max else 0        (masked IS; drops the token or sequence)
    Multiply the per-token policy loss by w before aggregation (the denominators keep masked tokens, as TRL).

    Log-ratio bound (module docstring): each token's log-ratio is clamped to +-LOG_RATIO_BOUND nats and, in the
    sequence modes, so is the row's summed log-ratio before exp, so every weight lies in [0, e^20] and no
    inf - inf or overflow makes a NaN. Whether a ratio is outside [C_min, C_max] is decided on the summed,
    unclamped-at-row-level log-ratio, so masking matches TRL for any bound. Inside the bound the weights equal
    TRL's.

    Args:
        old_logprobs: [B, T] float32 learner log-probabilities of the sampled tokens before the update (pi_old).
        rollout_logprobs: [B, T] float32 log-probabilities the rollout engine reported for the same tokens.
        response_mask: [B, T] bool, True on tokens that count (sampled tokens; not observations or padding).
        mode: one of ``ROLLOUT_CORRECTION_MODES``.
        ratio_min: C_min > 0, or None (no lower bound).
        ratio_max: C_max > 0, or None (no upper bound).

    Returns:
        weights: [B, T] float32, 0 at masked positions.
        corrected: [B, T] bool, True on valid tokens whose ratio lay outside [C_min, C_max] (truncated, or
            masked to 0); in the sequence modes every valid token of such a row.

    Raises:
        ValueError: shapes differ, mask not bool, unknown mode, a bound <= 0, C_min >= C_max, or a truncate
            mode with neither bound.

    Source: TRL 1.16 ``GRPOTrainer._generate_and_score_completions`` (grpo_trainer.py lines 2660-2705) and
    ``GRPOConfig`` vllm_importance_sampling_mode / _clip_min / _clip_max; Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training" (token TIS); verl/NeMo-RL masked (rejection) IS.
    """
    _check_correction(old_logprobs, rollout_logprobs, response_mask, mode, ratio_min, ratio_max)
    log_ratio = _log_ratio(old_logprobs, rollout_logprobs, response_mask)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    log_min = -math.inf if ratio_min is None else math.log(ratio_min)
    log_max = math.inf if ratio_max is None else math.log(ratio_max)
    outside = (log_ratio < log_min) | (log_ratio > log_max)
    truncate = mode.endswith("truncate")
    log_weight = log_ratio.clamp(log_min, log_max) if truncate else log_ratio
    weights = torch.exp(log_weight.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    keep = response_mask if truncate else response_mask & ~outside
    return torch.where(keep, weights, torch.zeros_like(weights)), outside & response_mask


def _check_correction(old, rollout, mask, mode: str, ratio_min: float | None, ratio_max: float | None) -> None:
    fn = "rollout_correction_weights"
    if not (old.shape == rollout.shape == mask.shape) or mask.dtype != torch.bool:
        raise ValueError(
            f"{fn}: old_logprobs {tuple(old.shape)}, rollout_logprobs {tuple(rollout.shape)} and bool "
            f"response_mask {tuple(mask.shape)} must match"
        )
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"{fn}: unknown mode {mode!r}; expected one of {ROLLOUT_CORRECTION_MODES}")
    for name, bound in (("ratio_min", ratio_min), ("ratio_max", ratio_max)):
        if bound is not None and not bound > 0:
            raise ValueError(f"{fn}: {name}={bound} must be > 0 (or None)")
    if ratio_min is not None and ratio_max is not None and ratio_min >= ratio_max:
        raise ValueError(f"{fn}: ratio_min={ratio_min} must be below ratio_max={ratio_max}")
    if mode.endswith("truncate") and ratio_min is None and ratio_max is None:
        raise ValueError(f"{fn}: mode {mode!r} needs ratio_min or ratio_max")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Returns [B, T] float32 entropy in nats of the categorical distributions given by ``logits``.

    H = logsumexp(z) - sum_v softmax(z)_v z_v, differentiable. For large V, call it on chunks of tokens.

    Args:
        logits: [B, T, V] float (bf16 is upcast to float32 here).

    Raises:
        ValueError: ``logits`` has fewer than 2 dimensions.

    Source: definition of Shannon entropy; verl ``verl_F.entropy_from_logits`` uses the same identity.
    """
    if logits.dim() < 2:
        raise ValueError(f"entropy_from_logits: logits must be [..., V], got {tuple(logits.shape)}")
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_bonus_loss(entropy: Tensor, response_mask: Tensor, *, coef: float) -> Tensor:
    """Returns [B, T] float32 per-token loss -coef * entropy (0 at masked positions) to add to the policy loss.

    Adding it before ``aggregate_loss`` makes the entropy bonus use the same normaliser as the policy term.

    Args:
        entropy: [B, T] float32 per-token entropy in nats (``entropy_from_logits``), with grad.
        response_mask: [B, T] bool, True on tokens that count.
        coef: entropy coefficient (>= 0; 0 disables the bonus).

    Raises:
        ValueError: shapes differ, mask not bool, or coef < 0.

    Source: Mnih et al. 2016 (A3C) entropy regularisation; Schulman et al. 2017 (PPO) eq. 9, c2 * S.
    Deviation: TRL 1.16 always token-means its entropy term; here it follows the policy loss's aggregation.
    """
    if entropy.shape != response_mask.shape or response_mask.dtype != torch.bool:
        raise ValueError(
            f"entropy_bonus_loss: entropy {tuple(entropy.shape)} and bool response_mask "
            f"{tuple(response_mask.shape)} must match"
        )
    if coef < 0:
        raise ValueError(f"entropy_bonus_loss: coef={coef} must be >= 0")
    return torch.where(response_mask, -coef * entropy, torch.zeros_like(entropy))
