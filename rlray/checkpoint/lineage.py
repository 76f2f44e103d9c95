"""Lineage: every snapshot is a version of the registered model ``rlray-<experiment>`` in MLflow.

A version's tags record where it came from: ``rlray.parent_version`` (the version the training
continued from, across resumes and rollbacks), ``rlray.step``, ``rlray.config_hash``,
``rlray.dataset_hash``, ``rlray.git_commit``, ``rlray.run_id``, ``rlray.snapshot_uri`` and
``metric.<key>`` for the step's metrics. Following parents from any version reaches the run's first
snapshot. ``find_snapshot`` turns a run (or a storage URI) and a step or version into a snapshot, and
``write_rollback`` writes the config that resumes from it (``rlray rollback``; the CLI builds that config from the
snapshot's own with ``rlray.config.resume_tree``).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.manifest import SnapshotManifest
from rlray.observe import tracking

HEADLINE_METRICS = ("reward/mean", "algo/kl", "learner/loss", "eval/reward_mean")


def model_name(experiment: str) -> str:
    """Returns the registered model name of an experiment: ``rlray-<experiment>`` (unsafe characters -> '-')."""
    return "rlray-" + re.sub(r"[^0-9A-Za-z_.-]", "-", experiment)


def git_commit(path: str | Path | None = None) -> str:
    """Returns the git commit of the code (the checkout holding rlray), or 'unknown' outside git."""
    here = Path(path or Path(__file__).resolve().parent)
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def version_tags(manifest: SnapshotManifest, uri: str, metrics: dict[str, float]) -> dict[str, str]:
    """Returns the lineage tags of the snapshot at ``uri`` from its manifest and the step's metrics."""
    tags = {
        "rlray.parent_version": manifest.parent_version or "",
        "rlray.step": str(manifest.step),
        "rlray.epoch": str(manifest.epoch),
        "rlray.policy_version": str(manifest.policy_version),
        "rlray.config_hash": manifest.config_hash,
        "rlray.dataset_hash": manifest.dataset_hash,
        "rlray.git_commit": manifest.git_commit,
        "rlray.run_id": manifest.run_id,
        "rlray.snapshot_uri": uri,
        "rlray.kind": manifest.kind,
    }
    tags.update({f"metric.{k}": f"{metrics[k]:.6g}" for k in HEADLINE_METRICS if k in metrics})
    return tags


def register(tracker: tracking.Tracker, experiment: str, uri: str, manifest: SnapshotManifest, metrics: dict[str, float]) -> str:
    """Registers the snapshot at ``uri`` as a new version of ``rlray-<experiment>``; returns the version."""
    return tracker.register_model_version(model_name(experiment), uri, version_tags(manifest, uri, metrics))


def version_of(tracking_uri: str, experiment: str, snapshot_uri: str) -> str | None:
    """Returns the registered version of the snapshot at ``snapshot_uri``, or None when it has none."""
    found = tracking.model_versions(tracking_uri, model_name(experiment), tag=("rlray.snapshot_uri", snapshot_uri))
    return found[-1]["version"] if found else None


def chain(tracking_uri: str, experiment: str, version: str) -> list[dict]:
    """Returns the versions from ``version`` back through its parents to the first snapshot (newest first).

    Raises:
        ValueError: a parent cycle (a corrupted registry).
    """
    name = model_name(experiment)
    out, seen = [], set()
    current: str | None = version
    while current:
        if current in seen:
            raise ValueError(f"model '{name}': parent cycle at version {current}")
        seen.add(current)
        v = tracking.model_version(tracking_uri, name, current)
        out.append(v)
        current = v["tags"].get("rlray.parent_version") or None
    return out


def run_versions(tracking_uri: str, experiment: str, run_id: str) -> list[dict]:
    """Returns the versions registered by one run, oldest first."""
    return tracking.model_versions(tracking_uri, model_name(experiment), run_id=run_id)


def all_versions(tracking_uri: str, experiment: str) -> list[dict]:
    """Returns every version of ``rlray-<experiment>``, oldest first."""
    return tracking.model_versions(tracking_uri, model_name(experiment))


def format_versions(versions: list[dict]) -> str:
    """Returns a text table of versions: version, parent, step, run, kind, headline metrics, snapshot."""
    lines = [f"{'version':>7}  {'parent':>6}  {'step':>6}  {'run':<12}  {'kind':<8}  {'reward/mean':>11}  snapshot"]
    for v in versions:
        t = v["tags"]
        lines.append(
            f"{v['version']:>7}  {t.get('rlray.parent_version') or '-':>6}  {t.get('rlray.step', '?'):>6}  "
            f"{(v['run_id'] or '')[:12]:<12}  {t.get('rlray.kind', ''):<8}  {t.get('metric.reward/mean', '-'):>11}  {v['source']}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Rollback
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Registry:
    """Where a run's snapshots and their registered versions are found (``rlray rollback``).

    Attributes:
        tracking_uri: the MLflow store (``tracking.mlflow_uri``).
        experiment: the experiment, whose registered model is ``rlray-<experiment>`` (``tracking.experiment``).
        storage_options: fsspec options of the snapshot storage (``checkpoint.s3``'s); None: the defaults.
    """

    tracking_uri: str
    experiment: str
    storage_options: dict[str, Any] | None = None


def find_snapshot(ref: str, to: str, where: Registry) -> str:
    """Returns the snapshot URI for ``rlray rollback REF --to TO``.

    Args:
        ref: an MLflow run id (its snapshots are found through the tag ``rlray.snapshot_dir``), a run
            folder URI, or a storage root URI.
        to: a step ('12') or a registered version ('v3').
        where: the MLflow store, the experiment and the storage options.

    Raises:
        rlray.checkpoint.storage.SnapshotError: no complete snapshot matches.
    """
    opts = where.storage_options
    if not (to.isdigit() or (to[:1].lower() == "v" and to[1:].isdigit())):
        raise checkpoint.SnapshotError(f"--to {to!r}: give a step (12) or a registered model version (v3)")
    if to.lower().startswith("v"):
        v = tracking.model_version(where.tracking_uri, model_name(where.experiment), to[1:])
        checkpoint.read_manifest(v["source"], opts)
        return v["source"]
    base = ref if ("/" in ref or "://" in ref) else tracking.get_run(where.tracking_uri, ref).data.tags.get("rlray.snapshot_dir")
    if not base:
        raise checkpoint.SnapshotError(f"run '{ref}' has no rlray.snapshot_dir tag (was it started by rlray train?)")
    hits = [s for s in checkpoint.list_snapshots(base, opts) if s.step == int(to) and s.complete]
    if not hits:
        raise checkpoint.SnapshotError(f"no complete snapshot at step {to} under '{base}'")
    return max(hits, key=lambda s: s.manifest.written_at).uri


def write_rollback(snapshot_uri: str, tree: dict[str, Any], dest: Path,
                   storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Writes ``dest/config.yaml`` from ``tree``, so ``rlray train dest/config.yaml`` resumes from the snapshot at
    ``snapshot_uri`` (``rlray rollback``).

    Args:
        snapshot_uri: the snapshot the run resumes from (``find_snapshot``).
        tree: the config to write, plain data, validated and resuming from the snapshot
            (``rlray.config.resume_tree``).
        dest: folder for config.yaml (made when missing).
        storage_options: fsspec options of the snapshot storage; None: the defaults.

    Returns:
        {snapshot, step, policy_version, config, command}.

    Raises:
        rlray.checkpoint.storage.SnapshotError: the snapshot's manifest cannot be read.
    """
    manifest = checkpoint.read_manifest(snapshot_uri, storage_options)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return {
        "snapshot": snapshot_uri,
        "step": manifest.step,
        "policy_version": manifest.policy_version,
        "config": str(dest / "config.yaml"),
        "command": f"rlray train {dest / 'config.yaml'}",
    }
