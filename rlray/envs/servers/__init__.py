"""Environment servers: environments that run as servers beside the run, each in its own Python environment.

- ``supervisor``: the protocol-free part: ``ServerSpec``, ``ServerProcess`` (start in a Python environment, wait
  until healthy, restart when it dies, bound its sessions, stop), ``ServerSupervisor`` (many, watched by a thread),
  and the errors ``ServerError``/``ServerStartError``/``ServerDown``/``ServerBusy``.
- ``openenv``: OpenEnv's WebSocket protocol and an rlray environment over one OpenEnv session.
- ``verifiers`` (with ``verifiers_bridge``, run in verifiers' own venv): a verifiers environment as an agent, its
  bridge a server that a ``ServerSupervisor`` runs.
"""

from rlray.envs.servers.supervisor import (
    Lease,
    ServerBusy,
    ServerDown,
    ServerError,
    ServerProcess,
    ServerSpec,
    ServerStartError,
    ServerSupervisor,
    free_port,
    restarts_here,
)

__all__ = [
    "Lease",
    "ServerBusy",
    "ServerDown",
    "ServerError",
    "ServerProcess",
    "ServerSpec",
    "ServerStartError",
    "ServerSupervisor",
    "free_port",
    "restarts_here",
]
