"""``rlray monitor RUN_ID`` (issue 13): the live page of a run kept in MLflow. A tiny store written here with
rlray's own Tracker (config, step metrics, samples tables, tags) is served read-only, and real HTTP GETs check the
page, /api/metrics (equal to what MLflow logged), /api/samples (equal to the kept samples) and /health."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlray.config import config_from_dict
from rlray.observe import page
from rlray.observe.samples import StepSample, json_row
from rlray.observe.stored import StoredRun
from rlray.observe.tracking import Tracker, get_run_metrics

ROOT = Path(__file__).parents[2]


def _get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _samples(step: int) -> list[StepSample]:
    return [StepSample(step, f"p{step}", "Q: 2+2?", "4</s>", 1.0, {"math": 1.0, "fmt": None}, 0.5, "stop", step - 1, 3),
            StepSample(step, f"q{step}", "Q: <script>x</script>", "<b>no</b>", math.nan, {"math": math.nan, "fmt": 0.0},
                       -0.5, "length", step - 1, 9)]


@pytest.fixture
def finished_run(tmp_path):
    """A finished 3-step run: KL guard 0.05, samples of steps 2 and 3, a snapshot at step 2, one alert."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "stored")
    tracker.log_config(config_from_dict({}, ["guard.kl_threshold=0.05", "monitor.heartbeat_s=30"]))
    tracker.log_metrics({"monitor/heartbeat_s": 0.0, "monitor/rss_gib": 1.5}, step=0)  # the first heartbeat
    for step in (1, 2, 3):
        tracker.log_metrics({"reward/mean": 0.25 * step, "reward/math": 0.5 * step, "reward/std": 0.1,
                             "algo/kl": 0.01 * step, "learner/pg_loss": -0.5 + step, "timing/step_s": 2.0,
                             "data/epoch": 1.0, "rollout/policy_version": float(step - 1)}, step=step)
    for step in (2, 3):
        tracker.log_samples(_samples(step), step=step)
    tracker.set_tags({"rlray.last_snapshot": "/tmp/snaps/run_x/step_00000002", "rlray.alert.stall": "no heartbeat for 70 s",
                      "rlray.stop_reason": "max_steps"})
    tracker.finish()
    return uri, tracker.run_id


def test_stored_run_answers_the_page_with_what_mlflow_logged(finished_run):
    uri, run_id = finished_run
    stored = StoredRun(uri, run_id)
    port = stored.serve("127.0.0.1", 0)
    try:
        assert stored._server.server_address[0] == "127.0.0.1"
        status, headers, html = _get(port, "/")
        assert status == 200 and b'<script src="/static/monitor.js"></script>' in html
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert _get(port, "/static/monitor.js")[0] == 200
        doc = json.loads(_get(port, "/api/metrics")[2])
        assert (doc["run_id"], doc["kl_limit"], doc["history_id"]) == (run_id, 0.05, 0)
        assert [p["step"] for p in doc["points"]] == [1, 2, 3]  # step 0 held a heartbeat only: no point
        assert [b["metric"] for b in doc["bands"]] == ["learner/pg_loss", "learner/value_loss", "learner/grad_norm",
                                                       "reward/mean", "algo/kl"]  # the run's monitor.bands and its guard
        assert [p["outside"] for p in doc["points"]] == [{}, {}, {}]
        assert set(doc["points"][0]["values"]) == {"reward/mean", "reward/math", "algo/kl", "learner/pg_loss",
                                                   "timing/step_s"}
        logged = get_run_metrics(uri, run_id)
        for key in doc["points"][0]["values"]:
            assert [(p["step"], p["values"][key]) for p in doc["points"]] == logged[key], key
        assert doc["points"][2]["values"]["reward/mean"] == 0.75 and doc["points"][1]["values"]["learner/pg_loss"] == 1.5
        assert [p["step"] for p in json.loads(_get(port, "/api/metrics?since=2")[2])["points"]] == [3]

        latest = json.loads(_get(port, "/api/samples")[2])
        assert (latest["step"], latest["steps"]) == (3, [2, 3])
        assert latest["samples"] == [json_row(s) for s in _samples(3)]  # the same records the live page shows
        assert latest["samples"][1]["terms"] == {"math": "failed", "fmt": 0.0} and latest["samples"][1]["reward"] is None
        step2 = json.loads(_get(port, "/api/samples?step=2")[2])
        assert [s["prompt_id"] for s in step2["samples"]] == ["p2", "q2"]
        status, _, body = _get(port, "/api/samples?step=1")
        assert status == 404 and "no samples for step 1" in json.loads(body)["error"]
        assert _get(port, "/api/samples?step=two")[0] == 400

        health = json.loads(_get(port, "/health")[2])
        assert health["status"] == "stopped" and health["reason"] == "max_steps" and health["source"] == "mlflow"
        assert (health["step"], health["epoch"], health["policy_version"], health["snapshot_step"]) == (3, 1, 2, 2)
        assert health["run_id"] == run_id and health["restarts"] is None
        assert health["alerts"] == [{"kind": "stall", "message": "no heartbeat for 70 s", "step": None, "time": None}]
        status, _, body = _get(port, "/metrics")
        assert status == 404 and "live run" in json.loads(body)["error"]
    finally:
        stored.close()


def test_stored_sample_text_stays_escaped(finished_run):
    uri, run_id = finished_run
    stored = StoredRun(uri, run_id)
    code, doc = stored.samples_of(3)
    body = page.json_bytes(doc)
    assert code == 200 and b"<" not in body and b">" not in body
    assert json.loads(body)["samples"][1]["completion"] == "<b>no</b>"


def test_a_running_run_is_healthy_then_stalled_and_gains_steps_on_refresh(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "stored")
    tracker.log_config(config_from_dict({}, ["monitor.heartbeat_s=30", "guard.kl_threshold=null"]))
    tracker.log_metrics({"reward/mean": 0.5, "timing/step_s": 1.0}, step=1)
    tracker.flush()
    stored = StoredRun(uri, tracker.run_id, refresh_s=0.1)
    assert stored.page.kl_limit is None
    health = stored.health()
    assert health["status"] == "healthy" and health["step"] == 1 and health["seconds_since_heartbeat"] < 30
    tracker.log_metrics({"reward/mean": 0.75, "timing/step_s": 1.0}, step=2)
    tracker.flush()
    stored.refresh()
    assert [(p["step"], p["values"]["reward/mean"]) for p in stored.page.metrics_since(1)["points"]] == [(2, 0.75)]
    stored.last_logged_s -= 61.0  # nothing logged for more than two heartbeats (2 x 30 s)
    health = stored.health()
    assert health["status"] == "stalled" and "nothing logged to MLflow for 61 s" in health["reason"]
    tracker.finish()


def test_rlray_monitor_serves_a_finished_run(finished_run):
    """The command as a user runs it: binds 127.0.0.1, prints the URL, serves the page until stopped."""
    uri, run_id = finished_run
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "rlray.cli", "monitor", f"runs:/{run_id}", "--tracking-uri", uri],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines[0].startswith(f"rlray monitor: run {run_id} (finished) from {uri}"), (lines, proc.stderr.read()
                                                                                          if proc.poll() is not None else "")
        url = re.search(r"page at (http://127\.0\.0\.1:(\d+)/)", lines[1])
        assert url, lines
        port = int(url.group(2))
        assert _get(port, "/")[0] == 200
        points = json.loads(_get(port, "/api/metrics")[2])["points"]
        assert [p["values"]["reward/mean"] for p in points] == [0.25, 0.5, 0.75]
        assert json.loads(_get(port, "/api/samples?step=2")[2])["samples"][0]["completion"] == "4</s>"
        assert json.loads(_get(port, "/health")[2])["status"] == "stopped"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_rlray_monitor_names_a_missing_run(tmp_path):
    from rlray.cli import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(uri, "stored").finish()
    assert main(["monitor", "0123456789abcdef", "--tracking-uri", uri]) == 2


def test_a_stored_config_without_bands_or_heartbeat_takes_the_monitor_defaults_given(tmp_path):
    """A run an older rlray logged (its config/resolved.yaml has no monitor.bands or heartbeat_s) shows the defaults
    ``rlray monitor`` passes (``rlray.config.monitor_defaults``), and none without them; a run logged without a
    config shows its curves with the same defaults."""
    from rlray.config import monitor_defaults

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "stored")
    tracker.log_text("guard: {kl_threshold: 0.04}\nmonitor: {port: 8888}\n", "config/resolved.yaml")
    tracker.log_metrics({"reward/mean": 0.5}, step=1)
    tracker.finish()
    defaults = monitor_defaults()
    stored = StoredRun(uri, tracker.run_id, monitor_defaults=defaults)
    assert [b.metric for b in stored.page.bands] == ["learner/pg_loss", "learner/value_loss", "learner/grad_norm",
                                                     "reward/mean", "algo/kl"]  # the guard's band is always drawn
    assert (stored.page.bands[3].min_slope, stored.page.bands[3].window, stored.page.kl_limit) == (0.0, 20, 0.04)
    assert stored.heartbeat_s == 300.0
    bare = StoredRun(uri, tracker.run_id, monitor_defaults={**defaults, "heartbeat_s": 60.0})
    assert bare.heartbeat_s == 60.0
    assert [b.metric for b in StoredRun(uri, tracker.run_id).page.bands] == ["algo/kl"]

    plain = Tracker(uri, "stored")  # no config logged at all
    plain.log_metrics({"reward/mean": 0.5}, step=1)
    plain.finish()
    stored = StoredRun(uri, plain.run_id, monitor_defaults=defaults)
    assert len(stored.page.bands) == 4 and stored.page.kl_limit is None
