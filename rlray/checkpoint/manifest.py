"""The snapshot manifest: ``SnapshotManifest`` is what a snapshot's ``manifest.json`` holds, and its
``to_json`` / ``from_json`` are the one place that knows the JSON layout.

Layouts (the ``format`` key):

- 1: the first snapshots (``<output_dir>/final``, written before snapshot storage existed): ``step``,
  ``policy_version``, ``kind`` and ``written_at`` only. Such a manifest loads with ``FORMAT1_DEFAULTS``
  for the rest; the snapshot serves as a model folder (``rlray eval``, ``reward.model_path``) but cannot
  be resumed from (no data cursor, no RNG states).
- 2 (written today): every field of ``SnapshotManifest``; each is required.

Keys this version does not know (written by a newer rlray) are ignored without an error, so a newer
snapshot still loads here; they are not kept (this version never rewrites a manifest).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

FORMAT = 2
"""The layout ``SnapshotManifest.to_json`` writes."""


@dataclass(frozen=True)
class SnapshotManifest:
    """A snapshot's manifest: where the run was when the snapshot was taken, its lineage, and its files.

    The manifest is written last (``rlray.checkpoint.storage.write_manifest``): a folder without one is
    an incomplete snapshot.

    Attributes:
        kind: why it was taken: "periodic" (every ``checkpoint.every_steps``), "final" (the last step) or
            "stop" (a stop request or a guard ended the run).
        step: RL steps done when it was taken (the next step to run is ``step + 1``).
        epoch: the data cursor's epoch (a copy of ``data_cursor["epoch"]``, for people and lineage tags).
        policy_version: the policy version of the weights it holds (one per learner update).
        rollbacks: guard rollbacks the run had made by then (its snapshot folders carry ``_r<rollbacks>``).
        data_cursor: the data cursor (``RunContext.cursor_state``); its shape belongs to
            ``rlray.data.PromptStream.state_dict`` and, online, ``rlray.rollout.pipeline.RolloutPipeline.cursor_state``
            (which adds "in_flight"). None only in a format-1 manifest, which cannot be resumed from.
        world_size: learner ranks of the run that wrote it (one RNG file per rank).
        run_id: the MLflow run that wrote it.
        config_hash: ``Config.config_hash()`` of the config it was trained with.
        dataset_hash: the prompt rows' fingerprint (a copy of ``data_cursor["rows_fingerprint"]``).
        git_commit: the code's git commit, or "unknown" outside git.
        parent_version: the registered model version training continued from (the previous snapshot's,
            across resumes and rollbacks); None for a run's first snapshot.
        metrics: the step's metrics, {key: value}.
        files: {path relative to the snapshot folder: bytes} of every payload file; set by ``write_manifest``.
        written_at: when the manifest was written, seconds since the epoch; set by ``write_manifest``.
    """

    kind: str
    step: int
    epoch: int
    policy_version: int
    rollbacks: int
    data_cursor: dict[str, Any] | None
    world_size: int
    run_id: str
    config_hash: str
    dataset_hash: str
    git_commit: str
    parent_version: str | None
    metrics: dict[str, float]
    files: dict[str, int] = field(default_factory=dict)
    written_at: float = 0.0

    def to_json(self) -> str:
        """Returns the manifest as JSON text in layout ``FORMAT`` (keys sorted, 2-space indent)."""
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> SnapshotManifest:
        """Returns the manifest read from ``manifest.json`` text in layout 1 or 2 (or a newer one).

        Keys a format-1 manifest lacks take ``FORMAT1_DEFAULTS``; unknown keys are ignored.

        Raises:
            ValueError: not JSON, not an object, no ``format``, a key the layout requires is missing, or a
                value of the wrong type; the message names the key.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or "format" not in data:
            raise ValueError("not a snapshot manifest: a JSON object with a 'format' key is expected")
        defaults = FORMAT1_DEFAULTS if data["format"] == 1 else {}
        values = {}
        for f in fields(cls):
            if f.name in data:
                raw = data[f.name]
            elif f.name in defaults:
                raw = defaults[f.name]
            else:
                raise ValueError(f"manifest (format {data['format']}) has no '{f.name}'")
            try:
                values[f.name] = _READERS[f.name](raw)
            except TypeError as err:
                raise ValueError(f"manifest key '{f.name}' has {raw!r}: {err}") from None
        return cls(**values)


FORMAT1_DEFAULTS = MappingProxyType({
    "epoch": 0,
    "rollbacks": 0,  # true: rollbacks came with format 2
    "data_cursor": None,  # not kept: the snapshot cannot be resumed from
    "world_size": 1,
    "run_id": "",
    "config_hash": "",
    "dataset_hash": "",
    "git_commit": "unknown",  # what rlray.checkpoint.lineage.git_commit says outside git
    "parent_version": None,  # no lineage before format 2
    "metrics": {},
    "files": {},  # no sizes listed: nothing to verify
})
"""Values of the keys a format-1 manifest lacks (it holds format, written_at, step, policy_version, kind)."""


def _optional(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else read(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string is expected, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"an integer is expected, got {type(value).__name__}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a number is expected, got {type(value).__name__}")
    return float(value)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"a JSON object is expected, got {type(value).__name__}")
    return dict(value)


_READERS: dict[str, Callable[[Any], Any]] = {
    "kind": _str,
    "step": _int,
    "epoch": _int,
    "policy_version": _int,
    "rollbacks": _int,
    "data_cursor": _optional(_object),
    "world_size": _int,
    "run_id": _str,
    "config_hash": _str,
    "dataset_hash": _str,
    "git_commit": _str,
    "parent_version": _optional(_str),
    "metrics": lambda value: {_str(k): _number(v) for k, v in _object(value).items()},
    "files": lambda value: {_str(k): _int(v) for k, v in _object(value).items()},
    "written_at": _number,
}
