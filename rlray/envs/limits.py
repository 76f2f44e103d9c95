"""EpisodeLimits: the one limits record of an episode, for environment episodes and agent episodes alike.

The same ``env.*`` keys limit both kinds of episode. An environment episode's loop (``rlray.run.episodes``) checks
turns, episode tokens and time between turns and cuts observations; an agent episode's gateway
(``rlray.envs.agents.gateway``) refuses the call past ``max_turns`` or ``max_episode_tokens`` and clamps a call's
``max_tokens`` to ``max_new_tokens``, and its watcher (``rlray.envs.agents.agent``) stops an agent past
``step_timeout_s`` between calls or ``episode_timeout_s`` in all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits that end an episode, each with its own stop reason.

    Attributes:
        max_turns: assistant turns per episode (``max_turns``; ``env.max_turns``): an environment episode samples at
            most this many, an agent's gateway answers at most this many calls.
        max_episode_tokens: prompt + all turns + observations, in tokens; a turn starts only when ``max_new_tokens``
            more still fit (``max_episode_tokens``; an agent episode: per segment).
        max_observation_tokens: cap per observation message's content, in tokens (cut and counted; environments).
        episode_timeout_s: wall seconds per episode (``episode_timeout``, a failure), checked between turns for an
            environment, at any time for an agent (``env.episode_timeout_s``).
        step_timeout_s: the most seconds an agent may spend between gateway calls (``timeout``, a failure;
            ``env.step_timeout_s``; an environment host applies the same key to each reset and step call itself).
        max_new_tokens: the most tokens one gateway call samples (``rollout.max_new_tokens``; a call asking for more
            is clamped); 0 in a host's record, where each agent batch's sampling sets it (``with_max_new_tokens``).
            An environment episode's turns take it from the step's sampling.
    """

    max_turns: int
    max_episode_tokens: int
    max_observation_tokens: int
    episode_timeout_s: float
    step_timeout_s: float = 60.0
    max_new_tokens: int = 0

    def with_max_new_tokens(self, max_new_tokens: int) -> EpisodeLimits:
        """Returns a copy of these limits whose calls sample at most ``max_new_tokens`` tokens (an agent batch's)."""
        return dataclasses.replace(self, max_new_tokens=max_new_tokens)
