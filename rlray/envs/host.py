"""EnvironmentHost: runs many episodes' environment instances in one process (a Ray actor in a run).

The episode loop on learner rank 0 (``rlray.run.episodes``) batches every active episode's reset or
step into one call per host; the host runs the calls of a batch concurrently on threads, each under
``step_timeout_s``. That limit is SOFT: a call past it fails its episode (stop reason ``timeout``)
and the thread is abandoned, not killed (Python cannot kill a thread). Untrusted tool code belongs
in the sandbox (a child process per call, killed on timeout: ``reward.functions[].untrusted``'s
mechanism), which an environment's tools can use directly.

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


class EnvironmentHost:
    """Holds the environment instances of running episodes, keyed by episode key.

    Args:
        environments: {name: spec}, spec "package.module:Class" or "file.py:Class" (``rlray.envs.load_environment``;
            TRL ``environment_factory`` classes are wrapped automatically).
        tool_parser: the tool-call parser for the model family ("hermes").
        step_timeout_s: soft limit of one reset or step call, in seconds.
        threads: calls run at once.

    Raises:
        ValueError: a spec cannot be loaded (names the environment and the spec).
    """

    def __init__(self, environments: dict[str, str], *, tool_parser: str = "hermes", step_timeout_s: float = 60.0,
                 threads: int = 8) -> None:
        from rlray.envs.trl import load_environment  # the loader picks the TRL adapter per class

        self._factories = {}
        for name, spec in environments.items():
            try:
                self._factories[name] = load_environment(spec)
            except Exception as err:  # noqa: BLE001 - any import problem of user code becomes one clear error
                raise ValueError(f"env.environments.{name}: cannot load '{spec}': {err}") from err
        self._parser = tool_parser
        self._timeout = step_timeout_s
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rlray-env")
        self._episodes: dict[str, Any] = {}

    def ping(self) -> bool:
        """Returns True (a liveness check)."""
        return True

    def reset(self, requests: list[tuple[str, str, dict[str, Any]]]) -> list[ResetReply]:
        """Opens episodes: for each (key, environment name, row) builds an instance and calls ``reset(**row)``.

        Returns:
            One ``ResetReply`` per request, in order; an environment that raises or passes the time limit
            gives an error reply (its instance is dropped).
        """
        from rlray.envs.tools import tool_schemas

        def one(key: str, name: str, row: dict[str, Any]) -> ResetReply:
            env = self._factories[name]()
            self._episodes[key] = env
            got = env.reset(**row)
            if not isinstance(got, EnvReset):
                raise TypeError(f"{type(env).__name__}.reset returned {type(got).__name__}, expected rlray.envs.EnvReset")
            return ResetReply(list(got.prompt), tool_schemas(got.tools) if got.tools else None, list(got.stop))

        replies = self._run([(one, (key, name, row)) for key, name, row in requests], ResetReply)
        for (key, _, _), reply in zip(requests, replies, strict=True):
            if reply.error:
                self._episodes.pop(key, None)
        return replies

    def step(self, requests: list[tuple[str, str, str, int]]) -> list[StepReply]:
        """Sends each (key, turn text, finish reason, turn index) to its episode's ``step``, tool calls parsed.

        Returns:
            One ``StepReply`` per request, in order.
        """
        from rlray.envs.tools import parse_tool_calls

        def one(key: str, text: str, finish_reason: str, turn_index: int) -> StepReply:
            calls, errors = parse_tool_calls(text, parser=self._parser)
            turn = AssistantTurn(text, calls, errors, finish_reason, turn_index)
            got = self._episodes[key].step(turn)
            if not isinstance(got, EnvStep):
                raise TypeError(f"{type(self._episodes[key]).__name__}.step returned {type(got).__name__}, expected "
                                "rlray.envs.EnvStep")
            # a ToolEnvironment counts its own calls and errors (parse errors included); else the parser's counts
            n_calls = int(got.metrics.get("tool_calls", len(calls) + len(errors)))
            return StepReply(got, n_calls, int(got.metrics.get("tool_errors", len(errors))))

        return self._run([(one, req) for req in requests], StepReply)

    def rewards_at_limit(self, keys: list[str]) -> list[float | None]:
        """Returns each episode's ``reward_at_limit()`` (an optional method: None when absent), for episodes that a
        limit ended before the environment said done."""
        out = []
        for key in keys:
            env = self._episodes.get(key)
            final = getattr(env, "reward_at_limit", None)  # optional part of the contract (rlray.envs.base)
            try:
                out.append(None if final is None else final())
            except Exception:  # noqa: BLE001 - a failing final reward is no reward, logged
                log.warning("reward_at_limit of episode %s raised:\n%s", key, traceback.format_exc())
                out.append(None)
        return out

    def close(self, keys: list[str]) -> None:
        """Drops the instances of finished episodes (calls their ``close()`` when they have one)."""
        for key in keys:
            env = self._episodes.pop(key, None)
            closer = getattr(env, "close", None)
            if callable(closer):
                try:
                    closer()
                except Exception:  # noqa: BLE001 - closing must not fail a finished episode
                    log.warning("close of episode %s raised:\n%s", key, traceback.format_exc())

    def open_episodes(self) -> int:
        """Returns how many episodes are open on this host."""
        return len(self._episodes)

    def _run(self, calls: list[tuple[Any, tuple]], reply_type: type) -> list[Any]:
        running = [self._pool.submit(fn, *args) for fn, args in calls]
        out = []
        for fut in running:
            try:
                out.append(fut.result(timeout=self._timeout))
            except futures.TimeoutError:
                out.append(reply_type(error="timeout", message=f"the call ran past env.step_timeout_s={self._timeout}"))
            except Exception as err:  # noqa: BLE001 - an environment's error fails its episode, not the run
                out.append(reply_type(error="env_error", message=f"{type(err).__name__}: {err}"))
        return out
