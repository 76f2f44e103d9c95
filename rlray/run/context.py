"""``RunContext``: what a learner rank's run holds, and the part of a run that differs by kind.

The session (``rlray.run.session``: restore, step boundary, snapshots, finish) is written once
against this class; ``rlray.run.online.OnlineRun`` and ``rlray.run.offline.OfflineRun`` fill in the
steps, evaluation and progress line of their kind.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlray.config import Config
from rlray.data import PromptStream
from rlray.learner import PolicyLearner
from rlray.learner.collective import Collective
from rlray.observe.samples import StepSample
from rlray.observe.tracking import Tracker


class StepBoundary(Protocol):
    """Stage 8 of a step (log, guard, snapshot, hooks), handed to ``RunContext.run_step`` by the session."""

    def __call__(self, metrics: dict[str, float], samples: Sequence[StepSample] = (),
                 prompt_ids: Sequence[str] | None = None) -> None:
        """Ends the step with its metrics (complete on rank 0), rank 0's kept samples and the ids of the prompts the
        step consumed (online runs, rank 0: the prompt ledger, ``rlray.run.ledger``; None: no ledger)."""


@dataclass
class RunContext(abc.ABC):
    """Everything one learner rank's run holds, whatever its kind.

    Attributes:
        cfg: the config in force (a rollback may replace it).
        coll: the collectives of the learner group.
        learner: the policy learner (every rank).
        tokenizer: the policy's tokenizer.
        stream: the data cursor (rank 0 of online runs; every rank of offline runs, which all walk it).
        tracker: the MLflow run (rank 0 only).
        policy_version: the version of the learner's weights (optimizer steps taken; snapshots keep it).
    """

    cfg: Config
    coll: Collective
    learner: PolicyLearner
    tokenizer: Any
    stream: PromptStream | None = None
    tracker: Tracker | None = None
    policy_version: int = 0
    data_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """Returns this worker's rank."""
        return self.coll.rank

    @property
    def world(self) -> int:
        """Returns the number of learner ranks."""
        return self.coll.world

    def start_metrics(self) -> dict[str, float]:
        """Returns the metrics logged at step 0 of a fresh run (every rank calls it; rank 0 logs them)."""
        return dict(self.data_metrics)

    @abc.abstractmethod
    def run_step(self, step: int, end_step: StepBoundary) -> dict[str, float]:
        """Runs 0-based ``step`` on this rank, ending with ``end_step(metrics)``; returns its metrics (complete on rank 0)."""

    @abc.abstractmethod
    def evaluate_when_due(self, steps_done: int) -> dict[str, float]:
        """Returns the eval metrics due after ``steps_done`` steps (every rank calls it), or {}."""

    @abc.abstractmethod
    def progress_text(self, steps_done: int, metrics: dict[str, float]) -> str:
        """Returns the one progress line of a finished step (rank 0)."""

    def reload_rollouts(self) -> None:  # noqa: B027 (a hook with a default: offline runs have no rollouts)
        """Pushes the learner's weights to the rollout engines (start, restore, rollback); none by default."""

    def cursor_state(self) -> dict[str, Any]:
        """Returns the data cursor a snapshot keeps (``PromptStream.state_dict``: the prompts the steps done took)."""
        return self.stream.state_dict()

    def load_cursor_state(self, state: dict[str, Any]) -> None:
        """Sets the data cursor to a snapshot's ``state`` (``cursor_state``)."""
        self.stream.load_state_dict(state)

    def close(self) -> None:  # noqa: B027 (a hook with a default: nothing to release)
        """Releases what the run holds besides the learner (clients, connections); nothing by default."""
