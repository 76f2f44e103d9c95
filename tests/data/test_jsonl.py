"""rlray.data.jsonl: JSON Lines rows with their 1-based line numbers, and errors that name ``<file>:<line>``."""

from __future__ import annotations

import bz2
import gzip
from pathlib import Path

import pytest

from rlray.data.jsonl import DataError, read_jsonl


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_rows_keep_their_line_numbers_and_skip_blank_lines(tmp_path):
    path = _write(tmp_path / "a.jsonl", b'{"q": 1}\n\n  \n{"q": "two", "x": [1, 2]}\n{"q": null}')  # no final newline
    assert read_jsonl(path) == [(1, {"q": 1}), (4, {"q": "two", "x": [1, 2]}), (5, {"q": None})]


@pytest.mark.parametrize(("suffix", "compress"), [(".jsonl.gz", gzip.compress), (".jsonl.bz2", bz2.compress)])
def test_compressed_files_are_decompressed_by_suffix(tmp_path, suffix, compress):
    path = _write(tmp_path / f"a{suffix}", compress(b'{"a": 1}\n{"a": 2}\n'))
    assert read_jsonl(path) == [(1, {"a": 1}), (2, {"a": 2})]


def test_utf8_text_is_kept(tmp_path):
    path = _write(tmp_path / "u.jsonl", '{"q": "caf\u00e9 \u2211"}\n'.encode())
    assert read_jsonl(path) == [(1, {"q": "caf\u00e9 \u2211"})]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"a": 1}\n{"a": \n', ":2: not valid JSON (Expecting value at column 7)"),
        (b'{"a": 1}\n\n[1, 2]\n', ":3: expected a JSON object per line, got list"),
        (b'"text"\n', ":1: expected a JSON object per line, got str"),
        (b'{"a": 1}\n{"a": "\xff"}\n', ":2: not valid UTF-8 (byte 0xff at column 8); re-encode the file as UTF-8"),
        (b"[" * 100_000 + b"\n", ":1: not valid JSON (nested too deeply)"),
        (b'{"a": 1}\n{"n": 1' + b"0" * 5000 + b"}\n", ":2: cannot read this JSON (Exceeds the limit (4300 digits) for "
         "integer string conversion: value has 5001 digits; use sys.set_int_max_str_digits() to increase the limit)"),
    ],
)
def test_bad_lines_are_named(tmp_path, data, message):
    path = _write(tmp_path / "bad.jsonl", data)
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value) == f"{path}{message}"


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="file not found"):
        read_jsonl(path)


def test_file_of_blank_lines_is_empty(tmp_path):
    path = _write(tmp_path / "empty.jsonl", b"\n  \n\n")
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value) == f"{path}: file is empty (it has no rows)"


def test_broken_archive_is_named(tmp_path):
    path = _write(tmp_path / "broken.jsonl.gz", b"not gzip at all")
    with pytest.raises(DataError, match=r"broken\.jsonl\.gz: cannot read it: "):
        read_jsonl(path)
