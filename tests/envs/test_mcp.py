"""MCP tools (rlray.envs.agents.mcp) through the real ``mcp`` client and the small server of tests/fixtures/mcp_server.py:
tool listing, calls, failures and time-outs as counted error observations, stdio and streamable HTTP, start errors,
MCP tools in a ToolEnvironment, and an environment host that starts and stops its servers."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlray.envs import AssistantTurn, ToolCall, tool_schemas
from rlray.envs.agents.mcp import McpClients, McpServerSpec, McpStartError, McpTool

SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "mcp_server.py"
AGENTS = Path(__file__).resolve().parents[1] / "fixtures" / "agents.py"
STDIO = McpServerSpec("fixture", (sys.executable, str(SERVER)), timeout_s=2.0)


def test_stdio_tools_are_listed_called_and_their_faults_answered():
    async def scenario():
        clients = McpClients([STDIO])
        await clients.start()
        try:
            got = {"names": clients.names, "schema": clients.schemas[0]}
            got["add"] = await clients.call("add", {"a": 2, "b": 3})
            got["json"] = await clients.call("add", '{"a": 1, "b": 1}')
            got["explode"] = await clients.call("explode", {"reason": "boom"})
            got["nap"] = await clients.call("nap", {"seconds": 5})
            got["after"] = await clients.call("add", {"a": 4, "b": 4})  # the session survives a time-out
            got["unknown"] = await clients.call("nope", {})
            got["bad_json"] = await clients.call("add", "{not json")
            got["bad_args"] = await clients.call("add", {"a": "x", "b": 1})
            got["counts"] = (clients.calls, clients.errors, clients.timeouts)
        finally:
            await clients.close()
        return got

    got = asyncio.run(scenario())
    assert got["names"] == ["add", "explode", "nap"]
    assert got["schema"]["type"] == "function" and got["schema"]["function"]["name"] == "add"
    assert got["schema"]["function"]["parameters"]["required"] == ["a", "b"]
    assert (got["add"].text, got["add"].is_error, got["json"].text, got["after"].text) == ("5", False, "2", "8")
    assert got["explode"].is_error and got["explode"].text.startswith("Error: tool 'explode' failed")
    assert got["nap"].is_error and got["nap"].timed_out and "timed out after 2 s" in got["nap"].text
    assert got["unknown"].is_error and "unknown tool 'nope'; available tools: add, explode, nap" in got["unknown"].text
    assert got["bad_json"].is_error and "not JSON" in got["bad_json"].text
    assert got["bad_args"].is_error
    assert got["counts"] == (8, 5, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_streamable_http_server_is_reached_by_its_url():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the MCP HTTP server did not start"
                time.sleep(0.2)

        async def scenario():
            clients = McpClients([McpServerSpec("web", url=f"http://127.0.0.1:{port}/mcp", timeout_s=5.0)])
            await clients.start()
            try:
                return clients.names, (await clients.call("add", {"a": 20, "b": 22})).text
            finally:
                await clients.close()

        assert asyncio.run(scenario()) == (["add", "explode", "nap"], "42")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_start_errors_name_the_server():
    async def start(specs):
        clients = McpClients(specs)
        await clients.start()

    with pytest.raises(McpStartError, match=r"server 'ghost' \(/no/such/mcp-server\) did not start"):
        asyncio.run(start([McpServerSpec("ghost", ("/no/such/mcp-server",))]))
    twin = McpServerSpec("twin", STDIO.command)
    with pytest.raises(McpStartError, match="tool 'add' is listed by servers 'fixture' and 'twin'"):
        asyncio.run(start([STDIO, twin]))


def _mcp_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if str(SERVER) in " ".join(p.cmdline())]


def test_two_hosts_in_one_process_give_their_environments_their_own_tools():
    """The tools reach an episode from its host, not from the process: a host with an MCP server and one without,
    side by side in one process, open the same environment with different tool lists."""
    from rlray.envs.agents.agent_host import AgentHost
    from rlray.envs.host import ResetRequest

    with_mcp = AgentHost({"calc": f"{AGENTS}:CalcEnv"}, agents={}, model_dir=None, mcp_servers=[STDIO])
    without = AgentHost({"calc": f"{AGENTS}:CalcEnv"}, agents={}, model_dir=None, mcp_servers=[])
    try:
        (a,) = with_mcp.reset([ResetRequest("a", "calc", {"prompt": "Add"})])
        (b,) = without.reset([ResetRequest("b", "calc", {"prompt": "Add"})])
        assert [t["function"]["name"] for t in a.tools] == ["double", "add", "explode", "nap"]
        assert [t["function"]["name"] for t in b.tools] == ["double"]
        with_mcp.close(["a"])
        without.close(["b"])
    finally:
        without.shutdown()
        with_mcp.shutdown()


def test_a_host_starts_its_servers_offers_them_to_tool_environments_and_stops_them(tiny_model_path):
    from ray._private.async_compat import has_async_methods

    from rlray.envs.agents.agent_host import AgentHost
    from rlray.envs.host import ResetRequest, StepRequest
    from rlray.envs.toolenv import open_with_tools
    from tests.fixtures.agents import CalcEnv

    assert not has_async_methods(AgentHost)  # else Ray makes it an asyncio actor and its blocking calls hold Ray's loop
    host = AgentHost({"calc": f"{AGENTS}:CalcEnv"}, agents={}, model_dir=None, mcp_servers=[STDIO])
    try:
        assert host.mcp_tool_names() == ["add", "explode", "nap"] and len(_mcp_children()) == 1
        assert host.gateway_url() == ""  # no agents: no gateway
        tools = host.episode_tools  # listed once by the host, handed to every episode it opens
        assert [t.name for t in tools] == ["add", "explode", "nap"] and all(isinstance(t, McpTool) for t in tools)
        env = CalcEnv()
        open_with_tools(env, tools)  # what the host does before an episode's reset
        opened = env.reset(prompt="Add")
        schemas = tool_schemas(opened.tools)
        assert [s["function"]["name"] for s in schemas] == ["double", "add", "explode", "nap"]
        assert schemas[1] == host.mcp.schemas[0]  # the server's own schema
        step = env.step(AssistantTurn("", [ToolCall("add", {"a": 1, "b": 2}), ToolCall("double", {"x": 4}),
                                           ToolCall("explode", {"reason": "no"})]))
        assert [o["content"] for o in step.observations[:2]] == ["3", "8"]
        assert step.observations[2]["content"].startswith("Error: tool 'explode' raised RuntimeError: tool 'explode' failed")
        assert (step.tool_calls, step.tool_errors) == (3, 1)
        # the same through the host's own environment episodes (reset and step, as the episode loop calls them)
        (opened,) = host.reset([ResetRequest("e0", "calc", {"prompt": "Add"})])
        assert opened.error is None and [t["function"]["name"] for t in opened.tools] == ["double", "add", "explode", "nap"]
        call = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'
        (stepped,) = host.step([StepRequest("e0", call, "stop", 0)])
        assert stepped.error is None and stepped.step.observations[0]["content"] == "42"
        host.close(["e0"])
    finally:
        host.shutdown()
    assert [s["function"]["name"] for s in tool_schemas(CalcEnv().reset(prompt="Add").tools)] == ["double"]  # no leak
    deadline = time.monotonic() + 10
    while _mcp_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _mcp_children() == []  # the server stopped with its host
