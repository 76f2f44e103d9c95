"""A sqlite store keeps its runs' artifacts beside its file (``<folder>/mlartifacts/<experiment>``), not in ``./mlruns``
of the folder a command ran in (MLflow's default for a sqlite store)."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from rlray.observe.tracking import Tracker, artifact_location, read_artifact_text


def test_a_runs_artifacts_sit_beside_the_sqlite_file_whatever_the_working_folder(tmp_path, monkeypatch):
    elsewhere, store = tmp_path / "elsewhere", tmp_path / "store"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    tracker = Tracker(uri, "grpo gsm8k/1")
    tracker.log_text("hello\n", "notes/a.txt")
    assert tracker.flush()
    written = store / "mlartifacts" / "grpo_gsm8k_1" / tracker.run_id / "artifacts" / "notes" / "a.txt"
    assert written.read_text() == "hello\n"
    assert read_artifact_text(uri, tracker.run_id, "notes/a.txt") == "hello\n"
    assert MlflowClient(uri).get_experiment(tracker.experiment_id).artifact_location == written.parents[3].as_uri()
    assert sorted(p.name for p in elsewhere.iterdir()) == []  # no ./mlruns here
    tracker.finish()


def test_artifact_location_only_for_a_sqlite_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert artifact_location("sqlite:///runs/mlflow.db", "smoke") == (tmp_path / "runs" / "mlartifacts" / "smoke").as_uri()
    assert artifact_location("sqlite:////abs/mlflow.db?timeout=5", "a:b") == Path("/abs/mlartifacts/a_b").as_uri()
    assert artifact_location("sqlite:///:memory:", "smoke") is None
    assert artifact_location("http://mlflow:5000", "smoke") is None
