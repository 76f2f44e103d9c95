"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the learner's models sharded over the ranks, and gathered back.

Layout (torchtitan's): every decoder layer is one unit, then every direct part of the model that shares no weight
with another (a classifier's trunk and its head; an untied LM's body and lm_head), then the root: a tied LM's root
holds the embedding, the final norm and the lm_head (one weight). A unit's parameters are gathered for its forward
and again for its backward, and its gradients reduce-scattered after its backward, so a rank holds 1/N of the
weights, gradients and optimizer state plus the units in flight (``rlray.launch.plan_roles``: the root and two
layers). It runs on gloo (CPU) as on NCCL (CUDA), in the process group Ray Train's ``TorchTrainer`` opened.

Precision: float32 master shards always. With ``mixed_precision`` (``model.dtype`` bfloat16) a unit gathers its
parameters in bf16 and reduces its gradients in float32 (``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``), torchtitan's and verl's FSDP2 setting, instead of DDP's bf16 autocast over float32
weights: autocast would keep a bf16 copy of every gathered linear weight for backward, a whole bf16 model per rank.
So under bf16 an FSDP step is not bitwise a DDP step (the residual stream is bf16 too, as in the vLLM engine); in
float32 the two agree to float rounding (tests/learner/test_fsdp.py). The frozen reference and teacher are stored
as bf16 shards under bf16 (the same bf16 values the policy gathers, half the memory) and gathered the same way.

Gradient accumulation: every micro-batch's backward reduce-scatters (FSDP2's default). Skipping it
(``set_requires_gradient_sync(False)``) would accumulate whole unsharded gradients, in bf16 under mixed precision,
until the last micro-batch: a full gradient copy per rank, which is what sharding removes.

Every rank must run the same forwards (each gathers over the ranks): ``PolicyLearner`` pads a rank's micro-batches
to the others' count (``rlray.learner.parallel.FSDP2.even_microbatches``).

Memory on the CPU (glibc): the whole float32 models a rank loads before sharding, and the gathered layers and whole
gradients of every step, are freed, but glibc's malloc keeps a freed block of under 32 MiB in its heaps once its
mmap threshold has risen (it rises to each freed mmapped block's size), so the process's resident memory stays near
DDP's (SmolLM2-135M, 2 ranks: 4.8 GiB peak per rank against DDP's 4.6). ``parallel.FSDP2`` therefore fixes the threshold at
1 MiB (``mallopt(M_MMAP_THRESHOLD)``: larger blocks are mapped and unmapped, as they are freed) before the model is
loaded, and returns the heaps' free pages after sharding (``malloc_trim``): 3.1 GiB per rank
(``benchmarks/fsdp_memory.py``). Other allocators (CUDA's caching allocator) are not affected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist


def shard(model: torch.nn.Module, *, mixed_precision: bool, gpu: bool, broadcast: bool) -> torch.nn.Module:
    """Returns ``model`` sharded in place over every rank of the default process group (``shard_units``, then the
    root), on this process's CUDA device (``gpu``) or the CPU; the strategy is ``rlray.learner.parallel.FSDP2``.

    Args:
        model: a Hugging Face model (or a peft model over one).
        mixed_precision: gather parameters in bf16 and reduce gradients in float32; False keeps float32.
        gpu: place the shards on the current CUDA device (NCCL); False keeps them on the CPU (gloo).
        broadcast: copy rank 0's parameters and buffers to every rank first (a trained model's random parts).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    model.to(device)
    if broadcast:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    glibc_call("malloc_trim", 0)  # the whole tensors just freed go back to the OS
    return model


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (malloc.h)."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks from 1 MiB up are mapped on their own and returned when freed (a decoder layer's weights are MiBs)."""


def glibc_call(name: str, *args: int) -> None:
    """Calls glibc's ``name(*args)`` (``mallopt``, ``malloc_trim``) where the C library is glibc; else does nothing."""
    path = ctypes.util.find_library("c")
    try:
        getattr(ctypes.CDLL(path), name)(*args)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS) or no C library found
        return


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Returns the sub-modules that become their own FSDP units, innermost first: every decoder layer (the classes
    in Hugging Face's ``_no_split_modules``), then every direct child of the Hugging Face model that holds
    parameters and shares none with a sibling. The root (``model``, or the peft model over it) is not included.
    """
    from peft import PeftModel

    hf = model.get_base_model() if isinstance(model, PeftModel) else model
    layer_classes = set(getattr(hf, "_no_split_modules", None) or ())  # a Hugging Face model's; None on others
    layers = [m for m in hf.modules() if type(m).__name__ in layer_classes]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    owners: dict[int, int] = {}
    children = [c for c in hf.children() if any(True for _ in c.parameters())]
    for c in children:
        for p in c.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    parts = [c for c in children if all(owners[id(p)] == 1 for p in c.parameters())
             and any(id(p) not in in_layers for p in c.parameters())]
    return layers + parts


def is_sharded(model: torch.nn.Module) -> bool:
    """Returns True when ``model`` is an FSDP2 unit (``fully_shard`` applied): its state is sharded over ranks."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _full(t: torch.Tensor) -> torch.Tensor:
    """Returns ``t`` whole: a DTensor's shards gathered from every rank (a collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


@torch.no_grad()
def gathered_state_dict(
    module: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    include: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Returns ``module.state_dict()`` whole on rank 0 (cast to ``dtype``, on ``device``, contiguous); {} elsewhere.

    A collective: every rank calls it with the same arguments. One tensor is gathered at a time and cast at once,
    so rank 0 holds the result and one float32 tensor in flight, never two copies of the model. Names that share
    one parameter (a tied lm_head) share one tensor in the result too (``keep_vars``: a tied name is the same object).

    Args:
        module: an FSDP2-sharded model (plain tensors pass through).
        dtype: the result's dtype; None keeps each tensor's own.
        device: where the result lives.
        include: keep only the names it accepts (e.g. a LoRA model's adapter tensors); None keeps all.
    """
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if include is not None and not include(name):
            continue
        if id(t) in first:
            if rank == 0:
                out[name] = out[first[id(t)]]
            continue
        first[id(t)] = name
        full = _full(t)
        if rank == 0:
            out[name] = full.detach().to(device, dtype or full.dtype).contiguous()
        del full
    return out


@torch.no_grad()
def gathered_merged_lora_state_dict(
    peft_model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Returns the sharded LoRA model's base state dict with every adapter merged in, whole on rank 0; {} elsewhere.

    The sharded counterpart of ``rlray.learner.lora.merged_lora_state_dict`` (same names and values): each adapted
    weight becomes ``W + transpose(B @ A, fan_in_fan_out) * scaling`` (peft's ``Linear.get_delta_weight``), computed
    in float32 from the gathered shards, one adapted layer at a time, then cast to ``dtype``. A collective.

    Raises:
        ValueError: an adapter uses DoRA (its magnitude vector is not merged here).
    """
    rank = dist.get_rank()
    base = peft_model.get_base_model()
    lora = {name: m for name, m in base.named_modules() if _is_lora_layer(m) and m.active_adapters}
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for key, value in _base_entries(base.state_dict(keep_vars=True), lora):
        if isinstance(value, torch.nn.Module):
            merged = _merged_weight(value)
            if rank == 0:
                out[key] = merged.to(device, dtype).contiguous()
        elif id(value) in first:  # a tied lm_head: the same tensor as the embedding's
            if rank == 0:
                out[key] = out[first[id(value)]]
        else:
            first[id(value)] = key
            full = _full(value)
            if rank == 0:
                out[key] = full.detach().to(device, dtype).contiguous()
    return out


def _base_entries(state: dict[str, torch.Tensor], lora: dict[str, torch.nn.Module]) -> Iterator[tuple[str, object]]:
    """Yields (name under the base model's names, its tensor or the LoRA layer whose merged weight goes there) in
    state-dict order; a LoRA layer's own tensors (base_layer, lora_A, lora_B) are replaced by its merged weight and,
    when it has one, its base layer's bias."""
    done: set[str] = set()
    for key, value in state.items():
        owner = next((name for name in lora if key.startswith(name + ".")), None)
        if owner is None:
            yield key, value
        elif owner not in done:
            done.add(owner)
            yield f"{owner}.weight", lora[owner]
            if f"{owner}.base_layer.bias" in state:
                yield f"{owner}.bias", state[f"{owner}.base_layer.bias"]


def _merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """Returns a LoRA layer's merged float32 weight whole (on every rank; a collective)."""
    adapter = layer.active_adapters[0]
    if layer.use_dora.get(adapter, False):
        raise ValueError("a DoRA adapter cannot be merged from FSDP shards; use resources.learner.strategy=ddp")
    weight = _full(layer.base_layer.weight).float()
    a, b = _full(layer.lora_A[adapter].weight).float(), _full(layer.lora_B[adapter].weight).float()
    delta = b @ a
    if layer.fan_in_fan_out:
        delta = delta.T
    return weight + delta * layer.scaling[adapter]
