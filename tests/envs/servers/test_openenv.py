"""OpenEnv environments over rlray's protocol client (rlray.envs.servers.openenv) against the template `openenv init`
writes, served from its own virtual environment: reset and step with typed actions (text and JSON), rewards from the
observations, rejected actions answered and counted, a killed server failing its open episode and restarted for the
next, the session bound."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from rlray.envs.base import AssistantTurn
from rlray.envs.servers import ServerBusy, ServerSpec
from rlray.envs.servers.hosted import HostedServer, start_servers
from rlray.envs.servers.openenv import OpenEnvError, OpenEnvOptions, parse_action, render_observation
from tests.envs.servers.openenv_template import openenv_init, openenv_venv, server_command

PROMPT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    folder = openenv_init(tmp_path_factory.mktemp("openenv"))
    spec = ServerSpec("echo", command=server_command(), python=str(openenv_venv()), cwd=str(folder), max_sessions=2,
                      max_restarts=2)
    text = HostedServer(spec, openenv=OpenEnvOptions(action_field="message", observation_field="echoed_message"))
    supervisor, factories = start_servers([text], timeout_s=30.0)
    yield supervisor, factories
    supervisor.stop()


def test_text_actions_rewards_and_observations(echo):
    supervisor, factories = echo
    env = factories["echo"]()
    opened = env.reset(prompt=PROMPT, other_column=1)
    # the row's prompt, then the template's reset observation (its echoed_message)
    assert opened.prompt == [*PROMPT, {"role": "user", "content": "Echo Env environment ready!"}]
    step = env.step(AssistantTurn("Hello"))
    assert step.observations == [{"role": "user", "content": "Hello"}]
    assert step.reward == pytest.approx(0.5) and not step.done  # 0.1 * len("Hello")
    step = env.step(AssistantTurn("a much longer message"))
    env.close()
    standard = factories["echo"]()  # a standard row's prompt (a string) becomes a user message
    assert standard.reset(prompt="text").prompt[0] == {"role": "user", "content": "text"}
    standard.close()
    assert step.reward == pytest.approx(2.1)  # 0.1 * 21 characters


def test_json_actions_and_rejected_ones(echo):
    supervisor, _ = echo
    from rlray.envs.servers.openenv import OpenEnvEnvironment

    env = OpenEnvEnvironment("echo", supervisor["echo"], OpenEnvOptions(), timeout_s=30.0)
    opened = env.reset(prompt=PROMPT)
    # every observation field but metadata, as JSON
    assert opened.prompt[-1]["content"] == '{"echoed_message": "Echo Env environment ready!", "message_length": 0}'
    step = env.step(AssistantTurn('I will send {"message": "hi"} now'))
    assert step.reward == pytest.approx(0.2)
    assert step.observations[0]["content"] == '{"echoed_message": "hi", "message_length": 2}'
    bad = env.step(AssistantTurn('{"msg": "hi"}'))  # the server's Action has no msg and needs message
    assert bad.reward is None and bad.metrics == {"invalid_actions": 1.0} and bad.tool_errors == 1
    assert "invalid action" in bad.observations[0]["content"] and "message" in bad.observations[0]["content"]
    none = env.step(AssistantTurn("no json here"))
    assert "no JSON object" in none.observations[0]["content"]
    assert env.step(AssistantTurn('{"message": "ok"}')).reward == pytest.approx(0.2)  # the session survived both
    env.close()


def test_sessions_are_bounded_and_freed(echo):
    _, factories = echo
    a, b, c = factories["echo"](), factories["echo"](), factories["echo"]()
    a.reset(prompt=PROMPT)
    b.reset(prompt=PROMPT)
    c.timeout_s = 0.3
    with pytest.raises(ServerBusy):
        c.reset(prompt=PROMPT)
    a.close()
    c.timeout_s = 30.0
    c.reset(prompt=PROMPT)  # a's slot is free again
    b.close()
    c.close()


def test_a_killed_server_fails_its_open_episode_and_serves_the_next(echo):
    supervisor, factories = echo
    server = supervisor["echo"]
    env = factories["echo"]()
    env.reset(prompt=PROMPT)
    generation = server.generation
    server_pid = [p for p in _children(server.pid)][0]
    os.kill(server_pid, signal.SIGKILL)
    with pytest.raises(OpenEnvError, match="dropped the session"):
        env.step(AssistantTurn("Hello"))
    env.close()
    deadline = time.monotonic() + 15  # the guard exits after its server; a session opened before is refused
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    fresh = factories["echo"]()  # the session waits for the restart (ServerProcess.check)
    fresh.reset(prompt=PROMPT)
    assert server.generation == generation + 1 and server.restarts >= 1
    assert fresh.step(AssistantTurn("Hi")).reward == pytest.approx(0.2)
    fresh.close()
    with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
        assert reply.status == 200


def test_a_wrong_action_field_is_named(echo, tmp_path):
    supervisor, _ = echo
    spec = ServerSpec("echo2", url=supervisor["echo"].url)
    with pytest.raises(ValueError, match=r"action_field='text' is not a field of the server's action; it has "
                                         r"\['message', 'metadata'\]"):
        start_servers([HostedServer(spec, openenv=OpenEnvOptions(action_field="text"))], timeout_s=5.0)


def test_parse_and_render():
    assert parse_action("anything", "message") == {"message": "anything"}
    assert parse_action('{"a": 1} then {"b": {"c": 2}} end', None) == {"b": {"c": 2}}  # the last object
    assert render_observation({"x": 1, "metadata": {"m": 1}, "a": "b"}, None) == '{"a": "b", "x": 1}'
    assert render_observation({"x": [1, 2]}, "x") == "[1, 2]"
    with pytest.raises(OpenEnvError, match=r"observation_field='y' is not in the observation; it has \['x'\]"):
        render_observation({"x": 1}, "y")


def _children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children()]
