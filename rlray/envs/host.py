"""EnvironmentHost: runs many episodes' environment instances in one process (a Ray actor in a run).

The episode loop on learner rank 0 (``rlray.run.episodes``) batches every active episode's reset or
step into one call per host (``host.reset.remote([ResetRequest, ...])``, ``host.step.remote([StepRequest,
...])``); the host runs the calls of a batch concurrently on threads, each under ``step_timeout_s``. In
process that limit is SOFT: a call past it fails its episode (stop reason ``timeout``) and the thread is
abandoned, not killed (Python cannot kill a thread). With ``sandbox`` (``env.sandbox``, for untrusted
environment and tool code) each episode's instance lives in its own child process
(``rlray.sandbox.ProcessSandbox``, with the untrusted limits), and the limit is HARD: the child is killed, which
ends that episode only, not its neighbours.

Each episode's instance is an ``EpisodeEnvironment``, one interface over two backends: the instance in this
process, or in a sandbox child. Both run the same module-level functions on the instance (``_reset``,
``_step``, ``_reward_at_limit``, ``_close``): in process they are called directly; sandboxed, the function
itself is sent to the child (pickled by reference), which applies it to its instance. No method is named by a
string.

Tool calls are parsed here (``rlray.envs.tools.parse_tool_calls``), so an environment receives an
``AssistantTurn`` with its calls already parsed.

MCP tools (``env.mcp_servers``) reach an episode explicitly: the host that holds the MCP sessions
(``rlray.envs.agents.agent_host.AgentHost``) lists their tools once into ``episode_tools``, and every in-process episode
it opens is handed that list before its ``reset`` (``rlray.envs.toolenv.open_with_tools``). The tools call back into
the host's sessions, so a sandboxed episode (another process) gets none.

Environment servers (``env.servers``, ``rlray.envs.servers``) are started here, on the host's machine (they bind
127.0.0.1), watched and restarted by the host's ``ServerSupervisor`` and stopped with it; each of their episodes is an
in-process client session (``OpenEnvEnvironment``; never sandboxed: the untrusted code runs in the server's own
process). A server that dies fails the episodes open on it, counted like any environment error.
"""

from __future__ import annotations

import concurrent.futures as futures
import functools
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rlray.envs.base import AssistantTurn, EnvReset, EnvStep, Message
from rlray.hangs import enable_stack_dumps
from rlray.sandbox import Limits, ProcessSandbox, SandboxCrashed, SandboxError, SandboxTimeout

if TYPE_CHECKING:
    from rlray.envs.servers.hosted import HostedServer

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass
class ResetRequest:
    """One episode to open: a new instance of ``environment`` for episode ``key``, then ``reset(**row)``.

    Attributes:
        key: the episode's key, unique among the host's open episodes.
        environment: the environment's name (an env.environments key).
        row: ``reset``'s keyword arguments: the prompt row's columns, ``prompt`` included.
    """

    key: str
    environment: str
    row: dict[str, Any]


@dataclass
class StepRequest:
    """One episode's assistant turn, for its environment's ``step``.

    Attributes:
        key: the episode's key.
        text: the turn's text, special tokens removed (its tool calls are parsed on the host).
        finish_reason: the engine's "stop" (EOS or a stop string) or "length" (the turn hit max_new_tokens).
        turn_index: 0 for the episode's first assistant turn.
        last: no turn follows this one (turn ``env.max_turns``; ``AssistantTurn.last``).
    """

    key: str
    text: str
    finish_reason: str
    turn_index: int
    last: bool = False


@dataclass
class ResetReply:
    """A host's answer to one episode's reset.

    Attributes:
        prompt: the opening messages; tools: their JSON schemas (None: no tools); stop: extra stop strings.
        error: None, or "env_error"/"timeout" with ``message`` saying what happened.
    """

    prompt: list[Message] = field(default_factory=list)
    tools: list[dict] | None = None
    stop: list[str] = field(default_factory=list)
    error: str | None = None
    message: str = ""


@dataclass
class StepReply:
    """A host's answer to one episode's step: the environment's ``EnvStep`` and the turn's tool-call counts.

    Attributes:
        step: what the environment returned (empty when ``error`` is set).
        tool_calls: calls the turn attempted; tool_errors: calls that failed (could not be parsed, an unknown
            tool, bad arguments, a raising tool). The environment's own ``EnvStep.tool_calls`` /
            ``EnvStep.tool_errors`` when it counts them (``ToolEnvironment`` does), else the parser's counts.
        error: None, or "env_error"/"timeout" with ``message``.
    """

    step: EnvStep = field(default_factory=EnvStep)
    tool_calls: int = 0
    tool_errors: int = 0
    error: str | None = None
    message: str = ""


@dataclass
class LimitReply:
    """A host's answer to one episode's ``reward_at_limit()`` (a limit ended it before the environment said done).

    Attributes:
        reward: what it returned (None: no reward, or the environment has no ``reward_at_limit``).
        error: None, or "env_error"/"timeout" with ``message``: it raised, so the episode fails.
    """

    reward: float | None = None
    error: str | None = None
    message: str = ""


class ToolSchemaError(ValueError):
    """A tool of an environment has no usable JSON schema (``rlray.envs.tools.tool_schemas`` names it and the fix)."""


class EnvironmentRaised(RuntimeError):
    """The environment's own code raised; ``str()`` says where (``describe_error``), worded where the code ran (in
    this process or in a sandbox child), so both backends give the same message."""


def _user_call(where: str, call: Callable[[], R]) -> R:
    """Returns ``call()``; whatever it raises becomes ``EnvironmentRaised`` saying ``where`` it raised and where in
    the environment's code."""
    try:
        return call()
    except Exception as err:  # noqa: BLE001 - any error of the environment fails its episode, with where it raised
        raise EnvironmentRaised(describe_error(where, err)) from err


# ---- what both backends run on an episode's instance (module-level: a sandbox child unpickles them by name) ----
def _reset(env: Any, row: dict[str, Any], tools: tuple[Any, ...] = ()) -> ResetReply:
    """Returns the reply to ``env.reset(**row)`` (tool schemas built here, where the tools live), the episode opened
    with the host's MCP tools ``tools`` (``rlray.envs.toolenv.open_with_tools``).

    Raises:
        TypeError: reset returned something other than an ``EnvReset``.
        EnvironmentRaised: reset raised.
        ToolSchemaError: a tool has no usable JSON schema (names the tool and the fix).
    """
    from rlray.envs.toolenv import open_with_tools
    from rlray.envs.tools import tool_schemas

    open_with_tools(env, tools)
    got = _user_call("reset(**row)", lambda: env.reset(**row))
    if not isinstance(got, EnvReset):
        raise TypeError(f"{type(env).__name__}.reset returned {type(got).__name__}, expected rlray.envs.EnvReset")
    try:
        schemas = tool_schemas(got.tools) if got.tools else None
    except ValueError as err:
        raise ToolSchemaError(str(err)) from None
    return ResetReply(list(got.prompt), schemas, list(got.stop))


def _step(env: Any, request: StepRequest, tool_parser: str) -> StepReply:
    """Returns the reply to ``env.step(turn)`` for a turn's text, its tool calls parsed with ``tool_parser``.

    Raises:
        TypeError: step returned something other than an ``EnvStep``.
        EnvironmentRaised: step raised (a TRL class: its get_reward at a turn without tool calls).
    """
    from rlray.envs.tools import parse_tool_calls

    calls, errors = parse_tool_calls(request.text, parser=tool_parser)
    turn = AssistantTurn(request.text, calls, errors, request.finish_reason, request.turn_index, request.last)
    got = _user_call("step", lambda: env.step(turn))
    if not isinstance(got, EnvStep):
        raise TypeError(f"{type(env).__name__}.step returned {type(got).__name__}, expected rlray.envs.EnvStep")
    # a ToolEnvironment counts its own calls and errors (parse errors included); else the parser's counts
    n_calls = len(calls) + len(errors) if got.tool_calls is None else got.tool_calls
    n_errors = len(errors) if got.tool_errors is None else got.tool_errors
    return StepReply(got, int(n_calls), int(n_errors))


def _reward_at_limit(env: Any) -> LimitReply:
    """Returns the optional ``reward_at_limit()`` of the environment (None when it has none).

    Raises:
        EnvironmentRaised: ``reward_at_limit`` (a TRL class: ``get_reward``) raised.
    """
    final = getattr(env, "reward_at_limit", None)  # optional part of the contract (rlray.envs.base)
    reward = None if final is None else _user_call("reward_at_limit() (a TRL class: get_reward())", final)
    return LimitReply(None if reward is None else float(reward))


def _close(env: Any) -> None:
    """Calls the environment's optional ``close()``.

    Raises:
        EnvironmentRaised: close raised.
    """
    closer = getattr(env, "close", None)
    if callable(closer):
        _user_call("close()", closer)


def _apply(env: Any, fn: Callable[..., R], *args: Any) -> R:
    """Returns ``fn(env, *args)``: how both backends run one of the functions above on the episode's instance."""
    return fn(env, *args)


def _serve(spec: str, trl_parity: bool = True) -> Callable[..., Any]:
    """Returns ``_apply`` bound to a new instance of ``spec``: a sandbox child's entry (it runs in the child)."""
    from rlray.envs.tools import load_schema_builder
    from rlray.envs.trl import load_environment

    load_schema_builder()  # under the child's start limit, not its first reset's (load_schema_builder)
    return functools.partial(_apply, load_environment(spec, trl_parity)())


def describe_error(where: str, err: BaseException) -> str:
    """Returns '<where> raised <Type>: <message> (at <file>:<line>)': what an environment's failure says (the
    innermost frame of its traceback). An ``EnvironmentRaised`` (also inside a ``SandboxError``) is already worded
    and is returned as it is; another sandboxed error has its type and message only."""
    original = err.original if isinstance(err, SandboxError) else err
    if isinstance(original, EnvironmentRaised):
        return str(original)
    frames = traceback.extract_tb(err.__traceback__)
    located = frames and not isinstance(err, (SandboxError, ToolSchemaError))  # a schema error names its tool
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if located else ""
    text = str(err) if isinstance(err, SandboxError) else f"{type(err).__name__}: {err}"
    return f"{where} raised {text}{at}"


class EpisodeEnvironment:
    """One episode's environment instance, in this process or in its own child process, behind one interface.

    Build one with ``in_process`` or ``sandboxed``. ``reset`` and ``step`` check what the environment returns.
    Sandboxed (``rlray.sandbox.ProcessSandbox``), a call past ``timeout_s`` kills the child: a HARD limit that
    ends this episode only. The child runs with the sandbox's untrusted limits (address-space cap, emptied
    environment, private temporary folder); starting it costs a Python start and the environment's imports
    (seconds) per episode.

    Args:
        call: runs a function on the instance: ``call(fn, *args)`` returns ``fn(instance, *args)`` (``_apply``
            bound to the instance, or the ``ProcessSandbox`` serving it).
        tool_parser: the tool-call parser ("hermes").
        box: the sandbox child holding the instance (None: the instance is in this process).
        tools: the host's MCP tools the episode is opened with (in process only; ``_reset``).
    """

    def __init__(self, call: Callable[..., Any], tool_parser: str, box: ProcessSandbox | None = None,
                 tools: tuple[Any, ...] = ()) -> None:
        self._call, self._parser, self._box, self._tools = call, tool_parser, box, tuple(tools)

    @classmethod
    def in_process(cls, env: Any, tool_parser: str, tools: tuple[Any, ...] = ()) -> EpisodeEnvironment:
        """Returns an ``EpisodeEnvironment`` over ``env``, an instance in this process, opened with ``tools``."""
        return cls(functools.partial(_apply, env), tool_parser, tools=tools)

    @classmethod
    def sandboxed(cls, spec: str, tool_parser: str, *, timeout_s: float, memory_gib: float,
                  name: str, trl_parity: bool = True) -> EpisodeEnvironment:
        """Returns an ``EpisodeEnvironment`` over a new instance of ``spec`` built in its own child process.

        Args:
            spec: the environment's "package.module:Class" or "file.py:Class".
            timeout_s: seconds one call may take before the child is killed.
            memory_gib: the child's address-space cap, in GiB.
            name: the environment's name, for error messages.
            trl_parity: how a TRL-shaped class answers tool calls (``rlray.envs.trl.TRLEnvironment``).

        Raises:
            SandboxError: building the environment raised in the child.
            SandboxTimeout: the child did not start in time.
        """
        box = ProcessSandbox(_serve, {"spec": spec, "trl_parity": trl_parity}, timeout_s=timeout_s,
                             limits=Limits(untrusted=True, memory_gib=memory_gib), name=f"environment {name}")
        return cls(box, tool_parser, box)

    def reset(self, row: dict[str, Any]) -> ResetReply:
        """Returns the reply to the instance's ``reset(**row)`` (see ``_reset``; sandboxed: its errors as
        ``SandboxError``, ``SandboxTimeout``, ``SandboxCrashed``)."""
        return self._call(_reset, row, self._tools)

    def step(self, request: StepRequest) -> StepReply:
        """Returns the reply to the instance's ``step`` for ``request``'s turn (see ``_step``)."""
        return self._call(_step, request, self._parser)

    def reward_at_limit(self) -> LimitReply:
        """Returns the instance's optional ``reward_at_limit()`` (reward None when it has none; see ``_reward_at_limit``)."""
        return self._call(_reward_at_limit)

    def close(self) -> None:
        """Calls the instance's optional ``close()``, then stops its child (sandboxed)."""
        try:
            self._call(_close)
        finally:
            self.kill()

    def kill(self) -> None:
        """Stops the sandbox child at once (a failed or timed-out episode); nothing to stop in process."""
        if self._box is not None:
            self._box.close()


class EnvironmentHost:
    """Holds the environment instances of running episodes, keyed by episode key.

    Args:
        environments: {name: spec}, spec "package.module:Class" or "file.py:Class" (``rlray.envs.load_environment``;
            TRL ``environment_factory`` classes are wrapped automatically).
        tool_parser: the tool-call parser for the model family ("hermes").
        step_timeout_s: limit of one reset, step, reward_at_limit or close call, in seconds: soft (the thread is
            abandoned) in process, hard (the child is killed) with ``sandbox``.
        threads: calls run at once.
        sandbox: run each episode's instance in its own child process (``EpisodeEnvironment.sandboxed``).
        memory_gib: address-space cap of a sandboxed episode's child, in GiB.
        trl_parity: how TRL-shaped classes answer tool calls (``rlray.envs.trl.TRLEnvironment``; ``env.trl_parity``).
        servers: environment servers to start here (``rlray.envs.servers.hosted.HostedServer``; ``env.servers``), their
            names environments too.
        server_log_dir: folder of the log files of the servers started in this process (``env.servers``, and the
            verifiers bridges of its agents, through ``$RLRAY_SERVER_LOG_DIR``); "": a temporary folder.

    Attributes:
        episode_tools: the MCP tools every in-process episode is opened with ([]; set once by the ``AgentHost`` that
            starts the MCP sessions).

    Every failure reply's message says where the environment raised: '<reset|step|reward_at_limit()> raised
    <Type>: <message> (at <file>:<line>)' (``describe_error``), or that the call ran past the time limit.

    Raises:
        ValueError: a spec cannot be loaded (names the environment and the spec).
        rlray.envs.servers.ServerStartError: a server did not start (its log quoted).
    """

    def __init__(self, environments: dict[str, str], *, tool_parser: str = "hermes", step_timeout_s: float = 60.0,
                 threads: int = 8, sandbox: bool = False, memory_gib: float = 2.0, trl_parity: bool = True,
                 servers: list[HostedServer] | None = None, server_log_dir: str = "") -> None:
        from rlray.envs.trl import load_environment  # the loader picks the TRL adapter per class

        enable_stack_dumps()  # a call past watchdog.env_call_s is reported with this process's stacks (rlray.hangs)
        self._factories, self._specs = {}, dict(environments)
        for name, spec in environments.items():
            try:
                self._factories[name] = load_environment(spec, trl_parity)  # checked here even when episodes run sandboxed
            except Exception as err:  # noqa: BLE001 - any import problem of user code becomes one clear error
                raise ValueError(f"env.environments.{name}: cannot load '{spec}': {err}") from err
        if not sandbox:
            from rlray.envs.tools import load_schema_builder

            load_schema_builder()  # here, not under the first reset's env.step_timeout_s (load_schema_builder)
        self._parser = tool_parser
        self._timeout = step_timeout_s
        self._sandbox, self._memory_gib, self._trl_parity = sandbox, memory_gib, trl_parity
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rlray-env")
        self._episodes: dict[str, EpisodeEnvironment] = {}
        self.episode_tools: list[Any] = []
        self.servers = None  # the ServerSupervisor of env.servers (None without)
        if server_log_dir:  # also where agents' servers (verifiers bridges) started in this process log
            os.environ["RLRAY_SERVER_LOG_DIR"] = server_log_dir
        if servers:
            from rlray.envs.servers.hosted import start_servers  # deferred: only hosts with servers need them

            self.servers, served = start_servers(list(servers), step_timeout_s, server_log_dir or None)
            self._factories.update(served)

    def stop_servers(self) -> None:
        """Stops the host's environment servers (also done at exit, and by each server's guard when the host dies)."""
        if self.servers is not None:
            self.servers.stop()

    def server_restarts(self) -> dict[str, int]:
        """Returns {server name: restarts so far} of the servers started in this process (``env.servers`` and the
        agents' verifiers bridges; ``rlray.envs.servers.restarts_here``)."""
        from rlray.envs.servers.supervisor import restarts_here

        return restarts_here()

    def ping(self) -> bool:
        """Returns True (a liveness check)."""
        return True

    def reset(self, requests: list[ResetRequest]) -> list[ResetReply]:
        """Opens episodes: for each request builds an instance of its environment and calls ``reset(**row)``.

        Returns:
            One ``ResetReply`` per request, in order; an environment that raises or passes the time limit
            gives an error reply (its instance is dropped).
        """
        calls = [functools.partial(self._open, request) for request in requests]
        replies = self._run(calls, ResetReply, "reset(**row)")
        for request, reply in zip(requests, replies, strict=True):
            if reply.error:
                self._drop(request.key)
        return replies

    def step(self, requests: list[StepRequest]) -> list[StepReply]:
        """Sends each request's turn to its episode's ``step``, tool calls parsed.

        Returns:
            One ``StepReply`` per request, in order (an error reply drops the episode's instance).
        """
        replies = self._run([functools.partial(self._step_one, request) for request in requests], StepReply, "step")
        for request, reply in zip(requests, replies, strict=True):
            if reply.error:
                self._drop(request.key)
        return replies

    def rewards_at_limit(self, keys: list[str]) -> list[LimitReply]:
        """Returns each episode's ``reward_at_limit()`` (an optional method: reward None when absent), for episodes
        that a limit ended before the environment said done. One that raises (a TRL class's ``get_reward``) or passes
        the time limit gives an error reply: the episode fails, as it would had it raised in ``step``."""
        calls = [functools.partial(self._limit_one, key) for key in keys]
        return self._run(calls, LimitReply, "reward_at_limit() (a TRL class: get_reward())")

    def close(self, keys: list[str]) -> list[str]:
        """Drops the instances of finished episodes, calling their ``close()`` when they have one; returns, per key, ""
        or what its ``close()`` raised (the episode then fails)."""
        out = []
        for key in keys:
            episode = self._episodes.pop(key, None)
            try:
                if episode is not None:
                    episode.close()
                out.append("")
            except Exception as err:  # noqa: BLE001 - a raising close fails its episode, not the host
                log.warning("close of episode %s raised:\n%s", key, traceback.format_exc())
                out.append(describe_error("close()", err))
        return out

    def open_episodes(self) -> int:
        """Returns how many episodes are open on this host."""
        return len(self._episodes)

    def _open(self, request: ResetRequest) -> ResetReply:
        """Builds the episode's instance (in process or sandboxed), keeps it under its key, and resets it."""
        name = request.environment
        if self._sandbox and name in self._specs:  # a server's episode is a client session: in process
            episode = EpisodeEnvironment.sandboxed(self._specs[name], self._parser, timeout_s=self._timeout,
                                                   memory_gib=self._memory_gib, name=name, trl_parity=self._trl_parity)
        else:
            episode = EpisodeEnvironment.in_process(self._factories[name](), self._parser, tuple(self.episode_tools))
        self._episodes[request.key] = episode
        return episode.reset(request.row)

    def _step_one(self, request: StepRequest) -> StepReply:
        """Returns the reply of the request's episode to its turn."""
        return self._episodes[request.key].step(request)

    def _limit_one(self, key: str) -> LimitReply:
        """Returns the reply of episode ``key``'s ``reward_at_limit()`` (reward None for an episode not open here)."""
        return self._episodes[key].reward_at_limit() if key in self._episodes else LimitReply()

    def _drop(self, key: str) -> None:
        """Forgets a failed episode (a sandboxed one's child is stopped)."""
        episode = self._episodes.pop(key, None)
        if episode is not None:
            episode.kill()

    def _run(self, calls: list[Callable[[], R]], reply_type: type[R], where: str) -> list[R]:
        """Returns each call's result, in order, run on the host's threads; a call that raises or passes the time
        limit gives ``reply_type(error=..., message=...)`` instead, the message naming ``where`` (``describe_error``)."""
        # sandboxed calls end at the child's hard limit; the thread waits a little longer for that answer
        wait_s = self._timeout + (30.0 if self._sandbox else 0.0)
        running = [self._pool.submit(fn) for fn in calls]
        out = []
        for fut in running:
            try:
                out.append(fut.result(timeout=wait_s))
            except (futures.TimeoutError, SandboxTimeout):
                out.append(reply_type(error="timeout", message=f"{where} ran past env.step_timeout_s={self._timeout:g}"))
            except (SandboxError, SandboxCrashed) as err:  # raised in (or killed) the episode's child
                out.append(reply_type(error="env_error", message=describe_error(where, err)))
            except Exception as err:  # noqa: BLE001 - an environment's error fails its episode, not the run
                out.append(reply_type(error="env_error", message=describe_error(where, err)))
        return out
