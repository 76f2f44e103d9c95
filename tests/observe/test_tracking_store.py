"""rlray.observe.tracking_store: a sqlite store copied from the migrated template equals one MLflow creates."""

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from rlray.cache import cache_dir
from rlray.observe import tracking_store
from rlray.observe.tracking_store import ensure_store, store_template

REPO = Path(__file__).resolve().parents[2]


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


def test_the_store_modules_are_imported_in_the_background_and_no_file_is_made(tmp_path):
    """The driver imports MLflow, rlray's tracking and MLflow's SQL store while Ray starts; importing this module
    imports no mlflow, and nothing is written (a run that does not fit the cluster leaves no store behind)."""
    code = ("import os, sys\n"
            "from rlray.observe import tracking_store\n"
            "names = ('mlflow', *tracking_store.STORE_MODULES)\n"
            "before = [m in sys.modules for m in names]\n"
            "thread = tracking_store.start_store_imports()\n"
            "thread.join(timeout=120)\n"
            "print(before, [m in sys.modules for m in names], thread.daemon, thread.is_alive(),"
            " os.listdir('.'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO), "RLRAY_CACHE": str(tmp_path / "cache")})
    assert out.stdout.strip() == "[False, False, False, False] [True, True, True, True] True False []"
