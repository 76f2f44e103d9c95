"""Loss aggregation: per-token losses -> one scalar, with global normalisers for accumulation and DP.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

Modes (the names used by verl's ``agg_loss``; TRL 1.16 ``GRPOTrainer._compute_loss`` names in brackets):
    token-mean               sum_{b,t} m*l / N_tokens                      [bnpo local, dapo global]
    seq-mean-token-mean      sum_b (sum_t m*l / n_b) / N_seq               [grpo]
    seq-mean-token-sum       sum_b (sum_t m*l) / N_seq
    seq-mean-token-sum-norm  sum_b (sum_t m*l / max_response_tokens) / N_seq   [dr_grpo, Liu et al. 2025 eq. 2]
where m is the response mask, n_b the valid tokens of sequence b, N_tokens the valid tokens and N_seq the
sequences with at least one valid token.

Global normalisation. The driver counts N_tokens and N_seq over the whole mini-batch (all micro-batches on
all data-parallel ranks, after every mask is applied) and passes them in. Each micro-batch then returns a
*partial sum* with that global denominator, so that
    sum over micro-batches and ranks of aggregate_loss(...) == the full mini-batch value.
Callers must therefore (1) backward each micro-batch's value as is (no division by the number of
accumulation steps) and (2) under DDP, whose all-reduce *averages* gradients over ``world_size`` ranks,
multiply each micro-batch value by ``world_size`` before ``backward`` (or all-reduce with a sum instead).
Without normalisers the micro-batch is normalised locally (what TRL's grpo/bnpo/dr_grpo do per micro-batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(
    per_token_loss: Tensor,
    response_mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_response_tokens: int | None = None,
) -> Tensor:
    """Returns the scalar loss (0-dim, dtype of ``per_token_loss``) reduced from per-token losses.

    Masked positions are excluded with ``torch.where`` (not a product), so NaN or inf there cannot leak
    into the value or the gradient of valid positions.

    Args:
        per_token_loss: [B, T] float32 per-token loss; values at masked positions are ignored.
        response_mask: [B, T] bool, True where the token counts.
        mode: one of ``AGGREGATION_MODES`` (see the module docstring for the formulas).
        num_tokens: global count of valid tokens in the mini-batch (token-mean's denominator). None means
            the local count ``response_mask.sum()``. Counts below 1 are floored to 1.
        num_sequences: global count of sequences with >= 1 valid token (the seq-mean-* denominator). None
            means the local count. Floored to 1.
        max_response_tokens: Dr.GRPO's constant per-sequence divisor, in tokens (the generation cap,
            ``max_new_tokens``); required by seq-mean-token-sum-norm and ignored by the other modes.

    Returns:
        0-dim tensor. With global normalisers this is the micro-batch's share; summing the shares of all
        micro-batches (and, under DDP, scaling by world_size as the module docstring says) gives the
        full mini-batch value.

    Raises:
        ValueError: unknown ``mode``; shapes differ or are not 2-D; ``response_mask`` is not bool;
            seq-mean-token-sum-norm without a positive ``max_response_tokens``; a negative normaliser.

    Source: verl ``core_algos.agg_loss``; TRL 1.16 ``GRPOTrainer._compute_loss`` (grpo_trainer.py lines
    3153-3174). Deviation: the seq-mean-* modes divide by sequences with a valid token, where TRL's grpo
    and dr_grpo divide by every row (identical unless a row is fully masked).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"aggregate_loss: unknown mode {mode!r}; expected one of {AGGREGATION_MODES}")
    _check_loss_and_mask(per_token_loss, response_mask)
    for name, value in (("num_tokens", num_tokens), ("num_sequences", num_sequences)):
        if value is not None and value < 0:
            raise ValueError(f"aggregate_loss: {name}={value} must be >= 0 (a count after masking)")
    masked = torch.where(response_mask, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token-mean":
        return masked.sum() / _denominator(response_mask.sum(), num_tokens, masked.dtype)
    seq_tokens = response_mask.sum(dim=-1)
    seq_loss = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_loss / seq_tokens.clamp(min=1).to(seq_loss.dtype)
    elif mode == "seq-mean-token-sum-norm":
        if max_response_tokens is None or max_response_tokens <= 0:
            raise ValueError(
                f"aggregate_loss: mode 'seq-mean-token-sum-norm' needs max_response_tokens > 0 (the generation "
                f"cap in tokens), got {max_response_tokens!r}"
            )
        seq_loss = seq_loss / float(max_response_tokens)
    return seq_loss.sum() / _denominator((seq_tokens > 0).sum(), num_sequences, masked.dtype)


def _denominator(local_count: Tensor, global_count: float | None, dtype: torch.dtype) -> Tensor | float:
    """Returns the global count if given, else the local one (kept on device: no host sync), floored to 1."""
    if global_count is not None:
        return max(float(global_count), 1.0)
    return local_count.clamp(min=1).to(dtype)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Returns the 0-dim mean of ``values`` over positions where ``mask`` is True (0 when none are).

    Args:
        values: [B, T] (or any shape) float tensor; values at masked positions are ignored.
        mask: bool tensor of the same shape, True where the value counts.

    Raises:
        ValueError: shapes differ or ``mask`` is not bool.

    Source: verl ``verl_F.masked_mean``; used for logging diagnostics (clip fractions, KL, entropy).
    """
    if values.shape != mask.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"masked_mean: values {tuple(values.shape)} and bool mask {tuple(mask.shape)} ({mask.dtype}) must match"
        )
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1).to(total.dtype)


def _check_loss_and_mask(per_token_loss: Tensor, response_mask: Tensor) -> None:
    if per_token_loss.dim() != 2 or per_token_loss.shape != response_mask.shape:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [B, T]"
        )
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be bool (True = counts), got {response_mask.dtype}")
