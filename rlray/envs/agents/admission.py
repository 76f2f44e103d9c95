"""Admission of a batch's synchronous agent episodes (``env.agent_threads``): how many run at once, per rollout actor,
without changing which requests share an engine call (``rlray.envs.agents.agent_host``'s ``TickBatcher``).

``thread_shares`` deals the threads over the actors and ``admission_waves`` says how many episode time limits a batch
may take end to end (rank 0 waits that long for a host's ``run_agents``: ``rlray.run.agents``); both are pure and
import nothing of the host, so rank 0 uses them without the gateway's dependencies.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rlray.envs.agents.agent import AgentRequest


class Batcher(Protocol):
    """What admission needs of the batch's batcher (``rlray.envs.agents.agent_host.TickBatcher``): its sampler's
    ``num_actors``, and the count of running episodes per actor key."""

    sampler: Any

    def enter(self, actor_key: int) -> None:
        """Counts an episode that starts."""

    def leave(self, actor_key: int) -> None:
        """Counts an episode that ended."""


def thread_shares(pinned: Mapping[int, int], threads: int) -> dict[int, int]:
    """Returns {actor: threads} for a batch whose synchronous episodes are ``pinned`` ({actor: episodes}): one each,
    then one at a time in actor order, none past an actor's episodes, until ``threads`` are dealt (an actor with
    episodes always gets one, so the total can pass ``threads`` when it is below the number of such actors)."""
    shares, left = dict.fromkeys(pinned, 1), threads - len(pinned)
    while left > 0 and any(shares[a] < pinned[a] for a in shares):
        for actor in sorted(shares):
            if left > 0 and shares[actor] < pinned[actor]:
                shares[actor], left = shares[actor] + 1, left - 1
    return shares


def admission_waves(pinned: Mapping[int, int], threads: int) -> int:
    """Returns how many episodes run one after another on one thread at most (1 without synchronous episodes): a
    batch may take that many ``env.episode_timeout_s`` end to end."""
    shares = thread_shares(pinned, threads)
    return max((math.ceil(n / shares[a]) for a, n in pinned.items() if n), default=1)


class Admission:
    """Starts a batch's synchronous agent episodes (a thread each) at most ``threads`` at a time (env.agent_threads).

    The threads are dealt over the rollout actors the batch's synchronous episodes are pinned to: one each, then one at
    a time in actor order, none past an actor's episodes. Each actor admits its episodes in episode order, its first
    ones at once and each later one when one of its running synchronous episodes ends. An episode counts in the
    batcher (``TickBatcher.enter``) from its admission, and ``end`` hands an ended episode's place on in one stretch of
    synchronous code (``leave``, then ``enter`` of the next one: no ``await`` between), so the batcher never sees the
    actor a running episode short: it waits for the newcomer's first request as it would have for the ended episode's
    next, and under ``lockstep`` each engine call still carries what the conversations alone decide, whatever the
    timing. A freed place stays with its actor (one whose episodes have all started leaves it unused): handed to another
    actor, whether the newcomer joined that actor's current call would depend on timing. Async agents' episodes are
    admitted at once and not counted.

    Args:
        batcher: the batch's batcher (episodes are counted in it as they are admitted).
        episodes: the batch's episodes, in order.
        is_sync: whether an episode's agent is synchronous.
        threads: the most synchronous episodes running at once (at least one per actor they are pinned to).
    """

    def __init__(self, batcher: Batcher, episodes: list[AgentRequest], is_sync: Callable[[AgentRequest], bool],
                 threads: int) -> None:
        self.batcher, num_actors = batcher, batcher.sampler.num_actors
        self._waiting: dict[int, collections.deque[tuple[AgentRequest, asyncio.Future]]] = {}  # actor -> not started
        self._tickets: dict[str, asyncio.Future] = {}  # episode key -> done at its admission
        self._sync = {r.key for r in episodes if is_sync(r)}
        free = thread_shares(collections.Counter(r.actor_key % num_actors for r in episodes if r.key in self._sync),
                             threads)  # actor -> places not taken yet
        loop = asyncio.get_running_loop()
        for request in episodes:
            if request.key in self._sync:
                actor = request.actor_key % num_actors
                if not free[actor]:
                    self._tickets[request.key] = ticket = loop.create_future()
                    self._waiting.setdefault(actor, collections.deque()).append((request, ticket))
                    continue
                free[actor] -= 1
            batcher.enter(request.actor_key)

    async def wait(self, request: AgentRequest) -> None:
        """Returns once ``request``'s episode is admitted (counted in the batcher): at once, or when a running episode
        of its actor has ended."""
        ticket = self._tickets.pop(request.key, None)
        if ticket is not None:
            await ticket

    def end(self, request: AgentRequest) -> None:
        """Counts ``request``'s admitted episode as ended and hands its place to the next waiting episode of its actor,
        if any, without yielding to the loop in between (see the class docstring)."""
        self.batcher.leave(request.actor_key)
        waiting = self._waiting.get(request.actor_key % self.batcher.sampler.num_actors)
        while request.key in self._sync and waiting:
            following, ticket = waiting.popleft()
            if ticket.done():  # its wait was cancelled (the batch is being torn down): the place goes on
                continue
            self.batcher.enter(following.actor_key)  # the batcher, woken by leave, already waits for this one
            ticket.set_result(None)
            break
