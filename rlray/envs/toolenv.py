"""ToolEnvironment: a base class whose ``step`` answers native tool calls, for environments built on tools.

A subclass opens the episode in ``reset(**row)`` by returning ``self.begin(prompt, tools=[...])`` (which
records the tools by name and builds the ``EnvReset``), and scores the final answer in ``final_reward``:

    class MyEnv(ToolEnvironment):
        def reset(self, *, question: str, answer: str, **row) -> EnvReset:
            self.answer = answer
            return self.begin([{"role": "user", "content": question}], tools=[self.search])

        def search(self, query: str) -> str:
            '''Searches the web. Args: query: the words to look for.'''
            ...

        def final_reward(self, turn: AssistantTurn) -> float | None:
            return float(self.answer in turn.text)

The environment host opens each episode with its MCP servers' tools (``env.mcp_servers``): it hands them to the
instance before ``reset`` (``open_with_tools``, into ``host_tools``), and ``begin`` adds them after the episode's own.
Nothing else: an instance built outside a host, or in a sandbox child, has none.

Step semantics (one assistant turn):
- with tool calls or tool-call parse errors: every call is run through ``call_tool`` and answered by one
  ``{"role": "tool", "name": <tool>, "content": <text>}`` message, in call order; every parse error is answered
  by one tool message named ``"invalid_tool_call"`` whose content reads ``Error: ...``; reward None, not done;
- without either: the episode is over (``done=True``) and the reward is ``final_reward(turn)``.
Counts every turn, in ``EnvStep.tool_calls`` (calls attempted: parsed calls plus unparsable ones) and
``EnvStep.tool_errors`` (those that failed: parse errors plus calls whose observation is an error).

This mirrors TRL's ``GRPOTrainer._tool_call_loop`` (a turn without tool calls ends the rollout).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from rlray.envs.base import AssistantTurn, EnvReset, EnvStep, Message
from rlray.envs.tools import call_tool

INVALID_TOOL_CALL = "invalid_tool_call"  # the tool-message name answering a call that could not be parsed


def tool_step(tools: dict[str, Callable[..., Any]], turn: AssistantTurn) -> EnvStep | None:
    """Returns the tool observations for ``turn`` (not done, reward None), or None when the turn has no tool call
    and no parse error (the caller ends the episode). Counts: ``tool_calls``, ``tool_errors`` (see module doc)."""
    if not turn.tool_calls and not turn.tool_call_errors:
        return None
    observations: list[Message] = []
    errors = 0
    for call in turn.tool_calls:
        text, is_error = call_tool(tools, call)
        errors += is_error
        observations.append({"role": "tool", "name": call.name, "content": text})
    for message in turn.tool_call_errors:
        observations.append({"role": "tool", "name": INVALID_TOOL_CALL, "content": f"Error: {message}"})
    errors += len(turn.tool_call_errors)
    attempted = len(turn.tool_calls) + len(turn.tool_call_errors)
    return EnvStep(observations=observations, tool_calls=attempted, tool_errors=errors)


class ToolEnvironment(abc.ABC):
    """Base class for native tool-calling environments: implements ``step``; subclasses implement ``reset`` and
    ``final_reward`` (see the module docstring for the step semantics).

    Attributes:
        host_tools: the MCP tools its host opened the episode with (``open_with_tools``; () by default), added by
            ``begin`` after the episode's own tools.
    """

    host_tools: tuple[Callable[..., Any], ...] = ()  # a class default: a subclass need not call __init__

    def __init__(self) -> None:
        """Starts with no tools; ``begin`` records them when ``reset`` opens the episode."""
        self.tools_by_name: dict[str, Callable[..., Any]] = {}

    @abc.abstractmethod
    def reset(self, **row: Any) -> EnvReset:
        """Returns the opening conversation and tools for one dataset row; subclasses implement it and return
        ``self.begin(prompt, tools)`` (abstract: a subclass without it cannot be instantiated, TypeError)."""

    def begin(self, prompt: list[Message], tools: list[Callable[..., Any]], stop: list[str] | None = None) -> EnvReset:
        """Returns ``EnvReset(prompt, tools, stop)`` and records ``tools`` by ``__name__`` for ``step``'s dispatch.

        The MCP servers' tools the host opened the episode with (``host_tools``; ``env.mcp_servers``) are added
        after ``tools``.

        Raises:
            ValueError: two tools share a name (the model could not tell them apart).
        """
        tools = [*tools, *self.host_tools]  # env.mcp_servers: the host's MCP tools join every tool environment's
        names = [tool.__name__ for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"{type(self).__name__}: tool names must be unique, got {names}")
        self.tools_by_name = dict(zip(names, tools, strict=True))
        return EnvReset(prompt=prompt, tools=list(tools), stop=list(stop or []))

    def final_reward(self, turn: AssistantTurn) -> float | None:
        """Returns the reward of the episode's last turn (the one without tool calls); None (no reward) by default."""
        return None

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Returns the tool observations for ``turn``, or the end of the episode with ``final_reward(turn)`` when the
        turn calls no tool (see the module docstring)."""
        result = tool_step(self.tools_by_name, turn)
        if result is not None:
            return result
        return EnvStep(reward=self.final_reward(turn), done=True, tool_calls=0, tool_errors=0)


def open_with_tools(env: Any, tools: tuple[Callable[..., Any], ...] | list[Callable[..., Any]]) -> None:
    """Hands ``tools`` (the host's MCP tools, ``McpTool`` callables) to ``env`` before its ``reset``: a
    ``ToolEnvironment`` keeps them in ``host_tools`` for ``begin``; any other environment ignores them (as before:
    MCP tools join tool environments only)."""
    if isinstance(env, ToolEnvironment):
        env.host_tools = tuple(tools)
