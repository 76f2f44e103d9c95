"""Environments: the contract (``base``), tools and their parsers, a tool-calling base class, the TRL adapter, the
environment host (``host``) and the one limits record of every episode (``limits``); agents behind the gateway and MCP
tools in their own folder (``rlray.envs.agents``: ``agent``, ``gateway``, ``conversation``, ``agent_host``, ``mcp``).

Plain Python, no Ray: an environment is tested as an object (DESIGN.md, Environments).
"""

from rlray.envs.agents import AgentResult, episode_tools
from rlray.envs.agents.mcp import McpTool
from rlray.envs.base import AssistantTurn, Environment, EnvReset, EnvStep, Message, ToolCall
from rlray.envs.limits import EpisodeLimits
from rlray.envs.toolenv import ToolEnvironment, tool_step
from rlray.envs.tools import (
    TOOL_CALL_PARSERS,
    call_tool,
    parse_hermes,
    parse_tool_calls,
    resolve_awaitable,
    tool_result_text,
    tool_schemas,
    trl_tool_results,
)
from rlray.envs.trl import (
    TRLEnvironment,
    is_trl_environment,
    load_environment,
    load_environment_class,
    trl_tool_names,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "AgentResult",
    "AssistantTurn",
    "EnvReset",
    "EnvStep",
    "Environment",
    "EpisodeLimits",
    "McpTool",
    "Message",
    "TRLEnvironment",
    "ToolCall",
    "ToolEnvironment",
    "call_tool",
    "episode_tools",
    "is_trl_environment",
    "load_environment",
    "load_environment_class",
    "parse_hermes",
    "parse_tool_calls",
    "resolve_awaitable",
    "tool_result_text",
    "tool_schemas",
    "tool_step",
    "trl_tool_results",
    "trl_tool_names",
]
