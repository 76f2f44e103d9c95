"""``RunContext``: what a learner rank's run holds, the part of a run that differs by kind, and ``StepResult``.

The session (``rlray.run.session``: restore, step boundary, snapshots, finish) is written once
against this class; ``rlray.run.online.OnlineRun`` and ``rlray.run.offline.OfflineRun`` fill in the
steps, evaluation and progress line of their kind. A step returns a ``StepResult``; the session then
runs the step boundary (stage 8: eval when due, guards, log, hooks, snapshot) with it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.learner import PolicyLearner
from rlray.learner.collective import Collective
from rlray.observe.samples import StepSample
from rlray.observe.tracking import Tracker
from rlray.plan import RunPlan
from rlray.plan.settings import Settings


@dataclass(frozen=True)
class StepAlert:
    """An alert a step raises on rank 0, sent through the monitor at the step boundary (the driver's console prints
    it; ``rlray.run.failures``).

    Attributes:
        kind: env_failed, reward_failed, no_signal, ...
        message: one line for people, naming the source and the step.
    """

    kind: str
    message: str


@dataclass
class StepResult:
    """What one step hands to the step boundary (``rlray.run.session.step_boundary``).

    Attributes:
        metrics: the step's metrics ({"reward/mean": ..., "timing/step_s": ...}); complete on rank 0, the
            learner statistics (summed over ranks) elsewhere.
        samples: rank 0's kept rollouts of an online step (``tracking.samples_per_step``); () elsewhere.
        prompt_ids: the ids of the prompts the step took from the data stream, in the order taken (its own, then
            DAPO refills): the prompt ledger of an online step on rank 0 (``Tracker.log_ledger``); None elsewhere
            and for offline runs.
        alerts: rank 0's alerts of the step (failures, no reward signal), sent at the step boundary.
    """

    metrics: dict[str, float]
    samples: list[StepSample] = field(default_factory=list)
    prompt_ids: list[str] | None = None
    alerts: list[StepAlert] = field(default_factory=list)


@dataclass
class RunContext(abc.ABC):
    """Everything one learner rank's run holds, whatever its kind.

    Attributes:
        plan: the run plan in force (``rlray.plan.resolve_plan``; a rollback replaces it through ``adopt_plan``).
        coll: the collectives of the learner group.
        learner: the policy learner (every rank).
        tokenizer: the policy's tokenizer.
        tracker: the MLflow run (rank 0 only; None on the other ranks).
        policy_version: the version of the learner's weights (optimizer steps taken; snapshots keep it).
    """

    plan: RunPlan
    coll: Collective
    learner: PolicyLearner
    tokenizer: Any
    tracker: Tracker | None = None
    policy_version: int = 0

    @property
    def settings(self) -> Settings:
        """Returns the settings of the plan in force, read-only (``RunPlan.settings``)."""
        return self.plan.settings

    @property
    def rank(self) -> int:
        """Returns this worker's rank."""
        return self.coll.rank

    @property
    def world(self) -> int:
        """Returns the number of learner ranks."""
        return self.coll.world

    def start_metrics(self) -> dict[str, float]:
        """Returns the metrics logged at step 0 of a fresh run (every rank calls it; rank 0 logs them); {} by default."""
        return {}

    @abc.abstractmethod
    def run_step(self, step: int) -> StepResult:
        """Runs 0-based ``step`` on this rank (every stage but the step boundary); returns its result."""

    @abc.abstractmethod
    def evaluate_when_due(self, steps_done: int) -> dict[str, float]:
        """Returns the eval metrics due after ``steps_done`` steps (every rank calls it), or {}."""

    @abc.abstractmethod
    def progress_text(self, steps_done: int, metrics: dict[str, float]) -> str:
        """Returns the one progress line of a finished step (rank 0)."""

    @abc.abstractmethod
    def data_epoch(self) -> int:
        """Returns the data cursor's epoch (0-based; rank 0 of online runs, every rank of offline runs)."""

    @abc.abstractmethod
    def cursor_state(self) -> dict[str, Any]:
        """Returns the data cursor a snapshot keeps (rank 0; ``PromptStream.state_dict`` and what the kind adds)."""

    @abc.abstractmethod
    def load_cursor_state(self, state: dict[str, Any]) -> None:
        """Sets the data cursor to a snapshot's ``state`` (called on every rank; a rank without a cursor ignores it)."""

    def in_flight_rollouts(self) -> list[dict | None] | None:
        """Returns what a snapshot keeps of the rollouts of the steps in flight (rank 0 of an async online run), JSON
        data; None by default (no steps run ahead)."""
        return None

    def load_in_flight_rollouts(self, rollouts: list[dict | None]) -> None:  # noqa: B027 (a hook with a default)
        """Gives the steps in flight of a just loaded ``cursor_state`` the rollouts the same snapshot kept
        (``in_flight_rollouts``; every rank calls it, a rank without steps in flight ignores it); none by default."""

    def adopt_plan(self, plan: RunPlan) -> None:
        """Makes ``plan`` the plan in force (a rollback's ``guard.rollback_overrides`` applied, ``rlray.plan.replan``)."""
        self.plan = plan

    def reload_rollouts(self) -> None:  # noqa: B027 (a hook with a default: offline runs have no rollouts)
        """Pushes the learner's weights to the rollout engines (start, restore, rollback); none by default."""

    def watch_hangs(self, alert: Callable[[str], None]) -> None:  # noqa: B027 (a hook with a default: no remote calls)
        """Sends the hang reports of the remote calls this rank waits on through ``alert`` (every rank; ``rlray.hangs``,
        ``rlray.run.session.hang_alert``); none by default."""

    def close(self) -> None:  # noqa: B027 (a hook with a default: nothing to release)
        """Releases what the run holds besides the learner (clients, connections); nothing by default."""
