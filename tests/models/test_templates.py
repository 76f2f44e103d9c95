"""The shipped chat template 'smollm2-tools': SmolLM2's rendering without tools, Hermes tool calls, the prefix property."""

from __future__ import annotations

import json

import pytest

from rlray.models import CHAT_TEMPLATES, ModelError, load_tokenizer, resolve_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
        {"role": "system", "content": "late system"},
    ],
]


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


@pytest.fixture(scope="module")
def tokenizers(tiny_model_path):
    """Returns (SmolLM2's own tokenizer, the same with 'smollm2-tools')."""
    return load_tokenizer(tiny_model_path), load_tokenizer(tiny_model_path, chat_template="smollm2-tools")


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_alias_and_jinja_string_both_load(tiny_model_path):
    assert CHAT_TEMPLATES == {"smollm2-tools": "smollm2_tools.jinja"}
    text = resolve_chat_template("smollm2-tools")
    assert text.startswith("{#- SmolLM2's ChatML template") and "<tool_call>" in text
    assert resolve_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ModelError, match=r"model.chat_template='smollm2-tool' is neither .* \['smollm2-tools'\]"):
        resolve_chat_template("smollm2-tool")  # a typo would otherwise render as literal text
    assert load_tokenizer(tiny_model_path, chat_template="smollm2-tools").chat_template == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_without_tools_it_renders_like_smollm2(tokenizers, messages, add_generation_prompt):
    original, tools = tokenizers
    assert "You are a helpful AI assistant named SmolLM" in original.chat_template  # the default system we copy
    expected = render(original, messages, add_generation_prompt=add_generation_prompt)
    assert render(tools, messages, add_generation_prompt=add_generation_prompt) == expected


def test_tools_and_a_tool_call_conversation(tokenizers):
    _, tok = tokenizers
    messages = [
        {"role": "user", "content": "6*7?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}},
                {"name": "multiply", "arguments": '{"a": 1, "b": 2}'},  # flat call, arguments as a JSON string
            ],
        },
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "tool", "name": "multiply", "content": "2"},
    ]
    text = render(tok, messages, tools=[multiply], add_generation_prompt=True)
    schema = json.dumps(
        {
            "type": "function",
            "function": {
                "name": "multiply",
                "description": "Multiplies two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "The first factor."},
                        "b": {"type": "integer", "description": "The second factor."},
                    },
                    "required": ["a", "b"],
                },
                "return": {"type": "integer"},
            },
        }
    )
    system = text.split("<|im_end|>\n", 1)[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n# Tools")
    assert f"<tools>\n{schema}\n</tools>" in system and "<tool_call></tool_call>" in system
    assert text.split("<|im_end|>\n", 1)[1] == (
        "<|im_start|>user\n6*7?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>\n'
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_given_system_message_holds_the_tools(tokenizers):
    _, tok = tokenizers
    text = render(tok, [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "q"}], tools=[multiply])
    assert text.startswith("<|im_start|>system\nBe exact.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1 and text.endswith("<|im_start|>user\nq<|im_end|>\n")


def test_assistant_text_before_a_tool_call(tokenizers):
    _, tok = tokenizers
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 1, "b": 1}}}
    text = render(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me see.", "tool_calls": [call]}])
    expected = '<|im_start|>assistant\nLet me see.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 1}}\n</tool_call>'
    assert text.endswith(expected + "<|im_end|>\n")


@pytest.mark.parametrize(("which", "with_tools"), [(0, False), (1, False), (1, True)])
def test_prefix_property(tokenizers, which, with_tools):
    """Rendering messages[:k] (ending with an assistant turn) is a prefix of messages[:k] + observations rendered with
    the generation prompt: the rollout loop tokenizes only the new observation text."""
    tok = tokenizers[which]
    tools = [multiply] if with_tools else None
    history = [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": '<tool_call>\n{"name": "multiply"}\n</tool_call>'}]
    for observations in (
        [{"role": "tool", "name": "multiply", "content": "42"}],
        [{"role": "tool", "name": "multiply", "content": "42"}, {"role": "tool", "name": "multiply", "content": "1"}],
        [{"role": "user", "content": "Wrong, try again."}],
    ):
        before = render(tok, history, tools=tools)
        after = render(tok, history + observations, tools=tools, add_generation_prompt=True)
        assert after.startswith(before) and after.endswith("<|im_start|>assistant\n")
        assert len(after) > len(before) + len(observations[0]["content"])


def test_trl_accepts_it_as_tool_capable(tokenizers):
    """TRL's GRPOTrainer refuses environment_factory unless the template renders a whole tool-call exchange."""
    from trl.chat_template_utils import supports_tool_calling

    original, tools = tokenizers
    assert supports_tool_calling(tools) and not supports_tool_calling(original)
