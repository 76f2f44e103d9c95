"""TRLEnvironment runs classes written for TRL 1.16's environment_factory; load_environment finds environments."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlray.envs import (
    AssistantTurn,
    Environment,
    EnvReset,
    TRLEnvironment,
    is_trl_environment,
    load_environment,
    parse_tool_calls,
    trl_tool_names,
)
from rlray.envs.builtin import GuessNumberEnv

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "envs" / "trl_calculator.py"


def turn(text: str, index: int = 0) -> AssistantTurn:
    calls, errors = parse_tool_calls(text)
    return AssistantTurn(text=text, tool_calls=calls, tool_call_errors=errors, turn_index=index)


def test_reset_appends_the_returned_string_like_trl(trl_calculator_cls):
    env = TRLEnvironment(trl_calculator_cls())
    row = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 6 x 7?"}], "a": 6, "b": 7}
    opened = env.reset(**row)
    # TRL: prompt[-1]["content"] + observation, no separator (grpo_trainer.py, _generate_and_score_completions)
    assert opened.prompt == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 6 x 7? Use the multiply tool on 6 and 7."},
    ]
    assert row["prompt"][1]["content"] == "What is 6 x 7?"  # the row is left untouched
    assert [t.__name__ for t in opened.tools] == ["multiply"]
    assert env.instance.resets == 1 and env.instance.target == 42


def test_standard_prompt_and_reset_returning_none_and_content_parts():
    class Quiet:
        def reset(self, **kwargs) -> None:
            self.seen = kwargs

    env = TRLEnvironment(Quiet())
    assert env.reset(prompt="Hello", x=1).prompt == [{"role": "user", "content": "Hello"}]
    assert env.instance.seen == {"prompt": "Hello", "x": 1}  # every column, prompt included, as TRL passes them
    assert env.reset(x=2).prompt == [{"role": "user", "content": ""}]  # no prompt column: TRL's default
    assert env.tools == []

    class Parts:
        def reset(self, **kwargs) -> str:
            return "B"

    parts = TRLEnvironment(Parts()).reset(prompt=[{"role": "user", "content": [{"type": "text", "text": "A"}]}])
    assert parts.prompt == [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]


def test_tools_are_public_methods_except_reset_and_get_reward(trl_calculator_cls):
    assert trl_tool_names(trl_calculator_cls) == ("multiply",)

    class Game:
        def reset(self, **kwargs) -> str | None: ...

        def move(self, direction: str) -> str: ...

        def look(self) -> str: ...

        def get_reward(self) -> float: ...

        def _private(self) -> None: ...

        @property
        def state(self) -> int: ...

    assert trl_tool_names(Game) == ("look", "move")  # sorted, as inspect.getmembers lists them


def test_scripted_three_turn_episode_in_rlray_wording(trl_calculator_cls):
    env = TRLEnvironment(trl_calculator_cls(), trl_parity=False)  # env.trl_parity=false: rlray's own wording
    env.reset(prompt="What is 6 x 7?", a=6, b=7)
    first = env.step(turn('<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 6}}</tool_call>'))
    assert first.observations == [{"role": "tool", "name": "multiply", "content": "36"}]
    assert (first.reward, first.done, first.metrics, first.tool_calls, first.tool_errors) == (None, False, {}, 1, 0)
    second = env.step(
        turn('<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call><tool_call>{"name": "add"}</tool_call>', 1)
    )
    assert second.observations == [
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "tool", "name": "add", "content": "Error: unknown tool 'add'; available tools: multiply"},
    ]
    assert (second.tool_calls, second.tool_errors, second.metrics) == (2, 1, {}) and not second.done
    third = env.step(turn("6 x 7 = 42", 2))  # no tool call: the episode ends, get_reward scores it
    assert (third.observations, third.reward, third.done) == ([], 1.0, True)
    assert env.instance.results == [36, 42]


def test_scripted_episode_in_trl_wording_by_default(trl_calculator_cls):
    class Tools(trl_calculator_cls):
        def describe(self, a: int) -> dict:
            """Describes a number.

            Args:
                a: The number.
            """
            return {"value": a, "even": a % 2 == 0}

        async def slow_double(self, a: int) -> int:
            """Doubles a number, asynchronously.

            Args:
                a: The number.
            """
            return 2 * a

    env = TRLEnvironment(Tools())
    env.reset(prompt="What is 6 x 7?", a=6, b=7)
    text = ('<tool_call>{"name": "slow_double", "arguments": {"a": 4}}</tool_call>'
            '<tool_call>{"name": "describe", "arguments": {"a": 4}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "multiply", "arguments": {"a": 6}}</tool_call>')
    first = env.step(turn(text))
    # TRL 1.16's _tool_call_loop: str(result), {"error": str(e)} for an unknown tool or a raising call, and the
    # coroutine tools' results after the synchronous ones
    assert first.observations == [
        {"role": "tool", "name": "describe", "content": "{'value': 4, 'even': True}"},
        {"role": "tool", "name": "add", "content": "{'error': 'Tool add not found.'}"},
        {"role": "tool", "name": "multiply",
         "content": "{'error': \"TRLCalculatorEnv.multiply() missing 1 required positional argument: 'b'\"}"},
        {"role": "tool", "name": "slow_double", "content": "8"},
    ]
    assert (first.tool_calls, first.tool_errors, first.done) == (4, 2, False)
    # the last turn (env.max_turns): TRL does not run its calls; the episode then ends at the limit
    last = AssistantTurn(text, *parse_tool_calls('<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}'
                                                 '</tool_call>'), turn_index=1, last=True)
    assert env.step(last).observations == [] and env.instance.results == []
    assert env.reward_at_limit() == 0.0
    # a turn with a call that cannot be parsed is plain text to TRL: the episode ends, scored by get_reward
    broken = env.step(turn('<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call><tool_call>x',
                           2))
    assert (broken.done, broken.reward, broken.observations, broken.tool_calls, broken.tool_errors) == (True, 0.0, [], 2, 1)
    assert env.instance.results == []


def test_episode_without_the_right_call_scores_zero_and_no_get_reward_gives_none(trl_calculator_cls):
    env = TRLEnvironment(trl_calculator_cls())
    env.reset(prompt="What is 6 x 7?", a=6, b=7)
    assert env.step(turn("42")).reward == 0.0

    class NoReward:
        def reset(self, **kwargs) -> None: ...

    bare = TRLEnvironment(NoReward())
    bare.reset(prompt="x")
    assert bare.step(turn("done")).reward is None


def test_async_get_reward_is_awaited(trl_calculator_cls):
    class AsyncJudge(trl_calculator_cls):
        async def get_reward(self) -> float:
            await asyncio.sleep(0)
            return 0.25 + len(self.results)

    env = TRLEnvironment(AsyncJudge())
    env.reset(prompt="p", a=2, b=3)
    env.step(turn('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'))
    assert env.step(turn("6", 1)).reward == 1.25


def test_is_trl_environment(trl_calculator_cls):
    class Native:
        def reset(self, **row) -> EnvReset: ...

        def step(self, turn): ...

    class NativeUnannotated:
        def reset(self, **row): ...

        def step(self, turn): ...

    class TRLWithStepTool:  # a tool named step: the reset annotation decides
        def reset(self, **kwargs) -> str | None: ...

        def step(self, direction: str) -> str: ...

    class TRLUnannotated:
        def reset(self, **kwargs): ...

    assert is_trl_environment(trl_calculator_cls) and is_trl_environment(trl_calculator_cls())
    assert is_trl_environment(TRLWithStepTool) and is_trl_environment(TRLUnannotated)
    assert not is_trl_environment(Native) and not is_trl_environment(NativeUnannotated)
    assert not is_trl_environment(GuessNumberEnv) and not is_trl_environment(object)
    with pytest.raises(TypeError, match="object has no callable reset"):
        TRLEnvironment(object())


def test_load_environment_from_module_and_file(monkeypatch):
    factory = load_environment("rlray.envs.builtin.guess:GuessNumberEnv")
    assert factory is GuessNumberEnv
    env = factory()
    assert isinstance(env, Environment) and env is not factory()

    monkeypatch.chdir(FIXTURE.parents[2])  # tests/: the file spec is relative to the current folder
    trl_factory = load_environment("fixtures/envs/trl_calculator.py:TRLCalculatorEnv")
    first, second = trl_factory(), trl_factory()
    assert isinstance(first, TRLEnvironment) and isinstance(first, Environment)
    assert first.instance is not second.instance  # one instance per episode
    assert type(first.instance).__name__ == "TRLCalculatorEnv"
    assert first.reset(prompt="q", a=2, b=5).prompt == [{"role": "user", "content": "q Use the multiply tool on 2 and 5."}]
    again = load_environment("fixtures/envs/trl_calculator.py:TRLCalculatorEnv")
    assert type(again().instance) is type(first.instance)  # the file is loaded once


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "use 'package.module:ClassName'"),
        ("rlray.envs.nope:X", "cannot import module 'rlray.envs.nope'"),
        ("missing/file.py:X", "file 'missing/file.py' not found"),
        ("some/dir:X", "'some/dir' is not a .py file"),
        ("rlray.envs.builtin.guess:Missing", "'Missing' is not defined in 'rlray.envs.builtin.guess' (its classes: GuessNumberEnv)"),
        ("FILE:NOT_A_CLASS", "'NOT_A_CLASS' is not a class"),
        ("FILE:NotAnEnv", "class NotAnEnv has no reset method"),
    ],
)
def test_load_environment_errors_name_the_spec(spec, message):
    spec = spec.replace("FILE", str(FIXTURE))
    with pytest.raises(ValueError, match="environment '" + spec.replace(".", r"\.") + "'") as info:
        load_environment(spec)
    assert message in str(info.value)
