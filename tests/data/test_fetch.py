"""Tests for rlray.data.fetch: the mirror source, idempotence and the error of a failing source chain."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlray.data import fetch
from rlray.data.fetch import FetchError, fetch_dataset


@pytest.fixture
def mirror(repo_root, monkeypatch):
    """The shared data mirror (env RLRAY_DATA_MIRROR, else <repo>/../shared/data), set in the env."""
    folder = os.environ.get(fetch.MIRROR_ENV) or str(repo_root.parent / "shared" / "data")
    monkeypatch.setenv(fetch.MIRROR_ENV, folder)
    return folder


@pytest.fixture
def no_network(monkeypatch):
    """Makes the hub source fail at once and points GitHub at a closed local port."""

    def hub_down(name, out):
        raise ConnectionError("hub unreachable (test)")

    monkeypatch.setattr(fetch, "_from_hub", hub_down)
    monkeypatch.setattr(fetch, "GSM8K_GITHUB_URL", "http://127.0.0.1:9/{split}.jsonl")


def test_mirror_copy_is_byte_identical_and_idempotent(tmp_path, mirror, no_network):
    out = fetch_dataset("gsm8k", tmp_path / "data")
    assert out == tmp_path / "data" / "gsm8k"
    for name in ("train.jsonl", "test.jsonl"):
        assert (out / name).read_bytes() == (Path(mirror) / "gsm8k" / name).read_bytes()
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    assert fetch_dataset("gsm8k", tmp_path / "data") == out  # files exist: nothing is rewritten
    assert (out / "train.jsonl").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["gsm8k"]  # no temp folders left


def test_mirror_hh_rlhf(tmp_path, mirror, no_network):
    out = fetch_dataset("hh-rlhf-harmless", tmp_path)
    assert (out / "test.jsonl.gz").stat().st_size > 0


def test_failing_chain_reports_every_source(tmp_path, monkeypatch, no_network):
    monkeypatch.delenv(fetch.MIRROR_ENV, raising=False)
    with pytest.raises(FetchError) as err:
        fetch_dataset("gsm8k", tmp_path)
    message = str(err.value)
    assert f"could not fetch 'gsm8k' into {tmp_path / 'gsm8k'}; every source failed" in message
    assert "mirror (env RLRAY_DATA_MIRROR): FileNotFoundError: RLRAY_DATA_MIRROR is not set" in message
    assert "Hugging Face hub: ConnectionError: hub unreachable (test)" in message
    assert "GitHub openai/grade-school-math: URLError" in message
    assert list((tmp_path / "gsm8k").iterdir()) == []


def test_incomplete_mirror_is_a_failed_source(tmp_path, monkeypatch, no_network):
    (tmp_path / "mirror" / "gsm8k").mkdir(parents=True)
    (tmp_path / "mirror" / "gsm8k" / "train.jsonl").write_text("{}\n")
    monkeypatch.setenv(fetch.MIRROR_ENV, str(tmp_path / "mirror"))
    with pytest.raises(FetchError, match=r"mirror \(env RLRAY_DATA_MIRROR\): FileNotFoundError: it did not provide \['test.jsonl'\]"):
        fetch_dataset("gsm8k", tmp_path / "data")
    assert not (tmp_path / "data" / "gsm8k" / "train.jsonl").exists()


def test_unknown_name_and_cli(tmp_path, mirror, no_network, capsys):
    with pytest.raises(ValueError, match=r"unknown dataset 'mnist'; known: \['gsm8k', 'guess-number', 'hh-rlhf-harmless', 'retry-arith'\]"):
        fetch_dataset("mnist", tmp_path)
    assert fetch.main(["gsm8k", "--dest", str(tmp_path)]) == 0
    assert f"gsm8k: {tmp_path / 'gsm8k'}" in capsys.readouterr().out
    from rlray.cli import main  # `make data`: every set in one process, one line each

    assert main(["data", "fetch", "gsm8k", "guess-number", "--dest", str(tmp_path / "both")]) == 0
    assert capsys.readouterr().out.splitlines() == [f"gsm8k: {tmp_path / 'both' / 'gsm8k'}",
                                                   f"guess-number: {tmp_path / 'both' / 'guess-number'}"]
    assert (tmp_path / "both" / "gsm8k" / "train.jsonl").is_file() and (tmp_path / "both" / "guess-number").is_dir()


def test_environment_datasets_are_generated_without_network(tmp_path, no_network):
    folder = fetch_dataset("retry-arith", tmp_path)
    rows = {split: [json.loads(x) for x in (folder / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "calibration", "heldout")}
    assert {k: len(v) for k, v in rows.items()} == {"train": 2000, "calibration": 200, "heldout": 200}
    ids = [{r["id"] for r in v} for v in rows.values()]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])  # disjoint items
    first = rows["train"][0]
    assert first["environment"] == "retry_arith"
    assert first["prompt"] == f"What is {first['a']} {first['op']} {first['b']}?"
    again = fetch_dataset("retry-arith", tmp_path / "again")
    assert (again / "heldout.jsonl").read_bytes() == (folder / "heldout.jsonl").read_bytes()  # seeded
    (folder / "heldout.jsonl").write_text('{"stale": true}\n')  # a set from an older generator is written anew
    assert (fetch_dataset("retry-arith", tmp_path) / "heldout.jsonl").read_bytes() == (again / "heldout.jsonl").read_bytes()
