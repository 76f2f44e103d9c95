"""Config section env (rlray.config.env): defaults, the episode token budget, and bad values named by key."""

from __future__ import annotations

import pytest

from rlray.config import ConfigError, config_from_dict
from rlray.config.env import EnvConfig

ENVS = {"guess": "rlray.envs.builtin.guess:GuessNumberEnv"}


def test_off_by_default_and_the_episode_budget():
    assert not EnvConfig().enabled
    cfg = config_from_dict({"env": {"environments": ENVS, "max_turns": 3, "max_observation_tokens": 50},
                            "data": {"max_prompt_tokens": 100}, "rollout": {"max_new_tokens": 20}})
    assert cfg.env.enabled
    assert cfg.episode_tokens == 100 + 3 * 20 + 2 * 50  # prompt + turns + observations between them
    cfg = config_from_dict({"env": {"environments": ENVS, "max_episode_tokens": 500}})
    assert cfg.episode_tokens == 500


@pytest.mark.parametrize(("env", "match"), [
    ({"environments": {"x": "no_colon"}}, r"env.environments.x='no_colon': write 'package.module:Class'"),
    ({"environments": ENVS, "default": "chess"}, r"env.default='chess' is not in env.environments \['guess'\]"),
    ({"environments": ENVS, "max_episode_tokens": 100}, r"env.max_episode_tokens=100 leaves no room for one turn"),
    ({"max_turns": 0}, r"env.max_turns"),
    ({"tool_parser": "json"}, r"env.tool_parser"),
])
def test_bad_values_name_the_key(env, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"env": env})


AGENTS = {"solver": "docs/examples/my_agent.py:agent"}


def test_agents_and_mcp_servers():
    cfg = config_from_dict({"env": {"agents": AGENTS, "default": "solver", "mcp_servers": [
        {"name": "calc", "command": "python tools.py --quiet", "timeout_s": 5},
        {"name": "web", "url": "http://127.0.0.1:9000/mcp"}]}})
    assert cfg.env.enabled and cfg.env.names == ["solver"] and cfg.env.gateway_host == "127.0.0.1"
    calc, web = cfg.env.mcp_servers
    assert (calc.command, calc.url, calc.timeout_s) == (["python", "tools.py", "--quiet"], None, 5.0)
    assert (web.command, web.url, web.timeout_s) == (None, "http://127.0.0.1:9000/mcp", 30.0)
    mixed = config_from_dict({"env": {"agents": AGENTS, "environments": ENVS, "default": "guess"}})
    assert mixed.env.names == ["guess", "solver"]


@pytest.mark.parametrize(("env", "match"), [
    ({"agents": {"a": "no_colon"}}, r"env.agents.a='no_colon': write 'package.module:function'"),
    ({"agents": {"guess": "m:f"}, "environments": ENVS}, r"env.agents and env.environments both name \['guess'\]"),
    ({"agents": AGENTS, "default": "chess"},
     r"env.default='chess' is not in env.environments \[\] or env.agents \['solver'\]"),
    ({"agents": AGENTS, "mcp_servers": [{"name": "x"}]}, r"give either command .* or url"),
    ({"agents": AGENTS, "mcp_servers": [{"name": "x", "command": ["a"], "url": "http://h"}]}, r"not both"),
    ({"agents": AGENTS, "mcp_servers": [{"name": "x", "url": "u"}, {"name": "x", "url": "v"}]}, r"names must be unique"),
    ({"mcp_servers": [{"name": "x", "url": "u"}]}, r"env.mcp_servers needs env.agents or env.environments"),
    ({"agents": AGENTS, "mcp_servers": [{"name": "x", "url": "u", "timeout_s": 0}]}, r"timeout_s"),
])
def test_bad_agent_values_name_the_key(env, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"env": env})


def test_agent_batching_is_lockstep_by_default_and_reaches_the_hosts():
    """env.agent_batching: lockstep unless set (a seeded run repeats its agents' samples); the plan and the agent hosts'
    keyword arguments carry it; another value is an error naming the key."""
    from rlray.launch.actors import agent_host_kwargs
    from rlray.plan import resolve_plan

    assert EnvConfig().agent_batching == "lockstep"
    cfg = config_from_dict({"env": {"agents": AGENTS, "default": "solver", "agent_batching": "window"}})
    plan = resolve_plan(cfg)
    assert plan.episodes.agent_batching == "window"
    assert agent_host_kwargs(plan, "/no/model")["agent_batching"] == "window"
    with pytest.raises(ConfigError, match=r"env.agent_batching='fast'"):
        config_from_dict({"env": {"agent_batching": "fast"}})


def test_agent_threads_is_64_by_default_reaches_the_hosts_and_must_be_positive():
    """env.agent_threads: 64 unless set; the plan and the agent hosts' keyword arguments carry it; 0 is refused with an
    error naming the key."""
    from rlray.launch.actors import agent_host_kwargs
    from rlray.plan import resolve_plan

    assert EnvConfig().agent_threads == 64
    plan = resolve_plan(config_from_dict({"env": {"agents": AGENTS, "default": "solver", "agent_threads": 3}}))
    assert plan.episodes.agent_threads == 3
    assert agent_host_kwargs(plan, "/no/model")["agent_threads"] == 3
    with pytest.raises(ConfigError, match=r"env.agent_threads=0: Input should be greater than or equal to 1"):
        config_from_dict({"env": {"agents": AGENTS, "default": "solver", "agent_threads": 0}})
