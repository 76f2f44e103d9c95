"""rlray.learner.batching: micro-batch row slices with padding trimmed, and moving the step's records to a device."""

from __future__ import annotations

import dataclasses

import torch

from rlray.learner.batching import split_microbatches
from rlray.schema import StepBatch, pack_sequences

PAD = 0


def _batch() -> StepBatch:
    # prompt lengths 1, 3, 2 and response lengths 2, 1, 4: Pm = 3, T = 4
    inputs = pack_sequences([[11], [21, 22, 23], [31, 32]], [[12, 13], [24], [33, 34, 35, 36]], PAD)
    return StepBatch(inputs=inputs, response_mask=inputs.attention_mask[:, 3:].bool(), reward=torch.tensor([1.0, 2.0, 3.0]),
                     group_id=torch.tensor([0, 0, 1]), policy_version=torch.zeros(3, dtype=torch.long))


def _tensors(batch: StepBatch) -> dict[str, torch.Tensor]:
    """Returns every tensor of ``batch`` by name (the inputs' as inputs.<name>)."""
    out = {f"inputs.{f.name}": getattr(batch.inputs, f.name) for f in dataclasses.fields(batch.inputs)}
    out.update({f.name: v for f in dataclasses.fields(batch) if isinstance(v := getattr(batch, f.name), torch.Tensor)})
    return out


def test_slices_keep_row_order_and_sizes():
    mbs = list(split_microbatches(_batch(), 2))
    assert [mb.reward.tolist() for mb in mbs] == [[1.0, 2.0], [3.0]]


def test_columns_padded_in_every_row_of_a_slice_are_trimmed():
    first, last = split_microbatches(_batch(), 2)
    # rows 0-1: longest prompt 3 (nothing to drop), longest response 2 (drop 2 response columns)
    assert first.inputs.input_ids.tolist() == [[PAD, PAD, 11, 12, 13], [21, 22, 23, 24, PAD]]
    assert first.inputs.attention_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert first.inputs.position_ids.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    assert first.inputs.response_ids.tolist() == [[12, 13], [24, PAD]]
    assert first.response_mask.tolist() == [[True, True], [True, False]]
    # row 2 alone: its prompt has 2 tokens (drop 1 prompt column), its response all 4
    assert last.inputs.input_ids.tolist() == [[31, 32, 33, 34, 35, 36]]
    assert last.inputs.position_ids.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert last.inputs.response_ids.tolist() == [[33, 34, 35, 36]]
    assert last.reward.tolist() == [3.0]  # [B] tensors are sliced, never trimmed


def test_the_model_inputs_alone_split_and_trim_the_same_way():
    whole = _batch()
    for mb, inputs in zip(split_microbatches(whole, 2), split_microbatches(whole.inputs, 2), strict=True):
        assert all(torch.equal(getattr(mb.inputs, f.name), getattr(inputs, f.name)) for f in dataclasses.fields(inputs))
    assert whole.inputs.response_lengths.tolist() == [2, 1, 4]


def test_one_slice_of_the_whole_batch_is_unchanged():
    batch = _batch()
    (whole,) = split_microbatches(batch, 8)
    assert _tensors(whole).keys() == _tensors(batch).keys()
    assert all(torch.equal(_tensors(whole)[k], v) for k, v in _tensors(batch).items())


def test_to_device_keeps_the_same_tensors_when_already_there():
    batch = _batch()
    same = batch.to(torch.device("cpu"))
    assert all(v is _tensors(batch)[k] for k, v in _tensors(same).items())
    moved = batch.to(torch.device("meta"))  # a device without data: only where and what shape
    assert moved is not batch and _tensors(moved).keys() == _tensors(batch).keys()
    assert all(v.device.type == "meta" and v.shape == _tensors(batch)[k].shape for k, v in _tensors(moved).items())
    assert moved.advantages is None  # stages not yet run stay None
