"""Agents: user code written against a chat-completions API, trained through the gateway.

An agent is a function that runs one episode (``env.agents: {name: "package.module:fn" | "path/to/file.py:fn"}``;
rows pick one by ``env.column``, as they pick environments):

    async def agent(client: openai.AsyncOpenAI, row: dict) -> float | AgentResult | None:
        ...  # any loop of client.chat.completions.create(...) calls, tools, parsing

``client``'s ``base_url`` is the episode's own endpoint on the gateway (``rlray.envs.agents.gateway``), pinned to one
rollout actor; ``row`` holds the prompt row's columns (``prompt`` included). Other frameworks (LangGraph,
smolagents, a hand-rolled ReAct loop) take ``str(client.base_url)`` and ``client.api_key``. A plain ``def agent``
gets a synchronous ``openai.OpenAI`` client instead and runs on a thread of the host. ``episode_tools()`` gives
the MCP servers' tools (``env.mcp_servers``): their OpenAI schemas for the ``tools=`` argument and ``await
tools.call(name, arguments)``.

The episode's reward is what the agent returns (a number, or ``AgentResult.reward``), added to what the reward
functions give its final conversation (``reward.functions``, weighted by env.reward_weight as an environment's
reward is); ``None`` leaves the reward functions alone.

How an episode ends (its stop reason):
- ``done``: the agent returned;
- ``max_turns``, ``max_episode_tokens``: a call was refused at a limit (the agent's error after it is expected;
  what it returns still counts);
- failed (no reward, left out of the update, counted in env/failed): ``env_error`` when the agent raised (or made
  no call), ``timeout`` when it spent more than env.step_timeout_s between gateway calls (its own work: a hang),
  ``episode_timeout`` past env.episode_timeout_s. A timed-out async agent is cancelled; a synchronous one's thread
  is abandoned (Python cannot kill a thread). Its later calls are refused (410).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.envs.agents.conversation import Segment
from rlray.envs.agents.gateway import Gateway, GatewayEpisode
from rlray.envs.agents.mcp import McpClients, ToolOutcome
from rlray.envs.limits import EpisodeLimits

CANCEL_WAIT_S = 1.0  # seconds a cancelled agent gets to unwind before it is abandoned


@dataclass
class AgentResult:
    """What an agent may return instead of a plain number.

    Attributes:
        reward: the episode's reward (None: the reward functions alone score it).
        metrics: the agent's own numbers, logged as env/metric/<name> means (like an environment's).
        scores: the parts of ``reward`` (e.g. a verifiers rubric's per-function scores), logged as reward terms
            ``reward/<agent>/<name>`` of weight 0: they are shown, never added to the reward again.
    """

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)


@dataclass
class AgentRequest:
    """One agent episode to run on a host.

    Attributes:
        key: the episode's key (unique per run; its path on the gateway).
        agent: the agent's name (an env.agents key).
        row: the agent's ``row``: the prompt row's columns, ``prompt`` included.
        actor_key: pins the episode's calls to one rollout actor.
    """

    key: str
    agent: str
    row: dict[str, Any]
    actor_key: int


@dataclass
class AgentReply:
    """What one agent episode gave: its token sequences and how it went.

    Attributes:
        key: the episode's key.
        segments: its token sequences, in order (more than one when the agent rewrote history).
        stop_reason: see the module docstring.
        reward: what the agent returned (None: nothing, or it failed).
        metrics: ``AgentResult.metrics``; scores: ``AgentResult.scores``.
        message: why it failed ("" otherwise).
        calls: calls answered; refused: calls refused; drift: history rewrites (segments cut).
        tool_calls, tool_errors: tool calls in the answers plus unparsable ones, and those that failed (unparsable, and
            MCP calls through ``episode_tools`` that failed or timed out).
        engine_calls, engine_prompts, batch_wait_s: the host batch's engine calls, the prompts they carried and the
            seconds they waited for their batch (``agent_host.GatewayStats``), on the batch's first reply only (0 on
            the others: a sum over the replies counts each batch once).
        parallel_calls: the episode's calls that came while another of its calls was being answered
            (``GatewayEpisode.parallel_calls``).
    """

    key: str
    segments: list[Segment]
    stop_reason: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    message: str = ""
    calls: int = 0
    refused: int = 0
    drift: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    engine_calls: int = 0
    engine_prompts: int = 0
    batch_wait_s: float = 0.0
    parallel_calls: int = 0


class EpisodeTools:
    """The MCP tools of one agent episode (``episode_tools()``): schemas and calls, the calls counted in the episode.

    Attributes:
        schemas: the tools' OpenAI schemas (``tools=`` of a chat call); [] without env.mcp_servers.
    """

    def __init__(self, clients: McpClients | None, episode: GatewayEpisode) -> None:
        self._clients, self._episode = clients, episode
        self.schemas: list[dict[str, Any]] = list(clients.schemas) if clients else []

    async def call(self, name: str, arguments: dict[str, Any] | str | None = None) -> str:
        """Returns the text of tool ``name`` run on ``arguments`` (a dict or its JSON text); an error, an unknown tool
        and a time-out give an ``"Error: ..."`` text (counted in the episode's tool errors), never an exception."""
        outcome = await self._clients.call(name, arguments) if self._clients else ToolOutcome(
            f"Error: unknown tool {name!r}; no MCP server is configured (env.mcp_servers)", is_error=True)
        self._episode.tool_errors += outcome.is_error
        return outcome.text

    def call_sync(self, name: str, arguments: dict[str, Any] | str | None = None) -> str:
        """Returns ``call(name, arguments)`` from a synchronous agent's thread (blocks)."""
        if self._clients is None:
            self._episode.tool_errors += 1
            return f"Error: unknown tool {name!r}; no MCP server is configured (env.mcp_servers)"
        outcome = self._clients.call_from_thread(name, arguments)
        self._episode.tool_errors += outcome.is_error
        return outcome.text


_EPISODE_TOOLS: contextvars.ContextVar[EpisodeTools] = contextvars.ContextVar("rlray_episode_tools")


def episode_tools() -> EpisodeTools:
    """Returns the MCP tools of the agent episode running in this context.

    Raises:
        RuntimeError: called outside an agent episode.
    """
    try:
        return _EPISODE_TOOLS.get()
    except LookupError:
        raise RuntimeError("episode_tools() is called from an agent that rlray runs (env.agents)") from None


@dataclass(frozen=True)
class LoadedAgent:
    """An agent function and whether it is a coroutine function (then it gets an ``AsyncOpenAI`` client)."""

    fn: Callable[..., Any]
    is_async: bool


def load_agent(spec: str) -> LoadedAgent:
    """Returns the agent function of ``spec``: ``"package.module:fn"`` or ``"path/to/file.py:fn"``.

    Raises:
        ValueError: as ``rlray.envs.trl.load_object`` (no ``:fn`` part, a missing or failing module or file, no such
            name), or ``fn`` is not a function taking (client, row); each message names the spec.
    """
    from rlray.envs.trl import load_object  # the one loader of user code named in the config

    label = f"agent {spec!r}"
    fn = load_object(spec, label=label, shape="function")
    module_part, _, name = spec.rpartition(":")
    if not inspect.isfunction(fn):
        raise ValueError(f"{label}: {name!r} is not a function in {module_part!r}")
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError as err:
        raise ValueError(f"{label}: {name} must take (client, row): {err}") from err
    return LoadedAgent(fn, inspect.iscoroutinefunction(fn))


def _reward_of(value: Any) -> tuple[float | None, dict[str, float]]:
    """Returns (reward, metrics) of an agent's return value.

    Raises:
        TypeError: a value that is neither None, a number nor an ``AgentResult``.
    """
    if value is None:
        return None, {}
    if isinstance(value, AgentResult):
        return (None if value.reward is None else float(value.reward)), {k: float(v) for k, v in value.metrics.items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), {}
    raise TypeError(f"the agent returned {type(value).__name__}; return a number, None or rlray.envs.AgentResult")


async def _watch(task: asyncio.Future, episode: GatewayEpisode, limits: EpisodeLimits) -> str:
    """Waits for the agent's task; returns "" when it finished, or the time limit that stopped it ("timeout": more than
    step_timeout_s outside gateway calls; "episode_timeout"), after cancelling it."""
    started = time.monotonic()
    while True:
        now = time.monotonic()
        idle = 0.0 if episode.in_call else now - episode.last_active
        wait = min(limits.episode_timeout_s - (now - started), limits.step_timeout_s - idle)
        done, _ = await asyncio.wait({task}, timeout=max(wait, 0.0) + 0.01)
        if done:
            return ""
        now = time.monotonic()
        if now - started >= limits.episode_timeout_s:
            reason = "episode_timeout"
        elif not episode.in_call and now - episode.last_active >= limits.step_timeout_s:
            reason = "timeout"
        else:
            continue
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        return reason


async def run_agent_episode(gateway: Gateway, request: AgentRequest, agent: LoadedAgent, clients: McpClients | None,
                            limits: EpisodeLimits, *, http_client: Any = None,
                            threads: concurrent.futures.Executor | None = None) -> AgentReply:
    """Returns the reply of one agent episode run to its end on the running loop (see the module docstring).

    Args:
        gateway: the host's gateway (serving).
        request: the episode.
        agent: the loaded agent function.
        clients: the host's MCP sessions (None without env.mcp_servers).
        limits: the episode's limits: its time limits, and the call limits the gateway applies (``max_new_tokens``
            set to the batch's).
        http_client: an ``httpx.AsyncClient`` shared by the episodes' ``AsyncOpenAI`` clients (None: their own).
        threads: runs synchronous agents (None: the loop's default executor).
    """
    import openai

    episode = gateway.open(request.key, request.actor_key, limits)
    tools = EpisodeTools(clients, episode)
    context = contextvars.copy_context()
    context.run(_EPISODE_TOOLS.set, tools)
    url = gateway.url(request.key)
    row = dict(request.row)
    if agent.is_async:
        client: Any = openai.AsyncOpenAI(base_url=url, api_key="rlray", max_retries=0, http_client=http_client,
                                         timeout=limits.episode_timeout_s)
        task = asyncio.get_running_loop().create_task(agent.fn(client, row), context=context)
    else:
        client = openai.OpenAI(base_url=url, api_key="rlray", max_retries=0, timeout=limits.episode_timeout_s)
        task = asyncio.get_running_loop().run_in_executor(threads, context.run, agent.fn, client, row)
    stopped = await _watch(task, episode, limits)
    reply = AgentReply(request.key, [], "")
    if stopped:
        reply.stop_reason = stopped
        reply.message = (f"the agent spent more than env.step_timeout_s={limits.step_timeout_s:g} s between gateway calls"
                         if stopped == "timeout" else f"the episode ran past env.episode_timeout_s={limits.episode_timeout_s:g}")
    elif task.cancelled():
        reply.stop_reason, reply.message = "env_error", "the agent's task was cancelled"
    elif task.exception() is not None and not episode.stop_reason:
        err = task.exception()
        reply.stop_reason = "env_error"
        reply.message = f"the agent raised {type(err).__name__}: {err}\n" + "".join(traceback.format_tb(err.__traceback__)[-3:])
    else:
        try:
            result = None if task.exception() is not None else task.result()
            reply.reward, reply.metrics = _reward_of(result)
            if isinstance(result, AgentResult):
                reply.scores = {k: float(v) for k, v in result.scores.items()}
            reply.stop_reason = episode.stop_reason or "done"
        except TypeError as err:
            reply.stop_reason, reply.message = "env_error", str(err)
    gateway.close_episode(request.key, reply.stop_reason)
    if agent.is_async and http_client is None:
        await client.close()
    reply.segments = episode.conversation.segments()
    if not reply.segments and episode.stop_reason == "max_episode_tokens":  # the opening prompt left no room
        reply.stop_reason, reply.reward = "prompt_too_long", None
        reply.message = (f"the first call's prompt with max_tokens={limits.max_new_tokens} exceeds "
                         f"env.max_episode_tokens={limits.max_episode_tokens}")
    elif not reply.segments and not reply.message:
        reply.stop_reason, reply.reward = "env_error", None
        reply.message = "the agent made no chat or completion call that was answered"
    reply.calls, reply.refused, reply.drift = episode.calls, episode.refused, episode.conversation.drift
    reply.tool_calls, reply.tool_errors = episode.tool_calls, episode.tool_errors
    reply.parallel_calls = episode.parallel_calls
    return reply
