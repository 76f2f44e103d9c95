"""DAPO pieces: dynamic sampling (keep groups whose accuracy varies, refill up to a limit) and overlong shaping.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

The other DAPO ingredients live elsewhere: clip-higher is ``ppo_clip_loss(clip_eps_high > clip_eps_low)`` and
the token-level loss is ``aggregate_loss(mode="token-mean", num_tokens=<global count>)``.

Dynamic sampling, as the step loop uses it:
    kept = 0; rounds = 0
    while (missing := dynamic_sampling_shortfall(kept, target_groups, rounds_done=rounds, max_rounds=limit)):
        batch = rollout(next prompts, at least ``missing`` of them); rounds += 1
        keep = groups_with_spread(batch.accuracy, batch.group_ids)   # rows of informative groups
        kept += number of distinct group_ids in batch[keep]
    then use the first ``target_groups`` kept groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlray.algos.advantages import group_max_min, group_mean_count


class DynamicSamplingError(RuntimeError):
    """Raised when dynamic sampling cannot fill the batch within its refill limit."""


@torch.no_grad()
def groups_with_spread(
    accuracies: Tensor, group_ids: Tensor, *, valid_mask: Tensor | None = None, min_spread: float = 0.0
) -> Tensor:
    """Returns [B] bool: True for rows whose group's raw accuracy has spread (max - min) > ``min_spread``.

    Groups where every valid sample is right (or every one wrong) carry zero GRPO advantage and are dropped.
    Invalid rows are always False and do not count toward the spread.

    Args:
        accuracies: [B] float32 raw per-sample accuracy (e.g. 1.0 correct / 0.0 wrong, before any format or
            length shaping), or any raw score whose spread should be non-zero.
        group_ids: [B] int64 prompt groups (ragged, any order).
        valid_mask: [B] bool, False for rows without a score; None means all valid.
        min_spread: spread threshold, >= 0 (0 keeps any non-constant group).

    Raises:
        ValueError: shapes differ, dtypes wrong, a valid accuracy is not finite, or min_spread < 0.

    Source: Yu et al. 2025 (DAPO) Sec. 3.2 "Dynamic Sampling", the constraint
    0 < |{o_i : is_equivalent(a, o_i)}| < G; verl DAPO ``filter_groups`` (std > 0 per prompt).
    """
    if accuracies.dim() != 1 or group_ids.shape != accuracies.shape or group_ids.is_floating_point():
        raise ValueError(
            f"groups_with_spread: need accuracies [B] float and group_ids [B] int, got "
            f"{tuple(accuracies.shape)} {accuracies.dtype} and {tuple(group_ids.shape)} {group_ids.dtype}"
        )
    if min_spread < 0:
        raise ValueError(f"groups_with_spread: min_spread={min_spread} must be >= 0")
    if valid_mask is None:
        valid_mask = torch.ones_like(group_ids, dtype=torch.bool)
    if valid_mask.shape != accuracies.shape or valid_mask.dtype != torch.bool:
        raise ValueError(
            f"groups_with_spread: valid_mask must be [B] bool, got {tuple(valid_mask.shape)} {valid_mask.dtype}"
        )
    bad = valid_mask & ~torch.isfinite(accuracies)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"groups_with_spread: accuracies[{row}]={accuracies[row].item()} is not finite on a valid row")
    acc = accuracies.float()
    highest, lowest = group_max_min(acc, group_ids, valid_mask)
    _, _, count = group_mean_count(acc, group_ids, valid_mask)
    spread = highest - lowest
    return valid_mask & (count >= 2) & (spread > min_spread)


def dynamic_sampling_shortfall(num_kept_groups: int, target_groups: int, *, rounds_done: int, max_rounds: int) -> int:
    """Returns how many more groups dynamic sampling still needs (0 when the batch is full).

    Args:
        num_kept_groups: groups with spread collected so far this step.
        target_groups: groups the update needs (prompts per step).
        rounds_done: rollout rounds already run this step (the first rollout counts as one).
        max_rounds: the most rollout rounds allowed per step (>= 1).

    Raises:
        DynamicSamplingError: groups are still missing after ``max_rounds`` rounds; the message names the
            counts and the ways out (a higher limit, easier prompts, or checking the reward).
        ValueError: negative counts, target_groups < 1 or max_rounds < 1.

    Source: Yu et al. 2025 (DAPO) Algorithm 1 lines 6-7 (sample until the buffer holds N groups); verl DAPO
    trainer's ``max_num_gen_batches`` check.
    """
    if target_groups < 1 or max_rounds < 1 or num_kept_groups < 0 or rounds_done < 0:
        raise ValueError(
            f"dynamic_sampling_shortfall: need target_groups >= 1, max_rounds >= 1 and non-negative counts, got "
            f"target_groups={target_groups} max_rounds={max_rounds} num_kept_groups={num_kept_groups} "
            f"rounds_done={rounds_done}"
        )
    missing = max(target_groups - num_kept_groups, 0)
    if missing and rounds_done >= max_rounds:
        raise DynamicSamplingError(
            f"DAPO dynamic sampling: after {rounds_done} rollout round(s) (max_rounds={max_rounds}) only "
            f"{num_kept_groups}/{target_groups} prompt groups have non-zero accuracy spread; the rest were all "
            "right or all wrong. Raise the refill limit (max_rounds), use prompts of mixed difficulty, or check "
            "that the reward is not constant."
        )
    return missing


@torch.no_grad()
def overlong_penalty(
    response_lengths: Tensor, *, max_response_tokens: int, cache_tokens: int, penalty_factor: float = 1.0
) -> Tensor:
    """Returns [B] float32 soft overlong punishment (<= 0), to add to the task reward.

    With L_exp = max_response_tokens - cache_tokens: 0 for length <= L_exp, then linear
    (L_exp - length) / cache_tokens down to -1 at max_response_tokens, and -1 beyond; times penalty_factor.

    Args:
        response_lengths: [B] int64 generated tokens per response (truncated ones equal the cap).
        max_response_tokens: L_max, the generation cap in tokens (> cache_tokens).
        cache_tokens: L_cache, the length of the punishment interval in tokens (> 0).
        penalty_factor: scale of the punishment (>= 0; 1.0 in the paper).

    Raises:
        ValueError: lengths not a 1-D integer tensor or negative, cache_tokens <= 0,
            max_response_tokens <= cache_tokens, or penalty_factor < 0.

    Source: Yu et al. 2025 (DAPO) Sec. 3.4 (Soft Overlong Punishment, R_length); verl DAPO reward manager
    ``overlong_buffer``.
    """
    if response_lengths.dim() != 1 or response_lengths.is_floating_point() or (response_lengths < 0).any():
        raise ValueError(
            f"overlong_penalty: response_lengths must be [B] non-negative integers, got "
            f"{tuple(response_lengths.shape)} {response_lengths.dtype}"
        )
    if cache_tokens <= 0 or max_response_tokens <= cache_tokens:
        raise ValueError(
            f"overlong_penalty: need 0 < cache_tokens ({cache_tokens}) < max_response_tokens ({max_response_tokens})"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty: penalty_factor={penalty_factor} must be >= 0")
    expected = max_response_tokens - cache_tokens
    excess = (response_lengths.float() - expected).clamp(min=0.0)
    return -(excess / cache_tokens).clamp(max=1.0) * penalty_factor
