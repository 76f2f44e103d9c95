"""Bad data: malformed JSON lines, text that is not UTF-8, empty prompts, prompts past data.max_prompt_tokens
(skipped and counted, or an error), preference rows with identical sides, duplicate pair ids; and fuzzing of
the prompt and pair loaders and of the GSM8K grader (only their documented errors, never anything else)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlray.data import DataError, PromptRow, load_preference_pairs, load_prompt_rows, prepare_prompts
from rlray.reward.gsm8k import grade_gsm8k

DIALOGUE = "\n\nHuman: what is 2+2?\n\nAssistant: {}"
GOOD = {"prompt": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}


def _lines(path: Path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_a_malformed_json_line_is_named_by_file_and_line(tmp_path):
    path = _lines(tmp_path / "rows.jsonl", [json.dumps(GOOD).encode(), b"", json.dumps(GOOD).encode()[:-1]])
    with pytest.raises(DataError, match=rf"^{path}:3: not valid JSON \(Expecting ',' delimiter at column 59\)$"):
        load_prompt_rows([path])
    pairs = _lines(tmp_path / "pairs.jsonl", [json.dumps({"chosen": DIALOGUE.format("4"), "rejected": DIALOGUE.format("5")}).encode(),
                                              b'{"chosen": "x", "rejected": [1,'])
    with pytest.raises(DataError, match=rf"^{pairs}:2: not valid JSON"):
        load_preference_pairs([pairs])
    with pytest.raises(DataError, match=rf"^{path}:1: expected a JSON object per line, got list$"):
        load_prompt_rows([_lines(tmp_path / "rows.jsonl", [b"[1, 2]"])])


def test_text_that_is_not_utf8_is_named_by_file_line_and_byte(tmp_path):
    latin1 = json.dumps({"prompt": "Combien coûte un café ?", "answer": "#### 2"}, ensure_ascii=False).encode("latin-1")
    path = _lines(tmp_path / "rows.jsonl", [json.dumps(GOOD).encode(), latin1])
    with pytest.raises(DataError, match=rf"^{path}:2: not valid UTF-8 \(byte 0xfb at column 23\); re-encode the file as UTF-8$"):
        load_prompt_rows([path])
    gz = tmp_path / "pairs.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b'{"chosen": "\xff", "rejected": "x"}\n')
    with pytest.raises(DataError, match=rf"^{gz}:1: not valid UTF-8 \(byte 0xff at column 13\)"):
        load_preference_pairs([str(gz)])


def test_an_empty_prompt_is_an_error_naming_the_line(tmp_path):
    path = _lines(tmp_path / "rows.jsonl", [json.dumps(GOOD).encode(), json.dumps({"prompt": "  ", "answer": "#### 1"}).encode()])
    with pytest.raises(DataError, match=rf"^{path}:2: prompt column 'prompt' is an empty string \('  '\)$"):
        load_prompt_rows([path])
    missing = _lines(tmp_path / "some.jsonl", [json.dumps(GOOD).encode(), json.dumps({"answer": "#### 1"}).encode()])
    with pytest.raises(DataError, match=rf"^{missing}:2: this row has no prompt column 'prompt' \(data.prompt_column\); "
                                        r"it has columns \['answer'\]$"):  # fmt: skip
        load_prompt_rows([missing])
    chat = _lines(tmp_path / "chat.jsonl", [json.dumps({"prompt": [{"role": "user"}]}).encode()])
    with pytest.raises(DataError, match=rf"^{chat}:1: prompt column 'prompt' message 0 \(0-based\) has no 'content'; "
                                        r"it has keys \['role'\]$"):  # fmt: skip
        load_prompt_rows([chat])


def test_long_prompts_are_skipped_and_counted_or_an_error_as_configured(tiny_tokenizer, caplog):
    rows = [PromptRow("short", "2+2?", {"answer": "4"}), PromptRow("long", "word " * 200, {"answer": "1"}), PromptRow("ok", "3+3?", {"answer": "6"})]
    render = dict(instruction="Answer.", system_prompt=None)
    lengths = [len(ids) for ids in prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=10**6, **render)[1]]
    limit = lengths[0] + 5
    assert lengths[1] > limit >= lengths[2]
    with caplog.at_level(logging.WARNING, logger="rlray.data.prompts"):
        kept, ids, skipped = prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=limit, long_prompts="skip", **render)
    assert [r.prompt_id for r in kept] == ["short", "ok"] and skipped == 1
    assert f"skipped 1 of 3 prompts longer than data.max_prompt_tokens={limit} (first: 'long' {lengths[1]} tokens)" in caplog.text
    with pytest.raises(DataError, match=(
            rf"prompt 'long' has {lengths[1]} tokens after the chat template, more than data.max_prompt_tokens={limit} "
            r"\(1 of 3 prompts are\); raise data.max_prompt_tokens or set data.long_prompts=skip")):
        prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=limit, long_prompts="error", **render)
    with pytest.raises(DataError, match="every one of the 1 prompts is longer than data.max_prompt_tokens"):
        prepare_prompts(rows[1:2], tiny_tokenizer, max_prompt_tokens=limit, **render)


def test_identical_preference_sides_are_skipped_counted_and_logged(tmp_path, caplog):
    rows = [{"chosen": DIALOGUE.format("4"), "rejected": DIALOGUE.format("5")},
            {"chosen": DIALOGUE.format("same"), "rejected": DIALOGUE.format("same")},
            {"chosen": DIALOGUE.format("4"), "rejected": DIALOGUE.format("")}]  # fmt: skip
    path = _lines(tmp_path / "p.jsonl", [json.dumps(r).encode() for r in rows])
    with caplog.at_level(logging.WARNING, logger="rlray.data.pairs"):
        pairs, skipped = load_preference_pairs([path])
    assert [p.prompt_id for p in pairs] == ["p:0"] and skipped == 2
    assert ("skipped 2 preference rows that cannot form a pair (1 with an empty response, "
            "1 with identical chosen and rejected responses)") in caplog.text


def test_duplicate_pair_ids_name_both_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    row = json.dumps({"chosen": DIALOGUE.format("4"), "rejected": DIALOGUE.format("5")}).encode()
    first, second = _lines(tmp_path / "a" / "pairs.jsonl", [row]), _lines(tmp_path / "b" / "pairs.jsonl", [row])
    with pytest.raises(DataError, match=rf"{second}:1: pair id 'pairs:0' appears twice \({first} and {second}\)"):
        load_preference_pairs([first, second])


def test_duplicate_prompt_ids_in_one_file(tmp_path):
    path = _lines(tmp_path / "ids.jsonl", [json.dumps(dict(GOOD, id="q1")).encode()] * 2)
    with pytest.raises(DataError, match="prompt id 'q1' appears twice"):
        load_prompt_rows([path])


# --------------------------------------------------------------------------------------------
# Fuzzing: random bytes and random JSON rows raise only DataError; the grader never raises
# --------------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
ROWS = st.lists(
    st.dictionaries(st.sampled_from(["prompt", "answer", "id", "chosen", "rejected", "x"]),
                    JSON_VALUES | st.sampled_from(["#### 3", DIALOGUE.format("a"), "q?", [{"role": "user", "content": "q?"}]]),
                    max_size=5),
    min_size=1, max_size=4,
)  # fmt: skip
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes_raise_only_data_errors(tmp_path, data):
    for name, load in (("rows.jsonl", lambda p: load_prompt_rows([p])), ("pairs.jsonl", lambda p: load_preference_pairs([p]))):
        path = tmp_path / name
        path.write_bytes(data)
        try:
            load(str(path))
        except DataError:
            pass


@FUZZ
@given(rows=ROWS)
def test_fuzz_random_json_rows_load_or_raise_data_errors(tmp_path, rows):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    try:
        got = load_prompt_rows([str(path)])
    except DataError:
        pass
    else:  # what loads is valid: a non-empty prompt string, or messages with a user turn
        assert all(r.prompt.strip() if isinstance(r.prompt, str) else any(m["role"] == "user" for m in r.prompt) for r in got)
        assert all("prompt" not in r.columns for r in got)
    try:
        pairs, skipped = load_preference_pairs([str(path)])
    except DataError:
        pass
    else:
        assert len(pairs) + skipped == len(rows) and all(p.chosen != p.rejected for p in pairs)


@settings(max_examples=100, deadline=None)
@given(response=st.text(max_size=200), reference=st.text(max_size=20) | st.sampled_from(["18", "1,080", "-3", "0.5"]))
def test_fuzz_the_gsm8k_grader_never_raises(response, reference):
    accuracy, fmt = grade_gsm8k(response, reference)
    assert accuracy in (0.0, 1.0) and fmt in (0.0, 1.0)
    assert grade_gsm8k(f"{response}\n#### {reference}", reference)[1] in (0.0, 1.0)
