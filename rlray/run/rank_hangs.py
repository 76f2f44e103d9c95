"""What a learner rank does about hangs: its step deadline (``watchdog.learner_step_s``), the action after a hang of
its own (``hang_action``: exit for Ray Train's restart, or end the run FAILED under ``watchdog.on_hang=stop``) and
how its hang reports reach the run's alerts (``hang_alert``). Used by ``rlray.run.session`` (the step deadline, the
collective deadline of ``rlray.run.collective_watch``) and by the calls a rank waits on (``RunContext.watch_hangs``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import ray

from rlray import hangs
from rlray.run import snapshots
from rlray.run.context import RunContext
from rlray.run.state import RunOutcome, RunServices, RunState

log = logging.getLogger(__name__)


def step_deadline(ctx: RunContext, run: RunState, services: RunServices) -> hangs.StepDeadline:
    """Returns this rank's step deadline (``watchdog.learner_step_s``): its report goes to the log and the alerts
    (``hang_alert``), then ``hang_action`` runs."""
    return hangs.StepDeadline(ctx.plan.deadlines.learner_step_s, f"learner rank {ctx.rank}", hang_alert(ctx, run, services),
                              hang_action(ctx, run, services))


def exit_rank() -> None:
    """Ends this learner rank's process at once (a stuck step cannot be unwound; Ray Train sees the worker die)."""
    os._exit(1)


def hang_action(ctx: RunContext, run: RunState, services: RunServices) -> hangs.HangAction | None:
    """Returns what this rank does after reporting a hang of its own (its step or collective deadline), under Ray
    Train; None outside it (the report alone). ``watchdog.on_hang=restart``: the rank exits, and Ray Train restarts the
    group from the newest snapshot (``monitor.max_failures``). ``stop``: the rank records the run's end in the run
    control (``RunControl.fail``: FAILED, the report's headline as the error, the newest snapshot as the one to
    resume from; no stop snapshot: a stuck rank cannot write its part) and sends the ``run_failed`` alert, then exits;
    a group Ray Train restarts ends at once (``rlray.run.worker.train_worker``) and the driver ends the run FAILED."""
    if not run.in_ray_train:
        return None
    if ctx.plan.deadlines.on_hang == "restart":
        return hangs.HangAction("exiting the rank (Ray Train restarts the group)", lambda head: exit_rank())

    def stop(head: str) -> None:
        try:
            if services.control is not None:
                outcome = RunOutcome("FAILED", run.step, run.last_snapshot, head, {})
                sent = [services.control.fail.remote(outcome)]
                if services.monitor is not None:
                    sent.append(services.monitor.alert.remote("run_failed", f"the run stops: {head}", run.step + 1))
                refs = [r for r in sent if isinstance(r, ray.ObjectRef)]  # tests hand fakes that return None
                if refs:
                    ray.wait(refs, num_returns=len(refs), timeout=10.0)
        except Exception as err:  # noqa: BLE001 - the rank exits whatever failed
            log.error("could not record the run's stop: %s: %s", type(err).__name__, err)
        exit_rank()

    return hangs.HangAction("stopping the run (watchdog.on_hang=stop: it ends FAILED, resumable from its newest snapshot "
                            "if it has one)", stop)


def hang_alert(ctx: RunContext, run: RunState, services: RunServices) -> Callable[[str], None]:
    """Returns how this rank sends a hang report as the run's ``hang`` alert, at the step in progress: through the
    monitor (``services.monitor.alert``, waiting up to 5 s for it to arrive, since the rank may exit next), else rank 0
    straight to ``monitor.alerts`` (``snapshots.alert``) and any other rank not at all (its log line only). Used by the
    step and collective deadlines and by the hang watches of the calls the rank waits on (``RunContext.watch_hangs``:
    a learner rank's reference and teacher calls)."""
    def alert(message: str) -> None:
        if services.monitor is not None:  # delivered before the exit that may follow (a deadline's restart action)
            sent = services.monitor.alert.remote("hang", message, run.step + 1)
            if isinstance(sent, ray.ObjectRef):  # a real actor handle (tests pass fakes that return None)
                ray.wait([sent], timeout=5.0)
        elif ctx.rank == 0:
            snapshots.alert(ctx, services, "hang", message, run.step + 1)

    return alert
