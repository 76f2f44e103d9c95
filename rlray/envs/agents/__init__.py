"""Agents behind the gateway, and MCP tools: user code written against a chat-completions API, trained through rlray.

- ``agent``: one agent episode (``run_agent_episode``), what an agent may return (``AgentResult``), its MCP tools
  (``episode_tools``), loading agent functions (``load_agent``);
- ``gateway``: the OpenAI-compatible HTTP endpoint each episode's client calls;
- ``conversation``: an agent conversation's exact tokens (segments where the agent rewrote history);
- ``agent_host``: ``AgentHost``, the environment host that also runs agents and holds the MCP sessions;
- ``mcp``: sessions with the MCP servers (``env.mcp_servers``) and their tools.

The limits of an agent episode are ``rlray.envs.limits.EpisodeLimits``, as an environment episode's.
"""

from rlray.envs.agents.agent import (
    AgentReply,
    AgentRequest,
    AgentResult,
    EpisodeTools,
    LoadedAgent,
    episode_tools,
    load_agent,
    run_agent_episode,
)

__all__ = [
    "AgentReply",
    "AgentRequest",
    "AgentResult",
    "EpisodeTools",
    "LoadedAgent",
    "episode_tools",
    "load_agent",
    "run_agent_episode",
]
