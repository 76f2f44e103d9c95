"""Snapshot storage: Ray Train checkpoints that carry rlray's manifest, written last.

Layout under the storage root (``checkpoint.uri``, a local folder or ``s3://bucket/prefix``, which is
also Ray Train's ``storage_path``)::

    <root>/run-<mlflow run id>/              one Ray Train run (its experiment folder)
        step_00000004/                       one snapshot (a Ray Train checkpoint folder)
            model/                           Hugging Face save_pretrained output (safetensors, tokenizer)
            trainer_state.pt                 optimizer and scheduler (torch.load(weights_only=True)); a sharded
                                             (FSDP2) learner's schedulers only, and then
            sharded/                         its optimizer state, one torch.distributed.checkpoint file per rank
            rng/rank_<r>.pt                  torch, numpy and python RNG states of each learner rank
            config.yaml                      the config the snapshot was trained with
            manifest.json                    written last: step, epoch, policy version, cursor, files
                                             (rlray.checkpoint.manifest.SnapshotManifest)
        checkpoint_manager_snapshot.json     Ray Train's own bookkeeping
    <root>/logs/run-<id>.log                 the run's log, copied at each snapshot

A snapshot counts only when its manifest exists and every file it lists has the listed size. The
payload is written first; the manifest is written last (on a local disk as a temporary file renamed
into place, on S3 as one object), so a process killed mid-write leaves a folder without a manifest,
which every reader ignores and ``prune`` removes. Rank 0 writes the folder itself and then registers
it with ``ray.train.report(checkpoint_upload_mode=NO_UPLOAD)``: Ray Train's upload would copy the files
in no set order, and a folder that Ray never heard of (a report that was interrupted) is invisible
to Ray's restarts but still follows rlray's rules.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlray.checkpoint.manifest import SnapshotManifest

MANIFEST = "manifest.json"
RUN_PREFIX = "run-"
STEP_PREFIX = "step_"
LOGS_DIR = "logs"
# An incomplete snapshot of another run may still be being written; it is removed once its newest
# file is this old (a snapshot upload that stalls for an hour has failed).
INCOMPLETE_GRACE_S = 3600.0
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)(?:_r\d+)?$")


class SnapshotError(RuntimeError):
    """A snapshot that cannot be written, found or read; the message names the URI and the cause."""


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot folder: its URI, run folder name, step, and manifest (None when incomplete)."""

    uri: str
    run: str
    step: int
    manifest: SnapshotManifest | None

    @property
    def complete(self) -> bool:
        """Returns True when the manifest exists and lists every file with its size."""
        return self.manifest is not None


# --------------------------------------------------------------------------------------------
# Filesystems and names
# --------------------------------------------------------------------------------------------
def open_fs(uri: str, options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Returns (fsspec filesystem, path without protocol) for ``uri``; ``options`` apply to s3:// only."""
    opts = dict(options or {}) if uri.startswith("s3://") else {}
    fs, path = fsspec.core.url_to_fs(uri, **opts)
    return fs, path.rstrip("/") or "/"


def join(uri: str, *names: str) -> str:
    """Returns ``uri`` with ``names`` appended, '/'-separated."""
    return "/".join([uri.rstrip("/"), *names])


def run_dir_name(run_id: str) -> str:
    """Returns the folder name (and Ray Train run name) of the MLflow run ``run_id``."""
    return f"{RUN_PREFIX}{run_id}"


def snapshot_name(step: int, rollbacks: int = 0) -> str:
    """Returns the folder name of the snapshot taken after ``step`` RL steps (zero-padded, sorts by step).

    After a rollback the run passes the same steps again; ``_r<rollbacks>`` keeps those snapshots apart,
    so neither rlray's nor Ray Train's retention can delete a new snapshot by an old one's name.
    """
    return f"{STEP_PREFIX}{step:08d}" + (f"_r{rollbacks}" if rollbacks else "")


def ray_storage(root: str, options: dict[str, Any] | None = None) -> tuple[str, Any]:
    """Returns (storage_path, storage_filesystem) for Ray Train's RunConfig.

    A local root is passed as a path with no filesystem (pyarrow's local one). Any other fsspec URI
    (``s3://`` through s3fs with ``options``) is given as a pyarrow ``PyFileSystem`` over the same
    fsspec filesystem rlray writes with, and a path without the protocol.
    """
    fs, path = open_fs(root, options)
    if isinstance(fs, LocalFileSystem) and "://" not in root:
        return path, None
    import pyarrow.fs  # deferred: ~0.5 s, only for Ray Train; the CLI imports this module for every command

    return path, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


def check_storage(root: str, options: dict[str, Any] | None = None) -> None:
    """Checks that snapshots can be written under ``root``: writes, reads back and deletes a small probe.

    Run before anything starts, so that a missing bucket or bad credentials fail the run at once instead
    of at its first snapshot.

    Raises:
        SnapshotError: the probe could not be written, read or deleted (names ``checkpoint.uri``, the cause
            and where to look: the bucket name or the ``checkpoint.s3.*`` credentials).
    """
    probe = join(root, f".rlray-probe-{time.time_ns()}")
    fs, path = open_fs(probe, options)
    try:
        if "://" not in root:
            Path(root).mkdir(parents=True, exist_ok=True)
        fs.pipe_file(path, b"rlray")
        fs.invalidate_cache(path)
        if fs.cat_file(path) != b"rlray":
            raise OSError("the probe object read back differs from what was written")
        fs.rm(path)
    except Exception as err:  # s3fs maps NoSuchBucket to FileNotFoundError, bad keys to PermissionError
        hint = "check the bucket name and the checkpoint.s3.* credentials" if root.startswith("s3://") else "check the path"
        raise SnapshotError(
            f"checkpoint.uri='{root}': snapshots cannot be written there ({type(err).__name__}: {err}); {hint}"
        ) from None


# --------------------------------------------------------------------------------------------
# Write and read
# --------------------------------------------------------------------------------------------
def clear(uri: str, options: dict[str, Any] | None = None) -> None:
    """Removes whatever is at ``uri`` (an earlier, interrupted attempt at the same snapshot).

    Raises:
        SnapshotError: the storage refused.
    """
    fs, root = open_fs(uri, options)
    try:
        fs.invalidate_cache(root)
        if fs.exists(root):
            fs.rm(root, recursive=True)
    except OSError as err:
        raise SnapshotError(f"could not clear '{uri}' before writing a snapshot: {err}") from err


def put_files(uri: str, local_dir: Path, options: dict[str, Any] | None = None) -> dict[str, int]:
    """Copies every file under ``local_dir`` to ``uri`` (sorted by path); returns {relative path: bytes}.

    Raises:
        SnapshotError: any write failure (a full disk, a refused upload), naming the file.
    """
    fs, root = open_fs(uri, options)
    sizes: dict[str, int] = {}
    for local in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
        rel = local.relative_to(local_dir).as_posix()
        dest = f"{root}/{rel}"
        try:
            fs.makedirs(fs._parent(dest), exist_ok=True)
            fs.put_file(str(local), dest)
        except OSError as err:
            raise SnapshotError(f"could not write '{join(uri, rel)}': {err}") from err
        sizes[rel] = local.stat().st_size
    return sizes


def put_file(local: Path, uri: str, options: dict[str, Any] | None = None) -> int:
    """Copies one local file to ``uri`` (replacing it); returns its size in bytes.

    Raises:
        SnapshotError: the write failed.
    """
    fs, dest = open_fs(uri, options)
    try:
        fs.makedirs(fs._parent(dest), exist_ok=True)
        fs.put_file(str(local), dest)
    except OSError as err:
        raise SnapshotError(f"could not write '{uri}': {err}") from err
    return Path(local).stat().st_size


def write_manifest(uri: str, manifest: SnapshotManifest, files: dict[str, int],
                   options: dict[str, Any] | None = None) -> SnapshotManifest:
    """Writes ``manifest.json`` as the snapshot's last file; returns the manifest as written.

    The manifest written is ``manifest`` with ``files`` (sorted by path) and ``written_at`` (now) set.

    On a local disk the manifest is written to a temporary name and renamed (atomic on POSIX); on an
    object store it is one PUT, which is atomic.

    Raises:
        SnapshotError: the write failed.
    """
    fs, root = open_fs(uri, options)
    full = replace(manifest, files=dict(sorted(files.items())), written_at=time.time())
    blob = full.to_json().encode()
    try:
        if isinstance(fs, LocalFileSystem):
            tmp = f"{root}/.{MANIFEST}.tmp"
            fs.pipe_file(tmp, blob)
            fs.mv(tmp, f"{root}/{MANIFEST}")
        else:
            fs.pipe_file(f"{root}/{MANIFEST}", blob)
    except OSError as err:
        raise SnapshotError(f"could not write the manifest of '{uri}': {err}") from err
    return full


def write_snapshot(uri: str, payload_dir: Path, manifest: SnapshotManifest, options: dict[str, Any] | None = None) -> SnapshotManifest:
    """Writes a whole snapshot from one process: clears ``uri``, copies the payload, writes the manifest last.

    Returns:
        The manifest as written.

    Raises:
        SnapshotError: any write failure; the folder is then left without a manifest (incomplete).
    """
    clear(uri, options)
    files = put_files(uri, payload_dir, options)
    return write_manifest(uri, manifest, files, options)


def file_sizes(uri: str, options: dict[str, Any] | None = None) -> dict[str, int]:
    """Returns {relative path: bytes} of every file under ``uri`` except the manifest."""
    fs, root = open_fs(uri, options)
    fs.invalidate_cache(root)
    found = fs.find(root, detail=True) if fs.exists(root) else {}
    out = {}
    for path, info in found.items():
        rel = path[len(root) :].lstrip("/")
        if rel and rel != MANIFEST and not rel.endswith(".tmp"):
            out[rel] = int(info["size"])
    return out


def read_manifest(uri: str, options: dict[str, Any] | None = None, *, verify: bool = True) -> SnapshotManifest:
    """Returns the manifest of the complete snapshot at ``uri`` (any layout ``SnapshotManifest.from_json`` reads).

    Args:
        uri: the snapshot folder.
        options: s3fs options (``checkpoint.s3``).
        verify: also check that every file the manifest lists exists with its size.

    Raises:
        SnapshotError: no manifest (an incomplete snapshot), unreadable JSON or a key missing or of the wrong
            type (the message names it), or a listed file missing or of another size.
    """
    fs, root = open_fs(uri, options)
    path = f"{root}/{MANIFEST}"
    fs.invalidate_cache(root)
    if not fs.exists(path):
        raise SnapshotError(f"'{uri}' is not a complete snapshot: {MANIFEST} is missing")
    try:
        manifest = SnapshotManifest.from_json(fs.cat_file(path))
    except (OSError, ValueError) as err:
        raise SnapshotError(f"could not read '{join(uri, MANIFEST)}': {err}") from err
    if verify:
        have = file_sizes(uri, options)
        for rel, size in manifest.files.items():
            if have.get(rel) != size:
                raise SnapshotError(f"snapshot '{uri}' is damaged: '{rel}' has {have.get(rel)} bytes, manifest says {size}")
    return manifest


def fetch_local(uri: str, dest: Path | None = None, options: dict[str, Any] | None = None) -> Path:
    """Returns a local folder with the snapshot's files (the folder itself when it is already local).

    Raises:
        SnapshotError: the snapshot is incomplete or damaged.
    """
    read_manifest(uri, options)
    fs, root = open_fs(uri, options)
    if isinstance(fs, LocalFileSystem) and "://" not in uri:
        return Path(root)
    dest = Path(dest or tempfile.mkdtemp(prefix="rlray-snap-"))
    if dest.exists():
        shutil.rmtree(dest)
    fs.get(f"{root}/", str(dest), recursive=True)
    return dest


def local_model_dir(uri: str, cache: str | None = None, options: dict[str, Any] | None = None) -> str:
    """Returns a local folder holding the snapshot's ``model/`` (downloaded when ``uri`` is remote).

    Raises:
        SnapshotError: the snapshot is incomplete.
    """
    return str(fetch_local(uri, Path(cache) if cache else None, options) / "model")


# --------------------------------------------------------------------------------------------
# Finding snapshots
# --------------------------------------------------------------------------------------------
def _children(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    fs.invalidate_cache(path)
    if not fs.isdir(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def list_snapshots(uri: str, options: dict[str, Any] | None = None) -> list[SnapshotInfo]:
    """Returns every snapshot folder (complete or not) under a storage root or one run folder, by step.

    Raises:
        SnapshotError: the storage cannot be listed.
    """
    fs, path = open_fs(uri, options)
    try:
        base = uri.rstrip("/").rsplit("/", 1)[-1]
        runs = [base] if base.startswith(RUN_PREFIX) else [n for n in _children(fs, path) if n.startswith(RUN_PREFIX)]
        run_uri = {base: uri} if base.startswith(RUN_PREFIX) else {r: join(uri, r) for r in runs}
        out = []
        for run in runs:
            for name in _children(fs, open_fs(run_uri[run], options)[1]):
                m = _STEP_RE.match(name)
                if m:
                    snap = join(run_uri[run], name)
                    out.append(SnapshotInfo(snap, run, int(m.group(1)), _manifest_or_none(snap, options)))
    except OSError as err:
        raise SnapshotError(f"could not list snapshots under '{uri}': {err}") from err
    return sorted(out, key=lambda s: (s.step, s.manifest.written_at if s.manifest else 0.0))


def _manifest_or_none(uri: str, options: dict[str, Any] | None) -> SnapshotManifest | None:
    try:
        return read_manifest(uri, options)
    except SnapshotError:
        return None


def latest_snapshot(uri: str, options: dict[str, Any] | None = None) -> str | None:
    """Returns the newest complete snapshot (by manifest written_at) under a root or run folder, or None."""
    done = [s for s in list_snapshots(uri, options) if s.complete]
    return max(done, key=lambda s: s.manifest.written_at).uri if done else None


def resolve_snapshot(ref: str, root: str, options: dict[str, Any] | None = None) -> str:
    """Returns the URI of a complete snapshot from 'latest', a snapshot URI, or a run folder URI.

    Raises:
        SnapshotError: nothing complete matches; the message says where it looked.
    """
    if ref == "latest":
        found = latest_snapshot(root, options)
        if found is None:
            raise SnapshotError(f"--resume latest: no complete snapshot under '{root}' (checkpoint.uri)")
        return found
    if _STEP_RE.match(ref.rstrip("/").rsplit("/", 1)[-1]):
        read_manifest(ref, options)
        return ref.rstrip("/")
    found = latest_snapshot(ref, options)
    if found is None:
        raise SnapshotError(f"'{ref}' is neither a complete snapshot nor a folder holding one")
    return found


# --------------------------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------------------------
def _newest_mtime(fs: fsspec.AbstractFileSystem, path: str) -> float:
    stamps = []
    for info in fs.find(path, detail=True).values():
        stamp = info.get("mtime", info.get("LastModified"))
        stamps.append(stamp.timestamp() if isinstance(stamp, datetime) else float(stamp or 0.0))
    return max(stamps, default=0.0)


def prune(
    root: str,
    current_run: str,
    *,
    max_age_s: float,
    log_max_age_s: float,
    keep_last: int | None = None,
    options: dict[str, Any] | None = None,
    now: float | None = None,
) -> list[str]:
    """Deletes snapshots and logs that retention no longer keeps; returns the URIs it deleted.

    Ray Train deletes the checkpoints beyond its ``num_to_keep`` on its own, concurrently: a snapshot that
    vanishes while this lists or deletes it is skipped (a half-deleted one looks incomplete; the soak test met
    the race: ``rm`` raised FileNotFoundError and cost a learner restart).

    Rules: incomplete snapshots of ``current_run`` go at once, those of other runs once their newest
    file is ``INCOMPLETE_GRACE_S`` old; complete snapshots of other runs go when older than
    ``max_age_s`` (manifest written_at); ``keep_last`` (only when Ray Train does not manage the run's
    count) keeps the newest N of ``current_run``; logs under ``<root>/logs`` older than
    ``log_max_age_s`` go. The newest complete snapshot under ``root`` is never deleted.

    Raises:
        SnapshotError: the storage cannot be listed.
    """
    now = time.time() if now is None else now
    fs, _ = open_fs(root, options)
    snaps = list_snapshots(root, options)
    done = [s for s in snaps if s.complete]
    newest = max(done, key=lambda s: s.manifest.written_at).uri if done else None
    doomed = []
    for s in snaps:
        if s.uri == newest:
            continue
        if not s.complete:
            grace = 0.0 if s.run == current_run else INCOMPLETE_GRACE_S
            try:
                if now - _newest_mtime(fs, open_fs(s.uri, options)[1]) >= grace:
                    doomed.append(s.uri)
            except FileNotFoundError:  # deleted meanwhile (Ray Train's num_to_keep): gone, as wanted
                continue
        elif s.run != current_run and now - s.manifest.written_at > max_age_s:
            doomed.append(s.uri)
    if keep_last is not None:
        mine = [s for s in done if s.run == current_run]
        doomed += [s.uri for s in mine[:-keep_last] if s.uri != newest and s.uri not in doomed]
    logs_path = open_fs(join(root, LOGS_DIR), options)[1]
    for name in _children(fs, logs_path):
        path = f"{logs_path}/{name}"
        if not name.startswith(current_run) and now - _newest_mtime(fs, path) > log_max_age_s:
            doomed.append(join(root, LOGS_DIR, name))
    removed = []
    for uri in doomed:
        f, p = open_fs(uri, options)
        try:
            f.rm(p, recursive=True)
        except FileNotFoundError:  # another deleter got there first (Ray Train prunes its checkpoints too)
            continue
        removed.append(uri)
    return removed


def lifecycle_rules(root: str, max_age_days: float, log_max_age_days: float) -> dict[str, Any]:
    """Returns an S3 bucket lifecycle configuration that expires logs and snapshots under ``root``.

    A lifecycle rule ages objects one by one and cannot spare the newest complete snapshot the way
    ``prune`` does, so set ``checkpoint.max_age_days`` longer than any pause between runs.

    Raises:
        ValueError: ``root`` is not an s3:// URI.
    """
    if not root.startswith("s3://"):
        raise ValueError(f"checkpoint.uri='{root}': bucket lifecycle rules need an s3:// URI")
    prefix = root[len("s3://") :].partition("/")[2].strip("/")
    base = f"{prefix}/" if prefix else ""
    return {
        "Rules": [
            {"ID": "rlray-logs", "Filter": {"Prefix": f"{base}{LOGS_DIR}/"}, "Status": "Enabled",
             "Expiration": {"Days": max(1, math.ceil(log_max_age_days))}},
            {"ID": "rlray-snapshots", "Filter": {"Prefix": base}, "Status": "Enabled",
             "Expiration": {"Days": max(1, math.ceil(max_age_days))}},
        ]
    }


def apply_lifecycle(root: str, rules: dict[str, Any], options: dict[str, Any] | None = None) -> None:
    """Sets ``rules`` as the lifecycle configuration of ``root``'s bucket (replacing the existing one).

    Raises:
        SnapshotError: S3 refused.
    """
    fs, _ = open_fs(root, options)
    bucket = root[len("s3://") :].partition("/")[0]
    try:
        fs.call_s3("put_bucket_lifecycle_configuration", Bucket=bucket, LifecycleConfiguration=rules)
    except Exception as err:  # botocore errors are not OSError
        raise SnapshotError(f"could not set the lifecycle rules of bucket '{bucket}': {err}") from err
