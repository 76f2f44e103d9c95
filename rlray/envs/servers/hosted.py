"""The environment servers of one environment host: started there (127.0.0.1 is the host's own machine), one
environment factory per server for the host's episodes, stopped with the host.

``HostedServer`` is the plain record the run plan hands the hosts (``env.servers``); ``start_servers`` starts them
with a ``ServerSupervisor`` (restarts included) and returns a factory per name that builds one episode's
environment over a session of its server (``OpenEnvEnvironment`` for protocol "openenv").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlray.envs.servers.openenv import OpenEnvEnvironment, OpenEnvError, OpenEnvOptions, fetch_schema
from rlray.envs.servers.supervisor import ServerSpec, ServerSupervisor

PROTOCOLS = ("openenv",)


@dataclass(frozen=True)
class HostedServer:
    """One ``env.servers`` entry as the hosts run it.

    Attributes:
        spec: the process to start or the URL to reach (``ServerSpec``; its ``name`` is the environment's name).
        protocol: "openenv".
        openenv: the OpenEnv options (protocol "openenv").
    """

    spec: ServerSpec
    protocol: str = "openenv"
    openenv: OpenEnvOptions = OpenEnvOptions()


def start_servers(servers: list[HostedServer], timeout_s: float,
                  log_dir: str | None = None) -> tuple[ServerSupervisor, dict[str, Callable[[], Any]]]:
    """Starts the servers and returns their supervisor and {name: a factory of one episode's environment}.

    Args:
        servers: the servers.
        timeout_s: seconds an episode waits for a session slot, to connect, and for each answer (env.step_timeout_s).
        log_dir: folder of the servers' logs (None: a temporary folder).

    Raises:
        ServerStartError: a server did not start (its log quoted).
        ValueError: an unknown protocol, or an OpenEnv server whose action has no ``action_field`` (names the fields).
    """
    supervisor = ServerSupervisor([s.spec for s in servers], log_dir)
    supervisor.start()
    factories: dict[str, Callable[[], Any]] = {}
    try:
        for hosted in servers:
            name = hosted.spec.name
            if hosted.protocol not in PROTOCOLS:
                raise ValueError(f"env.servers.{name}.protocol={hosted.protocol!r}: known protocols are {PROTOCOLS}")
            _check_action_field(name, supervisor[name].url, hosted.openenv)
            factories[name] = functools.partial(OpenEnvEnvironment, name, supervisor[name], hosted.openenv, timeout_s)
    except (ValueError, OpenEnvError):
        supervisor.stop()
        raise
    return supervisor, factories


def _check_action_field(name: str, url: str, options: OpenEnvOptions) -> None:
    """Raises ValueError when ``options.action_field`` is not a field of the server's action (``GET /schema``)."""
    if options.action_field is None:
        return
    fields = sorted(fetch_schema(url).get("action", {}).get("properties", {}))
    if options.action_field not in fields:
        raise ValueError(f"env.servers.{name}.openenv.action_field={options.action_field!r} is not a field of the "
                         f"server's action; it has {fields}")
