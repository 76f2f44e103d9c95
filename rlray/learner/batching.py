"""Batching on the learner: row slices of a collated batch (micro-batches), padding trimmed, moved to a device.

Legend: B sequences, Pm longest prompt, T longest response.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def split_microbatches(batch: dict[str, torch.Tensor], size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Yields consecutive row slices of ``batch`` with ``size`` rows each (the last may be shorter).

    Padding columns that are empty in every row of a slice are trimmed, so short micro-batches do
    not pay for the longest response of the step.

    Args:
        batch: ``collate`` output: input_ids, attention_mask, position_ids [B, Pm+T] int64 (prompts
            left-padded, responses right-padded), response_ids [B, T] int64, and any other [B, T] or [B] tensors.
        size: rows per micro-batch (>= 1).
    """
    n = batch["input_ids"].shape[0]
    for start in range(0, n, size):
        mb = {k: v[start : start + size] for k, v in batch.items()}
        yield _trim(mb)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Returns ``batch`` with every tensor on ``device`` (the same dict when it is already there)."""
    if all(v.device == device for v in batch.values()):
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _trim(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Returns ``mb`` without the leading prompt columns and trailing response columns that are padding in every row."""
    t_full = mb["response_ids"].shape[1]
    t = int(mb["attention_mask"][:, -t_full:].sum(1).max().item()) if t_full else 0
    p_full = mb["input_ids"].shape[1] - t_full
    p = int(mb["attention_mask"][:, :p_full].sum(1).max().item())
    out = {}
    for k, v in mb.items():
        if v.dim() == 2 and v.shape[1] == p_full + t_full:
            out[k] = v[:, p_full - p : p_full + t]
        elif v.dim() == 2 and v.shape[1] == t_full:
            out[k] = v[:, :t]
        else:
            out[k] = v
    return out
