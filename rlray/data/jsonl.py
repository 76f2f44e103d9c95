"""JSON Lines files (local or fsspec URIs, compressed or not), read with errors that name the file and line.

Both the prompt loader (``rlray.data.rows``) and the preference-pair loader (``rlray.data.pairs``) read
``.jsonl`` sources here, so a malformed line, bytes that are not UTF-8, or a line that is not a JSON
object give the same ``DataError`` naming ``<file>:<line>`` (1-based, as editors and compilers count).
"""

from __future__ import annotations

import json
from typing import Any

import fsspec


class DataError(ValueError):
    """Data that cannot be used. The message names the file, row or column and the fix."""


def read_jsonl(path: str, *, storage_options: dict | None = None) -> list[tuple[int, dict[str, Any]]]:
    """Returns (line number, object) for every non-blank line of a JSON Lines file, in order.

    Args:
        path: a local path or fsspec URI (``s3://...``); ``.gz``/``.bz2``/``.xz``/``.zst`` are decompressed.
        storage_options: options of the fsspec filesystem (s3fs credentials and endpoint).

    Raises:
        DataError: the file is missing or unreadable, has no non-blank line, or a line is not valid UTF-8,
            not valid JSON, or not a JSON object (each names ``<path>:<line>``).
    """
    try:
        with fsspec.open(path, "rb", compression="infer", **(storage_options or {})) as handle:
            raw = handle.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found (cannot read it)") from None
    except Exception as err:  # a broken archive, a permission error, an unreachable endpoint (botocore), a bad URI
        raise DataError(f"{path}: cannot read it: {type(err).__name__}: {err}") from None
    rows = []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        rows.append((number, _parse_line(path, number, line)))
    if not rows:
        raise DataError(f"{path}: file is empty (it has no rows)")
    return rows


def _parse_line(path: str, number: int, line: bytes) -> dict[str, Any]:
    """Returns the JSON object on one line; raises DataError naming ``path:number``."""
    where = f"{path}:{number}"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{where}: not valid UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1}); re-encode the file as UTF-8"
        ) from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as err:  # Python's own limits, e.g. an integer of more than 4300 digits
        raise DataError(f"{where}: cannot read this JSON ({err})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    return row
