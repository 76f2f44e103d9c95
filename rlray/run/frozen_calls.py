"""Stage 4's calls to the reference and teacher actors (``placement: actor``) under ``watchdog.reference_call_s``.

Every learner rank calls the actor for its own shard and waits on it (``FrozenCalls.logprobs``). A call past its
deadline is reported by the rank's ``rlray.hangs.HangWatch`` (the actor's Python stacks, taken from the actor's
process, in an ``rlray: hang`` line; rank 0's watch also sends the ``hang`` alert), then ``watchdog.on_hang`` applies:

- "restart": the watch kills the actor's process and Ray restarts it (``resources.reference.max_restarts`` /
  ``resources.teacher.max_restarts``: it loads its frozen model again), and the call is made once more. A call that
  fails with an actor error (the actor died, or another rank's watch restarted it) is made once more too. A second
  failure of the same call stops the run.
- "stop": the call is not made again, and the run stops.

The actor runs one call at a time and every rank's call waits on it, so one stuck call holds the calls queued behind
it: rank r reports only after a further r x (``stacks_timeout_s`` + ``STAGGER_S``) seconds, so that the lowest rank
whose call is stuck restarts the actor once (taking the stacks and the restart fit within that margin), and the
other ranks' calls then fail with an actor error and are made again, unreported. A call is not counted against its
deadline while the GCS has the actor starting or restarting (its model loading).

A stop needs every rank, whose next collectives would not line up otherwise (one rank writing the stop snapshot while
another waits in stage 5's all-reduce): ``FrozenCalls.agree``, one all-reduce that every rank calls after its stage 4
calls, sums the ranks' hang counts (``run/hangs``, ``run/hang_restarts``) and tells every rank which ranks stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from rlray.hangs import HangError, HangWatch
from rlray.rollout.fleet import gcs_actor_state

log = logging.getLogger(__name__)

STAGGER_S = 5.0  # seconds added to stacks_timeout_s per rank before a rank reports a stuck call (module docstring)
KEY = "watchdog.reference_call_s"


class FrozenCalls:
    """One learner rank's logprobs calls to the reference and teacher actors, each under ``watch.reference_call_s``.

    Args:
        watch: this rank's hang watch (``rlray.run.lead.hang_watch``; rank 0's sends alerts).
        rank: this learner rank (0-based): sets how long past the deadline it waits before reporting.
        wait: ``ray.wait``; get: ``ray.get``; state: the actor's GCS state (``gcs_actor_state``); clock: seconds,
            monotonic (a test passes fakes).
        poll_s: seconds between looks at a pending call.

    Attributes:
        stopped: why this rank's calls stop the run (a ``HangError`` message under ``watchdog.on_hang=stop``, or a
            call that failed twice), else None.
        retries: calls made once more, over the run (after a hang restart or an actor error).
        run_counts: the run's hang counts of every rank's calls, summed by the latest ``agree``:
            {"run/hangs": ..., "run/hang_restarts": ...}.
    """

    def __init__(self, watch: HangWatch, rank: int, *, wait: Callable[..., tuple[list, list]] = ray.wait,
                 get: Callable[[Any], Any] = ray.get, state: Callable[[Any], str] = gcs_actor_state,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 1.0) -> None:
        self.watch, self.rank, self.poll_s = watch, rank, poll_s
        self._wait, self._get, self._state, self._clock = wait, get, state, clock
        self.stopped: str | None = None
        self.retries = 0
        self.run_counts = {"run/hangs": 0.0, "run/hang_restarts": 0.0}

    @property
    def patience_s(self) -> float:
        """Returns the seconds this rank waits on a call before reporting it: ``reference_call_s`` plus
        rank x (``stacks_timeout_s`` + ``STAGGER_S``)."""
        return self.watch.reference_call_s + self.rank * (self.watch.stacks_timeout_s + STAGGER_S)

    def logprobs(self, actor: Any, who: str, inputs: Any, batching: Any) -> Any:
        """Returns ``actor.logprobs(inputs, batching)``: [B, T] float32 logprobs of this rank's shard's sampled tokens
        (``ReferenceActor.logprobs``), made once more after a hang restart or an actor error; None when the call
        stops the run (``stopped`` says why; the caller then calls ``agree``).

        Args:
            actor: the ``ReferenceActor`` handle; who: "reference actor" or "teacher actor".
            inputs: the shard's ``schema.ModelInputs``; batching: the actor's ``MicroBatching``.
        """
        if self.stopped is not None:
            return None
        failure = ""
        for attempt in (1, 2):
            ref = actor.logprobs.remote(inputs, batching)
            try:
                if self._finished(actor, who, ref):
                    return self._get(ref)
                failure = f"it ran past {KEY}={self.watch.reference_call_s:g} s"
            except HangError as err:  # watchdog.on_hang=stop, after the report
                self.stopped = f"HangError: {err}"
                return None
            except RayActorError as err:  # died, or restarted by this or another rank's watch
                failure = f"{type(err).__name__}: {err}"
            if attempt == 1:
                self.retries += 1
                log.warning("learner rank %d: %s's logprobs call failed (%s); making it once more", self.rank, who,
                            failure[:500])
        self.stopped = (f"{who}'s logprobs call failed twice on learner rank {self.rank} (the second time: "
                        f"{failure[:2000]})")
        return None

    def _finished(self, actor: Any, who: str, ref: Any) -> bool:
        """Waits for ``ref``; returns True once it is ready (done or failed), or False after reporting it past its
        deadline (``HangWatch.hung``: the actor restarted, which fails the call).

        Raises:
            HangError: under ``watchdog.on_hang=stop``, after the report.
        """
        started = self._clock()
        while not self._wait([ref], timeout=self.poll_s, fetch_local=False)[0]:
            waited = self._clock() - started
            if waited <= self.patience_s:
                continue
            if self._state(actor) not in ("ALIVE", "UNKNOWN"):  # starting or restarting: no call of it runs yet
                started = self._clock()
                continue
            self.watch.hung(actor, who, "logprobs", waited, self.watch.reference_call_s, KEY)
            return False
        return True

    def agree(self, all_reduce_sum: Callable[[dict[str, float]], dict[str, float]], world: int) -> list[int]:
        """Returns the ranks whose calls of this step stop the run ([] when none), the same on every rank, and sets
        ``run_counts`` to every rank's hang counts summed: one all-reduce that every rank calls at the same point.

        Args:
            all_reduce_sum: the learner group's element-wise sum over ranks (``Collective.all_reduce_sum``).
            world: learner ranks.
        """
        summed = all_reduce_sum(self.contribution(world))
        self.run_counts = {"run/hangs": summed["run/hangs"], "run/hang_restarts": summed["run/hang_restarts"]}
        return [r for r in range(world) if summed[f"stop/{r}"] > 0]

    def contribution(self, world: int) -> dict[str, float]:
        """Returns this rank's part of ``agree``'s all-reduce: its watch's counts ("run/hangs", "run/hang_restarts")
        and "stop/<r>" for each of ``world`` ranks r (1.0 at this rank's when its calls stop the run, else 0.0)."""
        return {"run/hangs": float(self.watch.hangs), "run/hang_restarts": float(self.watch.restarts),
                **{f"stop/{r}": float(r == self.rank and self.stopped is not None) for r in range(world)}}

    def stop_message(self, ranks: list[int]) -> str:
        """Returns the message every rank stops with when ``ranks`` (from ``agree``) stop the run: this rank's own
        (a ``HangError`` report has the actor's stacks) when it is one of them, else one naming them."""
        if self.stopped is not None:
            return self.stopped
        return (f"HangError: a logprobs call to the reference or teacher actor stopped the run on learner rank(s) "
                f"{ranks} ({KEY}; their log's 'rlray: hang' line names the actor and its stacks)")
