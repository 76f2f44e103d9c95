"""Token in, token out on a real tokenizer (SmolLM2's, with the tool-capable template): masks, logprobs and
exact sampled tokens across 3 turns with tool calls; stop-string turns; a template that rewrites history."""

from __future__ import annotations

import pytest

from rlray.envs.episode import TemplateDriftError, open_trajectory, truncate_observations
from rlray.envs.tools import tool_schemas
from rlray.models.loading import load_tokenizer


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@pytest.fixture(scope="module")
def tools_tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path, "smollm2-tools")


def sample(tok, text: str, *, eos: bool = True) -> list[int]:
    """Returns token ids as an engine would sample them: the text's tokens, then the end-of-turn token."""
    return list(tok(text, add_special_tokens=False)["input_ids"]) + ([tok.eos_token_id] if eos else [])


def test_three_turns_with_tool_calls_keep_sampled_tokens_and_mask_observations(tools_tokenizer):
    tok = tools_tokenizer
    schemas = tool_schemas([add])
    prompt = [{"role": "user", "content": "What is 2 + 2, then plus 3?"}]
    traj = open_trajectory(tok, prompt, tools=schemas)
    rendered_prompt = tok.apply_chat_template(prompt, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert traj.prompt_ids == tok(rendered_prompt, add_special_tokens=False)["input_ids"]
    assert '"name": "add"' in rendered_prompt

    turns = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>',
             '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 3}}\n</tool_call>',
             "The answer is 7."]
    observations = [[{"role": "tool", "name": "add", "content": "4"}], [{"role": "tool", "name": "add", "content": "7"}]]
    sampled_spans = []
    for k, text in enumerate(turns):
        ids = sample(tok, text)
        logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
        start = len(traj.response_ids)
        traj.add_turn(ids, logprobs, "stop", policy_version=3, text=text)
        sampled_spans.append((start, start + len(ids)))
        assert traj.response_ids[start:] == ids  # the engine's tokens, verbatim
        if k < 2:
            n = traj.add_observations(tok, observations[k])
            obs = traj.response_ids[-n:]
            assert tok.decode(obs) == (f"\n<|im_start|>user\n<tool_response>\n{observations[k][0]['content']}\n"
                                       "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.turn_spans == sampled_spans and traj.num_turns == 3
    # loss mask: True exactly on the sampled spans; logprobs 0.0 on every observation token
    in_turn = [any(a <= i < b for a, b in sampled_spans) for i in range(len(traj.response_ids))]
    assert traj.loss_mask == in_turn
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if not m)
    assert sum(traj.loss_mask) == sum(len(sample(tok, t)) for t in turns)
    # the whole sequence is the template's rendering of the whole conversation (the last turn closes with "\n")
    conversation = prompt + [{"role": "assistant", "content": turns[0]}, *observations[0],
                             {"role": "assistant", "content": turns[1]}, *observations[1],
                             {"role": "assistant", "content": turns[2]}]
    assert tok.decode(traj.token_ids) + "\n" == tok.apply_chat_template(conversation, tools=schemas, tokenize=False)


def test_non_canonical_sampled_tokens_are_never_retokenized(tools_tokenizer):
    tok = tools_tokenizer
    traj = open_trajectory(tok, [{"role": "user", "content": "Say hello"}])
    # "hello" sampled one character at a time: a tokenization the tokenizer itself would never produce
    chars = [tok.convert_tokens_to_ids(c) for c in "hello"] + [tok.eos_token_id]
    assert chars[:5] != tok("hello", add_special_tokens=False)["input_ids"]
    traj.add_turn(chars, [-1.0] * 6, "stop", 0, "hello")
    traj.add_observations(tok, [{"role": "user", "content": "again"}])
    traj.add_turn(sample(tok, "hello"), [-1.0] * len(sample(tok, "hello")), "stop", 0, "hello")
    assert traj.response_ids[:6] == chars


def test_a_turn_without_end_token_is_closed_by_an_observation_token(tools_tokenizer):
    tok = tools_tokenizer
    traj = open_trajectory(tok, [{"role": "user", "content": "Guess"}])
    ids = sample(tok, "<guess>5</guess>", eos=False)  # stopped on a stop string: no <|im_end|> sampled
    traj.add_turn(ids, [-0.5] * len(ids), "stop", 0, "<guess>5</guess>")
    n = traj.add_observations(tok, [{"role": "user", "content": "higher"}])
    obs = traj.response_ids[len(ids):]
    assert len(obs) == n and obs[0] == tok.eos_token_id
    assert tok.decode(obs) == "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert traj.loss_mask == [True] * len(ids) + [False] * n


def test_a_template_that_rewrites_history_ends_the_episode(tiny_model_path):
    # drops the content of every assistant turn but the last one (as reasoning templates drop old thoughts)
    rewriting = (
        "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not loop.last -%}<|im_start|>assistant\n"
        "<|im_end|>\n{%- else -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
    )
    tok = load_tokenizer(tiny_model_path, rewriting)
    traj = open_trajectory(tok, [{"role": "user", "content": "hi"}])
    ids = sample(tok, "thinking")
    traj.add_turn(ids, [0.0] * len(ids), "stop", 0, "thinking")
    before = list(traj.response_ids)
    with pytest.raises(TemplateDriftError, match="rewrites earlier turns"):
        traj.add_observations(tok, [{"role": "user", "content": "next"}])
    assert traj.response_ids == before  # nothing drifted was appended


def test_observations_are_cut_to_the_token_cap(tools_tokenizer):
    tok = tools_tokenizer
    long = " ".join(["word"] * 50)
    got, cut = truncate_observations(tok, [{"role": "tool", "content": long}, {"role": "tool", "content": "short"}], 8)
    assert cut == 1
    assert got[1]["content"] == "short"
    assert got[0]["content"].endswith(" [truncated]")
    assert len(tok(got[0]["content"][: -len(" [truncated]")], add_special_tokens=False)["input_ids"]) == 8
