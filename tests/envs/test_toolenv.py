"""ToolEnvironment.step: tool observations per call, parse errors as observations, the end on a turn without calls."""

from __future__ import annotations

import pytest

from rlray.envs import AssistantTurn, EnvReset, ToolCall, ToolEnvironment, parse_tool_calls


class EchoEnv(ToolEnvironment):
    """Two tools; the final reward is 1.0 when the final text names the stored word."""

    def reset(self, *, word: str, **row) -> EnvReset:
        self.word = word
        return self.begin([{"role": "user", "content": "Find the word."}], tools=[self.lookup, self.length])

    def lookup(self, key: str) -> str:
        """Looks up a key.

        Args:
            key: The key.
        """
        if key != "word":
            raise KeyError(key)
        return self.word

    def length(self, text: str) -> int:
        """Counts characters.

        Args:
            text: The text.
        """
        return len(text)

    def final_reward(self, turn: AssistantTurn) -> float | None:
        return 1.0 if self.word in turn.text else 0.0


def turn(text: str, index: int = 0) -> AssistantTurn:
    calls, errors = parse_tool_calls(text)
    return AssistantTurn(text=text, tool_calls=calls, tool_call_errors=errors, turn_index=index)


def test_reset_records_tools():
    env = EchoEnv()
    opened = env.reset(word="otter", prompt="ignored")
    assert opened.prompt == [{"role": "user", "content": "Find the word."}]
    assert [t.__name__ for t in opened.tools] == ["lookup", "length"]
    assert env.tools_by_name == {"lookup": env.lookup, "length": env.length}


def test_scripted_episode():
    env = EchoEnv()
    env.reset(word="otter")
    first = env.step(
        turn(
            '<tool_call>{"name": "lookup", "arguments": {"key": "word"}}</tool_call>'
            '<tool_call>{"name": "length", "arguments": {"text": "otter"}}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"key": "nope"}}</tool_call>'
            "<tool_call>oops</tool_call>"
        )
    )
    assert first.observations[:3] == [
        {"role": "tool", "name": "lookup", "content": "otter"},
        {"role": "tool", "name": "length", "content": "5"},
        {"role": "tool", "name": "lookup", "content": "Error: tool 'lookup' raised KeyError: 'nope'"},
    ]
    assert first.observations[3]["name"] == "invalid_tool_call"
    assert first.observations[3]["content"].startswith("Error: tool call is not valid JSON")
    # 4 calls attempted; errors: the raising lookup + the unparsable block = 2
    assert (first.reward, first.done, first.truncated, first.metrics) == (None, False, False, {})
    assert (first.tool_calls, first.tool_errors) == (4, 2)

    second = env.step(turn("<tool_call>{bad}</tool_call>", 1))  # only a parse error: still a tool turn
    assert second.done is False and (second.tool_calls, second.tool_errors, second.metrics) == (1, 1, {})
    assert len(second.observations) == 1

    last = env.step(turn("The word is otter.", 2))
    assert (last.observations, last.reward, last.done, last.metrics) == ([], 1.0, True, {})
    assert (last.tool_calls, last.tool_errors) == (0, 0)


def test_final_turn_wrong_answer_and_default_reward():
    env = EchoEnv()
    env.reset(word="otter")
    assert env.step(turn("It is a badger.")).reward == 0.0

    class NoReward(ToolEnvironment):
        def reset(self, **row) -> EnvReset:
            return self.begin([{"role": "user", "content": "hi"}], tools=[])

    plain = NoReward()
    plain.reset()
    result = plain.step(AssistantTurn(text="<tool_call>", tool_calls=[ToolCall("x", {})]))
    assert result.observations == [{"role": "tool", "name": "x", "content": "Error: unknown tool 'x'; available tools: none"}]
    final = plain.step(AssistantTurn(text="bye"))
    assert final.done and final.reward is None


def test_base_reset_and_duplicate_tool_names():
    with pytest.raises(TypeError, match="abstract method 'reset'|abstract method reset"):
        ToolEnvironment()
    env = EchoEnv()
    with pytest.raises(ValueError, match=r"tool names must be unique, got \['lookup', 'lookup'\]"):
        env.begin([], tools=[env.lookup, env.lookup])
