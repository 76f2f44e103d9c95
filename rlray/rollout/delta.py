"""Delta weight sync: ship only the values whose engine-dtype representation changed since the engine's version.

A rollout engine generates with the policy cast to its dtype (bf16 or float32), so a value whose cast did not change
between two versions needs no sending: with bf16 engines and learning rates around 1e-6 most values of a step keep
their bf16 bits (verl's delta sync; benchmarks/weight_sync.py measures the fraction). The learner (rank 0) keeps the
engine-dtype copy of the last version it sent (``DeltaEncoder``, one model in the engine dtype) and compares bit
patterns, tensor by tensor; every tensor with a change travels in the smallest of three encodings, by exact byte
count:

- ``dense``: every value (numel x dtype bytes);
- ``sparse``: the flat indices of the changed values (int32, int64 from 2**31 values on) and their new values;
- ``mask``: a packed bit mask of the changed positions (numel / 8 bytes) and their new values.

The new values are sent, never differences, so the result is exact. Every delta names the version it applies to
(``base_version``); the engine side (``DeltaReceiver``, in the rollout actor) keeps its own engine-dtype copy of the
version it holds, applies a delta only to that version, and checks an xxh3-64 checksum of every tensor after the
update against the learner's. A receiver that holds another version (restarted, rejoined, missed a push) or whose
checksum fails loads nothing and reports so; the fleet then sends it the full weights (``DeltaEncoder.full``, tagged
``base_version=None``), whose checksums must match too (``WeightSyncChecksumError`` otherwise).

Everything here is plain torch and NumPy (no Ray); the arrays are NumPy so that Ray's object store carries them
out of band (``rlray.rollout.wire``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

# dtype -> the integer dtype of the same width (bitwise comparison: -0.0 != 0.0, every NaN payload counts)
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


class WeightSyncChecksumError(ValueError):
    """A tensor's checksum after a weight sync differs from the learner's (names the tensor and the versions)."""


@dataclass
class TensorDelta:
    """The change of one tensor, flattened.

    Attributes:
        kind: ``dense`` (``values`` holds all numel values), ``sparse`` (``index``: the k changed flat positions,
            int32 or int64) or ``mask`` (``index``: ceil(numel / 8) uint8, numpy.packbits of the [numel] changed mask).
        values: the new values' raw bytes (uint8 [numel or k x itemsize]; NumPy has no bfloat16).
        index: the positions (sparse, mask); None for dense.
        changed: how many values changed (numel for a full sync).
    """

    kind: str
    values: np.ndarray
    index: np.ndarray | None
    changed: int

    @property
    def nbytes(self) -> int:
        """Returns the bytes this tensor adds to a sync (values and positions)."""
        return int(self.values.nbytes + (self.index.nbytes if self.index is not None else 0))


@dataclass
class WeightDelta:
    """One sync's payload: what changed since ``base_version`` (or everything, with ``base_version=None``).

    Attributes:
        version: the policy version the engine holds after applying it.
        base_version: the version it applies to; None for a full sync (every tensor dense).
        dtype: the engine dtype's name (``bfloat16``, ``float32``).
        shapes: every tensor's shape, changed or not.
        tensors: the changed tensors only (a delta leaves an unchanged tensor out).
        checksums: every tensor's xxh3-64 (``checksum``) after the update.
        numel: values over all tensors.
    """

    version: int
    base_version: int | None
    dtype: str
    shapes: dict[str, tuple[int, ...]]
    tensors: dict[str, TensorDelta]
    checksums: dict[str, int]
    numel: int = 0

    @property
    def nbytes(self) -> int:
        """Returns the bytes of values and positions this payload carries (the shapes and checksums aside)."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def changed_fraction(self) -> float:
        """Returns the fraction of all values whose engine-dtype bits changed (1.0 for a full sync)."""
        return sum(t.changed for t in self.tensors.values()) / max(self.numel, 1)


def checksum(tensor: torch.Tensor) -> int:
    """Returns the xxh3-64 hash (an int) of a CPU tensor's bytes (made contiguous), the same on both sides of a sync."""
    return xxhash.xxh3_64_intdigest(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def encode_tensor(old: torch.Tensor | None, new: torch.Tensor) -> TensorDelta | None:
    """Returns the smallest encoding of ``new`` given ``old`` (same shape and dtype), or None when no bit changed.

    The comparison runs in NumPy on integer views of the bits (several times faster than torch's on CPU).

    Args:
        old: the values the engine holds, or None (then ``new`` goes dense).
        new: the values to send, contiguous CPU, a float dtype.
    """
    flat = new.reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    if old is None:
        return TensorDelta("dense", raw, None, flat.numel())
    bits = _BITS[new.dtype]
    new_bits = flat.view(bits).numpy()
    changed_mask = np.not_equal(old.reshape(-1).view(bits).numpy(), new_bits)
    k, numel, item = int(np.count_nonzero(changed_mask)), flat.numel(), new.element_size()
    if k == 0:
        return None
    index_dtype = np.int32 if numel < 2**31 else np.int64
    sizes = {
        "dense": numel * item,
        "sparse": k * (item + np.dtype(index_dtype).itemsize),
        "mask": (numel + 7) // 8 + k * item,
    }
    kind = min(sizes, key=sizes.get)  # ties: dense first (no scatter on the engine side)
    if kind == "dense":
        return TensorDelta("dense", raw, None, k)
    index = np.flatnonzero(changed_mask)
    values = new_bits[index].view(np.uint8)
    if kind == "sparse":
        return TensorDelta("sparse", values, index.astype(index_dtype), k)
    return TensorDelta("mask", values, np.packbits(changed_mask), k)


def apply_tensor(target: torch.Tensor, delta: TensorDelta) -> None:
    """Writes ``delta``'s new values into ``target`` in place (contiguous, the delta's dtype and numel).

    Raises:
        ValueError: the delta's sizes do not fit ``target`` (a corrupt payload).
    """
    flat = target.view(-1)
    with warnings.catch_warnings():  # Ray's shared buffers are read-only; they are only read here
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(delta.values).view(target.dtype)
        if delta.kind == "dense":
            if values.numel() != flat.numel():
                raise ValueError(f"a dense delta of {values.numel()} values for a tensor of {flat.numel()}")
            flat.copy_(values)
        elif delta.kind == "sparse":
            flat[torch.from_numpy(delta.index).long()] = values
        elif delta.kind == "mask":
            index = np.flatnonzero(np.unpackbits(delta.index, count=flat.numel()))
            flat[torch.from_numpy(index)] = values
        else:
            raise ValueError(f"unknown delta kind {delta.kind!r}")


@dataclass
class DeltaEncoder:
    """The learner side (rank 0): keeps the engine-dtype copy of the last version sent and encodes the next.

    Memory: one copy of the model in the engine dtype (270 MiB for SmolLM2-135M in bf16), updated in place.

    Attributes:
        version: the version of the copy held (None before the first push).
        base: the copy, {HF name: contiguous CPU tensor in the engine dtype}.
    """

    version: int | None = None
    base: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def encode(self, tensors: dict[str, torch.Tensor], version: int) -> WeightDelta:
        """Returns the delta from the held version to ``tensors`` (a full payload at the first push, or when the
        names or shapes changed), and makes ``tensors`` the held version.

        Args:
            tensors: {HF name: CPU tensor} already cast to the engine dtype (``learner.export_weights``).
            version: their policy version.
        """
        same = self.base is not None and {n: (t.shape, t.dtype) for n, t in self.base.items()} == {
            n: (t.shape, t.dtype) for n, t in tensors.items()}
        if not same:
            self.base = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
            self.version = version
            return self.full()
        out: dict[str, TensorDelta] = {}
        for name, new in tensors.items():
            new = new.detach().contiguous()
            change = encode_tensor(self.base[name], new)
            if change is not None:
                out[name] = change
                if change.kind == "sparse":
                    apply_tensor(self.base[name], change)
                else:
                    self.base[name].copy_(new)  # the same bits as applying the change, at memcpy speed
        delta = self._payload(version, self.version, out)
        self.version = version
        return delta

    def full(self) -> WeightDelta:
        """Returns the held version whole (every tensor dense, ``base_version=None``), for an engine that holds
        another version. Its arrays are views of the held copy: put it in the object store before the next encode.

        Raises:
            RuntimeError: nothing was encoded yet.
        """
        if self.base is None or self.version is None:
            raise RuntimeError("DeltaEncoder.full: no version was sent yet")
        return self._payload(self.version, None, {n: encode_tensor(None, t) for n, t in self.base.items()})

    def _payload(self, version: int, base_version: int | None, tensors: dict[str, TensorDelta]) -> WeightDelta:
        dtype = next(iter(self.base.values())).dtype
        return WeightDelta(version, base_version, str(dtype).removeprefix("torch."),
                           {n: tuple(t.shape) for n, t in self.base.items()}, tensors,
                           {n: checksum(t) for n, t in self.base.items()}, sum(t.numel() for t in self.base.values()))


@dataclass
class DeltaReceiver:
    """The engine side (in the rollout actor): keeps the engine-dtype copy of the version the engine holds.

    Attributes:
        version: the version of the copy (None: no copy; the next sync must be full).
        mirror: {HF name: CPU tensor}, the weights last handed to the engine.
    """

    version: int | None = None
    mirror: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def clear(self) -> None:
        """Forgets the copy (the engine took weights by another path): the next delta is refused."""
        self.version, self.mirror = None, None

    def apply(self, delta: WeightDelta) -> dict[str, torch.Tensor] | None:
        """Returns the full weights after ``delta`` (the receiver's copy, to load into the engine), or None when the
        delta applies to a version this receiver does not hold (the sender must send the full weights).

        Raises:
            WeightSyncChecksumError: a tensor's checksum after the update differs from the learner's (names the
                tensor); the copy is forgotten (``clear``), so the next sync must be full.
        """
        if delta.base_version is not None and (self.mirror is None or self.version != delta.base_version):
            return None
        dtype = getattr(torch, delta.dtype)
        try:
            if delta.base_version is None:
                self.mirror = {n: torch.empty(s, dtype=dtype) for n, s in delta.shapes.items()}
            for name, change in delta.tensors.items():
                apply_tensor(self.mirror[name], change)
        except (KeyError, ValueError, IndexError, RuntimeError) as err:
            self.clear()
            raise WeightSyncChecksumError(f"rlray: weight sync to version {delta.version}: the delta does not fit the "
                                          f"weights held ({type(err).__name__}: {err})") from err
        for name, expected in delta.checksums.items():
            if checksum(self.mirror[name]) != expected:
                base = "full weights" if delta.base_version is None else f"the delta from version {delta.base_version}"
                self.clear()
                raise WeightSyncChecksumError(
                    f"rlray: weight sync to version {delta.version}: tensor '{name}' differs from the learner's after "
                    f"{base} (xxh3-64 checksum mismatch)")
        self.version = delta.version
        return self.mirror
