"""Tests for rlray.data.rows: prompt rows in TRL's formats from JSONL, Parquet, URIs and hub ids, with clear errors."""

from __future__ import annotations

import datetime
import gzip
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rlray.data
from rlray.data import DataError
from rlray.data import rows as rows_module
from rlray.data.rows import PromptRow, columns_json, load_prompt_rows

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Let me add:"},
]


def _real_rows(gsm8k_dir: Path, n: int, split: str = "test") -> list[dict]:
    with open(gsm8k_dir / f"{split}.jsonl") as handle:
        return [json.loads(next(handle)) for _ in range(n)]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_public_api_is_exported():
    assert (rlray.data.PromptRow, rlray.data.load_prompt_rows, rlray.data.columns_json) == (
        PromptRow, load_prompt_rows, columns_json)
    assert rlray.data.DataError is DataError
    assert not hasattr(rows_module, "reference_answer") and not hasattr(rows_module, "ANSWER_MARKER")


def test_real_gsm8k_train_file_with_question_column(gsm8k_dir):
    rows = load_prompt_rows([str(gsm8k_dir / "train.jsonl")], prompt_column="question")
    assert len(rows) == 7473
    assert [r.prompt_id for r in rows[:2]] == ["train:0", "train:1"] and rows[-1].prompt_id == "train:7472"
    first = _real_rows(gsm8k_dir, 1, "train")[0]
    assert rows[0].prompt == first["question"]
    assert rows[0].prompt.startswith("Natalia sold clips to 48 of her friends in April")
    assert rows[0].columns == {"answer": first["answer"]}  # the whole solution, untouched
    assert rows[0].columns["answer"].endswith("72 clips altogether in April and May.\n#### 72")
    assert not rows[0].is_conversational


def test_real_gsm8k_test_file(gsm8k_dir):
    rows = load_prompt_rows([str(gsm8k_dir / "test.jsonl")], prompt_column="question")
    assert len(rows) == 1319
    assert rows[0].prompt_id == "test:0" and rows[0].columns["answer"].endswith("\n#### 18")
    assert rows[0].prompt.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert rows[-1].prompt_id == "test:1318"
    finals = [r.columns["answer"].rsplit("####", 1)[1].strip() for r in rows]
    assert sum("," in f for f in finals) == 14  # e.g. '2,125': the text is kept exactly as written
    assert set(finals) >= {"-10", "-3"}


def test_two_files_keep_order_and_stems(gsm8k_dir):
    rows = load_prompt_rows([str(gsm8k_dir / "test.jsonl"), str(gsm8k_dir / "train.jsonl")], prompt_column="question")
    assert len(rows) == 1319 + 7473
    assert rows[1319].prompt_id == "train:0"


def test_standard_and_conversational_formats(tmp_path):
    path = _write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "What is 2+2?", "solution": "4"},
        {"prompt": CONVERSATION, "solution": "4"},
        {"prompt": [{"role": "user", "content": "Call it."}, {"role": "tool", "content": "42", "name": "lookup"}]},
    ])
    standard, conversational, tool = load_prompt_rows([path])
    assert standard == PromptRow("mixed:0", "What is 2+2?", {"solution": "4"})
    assert not standard.is_conversational and conversational.is_conversational
    assert conversational.prompt == CONVERSATION and conversational.columns == {"solution": "4"}
    assert tool.prompt[1] == {"role": "tool", "content": "42", "name": "lookup"} and tool.columns == {}


def test_prompt_column_mapping(tmp_path):
    path = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": "not me", "input": "me", "id": 7}])
    (row,) = load_prompt_rows([path], prompt_column="input")
    assert row == PromptRow("7", "me", {"prompt": "not me", "id": 7})  # the id column stays a column, as an int


def test_mixed_type_columns_preserved_and_columns_json_round_trips(tmp_path):
    records = [
        {"prompt": "a", "tests": 3, "meta": None, "score": 0.5},
        {"prompt": "b", "tests": [1, "two", {"three": [3.0, None]}], "meta": {"src": "caf\u00e9", "ok": True}},
        {"tests": {"k": [1, 2]}, "prompt": "c", "extra": "only here"},
    ]
    rows = load_prompt_rows([_write_jsonl(tmp_path / "mixed.jsonl", records)])
    assert [r.columns for r in rows] == [{k: v for k, v in r.items() if k != "prompt"} for r in records]
    assert list(rows[2].columns) == ["tests", "extra"]  # the file's order
    assert isinstance(rows[0].columns["tests"], int) and isinstance(rows[0].columns["score"], float)
    for row in rows:
        assert json.loads(columns_json(row)) == row.columns
    assert columns_json(rows[1]) == (
        '{"tests": [1, "two", {"three": [3.0, null]}], "meta": {"src": "caf\u00e9", "ok": true}}'  # ensure_ascii=False
    )


def test_columns_json_stringifies_what_json_cannot_hold():
    when = datetime.datetime(2024, 5, 1, 12, 30)
    row = PromptRow("p", "q", {"raw": b"\x00\x01", "when": when, "n": 1})
    assert json.loads(columns_json(row)) == {"raw": "b'\\x00\\x01'", "when": "2024-05-01 12:30:00", "n": 1}
    assert columns_json(PromptRow("p", "q", {})) == "{}"


def test_parquet_matches_jsonl(gsm8k_dir, tmp_path):
    real = _real_rows(gsm8k_dir, 50)
    pq.write_table(pa.Table.from_pylist(real), tmp_path / "mini.parquet")
    from_parquet = load_prompt_rows([str(tmp_path / "mini.parquet")], prompt_column="question")
    from_jsonl = load_prompt_rows([_write_jsonl(tmp_path / "mini.jsonl", real)], prompt_column="question")
    assert from_parquet == from_jsonl
    assert from_parquet[7] == PromptRow("mini:7", real[7]["question"], {"answer": real[7]["answer"]})


def test_parquet_nested_columns_come_back_as_python_objects(tmp_path):
    records = [
        {"prompt": CONVERSATION[:2], "tests": [{"input": "1", "output": [1, 2]}], "info": {"level": 3, "tags": ["a"]}},
        {"prompt": [{"role": "user", "content": "Hi"}], "tests": [], "info": {"level": 5, "tags": []}},
    ]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "nested.parquet")
    rows = load_prompt_rows([str(tmp_path / "nested.parquet")])
    assert [r.prompt_id for r in rows] == ["nested:0", "nested:1"]
    assert rows[0].prompt == CONVERSATION[:2] and rows[0].is_conversational
    assert rows[0].columns == {"tests": [{"input": "1", "output": [1, 2]}], "info": {"level": 3, "tags": ["a"]}}
    assert rows[1].columns == {"tests": [], "info": {"level": 5, "tags": []}}
    assert json.loads(columns_json(rows[0])) == rows[0].columns


def test_gzipped_jsonl_and_id_column(gsm8k_dir, tmp_path):
    real = [dict(r, id=f"q{i * 10}") for i, r in enumerate(_real_rows(gsm8k_dir, 3))]
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in real)
    rows = load_prompt_rows([str(path)], prompt_column="question")
    assert [r.prompt_id for r in rows] == ["q0", "q10", "q20"]
    assert rows[1].columns == {"answer": real[1]["answer"], "id": "q10"}


def _fake_loader(calls: list):
    def load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.Dataset.from_list([{"question": "1+1?", "answer": "1+1=2\n#### 2"}])

    return load_dataset


def test_uri_passes_storage_options(monkeypatch):
    calls: list = []
    monkeypatch.setattr(datasets, "load_dataset", _fake_loader(calls))
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:5000"}}
    rows = load_prompt_rows(["s3://bucket/gsm8k/train.parquet"], prompt_column="question", storage_options=options)
    assert calls == [
        ("parquet", None, {"data_files": "s3://bucket/gsm8k/train.parquet", "storage_options": options, "split": "train"})
    ]
    assert rows == [PromptRow("train:0", "1+1?", {"answer": "1+1=2\n#### 2"})]


def test_jsonl_uri_is_read_through_fsspec(gsm8k_dir, moto_s3):
    import s3fs

    fs = s3fs.S3FileSystem(key=moto_s3["key"], secret=moto_s3["secret"], endpoint_url=moto_s3["endpoint_url"],
                           client_kwargs={"region_name": moto_s3["region"]}, skip_instance_cache=True)
    real = _real_rows(gsm8k_dir, 3)
    fs.pipe_file(f"{moto_s3['bucket']}/gsm8k/mini.jsonl", "".join(json.dumps(r) + "\n" for r in real).encode())
    options = {"key": moto_s3["key"], "secret": moto_s3["secret"], "endpoint_url": moto_s3["endpoint_url"]}
    rows = load_prompt_rows([f"s3://{moto_s3['bucket']}/gsm8k/mini.jsonl"], prompt_column="question",
                            storage_options=options)
    assert [r.prompt_id for r in rows] == ["mini:0", "mini:1", "mini:2"]
    assert rows[0].columns == {"answer": real[0]["answer"]} and rows[0].columns["answer"].endswith("#### 18")


def test_hub_id_syntax(monkeypatch):
    calls: list = []
    monkeypatch.setattr(datasets, "load_dataset", _fake_loader(calls))
    rows = load_prompt_rows(["openai/gsm8k:main:test", "someone/math"], prompt_column="question")
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


def test_missing_prompt_column_lists_the_columns(gsm8k_dir, tmp_path):
    path = str(gsm8k_dir / "test.jsonl")
    with pytest.raises(DataError) as err:
        load_prompt_rows([path])  # GSM8K without prompt_column="question"
    assert str(err.value) == (
        f"{path}: no prompt column 'prompt' (data.prompt_column); it has columns ['question', 'answer']; "
        "set data.prompt_column to the column that holds the prompt"
    )
    pq.write_table(pa.Table.from_pylist([{"text": "q", "label": 1}]), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: no prompt column 'query' .*it has columns \['text', 'label'\]"):
        load_prompt_rows([str(tmp_path / "p.parquet")], prompt_column="query")


def test_row_without_the_prompt_column_names_its_line(tmp_path):
    path = _write_jsonl(tmp_path / "some.jsonl", [{"prompt": "a"}, {"question": "b", "x": 1}])
    with pytest.raises(DataError) as err:
        load_prompt_rows([path])
    assert str(err.value) == (
        f"{path}:2: this row has no prompt column 'prompt' (data.prompt_column); it has columns ['question', 'x']"
    )


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ("  \n", "is an empty string ('  \\n')"),
        ([], "is an empty list of messages"),
        (5, "must be a non-empty string (standard format) or a non-empty list of {'role', 'content'} messages "
            "(conversational format), got int 5"),
        ({"role": "user", "content": "hi"}, "must be a non-empty string (standard format)"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"content": "c"}],
         "message 2 (0-based) has no 'role'; it has keys ['content']"),
        ([{"role": "user"}], "message 0 (0-based) has no 'content'; it has keys ['role']"),
        ([{"role": "user", "content": "a"}, "b"], "message 1 (0-based) must be a {'role', 'content'} object, got str 'b'"),
        ([{"role": "human", "content": "a"}], "message 0 (0-based) has role 'human'; roles must be one of system/user/assistant/tool"),
        ([{"role": "user", "content": ["a"]}], "message 0 (0-based) (user) 'content' must be a string, got list ['a']"),
        ([{"role": "system", "content": "s"}], "has no 'user' message (roles: ['system'])"),
    ],
)
def test_bad_prompt_names_line_and_problem(tmp_path, prompt, problem):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "a": 1}, {"prompt": "fine too"}, {"prompt": prompt}])
    with pytest.raises(DataError) as err:
        load_prompt_rows([path])
    assert str(err.value).startswith(f"{path}:3: prompt column 'prompt' {problem}")


def test_bad_prompt_in_parquet_names_the_row(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"q": "fine"}, {"q": ""}]), tmp_path / "e.parquet")
    source = str(tmp_path / "e.parquet")
    with pytest.raises(DataError) as err:
        load_prompt_rows([source], prompt_column="q")
    assert str(err.value) == f"{source} row 1 (0-based): prompt column 'q' is an empty string ('')"


def test_duplicate_prompt_ids(gsm8k_dir, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    real = _real_rows(gsm8k_dir, 2)
    first = _write_jsonl(tmp_path / "a" / "train.jsonl", real)
    second = _write_jsonl(tmp_path / "b" / "train.jsonl", real)
    with pytest.raises(DataError, match="prompt id 'train:0' appears twice"):
        load_prompt_rows([first, second], prompt_column="question")
    same_ids = _write_jsonl(tmp_path / "ids.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": "1"}])
    with pytest.raises(DataError, match="prompt id '1' appears twice"):
        load_prompt_rows([same_ids])


@pytest.mark.parametrize("row_id, shown", [([1], "list [1]"), (True, "bool True"), ({"k": 1}, "dict {'k': 1}")])
def test_an_id_that_is_not_a_string_or_integer_names_its_line(tmp_path, row_id, shown):
    path = _write_jsonl(tmp_path / "ids.jsonl", [{"prompt": "a", "id": "x"}, {"prompt": "b", "id": row_id}])
    with pytest.raises(DataError) as err:
        load_prompt_rows([path])
    assert str(err.value) == f"{path}:2: column 'id' must be a string or an integer (the prompt id), got {shown}"


def test_a_broken_json_file_names_the_parser_cause(tmp_path):
    (tmp_path / "bad.json").write_text('{"prompt": ')
    with pytest.raises(DataError) as err:
        load_prompt_rows([str(tmp_path / "bad.json")])
    assert str(err.value).startswith(f"{tmp_path / 'bad.json'}: cannot load it with datasets.load_dataset: "
                                     "DatasetGenerationError: An error occurred while generating the dataset (")
    assert "JSON parse error" in str(err.value) and "in row 0" in str(err.value)
