"""rlray.observe.tracking_store: a sqlite store copied from the migrated template equals one MLflow creates."""

import sqlite3

import pytest
from mlflow.tracking import MlflowClient

from rlray.cache import cache_dir
from rlray.observe import tracking_store
from rlray.observe.tracking_store import ensure_store, start_ensure_store, store_template


def _schema(db) -> tuple[list, list]:
    """Returns (each table's and index's type, name and sorted definition lines; the alembic version). Sorted:
    MLflow's migrations write a table's constraints in a different order from one run to the next."""
    with sqlite3.connect(db) as con:
        tables = [(kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                  for kind, name, sql in con.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name")]
        version = con.execute("SELECT version_num FROM alembic_version").fetchall()
    con.close()
    return tables, version


def test_a_copied_store_equals_one_mlflow_creates(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # MLflow's Default experiment location depends on the working folder
    ours, theirs = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    theirs.parent.mkdir()
    MlflowClient(tracking_uri=f"sqlite:///{theirs}").search_experiments(max_results=1)  # MLflow's migrations
    ensure_store(f"sqlite:///{ours}")
    assert store_template().exists()  # made by the first store, kept for the next, in the cache folder
    assert store_template().parent == cache_dir() / "mlflow" == tmp_path / "cache" / "mlflow"
    assert _schema(ours) == _schema(theirs)
    default = [MlflowClient(tracking_uri=f"sqlite:///{db}").get_experiment("0") for db in (ours, theirs)]
    assert default[0].artifact_location == default[1].artifact_location == str(tmp_path / "mlruns" / "0")
    assert default[0].name == default[1].name == "Default"
    assert abs(default[0].creation_time - default[1].creation_time) < 60_000  # now, not the template's time
    client = MlflowClient(tracking_uri=f"sqlite:///{ours}")  # a working store: a run logs and reads back
    run = client.create_run(client.create_experiment("e"))
    client.log_metric(run.info.run_id, "loss", 0.25, step=3)
    assert [(m.value, m.step) for m in client.get_metric_history(run.info.run_id, "loss")] == [(0.25, 3)]


def test_an_unusable_cache_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("RLRAY_CACHE", str(blocker))  # cache_dir() cannot create it: OSError
    monkeypatch.setattr(tracking_store, "_READY_STORES", set())
    ensure_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment("0").name == "Default"
    assert _schema(tmp_path / "mlflow.db")[1]  # MLflow migrated it to its head


def test_the_store_made_in_the_background_is_the_one_ensure_store_makes(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tracking_store, "_READY_STORES", set())
    uri, reference = f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}", tmp_path / "b" / "mlflow.db"
    thread = start_ensure_store(uri)
    thread.join(timeout=120)
    assert not thread.is_alive() and thread.daemon and thread.name == "rlray-mlflow-store"
    assert uri in tracking_store._READY_STORES  # the driver's Tracker then skips the check
    ensure_store(f"sqlite:///{reference}")
    assert _schema(tmp_path / "a" / "mlflow.db") == _schema(reference)


def test_a_background_failure_is_raised_by_the_next_ensure_store(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking_store, "_READY_STORES", set())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    uri = f"sqlite:///{blocker / 'mlflow.db'}"  # its folder is a file: the store cannot be made
    thread = start_ensure_store(uri)
    thread.join(timeout=120)
    assert not thread.is_alive() and uri not in tracking_store._READY_STORES  # nothing raised on that thread
    with pytest.raises(OSError):
        ensure_store(uri)  # the caller's own call raises it, on its thread
