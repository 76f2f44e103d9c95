"""EnvironmentHost without Ray: typed requests and replies, the turn's tool-call counts (the environment's own, else
the parser's), a raising environment, and the two backends of an episode's instance (in this process, in a sandbox
child) answering one scripted set of episodes alike. (Through Ray and the episode loop: tests/run/test_episodes.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray.envs import EnvStep
from rlray.envs.host import (
    EnvironmentHost,
    EpisodeEnvironment,
    LimitReply,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
)
from rlray.sandbox import SandboxCrashed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ENVS = {
    "countdown": f"{FIXTURES}/test_envs.py:CountdownEnv",  # no tools: counts come from the parser
    "calculator": "rlray.envs.builtin.calculator:CalculatorEnv",  # a ToolEnvironment: counts its own calls
    "trl": f"{FIXTURES}/envs/trl_calculator.py:TRLCalculatorEnv",  # a TRL environment_factory class, adapted
    "raise": f"{FIXTURES}/test_envs.py:RaisingEnv",  # raises in step
}


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def script(host: EnvironmentHost) -> dict:
    """Runs four episodes for two turns (countdown, calculator, TRL calculator, raising) and returns every reply."""
    resets = host.reset([
        ResetRequest("c", "countdown", {"prompt": "hi"}),
        ResetRequest("k", "calculator", {"prompt": "q", "question": "What is 6 x 7?", "answer": "#### 42"}),
        ResetRequest("t", "trl", {"prompt": "What is 6 x 7?", "a": 6, "b": 7}),
        ResetRequest("r", "raise", {"prompt": "hi"}),
    ])
    first = host.step([
        StepRequest("c", "more " + call("multiply", a=1, b=2) + "<tool_call>oops</tool_call>", "stop", 0),
        StepRequest("k", call("calculator", expression="6*7") + call("calculator", expression="1/0"), "stop", 0),
        StepRequest("t", call("multiply", a=6, b=7), "stop", 0),
        StepRequest("r", "anything", "length", 0),
    ])
    second = host.step([StepRequest("c", "stop", "stop", 1), StepRequest("k", "It is 42.", "stop", 1),
                        StepRequest("t", "42", "stop", 1)])
    at_limit = host.rewards_at_limit(["c", "k", "t"])
    closed = host.close(["c", "k", "t"])
    return {"resets": resets, "first": first, "second": second, "at_limit": at_limit, "closed": closed,
            "open": host.open_episodes()}


@pytest.fixture(scope="module")
def in_process() -> dict:
    return script(EnvironmentHost(ENVS, step_timeout_s=60.0))


def test_typed_requests_round_trip_through_a_host(in_process):
    resets, first, second = in_process["resets"], in_process["first"], in_process["second"]
    assert resets[0] == ResetReply([{"role": "user", "content": "countdown"}], None, [])
    assert resets[1].prompt[0]["content"].startswith("What is 6 x 7?") and resets[1].error is None
    assert [t["function"]["name"] for t in resets[1].tools] == ["calculator"]
    assert resets[2].prompt == [{"role": "user", "content": "What is 6 x 7? Use the multiply tool on 6 and 7."}]
    assert [t["function"]["name"] for t in resets[2].tools] == ["multiply"]
    assert resets[3] == ResetReply([{"role": "user", "content": "raise"}], None, [])

    # countdown counts no tools: the parser's counts, 1 call + 1 unparsable block attempted, the block failed
    go_on = EnvStep(observations=[{"role": "user", "content": "go on"}], metrics={"said_stop": 0.0})
    assert first[0] == StepReply(go_on, tool_calls=2, tool_errors=1)
    # the calculator (a ToolEnvironment) counts its own: 2 calls, 1 raised (the parser alone would say 0 errors)
    assert [o["content"] for o in first[1].step.observations] == [
        "42", "Error: tool 'calculator' raised ValueError: division by zero"]
    assert (first[1].tool_calls, first[1].tool_errors, first[1].step.tool_calls, first[1].step.tool_errors) == (2, 1, 2, 1)
    assert first[2] == StepReply(EnvStep(observations=[{"role": "tool", "name": "multiply", "content": "42"}],
                                         tool_calls=1, tool_errors=0), tool_calls=1, tool_errors=0)
    # where it raised: the phase, the error and the line of the environment's code (the same when sandboxed)
    source = (FIXTURES / "test_envs.py").read_text().splitlines()
    line = source.index('        raise RuntimeError("the environment broke")') + 1
    assert first[3] == StepReply(error="env_error", message="step raised RuntimeError: the environment broke "
                                 f"(at {FIXTURES}/test_envs.py:{line})")

    assert second[0] == StepReply(EnvStep(reward=2.0, done=True, metrics={"said_stop": 1.0}))  # turn 2 of countdown
    assert (second[1].step.reward, second[1].step.done, second[1].tool_calls) == (1.0, True, 0)
    assert (second[2].step.reward, second[2].step.done, second[2].tool_calls) == (1.0, True, 0)  # get_reward()
    # countdown's reward_at_limit, none, TRL's get_reward
    assert in_process["at_limit"] == [LimitReply(-1.0), LimitReply(None), LimitReply(1.0)]
    assert in_process["closed"] == ["", "", ""]
    assert in_process["open"] == 0  # the raising episode was dropped, the others closed


def test_sandboxed_and_in_process_episodes_give_the_same_replies(in_process):
    sandboxed = script(EnvironmentHost(ENVS, step_timeout_s=60.0, sandbox=True))
    assert sandboxed == in_process


def test_an_episode_environment_runs_the_same_calls_in_process_and_sandboxed():
    from rlray.envs.builtin.calculator import CalculatorEnv

    row = {"question": "What is 2 + 2?", "answer": "#### 4"}
    turn = StepRequest("e", call("calculator", expression="2+2"), "stop", 0)
    local = EpisodeEnvironment.in_process(CalculatorEnv(), "hermes")
    boxed = EpisodeEnvironment.sandboxed(ENVS["calculator"], "hermes", timeout_s=60.0, memory_gib=2.0, name="calculator")
    try:
        for episode in (local, boxed):
            assert episode.reset(row).tools[0]["function"]["name"] == "calculator"
        replies = [episode.step(turn) for episode in (local, boxed)]
        assert replies[0] == replies[1]
        assert replies[0].step.observations == [{"role": "tool", "name": "calculator", "content": "4"}]
        assert local.reward_at_limit() == LimitReply() and boxed.reward_at_limit() == LimitReply()
    finally:
        local.close()
        boxed.close()
    with pytest.raises(SandboxCrashed, match="environment calculator: the sandbox is closed"):
        boxed.step(turn)  # close stopped the child
