"""Tests for rlray.data.prompts: chat-template rendering, long-prompt filtering and the PromptStream cursor."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlray.config import DataConfig
from rlray.data.prompts import PromptStream, filter_long_prompts, prepare_prompts, render_prompt
from rlray.data.rows import PromptRow, load_prompt_rows
from rlray.models.loading import load_tokenizer


def _rows(n: int) -> list[PromptRow]:
    return [PromptRow(f"r:{i}", f"question {i}", {"answer": str(i)}) for i in range(n)]


def _ids(rows: list[PromptRow]) -> list[int]:
    return [int(r.prompt_id.split(":")[1]) for r in rows]


def test_render_prompt_with_system_turn(tiny_tokenizer):
    ids = render_prompt(tiny_tokenizer, "What is 2+2?", instruction="End with '#### N'.", system_prompt="You do math.")
    expected = (
        "<|im_start|>system\nYou do math.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?\n\nEnd with '#### N'.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tiny_tokenizer.decode(ids) == expected
    assert ids.count(tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # BOS not doubled


def test_render_prompt_default_system_and_user_first_template(tiny_model_path, tiny_tokenizer):
    ids = render_prompt(tiny_tokenizer, "Q?", instruction="I.", system_prompt=None)
    text = tiny_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system turn
    assert text.endswith("<|im_start|>user\nQ?\n\nI.<|im_end|>\n<|im_start|>assistant\n")
    plain = load_tokenizer(
        tiny_model_path,
        chat_template=(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    )
    text = plain.decode(render_prompt(plain, "Q?", instruction="I.", system_prompt=None))
    assert text == "<|im_start|>user\nQ?\n\nI.<|im_end|>\n<|im_start|>assistant\n"


GSM8K_INSTRUCTION = (  # the GSM8K instruction of configs before data.instruction defaulted to ""
    "Answer in at most three short lines and end with the final answer as '#### <number>'.\n\n"
    "Example:\nQuestion: Tom has 3 bags with 4 apples each. He eats 2 apples. How many apples are left?\n"
    "Answer: 3 * 4 = 12 apples. 12 - 2 = 10 apples.\n#### 10"
)


def _template_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_render_gsm8k_question_is_unchanged(gsm8k_dir, tiny_tokenizer):
    rows = load_prompt_rows([str(gsm8k_dir / "train.jsonl")], prompt_column="question")[:20]
    for row in rows:
        user = {"role": "user", "content": row.prompt + "\n\n" + GSM8K_INSTRUCTION}
        expected = _template_ids(tiny_tokenizer, [user], add_generation_prompt=True)
        assert render_prompt(tiny_tokenizer, row.prompt, instruction=GSM8K_INSTRUCTION, system_prompt=None) == expected
        system = {"role": "system", "content": "You do math."}
        expected = _template_ids(tiny_tokenizer, [system, user], add_generation_prompt=True)
        assert render_prompt(tiny_tokenizer, row.prompt, instruction=GSM8K_INSTRUCTION, system_prompt="You do math.") == expected


def test_render_standard_prompt_without_instruction(tiny_tokenizer):
    text = tiny_tokenizer.decode(render_prompt(tiny_tokenizer, "Q?", instruction="", system_prompt="S."))
    assert text == "<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"


def test_render_conversation_instruction_goes_into_last_user_message(tiny_tokenizer):
    prompt = [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Second?"},
    ]
    before = json.dumps(prompt)
    text = tiny_tokenizer.decode(render_prompt(tiny_tokenizer, prompt, instruction="Be brief.", system_prompt="S."))
    assert text == (
        "<|im_start|>system\nS.<|im_end|>\n"
        "<|im_start|>user\nFirst?<|im_end|>\n"
        "<|im_start|>assistant\nOne.<|im_end|>\n"
        "<|im_start|>user\nSecond?\n\nBe brief.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert json.dumps(prompt) == before  # the row's messages are not modified
    no_instruction = render_prompt(tiny_tokenizer, prompt, instruction="", system_prompt=None)
    assert no_instruction == _template_ids(tiny_tokenizer, prompt, add_generation_prompt=True)
    assert tiny_tokenizer.decode(no_instruction).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_render_conversation_own_system_message_wins(tiny_tokenizer):
    prompt = [{"role": "system", "content": "Row system."}, {"role": "user", "content": "Hi"}]
    for system_prompt in ("Config system.", None):
        text = tiny_tokenizer.decode(render_prompt(tiny_tokenizer, prompt, instruction="", system_prompt=system_prompt))
        assert text == "<|im_start|>system\nRow system.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_render_conversation_prefill_is_continued(tiny_tokenizer):
    prompt = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Let me add:"},
    ]
    ids = render_prompt(tiny_tokenizer, prompt, instruction="End with '#### N'.", system_prompt="ignored")
    assert tiny_tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?\n\nEnd with '#### N'.<|im_end|>\n"
        "<|im_start|>assistant\nLet me add:"  # open: no <|im_end|>, no second assistant header
    )
    assert ids[-len(tiny_tokenizer("Let me add:")["input_ids"]):] == tiny_tokenizer("Let me add:")["input_ids"]


def test_render_conversation_without_user_message_and_instruction(tiny_tokenizer):
    with pytest.raises(ValueError, match="no 'user' message to append data.instruction to"):
        render_prompt(tiny_tokenizer, [{"role": "system", "content": "S"}], instruction="I.", system_prompt=None)


def test_prepare_prompts_mixes_both_formats(tmp_path, tiny_tokenizer):
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps({"prompt": "Q?"}) + "\n" + json.dumps({"prompt": [{"role": "user", "content": "Q?"}]}) + "\n")
    rows = load_prompt_rows([str(path)])
    kept_rows, kept_ids, skipped = prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=100, instruction="I.",
                                                   system_prompt=None)
    assert kept_rows == rows and skipped == 0
    assert kept_ids[0] == kept_ids[1] == render_prompt(tiny_tokenizer, "Q?", instruction="I.", system_prompt=None)


def test_prepare_prompts_on_real_rows(gsm8k_dir, tiny_tokenizer):
    cfg = DataConfig()
    rows = load_prompt_rows([str(gsm8k_dir / "test.jsonl")], prompt_column="question")[:200]
    ids = [render_prompt(tiny_tokenizer, r.prompt, instruction=cfg.instruction, system_prompt=None) for r in rows]
    render = dict(instruction=cfg.instruction, system_prompt=None)
    kept_rows, kept_ids, skipped = prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, **render)
    assert skipped == sum(len(i) > cfg.max_prompt_tokens for i in ids) and len(kept_rows) == 200 - skipped
    assert kept_ids == [i for i in ids if len(i) <= cfg.max_prompt_tokens]
    median = sorted(len(i) for i in ids)[100]
    kept_rows, kept_ids, skipped = prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=median, **render)
    assert skipped == sum(len(i) > median for i in ids) > 0 and max(len(i) for i in kept_ids) == median
    assert kept_rows == [r for r, i in zip(rows, ids, strict=True) if len(i) <= median]


def test_filter_long_prompts_hand_case():
    rows = _rows(4)
    ids = [[1] * 3, [1] * 5, [1] * 4, [1] * 6]
    kept_rows, kept_ids, skipped = filter_long_prompts(rows, ids, 4)
    assert _ids(kept_rows) == [0, 2] and [len(i) for i in kept_ids] == [3, 4] and skipped == 2
    with pytest.raises(ValueError, match="4 rows but 3 token id lists"):
        filter_long_prompts(rows, ids[:3], 4)


def test_stream_in_order_crosses_epochs():
    stream = PromptStream(_rows(5), seed=0, shuffle=False)
    assert _ids(stream.next_batch(3)) == [0, 1, 2]
    assert _ids(stream.next_batch(3)) == [3, 4, 0]
    assert (stream.epoch, stream.position) == (1, 1)
    assert _ids(stream.next_batch(9)) == [1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert (stream.epoch, stream.position) == (3, 0)


def test_stream_shuffle_is_a_seeded_permutation_per_epoch():
    stream = PromptStream(_rows(20), seed=3, shuffle=True)
    epoch0, epoch1 = _ids(stream.next_batch(20)), _ids(stream.next_batch(20))
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert epoch0 != epoch1 and epoch0 != list(range(20))
    again = PromptStream(_rows(20), seed=3, shuffle=True)
    assert _ids(again.next_batch(40)) == epoch0 + epoch1
    other = PromptStream(_rows(20), seed=4, shuffle=True)
    assert _ids(other.next_batch(20)) != epoch0


def test_stream_batch_larger_than_epoch():
    stream = PromptStream(_rows(5), seed=0, shuffle=True)
    counts = Counter(_ids(stream.next_batch(12)))
    assert sorted(counts.values()) == [2, 2, 2, 3, 3] and (stream.epoch, stream.position) == (2, 2)
    with pytest.raises(ValueError, match="n must be >= 1"):
        stream.next_batch(0)


def test_stream_state_round_trip_resumes_exactly():
    stream = PromptStream(_rows(7), seed=11, shuffle=True)
    stream.next_batch(5)
    stream.next_batch(5)
    state = json.loads(json.dumps(stream.state_dict()))  # snapshots store it as JSON
    assert (state["epoch"], state["position"]) == (1, 3)
    resumed = PromptStream(_rows(7), seed=11, shuffle=True)
    resumed.load_state_dict(state)
    for n in (3, 6, 9):
        assert resumed.next_batch(n) == stream.next_batch(n)


def test_stream_state_mismatch_errors():
    state = PromptStream(_rows(7), seed=11, shuffle=True).state_dict()
    with pytest.raises(ValueError, match="seed=11 does not match this stream \\(12\\).*run.seed"):
        PromptStream(_rows(7), seed=12, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows=7 does not match this stream \\(8\\)"):
        PromptStream(_rows(8), seed=11, shuffle=True).load_state_dict(state)
    renamed = [PromptRow(f"x:{i}", "q", {}) for i in range(7)]
    with pytest.raises(ValueError, match="rows_fingerprint"):
        PromptStream(renamed, seed=11, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="at least one prompt row"):
        PromptStream([], seed=0, shuffle=True)
