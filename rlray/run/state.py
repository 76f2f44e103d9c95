"""The records of a run on one learner rank: what the driver hands every rank (``WorkerArgs``), where
the run is (``RunState``), and how it ended (``RunOutcome``, sent back to the driver)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlray.run.hooks import StepHook

if TYPE_CHECKING:  # torch (through guards) stays out of the light processes that unpickle these records: Ray Train's
    from rlray.run.guards import MemoryWatchdog  # controller (WorkerArgs), the monitor actor (RunOutcome)

RUNNING = "RUNNING"


@dataclass
class RunServices:
    """The driver's services a learner rank uses besides the config.

    Attributes:
        monitor: the ``MonitorActor`` handle, or None to run without /health and alerts.
        control: the actor holding the run's ``RunControl`` (the monitor actor: stop requests in, the run's outcome out), or None.
        started_at: the run's start (Unix seconds), for ``run.max_wall_time_s`` across restarts.
        git_commit: the code's commit, a lineage tag.
        resume_from: the snapshot URI to start from (``checkpoint.resume_from`` resolved by the driver).
    """

    monitor: Any = None
    control: Any = None
    started_at: float = field(default_factory=time.time)
    git_commit: str = "unknown"
    resume_from: str | None = None


@dataclass
class WorkerArgs:
    """What the driver hands every learner rank (Ray Train's ``train_loop_config["args"]``).

    Attributes:
        config: the validated config as ``Config.model_dump()`` (python mode: secrets travel, never logged).
        model_dir: local Hugging Face folder of the initial policy (resolved by the driver).
        run_id: the MLflow run to log to (created by the driver).
        rollout_actors: the rollout actor handles (online runs; used by rank 0).
        reference_actor: the reference actor (``resources.reference.placement == "actor"``), else None.
        teacher_dir: local Hugging Face folder of the distillation teacher (``teacher.path`` resolved), else None.
        teacher_actor: the teacher actor (``teacher.path`` set, ``resources.teacher.placement == "actor"``), else None.
        env_hosts: the environment host actors (``env.environments`` set; used by rank 0), else [].
        services: the monitor, the run control, start time, commit and resume snapshot.
        step_hooks: per-step hooks run on rank 0 (``rlray.run.hooks``; the same list on every rank).
    """

    config: dict[str, Any]
    model_dir: str
    run_id: str | None = None
    rollout_actors: list[Any] = field(default_factory=list)
    reference_actor: Any = None
    teacher_dir: str | None = None
    teacher_actor: Any = None
    env_hosts: list[Any] = field(default_factory=list)
    services: RunServices = field(default_factory=RunServices)
    step_hooks: list[StepHook] = field(default_factory=list)


@dataclass
class RunOutcome:
    """How a run ended on rank 0, sent to the driver through ``RunControl.record_outcome``.

    Attributes:
        status: FINISHED, FAILED or 'stopped: <reason>' (a guard or a hook).
        step: RL or optimizer steps done.
        last_snapshot: URI of the last complete snapshot, or None.
        error: the message of an error a restart cannot fix (``FatalStepError``), else "".
        metrics: the last step's metrics.
    """

    status: str
    step: int
    last_snapshot: str | None
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunState:
    """Where a run is, on one rank.

    Attributes:
        run_id: MLflow run id; ``run_dir`` is its snapshot folder ``<checkpoint uri>/run-<run_id>``.
        step: steps done. ``first_step`` is where this process started (0 or a restored step).
        rollbacks: rollbacks so far (kept in snapshots). ``nonfinite_in_row``: the non-finite guard's count.
        logged_through: the last step whose metrics MLflow has (a restarted run does not log a step twice).
        last_snapshot: the newest complete snapshot this run can roll back to; ``model_version`` its
            registered version (the parent of the next one).
        status: RUNNING, FINISHED, FAILED or 'stopped: <reason>'.
    """

    run_id: str
    run_dir: str
    options: dict[str, Any]
    in_ray_train: bool
    step: int = 0
    first_step: int = 0
    rollbacks: int = 0
    nonfinite_in_row: int = 0
    logged_through: int = 0
    last_snapshot: str | None = None
    model_version: str | None = None
    status: str = RUNNING
    source: tuple[int, str] | None = None
    heartbeat: Any = None
    watchdog: MemoryWatchdog | None = None
    log_handler: logging.Handler | None = None
