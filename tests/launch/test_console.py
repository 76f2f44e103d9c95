"""rlray train's console (issue 13): start and last lines, one progress bar drawn by the driver from the monitor's
progress document that ends at 100%, a quiet console with the full driver log in the run's folder, Ray's log files
copied there. Pure functions and a fake poll here; a real ``rlray train`` subprocess's console is checked by
tests/observe/test_held_run.py (the one held tiny run that also serves the page, JSON and TensorBoard checks)."""

from __future__ import annotations

import io
import logging
import os
import re
import time
import warnings

import pytest

from rlray.cli import build_parser
from rlray.launch import console
from rlray.observe.monitor import Alerter, Progress, RunMonitor, StepProgress
from rlray.observe.page import Alert


class _Monitor:
    """Stands in for ``RunMonitor.progress``: steps recorded in order (numbered as the monitor numbers them), alerts."""

    def __init__(self) -> None:
        self.step, self.steps, self.alerts = 0, [], []

    def record(self, step: int, **metrics: float) -> _Monitor:
        self.step = step
        self.steps.append(StepProgress(len(self.steps) + 1, step, metrics))
        return self

    def progress(self) -> Progress:
        return Progress("healthy", None, self.step, tuple(self.alerts), tuple(self.steps))


@pytest.fixture
def root_logging():
    """Restores the root logger's handlers and level, and warnings capture, after a test that configures them."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
        if h not in handlers:
            h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


def test_start_lines_name_run_page_dashboard_snapshots_and_logs():
    lines = console.start_lines(run_id="abc123", tracking_uri="sqlite:////w/mlruns/mlflow.db",
                                monitor_url="http://127.0.0.1:8888", dashboard_url="127.0.0.1:8265",
                                snapshot_dir="/w/outputs/snapshots/run-abc123", log_dir="/w/outputs/logs/abc123", verbose=False)
    assert lines == [
        "rlray: MLflow run abc123 in sqlite:////w/mlruns/mlflow.db (open: mlflow ui --backend-store-uri "
        "sqlite:////w/mlruns/mlflow.db --host 127.0.0.1 --port 5000; or rlray monitor abc123)",
        "rlray: live page at http://127.0.0.1:8888/ (curves and samples), health at http://127.0.0.1:8888/health, "
        "metrics at http://127.0.0.1:8888/metrics",
        "rlray: Ray dashboard at http://127.0.0.1:8265",
        "rlray: snapshots under /w/outputs/snapshots/run-abc123",
        "rlray: logs in /w/outputs/logs/abc123 (driver.log; every Ray process's log in ray/ when the run ends); "
        "-v shows them here",
    ]
    verbose = console.start_lines(run_id="r", tracking_uri="u", monitor_url="http://h:1", dashboard_url="",
                                  snapshot_dir="s", log_dir="l", verbose=True)
    assert len(verbose) == 4 and not any("dashboard" in x for x in verbose)  # no dashboard: no line
    assert verbose[-1].endswith("when the run ends)")


def test_end_lines_name_the_log_folder():
    assert console.end_lines(status="FINISHED", step=2, total_steps=2, final_snapshot="/s/step_2", log_dir="/l",
                             ray_files=14, ray_logs_dir="/tmp/ray/session_x/logs") == [
        "rlray: FINISHED at step 2/2; last snapshot /s/step_2",
        "rlray: full logs in /l: driver.log, every Ray process's in ray/ (14 files)"]
    assert console.end_lines(status="FAILED", step=0, total_steps=5, final_snapshot="", log_dir="/l", ray_files=0,
                             ray_logs_dir="/tmp/ray/session_x/logs") == [
        "rlray: FAILED at step 0/5",
        "rlray: full logs in /l: driver.log, every Ray process's in Ray's folder /tmp/ray/session_x/logs on the head node"]


def test_progress_fields_and_durations():
    metrics = {"reward/mean": 0.41234, "algo/kl": 0.003149, "perf/tokens_per_s": 911.6, "timing/step_s": 12.34,
               "learner/grad_norm": 1.0}
    assert console.progress_fields(metrics, 333.0) == "reward=0.412 kl=0.0031 tokens/s=912 step=12.3s eta=5m33s"
    assert console.progress_fields({"learner/loss": 0.69312}, None) == "loss=0.6931"  # an offline run: no reward or KL
    assert [console.duration_text(s) for s in (0, 42.4, 59.6, 307, 7500)] == ["0s", "42s", "1m00s", "5m07s", "2h05m"]


def test_plain_progress_prints_one_line_per_step_and_each_alert_once():
    """Without a terminal (ray job logs): one line per new step; a poll with no new step prints nothing."""
    out, mon = io.StringIO(), _Monitor()
    bar = console.DriverProgress(3, poll=mon.progress, stream=out, tty=False)
    assert bar.show(mon.progress()) == []  # before the first step
    first = bar.show(mon.record(1, **{"reward/mean": 0.25, "algo/kl": 0.001}).progress())
    assert first == ["rlray step 1/3 (33%) reward=0.250 kl=0.0010"]  # no ETA from one step
    assert bar.show(mon.progress()) == []
    mon.alerts.append(Alert("guard_trip", "kl 0.2 above 0.1", 2, 100.0))
    second = bar.show(mon.record(2, **{"reward/mean": 0.5}).progress())
    assert second[0] == "rlray: alert guard_trip at step 2: kl 0.2 above 0.1"
    assert re.fullmatch(r"rlray step 2/3 \(66%\) reward=0\.500 eta=\d+s", second[1])
    assert bar.show(mon.progress()) == []  # the same alert is not printed again
    mon.record(3)
    bar.close()  # the last poll finds step 3: the run ends at 100%
    assert out.getvalue().splitlines()[-1].startswith("rlray step 3/3 (100%)")
    assert out.getvalue().count("alert guard_trip") == 1


def test_a_poll_that_finds_two_new_steps_prints_both_in_order():
    """The console prints every step it has not printed, in order: a poll that comes after two short steps (the
    monitor saw steps 2 and 3 since the last poll) still prints a line for each, with each step's own figures."""
    out, mon = io.StringIO(), _Monitor()
    bar = console.DriverProgress(4, poll=mon.progress, stream=out, tty=False)
    assert bar.show(mon.record(1, **{"reward/mean": 0.25}).progress()) == ["rlray step 1/4 (25%) reward=0.250"]
    mon.record(2, **{"reward/mean": 0.5}).record(3, **{"reward/mean": 0.75})
    lines = bar.show(mon.progress())
    assert [x.split(" eta=")[0] for x in lines] == ["rlray step 2/4 (50%) reward=0.500", "rlray step 3/4 (75%) reward=0.750"]
    assert bar.show(mon.progress()) == [] and bar.step == 3
    # the same through a real monitor: two steps recorded between polls, both printed
    monitor = RunMonitor("r", heartbeat_s=60.0, alerter=Alerter(["log"]))
    try:
        live = console.DriverProgress(2, poll=monitor.progress, stream=io.StringIO(), tty=False)
        monitor.record_step(1, 0, 1, {"reward/mean": 0.1, "reward/std": 0.5})
        monitor.record_step(2, 0, 2, {"reward/mean": 0.2})
        shown = live.show(monitor.progress())
        assert [x.split(" eta=")[0] for x in shown] == ["rlray step 1/2 (50%) reward=0.100", "rlray step 2/2 (100%) reward=0.200"]
    finally:
        monitor.close()


def test_bar_moves_once_per_step_and_ends_at_100_percent():
    out = io.StringIO()
    polls = iter([_Monitor().record(1, **{"reward/mean": 0.1}), _Monitor().record(1, **{"reward/mean": 0.1}).record(2)])
    last = _Monitor().record(1).record(2).record(3).record(4, **{"reward/mean": 0.4, "perf/tokens_per_s": 900.0})
    bar = console.DriverProgress(4, poll=lambda: next(polls, last).progress(), stream=out, interval_s=0.01, tty=True).start()
    deadline = time.monotonic() + 10
    while bar.step != 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    bar.close()
    bar.close()  # idempotent
    text = out.getvalue()
    assert bar.bar.n == 4 and bar.step == 4
    final = text.split("\r")[-1]
    assert "100%" in final and "4/4" in final and "reward=0.400 tokens/s=900" in final
    assert "rlray train" in final and text.count("100%") >= 1


def test_bar_starts_at_a_resumed_step_and_follows_a_rollback():
    mon = _Monitor()
    bar = console.DriverProgress(10, poll=mon.progress, stream=io.StringIO(), tty=True)
    mon.step = 6  # a run resumed from the snapshot of step 6: heartbeats at step 6, no step recorded yet
    bar.show(mon.progress())
    assert bar.bar.n == 6 and bar.step is None
    bar.show(mon.record(7).progress())
    assert bar.bar.n == 7 and bar.eta_s(7, time.monotonic()) is None
    bar._first = (7, time.monotonic() - 20.0)  # step 7 seen 20 s ago: 10 s per step since
    assert bar.eta_s(9, bar._first[1] + 20.0) == pytest.approx(1 * 10.0)  # 1 step left at 10 s
    bar.show(mon.record(5).progress())  # a rollback to the snapshot of step 4 runs step 5 again
    assert bar.bar.n == 5 and bar._first[0] == 5
    bar.close()


def test_a_failing_poll_keeps_the_last_step():
    def gone():
        raise RuntimeError("monitor actor died")

    bar = console.DriverProgress(5, poll=gone, stream=io.StringIO(), tty=False)
    bar.show(_Monitor().record(1).record(2).progress())
    bar.close()
    assert bar.step == 2


def test_console_is_quiet_and_the_driver_log_keeps_everything(root_logging, tmp_path):
    out = io.StringIO()
    console.configure_console(verbose=False, stream=out)
    logging.getLogger("rlray.launch.driver").info("MLflow run abc in sqlite:///x")  # before the folder is known
    logging.getLogger("mlflow.store").warning("a library warning")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("torch.cuda.amp is deprecated", FutureWarning, stacklevel=1)
    handler = console.keep_logs(tmp_path / "logs" / "abc")
    logging.getLogger("rlray.run.session").warning("learner restarted")
    logging.getLogger("transformers").error("a library error")
    console.release_logs(handler)
    assert out.getvalue() == "rlray: WARNING rlray.run.session: learner restarted\n"  # rlray's warnings only
    kept = (tmp_path / "logs" / "abc" / "driver.log").read_text()
    order = ["INFO rlray.launch.driver: MLflow run abc", "WARNING mlflow.store: a library warning",
             "WARNING py.warnings:", "torch.cuda.amp is deprecated", "WARNING rlray.run.session: learner restarted",
             "ERROR transformers: a library error"]
    assert all(s in kept for s in order), kept
    positions = [kept.index(s) for s in order]
    assert positions == sorted(positions)
    assert not [h for h in root_logging.handlers if h.get_name() == console.PENDING_HANDLER]  # the buffer is gone


def test_the_quiet_console_has_no_library_progress_bars(root_logging, monkeypatch):
    from transformers.utils import logging as hf_logging

    from rlray.launch.driver import worker_env

    hf_logging.enable_progress_bar()
    console.configure_console(verbose=False, stream=io.StringIO())
    assert not hf_logging.is_progress_bar_enabled()  # "Loading weights", "Writing model shards": not in the console
    hf_logging.enable_progress_bar()
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    assert worker_env()["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # nor from a Ray worker (a snapshot's save_pretrained)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    assert worker_env()["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"  # a user's own choice travels as it is


def test_verbose_console_shows_every_library(root_logging):
    out = io.StringIO()
    console.configure_console(verbose=True, stream=out)
    logging.getLogger("anylibrary.engine").info("loading weights")  # a name no library configures (a test order leaves vllm.* disabled)
    logging.getLogger("rlray.x").debug("not shown")
    assert "INFO anylibrary.engine: loading weights" in out.getvalue() and "not shown" not in out.getvalue()
    f = console.ConsoleFilter(verbose=False)
    rec = lambda name, level: logging.LogRecord(name, level, "f", 1, "m", None, None)  # noqa: E731
    assert [f.filter(rec(n, lv)) for n, lv in [("rlray", 30), ("rlray.a", 40), ("rlray.a", 20), ("rlrayx", 30), ("ray", 40)]] == [
        True, True, False, False, False]


def test_copy_ray_logs_keeps_the_runs_files_only(tmp_path):
    src, dest = tmp_path / "session" / "logs", tmp_path / "run" / "ray"
    (src / "events").mkdir(parents=True)
    old = src / "worker-old.out"
    old.write_text("an earlier job")
    os.utime(old, (1000.0, 1000.0))
    (src / "worker-1.out").write_text("rlray step 1/2\n")
    (src / "events" / "event_GCS.log").write_text("{}")
    os.symlink(src / "worker-1.out", src / "link.out")
    copied = console.copy_ray_logs(src, dest, since=2000.0)
    assert sorted(p.relative_to(dest).as_posix() for p in copied) == ["events/event_GCS.log", "worker-1.out"]
    assert (dest / "worker-1.out").read_text() == "rlray step 1/2\n"
    assert console.copy_ray_logs(tmp_path / "missing", dest, since=0.0) == []


def test_train_takes_verbose():
    p = build_parser()
    assert p.parse_args(["train", "c.yaml", "run.max_steps=2"]).verbose is False
    args = p.parse_args(["train", "c.yaml", "run.max_steps=2", "-v"])
    assert args.verbose is True and args.overrides == ["run.max_steps=2"]
    assert p.parse_args(["train", "c.yaml", "--verbose"]).verbose is True


def test_an_embedded_ray_runs_no_preemption_watcher_and_a_cluster_keeps_it(monkeypatch):
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR, HEALTH_CHECK_INTERVAL_S_ENV_VAR

    from rlray.launch import driver

    calls: list[dict] = []
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR, raising=False)
    monkeypatch.delenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR, raising=False)
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(driver.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    driver.init_ray()  # the embedded local Ray: one node, never drained, so Ray Train's watcher is off
    assert calls[-1]["runtime_env"]["env_vars"][ENABLE_PREEMPTION_WATCHER_ENV_VAR] == "0"
    assert calls[-1]["runtime_env"]["env_vars"][HEALTH_CHECK_INTERVAL_S_ENV_VAR] == "0.5"  # Ray's default: 2 s
    monkeypatch.setenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR, "1")
    driver.init_ray()  # a user's own choice travels as it is
    assert calls[-1]["runtime_env"]["env_vars"][ENABLE_PREEMPTION_WATCHER_ENV_VAR] == "1"
    monkeypatch.delenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    driver.init_ray()  # a cluster's nodes can be drained: Ray Train's default (on) stays
    assert ENABLE_PREEMPTION_WATCHER_ENV_VAR not in calls[-1]["runtime_env"]["env_vars"]
    assert HEALTH_CHECK_INTERVAL_S_ENV_VAR not in calls[-1]["runtime_env"]["env_vars"]
    assert calls[-1]["address"] == "127.0.0.1:6379"


def test_the_eta_is_at_most_the_time_left_in_the_runs_wall_time_budget():
    now = time.monotonic()
    bar = console.DriverProgress(40, poll=_Monitor().progress, stream=io.StringIO(), tty=False, ends_by=now + 100.0)
    bar._first = (1, now - 30.0)  # 10 s per step since step 1: the 36 steps left at step 4 would take 360 s
    assert bar.eta_s(4, now) == pytest.approx(100.0)  # run.max_wall_time_s stops it first
    assert bar.eta_s(39, now + 380.0) == pytest.approx(0.0)  # past the budget: the stop is due
    unbounded = console.DriverProgress(40, poll=_Monitor().progress, stream=io.StringIO(), tty=False)
    unbounded._first = (1, now - 30.0)
    assert unbounded.eta_s(4, now) == pytest.approx(360.0)


def test_a_run_stopped_by_its_wall_time_budget_is_finished_in_mlflow_and_a_guard_stop_killed():
    from rlray.launch.driver import _mlflow_status

    assert _mlflow_status("stopped: wall_time") == "FINISHED"
    assert [_mlflow_status(s) for s in ("stopped: kl_guard", "stopped: sigterm", "FAILED", "FINISHED")] == [
        "KILLED", "KILLED", "FAILED", "FINISHED"]
