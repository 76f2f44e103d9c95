"""Offline rows in every TRL form: prompt splits, exact token ids, skips, errors naming file:line, hh-rlhf unchanged."""

import gzip
import hashlib
import json

import pytest

from rlray.data import DataError
from rlray.data.pair_rows import PreferencePair
from rlray.data.pairs import collate_pairs, load_preference_pairs, pairs_table, require_preferences

SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE, GREEN = {"role": "assistant", "content": "It is blue."}, {"role": "assistant", "content": "It is green."}


def _write(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _load(tmp_path, rows, name="r.jsonl.gz", method=None):
    return load_preference_pairs([_write(tmp_path / name, rows)], method=method)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_preference_forms_split_prompt_and_responses(tmp_path):
    pairs, skipped = _load(tmp_path, [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},  # standard, explicit
        {"prompt": SKY, "chosen": [BLUE], "rejected": [GREEN]},  # conversational, explicit
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # standard, implicit (common prefix)
        {"chosen": SKY + [BLUE], "rejected": SKY + [GREEN]},  # conversational, implicit
        {"prompt": "What color is the sky?", "chosen": SKY + [BLUE], "rejected": SKY + [GREEN]},  # TRL ignores it
    ])  # fmt: skip
    assert skipped == 0
    assert pairs == [
        PreferencePair("r:0", (), " blue.", " green.", "The sky is"),
        PreferencePair("r:1", tuple(SKY), "It is blue.", "It is green."),
        PreferencePair("r:2", (), " blue.", " green.", "The sky is"),  # the space goes to the completions
        PreferencePair("r:3", tuple(SKY), "It is blue.", "It is green."),
        PreferencePair("r:4", tuple(SKY), "It is blue.", "It is green."),
    ]
    for method in ("dpo", "ipo", "kto", "orpo", "simpo", "reward_model", "sft"):
        for pair in pairs:
            require_preferences(pair, method, "r.jsonl.gz:1")


def test_sft_forms(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, *SKY, BLUE, {"role": "user", "content": "And grass?"},
            {"role": "assistant", "content": "Green."}]  # fmt: skip
    pairs, skipped = _load(tmp_path, [
        {"messages": chat},  # one record per assistant turn
        {"messages": SKY + [BLUE]},
        {"prompt": "The sky is", "completion": " blue."},
        {"prompt": SKY, "completion": [BLUE]},
        {"text": "The sky is blue."},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # pairs stay accepted (chosen side)
    ])  # fmt: skip
    assert skipped == 0
    assert pairs[:6] == [
        PreferencePair("r:0#0", tuple(chat[:2]), "It is blue.", None),
        PreferencePair("r:0#1", tuple(chat[:4]), "Green.", None),
        PreferencePair("r:1", tuple(SKY), "It is blue.", None),
        PreferencePair("r:2", (), " blue.", None, "The sky is"),
        PreferencePair("r:3", tuple(SKY), "It is blue.", None),
        PreferencePair("r:4", (), "The sky is blue.", None, ""),
    ]
    assert _load(tmp_path, [{"messages": chat}], name="s.jsonl.gz", method="sft")[0] == [
        PreferencePair("s:0#0", tuple(chat[:2]), "It is blue.", None), PreferencePair("s:0#1", tuple(chat[:4]), "Green.", None)
    ]  # fmt: skip
    for method in ("dpo", "kto"):  # the first SFT row is the error, named by file and 1-based line
        with pytest.raises(DataError, match=r"t.jsonl.gz:2: this row has no 'rejected' side: it is SFT data, which only "
                                            rf"algo.name=sft takes, not {method}; accepted rows: preference"):
            _load(tmp_path, [{"prompt": "Q", "chosen": "a", "rejected": "b"}, {"text": "x"}], name="t.jsonl.gz", method=method)


def test_unpaired_kto_rows(tmp_path, tiny_tokenizer):
    """TRL's unpaired preference type, standard and conversational, for kto; pairs may share the files."""
    rows = [
        {"prompt": "The sky is", "completion": " blue.", "label": True},  # standard
        {"prompt": SKY, "completion": [GREEN], "label": False},  # conversational
        {"prompt": "Q", "completion": "", "label": True},  # empty completion: a counted skip
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},  # a pair: two examples
    ]
    pairs, skipped = _load(tmp_path, rows, method="kto")
    assert skipped == 1
    assert pairs == [
        PreferencePair("r:0", (), " blue.", None, "The sky is", True),
        PreferencePair("r:1", tuple(SKY), "It is green.", None, None, False),
        PreferencePair("r:3", (), " blue.", " green.", "The sky is"),
    ]
    table = pairs_table(pairs, tiny_tokenizer, max_prompt_tokens=100, max_response_tokens=100)
    assert table.column("label").to_pylist() == [True, False, None]
    assert table.column("rejected_token_ids").to_pylist()[:2] == [[], []]
    assert table.column("chosen_token_ids").to_pylist()[1] == _ids(tiny_tokenizer, "It is green.") + [tiny_tokenizer.eos_token_id]
    batch = collate_pairs(table, tiny_tokenizer.pad_token_id)
    # examples: chosen rows 0 (desirable), 1 (undesirable), 2 (desirable, a pair's) and the pair's rejected row 5
    assert batch.labels.tolist() == [True, False, True] and batch.paired_mask.tolist() == [False, False, True]
    for method in ("dpo", "sft", "reward_model"):
        with pytest.raises(DataError, match=r"r.jsonl.gz:1: an unpaired row \('prompt', 'completion', 'label'\) has no "
                                            rf"'chosen'/'rejected' pair: only algo.name=kto takes it, not {method}"):
            _load(tmp_path, rows, method=method)


def test_token_ids_of_each_form(tmp_path, tiny_tokenizer):
    tok, eos = tiny_tokenizer, tiny_tokenizer.eos_token_id
    pairs, _ = _load(tmp_path, [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": SKY, "chosen": [BLUE], "rejected": [GREEN]},
        {"prompt": "The sky is", "completion": " blue."},
        {"text": "The sky is blue."},
    ])  # fmt: skip
    table = pairs_table(pairs, tok, max_prompt_tokens=1000, max_response_tokens=1000)
    prompts, chosen, rejected = (table.column(c).to_pylist() for c in ("prompt_token_ids", "chosen_token_ids",
                                                                        "rejected_token_ids"))
    # standard: the prompt tokenized as is, no chat template
    assert (prompts[0], chosen[0], rejected[0]) == (_ids(tok, "The sky is"), _ids(tok, " blue.") + [eos],
                                                    _ids(tok, " green.") + [eos])  # fmt: skip
    templated = tok.apply_chat_template(SKY, add_generation_prompt=True, tokenize=False)
    assert prompts[1] == _ids(tok, templated) and chosen[1] == _ids(tok, "It is blue.") + [eos]
    assert tok.decode(prompts[1]).endswith("<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n")
    # prompt-completion: no rejected side
    assert (prompts[2], chosen[2], rejected[2]) == (_ids(tok, "The sky is"), _ids(tok, " blue.") + [eos], [])
    # text: the loss covers every token that has a predecessor (the first token is the prompt)
    text = _ids(tok, "The sky is blue.") + [eos]
    assert (prompts[3], chosen[3], rejected[3]) == (text[:1], text[1:], [])
    b = collate_pairs(table, tok.pad_token_id)
    assert b.response_mask.sum(1).tolist() == [len(r) for r in chosen + rejected]


def test_skipped_rows_are_counted(tmp_path):
    pairs, skipped = _load(tmp_path, [
        {"prompt": "Q", "chosen": "same", "rejected": "same"},  # identical responses
        {"chosen": "abc", "rejected": "xyz"},  # no common prompt
        {"chosen": [BLUE], "rejected": [GREEN]},  # no common leading message
        {"prompt": SKY, "chosen": [{"role": "assistant", "content": ""}], "rejected": [GREEN]},  # empty response
        {"messages": SKY},  # no assistant turn
        {"prompt": "Q", "completion": ""},  # empty completion
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    ])  # fmt: skip
    assert (skipped, [p.prompt_id for p in pairs]) == (6, ["r:6"])


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Q", "chosen": "a"}, r":2: need fields 'chosen' and 'rejected'; 'rejected' is missing"),
        ({"chosen": SKY + [BLUE], "rejected": "text"}, r":2: 'rejected' must be a string or a non-empty list of messages"),
        ({"chosen": "text", "rejected": SKY + [GREEN]}, r":2: 'rejected' must be a string here, got list"),
        ({"prompt": SKY, "chosen": [{"role": "assistant"}], "rejected": [GREEN]},
         r":2: 'chosen'\[0\] must be a message \{'role': str, 'content': str\}"),
        ({"prompt": SKY, "chosen": [BLUE, BLUE], "rejected": [GREEN]},
         r":2: 'chosen' must hold exactly one assistant message after the prompt, got \['assistant', 'assistant'\]"),
        ({"chosen": SKY + [BLUE, *SKY], "rejected": SKY + [GREEN]}, r":2: 'chosen' must hold exactly one assistant"),
        ({"messages": "hi"}, r":2: 'messages' must be a string or a non-empty list of messages, got str"),
        ({"completion": "x"}, r":2: 'completion' needs a 'prompt'"),
        ({"prompt": "Q", "completion": "x", "label": 1}, r":2: 'label' must be true or false \(desirable or not\), got 1"),
        ({"prompt": "Q", "completion": "x", "label": "yes"}, r":2: 'label' must be true or false"),
        ({"prompt": SKY, "completion": [BLUE, GREEN], "label": True}, r":2: 'completion' must hold exactly one assistant"),
        ({"prompt": "Q", "completion": [BLUE]}, r":2: 'completion' must be a string here, got list"),
        ({"text": 3}, r":2: 'text' must be a string here, got int 3"),
        ({"question": "Q"}, r":2: no known fields \(keys \['question'\]\)"),
    ],
)
def test_malformed_rows_name_file_line_field_and_forms(tmp_path, row, message):
    path = _write(tmp_path / "bad.jsonl.gz", [{"text": "ok"}, row])
    with pytest.raises(DataError, match=f"bad.jsonl.gz{message}.*accepted rows: preference"):
        load_preference_pairs([path])


def test_hh_rlhf_table_is_unchanged(hh_rlhf_dir, tiny_tokenizer):
    """The hh-rlhf harmless test table, byte for byte as before the other forms (hash taken from the old parser)."""
    pairs, skipped = load_preference_pairs([str(hh_rlhf_dir / "test.jsonl.gz")])
    table = pairs_table(pairs, tiny_tokenizer, max_prompt_tokens=256, max_response_tokens=128)
    digest = hashlib.sha256()
    for name in table.column_names:
        if name != "label":  # the unpaired KTO label, added later: null for every pair
            digest.update(repr(table.column(name).to_pylist()).encode())
    assert table.column("label").null_count == table.num_rows
    assert (len(pairs), skipped) == (2303, 9)
    assert digest.hexdigest() == "df20702fddf8108dc7b8915eb64725d37e6a80423e203a242b7e5c740d5c0000"


def test_the_documented_rows_load_as_documented(tmp_path):
    """docs/data.md "Offline data": its three JSON blocks (preference, unpaired, SFT rows) load without a skip, each
    for the methods the page says take it."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    section = page.split("## Offline data")[1]
    blocks = section.split("```json\n")[1:]
    assert len(blocks) == 3
    loaded = []
    for i, (block, method) in enumerate(zip(blocks, ("dpo", "kto", "sft"), strict=True)):
        path = tmp_path / f"doc{i}.jsonl"
        path.write_text(block.split("```")[0])
        loaded.append(load_preference_pairs([str(path)], method=method))
    (pairs, skipped), (unpaired, unpaired_skipped), (sft, sft_skipped) = loaded
    assert (len(pairs), skipped, len(unpaired), unpaired_skipped, len(sft), sft_skipped) == (5, 0, 2, 0, 4, 0)
    assert {(p.prompt_text, p.chosen, p.rejected) for p in pairs[:4:3]} == {("The sky is", " blue.", " green.")}
    assert pairs[2] == PreferencePair("doc0:2", ({"role": "user", "content": "Can shoot a plan"},), "What?",
                                      "Can't shoot a plan.  What are you trying to do?")  # the hh-rlhf row, as is
    assert [p.label for p in unpaired] == [True, False] and unpaired[1].chosen == "It is green."
    assert all(p.rejected is not None for p in pairs) and all(p.rejected is None for p in sft)
    assert sft[-1] == PreferencePair("doc2:3", (), "The sky is blue.", None, "")
    for method in ("dpo", "sft"):  # the page's table: unpaired rows only for kto
        with pytest.raises(DataError, match=rf"doc1.jsonl:1: an unpaired row .* not {method}"):
            load_preference_pairs([str(tmp_path / "doc1.jsonl")], method=method)
