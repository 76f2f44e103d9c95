"""MCP tools: sessions with the configured MCP servers (``env.mcp_servers``), their tools as tool schemas, and calls.

Each environment host starts one client session per server when it starts and stops them with it: a stdio server is
the host's child process (``command``; a command that starts with ``python`` runs on the host's own interpreter, the
run's virtualenv), a streamable-HTTP server is reached at its ``url``. The sessions live on the
host's asyncio loop, through the ``mcp`` package's client (``mcp.ClientSession`` over ``mcp.stdio_client`` or
``mcp.client.streamable_http.streamable_http_client``). The servers' tools are listed once, at start, and
offered two ways:

- to agents (``rlray.envs.agents``): ``episode_tools()`` in an agent gives the tools' OpenAI schemas and
  ``await tools.call(name, arguments)``;
- to environments built on ``ToolEnvironment``: ``McpClients.tools()`` gives them as ``McpTool`` callables, which the
  host hands to each episode it opens (``rlray.envs.host.EnvironmentHost.episode_tools``), added to the environment's
  own tools (their JSON schemas are the servers', ``tool_schemas`` lists them).

A call never raises: an error the tool reports (``is_error``), an exception, a server that died, and a call past the
server's ``timeout_s`` each give an ``"Error: ..."`` observation, counted (``McpClients.errors``, ``.timeouts``; in
an episode, its tool_errors). Text content blocks are joined; a result with only structured content is its JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # seconds a server may take to start and list its tools
PYTHON_NAMES = ("python", "python3")  # a stdio command starting with one of these runs on the host's own interpreter


class McpStartError(RuntimeError):
    """An MCP server could not be started or did not list its tools (names the server)."""


@dataclass(frozen=True)
class McpServerSpec:
    """One MCP server to connect to.

    Attributes:
        name: the server's name (for messages).
        command: the argv of a stdio server started as the host's child process ([] for a URL server).
        url: the streamable-HTTP endpoint of a running server ("" for a stdio server).
        timeout_s: seconds one tool call may take before it is answered with a time-out error.
        env: extra environment variables of a stdio server's process.
    """

    name: str
    command: tuple[str, ...] = ()
    url: str = ""
    timeout_s: float = 30.0
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ToolOutcome:
    """What one tool call gave: the observation text, whether it failed, and whether it timed out."""

    text: str
    is_error: bool = False
    timed_out: bool = False


def result_text(result: Any) -> str:
    """Returns an MCP ``CallToolResult``'s content as text: its text blocks joined by newlines, other blocks named in
    brackets (``[image]``), and its structured content as JSON when there is no text block."""
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)  # content blocks of several types; only TextContent has text
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    if not any(isinstance(getattr(b, "text", None), str) for b in result.content) and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


class McpTool:
    """One MCP tool as a Python callable for ``ToolEnvironment``: ``tool(**arguments)`` returns its text, and raises
    ``RuntimeError`` with the error text when the call failed (``call_tool`` turns that into an error observation).

    Attributes:
        name: the tool's name (``__name__`` too).
        schema: its OpenAI function schema (``{"type": "function", "function": {name, description, parameters}}``).
    """

    def __init__(self, clients: McpClients, name: str, schema: dict[str, Any]) -> None:
        self._clients, self.name, self.__name__, self.schema = clients, name, name, schema

    def __call__(self, **arguments: Any) -> str:
        """Returns the tool's text for ``arguments``, run on the host's loop (from an environment's thread).

        Raises:
            RuntimeError: the call failed or timed out (the message is the error observation), or it was made from the
                loop's own thread (an async caller must ``await clients.call(...)``).
        """
        outcome = self._clients.call_from_thread(self.name, arguments)
        if outcome.is_error:
            raise RuntimeError(outcome.text.removeprefix("Error: "))
        return outcome.text


class McpClients:
    """Sessions with the MCP servers of one environment host (see the module docstring).

    Args:
        specs: the servers.

    Attributes:
        schemas: the OpenAI function schemas of every server's tools, in server then listing order.
        calls, errors, timeouts: tool calls made, those that failed (time-outs included), those that timed out.
    """

    def __init__(self, specs: list[McpServerSpec]) -> None:
        self.specs = list(specs)
        self.schemas: list[dict[str, Any]] = []
        self.calls = self.errors = self.timeouts = 0
        self._sessions: dict[str, Any] = {}  # server name -> ClientSession
        self._owner: dict[str, McpServerSpec] = {}  # tool name -> its server
        self._tasks: list[asyncio.Task] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def names(self) -> list[str]:
        """Returns the tool names, in the order of ``schemas``."""
        return [s["function"]["name"] for s in self.schemas]

    def tools(self) -> list[McpTool]:
        """Returns every tool as an ``McpTool`` callable (for environments)."""
        return [McpTool(self, s["function"]["name"], s) for s in self.schemas]

    async def start(self) -> None:
        """Starts every server's session on the running loop and lists its tools.

        Raises:
            McpStartError: a server did not start, did not answer within ``START_TIMEOUT_S``, or lists a tool name
                another server lists too (names both).
        """
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        for spec in self.specs:
            ready: asyncio.Future = self._loop.create_future()
            self._tasks.append(asyncio.create_task(self._serve(spec, ready), name=f"mcp-{spec.name}"))
            try:
                session, tools = await asyncio.wait_for(ready, START_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - any start failure becomes one error naming the server
                await self.close()
                how = " ".join(spec.command) if spec.command else spec.url
                raise McpStartError(f"env.mcp_servers: server {spec.name!r} ({how}) did not start: "
                                    f"{type(err).__name__}: {err}") from err
            self._sessions[spec.name] = session
            for tool in tools:
                if tool.name in self._owner:
                    await self.close()
                    raise McpStartError(f"env.mcp_servers: tool {tool.name!r} is listed by servers "
                                        f"{self._owner[tool.name].name!r} and {spec.name!r}; tool names must be unique")
                self._owner[tool.name] = spec
                self.schemas.append({"type": "function", "function": {
                    "name": tool.name, "description": tool.description or "", "parameters": tool.input_schema}})

    async def close(self) -> None:
        """Ends every session (stdio servers' processes stop)."""
        if self._stop is not None:
            self._stop.set()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, 10.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 - closing never fails
                task.cancel()
        self._tasks, self._sessions = [], {}

    async def call(self, name: str, arguments: dict[str, Any] | str | None) -> ToolOutcome:
        """Returns the outcome of calling tool ``name`` with ``arguments`` (a dict, or its JSON text); never raises."""
        self.calls += 1
        spec = self._owner.get(name)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                return self._failed(f"Error: the arguments of tool {name!r} are not JSON: {err}")
        if spec is None:
            return self._failed(f"Error: unknown tool {name!r}; available tools: {', '.join(self.names) or 'none'}")
        if not isinstance(arguments, dict):
            return self._failed(f"Error: the arguments of tool {name!r} must be a JSON object")
        session = self._sessions.get(spec.name)
        if session is None:
            return self._failed(f"Error: MCP server {spec.name!r} of tool {name!r} is not running")
        try:
            result = await asyncio.wait_for(session.call_tool(name, arguments), spec.timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            out = self._failed(f"Error: tool {name!r} timed out after {spec.timeout_s:g} s (env.mcp_servers "
                               f"{spec.name!r} timeout_s)")
            out.timed_out = True
            return out
        except Exception as err:  # noqa: BLE001 - a failing server is an observation for the model, not a crash
            return self._failed(f"Error: tool {name!r} failed: {type(err).__name__}: {err}")
        text = result_text(result)
        if result.is_error:
            return self._failed(f"Error: tool {name!r} failed: {text}")
        return ToolOutcome(text)

    def call_from_thread(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Returns ``call(name, arguments)`` run on the sessions' loop, from another thread (blocks).

        Raises:
            RuntimeError: called on the loop's own thread (it would wait for itself), or before ``start``.
        """
        if self._loop is None:
            raise RuntimeError("the MCP sessions are not started")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError(f"MCP tool {name!r} called synchronously on the host's event loop; use "
                               "`await episode_tools().call(...)`")
        return asyncio.run_coroutine_threadsafe(self.call(name, arguments), self._loop).result()

    def _failed(self, text: str) -> ToolOutcome:
        self.errors += 1
        log.warning("%s", text[:300])
        return ToolOutcome(text, is_error=True)

    async def _serve(self, spec: McpServerSpec, ready: asyncio.Future) -> None:
        """Holds one server's session open until ``close``: sets ``ready`` to (session, tools), or to the error."""
        from mcp import ClientSession

        try:
            async with self._transport(spec) as streams, ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                listed = await session.list_tools()
                ready.set_result((session, list(listed.tools)))
                await self._stop.wait()
        except BaseException as err:  # noqa: BLE001 - reported to start(), or logged once the session is up
            if not ready.done():
                ready.set_exception(err if isinstance(err, Exception) else RuntimeError(repr(err)))
            elif not self._stop.is_set():
                log.warning("MCP server %r stopped: %s: %s", spec.name, type(err).__name__, err)
                self._sessions.pop(spec.name, None)
            if isinstance(err, asyncio.CancelledError):
                raise

    @staticmethod
    def _transport(spec: McpServerSpec) -> Any:
        """Returns the async context manager of the server's transport (stdio child process, or streamable HTTP)."""
        if spec.url:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(spec.url)
        from mcp import StdioServerParameters, stdio_client

        command = sys.executable if spec.command[0] in PYTHON_NAMES else spec.command[0]
        params = StdioServerParameters(command=command, args=list(spec.command[1:]), env=dict(spec.env) or None)
        return stdio_client(params, errlog=sys.stderr)
