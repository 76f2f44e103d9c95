"""MLflow down: a real outage of the sqlite store (its file moved away and a folder put in its place) while a
Tracker logs; metrics, tags and artifacts are buffered with a warning and written when the store returns; at
the end of a run what cannot be written is saved to a file, never dropped; invalid writes still raise."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from rlray.observe.tracking import StoreUnavailableError, Tracker, get_run_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from outages import store_down  # noqa: E402


def test_metrics_tags_and_artifacts_are_buffered_while_the_store_is_down(tmp_path, caplog):
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    tracker = Tracker(uri, "outage")
    tracker.log_metrics({"reward/mean": 0.1}, step=1)
    with caplog.at_level(logging.WARNING, logger="rlray.observe.tracking"), store_down(db):
        tracker.log_metrics({"reward/mean": 0.2, "learner/loss": 1.5}, step=2)
        tracker.set_tags({"rlray.status": "RUNNING"})
        tracker.log_text("a: 1\n", "config/rollback_1.yaml")
        tracker.log_metrics({"reward/mean": 0.3}, step=3)
        tracker.set_tags({"rlray.status": "RUNNING again"})
        assert tracker.pending == 5  # 3 metrics, 1 tag (the last value wins), 1 artifact
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable" in w and "buffering metrics, tags and artifacts" in w for w in warnings) == 1
    tracker.log_metrics({"reward/mean": 0.4}, step=4)  # the store is back: everything is written, in order
    assert tracker.pending == 0
    assert tracker.take_outages() == 1 and tracker.take_outages() == 0  # one outage (monitor/mlflow_outages), counted once
    assert any("is back after" in r.getMessage() for r in caplog.records)
    metrics = get_run_metrics(uri, tracker.run_id)
    assert metrics["reward/mean"] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)] and metrics["learner/loss"] == [(2, 1.5)]
    client = MlflowClient(uri)
    assert client.get_run(tracker.run_id).data.tags["rlray.status"] == "RUNNING again"
    assert client.download_artifacts(tracker.run_id, "config/rollback_1.yaml", str(tmp_path)).endswith("rollback_1.yaml")


def test_what_cannot_be_written_at_the_end_is_saved_to_a_file(tmp_path):
    db = tmp_path / "mlflow.db"
    tracker = Tracker(f"sqlite:///{db}", "outage")
    spill = tmp_path / "logs" / "unsent.jsonl"
    with store_down(db):
        tracker.log_metrics({"reward/mean": 0.5}, step=7)
        tracker.set_tags({"rlray.status": "FINISHED"})
        with pytest.raises(StoreUnavailableError, match=rf"stayed unreachable for 0.5 s .* 2 unsent metrics/tags/artifacts were saved to {spill}"):
            tracker.close(wait_s=0.5, spill_path=spill)
    records = [json.loads(line) for line in spill.read_text().splitlines()]
    assert records[0]["kind"] == "metric" and (records[0]["key"], records[0]["value"], records[0]["step"]) == ("reward/mean", 0.5, 7)
    assert records[1] == {"kind": "tag", "key": "rlray.status", "value": "FINISHED"}
    assert tracker.pending == 0


def test_an_invalid_write_is_raised_not_buffered(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "invalid")
    MlflowClient(uri).delete_run(tracker.run_id)
    with pytest.raises(MlflowException, match="must be in the 'active' state"):
        tracker.log_metrics({"reward/mean": 1.0}, step=1)


class _SharedClient:
    """A stand-in MlflowClient that records logged metrics; writes fail while ``down``; a metric named ``slow`` holds
    its first write open until ``release`` is set (a write in flight when the store goes away)."""

    def __init__(self) -> None:
        self.logged: list[tuple[str, int]] = []
        self.down = False
        self.in_flight, self.release = threading.Event(), threading.Event()

    def get_experiment_by_name(self, name):
        return SimpleNamespace(experiment_id="0")

    def create_run(self, experiment_id, run_name=None):
        return SimpleNamespace(info=SimpleNamespace(run_id="r"))

    def log_batch(self, run_id, metrics=(), tags=()):
        batch = list(metrics)
        if any(m.key == "slow" for m in batch) and not self.in_flight.is_set():
            self.in_flight.set()
            self.release.wait(10)
        elif self.down:
            raise ConnectionError("store down")
        time.sleep(0)  # let the other thread in between the write and the buffer's update
        self.logged.extend((m.key, m.step) for m in batch)


def test_the_heartbeat_thread_and_the_step_loop_log_each_metric_once():
    client = _SharedClient()
    tracker = Tracker("sqlite:///unused", "threads", client=client)

    def log(key: str) -> None:
        for step in range(300):
            tracker.log_metrics({key: float(step)}, step=step)

    threads = [threading.Thread(target=log, args=(key,)) for key in ("learner/loss", "monitor/heartbeat_s")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in ("learner/loss", "monitor/heartbeat_s"):  # none written twice, none dropped
        assert sorted(s for k, s in client.logged if k == key) == list(range(300))


def test_a_write_in_flight_when_the_store_goes_away_does_not_split_one_outage_in_two():
    client = _SharedClient()
    tracker = Tracker("sqlite:///unused", "threads", client=client)
    heartbeat = threading.Thread(target=tracker.log_metrics, args=({"slow": 1.0}, 1))
    heartbeat.start()
    assert client.in_flight.wait(10)
    client.down = True
    threading.Timer(0.2, client.release.set).start()  # the heartbeat's write succeeds after the store went away
    tracker.log_metrics({"learner/loss": 1.0}, step=2)  # fails: the outage begins
    heartbeat.join()
    tracker.log_metrics({"learner/loss": 2.0}, step=3)  # still down: the same outage
    client.down = False
    tracker.log_metrics({"learner/loss": 3.0}, step=4)
    assert tracker.take_outages() == 1 and tracker.pending == 0
    assert [s for k, s in client.logged if k == "learner/loss"] == [2, 3, 4]
