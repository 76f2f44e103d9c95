"""Per-step hooks: how the world outside the step loop sees each step and asks the run to stop.

``rlray.run.worker.train`` calls every hook on rank 0 at each step boundary, in one of two places:

- a *control* hook (the default) runs after the step's metrics are logged and before the step's
  snapshot. It returns None, or a short reason (a string) to stop the run at this step boundary;
  rank 0 then broadcasts the decision and every learner rank leaves the loop together, so the run
  ends with a snapshot of this step ("stop") and its MLflow status is set by the driver.
- an *observer* hook (class attribute ``after_snapshot = True``) runs after the step's snapshot is
  complete and sees its URI in ``StepEnd.snapshot`` (None when no snapshot was written at this step).
  It cannot stop the run (its return value is ignored).

Hooks travel to the Ray Train workers inside ``train_loop_config``, so they must pickle (module-level
classes holding actor handles do).

Callers today: ``StopWhenRequested`` (control: ``ray job stop`` -> SIGTERM on the driver ->
``RunControl``), ``rlray.sweep.tune``'s trial reporter (observer: per-step metrics and the step's
snapshot to Ray Tune, for ASHA and PBT) and, for tests only, ``HoldForTest`` (control: holds a live run
at a step while a test looks at its page; ``hold_hooks_from_env``).

Not a step hook, also for tests only: ``hold_generate_from_env`` holds a rollout actor's n-th generate call
(``RLRAY_TEST_HOLD_GENERATE``) so that a test can lose the actor's node while it is provably mid-call.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger(__name__)

HOLD_STEP_ENV = "RLRAY_TEST_HOLD_AFTER_STEP"  # tests only: the step after which the run waits (``HoldForTest``)
HOLD_RELEASE_ENV = "RLRAY_TEST_HOLD_RELEASE"  # tests only: the file whose creation lets the held run go on
HOLD_GENERATE_ENV = "RLRAY_TEST_HOLD_GENERATE"  # tests only: folder whose hold-<n> holds a rollout actor's n-th generate
HOLD_TIMEOUT_S = 900.0  # seconds a held run waits for its release file before it stops itself


@dataclass(frozen=True)
class StepEnd:
    """What a hook sees after a step (on rank 0).

    Attributes:
        step: number of steps done, 1-based (the MLflow step of ``metrics``).
        max_steps: ``run.max_steps`` of the run.
        metrics: the step's logged metrics ({"reward/mean": ..., ...}), eval keys included on eval steps.
        snapshot: URI of the complete snapshot written at this step boundary (observer hooks only; None
            for control hooks, and when no snapshot was due or the write failed).
    """

    step: int
    max_steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    snapshot: str | None = None


StepHook = Callable[[StepEnd], "str | None"]


def is_observer(hook: StepHook) -> bool:
    """Returns True when ``hook`` runs after the step's snapshot (``after_snapshot = True``), not before it."""
    return bool(getattr(hook, "after_snapshot", False))


def run_hooks(hooks: Sequence[StepHook], event: StepEnd) -> str | None:
    """Runs the control hooks of ``hooks`` (before the snapshot); returns their stop reasons joined by
    '; ', or None when none asks to stop.

    Every control hook is called, in order, even after one asked to stop. Observer hooks are skipped
    (``run_observers`` calls them after the snapshot).
    """
    reasons = [r for r in (hook(event) for hook in hooks if not is_observer(hook)) if r]
    return "; ".join(reasons) or None


def run_observers(hooks: Sequence[StepHook], event: StepEnd) -> None:
    """Calls the observer hooks of ``hooks`` in order with ``event`` (which carries the step's snapshot URI)."""
    for hook in hooks:
        if is_observer(hook):
            hook(event)


class RunControl:
    """A run's stop flag and outcome, shared by the driver and the learner's rank 0 (as a Ray actor).

    The driver sets the flag (for example from its SIGTERM handler); the ``StopWhenRequested`` hook
    reads it at every step boundary. Rank 0 records how the run ended (``rlray.run.state.RunOutcome``)
    when it leaves the step loop; the driver reads it after Ray Train returns.
    """

    def __init__(self) -> None:
        self._reason: str | None = None
        self._outcome: object = None

    def record_outcome(self, outcome: object) -> None:
        """Keeps rank 0's ``RunOutcome`` (the last attempt's wins after a restart)."""
        self._outcome = outcome

    def outcome(self) -> object:
        """Returns the recorded ``RunOutcome``, or None when no attempt got to record one."""
        return self._outcome

    def request_stop(self, reason: str) -> None:
        """Records a stop request; the first reason wins."""
        self._reason = self._reason or reason

    def stop_reason(self) -> str | None:
        """Returns the recorded stop reason, or None while no stop was requested."""
        return self._reason


def start_run_control() -> ray.actor.ActorHandle:
    """Returns a started ``RunControl`` actor (0 CPUs; it only holds a flag), pinned to the caller's node: it holds
    the run's outcome, so it must outlive the loss of any other node."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(RunControl).options(scheduling_strategy=here).remote()


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


class HoldForTest:
    """Hook, for tests only: after step ``step`` waits until the file ``release`` exists; returns None, or a stop
    reason when ``timeout_s`` seconds pass without it.

    A control hook, so the step's metrics and samples are in MLflow and on their way to the monitor before it
    waits, and its snapshot is written after (``rlray.run.session.step_boundary``). Meanwhile the heartbeat goes on
    and the monitor serves the page at that step, so a test can load the page of a real run at a known step. A
    release file that never comes ends the run loudly: an error in the log and status 'stopped: test hold ...'.
    Only ``hold_hooks_from_env`` makes one, when ``RLRAY_TEST_HOLD_AFTER_STEP`` is set.

    Args:
        step: the 1-based step after which to wait.
        release: path of the file the test creates to let the run go on (a local path of the learner's node).
        timeout_s: seconds to wait for it.
    """

    def __init__(self, step: int, release: str, timeout_s: float = HOLD_TIMEOUT_S) -> None:
        self.step, self.release, self.timeout_s = step, release, timeout_s

    def __call__(self, event: StepEnd) -> str | None:
        if event.step != self.step:
            return None
        log.warning("test hold: waiting after step %d until %s exists (%s)", event.step, self.release, HOLD_STEP_ENV)
        deadline = time.monotonic() + self.timeout_s
        while not Path(self.release).exists():
            if time.monotonic() > deadline:
                reason = f"test hold: {self.release} not created within {self.timeout_s:g} s"
                log.error("%s; stopping the run", reason)
                return reason
            time.sleep(0.2)
        return None


def hold_hooks_from_env(env: Mapping[str, str]) -> list[StepHook]:
    """Returns [a ``HoldForTest``] when ``env`` sets ``RLRAY_TEST_HOLD_AFTER_STEP`` (a step) and
    ``RLRAY_TEST_HOLD_RELEASE`` (the release file), else [] (every real run).

    Raises:
        ValueError: the step is not a positive integer, or the release file is not given.
    """
    step = env.get(HOLD_STEP_ENV)
    if not step:
        return []
    release = env.get(HOLD_RELEASE_ENV)
    if not step.isdigit() or int(step) < 1 or not release:
        raise ValueError(f"{HOLD_STEP_ENV}={step!r} {HOLD_RELEASE_ENV}={release!r}: the test hold needs a step >= 1 "
                         f"and a release file path; unset {HOLD_STEP_ENV} outside tests")
    return [HoldForTest(int(step), release)]


def hold_generate_from_env(call: int, env: Mapping[str, str]) -> None:
    """Returns at once, unless ``env`` sets ``RLRAY_TEST_HOLD_GENERATE`` (tests only) to a folder holding the file
    ``hold-<call>``: then writes ``held-<call>-<pid>`` there and returns once ``hold-<call>`` is gone.

    ``rlray.launch.actors.RolloutActor`` calls it at the start of its ``call``-th generate (counted from 1 in the actor
    process), so that a test can kill the actor's node while the call is provably in flight. A hold file that stays
    is given up after ``HOLD_TIMEOUT_S`` seconds, with an error in the log.

    Args:
        call: the actor process's generate calls so far, this one included.
        env: the process environment.
    """
    folder = env.get(HOLD_GENERATE_ENV)
    hold = Path(folder, f"hold-{call}") if folder else None
    if hold is None or not hold.exists():
        return
    Path(folder, f"held-{call}-{os.getpid()}").touch()
    log.warning("test hold: generate call %d waits while %s exists (%s)", call, hold, HOLD_GENERATE_ENV)
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while hold.exists():
        if time.monotonic() > deadline:
            log.error("test hold: %s still exists after %g s; going on", hold, HOLD_TIMEOUT_S)
            return
        time.sleep(0.1)
