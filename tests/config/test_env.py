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
