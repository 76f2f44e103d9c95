"""Token exactness of agent conversations (rlray.envs.agents.conversation) on SmolLM2's real tokenizer (the tiny-random model
carries it) with the smollm2-tools template: extension reuses the sampled tokens, history rewrites cut segments."""

from __future__ import annotations

import json

import pytest

from rlray.envs.agents.conversation import AgentConversation, GatewayError, Sampled, normalize_message

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from rlray.models import load_tokenizer

    return load_tokenizer(tiny_model_path, "smollm2-tools")


def sampled(tok, text, lp=-0.5):
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Sampled(ids, [lp] * len(ids), "stop", 3)


def test_normalize_reads_openai_messages_as_the_template_does():
    sdk = {"role": "assistant", "content": None, "refusal": None, "annotations": [],
           "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    assert normalize_message(sdk) == {"role": "assistant", "content": "",
                                      "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}
    assert normalize_message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) \
        == {"role": "user", "content": "ab"}
    assert normalize_message({"role": "function", "name": "add", "content": "2"}) == {"role": "tool", "content": "2", "name": "add"}
    for bad in ({"content": "x"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                {"role": "assistant", "tool_calls": [{"function": {}}]}):
        with pytest.raises(GatewayError) as err:
            normalize_message(bad)
        assert err.value.status == 400


def test_extending_calls_reuse_the_sampled_tokens_and_add_only_the_new_text(tok):
    conv = AgentConversation(tok)
    user = [{"role": "user", "content": "What is 1 + 1?"}]
    first = conv.chat_prompt([normalize_message(m) for m in user], TOOLS)
    expected = tok(tok.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
    assert first == expected
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    turn = sampled(tok, call)
    message = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}
    conv.record(turn, message, call)
    # the agent sends back what it got (SDK form, with ids and JSON-string arguments) and the tool's answer
    wire = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 1})}}]}
    second = conv.chat_prompt([normalize_message(m) for m in [*user, wire, {"role": "tool", "content": "2"}]], TOOLS)
    assert second[: len(first) + len(turn.token_ids)] == first + turn.token_ids  # the sampled tokens, not re-tokenized
    new = tok.decode(second[len(first) + len(turn.token_ids):])
    assert new == "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert conv.drift == 0 and conv.num_turns == 1
    (seg,) = conv.segments()
    assert seg.loss_mask == [True] * len(turn.token_ids) + [False] * (len(second) - len(first) - len(turn.token_ids))
    assert seg.logprobs[: len(turn.token_ids)] == turn.logprobs and set(seg.logprobs[len(turn.token_ids):]) == {0.0}
    assert seg.observation_tokens == len(second) - len(first) - len(turn.token_ids)


@pytest.mark.parametrize("rewrite", ["drop", "edit", "reorder", "tools"])
def test_rewriting_history_cuts_a_new_segment(tok, rewrite):
    conv = AgentConversation(tok)
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    conv.chat_prompt(user, None)
    conv.record(sampled(tok, "Hello!"), {"role": "assistant", "content": "Hello!"}, "Hello!")
    history = [*user, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    tools = None
    if rewrite == "drop":
        history = [history[1], *history[2:]]
    elif rewrite == "edit":
        history[2] = {"role": "assistant", "content": "Hello"}
    elif rewrite == "reorder":
        history = [history[1], history[0], *history[2:]]
    else:
        tools = TOOLS
    ids = conv.chat_prompt(history, tools)
    assert ids == tok(tok.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    conv.record(sampled(tok, "Bye"), {"role": "assistant", "content": "Bye"}, "Bye")
    assert conv.drift == 1 and [s.num_turns for s in conv.segments()] == [1, 1]


def test_an_unanswered_segment_is_replaced_not_counted(tok):
    conv = AgentConversation(tok)
    conv.chat_prompt([{"role": "user", "content": "a"}], None)  # e.g. refused before sampling
    conv.chat_prompt([{"role": "user", "content": "b"}], None)
    assert conv.drift == 0 and conv.segments() == []


def test_text_completions_extend_their_text_and_cut_otherwise(tok):
    conv = AgentConversation(tok)
    first = conv.text_prompt("Q: 2+2?")
    turn = sampled(tok, " A: 4")
    conv.record(turn, None, " A: 4")
    second = conv.text_prompt("Q: 2+2? A: 4\nQ: 3+3?")
    assert second == first + turn.token_ids + tok("\nQ: 3+3?", add_special_tokens=False)["input_ids"]
    conv.record(sampled(tok, " A: 6"), None, " A: 6")
    conv.text_prompt("something else")
    assert conv.drift == 1
    ids = conv.text_prompt([5, 6, 7])  # token ids open a segment of their own (the previous one had no turn)
    assert ids == [5, 6, 7] and conv.drift == 1


def test_a_template_that_cannot_render_is_a_400(tok):
    conv = AgentConversation(tok)
    with pytest.raises(GatewayError) as err:
        conv.chat_prompt([{"role": "user", "content": "a", "tool_calls": None}, {"role": "tool"}], None)
    assert err.value.status == 400 and "cannot render" in str(err.value)
    with pytest.raises(GatewayError):
        conv.chat_prompt([], None)


def test_each_token_keeps_its_version_across_calls_and_cuts(tok):
    """Partial rollouts: a call's tokens keep the versions the engine sampled them with (an update inside the call);
    the agent's text between two calls (loss mask off) the version of the token before it; a new segment (the agent's
    next prompt does not extend the last) starts from its own call's versions."""
    conv = AgentConversation(tok)
    first = conv.text_prompt("Q: 1+1?")
    conv.record(Sampled([5, 6, 7], [-0.1, -0.2, -0.3], "length", 2, [2, 3, 3]), None, " two")
    more = conv.text_prompt("Q: 1+1? two\nQ: 2+2?")  # extends: the tokens of "\nQ: 2+2?" appended
    rest = len(more) - len(first) - 3
    assert rest == len(tok("\nQ: 2+2?", add_special_tokens=False)["input_ids"])
    conv.record(Sampled([8, 9], [-0.4, -0.5], "stop", 3, [3, 4]), None, " four")
    conv.text_prompt("Another question.")  # does not extend: a new segment
    conv.record(Sampled([10], [-0.6], "stop", 4), None, " ok")  # no per-token versions given: the call's version
    a, b = conv.segments()
    assert a.versions == [2, 3, 3] + [3] * rest + [3, 4] and a.policy_versions == [2, 3]
    assert a.logprobs == [-0.1, -0.2, -0.3] + [0.0] * rest + [-0.4, -0.5]
    assert a.loss_mask == [True] * 3 + [False] * rest + [True] * 2
    assert (b.versions, b.policy_versions, b.logprobs) == ([4], [4], [-0.6])
    with pytest.raises(ValueError, match="Sampled: 2 tokens, 2 logprobs and 1 versions"):
        Sampled([1, 2], [0.0, 0.0], "stop", 0, [0])
