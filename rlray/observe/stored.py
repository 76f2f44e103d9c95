"""A read-only monitor of a run kept in MLflow (``rlray monitor RUN_ID``): the live page for yesterday's run.

``StoredRun`` reads a run's step metrics, status, tags and samples tables from its MLflow store and answers the
page's requests through the live monitor's own routing (``page.PageServer``: ``/``, ``/api/charts``,
``/api/metrics``, ``/api/samples``, ``/health``), so the same page shows it. It reads the metrics once at start, and
again every ``refresh_s`` seconds in a background thread while the run is still RUNNING (never per request). Samples
tables are read when the page first asks for a step and the last ``sample_cache_steps`` of them are held. ``/metrics``
(Prometheus) belongs to a live run and answers 404 here.

``/health`` is rebuilt from what MLflow holds: status ``stopped`` (reason: the run's ``rlray.stop_reason`` tag, else
its MLflow status) for an ended run; for a RUNNING one ``healthy`` while its last metric is younger than two
heartbeats (``monitor.heartbeat_s``), else ``stalled``. Alerts are the ``rlray.alert.<kind>`` tags (the newest
message of each kind; MLflow keeps no step for them). ``source`` is ``"mlflow"``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import asdict
from typing import Any

import yaml

from rlray.observe import metrics, page, tracking
from rlray.observe.samples import rows_from_table

log = logging.getLogger(__name__)

ENDED = ("FINISHED", "FAILED", "KILLED")  # MLflow run statuses after which nothing more is logged


def _kl_limit(config: dict[str, Any]) -> float | None:
    """Returns ``guard.kl_threshold`` of a run's resolved config (a parsed ``config/resolved.yaml``), None when off
    or absent."""
    value = (config.get("guard") or {}).get("kl_threshold")
    return None if value is None else float(value)


def _bands(config: dict[str, Any], defaults: dict[str, Any]) -> tuple[page.Band, ...]:
    """Returns ``monitor.bands`` of a run's resolved config as ``page.Band`` (``defaults``' bands when the run's config
    has none); a band this rlray cannot read is left out with a warning."""
    monitor = config.get("monitor") or {}
    bands = []
    for item in (monitor["bands"] if "bands" in monitor else defaults.get("bands")) or []:
        try:
            bands.append(page.Band(**item))
        except TypeError as err:
            log.warning("monitor.bands entry %r of this run cannot be read (%s); left out", item, err)
    return tuple(bands)


class StoredRun(page.PageServer):
    """The page of one MLflow run, read-only (``page.PageServer`` with /health and samples rebuilt from MLflow).

    Args:
        uri: the MLflow tracking URI (``tracking.mlflow_uri``).
        run_id: the run to show.
        refresh_s: seconds between rereads of a RUNNING run's metrics and status (an ended run is read once).
        sample_cache_steps: steps whose samples tables are held in memory once read.
        monitor_defaults: the monitor section's defaults (``rlray.config.monitor_defaults()``; ``rlray monitor``
            passes them), read where the run's stored config lacks ``monitor.bands`` or ``monitor.heartbeat_s`` (a
            run an older rlray wrote); None: no bands, heartbeats every 300 s.

    Raises:
        mlflow.exceptions.MlflowException: no run ``run_id`` in the store (``RESOURCE_DOES_NOT_EXIST``).
    """

    def __init__(self, uri: str, run_id: str, *, refresh_s: float = 10.0, sample_cache_steps: int = 20,
                 monitor_defaults: dict[str, Any] | None = None) -> None:
        self.uri, self.refresh_s, self.sample_cache_steps = uri, refresh_s, sample_cache_steps
        run = tracking.get_run(uri, run_id)
        try:
            config = yaml.safe_load(tracking.read_artifact_text(uri, run_id, "config/resolved.yaml")) or {}
        except Exception as err:  # a run logged without its config (or by another tool) still shows its curves
            log.warning("run %s has no readable config/resolved.yaml (%s): no KL guard line or bands", run_id, err)
            config = {}
        defaults = monitor_defaults or {}
        self.heartbeat_s = float((config.get("monitor") or {}).get("heartbeat_s", defaults.get("heartbeat_s", 300.0)))
        super().__init__(run_id, page.PageData(sample_cache_steps, _kl_limit(config), _bands(config, defaults)),
                         " for a run read from MLflow")
        self.mlflow_status = run.info.status
        self.tags: dict[str, str] = dict(run.data.tags)
        self.last: dict[str, float] = {}  # newest value of every key (data/epoch, rollout/policy_version, ...)
        self.sample_step_list: list[int] = []
        self.last_logged_s: float | None = None
        self._samples: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self._refresher: threading.Thread | None = None
        self.refresh()

    def refresh(self) -> None:
        """Rereads the run's status, tags, metrics (steps after the last one read go to the page) and its list of
        samples tables."""
        run = tracking.get_run(self.uri, self.run_id)
        by_step = tracking.metrics_by_step(self.uri, self.run_id)
        steps = tracking.sample_steps(self.uri, self.run_id)
        heartbeat = tracking.last_metric_time_s(self.uri, self.run_id, "timing/step_s")
        beat = tracking.last_metric_time_s(self.uri, self.run_id, "monitor/heartbeat_s")
        with self._lock:
            self.mlflow_status, self.tags = run.info.status, dict(run.data.tags)
            done = self.page.metrics_since(0)["points"]
            last_step = done[-1]["step"] if done else None
            for step, step_metrics in by_step.items():
                self.last.update(step_metrics)
                if (last_step is None or step > last_step) and any(metrics.is_charted(k) for k in step_metrics):
                    self.page.record_step(step, step_metrics)  # a step with a heartbeat only is no point of the curves
            self.sample_step_list = steps
            times = [t for t in (heartbeat, beat) if t is not None]
            self.last_logged_s = max(times) if times else run.info.start_time / 1000.0

    def samples_of(self, step: int | None) -> tuple[int, dict[str, Any]]:
        """Returns (HTTP status, /api/samples document) of ``step`` (None: the newest step with samples), read
        from its samples table; 404 with {error, steps} when the run has no table for ``step``."""
        with self._lock:
            steps = list(self.sample_step_list)
        if step is None:
            step = steps[-1] if steps else None
        elif step not in steps:
            return 404, {"error": f"run {self.run_id} has no samples for step {step} (steps with samples: "
                         f"{steps or 'none'}; tracking.samples_per_step=0 keeps none)", "steps": steps}
        if step is None:
            return 200, {"step": None, "steps": steps, "samples": []}
        with self._lock:
            rows = self._samples.get(step)
        if rows is None:
            table = tracking.read_artifact_json(self.uri, self.run_id, f"{tracking.SAMPLES_DIR}/step_{step:06d}.json")
            rows = rows_from_table(table)
            with self._lock:
                self._samples[step] = rows
                while len(self._samples) > self.sample_cache_steps:
                    self._samples.popitem(last=False)
        return 200, {"step": step, "steps": steps, "samples": rows}

    def health(self) -> dict[str, Any]:
        """Returns the /health document of the live monitor, rebuilt from MLflow (see the module's docstring), with
        ``source`` "mlflow"."""
        with self._lock:
            points = self.page.metrics_since(0)["points"]
            age = time.time() - (self.last_logged_s or time.time())
            if self.mlflow_status in ENDED:
                status = "stopped"
                reason = self.tags.get("rlray.stop_reason") or self.mlflow_status.lower()
            elif age > 2 * self.heartbeat_s:
                status, reason = "stalled", f"nothing logged to MLflow for {age:.0f} s (monitor.heartbeat_s={self.heartbeat_s:g})"
            else:
                status, reason = "healthy", None
            snapshot = re.match(r"step_(\d+)", self.tags.get("rlray.last_snapshot", "").rstrip("/").rsplit("/", 1)[-1])
            alerts = [page.Alert(k.removeprefix("rlray.alert."), v, None, None)
                      for k, v in sorted(self.tags.items()) if k.startswith("rlray.alert.")]
            return {
                "status": status,
                "reason": reason,
                "epoch": int(self.last.get("data/epoch", 0)),
                "step": points[-1]["step"] if points else 0,
                "policy_version": int(self.last.get("rollout/policy_version", 0)),
                "seconds_since_heartbeat": round(age, 3),
                "run_id": self.run_id,
                "restarts": None,  # MLflow keeps no count of learner restarts
                "snapshot_step": int(snapshot.group(1)) if snapshot else None,
                "alerts": [asdict(a) for a in alerts[-page.HEALTH_ALERTS:]],
                "source": "mlflow",
            }

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP server (``page.PageServer.serve``) and, for a RUNNING run, the refresh thread (``close``
        stops both); returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        port = super().serve(host, port)
        if self.mlflow_status not in ENDED:
            self._refresher = threading.Thread(target=self._refresh_loop, name="rlray-stored-refresh", daemon=True)
            self._refresher.start()
        return port

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s) and self.mlflow_status not in ENDED:
            try:
                self.refresh()
            except Exception as err:  # the store being down for a while must not end the page
                log.warning("monitor of run %s: cannot read MLflow (%s); trying again in %g s", self.run_id, err,
                            self.refresh_s)
