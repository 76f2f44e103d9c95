"""Test helpers: the learner's typed records with only the fields a test needs (the model inputs a stand-in)."""

from __future__ import annotations

import torch

from rlray.schema import PairBatch, StepBatch, pack_sequences


def stand_in_inputs(rows: int, response_tokens: int):
    """Returns ``ModelInputs`` of ``rows`` rows, a 1-token prompt and ``response_tokens`` response tokens each (for code
    that never runs a model on them)."""
    return pack_sequences([[1]] * rows, [[1] * response_tokens] * rows, 0)


def step_batch(response_mask: torch.Tensor, **fields: torch.Tensor) -> StepBatch:
    """Returns a ``StepBatch`` with ``response_mask`` [B, T] bool and ``fields``; reward 0, group_id 0..B-1 and
    policy_version 0 unless given, stand-in model inputs."""
    b, t = response_mask.shape
    base = {"reward": torch.zeros(b), "group_id": torch.arange(b), "policy_version": torch.zeros(b, dtype=torch.long)}
    return StepBatch(inputs=stand_in_inputs(b, t), response_mask=response_mask, **{**base, **fields})


def pair_batch(response_mask: torch.Tensor, **fields: torch.Tensor) -> PairBatch:
    """Returns a ``PairBatch`` with ``response_mask`` [2P, T] bool and ``fields`` (reference logprobs), stand-in
    model inputs."""
    return PairBatch(inputs=stand_in_inputs(*response_mask.shape), response_mask=response_mask, **fields)
