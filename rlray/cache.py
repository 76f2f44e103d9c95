"""rlray's cache folder (converted models, MLflow store templates, prompt token ids), in a module that imports nothing heavy."""

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


def prompt_cache_dir() -> Path:
    """Returns the folder of the prompt token cache (``rlray.data.prompt_cache``): ``prompts/`` in rlray's cache folder
    (``$RLRAY_CACHE``, else ``~/.cache/rlray``); the preflight writes it and learner rank 0 reads it.

    Raises:
        OSError: the cache folder cannot be created.
    """
    return cache_dir() / "prompts"
