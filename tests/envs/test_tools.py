"""Tool schemas, the Hermes tool-call parser and call_tool's error observations."""

from __future__ import annotations

import json

import pytest

from rlray.envs import TOOL_CALL_PARSERS, ToolCall, call_tool, parse_tool_calls, tool_result_text, tool_schemas


def multiply(a: int, b: float = 1.0) -> float:
    """Multiplies two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def fails(x: str) -> str:
    """Always raises.

    Args:
        x: Ignored.
    """
    raise RuntimeError(f"broken on {x}")


async def shout(text: str) -> dict:
    """Upper-cases the text.

    Args:
        text: What to shout.
    """
    return {"loud": text.upper(), "n": [1, 2]}


def no_hints(a):
    """Has no type hints.

    Args:
        a: Anything.
    """
    return a


def test_tool_schemas_follow_transformers_format():
    (schema,) = tool_schemas([multiply])
    assert schema == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiplies two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first factor."},
                    "b": {"type": "number", "description": "The second factor."},
                },
                "required": ["a"],
            },
            "return": {"type": "number"},
        },
    }


def test_tool_schemas_error_names_the_function():
    with pytest.raises(ValueError, match="'no_hints'.*type hint"):
        tool_schemas([multiply, no_hints])


def test_parse_one_call_with_surrounding_text():
    text = 'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("multiply", {"a": 3, "b": 4})], [])


def test_parse_several_calls_and_missing_arguments():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": "1"}}</tool_call> and '
        '<tool_call>\n{"name": "b"}\n</tool_call><tool_call>{"name": "c", "arguments": {}}</tool_call>'
    )
    calls, errors = parse_tool_calls(text, parser="hermes")
    assert calls == [ToolCall("a", {"x": "1"}), ToolCall("b", {}), ToolCall("c", {})]
    assert errors == []


def test_parse_no_call():
    assert parse_tool_calls("The answer is 12.") == ([], [])


def test_parse_malformed_calls_become_errors_and_good_ones_survive():
    text = (
        "<tool_call>{name: multiply}</tool_call>"  # not JSON
        '<tool_call>{"arguments": {"a": 1}}</tool_call>'  # no name
        '<tool_call>["multiply"]</tool_call>'  # not an object
        '<tool_call>{"name": "multiply", "arguments": [1, 2]}</tool_call>'  # arguments not an object
        '<tool_call>{"name": "multiply", "arguments": {"a": 2}}</tool_call>'  # good
        '<tool_call>{"name": "multiply"'  # never closed
    )
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("multiply", {"a": 2})]
    assert len(errors) == 5
    assert errors[0].startswith("tool call is not valid JSON")
    assert 'string "name"' in errors[1] and 'string "name"' in errors[2]
    assert errors[3] == "tool call 'multiply': \"arguments\" must be a JSON object, got list"
    assert errors[4] == "a <tool_call> block is not closed with </tool_call>"


def test_unknown_parser_lists_the_valid_ones():
    assert list(TOOL_CALL_PARSERS) == ["hermes"]
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'mistral'; use one of \['hermes'\]"):
        parse_tool_calls("x", parser="mistral")


TOOLS = {"multiply": multiply, "fails": fails, "shout": shout}


def test_call_tool_runs_and_converts_results():
    assert call_tool(TOOLS, ToolCall("multiply", {"a": 3, "b": 2.5})) == ("7.5", False)
    assert call_tool(TOOLS, ToolCall("multiply", {"a": 3})) == ("3.0", False)
    text, is_error = call_tool(TOOLS, ToolCall("shout", {"text": "hi"}))  # async tool, awaited; dict as JSON
    assert not is_error and json.loads(text) == {"loud": "HI", "n": [1, 2]}


def test_call_tool_unknown_tool():
    assert call_tool(TOOLS, ToolCall("divide", {"a": 1})) == (
        "Error: unknown tool 'divide'; available tools: fails, multiply, shout",
        True,
    )


def test_call_tool_bad_arguments():
    text, is_error = call_tool(TOOLS, ToolCall("multiply", {"a": 1, "c": 2}))
    assert is_error and text == "Error: bad arguments for tool 'multiply': got an unexpected keyword argument 'c'"
    text, is_error = call_tool(TOOLS, ToolCall("multiply", {"b": 2}))
    assert is_error and text == "Error: bad arguments for tool 'multiply': missing a required argument: 'a'"


def test_call_tool_raising_tool():
    assert call_tool(TOOLS, ToolCall("fails", {"x": "q"})) == ("Error: tool 'fails' raised RuntimeError: broken on q", True)


def test_tool_result_text():
    assert tool_result_text("a") == "a"
    assert tool_result_text([1, "é"]) == '[1, "é"]'
    assert tool_result_text({"s": {1, 2}}.keys()) == "dict_keys(['s'])"
    assert tool_result_text({"s": object}) == "{'s': <class 'object'>}"  # not JSON-serializable: str()
    assert tool_result_text(None) == "None"


def test_async_tool_inside_a_running_event_loop():
    """An async Ray actor calls call_tool with its loop running: the coroutine runs on a worker thread's own loop."""
    import asyncio

    async def inside() -> tuple[str, bool]:
        return call_tool(TOOLS, ToolCall("shout", {"text": "ok"}))

    text, is_error = asyncio.run(inside())
    assert not is_error and json.loads(text)["loud"] == "OK"
