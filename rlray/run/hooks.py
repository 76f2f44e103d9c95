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

Where hooks come from: the driver's own ``StopWhenRequested`` (control: ``ray job stop`` -> SIGTERM on the driver
-> ``RunControl``), the config's ``run.hooks`` (``load_step_hooks``: user code named like environments, each a
``"package.module:factory"`` or ``"path/to/file.py:factory"`` whose factory the driver calls with the Config; the
tests hold a live run at a step this way, tests/fixtures/holds.py) and ``rlray.sweep.tune``'s trial reporter
(observer: per-step metrics and the step's snapshot to Ray Tune, for ASHA and PBT).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
import ray.cloudpickle

if TYPE_CHECKING:  # the monitor actor's process imports this module: no config schema there (it imports torch)
    from rlray.plan import RunPlan

log = logging.getLogger(__name__)


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
    """A run's stop flag and outcome, shared by the driver and the learner's rank 0 (the monitor actor,
    ``rlray.launch.monitor_actor.MonitorActor``, holds them: pinned to the driver's node, it outlives the loss of any
    other node).

    The driver sets the flag (for example from its SIGTERM handler); the ``StopWhenRequested`` hook
    reads it at every step boundary. Rank 0 records how the run ended (``rlray.run.state.RunOutcome``)
    when it leaves the step loop; the driver reads it after Ray Train returns. A learner rank that stops the run for a
    hang of its own (``watchdog.on_hang=stop``, ``rlray.run.rank_hangs.hang_action``) records its end with ``fail``
    before it exits: the learner group Ray Train may restart then ends at once, and that outcome stays the run's.
    """

    def __init__(self) -> None:
        self._reason: str | None = None
        self._outcome: object = None
        self._failure: object = None

    def record_outcome(self, outcome: object) -> None:
        """Keeps rank 0's ``RunOutcome`` (the last attempt's wins after a restart; none after ``fail``)."""
        if self._failure is None:
            self._outcome = outcome

    def fail(self, outcome: object) -> None:
        """Records that a learner rank ended the run (a hang under ``watchdog.on_hang=stop``), with its ``RunOutcome``
        (status FAILED, the report as its error); the first wins, and it is the run's outcome from then on."""
        if self._failure is None:
            self._failure = self._outcome = outcome
            self._reason = self._reason or "hang"

    def failure(self) -> object:
        """Returns the ``RunOutcome`` that ``fail`` recorded, or None while no rank ended the run."""
        return self._failure

    def outcome(self) -> object:
        """Returns the recorded ``RunOutcome``, or None when no attempt got to record one."""
        return self._outcome

    def request_stop(self, reason: str) -> None:
        """Records a stop request; the first reason wins."""
        self._reason = self._reason or reason

    def stop_reason(self) -> str | None:
        """Returns the recorded stop reason, or None while no stop was requested."""
        return self._reason


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


def load_step_hooks(plan: RunPlan) -> list[StepHook]:
    """Returns the step hooks of ``run.hooks``, in order: each spec's factory called with the validated config
    (``plan.settings``; the factories' API is unchanged).

    A spec is ``"package.module:factory"`` or ``"path/to/file.py:factory"`` (relative to the current folder),
    loaded by ``rlray.envs.trl.load_object``, the loader of environments. The factory takes the validated Config
    and returns a step hook: a callable taking a ``StepEnd`` (a control hook, or an observer with
    ``after_snapshot = True``). A file's module is registered with cloudpickle to travel by value, so its hooks
    reach learner nodes that lack the file; a module's hooks travel by reference (it must import there).

    Raises:
        ConfigError: a spec's module or file is missing, its factory is missing or not callable, the factory
            raised, or it returned something that is not callable; one line naming ``run.hooks[i]``, the spec and
            the fix.
    """
    from rlray.envs.trl import USER_MODULE_PREFIX, load_object  # deferred: the monitor actor's process (this module) stays light
    from rlray.plan import ConfigError  # deferred: see the TYPE_CHECKING import above

    cfg = plan.settings
    hooks: list[StepHook] = []
    for i, spec in enumerate(cfg.run.hooks):
        label = f"run.hooks[{i}]={spec!r}"
        try:
            factory = load_object(spec, label=label, shape="factory")
        except ValueError as err:
            raise ConfigError(f"{err}; a hook spec is 'package.module:factory' or 'path/to/file.py:factory'") from err
        if not callable(factory):
            raise ConfigError(f"{label}: {type(factory).__name__} is not callable; name a function that takes the "
                              "Config and returns a step hook")
        module = inspect.getmodule(factory)
        if module is not None and module.__name__.startswith(USER_MODULE_PREFIX):  # loaded from a file
            ray.cloudpickle.register_pickle_by_value(module)
        try:
            hook = factory(cfg)
        except Exception as err:
            raise ConfigError(f"{label}: the factory raised {type(err).__name__}: {err}") from err
        if not callable(hook):
            raise ConfigError(f"{label}: the factory returned {hook!r} ({type(hook).__name__}), not a step hook; "
                              "return a callable taking rlray.run.hooks.StepEnd")
        hooks.append(hook)
    return hooks
