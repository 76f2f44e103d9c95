"""Advantage estimators from sequence rewards: GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline), ReMax.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

Group estimators take ``group_ids`` [B] int64: samples of one prompt share an id; groups may be ragged and
appear in any order (rows need not be contiguous). ``valid_mask`` [B] bool marks rows whose reward exists
(False e.g. for a failed reward call): such rows are left out of every statistic and get advantage 0.
Every function here is a pure computation under ``torch.no_grad`` and returns detached tensors.
GAE (it needs a critic) lives in value.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

STD_SCALES = ("group", "batch", "none")

SumFn = Callable[[Tensor], Tensor]
"""Sums a 0-dim tensor over the data-parallel ranks that share a batch (identity for one rank).

Batch-level statistics (GRPO's batch std, REINFORCE++ whitening) take one, so that every rank of a sharded step
computes the statistics of the whole step: the learner passes an all-reduce over its collective."""


def _local_sum(x: Tensor) -> Tensor:
    return x


# --------------------------------------------------------------------------------------------
# Group statistics
# --------------------------------------------------------------------------------------------
def _check_rewards(rewards: Tensor, group_ids: Tensor | None, valid_mask: Tensor | None, fn: str) -> Tensor:
    """Returns the [B] bool valid mask after checking shapes, dtypes and NaNs; raises ValueError."""
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"{fn}: rewards must be a [B] float tensor, got {tuple(rewards.shape)} {rewards.dtype}")
    if group_ids is not None and (group_ids.shape != rewards.shape or group_ids.is_floating_point()):
        raise ValueError(
            f"{fn}: group_ids must be a [B] integer tensor like rewards {tuple(rewards.shape)}, "
            f"got {tuple(group_ids.shape)} {group_ids.dtype}"
        )
    if valid_mask is None:
        valid_mask = torch.ones_like(rewards, dtype=torch.bool)
    elif valid_mask.shape != rewards.shape or valid_mask.dtype != torch.bool:
        raise ValueError(
            f"{fn}: valid_mask must be [B] bool like rewards {tuple(rewards.shape)}, "
            f"got {tuple(valid_mask.shape)} {valid_mask.dtype}"
        )
    bad = (~torch.isfinite(rewards)) & valid_mask
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{fn}: rewards[{row}]={rewards[row].item()} is not finite but valid_mask[{row}] is True; "
            "mark failed rewards with valid_mask=False"
        )
    return valid_mask


def group_mean_count(rewards: Tensor, group_ids: Tensor, valid_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (rewards with invalid rows zeroed [B], group mean per row [B], valid rows in the group per row [B]).

    Args:
        rewards: [B] float sequence rewards (float32, float64 or bfloat16; outputs keep the dtype); values of
            invalid rows are ignored.
        group_ids: [B] int64 group of each row (any order, ragged).
        valid_mask: [B] bool, True where the reward counts.

    Source: the per-group mean of GRPO (Shao et al. 2024, eq. 3's mean({r})), computed with index_add so
    groups need not be contiguous. A group without valid rows has mean 0 and count 0. The mean of a
    constant group (every valid reward equal, max == min) is that reward exactly: sum / count rounds in
    floating point (fp32 0.1 * 3 / 3 != 0.1), and the ulp left in r - mean would otherwise be blown up by a
    std division (GRPO advantages of 0.05 to 0.4, and far more in bfloat16, where 0 is right).
    """
    zeroed = torch.where(valid_mask, rewards, torch.zeros_like(rewards))
    sums = _per_group_sum(zeroed, group_ids)
    counts = _per_group_sum(valid_mask.to(rewards.dtype), group_ids)
    highest, lowest = group_max_min(rewards, group_ids, valid_mask)
    mean = torch.where(highest == lowest, highest, sums / counts.clamp(min=1.0))
    return zeroed, mean, counts


def group_max_min(values: Tensor, group_ids: Tensor, valid_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Returns (max [B], min [B]): per row, the largest and smallest value over the valid rows of its group.

    Args:
        values: [B] float (any float dtype; outputs keep it); values of invalid rows are ignored.
        group_ids: [B] int64 group of each row (any order, ragged).
        valid_mask: [B] bool, True where the value counts.

    A group without valid rows gets max -inf and min +inf (so max == min never holds for it).
    Source: scatter_reduce amax/amin, the per-prompt spread test of verl DAPO ``filter_groups``.
    """
    inverse = torch.unique(group_ids, return_inverse=True)[1]
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    inf = torch.tensor(float("inf"), dtype=values.dtype, device=values.device)
    highest = (-inf).expand(num_groups).scatter_reduce(0, inverse, torch.where(valid_mask, values, -inf), "amax")
    lowest = inf.expand(num_groups).scatter_reduce(0, inverse, torch.where(valid_mask, values, inf), "amin")
    return highest[inverse], lowest[inverse]


def _per_group_sum(values: Tensor, group_ids: Tensor) -> Tensor:
    """Returns [B]: for each row, the sum of ``values`` over the rows of its group."""
    inverse = torch.unique(group_ids, return_inverse=True)[1]
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return sums[inverse]


def _unbiased_std(sq_deviation_sum: Tensor, counts: Tensor) -> Tensor:
    """Returns sqrt(sum dev^2 / (n - 1)), or 0 where n <= 1 (Bessel's correction, as TRL's nanstd)."""
    return torch.sqrt(sq_deviation_sum / (counts - 1.0).clamp(min=1.0)) * (counts > 1.0)


# --------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_scale: str = "group",
    eps: float = 1e-6,
    valid_mask: Tensor | None = None,
    sum_fn: SumFn | None = None,
) -> Tensor:
    """Returns [B] float32 per-sequence advantages (r - mean_g) / (std + eps), 0 for invalid rows.

    The mean is always the group mean over valid rows. ``std`` is the *unbiased* (Bessel, n - 1) standard
    deviation, as TRL 1.16 uses: of the row's group ("group"), of all valid rows ("batch", PPO-Lite), or no
    division at all ("none", Dr.GRPO). A group with one valid row has std 0 and advantage exactly 0. A
    constant-reward group (every valid reward equal) gives exactly 0 with every std_scale, group size, reward
    value and dtype: its mean is the common reward exactly (``group_mean_count``), so no rounding residue
    reaches the division.

    Args:
        rewards: [B] float32 sequence rewards (any float dtype; the output keeps it).
        group_ids: [B] int64; samples of one prompt share an id; ragged groups in any order.
        std_scale: "group" | "batch" | "none".
        eps: added to the std before dividing (TRL uses 1e-4, our config default is 1e-6).
        valid_mask: [B] bool, False for rows without a reward; None means all valid.
        sum_fn: with std_scale "batch", sums the batch statistics over data-parallel ranks (``SumFn``), so the
            std is the whole step's; None means this batch alone. Groups must not span ranks.

    Raises:
        ValueError: unknown std_scale, eps <= 0 with a std scale, bad shapes/dtypes, or a non-finite reward
            on a valid row (naming the row).

    Source: Shao et al. 2024 (DeepSeekMath), eq. 3 / Sec. 4.1.2; TRL 1.16 ``GRPOTrainer.
    _generate_and_score_completions`` (grpo_trainer.py lines 2761-2788 and 2810, nanstd in trainer/utils.py
    lines 1021-1047); Liu et al. 2025 (Dr.GRPO) Sec. 3.1 for "none".
    """
    if std_scale not in STD_SCALES:
        raise ValueError(f"grpo_advantages: unknown std_scale {std_scale!r}; expected one of {STD_SCALES}")
    if std_scale != "none" and eps <= 0:
        raise ValueError(f"grpo_advantages: eps={eps} must be > 0 to floor the std of constant groups")
    valid_mask = _check_rewards(rewards, group_ids, valid_mask, "grpo_advantages")
    zeroed, mean, count = group_mean_count(rewards, group_ids, valid_mask)
    deviation = torch.where(valid_mask, zeroed - mean, torch.zeros_like(zeroed))
    if std_scale == "none":
        return deviation
    if std_scale == "group":
        std = _unbiased_std(_per_group_sum(deviation.square(), group_ids), count)
    else:
        total = sum_fn or _local_sum
        n = total(valid_mask.sum().to(rewards.dtype))
        batch_dev = torch.where(valid_mask, zeroed - total(zeroed.sum()) / n.clamp(min=1.0), torch.zeros_like(zeroed))
        std = _unbiased_std(total(batch_dev.square().sum()), n).expand_as(rewards)
    return deviation / (std + eps)


@torch.no_grad()
def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor, *, valid_mask: Tensor | None = None) -> Tensor:
    """Returns [B] float32 Dr.GRPO advantages r - mean_g (no std division), 0 for invalid rows.

    Args:
        rewards: [B] float32 sequence rewards.
        group_ids: [B] int64 prompt groups (ragged, any order).
        valid_mask: [B] bool, False for rows without a reward; None means all valid.

    Raises:
        ValueError: bad shapes/dtypes or a non-finite reward on a valid row (naming the row).

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr.GRPO), Sec. 3.1;
    equals TRL 1.16 GRPO with scale_rewards="none". Pair it with seq-mean-token-sum-norm aggregation.
    A constant-reward group gives exactly 0 (see ``group_mean_count``).
    """
    return grpo_advantages(rewards, group_ids, std_scale="none", valid_mask=valid_mask)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_ids: Tensor, *, valid_mask: Tensor | None = None) -> Tensor:
    """Returns [B] float32 leave-one-out advantages r_i - mean_{j != i, valid} r_j, 0 for invalid rows.

    Equivalently n/(n-1) * (r_i - mean_g) with n the valid rows of the group. A group with one valid row
    has no baseline and gets 0; a constant-reward group gets exactly 0 (see ``group_mean_count``).

    Args:
        rewards: [B] float32 sequence rewards.
        group_ids: [B] int64 prompt groups (ragged, any order).
        valid_mask: [B] bool, False for rows without a reward.

    Raises:
        ValueError: bad shapes/dtypes or a non-finite reward on a valid row.

    Source: Ahmadian et al. 2024, "Back to Basics" (RLOO estimator, after Kool et al. 2019); TRL 1.16
    ``RLOOTrainer`` (rloo_trainer.py lines 1682-1699, with normalize_advantages=False).
    """
    valid_mask = _check_rewards(rewards, group_ids, valid_mask, "rloo_advantages")
    zeroed, mean, count = group_mean_count(rewards, group_ids, valid_mask)
    scale = count / (count - 1.0).clamp(min=1.0) * (count > 1.0)
    return torch.where(valid_mask, (zeroed - mean) * scale, torch.zeros_like(zeroed))


@torch.no_grad()
def remax_advantages(rewards: Tensor, baseline_rewards: Tensor, *, valid_mask: Tensor | None = None) -> Tensor:
    """Returns [B] float32 ReMax advantages r(x, y) - r(x, y_greedy), 0 for invalid rows.

    The baseline is the greedy response's reward, not a group mean: a group whose samples all score r gets
    r - r_greedy, which is 0 only where the greedy response scores r too (Li et al.'s definition).

    Args:
        rewards: [B] float32 rewards of the sampled responses.
        baseline_rewards: [B] float32 reward of the greedy response to the same prompt (the rollout decodes
            it with temperature 0; repeat it for every sample of the prompt).
        valid_mask: [B] bool, False where either reward is missing.

    Raises:
        ValueError: shapes differ or a valid row has a non-finite reward or baseline.

    Source: Li et al. 2023, "ReMax", Algorithm 1 (greedy-response baseline); verl ``compute_remax_outcome_advantage``.
    """
    valid_mask = _check_rewards(rewards, None, valid_mask, "remax_advantages")
    if baseline_rewards.shape != rewards.shape:
        raise ValueError(
            f"remax_advantages: baseline_rewards {tuple(baseline_rewards.shape)} must match rewards "
            f"{tuple(rewards.shape)}"
        )
    _check_rewards(baseline_rewards, None, valid_mask, "remax_advantages(baseline_rewards)")
    diff = rewards - baseline_rewards
    return torch.where(valid_mask, diff, torch.zeros_like(diff))


@torch.no_grad()
def token_level_rewards(
    rewards: Tensor, response_mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Returns [B, T] float32 per-token rewards: -kl_coef * kl on valid tokens, plus the sequence reward.

    The sequence reward sits on the last valid token of each row (a fully masked row gets none). This is
    "KL in the reward" (``algo.kl_in: reward``: PPO, REINFORCE++; InstructGPT eq. 2); for "KL in the loss" add
    ``kl_coef * kl_penalty(...)`` to the per-token loss.

    Args:
        rewards: [B] float32 sequence rewards.
        response_mask: [B, T] bool, True on generated tokens that count.
        kl: [B, T] float32 per-token KL estimate in nats (``kl_penalty``); masked values are ignored.
        kl_coef: beta, the KL weight per token (>= 0).

    Raises:
        ValueError: shapes disagree, the mask is not bool, or kl_coef < 0.

    Source: Ouyang et al. 2022 (InstructGPT) eq. 2; Hu 2025 (REINFORCE++) token-level KL penalty;
    OpenRLHF ``compute_reward``.
    """
    if response_mask.dim() != 2 or response_mask.dtype != torch.bool or rewards.shape != response_mask.shape[:1]:
        raise ValueError(
            f"token_level_rewards: need rewards [B] and bool response_mask [B, T], got {tuple(rewards.shape)} "
            f"and {tuple(response_mask.shape)} {response_mask.dtype}"
        )
    if kl_coef < 0:
        raise ValueError(f"token_level_rewards: kl_coef={kl_coef} must be >= 0")
    out = torch.zeros(response_mask.shape, dtype=rewards.dtype, device=rewards.device)
    if kl is not None:
        if kl.shape != response_mask.shape:
            raise ValueError(f"token_level_rewards: kl {tuple(kl.shape)} must be [B, T] like response_mask")
        out = torch.where(response_mask, -kl_coef * kl.to(rewards.dtype), out)
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(response_mask, positions, -1).max(dim=1).values
    has_token = last >= 0
    rows = has_token.nonzero().squeeze(1)
    out[rows, last[rows]] += rewards[rows]
    return out


@torch.no_grad()
def whiten(
    values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8, sum_fn: SumFn | None = None
) -> Tensor:
    """Returns [B, T] values normalised to zero mean and unit variance over the masked positions.

    ``(x - mean) * rsqrt(var + eps)`` with the unbiased (n - 1) variance over positions where ``mask`` is
    True; masked positions come back as 0. With ``shift_mean=False`` the mean is added back.

    Args:
        values: [B, T] float32, e.g. per-token advantages or returns.
        mask: [B, T] bool, True where the value counts (the whole step's batch: whitening is batch-global).
        shift_mean: subtract the mean (True) or keep it (False).
        eps: added to the variance (units of values squared).
        sum_fn: sums the count, sum and squared deviations over data-parallel ranks (``SumFn``), so that the
            mean and variance are the whole step's (two passes, as the local form); None means this batch alone.

    Raises:
        ValueError: shapes differ or the mask is not bool.

    Source: verl ``verl_F.masked_whiten`` (unbiased masked variance); OpenRLHF advantage normalisation.
    """
    if values.shape != mask.shape or mask.dtype != torch.bool:
        raise ValueError(f"whiten: values {tuple(values.shape)} and bool mask {tuple(mask.shape)} must match")
    total = sum_fn or _local_sum
    zero = torch.zeros_like(values)
    n = total(mask.sum().to(values.dtype))
    mean = total(torch.where(mask, values, zero).sum()) / n.clamp(min=1.0)
    var = total(torch.where(mask, (values - mean).square(), zero).sum()) / (n - 1.0).clamp(min=1.0)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, zero)


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8, sum_fn: SumFn | None = None
) -> Tensor:
    """Returns [B, T] float32 REINFORCE++ advantages: batch-whitened discounted returns-to-go.

    G_t = sum_{s >= t, valid} gamma^(k(s) - k(t)) r_s over valid tokens (k counts valid tokens, so masked
    gaps neither add reward nor discount), then ``whiten`` over every valid token of the batch.
    There is no group baseline: the rows of a constant-reward group are whitened like any other rows and
    generally get non-zero advantages (Hu 2025's definition; use the -baseline variant for a group baseline).

    Args:
        token_rewards: [B, T] float32 from ``token_level_rewards`` (KL in the reward plus the outcome reward
            on the last token); masked values are ignored.
        response_mask: [B, T] bool, True on tokens that count. Pass the whole step's batch (global whitening).
        gamma: discount per token (1.0 in the paper).
        eps: variance floor for ``whiten``.
        sum_fn: makes the whitening global over data-parallel ranks (see ``whiten``).

    Raises:
        ValueError: shapes differ, mask not bool, or gamma outside [0, 1].

    Source: Hu 2025, "REINFORCE++" (token-level KL, global-batch advantage normalisation); verl
    ``compute_reinforce_plus_plus_outcome_advantage``.
    """
    if token_rewards.shape != response_mask.shape or response_mask.dtype != torch.bool:
        raise ValueError(
            f"reinforce_pp_advantages: token_rewards {tuple(token_rewards.shape)} and bool response_mask "
            f"{tuple(response_mask.shape)} must match"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"reinforce_pp_advantages: gamma={gamma} must be in [0, 1]")
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        valid = response_mask[:, t]
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, torch.zeros_like(running))
    return whiten(returns, response_mask, eps=eps, sum_fn=sum_fn)


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    valid_mask: Tensor | None = None,
    eps: float = 1e-8,
    sum_fn: SumFn | None = None,
) -> Tensor:
    """Returns [B, T] float32 REINFORCE++-baseline advantages: (r - mean_g) on every token, batch-whitened.

    Invalid rows, fully masked rows and masked tokens get 0 and are left out of the group means and the
    whitening (a row the learner masked out entirely does not move its group's baseline). Use it with
    KL in the loss (k2 or k3), as the paper does. A constant-reward group is centred to exactly 0, then the
    batch whitening maps that 0 to -mean / std of the batch's centred tokens: every token of the group gets
    that one value, which is 0 only when the batch mean is 0 (Hu 2025's and verl's definition).

    Args:
        rewards: [B] float32 sequence rewards.
        group_ids: [B] int64 prompt groups (ragged, any order).
        response_mask: [B, T] bool, True on tokens that count. Pass the whole step's batch.
        valid_mask: [B] bool, False for rows without a reward.
        eps: variance floor for ``whiten``.
        sum_fn: makes the whitening global over data-parallel ranks (see ``whiten``); groups stay on one rank.

    Raises:
        ValueError: bad shapes/dtypes or a non-finite reward on a valid row.

    Source: Hu 2025, "REINFORCE++" (the REINFORCE++-baseline variant); verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``.
    """
    valid_mask = _check_rewards(rewards, group_ids, valid_mask, "reinforce_pp_baseline_advantages")
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0] or response_mask.dtype != torch.bool:
        raise ValueError(
            f"reinforce_pp_baseline_advantages: response_mask must be [B, T] bool with B={rewards.shape[0]}, "
            f"got {tuple(response_mask.shape)} {response_mask.dtype}"
        )
    valid_mask = valid_mask & response_mask.any(dim=-1)
    centred = dr_grpo_advantages(rewards, group_ids, valid_mask=valid_mask)
    token_mask = response_mask & valid_mask[:, None]
    return whiten(centred[:, None].expand(response_mask.shape).contiguous(), token_mask, eps=eps, sum_fn=sum_fn)
