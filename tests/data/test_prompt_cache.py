"""Tests for rlray.data.prompt_cache: the prompt token ids kept on disk between runs (issue 39)."""

from __future__ import annotations

import numpy as np

from rlray.data import prompt_cache
from rlray.data.prompt_cache import cache_key, tokenize_cached, tokenizer_fingerprint
from rlray.data.prompts import prepare_prompts, render_prompt
from rlray.data.rows import PromptRow
from rlray.models.loading import load_tokenizer

RENDER = {"instruction": "End with '#### N'.", "system_prompt": None}


def _rows(n: int) -> list[PromptRow]:
    return [PromptRow(f"r:{i}", f"question {i} " + "word " * i, {}) for i in range(n)]


def test_cached_ids_equal_the_rendered_prompts_and_a_second_call_reads_them(tiny_tokenizer, tmp_path):
    rows = _rows(5)
    expected = [render_prompt(tiny_tokenizer, r.prompt, **RENDER) for r in rows]
    first = prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=10**9, cache=tmp_path, **RENDER)
    assert first == (rows, expected, 0)
    (entry,) = tmp_path.glob("*.npz")
    with np.load(entry) as stored:  # the entry holds every prompt's ids, concatenated, and their lengths
        assert stored["lengths"].tolist() == [len(ids) for ids in expected]
        assert stored["ids"].tolist() == [t for ids in expected for t in ids]
    # a second call reads the entry: ids planted in it come back (the tokenizer is not asked again)
    planted = [[7] * len(ids) for ids in expected]
    np.savez(entry, ids=np.array([t for ids in planted for t in ids]), lengths=[len(ids) for ids in planted])
    assert prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=10**9, cache=tmp_path, **RENDER)[1] == planted


def test_another_instruction_prompt_or_tokenizer_is_another_entry(tiny_model_path, tiny_tokenizer, tmp_path):
    rows = _rows(3)
    prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=10**9, cache=tmp_path, **RENDER)
    other = prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=10**9, cache=tmp_path, instruction="Other.",
                            system_prompt=None)
    assert other[1] == [render_prompt(tiny_tokenizer, r.prompt, instruction="Other.", system_prompt=None) for r in rows]
    assert len(list(tmp_path.glob("*.npz"))) == 2
    texts = ["<|im_start|>user\nhello<|im_end|>\n"]
    fresh = load_tokenizer(tiny_model_path)  # the session's tokenizer stays as it is
    before = tokenizer_fingerprint(fresh)
    assert before == tokenizer_fingerprint(tiny_tokenizer)
    fresh.add_tokens(["hello"])  # the same texts now tokenize otherwise: the key changes with the tokenizer
    after = tokenizer_fingerprint(fresh)
    assert after != before and cache_key(after, texts) != cache_key(before, texts)
    assert tokenize_cached(fresh, texts, tmp_path) == [list(fresh(texts[0], add_special_tokens=False)["input_ids"])]
    assert cache_key(before, texts) != cache_key(before, [texts[0] + " "])  # one changed prompt is another entry
    assert cache_key(before, ["ab", "c"]) != cache_key(before, ["a", "bc"])  # prompts are delimited


def test_a_damaged_entry_is_computed_again_and_replaced(tiny_tokenizer, tmp_path):
    texts = ["one two", "three"]
    expected = [list(tiny_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    tokenize_cached(tiny_tokenizer, texts, tmp_path)
    (entry,) = tmp_path.glob("*.npz")
    entry.write_bytes(b"not an npz")
    assert tokenize_cached(tiny_tokenizer, texts, tmp_path) == expected
    np.savez(entry, ids=np.array([1, 2, 3]), lengths=np.array([3]))  # another prompt count: not used
    assert tokenize_cached(tiny_tokenizer, texts, tmp_path) == expected
    with np.load(entry) as stored:
        assert stored["lengths"].tolist() == [len(e) for e in expected]


def test_no_folder_or_a_slow_tokenizer_caches_nothing_and_old_entries_are_pruned(tiny_tokenizer, tmp_path, monkeypatch):
    assert tokenize_cached(tiny_tokenizer, ["a b"], None) == [list(tiny_tokenizer("a b", add_special_tokens=False)["input_ids"])]

    class Slow:  # a tokenizer without a serialized fast form
        def __call__(self, text, add_special_tokens):
            return {"input_ids": [len(text)]}

    assert tokenizer_fingerprint(Slow()) is None
    assert tokenize_cached(Slow(), ["abc"], tmp_path) == [[3]]
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(prompt_cache, "KEEP_ENTRIES", 2)
    for text in ("x", "y", "z"):
        tokenize_cached(tiny_tokenizer, [text], tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 2 and not list(tmp_path.glob("*.tmp"))
    fingerprint = tokenizer_fingerprint(tiny_tokenizer)
    assert {p.stem for p in tmp_path.glob("*.npz")} == {cache_key(fingerprint, ["y"]), cache_key(fingerprint, ["z"])}
