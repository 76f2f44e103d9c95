"""Tools: JSON schemas for typed Python callables, tool-call parsers per model family, and the one dispatch.

- ``tool_schemas`` turns typed, docstringed callables into the JSON schemas a chat template lists
  (``transformers.utils.get_json_schema``: OpenAI's ``{"type": "function", "function": {...}}`` shape).
- ``parse_tool_calls`` reads the calls out of an assistant turn's text with the parser of the model family
  (``TOOL_CALL_PARSERS``). A call that cannot be read becomes an error message, never an exception: the
  environment answers it with an error observation and the model may try again.
- ``call_tool`` is the one place a tool is looked up by the name the model wrote (STYLE.md, anti-pattern 4).
  It never raises: an unknown tool, arguments that do not bind, or a tool that raises give an
  ``"Error: ..."`` observation.

Reference: the Hermes format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) is the one
NousResearch's Hermes 2 Pro models and Qwen2.5/Qwen3 chat templates use; TRL's ``GRPOTrainer`` dispatches
tools the same way (``_tool_call_loop``: ``tool(**arguments)``, an exception becomes ``{"error": str(e)}``).
``call_tool`` writes rlray's wording: dicts and lists are JSON, errors read ``Error: ...``. ``trl_tool_results``
writes TRL's (``str(result)``, a list as content parts, a failure as ``str({"error": str(e)})``): the TRL adapter
uses it by default (``env.trl_parity``), so a class written for TRL sees what it sees under TRL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from rlray.envs.base import ToolCall

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def load_schema_builder() -> Callable[[Callable[..., Any]], dict[str, Any]]:
    """Returns ``transformers.utils.get_json_schema``, imported on first call (~1.4 s on 2 quiet cores, over 4 s on a
    loaded CI machine).

    ``tool_schemas`` calls it inside an episode's ``reset``, which runs under ``env.step_timeout_s``. Whoever loads
    environments (the environment host, a sandboxed episode's child, the preflight probe) calls it while loading, so
    that first import is paid under the load's time limit, not under the first reset's.
    """
    from transformers.utils import get_json_schema  # deferred: a process that never builds a schema never pays it

    return get_json_schema


def tool_schemas(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """Returns the JSON schema of each tool, in order (``{"type": "function", "function": {name, description, parameters}}``).

    A tool needs a type hint on every argument and a Google-style docstring with an ``Args:`` entry per
    argument (transformers' rules). Bound methods work (``self`` is not listed). An MCP server's tool
    (``rlray.envs.agents.mcp.McpTool``) gives the schema its server listed.

    Raises:
        ValueError: a tool that transformers cannot describe; the message names the function and the reason.
    """
    from rlray.envs.agents.mcp import McpTool  # deferred: the agents package imports this module (its gateway)

    get_json_schema = load_schema_builder()
    schemas = []
    for tool in tools:
        if isinstance(tool, McpTool):  # an MCP server's tool: its schema is the server's
            schemas.append(tool.schema)
            continue
        try:
            schemas.append(get_json_schema(tool))
        except Exception as err:  # transformers raises TypeHintParsingException / DocstringParsingException
            name = getattr(tool, "__qualname__", repr(tool))
            raise ValueError(
                f"tool {name!r} has no usable JSON schema: {err}. Give every argument a type hint and the function a "
                "Google-style docstring with an 'Args:' line per argument"
            ) from err
    return schemas


def parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    """Returns (calls, errors) for the Hermes format: each ``<tool_call>{json}</tool_call>`` block is one call.

    The JSON must be an object with a string ``name`` and, when present, an object ``arguments`` (a missing
    ``arguments`` means ``{}``). A block that breaks these rules, and a ``<tool_call>`` never closed, give one
    error message each, in text order. Text outside the blocks is ignored.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    end = 0
    for match in _HERMES_BLOCK.finditer(text):
        end = match.end()
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as err:
            errors.append(f"tool call is not valid JSON ({err.msg} at char {err.pos}): {body[:200]}")
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            errors.append(f'tool call needs a JSON object with a string "name": {body[:200]}')
            continue
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            errors.append(f'tool call {payload["name"]!r}: "arguments" must be a JSON object, got {type(arguments).__name__}')
            continue
        calls.append(ToolCall(name=payload["name"], arguments=arguments))
    if "<tool_call>" in text[end:]:
        errors.append("a <tool_call> block is not closed with </tool_call>")
    return calls, errors


# Parser per model family: "hermes" covers Qwen2.5/Qwen3, Hermes models and rlray's smollm2-tools template.
TOOL_CALL_PARSERS: dict[str, Callable[[str], tuple[list[ToolCall], list[str]]]] = {"hermes": parse_hermes}


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[list[ToolCall], list[str]]:
    """Returns (calls, error messages) parsed from one assistant turn's ``text`` by the parser named ``parser``.

    Raises:
        ValueError: ``parser`` is not in ``TOOL_CALL_PARSERS`` (the message lists the valid names).
    """
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; use one of {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[parser](text)


def resolve_awaitable(value: Any) -> Any:
    """Returns ``value``, or the result of awaiting it when it is awaitable (an async tool or ``get_reward``).

    With no event loop running in this thread the coroutine runs in a fresh loop (``asyncio.run``); inside a
    running loop (an async Ray actor) it runs in a fresh loop on a worker thread, so the caller's loop is not
    re-entered. Exceptions of the coroutine propagate.
    """
    if not inspect.isawaitable(value):
        return value

    async def _await() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _await()).result()


def tool_result_text(result: Any) -> str:
    """Returns a tool's result as observation text: a str as is, a dict or list as JSON (``str()`` when it is not
    JSON-serializable), anything else through ``str()``."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def trl_tool_results(tools: dict[str, Callable[..., Any]], calls: list[ToolCall]) -> tuple[list[tuple[str, Any]], int]:
    """Returns ([(tool name, message content), ...], failures) for one turn's calls, as TRL 1.16 answers them.

    Reproduces ``GRPOTrainer._tool_call_loop`` (trl/trainer/grpo_trainer.py, lines 1975-2019 in 1.16.0): each call
    runs as ``tool(**arguments)``; an unknown name raises ``ValueError(f"Tool {name} not found.")``; an exception
    becomes the result ``{"error": str(e)}`` and counts as a failure. Calls of coroutine functions are gathered
    after the synchronous ones (``asyncio.gather(..., return_exceptions=True)``), so their results come last, in
    call order. The content is the result itself when it is a list (content parts), else ``str(result)``.
    """
    results: list[tuple[str, Any]] = []
    pending: list[tuple[str, Any]] = []
    failures = 0
    for call in calls:
        tool = tools.get(call.name)
        try:
            if tool is None:
                raise ValueError(f"Tool {call.name} not found.")
            if inspect.iscoroutinefunction(tool):
                pending.append((call.name, tool(**call.arguments)))
            else:
                results.append((call.name, tool(**call.arguments)))
        except Exception as err:  # noqa: BLE001 - TRL's rule: a failing call is an error result for the model
            failures += 1
            results.append((call.name, {"error": str(err)}))
    if pending:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(coro for _, coro in pending), return_exceptions=True)

        for (name, _), value in zip(pending, resolve_awaitable(gather()), strict=True):
            if isinstance(value, Exception):
                failures += 1
                value = {"error": str(value)}
            results.append((name, value))
    return [(name, value if isinstance(value, list) else str(value)) for name, value in results], failures


def call_tool(tools: dict[str, Callable[..., Any]], call: ToolCall) -> tuple[str, bool]:
    """Returns (observation text, is_error) for one call: the tool named ``call.name`` run on ``call.arguments``.

    This is the one place a tool is chosen by the name the model wrote. It never raises: an unknown name,
    arguments that do not bind to the tool's signature (``inspect.Signature.bind``), and an exception inside the
    tool each give ``("Error: ...", True)``. An async tool is awaited (``resolve_awaitable``). The result becomes
    text through ``tool_result_text``.
    """
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; available tools: {', '.join(sorted(tools)) or 'none'}", True
    try:
        bound = inspect.signature(tool).bind(**call.arguments)
    except TypeError as err:
        return f"Error: bad arguments for tool {call.name!r}: {err}", True
    try:
        result = resolve_awaitable(tool(*bound.args, **bound.kwargs))
    except Exception as err:  # a failing tool is an observation for the model, not a crash of the episode
        return f"Error: tool {call.name!r} raised {type(err).__name__}: {err}", True
    return tool_result_text(result), False
