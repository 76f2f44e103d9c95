"""Monitor: /health and /metrics over HTTP, stall after 2 missed heartbeats, alerts (log, MLflow, webhook
with retries), and the heartbeat thread."""

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlray.observe import monitor as monitor_module
from rlray.observe.monitor import PROGRESS_STEPS, Alerter, Heartbeat, RunMonitor, StepProgress
from rlray.observe.page import Alert


def _get(port: int, path: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.headers["Content-Type"], r.read()


@pytest.fixture
def monitor():
    m = RunMonitor("run123", heartbeat_s=0.2, alerter=Alerter(["log"]))
    yield m
    m.close()


def test_health_and_metrics_over_http(monitor):
    port = monitor.serve("127.0.0.1", 0)
    assert port > 0
    monitor.record_step(12, 3, 12, {"reward/mean": 0.25, "algo/kl": 0.004, "perf/tokens_per_s": 80.0, "rollout/staleness_mean": 0.0})
    status, ctype, body = _get(port, "/health")
    health = json.loads(body)
    assert (status, ctype) == (200, "application/json")
    assert {k: health[k] for k in ("status", "reason", "epoch", "step", "policy_version", "run_id", "restarts")} == {
        "status": "healthy", "reason": None, "epoch": 3, "step": 12, "policy_version": 12, "run_id": "run123", "restarts": 0}
    assert 0.0 <= health["seconds_since_heartbeat"] < 1.0
    status, ctype, body = _get(port, "/metrics")
    text = body.decode()
    assert ctype.startswith("text/plain")
    for line in ('rlray_step{run_id="run123"} 12.0', 'rlray_epoch{run_id="run123"} 3.0', 'rlray_reward_mean{run_id="run123"} 0.25',
                 'rlray_kl{run_id="run123"} 0.004', 'rlray_tokens_per_s{run_id="run123"} 80.0', 'rlray_staleness{run_id="run123"} 0.0'):
        assert line in text, line
    # one source: the page shows what the registry (which also feeds Ray's metrics) holds
    assert monitor.metrics.value("rlray_reward_mean") == 0.25
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(port, "/nope")
    assert err.value.code == 404


def test_monitor_binds_localhost_and_reports_a_taken_port(monitor):
    port = monitor.serve("127.0.0.1", 0)
    assert monitor._server.server_address[0] == "127.0.0.1"
    other = RunMonitor("r2", heartbeat_s=1.0, alerter=Alerter(["log"]))
    try:
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}.*monitor.port"):
            other.serve("127.0.0.1", port)
    finally:
        other.close()


def test_healthy_gauge_is_exported_from_the_start():
    """Before any heartbeat or stall check (the watcher's first check is 1 s away), rlray_healthy reads 1."""
    m = RunMonitor("run9", heartbeat_s=60.0, alerter=Alerter(["log"]))
    try:
        assert 'rlray_healthy{run_id="run9"} 1.0' in m.metrics.render().decode()
    finally:
        m.close()


class _RayGauge:
    """Stands in for a ray.util.metrics.Gauge: records every value set."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def set(self, value: float) -> None:
        self.values.append(value)


def test_ray_gauges_are_set_again_every_second():
    """Ray evicts a gauge not set within 2 report intervals; the watcher sets each one again every second
    with the value the registry holds, so a once-per-step figure stays on the head's export between steps."""
    m = RunMonitor("run7", heartbeat_s=60.0, alerter=Alerter(["log"]))
    try:
        fakes = {name: _RayGauge() for name in ("rlray_reward_mean", "rlray_step", "rlray_healthy")}
        m.metrics._ray = dict(fakes)
        m.record_step(4, 1, 4, {"reward/mean": 0.375})
        assert fakes["rlray_reward_mean"].values == [0.375] and fakes["rlray_step"].values == [4.0]
        start, deadline = time.monotonic(), time.monotonic() + 20
        while len(fakes["rlray_reward_mean"].values) < 3:  # two wake-ups of the watcher
            assert time.monotonic() < deadline, fakes["rlray_reward_mean"].values
            time.sleep(0.05)
        assert time.monotonic() - start >= 1.5  # at 1 s intervals, not faster
        assert set(fakes["rlray_reward_mean"].values) == {0.375} and set(fakes["rlray_step"].values) == {4.0}
        assert set(fakes["rlray_healthy"].values) == {1.0}
    finally:
        m.close()


def test_no_stall_while_the_run_starts_then_two_missed_heartbeats_after_the_learner_started(monitor, monkeypatch):
    monkeypatch.setattr(monitor_module, "STARTUP_GRACE_S", 0.6)
    time.sleep(0.45)  # > 2 x 0.2 s, but the learner has not started: engines and workers still loading
    assert monitor.health()["status"] == "healthy" and not monitor.alerts
    time.sleep(0.3)  # > the (shortened) start-up grace: a start that never comes is a stall too
    assert monitor.health()["status"] == "stalled" and [a.kind for a in monitor.alerts] == ["stall"]
    monitor.learner_started()  # healthy again; from now on 2 intervals
    time.sleep(0.45)
    assert monitor.health()["status"] == "stalled" and [a.kind for a in monitor.alerts] == ["stall", "stall"]


def test_stalled_after_two_missed_heartbeats_then_recovers(monitor, caplog):
    monitor.beat(5, 1, 5)
    assert monitor.health()["status"] == "healthy" and monitor.metrics.value("rlray_healthy") == 1.0
    time.sleep(0.45)  # > 2 x 0.2 s without a heartbeat
    health = monitor.health()
    assert health["status"] == "stalled" and "no heartbeat for" in health["reason"]
    assert monitor.metrics.value("rlray_healthy") == 0.0
    time.sleep(0.3)
    stalls = [a for a in monitor.alerts if a.kind == "stall"]
    assert len(stalls) == 1 and stalls[0].step == 5  # one alert per stall, not one per check
    assert "ALERT stall" in caplog.text
    monitor.beat(6, 1, 6)
    assert monitor.metrics.value("rlray_healthy") == 1.0  # set by the heartbeat itself
    assert monitor.health()["status"] == "healthy"
    monitor.set_status("stopped", "kl_guard")
    assert (monitor.health()["status"], monitor.health()["reason"]) == ("stopped", "kl_guard")
    assert monitor.metrics.value("rlray_healthy") == 0.0


def test_restart_is_counted_and_alerted(monitor):
    assert monitor.learner_started() == 1 and monitor.alerts == []
    assert monitor.learner_started() == 2
    assert [a.kind for a in monitor.alerts] == ["restart"]
    assert monitor.health()["restarts"] == 1 and monitor.metrics.value("rlray_restarts") == 1.0


class _Hook(BaseHTTPRequestHandler):
    failures_left = 2
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Hook.bodies.append(body)
        code = 500 if _Hook.failures_left > 0 else 200
        _Hook.failures_left -= 1
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args):
        return


class _Tags:
    def __init__(self):
        self.tags = {}

    def set_tags(self, tags):
        self.tags.update(tags)


def test_webhook_is_retried_and_mlflow_gets_a_tag():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tracker = _Tags()  # the MLflow sink through a real Tracker is covered in tests/run/test_session.py
    try:
        alerter = Alerter(["log", "mlflow", "webhook"], tracker=tracker,
                          webhook_url=f"http://127.0.0.1:{server.server_address[1]}/hook", webhook_attempts=3)
        assert alerter.send("guard_trip", "kl_guard: step 9", {"run_id": "r1", "step": 9}) == []
        # two 500s, then 200: three POSTs of the same JSON
        assert len(_Hook.bodies) == 3 and _Hook.bodies[0] == _Hook.bodies[2]
        assert _Hook.bodies[0] == {"kind": "guard_trip", "message": "kl_guard: step 9", "run_id": "r1", "step": 9}
        assert tracker.tags == {"rlray.alert.guard_trip": "kl_guard: step 9"}
        _Hook.failures_left = 10
        assert alerter.send("stall", "x", {}) == ["webhook"]  # gives up after 3 tries, never raises
    finally:
        server.shutdown()


def test_heartbeat_thread_beats_at_start_and_every_interval():
    beats = []
    hb = Heartbeat(lambda: beats.append(time.monotonic()), 0.1).start()
    time.sleep(0.35)
    hb.stop()
    assert 3 <= len(beats) <= 5
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert all(0.08 <= g <= 0.3 for g in gaps)


def test_progress_holds_every_recorded_step_with_its_figures():
    """The driver's console reads ``progress``: the status, the heartbeat's step, the newest alerts, and each recorded
    step (numbered in the order recorded) with its progress figures only, so a late poll still sees every step."""
    m = RunMonitor("run5", heartbeat_s=60.0, alerter=Alerter(["log"]))
    try:
        first = m.progress()
        assert (first.status, first.reason, first.step, first.alerts, first.steps) == ("healthy", None, 0, (), ())
        m.record_step(1, 0, 1, {"reward/mean": 0.25, "algo/kl": 0.001, "reward/std": 0.5})
        m.record_step(2, 0, 2, {"reward/mean": 0.5, "perf/tokens_per_s": 900})
        m.alert("guard_trip", "kl above 0.1", step=2)
        m.record_step(2, 0, 2, {"reward/mean": 0.75})  # step 2 run again (a rollback): a new record
        doc = m.progress()
        assert doc.steps == (StepProgress(1, 1, {"reward/mean": 0.25, "algo/kl": 0.001}),  # no reward/std: not shown
                             StepProgress(2, 2, {"reward/mean": 0.5, "perf/tokens_per_s": 900.0}),
                             StepProgress(3, 2, {"reward/mean": 0.75}))
        assert (doc.status, doc.step) == ("healthy", 2)
        assert doc.alerts == (Alert("guard_trip", "kl above 0.1", 2, m.alerts[0].time),)
        assert m.health()["alerts"] == [{"kind": "guard_trip", "message": "kl above 0.1", "step": 2, "time": m.alerts[0].time}]
        for step in range(3, PROGRESS_STEPS + 10):  # bounded: the oldest records go
            m.record_step(step, 0, step, {})
        steps = m.progress().steps
        assert len(steps) == PROGRESS_STEPS and steps[-1].step == PROGRESS_STEPS + 9 and steps[-1].seq == PROGRESS_STEPS + 10
    finally:
        m.close()
