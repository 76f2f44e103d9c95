"""rlray.learner.batching: micro-batch row slices with padding trimmed, and moving batches to a device."""

from __future__ import annotations

import torch

from rlray.learner.batching import split_microbatches, to_device
from rlray.schema import pack_sequences

PAD = 0


def _batch() -> dict[str, torch.Tensor]:
    # prompt lengths 1, 3, 2 and response lengths 2, 1, 4: Pm = 3, T = 4
    batch = pack_sequences([[11], [21, 22, 23], [31, 32]], [[12, 13], [24], [33, 34, 35, 36]], PAD)
    batch["response_mask"] = batch["attention_mask"][:, 3:].bool()
    batch["reward"] = torch.tensor([1.0, 2.0, 3.0])
    return batch


def test_slices_keep_row_order_and_sizes():
    mbs = list(split_microbatches(_batch(), 2))
    assert [mb["reward"].tolist() for mb in mbs] == [[1.0, 2.0], [3.0]]


def test_columns_padded_in_every_row_of_a_slice_are_trimmed():
    first, last = split_microbatches(_batch(), 2)
    # rows 0-1: longest prompt 3 (nothing to drop), longest response 2 (drop 2 response columns)
    assert first["input_ids"].tolist() == [[PAD, PAD, 11, 12, 13], [21, 22, 23, 24, PAD]]
    assert first["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert first["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    assert first["response_ids"].tolist() == [[12, 13], [24, PAD]]
    assert first["response_mask"].tolist() == [[True, True], [True, False]]
    # row 2 alone: its prompt has 2 tokens (drop 1 prompt column), its response all 4
    assert last["input_ids"].tolist() == [[31, 32, 33, 34, 35, 36]]
    assert last["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert last["response_ids"].tolist() == [[33, 34, 35, 36]]
    assert last["reward"].tolist() == [3.0]  # [B] tensors are sliced, never trimmed


def test_one_slice_of_the_whole_batch_is_unchanged():
    batch = _batch()
    (whole,) = split_microbatches(batch, 8)
    assert whole.keys() == batch.keys()
    assert all(torch.equal(whole[k], batch[k]) for k in batch)


def test_to_device_returns_the_same_dict_when_already_there():
    batch = _batch()
    assert to_device(batch, torch.device("cpu")) is batch
    moved = to_device(batch, torch.device("meta"))  # a device without data: only where and what shape
    assert moved is not batch and moved.keys() == batch.keys()
    assert all(v.device.type == "meta" and v.shape == batch[k].shape for k, v in moved.items())
