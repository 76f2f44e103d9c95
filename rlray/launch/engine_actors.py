"""The engine actors: thin Ray actors over rlray's model-holding classes (``rlray.launch.actors`` starts them).

- ``RolloutActor`` over ``RolloutEngine`` (one vLLM engine per actor), named ``rlray:rollout-<i>``; with partial
  rollouts (``rollout.partial``) ``PartialRolloutActor``, whose weight pushes run beside a generation.
- ``ReferenceActor`` over ``ReferenceModel`` (the reference policy, or the distillation teacher).

This module imports no torch, vLLM or config schema at import time: a process that only unpickles one of these
actors' handles (Ray Train's controller receives them in ``WorkerArgs``) imports it and stays light (issue 39: the
controller took ~6 s of imports on 2 cores before the learner's workers could start). Each actor imports its engine
in ``__init__``, before ``ActorTimes.begin``, so ``startup/<actor>_imports_s`` still counts it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray

from rlray.hangs import enable_stack_dumps
from rlray.observe.startup import ActorTimes

if TYPE_CHECKING:
    import torch

    from rlray.learner.batching import MicroBatching
    from rlray.models.adapters import AdapterWeights
    from rlray.rollout import Completion, SamplingSpec
    from rlray.rollout.delta import WeightDelta
    from rlray.schema import ModelInputs

log = logging.getLogger(__name__)


class RolloutActor:
    """Ray actor around a ``RolloutEngine`` (one vLLM engine per actor).

    Args:
        model_path: local Hugging Face folder of the initial policy.
        engine_kwargs: keyword arguments of ``RolloutEngine`` (dtype, seed, backend, ...).
    """

    def __init__(self, model_path: str, engine_kwargs: dict) -> None:
        from rlray.rollout import RolloutEngine  # deferred (module docstring); counted as the actor's imports
        from rlray.rollout.delta import DeltaReceiver

        self.times = ActorTimes.begin()
        enable_stack_dumps()  # a call past its deadline is reported with this process's stacks (rlray.hangs)
        self.engine = RolloutEngine(model_path, **engine_kwargs)
        self.receiver = DeltaReceiver()  # a copy of the weights only once a delta sync sends them
        self.times.end()

    def startup_times(self) -> ActorTimes:
        """Returns this actor's start: its process's creation, its imports and its engine's build (``ActorTimes``)."""
        return self.times

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec,
                 min_version: int = 0) -> list[Completion]:
        """Returns ``sampling.n`` completions per prompt, prompt-major (see ``RolloutEngine.generate``; ``min_version``:
        partial rollouts only, the oldest policy version the generation may start with)."""
        return self.engine.generate(prompt_token_ids, sampling, min_version)

    def update_weights(self, weights: dict[str, Any] | AdapterWeights | WeightDelta, version: int) -> int:
        """Loads a new policy, resets the cache and returns the new version: whole weights (tensors, or
        ``rollout.wire.pack_weights`` output; ``RolloutEngine.update_weights``), a LoRA adapter (``AdapterWeights``,
        packed or not; ``RolloutEngine.update_adapter``: applied over the engine's base weights), or a delta
        (``WeightDelta``: applied to this actor's copy of the version it holds, ``rollout.delta.DeltaReceiver``, which
        the engine then loads whole).

        A delta for a version this actor does not hold, or whose checksums fail, loads nothing: the old version is
        returned and the fleet sends the full weights (``RolloutFleet.push_weights``).

        Raises:
            WeightSyncChecksumError: full weights (a ``WeightDelta`` with no base) whose checksums fail.
        """
        from rlray.models.adapters import AdapterWeights
        from rlray.rollout.delta import WeightDelta
        from rlray.rollout.wire import unpack_adapter, unpack_weights

        if isinstance(weights, WeightDelta):
            return self._update_delta(weights, version)
        self.receiver.clear()  # the engine takes weights by another path: the next delta is refused
        if isinstance(weights, AdapterWeights):
            self.engine.update_adapter(unpack_adapter(weights), version)
        else:
            self.engine.update_weights(unpack_weights(weights), version)
        return self.engine.policy_version

    def _update_delta(self, delta: WeightDelta, version: int) -> int:
        from rlray.rollout.delta import WeightSyncChecksumError

        if delta.version != version:
            raise ValueError(f"update_weights: a delta to version {delta.version} pushed as version {version}")
        try:
            weights = self.receiver.apply(delta)
        except WeightSyncChecksumError as err:
            if delta.base_version is None:
                raise
            log.warning("%s: loading nothing; the fleet sends the full weights", err)
            return self.engine.policy_version
        if weights is None:
            return self.engine.policy_version
        self.engine.update_weights(weights, version)
        return self.engine.policy_version

    def policy_version(self) -> int:
        """Returns the policy version the engine generates with."""
        return self.engine.policy_version

    def ready(self) -> bool:
        """Returns True once the engine is built (used to wait for start-up)."""
        return True

    # vLLM weight transfer (NCCL / CUDA IPC), driven by rlray.rollout.weight_sync.VllmTransferSync
    def transfer_init(self, init_info: dict) -> None:
        """Joins the trainer's weight-transfer group (``RolloutEngine.init_weight_transfer``)."""
        self.engine.init_weight_transfer(init_info)

    def transfer_start(self) -> None:
        """Begins a weight update (``RolloutEngine.start_weight_transfer``)."""
        self.engine.start_weight_transfer()

    def transfer_receive(self, update_info: dict) -> None:
        """Receives the weights the trainer is sending (``RolloutEngine.receive_weights``)."""
        self.engine.receive_weights(update_info)

    def transfer_finish(self, version: int) -> int:
        """Ends the update, resets the cache, and returns the new policy version."""
        self.engine.finish_weight_transfer(version)
        self.receiver.clear()
        return self.engine.policy_version

    def transfer_shutdown(self) -> None:
        """Leaves the weight-transfer group (``RolloutEngine.shutdown_weight_transfer``)."""
        self.engine.shutdown_weight_transfer()


WEIGHTS_GROUP = "weights"  # PartialRolloutActor's concurrency group of weight pushes (one at a time)


class PartialRolloutActor(RolloutActor):
    """A ``RolloutActor`` for partial rollouts (``rollout.partial``): its weight pushes run in their own concurrency
    group (``WEIGHTS_GROUP``, one thread), beside a generation in progress, which takes them between two of its
    segments (``rlray.rollout.partial``); every other call runs on the actor's default thread, in the order sent.

    Start it with ``ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})`` (``rlray.launch.actors``).
    """

    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def update_weights(self, weights: dict[str, Any] | AdapterWeights | WeightDelta, version: int) -> int:
        """Loads a new policy while a generation may run (``RolloutActor.update_weights``); returns the new version."""
        return super().update_weights(weights, version)


class ReferenceActor:
    """Ray actor around a ``ReferenceModel``: a frozen model shared by every learner rank that receives the model
    inputs of a shard (``schema.ModelInputs``, nothing else of the step) and sends [B, T] logprobs of the sampled
    tokens (the reference policy, or the distillation teacher).

    Args:
        model_path: local Hugging Face folder of the initial policy (reference) or of the teacher.
        model_kwargs: keyword arguments of ``ReferenceModel`` (dtype, temperature, torch_threads).
    """

    def __init__(self, model_path: str, model_kwargs: dict) -> None:
        from rlray.learner.reference import ReferenceModel  # deferred (module docstring)

        self.times = ActorTimes.begin()
        enable_stack_dumps()
        self.model = ReferenceModel(model_path, **model_kwargs)
        self.times.end()

    def startup_times(self) -> ActorTimes:
        """Returns this actor's start: its process's creation, its imports and its model's load (``ActorTimes``)."""
        return self.times

    def logprobs(self, inputs: ModelInputs, batching: MicroBatching) -> torch.Tensor:
        """Returns [B, T] float32 reference logprobs of the rows' responses, micro-batch by micro-batch (``batching``)."""
        return self.model.logprobs(inputs, batching)

    def ready(self) -> bool:
        """Returns True once the model is loaded."""
        return True
