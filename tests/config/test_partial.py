"""rollout.partial: what the validator refuses (each key named), and what the plan and the engines get."""

from __future__ import annotations

import re

import pytest

from rlray.config import ConfigError, config_from_dict
from rlray.launch.actors import rollout_engine_kwargs
from rlray.plan import resolve_plan

PARTIAL = {"rollout": {"partial": True, "max_staleness": 1, "backend": "hf"}}


def test_partial_needs_an_async_run():
    with pytest.raises(ConfigError, match=r"rollout.partial=true needs an async run.*rollout.max_staleness>=1"):
        config_from_dict({"rollout": {"partial": True, "backend": "hf"}})  # max_staleness 0 (the default)


@pytest.mark.parametrize(("tree", "named"), [
    ({"rollout": {"backend": "exact"}}, "rollout.backend=exact"),
    ({"rollout": {"backend": "vllm", "stop": ["\n\n"]}}, "rollout.stop"),
    ({"rollout": {"weight_payload": "delta"}}, "rollout.weight_payload=delta"),
    ({"rollout": {"backend": "vllm", "weight_sync": "nccl"}, "resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 1}}},
     "rollout.weight_sync=nccl"),
])  # fmt: skip
def test_what_cannot_continue_across_an_update_is_refused_by_name(tree, named):
    merged = {**tree, "rollout": {**PARTIAL["rollout"], **tree.get("rollout", {})}}
    with pytest.raises(ConfigError, match=f"rollout.partial=true cannot run with .*{re.escape(named)}"):
        config_from_dict(merged)
    config_from_dict({**tree, "rollout": {**tree.get("rollout", {}), "max_staleness": 1}})  # fine without partial


def test_the_engines_get_the_segment_size_only_with_partial():
    plan = resolve_plan(config_from_dict({"rollout": {**PARTIAL["rollout"], "partial_segment_tokens": 8}}))
    assert plan.engines.partial_segment_tokens == 8
    assert rollout_engine_kwargs(plan, 280)["partial_segment_tokens"] == 8
    vllm = resolve_plan(config_from_dict({"rollout": {**PARTIAL["rollout"], "backend": "vllm"}}))
    assert vllm.engines.partial_segment_tokens == 16  # the default segment
    off = resolve_plan(config_from_dict({"rollout": {"max_staleness": 1, "partial_segment_tokens": 8}}))
    assert off.engines.partial_segment_tokens is None
    assert "partial_segment_tokens" not in rollout_engine_kwargs(off, 280)  # the engines are built as before


@pytest.mark.parametrize("env", [
    {"environments": {"guess": "rlray.envs.builtin.guess:GuessNumberEnv"}},
    {"agents": {"adder": "tests/fixtures/agents.py:tool_agent"}},
    {"servers": {"echo": {"protocol": "openenv", "url": "http://127.0.0.1:8000"}}},
    {"environments": {"guess": "rlray.envs.builtin.guess:GuessNumberEnv"}, "servers": {"echo": {
        "protocol": "openenv", "url": "http://127.0.0.1:8000"}}, "agents": {"adder": "tests/fixtures/agents.py:tool_agent"}},
])  # fmt: skip
def test_episodes_of_environments_servers_and_agents_run_with_partial_rollouts(env):
    """Environment episodes, served environments and gateway agents all continue across an update (no refusal left
    names env.*); what is still refused names its own key."""
    cfg = config_from_dict({**PARTIAL, "env": env})
    assert cfg.rollout.partial and cfg.env.names == [*env.get("environments", {}), *env.get("servers", {}),
                                                     *env.get("agents", {})]
    with pytest.raises(ConfigError, match=r"cannot run with rollout\.stop \(a stop string split") as err:
        config_from_dict({"rollout": {**PARTIAL["rollout"], "backend": "vllm", "stop": ["</a>"]}, "env": env})
    assert "env." not in str(err.value).split("cannot run with")[1]
