"""Preference losses: DPO (sigmoid, IPO, robust, hinge), KTO, ORPO, SimPO and the Bradley-Terry reward loss.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary. Here P counts preference pairs (one chosen, one rejected each).

Inputs are sequence log-probabilities [P] float32: the sum over the response tokens of the token
log-probabilities (``sequence_logps``), in nats. ``ref_*`` come from the frozen reference policy, computed
once per pair, and are detached. Every loss returns per-pair (or per-example) values; the caller takes the
mean (or a global-normalised sum, as in aggregation.py) over the mini-batch.

Shared signature of the DPO family (``rlray.algos.PAIRWISE_LOSSES``):
    loss_fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta) -> [P]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def sequence_logps(logprobs: Tensor, response_mask: Tensor, *, average: bool = False) -> Tensor:
    """Returns [B] float32 per-sequence log-probability: the sum (or mean) of token logprobs over valid tokens.

    Args:
        logprobs: [B, T] float32 token log-probabilities in nats; masked values are ignored.
        response_mask: [B, T] bool, True on response tokens that count.
        average: divide by the number of valid tokens (ORPO, SimPO, IPO's per-token form). A row without
            valid tokens gives 0.

    Raises:
        ValueError: shapes differ or the mask is not bool.

    Source: TRL 1.16 ``DPOTrainer._compute_loss`` (dpo_trainer.py line 1304, sum) and
    ``ORPOTrainer.get_batch_logps(average_log_prob=True)`` (experimental/orpo/orpo_trainer.py line 740).
    """
    if logprobs.shape != response_mask.shape or response_mask.dtype != torch.bool:
        raise ValueError(
            f"sequence_logps: logprobs {tuple(logprobs.shape)} and bool response_mask "
            f"{tuple(response_mask.shape)} must match"
        )
    total = torch.where(response_mask, logprobs, torch.zeros_like(logprobs)).sum(dim=-1)
    if average:
        total = total / response_mask.sum(dim=-1).clamp(min=1).to(total.dtype)
    return total


def _check_pairs(fn: str, beta: float, **tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or next(iter(tensors.values())).dim() != 1:
        raise ValueError(f"{fn}: inputs must all be [P] of one shape, got {shapes}")
    if beta <= 0:
        raise ValueError(f"{fn}: beta={beta} must be > 0")


def _dpo_margin(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    fn: str,
    beta: float,
) -> Tensor:
    """Returns [P] (log pi/ref)(chosen) - (log pi/ref)(rejected), the DPO implicit-reward margin / beta."""
    _check_pairs(
        fn,
        beta,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    return (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)


def dpo_sigmoid_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, *, beta: float
) -> Tensor:
    """Returns [P] float32 DPO losses -log sigmoid(beta * margin), margin = log-ratio(chosen) - log-ratio(rejected).

    Args:
        chosen_logps: [P] float32 policy sequence logprobs of the chosen responses (summed, nats), with grad.
        rejected_logps: [P] float32 policy sequence logprobs of the rejected responses, with grad.
        ref_chosen_logps: [P] float32 reference sequence logprobs of the chosen responses, detached.
        ref_rejected_logps: [P] float32 reference sequence logprobs of the rejected responses, detached.
        beta: KL strength (> 0), 0.1 typical.

    Raises:
        ValueError: shapes differ or beta <= 0.

    Source: Rafailov et al. 2023 (DPO) eq. 7; TRL 1.16 ``DPOTrainer._compute_loss`` loss_type "sigmoid"
    (dpo_trainer.py lines 1351-1388).
    """
    margin = _dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, "dpo_sigmoid_loss", beta)
    return -F.logsigmoid(beta * margin)


def dpo_hinge_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, *, beta: float
) -> Tensor:
    """Returns [P] float32 hinge losses relu(1 - beta * margin) (SLiC-style DPO).

    Args:
        chosen_logps: [P] float32 policy sequence logprobs of the chosen responses (summed, nats), with grad.
        rejected_logps: [P] float32 policy sequence logprobs of the rejected responses, with grad.
        ref_chosen_logps: [P] float32 reference sequence logprobs of the chosen responses, detached.
        ref_rejected_logps: [P] float32 reference sequence logprobs of the rejected responses, detached.
        beta: margin scale (> 0); the hinge sits at margin 1 / beta.

    Raises:
        ValueError: shapes differ or beta <= 0.

    Source: Zhao et al. 2023 (SLiC-HF) hinge loss, on the DPO log-ratio margin as in Liu et al. 2024 (RSO);
    TRL 1.16 ``DPOTrainer._compute_loss`` loss_type "hinge" (dpo_trainer.py lines 1390-1391).
    """
    margin = _dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, "dpo_hinge_loss", beta)
    return torch.relu(1.0 - beta * margin)


def ipo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    chosen_num_tokens: Tensor | None = None,
    rejected_num_tokens: Tensor | None = None,
) -> Tensor:
    """Returns [P] float32 IPO losses (margin - 1 / (2 beta))^2.

    With ``chosen_num_tokens`` and ``rejected_num_tokens`` each log ratio is first divided by its response
    length (TRL 1.16's form, "confirmed with the IPO authors"); without them the paper's summed form is used.

    Args:
        chosen_logps: [P] float32 policy sequence logprobs of the chosen responses (summed, nats), with grad.
        rejected_logps: [P] float32 policy sequence logprobs of the rejected responses, with grad.
        ref_chosen_logps: [P] float32 reference sequence logprobs of the chosen responses, detached.
        ref_rejected_logps: [P] float32 reference sequence logprobs of the rejected responses, detached.
        beta: the IPO regulariser tau (> 0).
        chosen_num_tokens: [P] int64 chosen response lengths in tokens (floored to 1), or None.
        rejected_num_tokens: [P] int64 rejected response lengths in tokens, or None (give both or neither).

    Raises:
        ValueError: shapes differ, beta <= 0, or only one of the token counts given.

    Source: Azar et al. 2023, "A General Theoretical Paradigm..." eq. 17; TRL 1.16 ``DPOTrainer._compute_loss``
    loss_type "ipo" (dpo_trainer.py lines 1393-1404).
    """
    _check_pairs(
        "ipo_loss",
        beta,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if (chosen_num_tokens is None) != (rejected_num_tokens is None):
        raise ValueError("ipo_loss: give both chosen_num_tokens and rejected_num_tokens, or neither")
    if chosen_num_tokens is not None:
        chosen_ratio = chosen_ratio / chosen_num_tokens.clamp(min=1).to(chosen_ratio.dtype)
        rejected_ratio = rejected_ratio / rejected_num_tokens.clamp(min=1).to(rejected_ratio.dtype)
    return (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)).square()


def robust_dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Returns [P] float32 robust-DPO losses, unbiased under labels flipped with probability ``label_smoothing``.

    ((1 - e) * -log sigmoid(beta m) - e * -log sigmoid(-beta m)) / (1 - 2e) with m the DPO margin and
    e = label_smoothing. e = 0 gives ``dpo_sigmoid_loss``.

    Args:
        chosen_logps: [P] float32 policy sequence logprobs of the chosen responses (summed, nats), with grad.
        rejected_logps: [P] float32 policy sequence logprobs of the rejected responses, with grad.
        ref_chosen_logps: [P] float32 reference sequence logprobs of the chosen responses, detached.
        ref_rejected_logps: [P] float32 reference sequence logprobs of the rejected responses, detached.
        beta: KL strength (> 0).
        label_smoothing: assumed label-flip rate e, in [0, 0.5).

    Raises:
        ValueError: shapes differ, beta <= 0, or label_smoothing outside [0, 0.5).

    Source: Chowdhury et al. 2024, "Provably Robust DPO" (the rDPO loss); TRL 1.16 ``DPOTrainer._compute_loss``
    loss_type "robust" (dpo_trainer.py lines 1428-1431).
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust_dpo_loss: label_smoothing={label_smoothing} must be in [0, 0.5)")
    margin = _dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, "robust_dpo_loss", beta)
    clean = -(1.0 - label_smoothing) * F.logsigmoid(beta * margin)
    flipped = -label_smoothing * F.logsigmoid(-beta * margin)
    return (clean - flipped) / (1.0 - 2.0 * label_smoothing)


@torch.no_grad()
def kto_kl_estimate(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """Returns the 0-dim KTO reference point z_ref = max(0, mean(kl_logps - ref_kl_logps)), detached, in nats.

    Args:
        kl_logps: [B] float32 policy sequence logprobs of *mismatched* (prompt, completion) pairs (the
            completions shifted by one within the batch).
        ref_kl_logps: [B] float32 reference sequence logprobs of the same mismatched pairs.

    Under data parallelism, average the per-rank means before clamping (TRL gathers them).

    Raises:
        ValueError: shapes differ.

    Source: Ethayarajh et al. 2024 (KTO) eq. 7's z_ref and Sec. 4.1 (mismatched-pair estimate); TRL 1.16
    ``KTOTrainer._compute_loss`` (kto_trainer.py lines 1442-1444).
    """
    if kl_logps.shape != ref_kl_logps.shape:
        raise ValueError(
            f"kto_kl_estimate: kl_logps {tuple(kl_logps.shape)} and ref_kl_logps {tuple(ref_kl_logps.shape)} differ"
        )
    return (kl_logps - ref_kl_logps).mean().clamp(min=0.0)


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    desirable_mask: Tensor,
    kl_estimate: Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> Tensor:
    """Returns [B] float32 KTO losses for unpaired examples labelled desirable or undesirable.

    With r = logps - ref_logps and z = ``kl_estimate``: desirable rows give w_d * (1 - sigmoid(beta (r - z))),
    undesirable rows w_u * (1 - sigmoid(beta (z - r))). TRL's batch loss is the mean over all rows.

    Args:
        logps: [B] float32 policy sequence logprobs (summed, nats), with grad.
        ref_logps: [B] float32 reference sequence logprobs, detached.
        desirable_mask: [B] bool, True for desirable (chosen) examples.
        kl_estimate: 0-dim tensor or float z_ref from ``kto_kl_estimate`` (0 disables it).
        beta: KL strength (> 0).
        desirable_weight: lambda_D, the weight of desirable rows (> 0).
        undesirable_weight: lambda_U, the weight of undesirable rows (> 0).

    Raises:
        ValueError: shapes differ, mask not bool, beta or a weight <= 0.

    Source: Ethayarajh et al. 2024 (KTO) eq. 7; TRL 1.16 ``KTOTrainer._compute_loss`` loss_type "kto"
    (kto_trainer.py lines 1448-1483).
    """
    _check_pairs("kto_loss", beta, logps=logps, ref_logps=ref_logps, desirable_mask=desirable_mask)
    if desirable_mask.dtype != torch.bool:
        raise ValueError(f"kto_loss: desirable_mask must be bool, got {desirable_mask.dtype}")
    if desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError(
            f"kto_loss: desirable_weight={desirable_weight} and undesirable_weight={undesirable_weight} must be > 0"
        )
    logratio = logps - ref_logps
    desirable = desirable_weight * (1.0 - torch.sigmoid(beta * (logratio - kl_estimate)))
    undesirable = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl_estimate - logratio)))
    return torch.where(desirable_mask, desirable, undesirable)


def _log1mexp(x: Tensor) -> Tensor:
    """Returns log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (Maechler 2012)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_odds_ratio_loss(chosen_mean_logps: Tensor, rejected_mean_logps: Tensor, *, beta: float) -> Tensor:
    """Returns [P] float32 ORPO odds-ratio losses -beta * log sigmoid(log odds(chosen) - log odds(rejected)).

    log odds(y) = log p - log(1 - p) with log p the *length-averaged* logprob. The full ORPO loss is
    ``nll + mean(orpo_odds_ratio_loss)``, nll being the chosen responses' token-mean cross-entropy
    (``aggregate_loss(-logprobs, mask, "token-mean")``; TRL also counts prompt tokens there).

    Args:
        chosen_mean_logps: [P] float32 length-averaged policy logprobs of the chosen responses
            (``sequence_logps(..., average=True)``), < 0, with grad.
        rejected_mean_logps: [P] float32 the same for the rejected responses, < 0, with grad.
        beta: lambda, the odds-ratio weight (> 0), 0.1 typical.

    Raises:
        ValueError: shapes differ, beta <= 0, or a mean logprob >= 0 (log odds undefined).

    Source: Hong et al. 2024 (ORPO) eqs. 4 and 7; TRL 1.16 ``ORPOTrainer.odds_ratio_loss``
    (experimental/orpo/orpo_trainer.py lines 690-697).
    """
    _check_pairs(
        "orpo_odds_ratio_loss", beta, chosen_mean_logps=chosen_mean_logps, rejected_mean_logps=rejected_mean_logps
    )
    if (chosen_mean_logps >= 0).any() or (rejected_mean_logps >= 0).any():
        raise ValueError("orpo_odds_ratio_loss: mean logprobs must be < 0 (probability < 1) for the log odds")
    log_odds = (chosen_mean_logps - rejected_mean_logps) - (
        _log1mexp(chosen_mean_logps) - _log1mexp(rejected_mean_logps)
    )
    return -beta * F.logsigmoid(log_odds)


def simpo_loss(chosen_mean_logps: Tensor, rejected_mean_logps: Tensor, *, beta: float, gamma: float) -> Tensor:
    """Returns [P] float32 SimPO losses -log sigmoid(beta * (mean logp_chosen - mean logp_rejected) - gamma).

    Reference-free: the implicit reward is the length-averaged logprob scaled by beta, with target margin gamma.

    Args:
        chosen_mean_logps: [P] float32 length-averaged policy logprobs of the chosen responses
            (``sequence_logps(..., average=True)``), with grad.
        rejected_mean_logps: [P] float32 the same for the rejected responses, with grad.
        beta: reward scale (> 0), 2.0-2.5 in the paper.
        gamma: target reward margin, in units of beta-scaled nats (0.5-1.6 in the paper).

    Raises:
        ValueError: shapes differ or beta <= 0.

    Source: Meng et al. 2024 (SimPO) eq. 6; TRL 1.16 ``CPOTrainer.cpo_loss`` loss_type "simpo" with
    label_smoothing 0 (experimental/cpo/cpo_trainer.py lines 715-721; its simpo_gamma is gamma here).
    """
    _check_pairs("simpo_loss", beta, chosen_mean_logps=chosen_mean_logps, rejected_mean_logps=rejected_mean_logps)
    return -F.logsigmoid(beta * (chosen_mean_logps - rejected_mean_logps) - gamma)


def bradley_terry_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, *, margin: Tensor | None = None, center_coef: float = 0.0
) -> Tensor:
    """Returns [P] float32 reward-model losses -log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2.

    Args:
        chosen_rewards: [P] float32 reward-head scores of the chosen responses, with grad.
        rejected_rewards: [P] float32 reward-head scores of the rejected responses, with grad.
        margin: [P] float32 optional required gap (Llama-2's margin); None means 0.
        center_coef: weight of the centering term that pulls scores to zero mean (0 disables; 0.01 in
            Eisenstein et al.).

    Raises:
        ValueError: shapes differ or center_coef < 0.

    Source: Bradley & Terry 1952; Ouyang et al. 2022 (InstructGPT) eq. 1; centering from Eisenstein et al.
    2023, "Helping or Herding?"; TRL 1.16 ``RewardTrainer.compute_loss`` (reward_trainer.py lines
    788-795), whose batch loss is the mean of these values.
    """
    tensors = {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
    if margin is not None:
        tensors["margin"] = margin
    _check_pairs("bradley_terry_loss", 1.0, **tensors)
    if center_coef < 0:
        raise ValueError(f"bradley_terry_loss: center_coef={center_coef} must be >= 0")
    gap = chosen_rewards - rejected_rewards
    if margin is not None:
        gap = gap - margin
    return -F.logsigmoid(gap) + center_coef * (chosen_rewards + rejected_rewards).square()
