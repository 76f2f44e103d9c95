"""AgentHost: an environment host that also runs agents behind the gateway, and the MCP servers' sessions.

One per environment actor when env.agents or env.mcp_servers is set (``rlray:env-<i>``; it is an
``EnvironmentHost`` too, so the same actor runs environment episodes). Its own thread runs an asyncio loop that
holds the gateway's HTTP server (``rlray.envs.agents.gateway``), every running agent (``rlray.envs.agents``: many per host,
concurrently) and the MCP sessions (``rlray.envs.agents.mcp``: started with the host, stopped with it).

Rank 0 hands a host a batch of agent episodes (``run_agents``: the episodes, the rollout actors' handles and the
step's sampling). Every call of every agent becomes a request to the episode's rollout actor, and the
``TickBatcher`` gathers the requests into engine calls: one call per actor at a time, each holding what its running
episodes asked for meanwhile (a batch of prompts is what makes an engine fast). How long it waits for them is
``env.agent_batching`` (``lockstep``: for all of them, so a seeded run repeats its samples; ``window``: a short time).
Synchronous agents (a plain ``def``) run on a thread each, at most ``env.agent_threads`` of a batch at once:
``Admission`` starts the others as running ones end, without changing which requests share an engine call.

The engine call itself is the ``Sampler`` the host is built with (``rlray.run.agents.FleetSampler``: Ray calls to
the rollout actors); this module imports no Ray and no engine, and tests give it a scripted sampler.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rlray.envs.agents.admission import Admission
from rlray.envs.agents.agent import AgentReply, AgentRequest, LoadedAgent, load_agent, run_agent_episode
from rlray.envs.agents.conversation import Sampled
from rlray.envs.agents.gateway import Gateway, GatewayEpisode
from rlray.envs.agents.mcp import McpClients, McpServerSpec
from rlray.envs.host import EnvironmentHost
from rlray.envs.limits import EpisodeLimits

log = logging.getLogger(__name__)

GATEWAY_CONNECTIONS = 256  # HTTP connections the host's agents hold to its gateway at once (more calls wait)


class Sampler(Protocol):
    """The engine call of one batch of agent episodes: ``num_actors`` rollout actors, each sampled with the batch's
    sampling (``rlray.run.agents.FleetSampler``). A factory builds one per batch: ``sampler_factory(actors, sampling,
    min_version)`` (``AgentBatch``'s)."""

    num_actors: int

    async def sample(self, actor: int, prompts: list[list[int]], max_new_tokens: int,
                     stop: tuple[str, ...]) -> list[Sampled]:
        """Returns one completion per prompt from rollout actor ``actor``, in order."""
        ...


@dataclass
class AgentBatch:
    """Agent episodes for one host, and how to sample their calls.

    Attributes:
        episodes: the episodes.
        actors: the rollout actors' handles (an episode's calls go to ``actors[actor_key % len(actors)]``).
        sampling: the step's sampling (``rlray.rollout.SamplingSpec``), handed to the host's sampler factory.
        max_new_tokens: the most tokens a call samples (the sampling's max_new_tokens).
        min_version: partial rollouts (``rollout.partial``): the latest policy version pushed when the batch was sent;
            no call starts under an older one (a push loads beside the calls, not before them). None: without
            partial rollouts (Ray runs the push before the calls sent after it).
    """

    episodes: list[AgentRequest]
    actors: list[Any]
    sampling: Any
    max_new_tokens: int
    min_version: int | None = None


AGENT_BATCHING = ("lockstep", "window")  # the TickBatcher's modes (env.agent_batching)


@dataclass
class GatewayStats:
    """A host's gateway counters since it started: calls answered, engine calls, the prompts those carried, and
    ``batch_wait_s``: seconds the engine calls waited for their batch (from the first request of a call to its send,
    summed over calls)."""

    calls: int = 0
    engine_calls: int = 0
    engine_prompts: int = 0
    batch_wait_s: float = 0.0


class ThreadPerCall(concurrent.futures.Executor):
    """An executor that runs each call on a daemon thread of its own (no pool, so no call waits for a free thread).

    Synchronous agents run on it, as many at once as ``Admission`` lets start: under ``lockstep`` every running
    episode's turn is waited for, and an episode queued behind a full pool would hold the others until its time limit.
    A thread that outlives its episode's time limit keeps running (Python cannot kill it), but its episode has ended
    and handed its place on.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Returns the future of ``fn(*args, **kwargs)``, started at once on a new daemon thread."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 - the caller gets whatever the call raised
                future.set_exception(err)

        threading.Thread(target=run, name="rlray-agent", daemon=True).start()
        return future


class TickBatcher:
    """Gathers concurrent sample requests into one engine call per rollout actor (see the module docstring).

    An actor runs one call at a time. Before each call the batcher waits for the actor's running episodes to ask (an
    episode counts from ``enter`` to ``leave``; episodes are told apart by their actor key, unique within a batch).
    Without the wait, the first agent to ask would go alone in an engine call and the rest in the next, each turn
    costing two calls. It sends, in episode (actor key) order, once

    - ``lockstep``: every running episode pinned to the actor has a request waiting (one that ended no longer counts).
      No time window: each call's requests, and so its place in the actor's calls (``FleetSampler`` seeds by it), are
      a function of the episodes' own conversations, never of timing, so a seeded run repeats its agents' samples bit
      for bit. An agent busy with its own work (a slow tool) holds its actor's other episodes until it asks, ends, or
      is ended by its limits: env.step_timeout_s between its calls, env.episode_timeout_s (no wait past them). An
      episode with several calls at once counts as asking with its first; the others join as they come.
    - ``window``: the same, or after ``WINDOW_FRACTION`` of the actor's previous call's duration (``MAX_WINDOW_S``
      before its first call; never more), whichever comes first: a slow agent is not waited for, but an episode whose
      request comes late (a loaded machine: a few milliseconds) lands in another call, and its samples then differ
      from run to run.

    Requests that differ in max new tokens or stop strings go in separate calls (in a fixed order).

    Args:
        sampler: the engine call.
        stats: counters to add to.
        call_s: {actor: seconds of its previous call}, kept by the host across batches (updated here).
        batching: ``lockstep`` or ``window`` (``AGENT_BATCHING``, env.agent_batching).

    Raises:
        ValueError: ``batching`` is not one of ``AGENT_BATCHING``.
    """

    WINDOW_FRACTION = 0.1  # of the actor's previous call's duration: the longest wait for its running episodes
    MAX_WINDOW_S = 0.5

    def __init__(self, sampler: Sampler, stats: GatewayStats, call_s: dict[int, float] | None = None,
                 batching: str = "lockstep") -> None:
        if batching not in AGENT_BATCHING:
            raise ValueError(f"env.agent_batching={batching!r}: need one of {list(AGENT_BATCHING)}")
        self.sampler, self.stats, self.batching = sampler, stats, batching
        # actor -> its waiting requests: ((max new tokens, stop), the episode's actor key, prompt, future)
        self._queue: dict[int, list[tuple[tuple[int, tuple[str, ...]], int, list[int], asyncio.Future]]] = {}
        self._busy: set[int] = set()
        self._running: dict[int, collections.Counter[int]] = {}  # actor -> {actor key: its episodes not ended}
        self._call_s = {} if call_s is None else call_s  # actor -> seconds its previous call took
        self._changed = asyncio.Event()

    def enter(self, actor_key: int) -> None:
        """Counts an episode that starts on the actor ``actor_key`` picks."""
        self._running.setdefault(actor_key % self.sampler.num_actors, collections.Counter())[actor_key] += 1

    def leave(self, actor_key: int) -> None:
        """Counts an episode that ended (its actor no longer waits for it)."""
        running = self._running[actor_key % self.sampler.num_actors]
        running[actor_key] -= 1
        if running[actor_key] <= 0:
            del running[actor_key]
        self._changed.set()

    async def sample(self, actor_key: int, prompt: list[int], max_new_tokens: int, stop: tuple[str, ...]) -> Sampled:
        """Returns the completion of ``prompt`` from the actor that ``actor_key`` picks.

        Raises:
            whatever the sampler raised for the engine call that carried it.
        """
        actor = actor_key % self.sampler.num_actors
        future = asyncio.get_running_loop().create_future()
        self._queue.setdefault(actor, []).append(((max_new_tokens, stop), actor_key, prompt, future))
        self._changed.set()
        if actor not in self._busy:
            self._busy.add(actor)
            asyncio.get_running_loop().create_task(self._drain(actor))
        return await future

    async def _drain(self, actor: int) -> None:
        """Sends the actor's waiting requests, one engine call per (max new tokens, stop) at a time, until none waits."""
        try:
            await asyncio.sleep(0)  # one tick: the requests this tick's calls make go in the same engine call
            while self._queue.get(actor):
                await self._gather(actor)
                # in episode order, not arrival order: the same requests make the same engine call (seeded per call)
                waiting = sorted(self._queue.pop(actor), key=lambda request: request[1])
                groups: dict[tuple[int, tuple[str, ...]], list[tuple[list[int], asyncio.Future]]] = {}
                for how, _, prompt, future in waiting:
                    groups.setdefault(how, []).append((prompt, future))
                for (max_new, stop), items in groups.items():
                    await self._call(actor, max_new, stop, items)
        finally:
            self._busy.discard(actor)

    async def _gather(self, actor: int) -> None:
        """Waits until every running episode of ``actor`` has a request waiting (``window``: or the window has passed);
        adds the wait to ``stats.batch_wait_s``."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        previous = self._call_s.get(actor)
        window = None if self.batching == "lockstep" else (
            self.MAX_WINDOW_S if previous is None else min(self.WINDOW_FRACTION * previous, self.MAX_WINDOW_S))
        try:
            while not self._running.get(actor, {}).keys() <= {key for _, key, _, _ in self._queue.get(actor, ())}:
                left = None if window is None else started + window - loop.time()
                if left is not None and left <= 0:
                    return
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    return
        finally:
            self.stats.batch_wait_s += loop.time() - started

    async def _call(self, actor: int, max_new: int, stop: tuple[str, ...],
                    items: list[tuple[list[int], asyncio.Future]]) -> None:
        self.stats.engine_calls += 1
        self.stats.engine_prompts += len(items)
        started = asyncio.get_running_loop().time()
        try:
            got = await self.sampler.sample(actor, [p for p, _ in items], max_new, stop)
        except Exception as err:  # noqa: BLE001 - every request of the call gets the engine's error
            for _, future in items:
                if not future.done():
                    future.set_exception(err)
            return
        finally:
            self._call_s[actor] = asyncio.get_running_loop().time() - started
        for (_, future), sampled in zip(items, got, strict=True):
            if not future.done():
                future.set_result(sampled)


class AgentRunner:
    """What runs on an ``AgentHost``'s loop: the gateway, the agents' episodes and their batchers, the MCP sessions.

    A plain class of coroutines, apart from the host: a Ray actor class with any ``async`` method becomes an asyncio
    actor, whose blocking methods would then hold Ray's own loop (``ray._private.async_compat.has_async_methods``).

    Args:
        agents: {name: the loaded agent}.
        tokenizer: the policy's tokenizer (None without agents).
        sampler_factory: ``sampler_factory(actors, sampling, min_version)`` returns the ``Sampler`` of a batch.
        limits: the agents' episode limits (``max_new_tokens`` is set per batch, from its sampling).
        mcp: the MCP sessions (None without env.mcp_servers).
        tool_parser, chat_template_kwargs: the gateway's (``Gateway``).
        threads: the most synchronous agent episodes of a batch running at once, a thread each (``Admission``;
            env.agent_threads).
        batching: the batchers' mode, ``lockstep`` or ``window`` (``TickBatcher``; env.agent_batching). Under
            ``lockstep`` the episodes' HTTP connections to the gateway have no cap (an episode waiting for one would
            hold the others); under ``window`` at most ``GATEWAY_CONNECTIONS``.
    """

    def __init__(self, agents: dict[str, LoadedAgent], tokenizer: Any,
                 sampler_factory: Callable[[list[Any], Any, int | None], Sampler] | None,
                 limits: EpisodeLimits, mcp: McpClients | None, *,
                 tool_parser: str, chat_template_kwargs: dict[str, Any] | None,
                 threads: int = 64, batching: str = "lockstep") -> None:
        self.agents, self.sampler_factory, self.limits, self.mcp = agents, sampler_factory, limits, mcp
        self.threads, self.batching = threads, batching
        self.executor = ThreadPerCall()  # the synchronous agents' threads (as many as Admission starts)
        self.stats = GatewayStats()
        self.gateway = Gateway(tokenizer, self.sample, tool_parser=tool_parser, chat_template_kwargs=chat_template_kwargs)
        self._batchers: dict[str, TickBatcher] = {}
        self._call_s: dict[int, float] = {}  # rollout actor -> seconds of its last engine call (``TickBatcher``)
        self._http: Any = None

    async def start(self, gateway_host: str) -> None:
        """Starts the gateway on ``gateway_host`` ("" for none) and the MCP sessions."""
        if gateway_host:
            import httpx2
            import openai

            await self.gateway.start(gateway_host)
            # one pool for every episode's client: connections are reused; under window, calls past the pool wait
            cap = None if self.batching == "lockstep" else GATEWAY_CONNECTIONS
            self._http = openai.DefaultAsyncHttpxClient(
                timeout=httpx2.Timeout(self.limits.episode_timeout_s, pool=None),
                limits=httpx2.Limits(max_connections=cap, max_keepalive_connections=GATEWAY_CONNECTIONS))
        if self.mcp is not None:
            await self.mcp.start()

    async def stop(self) -> None:
        """Stops the MCP sessions, the gateway and the shared HTTP client."""
        if self.mcp is not None:
            await self.mcp.close()
        await self.gateway.close()
        if self._http is not None:
            await self._http.aclose()

    async def run(self, batch: AgentBatch) -> list[AgentReply]:
        """Returns the replies of ``batch``'s episodes, in order: async agents' episodes start at once, synchronous
        ones as ``Admission`` admits them.

        Raises:
            ValueError: the runner has no sampler factory.
        """
        if self.sampler_factory is None:
            raise ValueError("AgentHost was built without a sampler_factory: it cannot sample agents' calls")
        own = GatewayStats()  # this batch's engine calls (its first reply carries them), added to the host's after
        batcher = TickBatcher(self.sampler_factory(batch.actors, batch.sampling, batch.min_version), own,
                              self._call_s, self.batching)
        limits = self.limits.with_max_new_tokens(batch.max_new_tokens)
        for request in batch.episodes:
            self._batchers[request.key] = batcher
        # the episodes admitted now count before any asks: the first call waits for them all
        admission = Admission(batcher, batch.episodes, lambda r: not self.agents[r.agent].is_async, self.threads)

        async def one(request: AgentRequest) -> AgentReply:
            await admission.wait(request)  # its time limits count from here (run_agent_episode starts them)
            try:
                return await run_agent_episode(self.gateway, request, self.agents[request.agent], self.mcp, limits,
                                               http_client=self._http, threads=self.executor)
            finally:
                admission.end(request)
                self._batchers.pop(request.key, None)

        try:
            replies = list(await asyncio.gather(*(one(r) for r in batch.episodes)))
        finally:
            self.stats.engine_calls += own.engine_calls
            self.stats.engine_prompts += own.engine_prompts
            self.stats.batch_wait_s += own.batch_wait_s
        if replies:  # once per batch, so a step's sum over its episodes counts each batch once
            replies[0] = dataclasses.replace(replies[0], engine_calls=own.engine_calls,
                                             engine_prompts=own.engine_prompts, batch_wait_s=own.batch_wait_s)
        return replies

    async def sample(self, episode: GatewayEpisode, prompt: list[int], max_new_tokens: int,
                     stop: tuple[str, ...]) -> Sampled:
        """Returns the engine's completion of one gateway call, through the batcher of the episode's batch."""
        self.stats.calls += 1
        return await self._batchers[episode.key].sample(episode.actor_key, prompt, max_new_tokens, stop)


class AgentHost(EnvironmentHost):
    """An ``EnvironmentHost`` that also runs agents behind the gateway and holds the MCP sessions (module docstring).

    Its methods are all synchronous (the coroutines live in its ``AgentRunner``), so Ray runs it as a threaded actor.

    Args:
        environments: {name: spec} of the environments (``EnvironmentHost``; may be empty).
        agents: {name: spec} of the agents (``rlray.envs.agents.load_agent``; may be empty with MCP servers alone).
        model_dir: the policy's local folder (its tokenizer tokenizes the agents' conversations).
        chat_template: ``model.chat_template`` (None: the tokenizer's own).
        sampler_factory: ``sampler_factory(actors, sampling, min_version)`` returns the ``Sampler`` of a batch.
        max_turns: calls answered per agent episode; max_episode_tokens: the longest segment, in tokens.
        episode_timeout_s: seconds per agent episode; max_observation_tokens: as an environment episode's (the host's
            ``limits``, one ``EpisodeLimits`` over the same env.* keys as the environment episodes').
        mcp_servers: the MCP servers to start (``McpServerSpec``).
        gateway_host: the address the gateway binds (``env.gateway_host``).
        chat_template_kwargs: extra template variables (``rollout.chat_template_kwargs``).
        agent_threads: the most synchronous agent episodes of a batch running at once, a thread each (``Admission``;
            env.agent_threads).
        agent_batching: how the batchers gather the agents' calls, ``lockstep`` or ``window`` (``TickBatcher``;
            env.agent_batching).
        tool_parser, step_timeout_s: as ``EnvironmentHost`` (step_timeout_s is also the most seconds an agent may spend
            between gateway calls).
        host_kwargs: the other keyword arguments of ``EnvironmentHost`` (threads, sandbox, memory_gib, ...).

    Raises:
        ValueError: an agent or environment cannot be loaded (names it and its spec).
        rlray.envs.agents.mcp.McpStartError: an MCP server did not start.
    """

    def __init__(self, environments: dict[str, str], *, agents: dict[str, str], model_dir: str | None,
                 chat_template: str | None = None, sampler_factory: Callable[[list[Any], Any, int | None], Sampler] | None = None,
                 max_turns: int = 8, max_episode_tokens: int = 4096, episode_timeout_s: float = 600.0,
                 max_observation_tokens: int = 256,
                 mcp_servers: list[McpServerSpec] | None = None, gateway_host: str = "127.0.0.1",
                 chat_template_kwargs: dict[str, Any] | None = None, agent_threads: int = 64,
                 agent_batching: str = "lockstep", tool_parser: str = "hermes", step_timeout_s: float = 60.0,
                 **host_kwargs: Any) -> None:
        super().__init__(environments, tool_parser=tool_parser, step_timeout_s=step_timeout_s, **host_kwargs)
        loaded: dict[str, LoadedAgent] = {}
        for name, spec in agents.items():
            try:
                loaded[name] = load_agent(spec)
            except Exception as err:  # noqa: BLE001 - any import problem of user code becomes one clear error
                raise ValueError(f"env.agents.{name}: cannot load '{spec}': {err}") from err
        tokenizer = None
        if agents:
            from rlray.models import load_tokenizer

            tokenizer = load_tokenizer(model_dir, chat_template)
        if agent_batching not in AGENT_BATCHING:
            raise ValueError(f"env.agent_batching={agent_batching!r}: need one of {list(AGENT_BATCHING)}")
        mcp = McpClients(list(mcp_servers or [])) if mcp_servers else None
        self.limits = EpisodeLimits(max_turns, max_episode_tokens, max_observation_tokens, episode_timeout_s,
                                    step_timeout_s)
        self.runner = AgentRunner(loaded, tokenizer, sampler_factory, self.limits, mcp, tool_parser=tool_parser,
                                  chat_template_kwargs=chat_template_kwargs, threads=agent_threads,
                                  batching=agent_batching)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlray-gateway", daemon=True)
        self._thread.start()
        try:
            self._on_loop(self.runner.start(gateway_host if agents else ""))
        except BaseException:
            self.shutdown()
            raise
        if mcp is not None:  # the tools every environment episode of this host is opened with (EnvironmentHost)
            self.episode_tools = mcp.tools()

    @property
    def gateway(self) -> Gateway:
        """Returns the host's gateway."""
        return self.runner.gateway

    @property
    def mcp(self) -> McpClients | None:
        """Returns the host's MCP sessions (None without env.mcp_servers)."""
        return self.runner.mcp

    def run_agents(self, batch: AgentBatch) -> list[AgentReply]:
        """Returns the replies of ``batch``'s episodes, in order, each run to its end (blocks).

        Raises:
            ValueError: an episode names an agent this host does not have.
        """
        unknown = sorted({r.agent for r in batch.episodes} - set(self.runner.agents))
        if unknown:
            raise ValueError(f"agents {unknown} are not in env.agents {sorted(self.runner.agents)}")
        return self._on_loop(self.runner.run(batch))

    def sync_agents(self) -> list[str]:
        """Returns the names of the host's synchronous agents (a plain ``def``: admitted ``env.agent_threads`` at a
        time, ``rlray.envs.agents.admission``), sorted."""
        return sorted(name for name, agent in self.runner.agents.items() if not agent.is_async)

    def gateway_url(self) -> str:
        """Returns the gateway's base URL ("" without agents)."""
        return self.runner.gateway.base_url

    def gateway_stats(self) -> GatewayStats:
        """Returns the gateway's counters since the host started."""
        stats = self.runner.stats
        return GatewayStats(stats.calls, stats.engine_calls, stats.engine_prompts, stats.batch_wait_s)

    def mcp_tool_names(self) -> list[str]:
        """Returns the MCP servers' tool names ([] without env.mcp_servers)."""
        return self.runner.mcp.names if self.runner.mcp is not None else []

    def shutdown(self) -> None:
        """Stops the MCP servers and the gateway, then the loop (the host is unusable after)."""
        if self._loop.is_closed():
            return
        if self._loop.is_running():
            try:
                self._on_loop(self.runner.stop(), timeout_s=30.0)
            except Exception:  # noqa: BLE001 - stopping goes on whatever failed
                log.warning("stopping the gateway or the MCP sessions failed", exc_info=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - the interpreter may be going down
            pass

    def _on_loop(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Returns the result of ``coro`` run on the host's loop (blocks this thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)
