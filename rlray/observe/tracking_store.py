"""The sqlite MLflow store: created once per file, under a file lock, from a migrated template.

MLflow creates a sqlite store at first use by running its alembic migrations: 1.1 s of CPU on a quiet 2-core
machine, 4-5 s on a loaded one, paid by every run, test and benchmark on a fresh folder. ``ensure_store`` copies
a store that MLflow created once per MLflow version (``<rlray cache>/mlflow/store-<mlflow version>.db``) and
sets its Default experiment (id 0) to the artifact location MLflow would have given it in this process, so the
copy equals a store MLflow made here (tested against one). When the template cannot be made or copied (a
read-only cache, a disk error), MLflow creates the store as before. Issue 39 (start-up).

Concurrent processes: the first one to take ``<db file>.lock`` creates the store, and the others, waiting on
the lock, find it made (MLflow's migrations run twice at once on a fresh file fail with "duplicate column
name"). The template is made under its own lock and renamed into place when complete.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

from filelock import FileLock

from rlray.cache import cache_dir

log = logging.getLogger(__name__)

STORE_LOCK_TIMEOUT_S = 600.0
_READY_STORES: set[str] = set()  # sqlite URIs this process has created or checked


def default_experiment_location() -> str:
    """Returns the artifact location MLflow gives the Default experiment (id 0) of a sqlite store it creates from
    this process: ``./mlruns/0`` made absolute against the working folder. Source: mlflow ``SqlAlchemyStore``
    (``artifact_root_uri``, ``_get_artifact_location``), with ``MlflowClient``'s default artifact root."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    return append_to_uri_path(resolve_uri_if_local(DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH), "0")


def _open(uri: str) -> None:
    """Opens the store at ``uri`` once: MLflow creates its tables or checks their schema."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def store_template() -> Path:
    """Returns the path of a sqlite store that MLflow created and migrated with this MLflow version, making it
    first when missing (under a file lock; written to a temporary file and renamed into place).

    Raises:
        OSError, sqlite3.Error, mlflow.exceptions.MlflowException: the template cannot be made.
        filelock.Timeout: another process held the template's lock for ``STORE_LOCK_TIMEOUT_S`` seconds.
    """
    import mlflow

    folder = cache_dir() / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    template = folder / f"store-{mlflow.__version__}.db"
    with FileLock(f"{template}.lock", timeout=STORE_LOCK_TIMEOUT_S):
        if not template.exists():
            tmp = folder / f".store-{os.getpid()}.db"
            tmp.unlink(missing_ok=True)
            _open(f"sqlite:///{tmp}")
            os.replace(tmp, template)
    return template


def _copy_template(path: Path) -> bool:
    """Writes a store at ``path`` from the template, its Default experiment's location and times set as MLflow
    would set them here; returns False (nothing written) when the template cannot be used."""
    from mlflow.exceptions import MlflowException

    try:
        template = store_template()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        shutil.copyfile(template, tmp)
        with sqlite3.connect(tmp) as db:
            now_ms = int(time.time() * 1000)
            db.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                       "WHERE experiment_id = 0", (default_experiment_location(), now_ms, now_ms))
        db.close()
        os.replace(tmp, path)
        return True
    except (OSError, sqlite3.Error, MlflowException) as err:
        log.debug("MLflow store template not used for %s (%s); MLflow creates the store", path, err)
        return False


STORE_MODULES = ("rlray.observe.tracking", "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.db.utils")
"""The modules the driver imports beside Ray's start: MLflow itself (through ``rlray.observe.tracking``, the only mlflow
importer) and MLflow's SQL store (SQLAlchemy, alembic), most of what making or opening a sqlite store costs. This
module imports mlflow only inside its functions."""


def start_store_imports() -> threading.Thread:
    """Starts importing ``STORE_MODULES`` in a daemon thread and returns the thread; creates no file.

    The driver imports them while Ray starts (issue 39: MLflow's import is ~0.5-0.7 s of CPU and a fresh sqlite store
    ~0.69 s more, 0.65 s of it these imports, and ``ray.init`` mostly waits on Ray's processes); the store itself is
    made afterwards, once the run's resources fit the cluster. An import that fails is left to the store's own use,
    which raises it.
    """

    def run() -> None:
        for name in STORE_MODULES:
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - raised again where the store is used
                log.debug("MLflow store module %s not imported in the background (%s)", name, err)

    thread = threading.Thread(target=run, name="rlray-mlflow-imports", daemon=True)
    thread.start()
    return thread


def resolve_tracking_uri(uri: str, base: Path | None = None) -> str:
    """Returns ``uri`` with a relative sqlite path made absolute against ``base`` (default: cwd).

    Ray workers and jobs may run in another folder than the user's shell; resolving once on the
    driver keeps every process on the same store. The sqlite file's folder is created; the store itself
    is created at first use (``ensure_store``).
    """
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = (base or Path.cwd()) / uri[len(prefix) :]
        path.parent.mkdir(parents=True, exist_ok=True)
        uri = prefix + str(path.resolve())
    elif uri.startswith(prefix):
        Path(uri[len(prefix) - 1 :]).parent.mkdir(parents=True, exist_ok=True)
    return uri


def ensure_store(uri: str) -> None:
    """Creates the MLflow store at a sqlite ``uri`` once, under a file lock (the module docstring says how).

    Other URIs (a tracking server, in-memory sqlite) are left alone, and each URI is checked once per process. A
    store at an older schema is not upgraded here: MLflow's error asks to back it up and run
    ``mlflow db upgrade <uri>``.

    Args:
        uri: MLflow tracking URI; a relative sqlite path is taken against the working folder.

    Raises:
        filelock.Timeout: another process held the lock for ``STORE_LOCK_TIMEOUT_S`` seconds.
        mlflow.exceptions.MlflowException: the store cannot be created, or its schema is out of date.
    """
    prefix = "sqlite:///"
    db = uri[len(prefix) :].split("?", 1)[0]
    if not uri.startswith(prefix) or db in ("", ":memory:") or uri in _READY_STORES:
        return
    path = Path(db)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock", timeout=STORE_LOCK_TIMEOUT_S):
        if not path.exists() or path.stat().st_size == 0:
            _copy_template(path)
        _open(uri)  # a copied store: a schema check (~50 ms); else MLflow creates it
    _READY_STORES.add(uri)
