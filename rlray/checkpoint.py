"""Snapshots: the policy as safetensors plus optimizer state, with a manifest written last.

A snapshot folder holds ``model/`` (Hugging Face ``save_pretrained`` output, safetensors, with the
tokenizer), ``trainer_state.pt`` (optimizer and scheduler, read back with
``torch.load(weights_only=True)``), and ``manifest.json``. The manifest is written after every other
file, so a folder without one is incomplete and never used.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

MANIFEST = "manifest.json"


class SnapshotError(RuntimeError):
    """A snapshot that cannot be written or read; the message names the path."""


def write_snapshot(uri: str, learner: Any, tokenizer: Any, state: dict[str, Any]) -> str:
    """Writes a snapshot to ``uri`` (local path or fsspec URI) and returns ``uri``.

    The payload is written first into a local temporary folder, copied to ``uri``, and the manifest
    (with ``state``: step, policy version, ...) is written last.

    Raises:
        SnapshotError: any write failure, naming the destination.
    """
    fs, root = fsspec.core.url_to_fs(uri)
    try:
        with tempfile.TemporaryDirectory(prefix="rlray-snap-") as tmp:
            tmp_path = Path(tmp)
            learner.module.save_pretrained(tmp_path / "model", safe_serialization=True)
            tokenizer.save_pretrained(tmp_path / "model")
            torch.save(learner.state_dict(), tmp_path / "trainer_state.pt")
            if fs.exists(root):
                fs.rm(root, recursive=True)
            fs.makedirs(root, exist_ok=True)
            fs.put(str(tmp_path) + "/", root, recursive=True)
        manifest = {"format": 1, "written_at": time.time(), **state}
        with fs.open(f"{root}/{MANIFEST}", "w") as f:
            json.dump(manifest, f, indent=2)
    except OSError as err:
        raise SnapshotError(f"could not write snapshot to '{uri}': {err}") from err
    return uri


def read_manifest(uri: str) -> dict[str, Any]:
    """Returns the manifest of the snapshot at ``uri``.

    Raises:
        SnapshotError: no manifest (an incomplete snapshot) or unreadable JSON.
    """
    fs, root = fsspec.core.url_to_fs(uri)
    path = f"{root}/{MANIFEST}"
    if not fs.exists(path):
        raise SnapshotError(f"'{uri}' is not a complete snapshot: {MANIFEST} is missing")
    try:
        with fs.open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise SnapshotError(f"could not read '{path}': {err}") from err


def local_model_dir(uri: str, cache: str | None = None) -> str:
    """Returns a local folder holding the snapshot's ``model/`` (downloaded when ``uri`` is remote).

    Raises:
        SnapshotError: the snapshot is incomplete.
    """
    read_manifest(uri)
    fs, root = fsspec.core.url_to_fs(uri)
    if fs.protocol in ("file", ("file", "local")) or "file" in fs.protocol:
        return str(Path(root) / "model")
    dest = Path(cache or tempfile.mkdtemp(prefix="rlray-model-")) / "model"
    if dest.exists():
        shutil.rmtree(dest)
    fs.get(f"{root}/model/", str(dest), recursive=True)
    return str(dest)


def save_final(output_dir: str, learner: Any, tokenizer: Any, *, step: int, policy_version: int) -> str:
    """Writes the end-of-run snapshot to ``<output_dir>/final`` and returns its URI."""
    uri = f"{output_dir.rstrip('/')}/final"
    return write_snapshot(uri, learner, tokenizer, {"step": step, "policy_version": policy_version, "kind": "final"})
