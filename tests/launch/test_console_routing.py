"""The console's first lines are rlray's: a library that sets its logger up after ``configure_console`` (MLflow does
when the driver imports it: its own stderr handler, no propagation) is routed through the root logger again by
``route_library_logs``, so its lines reach driver.log and not the console. The real ``rlray train`` console is checked
by tests/observe/test_held_run.py (every line of a held tiny run's console is rlray's)."""

from __future__ import annotations

import io
import logging

import pytest

from rlray.launch import console


@pytest.fixture
def root_logging():
    """Restores the root logger's handlers and level, warnings capture and the libraries' loggers after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    libraries = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).propagate)
                 for n in console.SELF_PRINTING_LOGGERS}
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
        if h not in handlers:
            h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)
    for name, (own, propagate) in libraries.items():
        logging.getLogger(name).handlers, logging.getLogger(name).propagate = own, propagate


def test_a_library_set_up_after_the_console_goes_to_driver_log_not_the_console(root_logging, tmp_path):
    out, library_stream = io.StringIO(), io.StringIO()
    console.configure_console(verbose=False, stream=out)
    for name in ("mlflow", "alembic"):  # what `import mlflow` does (mlflow.utils.logging_utils), after the console
        logger = logging.getLogger(name)
        handler = logging.StreamHandler(library_stream)
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logging.INFO)
    console.route_library_logs()
    logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
    logging.getLogger("alembic.runtime.migration").warning("Running upgrade")
    logging.getLogger("rlray.launch.driver").warning("an rlray warning")
    handler = console.keep_logs(tmp_path)
    console.release_logs(handler)
    assert library_stream.getvalue() == ""
    assert out.getvalue() == "rlray: WARNING rlray.launch.driver: an rlray warning\n"
    kept = (tmp_path / console.DRIVER_LOG).read_text()
    assert "INFO mlflow.store.db.utils: Creating initial MLflow database tables..." in kept
    assert "WARNING alembic.runtime.migration: Running upgrade" in kept


def test_routing_keeps_a_librarys_file_handler(root_logging, tmp_path):
    logger = logging.getLogger("ray")
    own_file = logging.FileHandler(tmp_path / "ray.log")
    logger.handlers = [logging.StreamHandler(io.StringIO()), own_file]
    console.route_library_logs()
    assert logger.handlers == [own_file] and logger.propagate
    own_file.close()
