"""A multi-turn step's rollout run again, whole, when a rollout actor or an environment host died under it (rank 0).

Episodes and agents sample turn after turn on the rollout actors while their environments live on the hosts. A death
in the middle of a step used to be repaired piecemeal: the fleet sent the dead actor's turn again, the episodes of a
dead host ran again alone (a smaller engine batch: other samples), agent episodes whose host or rollout actor died
failed, and an agent's call queued to a restarting rollout actor ran there on the initial weights. Each repair changed
the step's samples, so a run with a fault no longer repeated the run without it.

``RerunOnFault`` wraps the step's rollout source (``rlray.run.episodes.EpisodeRollout``, ``rlray.run.agents.
AgentRollout``) and runs the step's rollout again from the start when one of its actors or hosts died while it ran: a
rollout actor the fleet saw fail, a restart the GCS counts for any rollout actor or host (``NumRestarts``: an agent's
call, or a host call, met it), or an episode that ended ``actor_died``. Before the rerun every host must answer a ping
and every rollout actor must hold the fleet's latest weights (``RolloutFleet.recover``: a restarted actor gets them);
a host that is not back (its restarts spent), or no rollout actor back, leaves the step's samples as they are (its
failed episodes counted).
The rerun samples the same prompts with the same seeds and the same weights (a multi-turn rollout in flight is waited
for before the next weight push: ``RolloutPipeline.settle_before_push``) in the same engine batches, so its
completions are the ones an uninterrupted run gets, bit for bit (tests/run/test_async_resume.py kills a rollout actor
and an environment host). The lost work is counted: the rerun's episodes in ``env/episodes_rerun``, the fleet's
failures and calls in ``rollout/actor_failures`` and ``rollout/engine_calls``. Exactness needs the dead actor back
within ``resources.node_wait_s`` (with fewer actors the episodes' turns batch differently) and environments whose
episodes depend only on their row; after ``MAX_RERUNS + 1`` faulted attempts the last one's completions are kept.
With ``rollout.partial`` a push does not wait for the episodes (no settle), so a rerun samples with newer weights.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Any

import ray

from rlray.rollout import Completion, RolloutSource, SamplingSpec
from rlray.rollout.fleet import ACTOR_ERRORS, RolloutError, RolloutFleet
from rlray.rollout.gcs import gcs_actor_info
from rlray.rollout.types import in_background

log = logging.getLogger(__name__)

MAX_RERUNS = 2  # whole reruns of one step's rollout; a fault in the last one keeps its completions (counted)
HOST_WAIT_S = 60.0  # seconds a rerun waits for a restarting environment host to answer its ping


class RerunOnFault:
    """A ``RolloutSource`` that runs ``inner``'s rollout again, whole, when a rollout actor or host died under it.

    Args:
        inner: the multi-turn rollout (episodes, agents) whose steps it runs.
        fleet: the rollout fleet ``inner`` samples from.
        hosts: the environment hosts' handles ``inner`` runs episodes on.

    Attributes:
        reruns: whole rollouts run again, over its life (a counter).
    """

    def __init__(self, inner: RolloutSource, fleet: RolloutFleet, hosts: list[Any]) -> None:
        self.inner, self.fleet, self.hosts = inner, fleet, list(hosts)
        self.reruns = 0

    @property
    def version(self) -> int:
        """Returns the fleet's latest policy version."""
        return self.inner.version

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> Future[list[Completion]]:
        """Starts ``generate`` on a background thread ("rlray-rollout"); returns its future at once."""
        return in_background(lambda: self.generate(prompt_ids, sampling, rows), "rlray-rollout")

    def collect(self, pending: Future[list[Completion]]) -> list[Completion]:
        """Returns the completions of a submitted rollout, prompt-major, waiting for them.

        Raises:
            whatever ``inner``'s rollout raised.
        """
        return pending.result()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> list[Completion]:
        """Returns ``inner.generate(...)``'s completions of the first attempt no actor or host died under (at most
        ``MAX_RERUNS`` reruns); a rerun's completions carry ``episode.rerun``.

        Raises:
            whatever ``inner``'s rollout raised.
        """
        for attempt in range(MAX_RERUNS + 1):
            before = self._deaths()
            got = self.inner.generate(prompt_ids, sampling, rows)
            died = any(c.episode is not None and c.episode.stop_reason == "actor_died" for c in got)
            if not died and not self._died_since(before):
                break
            if attempt == MAX_RERUNS:
                log.warning("a rollout actor or environment host died under each of %d attempts of a step's rollout: "
                            "keeping the last one's samples", attempt + 1)
                break
            if not self._recover():
                log.warning("a rollout actor or environment host died during a step's rollout and is not back: "
                            "keeping its samples (its episodes count as failed)")
                break
            log.warning("a rollout actor or environment host died during a step's rollout: running its %d prompts "
                        "again from the start, with the same seeds and weights", len(prompt_ids))
            self.reruns += 1
        if attempt:
            got = [c if c.episode is None else dataclasses.replace(c, episode=dataclasses.replace(c.episode, rerun=True))
                   for c in got]
        return got

    def _deaths(self) -> tuple[int, ...]:
        """Returns the fleet's failures seen and the GCS's restart count of every rollout actor and host (-1 where the
        GCS did not answer)."""
        return (self.fleet.failures, *(gcs_actor_info(a).get("NumRestarts", -1) for a in [*self.fleet.actors, *self.hosts]))

    def _died_since(self, before: tuple[int, ...]) -> bool:
        """Returns whether the fleet saw a failure, or the GCS counts a restart, since ``_deaths()`` returned
        ``before`` (a count the GCS did not answer for, either time, is not compared)."""
        now = self._deaths()
        return now[0] != before[0] or any(a != b for a, b in zip(before[1:], now[1:], strict=True) if min(a, b) >= 0)

    def _recover(self) -> bool:
        """Waits for every host to answer a ping (up to ``HOST_WAIT_S``) and brings every rollout actor to the latest
        weights (``RolloutFleet.recover``); returns whether every host and at least one rollout actor are back."""
        deadline = time.monotonic() + HOST_WAIT_S
        for i, host in enumerate(self.hosts):
            while True:
                try:
                    ray.get(host.ping.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting: asked again
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(0.5)
                except (*ACTOR_ERRORS, ray.exceptions.GetTimeoutError):
                    log.warning("environment host %d is not back (resources.env.max_restarts spent?)", i)
                    return False
        try:
            self.fleet.recover()  # an actor not back within node_wait_s is left out (the turns then batch differently)
        except RolloutError:
            return False
        return True
