"""Tests for rlray.data.gsm8k: loading prompt rows from JSONL, Parquet, URIs and hub ids, with clear errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlray.data import gsm8k
from rlray.data.gsm8k import DataError, PromptRow, load_prompt_rows


def _real_rows(gsm8k_dir: Path, n: int) -> list[dict]:
    with open(gsm8k_dir / "test.jsonl") as handle:
        return [json.loads(next(handle)) for _ in range(n)]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_real_gsm8k_test_file(gsm8k_dir):
    rows = load_prompt_rows([str(gsm8k_dir / "test.jsonl")])
    assert len(rows) == 1319
    assert rows[0].prompt_id == "test:0" and rows[0].answer == "18"
    assert rows[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert rows[-1].prompt_id == "test:1318"
    assert sum("," in r.answer for r in rows) == 14  # e.g. '2,125': kept as written, graders normalise
    assert {r.answer for r in rows} >= {"-10", "-3"}


def test_two_files_keep_order_and_stems(gsm8k_dir):
    rows = load_prompt_rows([str(gsm8k_dir / "test.jsonl"), str(gsm8k_dir / "train.jsonl")])
    assert len(rows) == 1319 + 7473
    assert rows[1319].prompt_id == "train:0"


def test_parquet_matches_jsonl(gsm8k_dir, tmp_path):
    real = _real_rows(gsm8k_dir, 50)
    pq.write_table(pa.Table.from_pylist(real), tmp_path / "mini.parquet")
    from_parquet = load_prompt_rows([str(tmp_path / "mini.parquet")])
    from_jsonl = load_prompt_rows([_write_jsonl(tmp_path / "mini.jsonl", real)])
    assert from_parquet == from_jsonl
    assert from_parquet[7] == PromptRow("mini:7", real[7]["question"], real[7]["answer"].split("####")[-1].strip())


def test_gzipped_jsonl_and_id_column(gsm8k_dir, tmp_path):
    real = [dict(r, id=f"q{i * 10}") for i, r in enumerate(_real_rows(gsm8k_dir, 3))]
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in real)
    rows = load_prompt_rows([str(path)])
    assert [r.prompt_id for r in rows] == ["q0", "q10", "q20"]


def _fake_loader(calls: list):
    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.Dataset.from_list([{"question": "1+1?", "answer": "1+1=2\n#### 2"}])

    return load_dataset


def test_uri_passes_storage_options(monkeypatch):
    calls: list = []
    monkeypatch.setattr(gsm8k.datasets, "load_dataset", _fake_loader(calls))
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:5000"}}
    rows = load_prompt_rows(["s3://bucket/gsm8k/train.parquet"], storage_options=options)
    assert calls == [
        ("parquet", None, {"data_files": "s3://bucket/gsm8k/train.parquet", "storage_options": options, "split": "train"})
    ]
    assert rows == [PromptRow("train:0", "1+1?", "2")]


def test_jsonl_uri_is_read_through_fsspec(gsm8k_dir, moto_s3):
    import s3fs

    fs = s3fs.S3FileSystem(key=moto_s3["key"], secret=moto_s3["secret"], endpoint_url=moto_s3["endpoint_url"],
                           client_kwargs={"region_name": moto_s3["region"]}, skip_instance_cache=True)
    real = _real_rows(gsm8k_dir, 3)
    fs.pipe_file(f"{moto_s3['bucket']}/gsm8k/mini.jsonl", "".join(json.dumps(r) + "\n" for r in real).encode())
    options = {"key": moto_s3["key"], "secret": moto_s3["secret"], "endpoint_url": moto_s3["endpoint_url"]}
    rows = load_prompt_rows([f"s3://{moto_s3['bucket']}/gsm8k/mini.jsonl"], storage_options=options)
    assert [r.prompt_id for r in rows] == ["mini:0", "mini:1", "mini:2"] and rows[0].answer == "18"


def test_hub_id_syntax(monkeypatch):
    calls: list = []
    monkeypatch.setattr(gsm8k.datasets, "load_dataset", _fake_loader(calls))
    rows = load_prompt_rows(["openai/gsm8k:main:test", "someone/math"])
    assert calls == [
        ("openai/gsm8k", "main", {"split": "test", "storage_options": None}),
        ("someone/math", None, {"split": "train", "storage_options": None}),
    ]
    assert [r.prompt_id for r in rows] == ["gsm8k-test:0", "math-train:0"]


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        load_prompt_rows([str(tmp_path / "nope.jsonl")])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: file is empty"):
        load_prompt_rows([str(tmp_path / "empty.jsonl")])
    with pytest.raises(DataError, match="no prompt files given"):
        load_prompt_rows([])
    with pytest.raises(DataError, match=r"rows\.csv: unknown data source"):
        load_prompt_rows([str(tmp_path / "rows.csv")])


def test_missing_columns_lists_the_columns(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "solution": "s\n#### 1"}])
    with pytest.raises(DataError) as err:
        load_prompt_rows([path])
    assert f"{path}: rows need columns 'question' and 'answer'; missing ['answer']" in str(err.value)
    assert "it has columns ['question', 'solution']" in str(err.value)


def test_answer_without_marker_names_file_and_row(gsm8k_dir, tmp_path):
    real = _real_rows(gsm8k_dir, 3)
    real[1]["answer"] = real[1]["answer"].replace("####", "=")
    path = _write_jsonl(tmp_path / "broken.jsonl", real)
    with pytest.raises(DataError) as err:
        load_prompt_rows([path])
    assert f"{path}:2: 'answer' must end with a '#### <final answer>' line" in str(err.value)


def test_duplicate_prompt_ids(gsm8k_dir, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    real = _real_rows(gsm8k_dir, 2)
    first = _write_jsonl(tmp_path / "a" / "train.jsonl", real)
    second = _write_jsonl(tmp_path / "b" / "train.jsonl", real)
    with pytest.raises(DataError, match="prompt id 'train:0' appears twice"):
        load_prompt_rows([first, second])
