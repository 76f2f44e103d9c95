"""Run monitor: the live page (GET /, /api/charts, /api/metrics, /api/samples), GET /health and /metrics, heartbeats
and stall detection, alerts, and the driver's progress record.

``RunMonitor`` is a plain class; the driver runs it in a Ray actor (``rlray.launch.monitor_actor.MonitorActor``) on
its own node, so it outlives learner restarts. Learner rank 0 sends it heartbeats, step figures and
alerts. One ``MetricsRegistry`` feeds both Ray's metrics (``ray.util.metrics``, scraped by the Ray
dashboard and Prometheus as ``ray_rlray_*``) and the ``/metrics`` page (``rlray_*``), so the two never
disagree; the gauges that show a step metric are the metric registry's ``STEP_GAUGES``. The same step reports feed
the live page's curves (``rlray.observe.page.PageData``; the HTTP routing is ``page.PageServer``, shared with a
stored run), and rank 0 sends each step's kept samples for its sample viewer.

The driver's console polls ``progress``: a ``Progress`` record holding every recorded step of the last
``PROGRESS_STEPS`` (``StepProgress``, numbered in the order recorded), so a poll that comes after two short steps
still sees both and the console prints a line for each.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import prometheus_client
from ray.util import metrics as ray_metrics_api
from tenacity import retry, stop_after_attempt, wait_exponential

from rlray.observe import metrics as registry
from rlray.observe import page
from rlray.observe.page import HEALTH_ALERTS, Alert
from rlray.observe.samples import StepSample

log = logging.getLogger(__name__)

GAUGES: dict[str, str] = {
    "rlray_step": "RL steps finished",
    "rlray_epoch": "data epoch of the training cursor",
    "rlray_policy_version": "policy version held by the rollout engines",
    **{g.name: g.help for g in registry.STEP_GAUGES},  # set from a step metric at each recorded step
    "rlray_healthy": "1 when healthy, 0 when stalled or stopped",
    "rlray_heartbeat_age_s": "seconds since the last heartbeat",
    "rlray_snapshot_step": "step of the last complete snapshot",
}
COUNTERS: dict[str, str] = {
    "rlray_restarts": "learner restarts by Ray Train",
    "rlray_alerts": "alerts sent",
    "rlray_snapshot_failures": "snapshots that failed to write",
}
PROGRESS_STEPS = 500  # recorded steps the progress record keeps (a console that polls late still prints each)
# Before the learner's first start or heartbeat the run is starting (Ray Train's workers, the engines' loads): a
# stall is then "no sign of the learner" for this long or 2 heartbeat intervals, whichever is longer. A 10 s heartbeat
# (configs/grpo_gsm8k_tiny.yaml) otherwise alerted a stall at step 0 in every run whose start took over 20 s.
STARTUP_GRACE_S = 300.0


@dataclass(frozen=True)
class StepProgress:
    """One recorded step as the driver's console shows it.

    Attributes:
        seq: 1, 2, ... in the order the monitor recorded steps (a step run again after a rollback gets a new one).
        step: the 1-based step.
        metrics: the step's figures of ``metrics.PROGRESS_FIELDS`` that it logged.
    """

    seq: int
    step: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class Progress:
    """What the driver's console shows (``RunMonitor.progress``; ``rlray.launch.console.DriverProgress``).

    Attributes:
        status: healthy, stalled or stopped.
        reason: why stalled or stopped; None while healthy.
        step: the run's position by its last heartbeat (a resumed run's snapshot step before its first step ends).
        alerts: the newest ``HEALTH_ALERTS`` alerts, oldest first.
        steps: the recorded steps, oldest first: the last ``PROGRESS_STEPS`` of them.
    """

    status: str
    reason: str | None
    step: int
    alerts: tuple[Alert, ...]
    steps: tuple[StepProgress, ...]


class MetricsRegistry:
    """One set of figures, written to Ray's metrics and to a Prometheus registry served on /metrics.

    Args:
        run_id: MLflow run id, the ``run_id`` label/tag of every series.
        ray_metrics: also record through ``ray.util.metrics`` (needs a connected Ray process).
    """

    def __init__(self, run_id: str, *, ray_metrics: bool) -> None:
        self.run_id = run_id
        self.registry = prometheus_client.CollectorRegistry()
        self._prom: dict[str, Any] = {}
        self._ray: dict[str, Any] = {}
        for name, doc in GAUGES.items():
            self._prom[name] = prometheus_client.Gauge(name, doc, ["run_id"], registry=self.registry).labels(run_id)
        for name, doc in COUNTERS.items():
            self._prom[name] = prometheus_client.Counter(name, doc, ["run_id"], registry=self.registry).labels(run_id)
        if ray_metrics:
            for name, doc in GAUGES.items():
                self._ray[name] = ray_metrics_api.Gauge(name, doc, tag_keys=("run_id",))
            for name, doc in COUNTERS.items():
                self._ray[name] = ray_metrics_api.Counter(name, doc, tag_keys=("run_id",))
            for m in self._ray.values():
                m.set_default_tags({"run_id": run_id})

    def set(self, name: str, value: float) -> None:
        """Sets gauge ``name`` (one of GAUGES) in both registries."""
        self._prom[name].set(value)
        if name in self._ray:
            self._ray[name].set(value)

    def inc(self, name: str, value: float = 1.0) -> None:
        """Adds ``value`` to counter ``name`` (one of COUNTERS) in both registries."""
        self._prom[name].inc(value)
        if name in self._ray:
            self._ray[name].inc(value)

    def republish(self) -> None:
        """Sets every Ray gauge again to the value it holds now.

        Ray (2.60, OpenTelemetry export) evicts a gauge series that was not set within two metrics
        report intervals, so a gauge set once per step (tens of seconds) or once per stall check
        would blink in and out of the head's metrics export and the dashboard's charts. The
        monitor calls this every second from its watcher thread. Counters are cumulative in Ray
        and are not evicted.
        """
        for name, gauge in self._ray.items():
            if name in GAUGES:
                gauge.set(self.value(name))

    def value(self, name: str) -> float:
        """Returns the current value of a gauge or counter (as served on /metrics)."""
        suffix = "_total" if name in COUNTERS else ""
        return float(self.registry.get_sample_value(name + suffix, {"run_id": self.run_id}) or 0.0)

    def render(self) -> bytes:
        """Returns the Prometheus text exposition of every series."""
        return prometheus_client.generate_latest(self.registry)


class Alerter:
    """Sends alerts to the sinks of ``monitor.alerts``: the log, an MLflow run tag, an HTTP webhook.

    Args:
        sinks: any of "log", "mlflow", "webhook".
        tracker: an ``rlray.observe.tracking.Tracker`` for the "mlflow" sink (tags ``rlray.alert.<kind>``).
        webhook_url: the revealed URL for "webhook" (JSON POST).
        webhook_attempts: tries per alert, with exponential back-off.
    """

    def __init__(self, sinks: list[str], *, tracker: Any = None, webhook_url: str | None = None,
                 webhook_attempts: int = 3, webhook_timeout_s: float = 10.0) -> None:
        self.sinks = list(sinks)
        self.tracker = tracker
        self.webhook_url = webhook_url
        self.webhook_attempts = webhook_attempts
        self.webhook_timeout_s = webhook_timeout_s

    def send(self, kind: str, message: str, fields: dict[str, Any]) -> list[str]:
        """Sends one alert to every sink; returns the sinks that failed (each failure is logged, never raised)."""
        failed = []
        if "log" in self.sinks:
            log.warning("ALERT %s: %s", kind, message)
        if "mlflow" in self.sinks and self.tracker is not None:
            try:
                self.tracker.set_tags({f"rlray.alert.{kind}": message[:5000]})
            except Exception as err:  # an alert must never take the monitor down
                log.error("alert %s: MLflow tag failed: %s", kind, err)
                failed.append("mlflow")
        if "webhook" in self.sinks and self.webhook_url:
            body = json.dumps({"kind": kind, "message": message, **fields}).encode()
            try:
                self._post(body)
            except Exception as err:
                log.error("alert %s: webhook failed after %d attempts: %s", kind, self.webhook_attempts, err)
                failed.append("webhook")
        return failed

    def _post(self, body: bytes) -> None:
        @retry(stop=stop_after_attempt(self.webhook_attempts), wait=wait_exponential(multiplier=0.2, max=10), reraise=True)
        def post() -> None:
            req = urllib.request.Request(self.webhook_url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=self.webhook_timeout_s) as resp:
                resp.read()

        post()


class RunMonitor(page.PageServer):
    """Health of one run: status, progress, heartbeats, alerts, and the page that shows them (``page.PageServer``).

    Status is ``healthy`` while heartbeats come, ``stalled`` after 2 heartbeat intervals without one (before the
    learner's first start or heartbeat: after ``STARTUP_GRACE_S`` when that is longer), and ``stopped`` (with a
    reason) once the run ends.

    Args:
        run_id: MLflow run id.
        heartbeat_s: the heartbeat interval in seconds (``monitor.heartbeat_s``).
        alerter: where alerts go.
        ray_metrics: also feed Ray's metrics (inside a Ray process).
        kl_limit: the KL guard's threshold (``guard.kl_threshold``), drawn on the page's KL chart; None: off.
        page_sample_steps: steps whose samples the page keeps (``monitor.page_sample_steps``).
        bands: the page's healthy bands (``monitor.bands`` as ``page.Band``).
    """

    def __init__(self, run_id: str, *, heartbeat_s: float, alerter: Alerter, ray_metrics: bool = False,
                 kl_limit: float | None = None, page_sample_steps: int = 20, bands: tuple[page.Band, ...] = ()) -> None:
        super().__init__(run_id, page.PageData(page_sample_steps, kl_limit, bands))
        self.heartbeat_s = heartbeat_s
        self.alerter = alerter
        self.metrics = MetricsRegistry(run_id, ray_metrics=ray_metrics)
        self.status, self.reason = "healthy", None
        self.step = self.epoch = self.policy_version = 0
        self.snapshot_step: int | None = None
        self.recorded: deque[StepProgress] = deque(maxlen=PROGRESS_STEPS)  # the driver's console reads them
        self.last_heartbeat = time.monotonic()
        self.learner_starts = 0
        self.learner_seen = False  # a learner start or heartbeat came: the start-up grace is over
        self.alerts: list[Alert] = []
        self._lock = threading.Lock()
        self.metrics.set("rlray_healthy", 1.0)  # exported from the start, not only after the first stall check
        self._watcher = threading.Thread(target=self._watch, name="rlray-stall-watch", daemon=True)
        self._watcher.start()

    # ---- updates from the learner ---------------------------------------------------------
    def beat(self, step: int, epoch: int, policy_version: int) -> None:
        """Records a heartbeat with the run's position; a stalled run becomes healthy again."""
        with self._lock:
            self.last_heartbeat = time.monotonic()
            self.learner_seen = True
            self.step, self.epoch, self.policy_version = step, epoch, policy_version
            if self.status == "stalled":
                self.status, self.reason = "healthy", None
                log.info("run %s: heartbeats are back at step %d", self.run_id, step)
            healthy = 1.0 if self.status == "healthy" else 0.0
        for name, value in (("rlray_step", step), ("rlray_epoch", epoch), ("rlray_policy_version", policy_version),
                            ("rlray_healthy", healthy)):
            self.metrics.set(name, value)

    def record_step(self, step: int, epoch: int, policy_version: int, step_metrics: dict[str, float]) -> None:
        """Records a finished step (counts as a heartbeat): its progress record, gauges and the page's curves."""
        self.beat(step, epoch, policy_version)
        shown = {f.key: float(step_metrics[f.key]) for f in registry.PROGRESS_FIELDS if f.key in step_metrics}
        with self._lock:
            seq = self.recorded[-1].seq + 1 if self.recorded else 1
            self.recorded.append(StepProgress(seq, step, shown))
        for gauge in registry.STEP_GAUGES:
            if gauge.key in step_metrics:
                self.metrics.set(gauge.name, float(step_metrics[gauge.key]))
        self.page.record_step(step, step_metrics)

    def record_samples(self, step: int, samples: list[StepSample]) -> None:
        """Keeps a step's samples for the page's sample viewer (the last ``page_sample_steps`` steps)."""
        self.page.record_samples(step, samples)

    def record_snapshot(self, step: int | None) -> None:
        """Records a complete snapshot at ``step``, or a failed one when ``step`` is None."""
        if step is None:
            self.metrics.inc("rlray_snapshot_failures")
        else:
            self.snapshot_step = step
            self.metrics.set("rlray_snapshot_step", step)

    def learner_started(self) -> int:
        """Counts a learner (rank 0) start; returns how many there were. A start after the first is a
        restart by Ray Train, which is counted and alerted."""
        with self._lock:
            self.learner_starts += 1
            starts = self.learner_starts
            self.last_heartbeat = time.monotonic()
            self.learner_seen = True
            self.status, self.reason = "healthy", None
        if starts > 1:
            self.metrics.inc("rlray_restarts")
            self.alert("restart", f"learner restarted by Ray Train (start {starts}); resuming from the latest snapshot",
                       self.step)
        return starts

    def alert(self, kind: str, message: str, step: int | None = None) -> None:
        """Sends an alert (guard_trip, restart, stall, snapshot_failed, ...) to every configured sink."""
        fields = {"run_id": self.run_id, "step": self.step if step is None else step, "time": time.time()}
        with self._lock:
            self.alerts.append(Alert(kind, message, fields["step"], fields["time"]))
        self.metrics.inc("rlray_alerts")
        self.alerter.send(kind, message, fields)

    def set_status(self, status: str, reason: str | None = None) -> None:
        """Sets the status: 'healthy', or 'stopped' with a reason (finished, kl_guard, failed, ...)."""
        with self._lock:
            self.status, self.reason = status, reason
        self.metrics.set("rlray_healthy", 1.0 if status == "healthy" else 0.0)

    # ---- reads ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Returns the /health document: status, reason, epoch, step, policy_version,
        seconds_since_heartbeat, run_id, restarts, snapshot_step (of the last complete snapshot, None before
        one) and alerts (the newest ``HEALTH_ALERTS``, oldest first, each {kind, message, step, time})."""
        self.check_stall()
        with self._lock:
            return {
                "status": self.status,
                "reason": self.reason,
                "epoch": self.epoch,
                "step": self.step,
                "policy_version": self.policy_version,
                "seconds_since_heartbeat": round(time.monotonic() - self.last_heartbeat, 3),
                "run_id": self.run_id,
                "restarts": max(0, self.learner_starts - 1),
                "snapshot_step": self.snapshot_step,
                "alerts": [asdict(a) for a in self.alerts[-HEALTH_ALERTS:]],
            }

    def progress(self) -> Progress:
        """Returns what the driver's console shows: status, the heartbeat's step, the newest alerts and the recorded
        steps (``Progress``)."""
        self.check_stall()
        with self._lock:
            return Progress(self.status, self.reason, self.step, tuple(self.alerts[-HEALTH_ALERTS:]),
                            tuple(self.recorded))

    def check_stall(self) -> bool:
        """Marks the run stalled (and alerts once) when no heartbeat came for 2 intervals (``STARTUP_GRACE_S`` when
        longer, before the learner was seen); returns True if so."""
        with self._lock:
            age = time.monotonic() - self.last_heartbeat
            limit = 2 * self.heartbeat_s if self.learner_seen else max(2 * self.heartbeat_s, STARTUP_GRACE_S)
            newly = self.status == "healthy" and age > limit
            if newly:
                self.status, self.reason = "stalled", f"no heartbeat for {age:.0f} s (monitor.heartbeat_s={self.heartbeat_s:g})"
            stalled = self.status == "stalled"
        self.metrics.set("rlray_heartbeat_age_s", age)
        self.metrics.set("rlray_healthy", 1.0 if self.status == "healthy" else 0.0)
        if newly:
            self.alert("stall", self.reason)
        return stalled

    def prometheus(self) -> tuple[bytes, str]:
        """Returns (/metrics body, content type): every gauge and counter after a stall check (``page.PageServer``)."""
        self.check_stall()
        return self.metrics.render(), prometheus_client.CONTENT_TYPE_LATEST

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s / 4)):
            self.check_stall()
            self.metrics.republish()


class Heartbeat:
    """Calls ``beat()`` now and then every ``interval_s`` seconds in a daemon thread, until ``stop()``.

    The learner's rank 0 runs one; its ``beat`` writes the heartbeat log line, the MLflow metric and
    the monitor's heartbeat.
    """

    def __init__(self, beat: Any, interval_s: float) -> None:
        self._beat = beat
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlray-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Starts the thread (the first beat is immediate); returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread, waiting for a beat in progress to finish."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            try:
                self._beat()
            except Exception as err:  # a failed heartbeat must not kill training; the monitor sees the gap
                log.error("heartbeat failed: %s", err)
            if self._stop.wait(self._interval_s):
                return
