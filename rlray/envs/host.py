"""EnvironmentHost: runs many episodes' environment instances in one process (a Ray actor in a run).

The episode loop on learner rank 0 (``rlray.run.episodes``) batches every active episode's reset or
step into one call per host; the host runs the calls of a batch concurrently on threads, each under
``step_timeout_s``. In process that limit is SOFT: a call past it fails its episode (stop reason
``timeout``) and the thread is abandoned, not killed (Python cannot kill a thread). With ``sandbox``
(``env.sandbox``, for untrusted environment and tool code) each episode's instance lives in its own
child process (``rlray.sandbox.ProcessSandbox``, with the untrusted limits), and the limit is
HARD: the child is killed, which ends that episode only, not its neighbours.

Tool calls are parsed here (``rlray.envs.tools.parse_tool_calls``), so an environment receives an
``AssistantTurn`` with its calls already parsed.
"""

from __future__ import annotations

import concurrent.futures as futures
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any

from rlray.envs.base import AssistantTurn, EnvReset, EnvStep, Message

log = logging.getLogger(__name__)


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
            tool, bad arguments, a raising tool). The environment's own ``tool_calls`` / ``tool_errors`` metrics
            when it reports them (``ToolEnvironment`` does), else the parser's counts.
        error: None, or "env_error"/"timeout" with ``message``.
    """

    step: EnvStep = field(default_factory=EnvStep)
    tool_calls: int = 0
    tool_errors: int = 0
    error: str | None = None
    message: str = ""


class LocalEpisode:
    """One episode's environment instance in the host's process; ``reset``/``step`` check what it returns.

    Args:
        env: the environment instance (one per episode).
        tool_parser: the tool-call parser ("hermes").
    """

    def __init__(self, env: Any, tool_parser: str) -> None:
        self.env, self.parser = env, tool_parser

    def reset(self, row: dict[str, Any]) -> ResetReply:
        """Returns the reply to ``env.reset(**row)`` (tool schemas built here, where the tools live).

        Raises:
            TypeError: reset returned something other than an ``EnvReset``; whatever reset raised.
        """
        from rlray.envs.tools import tool_schemas

        got = self.env.reset(**row)
        if not isinstance(got, EnvReset):
            raise TypeError(f"{type(self.env).__name__}.reset returned {type(got).__name__}, expected rlray.envs.EnvReset")
        return ResetReply(list(got.prompt), tool_schemas(got.tools) if got.tools else None, list(got.stop))

    def step(self, text: str, finish_reason: str, turn_index: int) -> StepReply:
        """Returns the reply to ``env.step(turn)`` for a turn's text, its tool calls parsed here.

        Raises:
            TypeError: step returned something other than an ``EnvStep``; whatever step raised.
        """
        from rlray.envs.tools import parse_tool_calls

        calls, errors = parse_tool_calls(text, parser=self.parser)
        got = self.env.step(AssistantTurn(text, calls, errors, finish_reason, turn_index))
        if not isinstance(got, EnvStep):
            raise TypeError(f"{type(self.env).__name__}.step returned {type(got).__name__}, expected rlray.envs.EnvStep")
        # a ToolEnvironment counts its own calls and errors (parse errors included); else the parser's counts
        n_calls = int(got.metrics.get("tool_calls", len(calls) + len(errors)))
        return StepReply(got, n_calls, int(got.metrics.get("tool_errors", len(errors))))

    def reward_at_limit(self) -> float | None:
        """Returns the optional ``reward_at_limit()`` of the environment (None when it has none)."""
        final = getattr(self.env, "reward_at_limit", None)  # optional part of the contract (rlray.envs.base)
        return None if final is None else final()

    def close(self) -> None:
        """Calls the environment's optional ``close()``."""
        closer = getattr(self.env, "close", None)
        if callable(closer):
            closer()

    def __call__(self, method: str, *args: Any) -> Any:
        """Dispatches ``method`` (reset, step, reward_at_limit, close) with ``args``: the sandboxed child's entry."""
        return {"reset": self.reset, "step": self.step, "reward_at_limit": self.reward_at_limit,
                "close": self.close}[method](*args)


def sandboxed_episode(spec: str, tool_parser: str) -> LocalEpisode:
    """Returns a ``LocalEpisode`` over a new instance of ``spec`` (built inside a sandbox child process)."""
    from rlray.envs.trl import load_environment

    return LocalEpisode(load_environment(spec)(), tool_parser)


class SandboxedEpisode:
    """One episode's environment instance in its own child process (``rlray.sandbox.ProcessSandbox``).

    A call past ``timeout_s`` kills the child: a HARD limit that ends this episode only. The child runs with
    the sandbox's untrusted limits (address-space cap, emptied environment, private temporary folder).
    Starting it costs a Python start and the environment's imports (seconds) per episode.

    Raises:
        SandboxError: building the environment raised in the child.
    """

    def __init__(self, spec: str, tool_parser: str, *, timeout_s: float, memory_gib: float, name: str) -> None:
        from rlray.sandbox import Limits, ProcessSandbox

        self.box = ProcessSandbox(sandboxed_episode, {"spec": spec, "tool_parser": tool_parser}, timeout_s=timeout_s,
                                  limits=Limits(untrusted=True, memory_gib=memory_gib), name=f"environment {name}")

    def reset(self, row: dict[str, Any]) -> ResetReply:
        """Returns ``LocalEpisode.reset`` run in the child."""
        return self.box("reset", row)

    def step(self, text: str, finish_reason: str, turn_index: int) -> StepReply:
        """Returns ``LocalEpisode.step`` run in the child."""
        return self.box("step", text, finish_reason, turn_index)

    def reward_at_limit(self) -> float | None:
        """Returns ``LocalEpisode.reward_at_limit`` run in the child."""
        return self.box("reward_at_limit")

    def close(self) -> None:
        """Closes the environment in the child, then stops the child."""
        try:
            self.box("close")
        finally:
            self.box.close()

    def kill(self) -> None:
        """Stops the child at once (a timed-out episode)."""
        self.box.close()


class EnvironmentHost:
    """Holds the environment instances of running episodes, keyed by episode key.

    Args:
        environments: {name: spec}, spec "package.module:Class" or "file.py:Class" (``rlray.envs.load_environment``;
            TRL ``environment_factory`` classes are wrapped automatically).
        tool_parser: the tool-call parser for the model family ("hermes").
        step_timeout_s: limit of one reset or step call, in seconds: soft (the thread is abandoned) in process,
            hard (the child is killed) with ``sandbox``.
        threads: calls run at once.
        sandbox: run each episode's instance in its own child process (``SandboxedEpisode``).
        memory_gib: address-space cap of a sandboxed episode's child, in GiB.

    Raises:
        ValueError: a spec cannot be loaded (names the environment and the spec).
    """

    def __init__(self, environments: dict[str, str], *, tool_parser: str = "hermes", step_timeout_s: float = 60.0,
                 threads: int = 8, sandbox: bool = False, memory_gib: float = 2.0) -> None:
        from rlray.envs.trl import load_environment  # the loader picks the TRL adapter per class

        self._factories, self._specs = {}, dict(environments)
        for name, spec in environments.items():
            try:
                self._factories[name] = load_environment(spec)  # checked here even when episodes run sandboxed
            except Exception as err:  # noqa: BLE001 - any import problem of user code becomes one clear error
                raise ValueError(f"env.environments.{name}: cannot load '{spec}': {err}") from err
        self._parser = tool_parser
        self._timeout = step_timeout_s
        self._sandbox, self._memory_gib = sandbox, memory_gib
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rlray-env")
        self._episodes: dict[str, LocalEpisode | SandboxedEpisode] = {}

    def ping(self) -> bool:
        """Returns True (a liveness check)."""
        return True

    def reset(self, requests: list[tuple[str, str, dict[str, Any]]]) -> list[ResetReply]:
        """Opens episodes: for each (key, environment name, row) builds an instance and calls ``reset(**row)``.

        Returns:
            One ``ResetReply`` per request, in order; an environment that raises or passes the time limit
            gives an error reply (its instance is dropped).
        """

        def one(key: str, name: str, row: dict[str, Any]) -> ResetReply:
            if self._sandbox:
                episode = SandboxedEpisode(self._specs[name], self._parser, timeout_s=self._timeout,
                                           memory_gib=self._memory_gib, name=name)
            else:
                episode = LocalEpisode(self._factories[name](), self._parser)
            self._episodes[key] = episode
            return episode.reset(row)

        replies = self._run([(one, (key, name, row)) for key, name, row in requests], ResetReply)
        for (key, _, _), reply in zip(requests, replies, strict=True):
            if reply.error:
                self._drop(key)
        return replies

    def step(self, requests: list[tuple[str, str, str, int]]) -> list[StepReply]:
        """Sends each (key, turn text, finish reason, turn index) to its episode's ``step``, tool calls parsed.

        Returns:
            One ``StepReply`` per request, in order.
        """

        def one(key: str, text: str, finish_reason: str, turn_index: int) -> StepReply:
            return self._episodes[key].step(text, finish_reason, turn_index)

        replies = self._run([(one, req) for req in requests], StepReply)
        for req, reply in zip(requests, replies, strict=True):
            if reply.error:
                self._drop(req[0])
        return replies

    def rewards_at_limit(self, keys: list[str]) -> list[float | None]:
        """Returns each episode's ``reward_at_limit()`` (an optional method: None when absent), for episodes that a
        limit ended before the environment said done."""
        out = []
        for key in keys:
            try:
                out.append(self._episodes[key].reward_at_limit() if key in self._episodes else None)
            except Exception:  # noqa: BLE001 - a failing reward at a limit is no reward, logged
                log.warning("reward_at_limit of episode %s raised:\n%s", key, traceback.format_exc())
                out.append(None)
        return out

    def close(self, keys: list[str]) -> None:
        """Drops the instances of finished episodes (calls their ``close()`` when they have one)."""
        for key in keys:
            episode = self._episodes.pop(key, None)
            if episode is None:
                continue
            try:
                episode.close()
            except Exception:  # noqa: BLE001 - closing must not fail a finished episode
                log.warning("close of episode %s raised:\n%s", key, traceback.format_exc())

    def open_episodes(self) -> int:
        """Returns how many episodes are open on this host."""
        return len(self._episodes)

    def _drop(self, key: str) -> None:
        """Forgets a failed episode (a sandboxed one's child is stopped)."""
        episode = self._episodes.pop(key, None)
        if isinstance(episode, SandboxedEpisode):
            episode.kill()

    def _run(self, calls: list[tuple[Any, tuple]], reply_type: type) -> list[Any]:
        from rlray.sandbox import SandboxCrashed, SandboxError, SandboxTimeout

        # sandboxed calls end at the child's hard limit; the thread waits a little longer for that answer
        wait_s = self._timeout + (30.0 if self._sandbox else 0.0)
        running = [self._pool.submit(fn, *args) for fn, args in calls]
        out = []
        for fut in running:
            try:
                out.append(fut.result(timeout=wait_s))
            except (futures.TimeoutError, SandboxTimeout):
                out.append(reply_type(error="timeout", message=f"the call ran past env.step_timeout_s={self._timeout}"))
            except (SandboxError, SandboxCrashed) as err:  # raised in (or killed) the episode's child
                out.append(reply_type(error="env_error", message=str(err)))
            except Exception as err:  # noqa: BLE001 - an environment's error fails its episode, not the run
                out.append(reply_type(error="env_error", message=f"{type(err).__name__}: {err}"))
        return out
