"""The run's monitor as a Ray actor: the live page, /health, /metrics and the learner's reports.

Kept apart from ``rlray.launch.actors`` on purpose: Ray imports an actor's module in the actor's process, and
that module imports torch, vLLM's engine wrapper and the learner; this one imports only the light parts of
``rlray.observe`` (no torch, no config schema: that imports the algorithms, hence torch; MLflow only when an alert is
sent to it), so the monitor process stays small and starts in about a second (it holds no model).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlray.observe import page
from rlray.observe.monitor import Alert, Alerter, Progress, RunMonitor
from rlray.observe.samples import StepSample
from rlray.observe.startup import ActorTimes, Launched, LearnerTimes
from rlray.run.hooks import RunControl

if TYPE_CHECKING:
    from rlray.plan import RunPlan


class MonitorActor(RunControl):
    """Ray actor around a ``RunMonitor``: serves the live page, /health and /metrics and takes the learner's reports;
    it also holds the run's stop flag and outcome (``rlray.run.hooks.RunControl``'s methods: one process fewer at the
    run's start, about 1.3 s of CPU on a 2-core machine; issue 39).

    Args:
        run_id: MLflow run id.
        tracking_uri, experiment: MLflow store and experiment (for the "mlflow" alert sink).
        sinks: ``monitor.alerts``.
        webhook_url: the revealed ``monitor.webhook_url`` (None without one).
        webhook_attempts: ``monitor.webhook_attempts``.
        heartbeat_s: ``monitor.heartbeat_s``.
        kl_limit: ``guard.kl_threshold`` (the page draws it on the KL chart).
        page_sample_steps: ``monitor.page_sample_steps``.
        bands: ``monitor.bands``, each as a dict of ``page.Band``'s fields.
    """

    def __init__(self, run_id: str, tracking_uri: str, experiment: str, sinks: list[str], webhook_url: str | None,
                 webhook_attempts: int, heartbeat_s: float, kl_limit: float | None = None, page_sample_steps: int = 20,
                 bands: list[dict[str, Any]] | None = None) -> None:
        self.times = ActorTimes.begin()
        RunControl.__init__(self)
        self.learner_times = LearnerTimes()
        self.tracker = tracker = LazyTracker(tracking_uri, experiment, run_id) if "mlflow" in sinks else None
        alerter = Alerter(sinks, tracker=tracker, webhook_url=webhook_url, webhook_attempts=webhook_attempts)
        self.monitor = RunMonitor(run_id, heartbeat_s=heartbeat_s, alerter=alerter, ray_metrics=True, kl_limit=kl_limit,
                                  page_sample_steps=page_sample_steps,
                                  bands=tuple(page.Band(**b) for b in bands or []))
        self.times.end()

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP server; returns the bound port."""
        return self.monitor.serve(host, port)

    def beat(self, step: int, epoch: int, policy_version: int) -> None:
        """Records a heartbeat."""
        self.monitor.beat(step, epoch, policy_version)

    def record_step(self, step: int, epoch: int, policy_version: int, step_metrics: dict[str, float]) -> None:
        """Records a finished step (and stamps its end for the ``startup/*`` figures); the first one also starts
        building the MLflow client of the alerts (``LazyTracker.warm``), now that the run's start is over."""
        self.learner_times.step_recorded(step_metrics)
        self.monitor.record_step(step, epoch, policy_version, step_metrics)
        if self.tracker is not None:
            self.tracker.warm()

    def record_samples(self, step: int, samples: list[StepSample]) -> None:
        """Keeps a step's samples for the page (rank 0 sends them at stage 8)."""
        self.monitor.record_samples(step, samples)

    def record_snapshot(self, step: int | None) -> None:
        """Records a complete (step) or failed (None) snapshot."""
        self.monitor.record_snapshot(step)

    def learner_started(self) -> int:
        """Counts a learner start; returns the count (more than 1 means a restart)."""
        self.learner_times.learner_started()
        return self.monitor.learner_started()

    def alert(self, kind: str, message: str, step: int | None = None) -> None:
        """Sends an alert to every sink."""
        self.monitor.alert(kind, message, step)

    def set_status(self, status: str, reason: str | None = None) -> None:
        """Sets the run's status."""
        self.monitor.set_status(status, reason)

    def health(self) -> dict:
        """Returns the /health document."""
        return self.monitor.health()

    def progress(self) -> Progress:
        """Returns the driver's progress record (``RunMonitor.progress``: status, alerts, the recorded steps)."""
        return self.monitor.progress()

    def alerts(self) -> list[Alert]:
        """Returns every alert sent so far."""
        return list(self.monitor.alerts)

    def startup_times(self) -> ActorTimes:
        """Returns this actor's start: its process's creation, its imports and its ``__init__`` (``ActorTimes``)."""
        return self.times

    def learner_startup(self) -> LearnerTimes:
        """Returns the learner's start and each recorded step's end (``LearnerTimes``), for the ``startup/*`` figures."""
        return self.learner_times


class LazyTracker:
    """The monitor's MLflow client for alerts, built when first needed or, after the run's first step, in a background
    thread (``warm``): MLflow's import (about 2 s of CPU) stays out of the run's start, when the engines, the learner and
    Ray's own processes share the cores (issue 39; before, the build started with the actor). An alert that comes
    before it is built waits for it.

    Args:
        tracking_uri, experiment, run_id: the run's MLflow store, experiment and run (``rlray.observe.tracking.Tracker``).
    """

    def __init__(self, tracking_uri: str, experiment: str, run_id: str) -> None:
        self.args = (tracking_uri, experiment, run_id)
        self.lock = threading.Lock()
        self.tracker: Any = None
        self.warming: threading.Thread | None = None

    def warm(self) -> None:
        """Starts building the client in a daemon thread (once; nothing when it is built or being built)."""
        if self.warming is None and self.tracker is None:
            self.warming = threading.Thread(target=self.get, name="rlray-monitor-mlflow", daemon=True)
            self.warming.start()

    def get(self) -> Any:
        """Returns the ``Tracker``, built by the first caller (the others wait for it)."""
        with self.lock:
            if self.tracker is None:
                from rlray.observe.tracking import Tracker  # deferred: see the class docstring

                tracking_uri, experiment, run_id = self.args
                self.tracker = Tracker(tracking_uri, experiment, run_id=run_id)
            return self.tracker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


def start_monitor(plan: RunPlan, run_id: str) -> tuple[ray.actor.ActorHandle, int]:
    """Returns (monitor actor, bound port): ``launch_monitor``, then waits until it serves.

    Raises:
        OSError: the port is taken.
    """
    launched = launch_monitor(plan, run_id)
    return launched.handle, monitor_port(launched)


def launch_monitor(plan: RunPlan, run_id: str) -> Launched:
    """Asks for a ``MonitorActor`` on this node serving ``monitor.host:port`` and returns it unwaited (its ``ready``
    is the ``serve`` call: ``monitor_port`` waits for the bound port).

    The actor is pinned to the caller's node, so ``curl 127.0.0.1:<port>/health`` works where the run was
    started. Port 0 picks a free port. It gets plain values only (``plan.tracking``, the ``monitor.*`` and
    ``guard.kl_threshold`` settings): its process imports no config schema.
    """
    m = plan.settings.monitor
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    at = time.time()
    actor = ray.remote(MonitorActor).options(num_cpus=0, scheduling_strategy=here).remote(
        run_id, plan.tracking.mlflow_uri, plan.tracking.experiment, list(m.alerts),
        m.webhook_url.get_secret_value() if m.webhook_url else None, m.webhook_attempts, m.heartbeat_s,
        plan.settings.guard.kl_threshold, m.page_sample_steps, [b.model_dump() for b in m.bands],
    )
    return Launched("monitor", actor, actor.serve.remote(m.host, m.port), at)


def monitor_port(launched: Launched) -> int:
    """Waits until the monitor of ``launch_monitor`` serves; returns its bound port.

    Raises:
        OSError: the port is taken (the actor is killed).
    """
    try:
        return ray.get(launched.ready)
    except ray.exceptions.RayTaskError as err:
        ray.kill(launched.handle)
        raise OSError(str(err.cause)) from None
