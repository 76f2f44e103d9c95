"""verifiers environments, trained unchanged: an agent that plays each episode through the verifiers bridge.

A verifiers 0.4 environment (Prime Intellect's ``verifiers.v1``: a ``Taskset`` of ``Task`` s with ``@vf.reward``
functions, played by a harness) cannot be imported here: verifiers pins ``openai<3`` and ``mcp==2.0.0``, rlray uses
openai 3. So it runs in its own Python environment, ``.venvs/verifiers`` (``make verifiers-venv``, part of ``make
install``), inside ``rlray/envs/servers/verifiers_bridge.py``, a small HTTP server (prime-rl likewise runs each
environment as a server of its own). This module is rlray's side, written as an agent (``rlray.envs.agents``): for
each episode it posts the row's task and the episode's gateway endpoint (``client.base_url``) to the bridge; the
environment's harness makes its model calls there, so every sampled token is recorded by the gateway and trained
token-in/token-out; the bridge answers with the rubric's reward, the episode's reward, and the per-function scores,
logged as ``reward/<agent>/<function>`` terms of weight 0 (``AgentResult.scores``). A bridge error, an episode
verifiers could not score, or a dead bridge fails that episode only (``env_error``, counted in env/failed); a dead
bridge is started again on the next episode.

Use, in an agent file named by ``env.agents`` (``tests/envs/verifiers/vf_sum_agent.py``)::

    agent = verifiers_agent({"taskset": {"id": "vf_sum"}, "agent": {"harness": {"id": "null"}}},
                            paths=[Path(__file__).parent])

with rows ``{"prompt": "...", "task_index": i}`` (``i`` indexes the taskset's ``load()``; ``task`` instead gives a
whole ``TaskData`` dump). One bridge per environment host process and config, started on its first episode,
stopped when the process exits.

The small interface a generic server supervisor (``env.servers``) replaces: ``VerifiersBridge.command()`` (argv),
``READY_LINE`` on stdout (then ``GET /health``), ``VerifiersBridge.url``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from rlray.envs.agents.agent import AgentResult

BRIDGE_SCRIPT = Path(__file__).with_name("verifiers_bridge.py")
READY_LINE = "rlray-verifiers-bridge listening on"  # as verifiers_bridge.READY_LINE (that file runs in the other venv)
DEFAULT_VENV = Path(__file__).resolve().parents[3] / ".venvs" / "verifiers"  # the checkout's (make verifiers-venv)


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


class VerifiersBridge:
    """One bridge process (``verifiers_bridge.py`` in the verifiers venv) and its URL; restarted when it died.

    Args:
        env: verifiers' ``EnvConfig`` data, e.g. ``{"taskset": {"id": "vf_sum"}}``.
        paths: folders put on the bridge's ``sys.path`` (where the taskset module lies).
        python: the verifiers venv's interpreter (``venv_python``).
        max_concurrent: episodes the bridge plays at once (None: unbounded).
        start_timeout_s: seconds to wait for the bridge to listen.
        host: the address it binds (127.0.0.1).
    """

    def __init__(self, env: dict[str, Any], paths: Sequence[str | os.PathLike] = (), python: str | None = None,
                 max_concurrent: int | None = None, start_timeout_s: float = 120.0, host: str = "127.0.0.1") -> None:
        self.env, self.paths = dict(env), [str(Path(p).resolve()) for p in paths]
        self.python, self.max_concurrent, self.host = venv_python(python), max_concurrent, host
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._log = ""
        self._lock = threading.Lock()

    def command(self) -> list[str]:
        """Returns the bridge's argv (port 0: the OS picks a free one, printed on the ready line)."""
        argv = [str(self.python), str(BRIDGE_SCRIPT), "--env", json.dumps(self.env), "--host", self.host, "--port", "0"]
        for p in self.paths:
            argv += ["--path", p]
        if self.max_concurrent:
            argv += ["--max-concurrent", str(self.max_concurrent)]
        return argv

    def spec_fields(self, name: str = "verifiers") -> dict[str, Any]:
        """Returns this bridge as the fields of a generic server supervisor's spec (``env.servers``; i41-servers'
        ``rlray.envs.servers.supervisor.ServerSpec(**fields)``): the command with ``{host}``/``{port}`` for the
        supervisor to fill, run by ``python`` of the verifiers venv, healthy when ``GET /health`` answers."""
        argv = ["python", *self.command()[1:]]
        argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "{host}", "{port}"
        return {"name": name, "command": tuple(argv), "python": str(self.python), "host": self.host,
                "health_path": "/health", "max_sessions": self.max_concurrent or 64,
                "start_timeout_s": self.start_timeout_s}

    @property
    def alive(self) -> bool:
        """True while the bridge process runs."""
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """Returns the last ``lines`` lines of the bridge's output ('' before it started)."""
        try:
            return "\n".join(Path(self._log).read_text(errors="replace").splitlines()[-lines:]) if self._log else ""
        except OSError:
            return ""

    def ensure(self) -> str:
        """Starts the bridge unless it runs (again, when it died); returns its URL. Thread-safe; blocks up to
        ``start_timeout_s``.

        Raises:
            RuntimeError: it exited or did not listen in time (the message holds its last output lines).
        """
        with self._lock:
            if self.alive:
                return self.url
            self.stop()
            fd, self._log = tempfile.mkstemp(prefix="rlray-verifiers-bridge-", suffix=".log")
            with os.fdopen(fd, "w") as out:
                self._proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
            self.starts += 1
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline:
                found = re.search(re.escape(READY_LINE) + r" (\S+)", Path(self._log).read_text(errors="replace"))
                if found:
                    self.url = found.group(1)
                    return self.url
                if self._proc.poll() is not None:
                    break
                time.sleep(0.1)
            code = self._proc.poll()
            self.stop()
            why = f"exited with code {code}" if code is not None else f"did not listen within {self.start_timeout_s:g} s"
            raise RuntimeError(f"rlray: the verifiers bridge for {self.env} {why}; its output:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stops the bridge and its children (its process group: the harness programs it runs); idempotent."""
        proc, self._proc, self.url = self._proc, None, ""
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    async def rollout(self, row: dict[str, Any], base_url: str, api_key: str = "rlray") -> AgentResult:
        """Plays the row's task against ``base_url`` in the bridge; returns its reward and per-function scores.

        Raises:
            ValueError: the row has neither ``task_index`` nor ``task``.
            RuntimeError: the bridge failed the request, or verifiers scored nothing (its errors are in the message);
                the episode then fails (``env_error``).
        """
        import httpx

        if "task_index" not in row and "task" not in row:
            raise ValueError(f"rlray: a verifiers row needs 'task_index' or 'task'; it has {sorted(row)}")
        url = await asyncio.get_running_loop().run_in_executor(None, self.ensure)
        body = {"base_url": base_url, "model": "policy", "api_key": api_key,
                **({"task": row["task"]} if "task" in row else {"task_index": int(row["task_index"])})}
        try:
            async with httpx.AsyncClient(timeout=None) as http:
                reply = await http.post(f"{url}/rollout", json=body)
        except httpx.TransportError as err:
            raise RuntimeError(f"rlray: the verifiers bridge at {url} did not answer ({type(err).__name__}: {err}); "
                               f"alive={self.alive}; its output:\n{self.log_tail()}") from err
        got = reply.json()
        if reply.status_code != 200:
            raise RuntimeError(f"rlray: the verifiers bridge failed the episode: {got.get('error', got)}")
        return result_of(got)


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


_BRIDGES: dict[str, VerifiersBridge] = {}


def _stop_all() -> None:
    for bridge in _BRIDGES.values():
        bridge.stop()


atexit.register(_stop_all)


def verifiers_agent(env: dict[str, Any], paths: Sequence[str | os.PathLike] = (), *, python: str | None = None,
                    max_concurrent: int | None = None,
                    start_timeout_s: float = 120.0) -> Callable[[Any, dict[str, Any]], Awaitable[AgentResult]]:
    """Returns an agent function (``env.agents``) that plays a verifiers environment's episodes (module docstring).

    Args:
        env: verifiers' ``EnvConfig`` data: ``{"taskset": {"id": "<module>", ...}, "agent": {"harness": {"id":
            "null"}}}`` (the seat's ``runtime`` defaults to a local subprocess).
        paths: folders for the bridge's ``sys.path`` (absolute, or relative to the working directory).
        python: the verifiers venv's interpreter (``venv_python``).
        max_concurrent: episodes one bridge plays at once.
        start_timeout_s: seconds to wait for the bridge to listen.

    Returns:
        ``async def agent(client, row) -> AgentResult``; the bridge starts on its first call in each process.
    """
    key = json.dumps([env, [str(Path(p).resolve()) for p in paths], python, max_concurrent], sort_keys=True)

    async def agent(client: Any, row: dict[str, Any]) -> AgentResult:
        bridge = _BRIDGES.get(key)
        if bridge is None:
            bridge = _BRIDGES.setdefault(key, VerifiersBridge(env, paths, python, max_concurrent, start_timeout_s))
        return await bridge.rollout(row, str(client.base_url).rstrip("/"), str(client.api_key))

    agent.__qualname__ = agent.__name__ = f"verifiers_agent[{env.get('taskset', {}).get('id', '?')}]"
    return agent
