"""Collectives between learner ranks: one process (world 1) or a Ray Train worker group.

Small Python objects go rank 0 -> all through Ray Train's synchronisation actor (the object itself
is put in the object store and only its reference travels, so Ray tracks ownership of any nested
references). Numbers are summed and gathered with ``torch.distributed`` (gloo on CPU, NCCL on GPU),
which Ray Train's ``TorchTrainer`` initialises.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train.collective import broadcast_from_rank_zero


class Collective:
    """Collectives for one rank. The base class is the single-process case (world size 1).

    Attributes:
        rank: this worker's rank (0-based).
        world: number of learner ranks.
    """

    rank: int = 0
    world: int = 1

    def broadcast(self, obj: Any) -> Any:
        """Returns rank 0's ``obj`` on every rank (others pass None)."""
        return obj

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Returns the element-wise sum of ``values`` over ranks (same keys on every rank)."""
        return dict(values)

    def all_reduce_max(self, values: dict[str, float]) -> dict[str, float]:
        """Returns the element-wise max of ``values`` over ranks (same keys on every rank)."""
        return dict(values)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns the concatenation along dim 0 of every rank's ``tensor`` (equal shapes)."""
        return tensor

    def barrier(self) -> None:
        """Waits until every rank has reached this call."""

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Runs the block with its collectives under the per-collective deadline, labelled ``stage`` ("stage 6 (update)
        of step 3"; ``rlray.run.collective_watch``: every rank does the same work before each of them); here none."""
        yield


class RayTrainCollective(Collective):
    """Collectives inside a Ray Train worker group (``ray.train.get_context()`` must work)."""

    def __init__(self) -> None:
        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world = ctx.get_world_size()

    def broadcast(self, obj: Any) -> Any:
        wrapped = [ray.put(obj)] if self.rank == 0 else None
        wrapped = broadcast_from_rank_zero(wrapped)
        return ray.get(wrapped[0])

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return {k: float(v) for k, v in zip(keys, t.tolist(), strict=True)}

    def all_reduce_max(self, values: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {k: float(v) for k, v in zip(keys, t.tolist(), strict=True)}

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, 0)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def current_collective() -> Collective:
    """Returns the Ray Train collective when running inside a Ray Train worker, else world size 1."""
    try:
        ray.train.get_context().get_world_rank()
    except Exception:  # not inside a Ray Train worker
        return Collective()
    return RayTrainCollective()


def name_learner_process(rank: int) -> None:
    """Names this learner process ``rlray:learner-<rank>`` (its process title, seen in ps/top and py-spy).

    Ray Train creates and names its worker actors itself (RayTrainWorker), so the actor name
    cannot be set; the process title, the torch thread name and the logger prefix can.
    """
    name = f"rlray:learner-{rank}"
    threading.current_thread().name = name
    logging.getLogger("rlray").info("%s started", name)
    try:
        import setproctitle  # deferred: optional (Ray installs it on most platforms)
    except ImportError:
        return
    setproctitle.setproctitle(name)
