"""The learner's parallelism strategies: one process (``Single``), data parallel (``DDP``) and sharded (``FSDP2``).

A strategy owns everything that depends on how the learner's ranks share the models: wrapping the trained model,
placing the frozen ones (reference, teacher), the micro-batching constraint, evening out the ranks' micro-batches,
the optimizer state's form in a snapshot (whole, or shards in ``sharded_state_dict``) and the weights' export
(``PolicyLearner.export_weights`` and ``checkpoint_weights``). ``PolicyLearner`` and the critic ask it; the checkpoint
code reads ``learner.parallel`` (``sharded``, ``whole_into_shards``).

The micro-batching rule is also a pure function of plain values (``effective_micro_batching`` over ``parallel_kind``),
so that a plan or a validator built elsewhere applies the learner's own rule without building a strategy.

Legend: N ranks of the default process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from rlray.learner.batching import MicroBatching
from rlray.learner.logprobs import store_frozen_for_autocast
from rlray.learner.lora import merged_lora_state_dict
from rlray.learner.sharding import (
    M_MMAP_THRESHOLD,
    MMAP_THRESHOLD_BYTES,
    gathered_merged_lora_state_dict,
    gathered_state_dict,
    glibc_call,
    shard,
)

KINDS = ("single", "ddp", "fsdp")
"""The strategies by name: one process, data parallel (every rank holds the whole model), FSDP2 (1/N shards)."""


class MicroBatchLimits(NamedTuple):
    """A micro-batch's limits as a learner runs them: ``sequences`` rows, or a ``tokens`` budget when not None."""

    sequences: int
    tokens: int | None


def parallel_kind(strategy: str, world: int) -> str:
    """Returns the strategy a learner of ``world`` ranks runs: "fsdp" for ``resources.learner.strategy`` fsdp over
    more than one rank, "ddp" for any other over more than one, "single" for one rank (``rlray.run.build``)."""
    if world > 1:
        return "fsdp" if strategy == "fsdp" else "ddp"
    return "single"


def effective_micro_batching(kind: str, tokens_per_microbatch: int | None,
                             sequences_per_microbatch: int) -> MicroBatchLimits:
    """Returns the micro-batch limits a learner of strategy ``kind`` runs (``learner.tokens_per_microbatch`` and
    ``learner.sequences_per_microbatch`` as configured).

    FSDP cuts by sequences, a token budget is not used: every rank must run as many forwards (each gathers the
    weights over the ranks), and a token budget could cut the ranks' rows into different counts. Single and DDP
    use the budget as it is.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``.
    """
    if kind not in KINDS:
        raise ValueError(f"parallelism kind {kind!r}: use one of {KINDS}")
    if kind == "fsdp" and tokens_per_microbatch:
        return MicroBatchLimits(sequences_per_microbatch, None)
    return MicroBatchLimits(sequences_per_microbatch, tokens_per_microbatch)


def to_local_gpu(model: torch.nn.Module) -> torch.nn.Module:
    """Returns ``model`` moved to this process's current CUDA device (a one-rank GPU learner, which has no DDP to wrap it)."""
    return model.to(torch.device("cuda", torch.cuda.current_device()))


class Parallelism:
    """The strategy interface, with the behaviour of a learner whose every rank holds whole models (``Single``,
    ``DDP``); ``FSDP2`` overrides what sharding changes.

    Attributes:
        kind: "single", "ddp" or "fsdp" (``KINDS``).
        sharded: the trained model's state is split over the ranks (collectives to gather or save it).
    """

    kind: ClassVar[str] = "single"
    sharded: ClassVar[bool] = False

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Returns the trained model ready to train on this rank (moved, wrapped or sharded); identity here."""
        return model

    def place_frozen(self, model: torch.nn.Module, *, dtype: str, device: torch.device | None) -> torch.nn.Module:
        """Returns a frozen model (reference, teacher) placed for scoring: whole on ``device`` (the policy's; None
        leaves it where it is), its linear weights in bf16 under bf16 autocast (``store_frozen_for_autocast``: the
        same outputs, half the memory)."""
        store_frozen_for_autocast(model, dtype)
        return model if device is None else model.to(device)

    def micro_batching(self, batching: MicroBatching) -> MicroBatching:
        """Returns ``batching`` as this strategy runs it (``effective_micro_batching``)."""
        limits = effective_micro_batching(self.kind, batching.tokens, batching.sequences)
        if (limits.sequences, limits.tokens) == (batching.sequences, batching.tokens):
            return batching
        return dataclasses.replace(batching, sequences=limits.sequences, tokens=limits.tokens)

    def even_microbatches(self, microbatches: list[Any], device: torch.device) -> list[Any]:
        """Returns this rank's micro-batches, repeated at the end where every rank must run as many (FSDP2); as they
        are here."""
        return microbatches

    def accumulating(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Returns the context of one micro-batch's forward and backward (``last``: the mini-batch's last one);
        no effect here."""
        return contextlib.nullcontext()

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """Returns ``t`` whole (a DTensor's value over the ranks, e.g. clip_grad_norm_'s total norm), plain as is."""
        from torch.distributed.tensor import DTensor

        return t.full_tensor() if isinstance(t, DTensor) else t

    @torch.no_grad()
    def export_weights(self, module: torch.nn.Module, *, lora: bool, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Returns the model's Hugging Face state dict cast to ``dtype`` on ``device`` (contiguous), LoRA merged in
        (``merged_lora_state_dict``) when ``lora``; see ``PolicyLearner.export_weights``."""
        state = merged_lora_state_dict(module) if lora else module.state_dict()
        return {k: v.detach().to(device, dtype).contiguous() for k, v in state.items()}

    @torch.no_grad()
    def checkpoint_weights(self, module: torch.nn.Module, *, lora: bool) -> dict[str, torch.Tensor]:
        """Returns what ``save_pretrained`` writes as the model's weights: every tensor, or the adapters only with
        ``lora``; here the module's own tensors (no copy)."""
        return {k: v for k, v in module.state_dict().items() if not lora or "lora_" in k}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """Returns the optimizer's whole state for trainer_state.pt, or None where it is saved as shards."""
        return optimizer.state_dict()

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Loads a whole optimizer state (``optimizer_state``'s, indexed by trainable parameter number)."""
        optimizer.load_state_dict(state)

    def whole_into_shards(self) -> contextlib.AbstractContextManager:
        """Returns a context in which whole tensors load into sharded (DTensor) parameters: each is taken as
        replicated and its shard copied (``implicit_replication``); no effect on plain modules."""
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()


@dataclass(frozen=True)
class Single(Parallelism):
    """One learner process: the model on this process's GPU (``gpu``) or left on the CPU.

    Args:
        gpu: move the trained model to the current CUDA device (``to_local_gpu``).
    """

    gpu: bool = False
    kind: ClassVar[str] = "single"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Returns ``model`` on this process's GPU when ``gpu``, else as it is."""
        return to_local_gpu(model) if self.gpu else model


def _prepare_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """Ray Train's DDP wrap (``ray.train.torch.prepare_model``): moved to the worker's device, wrapped in DDP."""
    import ray.train.torch

    return ray.train.torch.prepare_model(model, parallel_strategy="ddp")


@dataclass(frozen=True)
class DDP(Parallelism):
    """Data parallel: every rank holds the whole model; gradients all-reduce on a mini-batch's last micro-batch.

    Args:
        wrap_model: the wrap (``ray.train.torch.prepare_model``'s DDP by default; ``torch.nn.parallel.
            DistributedDataParallel`` in a process group opened outside Ray Train).
    """

    wrap_model: Callable[[torch.nn.Module], torch.nn.Module] = _prepare_ddp
    kind: ClassVar[str] = "ddp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Returns ``model`` wrapped for data parallelism (``wrap_model``)."""
        return self.wrap_model(model)

    def accumulating(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Returns DDP's ``no_sync`` for every micro-batch but the last (one all-reduce per mini-batch)."""
        return model.no_sync() if (not last and hasattr(model, "no_sync")) else contextlib.nullcontext()


@dataclass(frozen=True)
class FSDP2(Parallelism):
    """Shards the learner's models with FSDP2 over every rank of the default process group (``rlray.learner.sharding``).

    Args:
        mixed_precision: gather parameters in bf16 and reduce gradients in float32 (``model.dtype`` bfloat16);
            False keeps everything in float32.
        gpu: place the shards on this process's CUDA device (NCCL); False keeps them on the CPU (gloo).
    """

    mixed_precision: bool
    gpu: bool = False
    kind: ClassVar[str] = "fsdp"
    sharded: ClassVar[bool] = True

    def __post_init__(self) -> None:
        glibc_call("mallopt", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)  # before the models are loaded

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Returns ``model`` (a float32 Hugging Face model, or a peft model over one) sharded in place, trainable.

        Rank 0's parameters and buffers are broadcast first, as DDP does, so that what was initialised at random
        (LoRA's A, a value head) is one model, not a patchwork of every rank's draws.
        """
        return shard(model, mixed_precision=self.mixed_precision, gpu=self.gpu, broadcast=True)

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """Returns a frozen model (the reference, the teacher) sharded in place: its parameters stored in bf16 under
        mixed precision (the values the policy's units gather), float32 otherwise. Buffers keep their dtype.

        Raises:
            ValueError: a parameter still requires grad.
        """
        if any(p.requires_grad for p in model.parameters()):
            raise ValueError("FSDP2.frozen: the model has parameters that require grad; freeze it first")
        if self.mixed_precision:
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        return shard(model, mixed_precision=self.mixed_precision, gpu=self.gpu, broadcast=False)

    def place_frozen(self, model: torch.nn.Module, *, dtype: str, device: torch.device | None) -> torch.nn.Module:
        """Returns the frozen model sharded like the policy (``frozen``; ``dtype`` and ``device`` follow from
        ``mixed_precision`` and ``gpu``)."""
        return self.frozen(model)

    def even_microbatches(self, microbatches: list[Any], device: torch.device) -> list[Any]:
        """Returns this rank's micro-batches with its last one repeated up to the largest count over the ranks (every
        forward gathers over the ranks; ``PolicyLearner.optimizer_step`` backwards a repeat times 0). A collective.

        Raises:
            ValueError: this rank has no micro-batch.
        """
        if not microbatches:
            raise ValueError("a sharded learner rank got no micro-batch: every rank needs rows (FSDP2 gathers)")
        real = len(microbatches)
        return microbatches + microbatches[-1:] * (_max_over_ranks(real, device) - real)

    @torch.no_grad()
    def export_weights(self, module: torch.nn.Module, *, lora: bool, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Returns the whole state dict on rank 0 ({} elsewhere), gathered one tensor at a time and cast at once
        (``sharding.gathered_state_dict``, or ``gathered_merged_lora_state_dict`` with ``lora``). A collective."""
        if lora:
            return gathered_merged_lora_state_dict(module, dtype=dtype, device=device)
        return gathered_state_dict(module, dtype=dtype, device=device)

    @torch.no_grad()
    def checkpoint_weights(self, module: torch.nn.Module, *, lora: bool) -> dict[str, torch.Tensor]:
        """Returns the weights whole and in float32 on rank 0 ({} elsewhere; a collective), the adapters only with
        ``lora``. A tied name (lm_head) is left out, as ``save_pretrained`` leaves it out of its own state."""
        include = (lambda name: "lora_" in name) if lora else None
        state, seen = gathered_state_dict(module, include=include), set()
        return {k: v for k, v in state.items() if not (id(v) in seen or seen.add(id(v)))}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """Returns None: the optimizer's shards are saved by ``PolicyLearner.sharded_state_dict``."""
        return None

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Loads a whole optimizer state (an unsharded learner's snapshot) into the shards: its parameter numbers are
        the trainable parameters in order, under their names (``set_optimizer_state_dict``). A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, p in model.named_parameters() if p.requires_grad]
        named = {"state": {names[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def strategy_for(kind: str, *, gpu: bool = False, mixed_precision: bool = False) -> Parallelism:
    """Returns the strategy named ``kind`` (``parallel_kind``): ``Single(gpu)``, ``DDP()`` (Ray Train's wrap, which
    places on the worker's device itself) or ``FSDP2(mixed_precision, gpu)``.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``.
    """
    if kind == "single":
        return Single(gpu=gpu)
    if kind == "ddp":
        return DDP()
    if kind == "fsdp":
        return FSDP2(mixed_precision=mixed_precision, gpu=gpu)
    raise ValueError(f"parallelism kind {kind!r}: use one of {KINDS}")


def _max_over_ranks(n: int, device: torch.device) -> int:
    """Returns the largest ``n`` over the ranks of the default process group (a collective; ``device``: where the
    backend reduces, CUDA for NCCL)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())
