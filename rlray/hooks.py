"""Per-step hooks: how the world outside the step loop sees each step and asks the run to stop.

``loop.train`` calls every hook on rank 0 after a step's metrics are logged. A hook returns None,
or a short reason (a string) to stop the run at this step boundary; rank 0 then broadcasts the
decision and every learner rank leaves the loop together, so the run ends with the usual final
snapshot and its MLflow status is set by the driver. Hooks travel to the Ray Train workers inside
``train_loop_config``, so they must pickle (module-level classes holding actor handles do).

Callers today: ``StopWhenRequested`` (``ray job stop`` -> SIGTERM on the driver -> ``RunControl``)
and ``rlray.tune``'s trial reporter (per-step metrics to Ray Tune for ASHA).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepEnd:
    """What a hook sees after a step (on rank 0).

    Attributes:
        step: number of steps done, 1-based (the MLflow step of ``metrics``).
        max_steps: ``run.max_steps`` of the run.
        metrics: the step's logged metrics ({"reward/mean": ..., ...}), eval keys included on eval steps.
    """

    step: int
    max_steps: int
    metrics: dict[str, float] = field(default_factory=dict)


StepHook = Callable[[StepEnd], "str | None"]


def run_hooks(hooks: Sequence[StepHook], event: StepEnd) -> str | None:
    """Returns the stop reasons of ``hooks`` joined by '; ', or None when no hook asks to stop.

    Every hook is called, in order, even after one asked to stop (reporting hooks still see the
    last step).
    """
    reasons = [r for r in (hook(event) for hook in hooks) if r]
    return "; ".join(reasons) or None


class RunControl:
    """A run's stop flag, shared by the driver and the learner's rank 0 (as a Ray actor).

    The driver sets it (for example from its SIGTERM handler); the ``StopWhenRequested`` hook
    reads it at every step boundary.
    """

    def __init__(self) -> None:
        self._reason: str | None = None

    def request_stop(self, reason: str) -> None:
        """Records a stop request; the first reason wins."""
        self._reason = self._reason or reason

    def stop_reason(self) -> str | None:
        """Returns the recorded stop reason, or None while no stop was requested."""
        return self._reason


def start_run_control() -> ray.actor.ActorHandle:
    """Returns a started ``RunControl`` actor (0 CPUs; it only holds a flag)."""
    return ray.remote(num_cpus=0)(RunControl).remote()


class StopWhenRequested:
    """Hook: returns the ``RunControl`` stop reason at each step boundary, or None.

    Args:
        control: handle of the run's ``RunControl`` actor.
    """

    def __init__(self, control: ray.actor.ActorHandle) -> None:
        self.control = control

    def __call__(self, event: StepEnd) -> str | None:
        reason = ray.get(self.control.stop_reason.remote())
        if reason:
            log.warning("stop requested (%s): ending the run after step %d", reason, event.step)
        return reason
