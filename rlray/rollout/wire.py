"""Weights in Ray's object store without serialising tensors: raw bytes out, zero-copy views back in.

``ray.put`` pickles a torch tensor through ``torch.save`` (a full serialisation into a bytes object),
and every reader rebuilds it with ``torch.load`` (another full copy per actor). A NumPy array, by
contrast, goes out of band: ``ray.put`` copies its bytes into shared memory once and ``ray.get`` on
the same node maps them without a copy. NumPy has no bfloat16, so each tensor travels as its raw
bytes (a uint8 view) plus its dtype and shape. Measured with benchmarks/weight_sync.py.

A LoRA adapter (``AdapterWeights``, an adapter-only sync) travels the same way: its tensors packed, its config as is.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rlray.models.adapters import AdapterWeights


def pack_weights(named_tensors: dict[str, torch.Tensor]) -> dict[str, tuple[Any, str, tuple[int, ...]]]:
    """Returns {name: (uint8 ndarray of the tensor's bytes, dtype name, shape)} for ``ray.put``; no copy.

    Args:
        named_tensors: CPU tensors (any dtype); non-contiguous ones are made contiguous (a copy).
    """
    out = {}
    for name, t in named_tensors.items():
        t = t.detach().contiguous()
        out[name] = (t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
    return out


def packed_bytes(payload: dict[str, Any] | AdapterWeights) -> int:
    """Returns the bytes of tensor data in a ``pack_weights`` or ``pack_adapter`` payload (what a push puts in the
    object store, its small name/dtype/shape headers left out); plain tensors count their ``nbytes`` too.

    Example: ``packed_bytes(pack_weights({"w": torch.zeros(3, 2)}))`` is 24 (6 float32 values).
    """
    tensors = payload.tensors if isinstance(payload, AdapterWeights) else payload
    return sum(int(v.nbytes) if isinstance(v, torch.Tensor) else int(v[0].nbytes) for v in tensors.values())


def unpack_weights(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Returns {name: tensor} from ``pack_weights``' output (views of its buffers, read-only in Ray's store).

    Plain tensors pass through unchanged, so a dict of tensors is accepted as well.
    """
    out = {}
    with warnings.catch_warnings():  # torch warns that Ray's shared buffers are not writable; nothing writes them
        warnings.simplefilter("ignore", UserWarning)
        for name, value in payload.items():
            if isinstance(value, torch.Tensor):
                out[name] = value
                continue
            raw, dtype, shape = value
            out[name] = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    return out


def pack_adapter(adapter: AdapterWeights) -> AdapterWeights:
    """Returns ``adapter`` with its tensors packed by ``pack_weights`` (for ``ray.put``; no copy), its config as is."""
    return AdapterWeights(pack_weights(adapter.tensors), adapter.config)


def unpack_adapter(adapter: AdapterWeights) -> AdapterWeights:
    """Returns ``adapter`` with its tensors unpacked by ``unpack_weights`` (views; tensors pass through)."""
    return AdapterWeights(unpack_weights(adapter.tensors), adapter.config)

