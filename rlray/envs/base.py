"""The environment contract: what an environment class gives rlray and what it gets back.

An environment is a plain Python class; one instance serves one episode (DESIGN.md, Environments):

    class MyEnv:
        def reset(self, **row) -> EnvReset: ...          # the row's columns as keyword arguments
        def step(self, turn: AssistantTurn) -> EnvStep: ...

``reset`` opens the episode: the conversation the model sees first (``EnvReset.prompt``) and the tools
it may call. Each assistant turn then goes to ``step``, which answers with observation messages, an
optional reward and done/truncated. The episode's reward is the sum of the turn rewards given (None
when no turn gave one: the episode then has no environment reward and the reward functions alone score
it). Classes written for TRL's ``GRPOTrainer(environment_factory=...)`` run through ``rlray.envs.trl``.

Two optional methods: ``reward_at_limit(self) -> float | None`` is called once when a limit (max turns,
tokens, a truncated turn) ends an episode before the environment said done, and its value is added to
the episode's reward; ``close(self)`` is called when the episode is over (release resources).

Nothing here imports Ray, vLLM or the config: environments are tested as plain objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]  # {"role": "system"|"user"|"assistant"|"tool", "content": str, ...} (transformers' chat format)


@dataclass
class ToolCall:
    """One tool call parsed from an assistant turn.

    Attributes:
        name: the tool name the model wrote.
        arguments: the parsed JSON arguments (a dict; {} when the model gave none).
    """

    name: str
    arguments: dict[str, Any]


@dataclass
class AssistantTurn:
    """One sampled assistant turn, as the environment sees it.

    Attributes:
        text: the turn's text, special tokens removed (tool-call markup included, as the model wrote it).
        tool_calls: calls parsed from ``text`` by the model family's parser ([] when none, or when the
            environment uses a text protocol).
        tool_call_errors: one message per call that could not be parsed (malformed JSON, no name).
        finish_reason: "stop" (EOS or a stop string) or "length" (the turn hit rollout.max_new_tokens).
        turn_index: 0 for the first assistant turn.
        last: no turn follows this one whatever ``step`` answers (it is turn ``env.max_turns``); TRL does not run
            the tool calls of such a turn, and neither does the TRL adapter by default (``rlray.envs.trl``).
    """

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    turn_index: int = 0
    last: bool = False


@dataclass
class EnvReset:
    """What ``reset(**row)`` returns: the opening conversation and the tools.

    Attributes:
        prompt: the messages the model sees before its first turn (system and user turns; an
            environment usually copies the row's ``prompt`` and may add to it).
        tools: typed, docstringed Python callables the model may call; their JSON schemas come from
            ``transformers.utils.get_json_schema`` and are given to the chat template.
        stop: extra stop strings for this episode's turns (text protocols), added to ``rollout.stop``.
    """

    prompt: list[Message]
    tools: list[Callable[..., Any]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)


@dataclass
class EnvStep:
    """What ``step(turn)`` returns.

    Attributes:
        observations: messages appended after the assistant turn (role "tool" for tool results,
            "user" for feedback); tokenized with the chat template and never trained on.
        reward: this turn's reward, or None (no reward for this turn).
        done: the episode ended normally (an answer was given, the game is over).
        truncated: the environment cut the episode short (its own limit).
        metrics: the environment's own numbers, logged as ``env/metric/<name>`` means (e.g. {"guesses": 3.0}).
        tool_calls: tool calls this turn attempted, as the environment counts them (``ToolEnvironment``: parsed
            calls plus unparsable ones); None: the host counts the calls and parse errors its parser found.
        tool_errors: those of them that failed (unparsable, an unknown tool, bad arguments, a raising tool); None:
            the host counts the parser's errors.
    """

    observations: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    tool_calls: int | None = None
    tool_errors: int | None = None


@runtime_checkable
class Environment(Protocol):
    """The contract (see the module docstring)."""

    def reset(self, **row: Any) -> EnvReset: ...

    def step(self, turn: AssistantTurn) -> EnvStep: ...
