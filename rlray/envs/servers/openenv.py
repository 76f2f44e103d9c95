"""OpenEnv environments: an rlray environment over one session of an OpenEnv server.

OpenEnv (PyPI ``openenv`` 0.10 / ``openenv-core`` 0.3; github.com/meta-pytorch/OpenEnv) serves an environment as a
FastAPI app (``openenv.core.env_server.http_server.create_app``); ``openenv init NAME`` writes one (server/app.py,
models.py with its typed Action and Observation, a client). OpenEnv's own client library cannot be installed beside
rlray: ``openenv`` 0.10 pulls fastmcp 3, which pins mcp < 2 (rlray has mcp 2.3), and both it and ``openenv-core`` 0.3
pull gradio, which downgrades pillow 13 to 12.3 (``pip install --dry-run``, 2026-12-05). So the server runs in its own
virtual environment (``make install`` builds ``.venvs/openenv``) and this module talks its protocol, as
``openenv.core.env_client.EnvClient`` of openenv-core 0.3.0 does:

- ``GET /health`` answers ``{"status": "healthy"}``; ``GET /schema`` gives ``{"action": <JSON schema>, "observation":
  ..., "state": ...}`` (pydantic's ``model_json_schema`` of the environment's types).
- One WebSocket per episode at ``ws://HOST:PORT/ws`` (each holds one environment instance on the server, up to the
  app's ``max_concurrent_envs``). Client frames: ``{"type": "reset", "data": {reset keyword arguments}}``,
  ``{"type": "step", "data": {the action's fields}}``, ``{"type": "close"}``. Server frames: ``{"type":
  "observation", "data": {"observation": {fields but reward and done}, "reward": float | null, "done": bool,
  "metadata": {...}}}`` or ``{"type": "error", "data": {"message": str, "code": "VALIDATION_ERROR" |
  "EXECUTION_ERROR" | "CAPACITY_REACHED" | ...}}``.

How an episode maps onto rlray's contract (token in, token out: rlray tokenizes what is shown, the model's tokens
are what it sampled):
- ``reset(**row)``: takes a session slot on the server (``ServerProcess.session``), opens the WebSocket, sends reset
  with the row's ``reset_columns``; the prompt is the row's prompt plus, with ``show_reset``, the reset observation
  as a user message.
- ``step(turn)``: the action is the turn's text in ``action_field`` (a text action), or, with no ``action_field``,
  the JSON object the turn's text holds (its last ``{...}``: the action's fields). A turn that holds no such object,
  or an action the server rejects (``VALIDATION_ERROR``), is answered with an error observation and counted
  (``env/metric/invalid_actions``, ``env/tool_errors``); the episode goes on. The observation is shown as a user
  message: ``observation_field`` alone, or every observation field but ``metadata`` as JSON. Its ``reward`` is the
  turn's reward (the episode's is their sum, plus ``reward.functions`` on the final conversation), ``done`` ends it.
- A session the server drops (it died: the supervisor restarts it), an ``EXECUTION_ERROR`` (the environment raised)
  or a frame past ``timeout_s`` raises ``OpenEnvError``: the host fails that episode, counted (``env/failed``), and
  the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request
import weakref
from dataclasses import dataclass, field
from typing import Any

from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

from rlray.envs.base import AssistantTurn, EnvReset, EnvStep, Message
from rlray.envs.servers.supervisor import ServerError, ServerProcess

PROTOCOL = "openenv-core 0.3.0 WebSocket /ws"  # the protocol version this client speaks
MAX_FRAME_BYTES = 100 * 2**20  # OpenEnv's client default (max_message_size)


class OpenEnvError(ServerError):
    """An OpenEnv session failed: the server dropped it, answered an error other than a rejected action, or timed out."""


@dataclass(frozen=True)
class OpenEnvOptions:
    """How an OpenEnv environment's typed actions and observations meet the model's text.

    Attributes:
        action_field: the action's string field the turn's text fills (the template's ``message``); None: the turn
            writes the action as a JSON object of its fields.
        observation_field: the observation field shown to the model; None: every field but ``metadata``, as JSON.
        reset_columns: row columns sent as reset's keyword arguments (``seed``, a task id, ...).
        show_reset: show the reset observation after the row's prompt.
    """

    action_field: str | None = None
    observation_field: str | None = None
    reset_columns: tuple[str, ...] = ()
    show_reset: bool = True


@dataclass
class OpenEnvResult:
    """One observation frame: ``observation`` (the fields but reward and done), ``reward`` (None: none given),
    ``done``, ``metadata``."""

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class OpenEnvRejected(Exception):
    """The server rejected an action (``VALIDATION_ERROR``); the session stays open."""


def fetch_schema(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Returns the server's ``GET /schema`` ({"action": ..., "observation": ..., "state": ...} JSON schemas).

    Raises:
        OpenEnvError: the server does not answer it.
    """
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/schema", timeout=timeout_s) as reply:  # noqa: S310 - our URL
            return json.loads(reply.read())
    except (OSError, ValueError) as err:
        raise OpenEnvError(f"{url}/schema: {err} (is it an OpenEnv server? {PROTOCOL})") from None


class OpenEnvSession:
    """One OpenEnv WebSocket session (one environment instance on the server), synchronous.

    Args:
        url: the server's base URL (http://host:port).
        timeout_s: seconds to connect and to wait for each answer.

    Raises:
        OpenEnvError: the connection could not be opened.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self._timeout = url, timeout_s
        ws_url = re.sub(r"^http", "ws", url.rstrip("/")) + "/ws"
        try:
            self._ws = connect(ws_url, open_timeout=timeout_s, max_size=MAX_FRAME_BYTES, proxy=None)
        except (OSError, WebSocketException, TimeoutError) as err:
            raise OpenEnvError(f"cannot open a session at {ws_url}: {type(err).__name__}: {err}") from None

    def reset(self, **kwargs: Any) -> OpenEnvResult:
        """Returns the reset observation (reset's keyword arguments ``kwargs``; the server keeps those its
        environment's ``reset`` takes).

        Raises:
            OpenEnvError: see the class.
        """
        return self._call({"type": "reset", "data": kwargs})

    def step(self, action: dict[str, Any]) -> OpenEnvResult:
        """Returns the observation after ``action`` (the action's fields).

        Raises:
            OpenEnvRejected: the action does not validate against the environment's Action type.
            OpenEnvError: see the class.
        """
        return self._call({"type": "step", "data": action})

    def close(self) -> None:
        """Ends the session (the server drops its instance); never raises."""
        with contextlib.suppress(Exception):
            self._ws.send(json.dumps({"type": "close"}))
        with contextlib.suppress(Exception):
            self._ws.close()

    def _call(self, message: dict[str, Any]) -> OpenEnvResult:
        try:
            self._ws.send(json.dumps(message))
            frame = json.loads(self._ws.recv(timeout=self._timeout))
        except TimeoutError:
            raise OpenEnvError(f"{self.url}: no answer to {message['type']} within {self._timeout:g} s") from None
        except (OSError, WebSocketException) as err:
            raise OpenEnvError(f"{self.url} dropped the session during {message['type']} ({type(err).__name__}: "
                               f"{err}); a server that died is restarted, this episode fails") from None
        data = frame.get("data") or {}
        if frame.get("type") == "error":
            text = f"{data.get('message', 'unknown error')} (code {data.get('code', 'UNKNOWN')})"
            if data.get("code") == "VALIDATION_ERROR":
                detail = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}"
                                   for e in data.get("errors", []))
                raise OpenEnvRejected(f"{text}: {detail}" if detail else text)
            raise OpenEnvError(f"{self.url}: {message['type']} failed on the server: {text}")
        if frame.get("type") != "observation":
            raise OpenEnvError(f"{self.url}: unexpected frame type {frame.get('type')!r} ({PROTOCOL})")
        observation = dict(data.get("observation") or {})
        reward = data.get("reward")
        metadata = data.get("metadata") or observation.get("metadata") or {}
        return OpenEnvResult(observation, None if reward is None else float(reward), bool(data.get("done")), metadata)


def render_observation(observation: dict[str, Any], field_name: str | None) -> str:
    """Returns the text the model sees for an observation: ``str(observation[field_name])``, or every field but
    ``metadata`` as compact JSON with sorted keys when ``field_name`` is None.

    Raises:
        OpenEnvError: ``field_name`` is not a field of the observation (names the fields it has).
    """
    if field_name is not None:
        if field_name not in observation:
            raise OpenEnvError(f"observation_field={field_name!r} is not in the observation; it has "
                               f"{sorted(observation)}")
        value = observation[field_name]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    shown = {k: v for k, v in observation.items() if k != "metadata"}
    return json.dumps(shown, sort_keys=True, separators=(", ", ": "))


def parse_action(text: str, action_field: str | None) -> dict[str, Any]:
    """Returns the action's fields from a turn's text: ``{action_field: text}``, or the last JSON object in the text.

    Raises:
        OpenEnvRejected: no JSON object could be read from the text (JSON actions).
    """
    if action_field is not None:
        return {action_field: text}
    decoder, found, i = json.JSONDecoder(), None, 0
    while (i := text.find("{", i)) != -1:
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        found, i = (value if isinstance(value, dict) else found), end
    if found is not None:
        return found
    raise OpenEnvRejected("the turn holds no JSON object of the action's fields")


class OpenEnvEnvironment:
    """One episode on an OpenEnv server (the module docstring): rlray's environment contract over one session.

    Args:
        name: the environment's name (an env.servers key).
        server: the server (``ServerProcess``) whose session slot the episode holds from reset to close.
        options: how actions and observations meet the text.
        timeout_s: seconds to wait for a free session slot, to connect, and for each answer.
    """

    def __init__(self, name: str, server: ServerProcess, options: OpenEnvOptions, timeout_s: float) -> None:
        self.name, self.server, self.options, self.timeout_s = name, server, options, timeout_s
        self._stack = contextlib.ExitStack()
        self._release = weakref.finalize(self, self._stack.close)  # a dropped (failed) episode frees its slot too
        self._session: OpenEnvSession | None = None

    def reset(self, **row: Any) -> EnvReset:
        """Returns the opening prompt: the row's prompt, then the reset observation (``show_reset``).

        Raises:
            ServerError: no session could be opened (the server is down or busy) or reset failed on the server.
        """
        try:
            lease = self._stack.enter_context(self.server.session(self.timeout_s))
            self._session = self._stack.enter_context(contextlib.closing(OpenEnvSession(lease.url, self.timeout_s)))
            kwargs = {c: row[c] for c in self.options.reset_columns if c in row}
            first = self._session.reset(**kwargs)
        except OpenEnvRejected as err:
            self._release()
            raise OpenEnvError(f"reset was rejected: {err}") from None
        except BaseException:
            self._release()
            raise
        given = row.get("prompt") or []  # a standard row's text, or a conversational row's messages
        prompt: list[Message] = [{"role": "user", "content": given}] if isinstance(given, str) else [dict(m) for m in given]
        if self.options.show_reset:
            prompt.append({"role": "user", "content": render_observation(first.observation,
                                                                         self.options.observation_field)})
        return EnvReset(prompt=prompt)

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Returns the observation, reward and done of the turn's action (an invalid action: an error observation).

        Raises:
            OpenEnvError: the session failed (see the module docstring).
        """
        if self._session is None:
            raise OpenEnvError("step before reset")
        try:
            result = self._session.step(parse_action(turn.text, self.options.action_field))
        except OpenEnvRejected as err:
            return EnvStep(observations=[{"role": "user", "content": f"Error: invalid action: {err}"}],
                           metrics={"invalid_actions": 1.0}, tool_calls=1, tool_errors=1)
        except BaseException:
            self._release()
            raise
        text = render_observation(result.observation, self.options.observation_field)
        return EnvStep(observations=[] if result.done else [{"role": "user", "content": text}], reward=result.reward,
                       done=result.done, metrics={"invalid_actions": 0.0})

    def close(self) -> None:
        """Ends the session and frees its slot."""
        self._release()
