"""The Ray Train training function of every run: builds the rank's run of the config's kind and runs it."""

from __future__ import annotations

import functools
import logging
from typing import Any

import ray

from rlray.learner.collective import current_collective, name_learner_process
from rlray.plan import RunPlan, plan_from_tree
from rlray.run import offline, online, session
from rlray.run.session import FatalStepError
from rlray.run.state import RunOutcome, WorkerArgs

log = logging.getLogger(__name__)


def train(plan: RunPlan, args: WorkerArgs, coll: Any = None) -> RunOutcome:
    """Runs the config's kind of run (online or offline) on this rank; returns how it ended.

    Args:
        plan: the run plan of the shipped config (``rlray.plan.plan_from_tree`` of ``args.config``).
        args: what the driver handed over (model folder, run id, actors, services, hooks).
        coll: collectives; defaults to Ray Train's when inside a worker group, else world 1.

    Raises:
        rlray.run.session.FatalStepError: a step hit an error a restart cannot fix.
        rlray.run.guards.EarlyOOM: out of memory again after the fallback.
    """
    coll = coll or current_collective()
    if plan.roles.online:
        build = functools.partial(online.setup, model_dir=args.model_dir, actors=args.rollout_actors, run_id=args.run_id,
                                  reference_actor=args.reference_actor, env_hosts=args.env_hosts,
                                  teacher_dir=args.teacher_dir, teacher_actor=args.teacher_actor)
    else:
        build = functools.partial(offline.setup, model_dir=args.model_dir, run_id=args.run_id)
    return session.train(build, plan, coll, run_id=args.run_id, services=args.services, hooks=args.step_hooks)


def train_worker(loop_config: dict[str, WorkerArgs]) -> None:
    """The Ray Train training function: validates the config of ``loop_config["args"]`` and runs it on this rank.

    A ``FatalStepError`` ends the worker quietly: it is recorded (MLflow status FAILED, tag rlray.error,
    the run's outcome) and a restart would fail the same way. So does a group that Ray Train started again after a
    rank ended the run for a hang (``RunControl.fail``): it returns at once, before any load.
    """
    args = loop_config["args"]
    control = args.services.control
    if control is not None and ray.get(control.failure.remote()) is not None:
        log.warning("a learner rank ended the run (a hang under watchdog.on_hang=stop): this group does not start")
        return
    plan = plan_from_tree(args.config)
    coll = current_collective()
    name_learner_process(coll.rank)
    try:
        train(plan, args, coll)
    except FatalStepError:
        return
