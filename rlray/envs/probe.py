"""Open an environment's first episode before a run: what the preflight checks and what ``rlray check`` shows.

- ``row_environment``: the environment a prompt row runs in (its ``env.column`` value, else ``env.default``); the
  episode loop (``rlray.run.episodes``) and the preflight route rows by this one rule.
- ``reset_kwargs``: what ``reset(**row)`` gets from a prompt row (its columns, and its prompt as ``prompt`` and under
  the data's prompt column).
- ``required_columns``: the keyword parameters of a class's ``reset`` without a default: columns that every row
  routed to it must have (``def reset(self, *, word: str, **row)`` needs ``word``). A class that reads ``row["a"]``
  inside ``reset`` needs ``a`` too, which only opening an episode finds (``probe_environment``).
- ``probe_environment``: loads the class, builds an instance per row and calls ``reset`` on the given rows, in
  order, until one opens (its tool schemas built as the host builds them), and closes it. ``probe_in_sandbox`` runs
  that in a child process (``rlray.sandbox``; with the untrusted limits under ``env.sandbox``), so the driver never
  imports the environment's code, and a ``reset`` that hangs is killed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.envs.host import ResetReply, ToolSchemaError, _close, _reset, describe_error
from rlray.envs.trl import is_trl_environment, load_environment, load_environment_class
from rlray.sandbox import Limits, ProcessSandbox, SandboxCrashed, SandboxError, SandboxTimeout

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def row_environment(columns: dict[str, Any], column: str, default: str | None) -> str:
    """Returns the environment name of a prompt row with ``columns``: the value of ``column`` when it is set (not
    missing, None or ""), else ``default``; "" (a single-turn row) when neither is."""
    return str(columns.get(column) or default or "")


def reset_kwargs(columns: dict[str, Any], prompt: Any, prompt_column: str) -> dict[str, Any]:
    """Returns ``reset``'s keyword arguments for a prompt row: its columns, with its prompt as ``prompt`` and under
    ``prompt_column`` (``data.prompt_column``)."""
    return {**columns, "prompt": prompt, prompt_column: prompt}


def required_columns(cls: type) -> list[str]:
    """Returns the keyword parameters of ``cls.reset`` that have no default (``self`` left out), in order: columns a
    row must have for ``reset(**row)`` to bind. [] for ``reset(self, **row)``."""
    try:
        params = list(inspect.signature(cls.reset).parameters.values())
    except (TypeError, ValueError):  # no signature to read
        return []
    if params and params[0].name == "self":
        params = params[1:]
    return [p.name for p in params if p.kind in _KEYWORD and p.default is p.empty]


@dataclass
class ProbeReport:
    """What opening an environment's first episode found.

    Attributes:
        trl: the class is written for TRL's ``environment_factory`` (adapted by ``rlray.envs.trl``).
        required_columns: the row columns its ``reset`` cannot do without (``required_columns``).
        replies: one ``ResetReply`` per row tried, in order, ending at the first that opened (its ``prompt`` and
            ``tools`` schemas are what the model sees first) or after every row given failed.
        tool_schema_error: "" or why a tool of the opened episode has no usable JSON schema (no row can open then).
    """

    trl: bool
    required_columns: list[str]
    replies: list[ResetReply] = field(default_factory=list)
    tool_schema_error: str = ""

    @property
    def opened(self) -> ResetReply | None:
        """Returns the reply of the row that opened, or None when every row tried failed."""
        return next((r for r in self.replies if r.error is None), None)


def probe_environment(spec: str, rows: list[dict[str, Any]], trl_parity: bool = True) -> ProbeReport:
    """Returns what opening one episode of ``spec`` on ``rows`` (each ``reset_kwargs``), in turn, found.

    Each row gets a new instance; the first that opens ends the probe (its instance is closed). A raise in the
    constructor, in ``reset``, a ``reset`` that does not return an ``EnvReset`` and a tool without a usable JSON
    schema each give an error reply that says where (``rlray.envs.host.describe_error``).

    Raises:
        ValueError: the class cannot be loaded (``rlray.envs.trl.load_environment_class``).
    """
    cls = load_environment_class(spec)
    factory = load_environment(spec, trl_parity)
    report = ProbeReport(is_trl_environment(cls), required_columns(cls))
    for row in rows:
        try:
            env = factory()
        except Exception as err:  # noqa: BLE001 - reported, never raised: the preflight words it
            report.replies.append(ResetReply(error="env_error", message=describe_error(f"{cls.__name__}()", err)))
            continue
        try:
            reply = _reset(env, row)
        except ToolSchemaError as err:  # not the row's fault: every episode would fail the same way
            report.replies.append(ResetReply(error="env_error", message=describe_error("reset(**row)", err)))
            report.tool_schema_error = str(err)
            break
        except Exception as err:  # noqa: BLE001 - as above (EnvironmentRaised says where)
            reply = ResetReply(error="env_error", message=describe_error("reset(**row)", err))
        report.replies.append(reply)
        try:
            _close(env)
        except Exception as err:  # noqa: BLE001 - a raising close fails an episode in a run, so it fails here
            report.replies[-1] = ResetReply(error="env_error", message=describe_error("close()", err))
        if report.replies[-1].error is None:
            break
    return report


def _serve_probe(spec: str, trl_parity: bool) -> Callable[[list[dict[str, Any]]], ProbeReport]:
    """Returns ``probe_environment`` for ``spec`` once its class loads: the probe child's entry (it runs there)."""
    from rlray.envs.tools import load_schema_builder

    load_environment_class(spec)
    load_schema_builder()  # under start_timeout_s, not the rows' env.step_timeout_s (load_schema_builder)
    return functools.partial(probe_environment, spec, trl_parity=trl_parity)


def probe_in_sandbox(spec: str, rows: list[dict[str, Any]], *, trl_parity: bool, untrusted: bool, memory_gib: float,
                     timeout_s: float, start_timeout_s: float = 120.0) -> ProbeReport:
    """Returns ``probe_environment(spec, rows)`` run in a child process (``rlray.sandbox.ProcessSandbox``).

    Args:
        spec: the environment's "package.module:Class" or "file.py:Class" (a file path absolute, or relative to
            this process's folder).
        rows: ``reset``'s keyword arguments of the rows to try, in order.
        trl_parity: as ``rlray.envs.trl.load_environment``.
        untrusted: run the child with the sandbox's untrusted limits (``env.sandbox``).
        memory_gib: the child's address-space cap with ``untrusted``, in GiB.
        timeout_s: seconds the child may take to try every row (``env.step_timeout_s`` per row).
        start_timeout_s: seconds the child may take to start and load the class (a Python start and its imports).

    Raises:
        ValueError: the class cannot be loaded (the loader's message), the probe ran past a time limit, or the
            child died (each names the spec).
    """
    try:
        box = ProcessSandbox(_serve_probe, {"spec": spec, "trl_parity": trl_parity}, timeout_s=timeout_s,
                             start_timeout_s=start_timeout_s, limits=Limits(untrusted=untrusted, memory_gib=memory_gib),
                             name=f"environment check {spec}")
    except SandboxError as err:
        raise ValueError(str(err.original) if isinstance(err.original, ValueError) else str(err)) from None
    except SandboxTimeout as err:
        raise ValueError(f"environment {spec!r}: loading it took longer than {start_timeout_s:g} s ({err})") from None
    try:
        return box(rows)
    except SandboxTimeout:
        raise ValueError(f"environment {spec!r}: opening an episode on {len(rows)} rows took longer than "
                         f"{timeout_s:g} s (env.step_timeout_s for each); its constructor or reset may hang") from None
    except (SandboxError, SandboxCrashed) as err:
        raise ValueError(f"environment {spec!r}: opening an episode failed: {err}") from None
    finally:
        box.close()
