"""Preference pairs: hh-rlhf parsing, validation errors naming file and row, the split, tokens and the forward layout."""

import gzip
import json

import pytest
import torch

from rlray.data import DataError
from rlray.data.pairs import collate_pairs, load_preference_pairs, pairs_table, parse_dialogue, split_pairs

DIALOGUE = "\n\nHuman: hi there\n\nAssistant: hello!\n\nHuman: what is 2+2?\n\nAssistant: {}"


def _write(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def test_parse_dialogue_splits_prompt_from_final_assistant_turn():
    messages, answer = parse_dialogue(DIALOGUE.format("It is 4."))
    assert messages == [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "what is 2+2?"},
    ]
    assert answer == "It is 4."
    for bad in ("no turns at all", "\n\nHuman: only a question", "\n\nAssistant: no human turn"):
        with pytest.raises(ValueError):
            parse_dialogue(bad)


def test_load_counts_unusable_pairs_and_keeps_ids(tmp_path):
    path = _write(tmp_path / "p.jsonl.gz", [
        {"chosen": DIALOGUE.format("4"), "rejected": DIALOGUE.format("5")},
        {"chosen": DIALOGUE.format("4"), "rejected": "\n\nHuman: other\n\nAssistant: 5"},  # prompts differ
        {"chosen": DIALOGUE.format(""), "rejected": DIALOGUE.format("5")},  # empty chosen response
        {"chosen": DIALOGUE.format("four"), "rejected": DIALOGUE.format("five")},
    ])  # fmt: skip
    pairs, skipped = load_preference_pairs([path])
    assert skipped == 2
    assert [p.prompt_id for p in pairs] == ["p:0", "p:3"]
    assert (pairs[1].chosen, pairs[1].rejected) == ("four", "five")
    assert load_preference_pairs([path], max_pairs=1)[0] == pairs[:1]


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", r":2: not valid JSON \(Expecting property name enclosed in double quotes at column 2\)"),
        ({"chosen": DIALOGUE.format("4")}, r":2: need fields 'chosen' and 'rejected'; 'rejected' is missing "
                                            r"\(keys \['chosen'\]\)"),
        ({"chosen": 4, "rejected": DIALOGUE.format("5")}, r":2: 'chosen' must be a string or a non-empty list of messages, got int 4"),
        ({"chosen": DIALOGUE.format("4"), "rejected": None}, r":2: 'rejected' must be a string .*got NoneType None"),
        ({"chosen": "plain text", "rejected": DIALOGUE.format("5")}, r":2: 'chosen': expected a dialogue"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, row, message):
    path = _write(tmp_path / "bad.jsonl.gz", [{"chosen": DIALOGUE.format("4"), "rejected": DIALOGUE.format("5")}, row])
    with pytest.raises(DataError, match=f"bad.jsonl.gz{message}"):
        load_preference_pairs([path])


def test_empty_or_missing_file(tmp_path):
    with pytest.raises(DataError, match="has no rows"):
        load_preference_pairs([_write(tmp_path / "e.jsonl.gz", [])])
    with pytest.raises(DataError, match="cannot read"):
        load_preference_pairs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(DataError, match="offline.pairs_files"):
        load_preference_pairs([])


def test_hh_rlhf_harmless_test_split(hh_rlhf_dir):
    pairs, skipped = load_preference_pairs([str(hh_rlhf_dir / "test.jsonl.gz")])
    # 2312 rows: 5 have different prompts on the two sides and 4 an empty final chosen turn (none overlap)
    assert (len(pairs), skipped) == (2303, 9)
    train, held = split_pairs(pairs, eval_fraction=0.05, seed=0)
    assert (len(train), len(held)) == (2188, 115)


def test_split_is_seeded_disjoint_and_ordered():
    pairs = [type("P", (), {"prompt_id": str(i)})() for i in range(20)]
    train, held = split_pairs(pairs, eval_fraction=0.25, seed=3)
    again = split_pairs(pairs, eval_fraction=0.25, seed=3)
    assert (train, held) == again
    assert len(held) == 5 and {p.prompt_id for p in train} | {p.prompt_id for p in held} == {str(i) for i in range(20)}
    assert [int(p.prompt_id) for p in train] == sorted(int(p.prompt_id) for p in train)
    assert split_pairs(pairs, eval_fraction=0.25, seed=4)[1] != held
    with pytest.raises(DataError, match="leave no training pair"):
        split_pairs(pairs[:1], eval_fraction=0.0, seed=0)


def test_pairs_table_tokens_and_truncation(tmp_path, tiny_tokenizer):
    path = _write(tmp_path / "p.jsonl.gz", [
        {"chosen": DIALOGUE.format("It is 4."), "rejected": DIALOGUE.format("Five, I think, or maybe six or seven.")},
        {"chosen": DIALOGUE.format("4"), "rejected": DIALOGUE.format("22")},
    ])  # fmt: skip
    pairs, _ = load_preference_pairs([path])
    tok = tiny_tokenizer
    full = pairs_table(pairs, tok, max_prompt_tokens=1000, max_response_tokens=1000)
    cut = pairs_table(pairs, tok, max_prompt_tokens=8, max_response_tokens=4)
    prompt = full.column("prompt_token_ids")[0].as_py()
    assert tok.decode(prompt).endswith("<|im_start|>user\nwhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert cut.column("prompt_token_ids")[0].as_py() == prompt[-8:]  # the prompt keeps its end
    chosen = full.column("chosen_token_ids")[0].as_py()
    assert chosen == tok("It is 4.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rejected = full.column("rejected_token_ids")[0].as_py()
    assert cut.column("rejected_token_ids")[0].as_py() == rejected[:4]  # a response keeps its start (EOS cut)
    # KTO's mismatched completion: the next pair's chosen response (wrapping around)
    assert full.column("kl_token_ids").to_pylist() == [full.column("chosen_token_ids")[1].as_py(), chosen]
    assert full.column("ref_chosen_logps").null_count == 2


def test_collate_pairs_layout_and_masks_from_lengths(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    path = _write(tmp_path / "p.jsonl.gz", [
        {"chosen": DIALOGUE.format("a b c"), "rejected": DIALOGUE.format("d")},
        {"chosen": "\n\nHuman: x\n\nAssistant: y", "rejected": "\n\nHuman: x\n\nAssistant: z z z z z"},
    ])  # fmt: skip
    table = pairs_table(load_preference_pairs([path])[0], tok, max_prompt_tokens=1000, max_response_tokens=1000)
    b = collate_pairs(table, tok.pad_token_id, with_kl=True)
    responses = table.column("chosen_token_ids").to_pylist() + table.column("rejected_token_ids").to_pylist()
    assert b.inputs.input_ids.shape[0] == 4 and b.kl_inputs.input_ids.shape[0] == 2
    assert b.inputs.response_lengths.tolist() == [len(r) for r in responses]
    kl_responses = table.column("kl_token_ids").to_pylist()
    assert b.kl_response_mask.sum(1).tolist() == [len(r) for r in kl_responses]
    for i, r in enumerate(responses):  # True exactly over the response, though EOS == pad ends each response
        assert b.response_mask[i].tolist() == [True] * len(r) + [False] * (b.inputs.response_ids.shape[1] - len(r))
        assert b.inputs.response_ids[i, : len(r)].tolist() == r
    prompts = table.column("prompt_token_ids").to_pylist() * 2
    p_max = max(len(p) for p in prompts)
    for i, p in enumerate(prompts):  # left-padded prompts: the response starts at column p_max on every row
        assert b.inputs.input_ids[i, p_max - len(p) : p_max].tolist() == p
        assert b.inputs.attention_mask[i].sum() == len(p) + len(responses[i])
    assert torch.equal(b.inputs.position_ids[:, p_max], torch.tensor([len(p) for p in prompts]))
