"""rlray.rollout.wire: weights through Ray's object store as raw bytes come back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlray.models.adapters import AdapterWeights
from rlray.rollout.wire import pack_adapter, pack_weights, packed_bytes, unpack_weights


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=g),
        "c.scale": torch.tensor(2.5, dtype=torch.float16),  # 0-dim
        "d.weight": torch.randn(4, 6, generator=g).t(),  # non-contiguous
    }


def test_round_trip_is_bit_exact_with_dtype_and_shape():
    weights = _weights()
    packed = pack_weights(weights)
    assert packed["a.weight"][1:] == ("bfloat16", (3, 5)) and packed["a.weight"][0].dtype == np.uint8
    assert packed["a.weight"][0].nbytes == 3 * 5 * 2 and packed["c.scale"][2] == ()
    back = unpack_weights(packed)
    for name, t in weights.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t), name


def test_packed_bytes_counts_the_tensor_data_a_push_ships():
    # a 3x5 bf16 (30 bytes), 7 float32 (28), a 0-dim float16 (2), a 6x4 float32 transposed (96): 156 bytes
    assert packed_bytes(pack_weights(_weights())) == 30 + 28 + 2 + 96
    assert packed_bytes({"x": torch.ones(2, 2)}) == 16  # plain tensors count as they are
    adapter = pack_adapter(AdapterWeights({"lora_A": torch.zeros(4, 2), "lora_B": torch.zeros(2, 4)}, {"r": 2}))
    assert packed_bytes(adapter) == 2 * 8 * 4  # the adapter's tensors only, its config is not tensor data


def test_plain_tensors_pass_through():
    t = torch.ones(2, 2)
    assert unpack_weights({"x": t})["x"] is t


@pytest.mark.ray
def test_round_trip_through_the_object_store(ray_session):
    weights = _weights()
    back = unpack_weights(ray_session.get(ray_session.put(pack_weights(weights))))
    assert all(torch.equal(back[n], t) for n, t in weights.items())
