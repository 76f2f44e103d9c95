"""The rollout fleet's deadlines (``rlray.rollout.fleet``): each call sent to a rollout actor is timed from when the
actor's earlier calls are seen done, and one past its deadline (``watchdog.engine_call_s`` for generate calls,
``watchdog.weight_push_s`` for weight pushes) goes to ``rlray.hangs.HangWatch.hung``. Apart from the fleet so that
each file keeps one job; ``RolloutFleet`` inherits it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray

from rlray.hangs import Hang, HangWatch
from rlray.rollout.gcs import gcs_actor_state

POLL_S = 1.0  # seconds between looks at the GCS state of the actors a pending call waits for (the fleet's too)


@dataclass
class _Sent:
    """A call sent to an actor, not yet seen finished: the method's name, its ObjectRef, when sent (``time.monotonic``)."""

    call: str
    ref: Any
    sent_at: float


class FleetDeadlines:
    """The deadline half of ``RolloutFleet``: the calls sent to each actor, in order, and the hang check over them.

    Attributes (set by ``init_deadlines``):
        watch: the deadlines and their action (``rlray.hangs.HangWatch``); None: no deadline.
    """

    actors: list[Any]
    watch: HangWatch | None

    def init_deadlines(self, watch: HangWatch | None) -> None:
        """Starts with no call sent; ``watch`` as the class docstring says."""
        self.watch = watch
        self._sent: dict[int, list[_Sent]] = {}  # actor -> its calls not yet seen finished, in the order sent
        self._free_at: dict[int, float] = {}  # actor -> when its latest call was seen finished
        self._stop: Hang | None = None  # a weight push hung under watchdog.on_hang=stop: raised at the next rollout

    def _track(self, actor: int, call: str, ref: Any) -> None:
        """Records a call sent to ``actor`` (its deadline runs from when the actor's earlier calls are seen done)."""
        if self.watch is not None:
            self._seen_done(actor)
            self._sent.setdefault(actor, []).append(_Sent(call, ref, time.monotonic()))

    def _get(self, actor: int, call: str, ref: Any) -> Any:
        """Returns ``ray.get(ref)`` of ``actor``'s ``call``, under the call's deadline (``_watch_hangs``).

        Raises:
            ray.exceptions.RayActorError: the actor died, or was restarted for a hang.
        """
        self._track(actor, call, ref)
        while self.watch is not None and not ray.wait([ref], timeout=POLL_S, fetch_local=False)[0]:
            self._watch_hangs({actor})
        return ray.get(ref)

    def _seen_done(self, actor: int) -> None:
        """Drops ``actor``'s calls that have finished (or failed); the actor is free of them from now on (at the
        latest: a finish seen late only shortens the time counted against the next call)."""
        sent = self._sent.get(actor, [])
        if not sent:
            return
        ready, _ = ray.wait([s.ref for s in sent], num_returns=len(sent), timeout=0, fetch_local=False)
        if ready:
            done = set(ready)
            self._sent[actor] = [s for s in sent if s.ref not in done]
            self._free_at[actor] = time.monotonic()

    def _watch_hangs(self, actors: set[int]) -> None:
        """Reports each of ``actors`` whose running call (its oldest unfinished one) has run past its deadline, since
        it was sent or since the actor's previous call was seen done, whichever is later, and while the GCS has it
        ALIVE (``HangWatch.hung``: stacks, alert, then the actor is restarted, which fails its pending calls, or
        ``HangError`` is raised)."""
        if self.watch is None:
            return
        for i in sorted(actors):
            self._seen_done(i)
            if not self._sent.get(i):
                continue
            head = self._sent[i][0]
            running_s = time.monotonic() - max(head.sent_at, self._free_at.get(i, 0.0))
            deadline, key = ((self.watch.engine_call_s, "watchdog.engine_call_s") if head.call == "generate"
                             else (self.watch.weight_push_s, "watchdog.weight_push_s"))
            if running_s > deadline and gcs_actor_state(self.actors[i]) not in ("ALIVE", "UNKNOWN"):
                self._free_at[i] = time.monotonic()  # starting or restarting (its __init__): no call of it runs yet
            elif running_s > deadline:
                del self._sent[i]  # the restart fails every call it had
                push = head.call != "generate"  # found in stage 7 (or a refresh): stop at the next rollout instead
                hang = self.watch.hung(self.actors[i], f"rollout actor {i}", head.call, running_s, deadline, key,
                                       stop_later=push)
                if push and hang.action == "stop":
                    self._stop = hang
