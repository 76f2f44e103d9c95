"""Tracker.finish_unless_ended: a run that someone else ended (a sweep closing a stopped trial's run) keeps
its status when the dying run process ends it afterwards; a running run is ended as asked."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from rlray.observe.tracking import Tracker, get_run_metrics


def test_a_run_ended_by_someone_else_keeps_its_status(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = Tracker(uri, "sweep")
    closer = Tracker(uri, "sweep", run_id=run.run_id)  # TrialRunCloser's view of the same run
    closer.set_tags({"rlray.stop_reason": "stopped early by the Tune scheduler"})
    closer.finish("KILLED")
    run.log_metrics({"reward/mean": 0.25}, step=1)  # still written: the process logs until it dies
    assert run.finish_unless_ended("FAILED", {"rlray.status": "FAILED"}) == "KILLED"
    got = MlflowClient(uri).get_run(run.run_id)
    assert got.info.status == "KILLED"
    assert "rlray.status" not in got.data.tags
    assert got.data.tags["rlray.stop_reason"] == "stopped early by the Tune scheduler"
    assert get_run_metrics(uri, run.run_id)["reward/mean"] == [(1, 0.25)]


def test_a_running_run_is_ended_as_asked(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = Tracker(uri, "plain")
    assert run.finish_unless_ended("FAILED", {"rlray.status": "FAILED"}) == "FAILED"
    got = MlflowClient(uri).get_run(run.run_id)
    assert got.info.status == "FAILED" and got.data.tags["rlray.status"] == "FAILED"
