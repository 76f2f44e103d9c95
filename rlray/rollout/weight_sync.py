"""Weight sync: learner -> rollout actors, version-tagged, after every update (online step stage 7).

- ``ObjectStoreSync`` (CPU, and any cluster): rank 0 exports the policy (HF names, engine dtype),
  puts it in Ray's object store once as raw bytes (``rollout.wire``: no tensor pickling, zero-copy
  reads), and every actor loads it in place (``update_weights``:
  vLLM's layerwise reload, which also repacks vLLM's CPU GEMM weights; ../shared/ENVIRONMENT.md).
  With ``adapter`` (``rollout.lora_sync``) it ships only the policy's LoRA adapter (``export_adapter``: a few MiB
  instead of the whole model) and every actor applies it over the base weights it loaded at start
  (``update_adapter``: vLLM's runtime LoRA).
  With ``delta`` (``rollout.weight_payload: delta``) it ships only the values whose engine-dtype bits changed since
  the last push (``rlray.rollout.delta``; rank 0 keeps the last version sent): an actor that holds another version
  loads nothing and the fleet sends it the full weights (``RolloutFleet.push_weights``' ``full``), and every load is
  checked bit for bit against the learner's per-tensor checksums.
- ``VllmTransferSync`` (GPU): vLLM's weight-transfer engines. "nccl": rank 0 broadcasts over an
  NCCL group it shares with every engine worker (``NCCLTrainerWeightTransferEngine``). "ipc": with
  colocated actors every learner rank shares its GPU copy through CUDA IPC handles
  (``IPCTrainerWeightTransferEngine``); no bytes cross the network. Both are driven through
  ``FleetTransferClient``, vLLM's ``VLLMWeightSyncClient`` protocol over our rollout actors.

Caches are reset after every sync (the engines drop their prefix cache in the same call). Every push leaves
``last_metrics`` on rank 0: ``rollout/weight_sync_bytes`` (values and indices put in the object store; 0 for nccl and ipc),
and with ``delta`` ``rollout/weight_sync_changed_fraction`` (values whose engine-dtype bits changed) and
``rollout/weight_sync_full_resyncs`` (actors sent the full weights since the previous push).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import ray
import torch

from rlray.rollout.delta import DeltaEncoder
from rlray.rollout.fleet import RolloutFleet
from rlray.rollout.wire import pack_adapter, pack_weights, packed_bytes


class ObjectStoreSync:
    """Pushes weights through the object store (``ray.put`` once, every actor fetches it).

    The store holds one copy at a time: a push releases the previous one before writing its own, and a synchronous
    push (``wait``) drops its own once every actor has loaded it (an actor that restarts then gets a fresh export,
    which is the pushed version until the next push). Shared memory is reused from push to push instead of a second
    region being touched while the first is still held.

    Args:
        fleet: the rollout fleet (rank 0; None on other ranks).
        dtype: dtype of the shipped tensors (the engine's).
        wait: block until every actor loaded the weights (sync mode); async mode checks later.
        adapter: ship the LoRA adapter alone (``learner.export_adapter``; rank 0 only, the learner unsharded)
            instead of the merged weights (``learner.export_weights``).
        delta: ship the merged weights as deltas from the last push (``rlray.rollout.delta``); not with ``adapter``.

    Raises:
        ValueError: ``delta`` with ``adapter``.
    """

    def __init__(self, fleet: RolloutFleet | None, dtype: torch.dtype, *, wait: bool = True, adapter: bool = False,
                 delta: bool = False) -> None:
        if delta and adapter:
            raise ValueError("ObjectStoreSync: a delta sync ships merged weights, not an adapter (rollout.lora_sync)")
        self.fleet, self.dtype, self.wait, self.adapter = fleet, dtype, wait, adapter
        self.encoder = DeltaEncoder() if delta else None
        self.last_metrics: dict[str, float] = {}
        self._resyncs_seen = 0

    def push(self, learner: Any, rank: int, version: int) -> None:
        """Exports the policy on rank 0 (on every rank with FSDP, a collective) and sends it, tagged ``version``."""
        if rank != 0 and not learner.sharded:
            return
        if self.encoder is not None:
            self._push_delta(learner, rank, version)
            return
        payload = self.export(learner)
        if rank == 0:
            self.last_metrics = {"rollout/weight_sync_bytes": float(packed_bytes(payload))}
            self.fleet.release_weights()  # an async push's copy goes before the new one is written (memory reused)
            self.fleet.push_weights(ray.put(payload), version, wait=self.wait)
            if self.wait and not learner.sharded:
                # Every live actor has loaded them: the store's copy goes, so the next push reuses its shared
                # memory instead of touching a second region (~0.5 GiB of PSS for SmolLM2 in float32). Until that
                # push the policy is exactly this version, so an actor that restarts gets a fresh export of it.
                self.fleet.mark_synced(version, lambda: ray.put(self.export(learner)))

    def _push_delta(self, learner: Any, rank: int, version: int) -> None:
        """Sends what changed since the last push (the full weights at the first); an actor that holds another
        version gets ``encoder.full()`` from the fleet. With FSDP the export is a collective; rank 0 alone encodes."""
        tensors = learner.export_weights(self.dtype)
        if rank != 0:
            return
        delta = self.encoder.encode(tensors, version)
        del tensors
        self.fleet.release_weights()
        self.fleet.push_weights(ray.put(delta), version, wait=self.wait, full=lambda: ray.put(self.encoder.full()))
        resyncs, self._resyncs_seen = self.fleet.full_resyncs - self._resyncs_seen, self.fleet.full_resyncs
        self.last_metrics = {"rollout/weight_sync_bytes": float(delta.nbytes), "rollout/weight_sync_changed_fraction": delta.changed_fraction,
                             "rollout/weight_sync_full_resyncs": float(resyncs)}

    def export(self, learner: Any) -> Any:
        """Returns what a push puts in the object store: ``pack_adapter`` of the adapter (``adapter``), else
        ``pack_weights`` of the merged weights (with FSDP a collective; only rank 0 gets tensors)."""
        if self.adapter:
            return pack_adapter(learner.export_adapter(self.dtype))
        return pack_weights(learner.export_weights(self.dtype))


def _dict_source() -> Any:
    """Returns a vLLM ``WeightSource`` over a ready {name: tensor} dict (set ``.tensors`` before each send).

    Built on first use, so that importing this module does not need vLLM.
    """
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource  # deferred: vllm is optional (GPU sync only)

    class DictSource(WeightSource):
        def __init__(self) -> None:
            self.tensors: dict[str, torch.Tensor] = {}

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from self.tensors.items()

    return DictSource()


class FleetTransferClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over rlray's rollout actors (all of them, as one unit).

    NCCL ranks: the trainer is rank 0 and actor i's tensor-parallel workers take ranks
    ``1 + i * tp .. i * tp + tp``; vLLM gives every engine rank_offset 1, so this client rewrites it
    per actor (the engines are separate, not data-parallel replicas of one).

    Args:
        actors: rollout actor handles.
        tensor_parallel_size: workers per engine.
    """

    def __init__(self, actors: list[Any], tensor_parallel_size: int) -> None:
        self.actors, self.tp = list(actors), tensor_parallel_size
        self.version = 0  # tagged on the engines by finish_weight_update

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        infos = [dict(init_info) for _ in self.actors]
        for i, info in enumerate(infos):
            if "rank_offset" in info:
                info["rank_offset"] = 1 + i * self.tp
        ray.get([a.transfer_init.remote(info) for a, info in zip(self.actors, infos, strict=True)])

    def start_weight_update(self) -> None:
        ray.get([a.transfer_start.remote() for a in self.actors])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        ray.get([a.transfer_receive.remote(update_info) for a in self.actors])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        got = ray.get([a.transfer_finish.remote(self.version) for a in self.actors])
        if any(v != self.version for v in got):
            raise RuntimeError(f"weight transfer: rollout actors report versions {got}, expected {self.version}")


class VllmTransferSync:
    """Pushes weights with vLLM's NCCL broadcast ("nccl") or CUDA IPC ("ipc") weight-transfer engines.

    The transfer group is built at the first push and rebuilt after a rollout actor has died (a
    restarted actor is first brought up to date through the object store by the fleet).

    Args:
        fleet: the rollout fleet (rank 0; None on other ranks).
        backend: "nccl" or "ipc".
        dtype: dtype of the shipped tensors.
        tensor_parallel_size: GPUs per engine.

    Attributes:
        last_metrics: {"rollout/weight_sync_bytes": bytes of tensor data this rank sent in the last push} (rank 0 for
            nccl; each rank its own for ipc); {} before the first push.
    """

    def __init__(self, fleet: RolloutFleet | None, backend: str, dtype: torch.dtype, tensor_parallel_size: int) -> None:
        if backend not in ("nccl", "ipc"):
            raise ValueError(f"VllmTransferSync: backend={backend!r}; use 'nccl' or 'ipc'")
        self.fleet, self.backend, self.dtype, self.tp = fleet, backend, dtype, tensor_parallel_size
        self._engine: Any = None
        self._client: FleetTransferClient | None = None
        self._source: Any = None
        self._failures_at_init = -1
        self.last_metrics: dict[str, float] = {}  # rank 0: the bytes of its last send

    def push(self, learner: Any, rank: int, version: int) -> None:
        """Exports the policy on the GPU (every rank for ipc or FSDP) and sends it, tagged ``version``.

        With FSDP the export is a collective that leaves the weights on rank 0, the only learner rank of the NCCL
        group (``NCCLTrainerInitInfo`` rank 0; the engines' workers hold ranks 1..): the other ranks export and return.
        """
        if rank != 0 and not (self.backend == "ipc" or learner.sharded):
            return
        device = torch.device("cuda", torch.cuda.current_device())
        if self._source is None:
            self._source = _dict_source()
        self._source.tensors = learner.export_weights(self.dtype, device=device)
        if rank != 0 and self.backend == "nccl":
            self._source.tensors = {}
            return
        self._ensure_group(rank)
        self.last_metrics = {"rollout/weight_sync_bytes": float(packed_bytes(self._source.tensors))}
        self._client.version = version
        self._engine.send_weights()
        if rank == 0:
            exporter = None if learner.sharded else (lambda: ray.put(pack_weights(learner.export_weights(self.dtype))))
            self.fleet.mark_synced(version, exporter)
        self._source.tensors = {}

    def _ensure_group(self, rank: int) -> None:
        # ipc: a collective on every rank, so every rank rebuilds when rank 0 must (the failure count
        # lives on rank 0; the ipc group has no rendezvous state of its own to rebuild).
        failures = self.fleet.failures if self.fleet is not None else 0
        if self._engine is not None and failures == self._failures_at_init:
            return
        if self._engine is not None:
            self._engine.shutdown()
            ray.get([a.transfer_shutdown.remote() for a in self._client.actors])
        # vLLM's trainer engines call the client on the sender (rank 0) only; other ranks hold an empty one.
        self._client = FleetTransferClient(self.fleet.live_actors if rank == 0 else [], self.tp)
        self._engine = self._trainer_engine(rank)
        self._failures_at_init = failures

    def _trainer_engine(self, rank: int) -> Any:
        # deferred: vllm is optional (GPU sync only)
        if self.backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

            return IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=rank), client=self._client, source=self._source
            )
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        info = NCCLTrainerInitInfo(
            master_address=ray.util.get_node_ip_address(),
            master_port=free_port(),
            world_size=1 + len(self._client.actors) * self.tp,
            rank=rank,
        )
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=self._client, source=self._source)


def free_port() -> int:
    """Returns a TCP port that is free on this node now (for the NCCL group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def make_weight_sync(backend: str, fleet: RolloutFleet | None, dtype: torch.dtype, *, wait: bool, tensor_parallel_size: int,
                     adapter: bool = False, delta: bool = False):
    """Returns the weight sync of ``backend`` (``Config.weight_sync_backend``): object_store, nccl or ipc; with
    ``adapter`` (``Config.adapter_sync``) the object store's adapter-only sync, with ``delta``
    (``rollout.weight_payload: delta``) its delta sync.

    Raises:
        ValueError: ``adapter`` or ``delta`` with nccl or ipc (both go through the object store).
    """
    if (adapter or delta) and backend != "object_store":
        raise ValueError(f"an adapter-only or delta weight sync goes through the object store, not {backend!r}")
    if backend == "object_store":
        return ObjectStoreSync(fleet, dtype, wait=wait, adapter=adapter, delta=delta)
    return VllmTransferSync(fleet, backend, dtype, tensor_parallel_size)
