"""verifiers environments, trained unchanged: an agent that plays each episode through the verifiers bridge.

A verifiers 0.4 environment (Prime Intellect's ``verifiers.v1``: a ``Taskset`` of ``Task`` s with ``@vf.reward``
functions, played by a harness) cannot be imported here: verifiers pins ``openai<3`` and ``mcp==2.0.0``, rlray uses
openai 3. So it runs in its own Python environment, ``.venvs/verifiers`` (``make verifiers-venv``, part of ``make
install``), inside ``rlray/envs/servers/verifiers_bridge.py``, a small HTTP server (prime-rl likewise runs each
environment as a server of its own). This module is rlray's side, written as an agent (``rlray.envs.agents``): for
each episode it posts the row's task and the episode's gateway endpoint (``client.base_url``) to the bridge; the
environment's harness makes its model calls there, so every sampled token is recorded by the gateway and trained
token-in/token-out; the bridge answers with the rubric's reward, the episode's reward, and the per-function scores,
logged as ``reward/<agent>/<function>`` terms of weight 0 (``AgentResult.scores``).

The bridge is an environment server like any other: a ``ServerSpec`` (the bridge's command, run by the verifiers
venv's ``python``, healthy when ``GET /health`` answers) that a ``ServerSupervisor``
(``rlray.envs.servers.supervisor``) runs, so starting, the guard process, restarts and their budget
(``max_restarts``), the session bound (``max_concurrent``), the log file and stopping are the supervisor's. Each
episode holds one session slot while its request is open. A bridge error, an episode verifiers could not score, or a
bridge that dies under an open episode fails that episode only (``env_error``, counted in env/failed); the supervisor
restarts a dead bridge (its watcher, or the next episode's session), on the same URL.

Use, in an agent file named by ``env.agents`` (``tests/envs/verifiers/vf_sum_agent.py``)::

    agent = verifiers_agent({"taskset": {"id": "vf_sum"}, "agent": {"harness": {"id": "null"}}},
                            paths=[Path(__file__).parent])

with rows ``{"prompt": "...", "task_index": i}`` (``i`` indexes the taskset's ``load()``; ``task`` instead gives a
whole ``TaskData`` dump). One bridge per environment host process and config, started on its first episode,
stopped with the process (the supervisor's exit hook; its guard when the process is killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from rlray.envs.agents.agent import AgentResult
from rlray.envs.servers.supervisor import Lease, ServerError, ServerProcess, ServerSpec, ServerSupervisor

BRIDGE_SCRIPT = Path(__file__).with_name("verifiers_bridge.py")
DEFAULT_VENV = Path(__file__).resolve().parents[3] / ".venvs" / "verifiers"  # the checkout's (make verifiers-venv)
DEFAULT_SESSIONS = 64  # session slots of a bridge without max_concurrent


def venv_python(python: str | os.PathLike | None = None) -> Path:
    """Returns the interpreter of the verifiers environment: ``python``, else ``$RLRAY_VERIFIERS_PYTHON``, else the
    checkout's ``.venvs/verifiers/bin/python``.

    Raises:
        FileNotFoundError: that interpreter does not exist (the message says how to make it).
    """
    path = Path(python or os.environ.get("RLRAY_VERIFIERS_PYTHON") or DEFAULT_VENV / "bin" / "python")
    if not path.exists():
        raise FileNotFoundError(f"rlray: the verifiers Python environment {path} does not exist; make it with "
                                "`make verifiers-venv` (part of `make install`) or set RLRAY_VERIFIERS_PYTHON")
    return path


def bridge_spec(env: dict[str, Any], paths: Sequence[str | os.PathLike] = (), *, python: str | os.PathLike | None = None,
                name: str = "", max_concurrent: int | None = None, start_timeout_s: float = 120.0,
                max_restarts: int = 3, host: str = "127.0.0.1") -> ServerSpec:
    """Returns the bridge as an environment server: ``python verifiers_bridge.py --env JSON --host {host} --port
    {port} [--path DIR ...] [--max-concurrent N]`` in the verifiers venv, healthy when ``GET /health`` answers.

    Args:
        env: verifiers' ``EnvConfig`` data, e.g. ``{"taskset": {"id": "vf_sum"}}``.
        paths: folders put on the bridge's ``sys.path`` (where the taskset module lies; made absolute here).
        python: the verifiers venv's interpreter (``venv_python``).
        name: the server's name (its log file ``<name>.log``); "": ``verifiers-<taskset id>``.
        max_concurrent: episodes open on the bridge at once (the session bound, and the bridge's own gate); None:
            ``DEFAULT_SESSIONS`` slots, no gate in the bridge.
        start_timeout_s: seconds one start may take until healthy.
        max_restarts: restarts after the bridge dies, over the run.
        host: the address it binds.

    Raises:
        FileNotFoundError: no verifiers venv (``venv_python``).
    """
    command = ["python", str(BRIDGE_SCRIPT), "--env", json.dumps(env), "--host", "{host}", "--port", "{port}"]
    for p in paths:
        command += ["--path", str(Path(p).resolve())]
    if max_concurrent:
        command += ["--max-concurrent", str(max_concurrent)]
    taskset = env.get("taskset", {}).get("id", "env") if isinstance(env.get("taskset"), dict) else "env"
    return ServerSpec(name or f"verifiers-{taskset}", command=tuple(command), python=str(venv_python(python)),
                      host=host, health_path="/health", max_sessions=max_concurrent or DEFAULT_SESSIONS,
                      start_timeout_s=start_timeout_s, max_restarts=max_restarts)


class VerifiersBridge:
    """One verifiers environment's bridge, run by a ``ServerSupervisor`` (started on the first episode), and the
    episodes played through it.

    Args:
        spec: the bridge's server (``bridge_spec``).
        log_dir: folder of its log file (None: the supervisor's default, ``$RLRAY_SERVER_LOG_DIR`` or a temporary one).
        session_timeout_s: seconds an episode waits for a free session slot.

    Attributes:
        supervisor: the bridge's supervisor (``supervisor.restarts()``, ``supervisor.stop()``).
    """

    def __init__(self, spec: ServerSpec, log_dir: str | None = None, session_timeout_s: float = 600.0) -> None:
        self.spec, self.session_timeout_s = spec, session_timeout_s
        self.supervisor = ServerSupervisor([spec], log_dir)
        self._started = False
        self._lock = threading.Lock()

    @property
    def server(self) -> ServerProcess:
        """Returns the bridge's ``ServerProcess`` (its ``url``, ``generation``, ``restarts``, ``log_path``)."""
        return self.supervisor[self.spec.name]

    def start(self) -> str:
        """Starts the bridge and its watcher the first time (thread-safe; blocks until healthy); returns its URL.

        Raises:
            ServerStartError: the first start failed (its log quoted); later calls raise nothing, and the episodes'
                sessions raise ``ServerDown``.
        """
        with self._lock:
            if not self._started:
                self._started = True
                self.supervisor.start()
        return self.server.url

    def stop(self) -> None:
        """Stops the bridge (its process group: the harness programs it runs too) and its watcher; idempotent."""
        self.supervisor.stop()

    async def rollout(self, row: dict[str, Any], base_url: str, api_key: str = "rlray") -> AgentResult:
        """Plays the row's task against ``base_url`` in the bridge, holding one session slot; returns its reward
        and per-function scores.

        Raises:
            ValueError: the row has neither ``task_index`` nor ``task``.
            ServerError: the bridge is down (did not start, or out of restarts), busy past ``session_timeout_s``,
                or dropped the request (it died: the supervisor restarts it, this episode fails).
            RuntimeError: the bridge failed the episode, or verifiers scored nothing (its errors are in the message).
        """
        import httpx

        if "task_index" not in row and "task" not in row:
            raise ValueError(f"rlray: a verifiers row needs 'task_index' or 'task'; it has {sorted(row)}")
        await asyncio.get_running_loop().run_in_executor(None, self.start)
        body = {"base_url": base_url, "model": "policy", "api_key": api_key,
                **({"task": row["task"]} if "task" in row else {"task_index": int(row["task_index"])})}
        async with _session(self.server, self.session_timeout_s) as lease:
            try:
                async with httpx.AsyncClient(timeout=None) as http:
                    reply = await http.post(f"{lease.url}/rollout", json=body)
            except httpx.TransportError as err:
                raise ServerError(f"rlray: the verifiers bridge {self.spec.name!r} at {lease.url} dropped the episode "
                                  f"({type(err).__name__}: {err}); a bridge that died is restarted, this episode "
                                  f"fails; log {self.server.log_path}") from err
        got = reply.json()
        if reply.status_code != 200:
            raise RuntimeError(f"rlray: the verifiers bridge failed the episode: {got.get('error', got)}")
        return result_of(got)


@contextlib.asynccontextmanager
async def _session(server: ServerProcess, timeout_s: float) -> AsyncIterator[Lease]:
    """``server.session(timeout_s)`` entered on a worker thread (it may wait for a slot or a restart); a caller
    cancelled while it waits (the episode's time limit) frees the slot once the thread has taken it."""
    held = server.session(timeout_s)
    taking = asyncio.get_running_loop().run_in_executor(None, held.__enter__)
    try:
        lease = await asyncio.shield(taking)
    except asyncio.CancelledError:
        taking.add_done_callback(lambda f: f.exception() is None and held.__exit__(None, None, None))
        raise
    try:
        yield lease
    finally:
        held.__exit__(None, None, None)


def result_of(got: dict[str, Any]) -> AgentResult:
    """Returns the ``AgentResult`` of a bridge's ``/rollout`` answer (``verifiers_bridge.summarize``).

    reward: verifiers' episode reward (the weighted sum of the rubric's functions); scores: each function's
    unweighted score; metrics: the task's ``@vf.metric`` values.

    Raises:
        RuntimeError: the episode has no reward (verifiers' errors in the message).
    """
    if got.get("reward") is None:
        raise RuntimeError(f"rlray: verifiers did not score the episode: {'; '.join(got.get('errors') or ['no reward'])}")
    return AgentResult(reward=float(got["reward"]), metrics={k: float(v) for k, v in got.get("metrics", {}).items()},
                       scores={k: float(v) for k, v in got.get("scores", {}).items()})


BRIDGES: dict[str, VerifiersBridge] = {}  # this process's bridges, by their agent's config (verifiers_agent)


def verifiers_agent(env: dict[str, Any], paths: Sequence[str | os.PathLike] = (), *, python: str | None = None,
                    max_concurrent: int | None = None, start_timeout_s: float = 120.0, max_restarts: int = 3,
                    name: str = "") -> Callable[[Any, dict[str, Any]], Awaitable[AgentResult]]:
    """Returns an agent function (``env.agents``) that plays a verifiers environment's episodes (module docstring).

    Args:
        env: verifiers' ``EnvConfig`` data: ``{"taskset": {"id": "<module>", ...}, "agent": {"harness": {"id":
            "null"}}}`` (the seat's ``runtime`` defaults to a local subprocess).
        paths: folders for the bridge's ``sys.path`` (absolute, or relative to the working directory).
        python: the verifiers venv's interpreter (``venv_python``).
        max_concurrent: episodes open on one bridge at once (``bridge_spec``).
        start_timeout_s: seconds a (re)start may take until the bridge answers ``/health``.
        max_restarts: restarts of a bridge that dies, over the run; then its episodes fail (counted).
        name: the bridge's server name (its log file); "": ``verifiers-<taskset id>``.

    Returns:
        ``async def agent(client, row) -> AgentResult``; the bridge starts on its first call in each process.
    """
    key = json.dumps([env, [str(Path(p).resolve()) for p in paths], python, max_concurrent, max_restarts, name],
                     sort_keys=True)

    async def agent(client: Any, row: dict[str, Any]) -> AgentResult:
        bridge = BRIDGES.get(key)
        if bridge is None:
            spec = bridge_spec(env, paths, python=python, name=name, max_concurrent=max_concurrent,
                               start_timeout_s=start_timeout_s, max_restarts=max_restarts)
            taken = {b.spec.name for b in BRIDGES.values()}
            if spec.name in taken:  # another config of the same taskset: a log file of its own
                spec = dataclasses.replace(spec, name=next(f"{spec.name}-{i}" for i in range(2, 10**6)
                                                           if f"{spec.name}-{i}" not in taken))
            bridge = BRIDGES.setdefault(key, VerifiersBridge(spec))
        return await bridge.rollout(row, str(client.base_url).rstrip("/"), str(client.api_key))

    agent.__qualname__ = agent.__name__ = f"verifiers_agent[{env.get('taskset', {}).get('id', '?')}]"
    return agent
