"""Ray's GCS actor table, read directly: an actor's state, restarts and node (``RolloutFleet``, ``RerunOnFault``).

The state API (``ray.util.state``) needs the dashboard, which a cluster may run without; ``ray._private.state`` asks
the GCS itself.
"""

from __future__ import annotations

from typing import Any

import ray._private.state


def gcs_actor_info(actor: Any) -> dict[str, Any]:
    """Returns the actor's row of Ray's GCS actor table ("State", "NumRestarts", "Address", "Pid", ...), {} when the
    GCS does not answer (busy or away for a moment: the next poll asks again) or does not know the actor.

    Reads the table directly (``ray._private.state``): the state API (``ray.util.state``) needs the dashboard, which a
    cluster may run without.
    """
    try:
        return ray._private.state.actors(actor_id=actor._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 - the GCS busy or away
        return {}


def gcs_actor_state(actor: Any) -> str:
    """Returns the actor's state in the GCS: "ALIVE", "RESTARTING", "PENDING_CREATION", "DEPENDENCIES_UNREADY",
    "DEAD", or "UNKNOWN" when the GCS does not answer or does not know the actor (``gcs_actor_info``)."""
    return gcs_actor_info(actor).get("State", "UNKNOWN")


def gcs_actor_node(actor: Any) -> str | None:
    """Returns the node id (hex) the actor runs on, from the GCS actor table, or None when the GCS does not say."""
    return gcs_actor_info(actor).get("Address", {}).get("NodeID") or None
