"""The state of a run on one learner rank, and what the driver hands every rank besides the config."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rlray.guard import MemoryWatchdog

RUNNING = "RUNNING"


@dataclass
class RunOps:
    """What the driver hands every learner rank besides the config (``train_loop_config['ops']``).

    Attributes:
        monitor: the ``MonitorActor`` handle, or None to run without /health and alerts.
        started_at: the run's start (Unix seconds), for ``run.max_wall_time_s`` across restarts.
        git_commit: the code's commit, a lineage tag.
        resume_from: the snapshot URI to start from (``checkpoint.resume_from`` resolved by the driver).
    """

    monitor: Any = None
    started_at: float = field(default_factory=time.time)
    git_commit: str = "unknown"
    resume_from: str | None = None


@dataclass
class RunState:
    """Where a run is, on one rank.

    Attributes:
        run_id: MLflow run id; ``run_dir`` is its snapshot folder ``<checkpoint uri>/run-<run_id>``.
        step: RL steps done. ``first_step`` is where this process started (0 or a restored step).
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


