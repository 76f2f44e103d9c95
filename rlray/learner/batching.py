"""Batching on the learner: row slices of a step's records (mini-batches, micro-batches) with padding trimmed.

The records are ``rlray.schema.ModelInputs`` (what a model reads) and ``rlray.schema.StepBatch`` (those inputs
plus the per-token training tensors); both slice rows (``rows``), trim padding (``trimmed``) and move to a device
(``to``). Legend: B sequences, Pm longest prompt, T longest response.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from rlray.schema import ModelInputs, StepBatch

Batch = TypeVar("Batch", ModelInputs, StepBatch)


def split_microbatches(batch: Batch, size: int) -> Iterator[Batch]:
    """Yields consecutive row slices of ``batch`` with ``size`` rows each (the last may be shorter).

    Padding columns that are empty in every row of a slice are trimmed (``trimmed``), so short micro-batches do
    not pay for the longest response of the step; [B] tensors are sliced, never trimmed.

    Args:
        batch: a ``ModelInputs`` or a ``StepBatch`` (``schema.collate`` output) of B rows.
        size: rows per micro-batch (>= 1).
    """
    for start in range(0, batch.num_rows, size):
        yield batch.rows(slice(start, start + size)).trimmed()
