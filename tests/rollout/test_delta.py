"""Delta weight sync's encoding (``rlray.rollout.delta``), pure: round trips are bit-exact for any change mask, the
smallest encoding is picked by exact byte count, a receiver that holds another version takes nothing, and the
checksum catches a corrupted delta."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlray.rollout.delta import (
    DeltaEncoder,
    DeltaReceiver,
    WeightSyncChecksumError,
    apply_tensor,
    checksum,
    encode_tensor,
)

_INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.dtype])


@st.composite
def _old_new(draw):
    """Returns (old, new, mask): random tensors in float32 or bf16 that differ exactly where ``mask`` is True (none,
    all, or any pattern), a 0.0 -> -0.0 change among them."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=gen).to(dtype)
    numel = old.numel()
    kind = draw(st.sampled_from(["none", "all", "random", "one"]))
    mask = {"none": torch.zeros(numel, dtype=torch.bool), "all": torch.ones(numel, dtype=torch.bool),
            "random": torch.rand(numel, generator=gen) < draw(st.floats(0.0, 1.0)),
            "one": torch.arange(numel) == draw(st.integers(0, numel - 1))}[kind]
    flat = old.reshape(-1).clone()
    # a changed value gets other bits: flip the lowest mantissa bit (the smallest change the engine dtype can see)
    flat_bits = _bits(flat)
    flat_bits[mask] ^= 1
    if draw(st.booleans()) and numel > 1:  # 0.0 -> -0.0 is a change of bits, not of value
        old.reshape(-1)[0], flat[0] = 0.0, -0.0 if mask[0] else 0.0
    return old, flat.reshape(shape), mask


@settings(max_examples=200, deadline=None)
@given(_old_new())
def test_encode_then_apply_rebuilds_the_new_tensor_bit_for_bit(case):
    old, new, mask = case
    change = encode_tensor(old, new)
    target = old.clone()
    if change is None:
        assert not mask.any()
    else:
        assert change.changed == int(mask.sum())
        apply_tensor(target, change)
    assert torch.equal(_bits(target), _bits(new))
    assert checksum(target) == checksum(new)


@settings(max_examples=100, deadline=None)
@given(_old_new())
def test_the_encoding_is_the_smallest_of_dense_sparse_and_mask(case):
    old, new, mask = case
    change = encode_tensor(old, new)
    if change is None:
        return
    n, k, item = new.numel(), int(mask.sum()), new.element_size()
    smallest = min(n * item, k * (item + 4), (n + 7) // 8 + k * item)
    assert change.nbytes == smallest
    assert change.kind == "dense" or change.nbytes < n * item


def test_a_bf16_change_of_two_values_in_a_thousand_goes_sparse_with_int32_indices():
    old = torch.zeros(1000, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 999]] = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    change = encode_tensor(old, new)
    assert change.kind == "sparse" and change.index.tolist() == [3, 999] and change.index.dtype == np.int32
    assert change.nbytes == 2 * (2 + 4)  # two bf16 values and two int32 indices


def test_a_bf16_change_of_a_quarter_goes_as_a_bit_mask():
    old = torch.zeros(800, dtype=torch.bfloat16)
    new = old.clone()
    new[::4] = 1.0  # 200 changed: sparse 200 * 6 = 1200 bytes, mask 100 + 400 = 500, dense 1600
    change = encode_tensor(old, new)
    assert change.kind == "mask" and change.nbytes == 500


def _model(seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 8, generator=gen).to(dtype), "b.bias": torch.randn(8, generator=gen).to(dtype)}


def test_the_first_push_is_full_then_deltas_carry_only_the_changes():
    enc, rec = DeltaEncoder(), DeltaReceiver()
    v1 = _model(0)
    first = enc.encode(v1, 1)
    assert first.base_version is None and first.changed_fraction == 1.0 and first.nbytes == 40 * 2
    assert all(torch.equal(rec.apply(first)[n], v1[n]) for n in v1)
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["a.weight"][0, 0] += 1.0  # one value of 40 changes; b.bias does not
    second = enc.encode(v2, 2)
    assert second.base_version == 1 and list(second.tensors) == ["a.weight"] and second.changed_fraction == 1 / 40
    got = rec.apply(second)
    assert rec.version == 2 and all(torch.equal(got[n], v2[n]) for n in v2)


def test_a_receiver_that_missed_a_version_takes_nothing_and_the_full_weights_bring_it_back():
    enc, behind, fresh = DeltaEncoder(), DeltaReceiver(), DeltaReceiver()
    behind.apply(enc.encode(_model(0), 1))
    enc.encode(_model(1), 2)  # behind misses version 2 (its push failed)
    v3 = _model(2)
    delta3 = enc.encode(v3, 3)
    assert delta3.base_version == 2
    assert behind.apply(delta3) is None and behind.version == 1  # nothing loaded: the engine keeps version 1
    assert fresh.apply(delta3) is None  # a restarted engine holds no copy at all
    full = enc.full()
    assert full.base_version is None and full.version == 3
    for rec in (behind, fresh):
        got = rec.apply(full)
        assert rec.version == 3 and all(torch.equal(got[n], v3[n]) for n in v3)


def test_the_checksum_catches_a_corrupted_delta_and_names_the_tensor():
    enc, rec = DeltaEncoder(), DeltaReceiver()
    rec.apply(enc.encode(_model(0, torch.float32), 1))
    v2 = {n: t + 1.0 for n, t in _model(0, torch.float32).items()}
    delta = enc.encode(v2, 2)
    corrupt = delta.tensors["b.bias"].values.copy()
    corrupt[0] ^= 1  # one bit of the first value
    delta.tensors["b.bias"].values = corrupt
    with pytest.raises(WeightSyncChecksumError, match=r"rlray: weight sync to version 2: tensor 'b.bias' differs"):
        rec.apply(delta)
    assert rec.version is None and rec.apply(enc.encode(v2, 3)) is None  # the copy is gone: the next sync must be full


def test_a_delta_that_does_not_fit_the_held_weights_is_a_checksum_error():
    enc, rec = DeltaEncoder(), DeltaReceiver()
    rec.apply(enc.encode(_model(0), 1))
    delta = enc.encode({n: t * 2 for n, t in _model(0).items()}, 2)
    delta.tensors["a.weight"].kind = "dense"
    delta.tensors["a.weight"].values = delta.tensors["a.weight"].values[:10]
    with pytest.raises(WeightSyncChecksumError, match="does not fit"):
        rec.apply(delta)


def test_the_encoder_keeps_its_own_copy_not_the_learners_tensors():
    enc = DeltaEncoder()
    live = _model(0, torch.float32)
    enc.encode(live, 1)
    before = {n: t.clone() for n, t in live.items()}
    for t in live.values():
        t.add_(1.0)  # the optimizer moves the learner's tensors in place
    assert all(torch.equal(enc.base[n], before[n]) for n in before)
    assert enc.encode(live, 2).changed_fraction == 1.0
