"""rlray's cache folder (converted models, MLflow store templates), in a module that imports nothing heavy."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Returns rlray's cache folder, creating it on demand.

    The folder is ``$RLRAY_CACHE`` when that is set, else ``~/.cache/rlray``. Converted models live in its
    ``models/`` subfolder (``rlray.models``), MLflow store templates in ``mlflow/`` (``rlray.observe.tracking_store``).

    Raises:
        OSError: the folder cannot be created.
    """
    root = Path(os.environ.get("RLRAY_CACHE") or Path.home() / ".cache" / "rlray").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root
