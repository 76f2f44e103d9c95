"""The async rollout pipeline on rank 0: keeps later steps' rollouts in flight with bounded staleness.

``RolloutPipeline`` runs the rollout of step t+1..t+k while step t trains (k =
``rollout.max_staleness``). Ray runs one actor's calls in the order one caller submitted them, so a
rollout submitted while the learner is at version v runs after every weight push up to v: its
samples lag the update that consumes them by at most k versions. k = 0 submits each step's rollout
only when that step starts, which is exactly the synchronous loop.

Multi-turn rollouts (environment episodes, agents) sample turn after turn on a thread of their own; a weight push
between two turns would give an episode's later turns newer weights than its first, depending on timing. With
``settle_before_push`` a push first waits for the rollouts in flight (``before_push``), so every turn of a step's
episodes is sampled with the weights of the version it was submitted at, as a single-turn rollout is.

A snapshot keeps the rollouts in flight (``in_flight_rollouts``: each step's completions and policy version, collected
first): a resumed run trains those steps on exactly the samples an uninterrupted run trains them on, instead of
sampling them again with the snapshot's newer weights.

A rollout in flight that fails before its step asks for it (collected by ``settle``: before a push, at a snapshot) is
sampled again at once, with its step's seeds, through the same source, after ``recover`` has brought every rollout
actor to the fleet's latest weights. When those are the weights it was submitted at (always so before a push with
``settle_before_push``: every multi-turn rollout in flight was submitted since the last push), its samples are the ones
an unfailed rollout gives, bit for bit. The weights of an older version are not kept (a push releases the previous
weights; a delta encoder and NCCL/IPC keep only the latest), so a rollout submitted before the last push (single-turn,
k >= 1, failed at a snapshot) or one whose re-sample failed too (sampled when its step asks) gets newer weights: its
samples carry the version that sampled them (``rollout/staleness_*``), a warning names the step and both versions, and
its prompts count in ``stale_rerun_prompts`` (``rollout/stale_rerun_prompts``). Every re-sampled prompt counts in
``rerun_prompts`` (``rollout/rerun_prompts``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.hangs import HangError
from rlray.rollout import Completion, RolloutSource, SamplingSpec
from rlray.rollout.types import completion_from_dict, completion_to_dict

log = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """One step's prompts and completions, as the step consumes them."""

    step: int
    rows: list[Any]
    prompt_ids: list[list[int]]
    completions: list[Completion]
    submitted_at_version: int


@dataclass
class _InFlight:
    """A step taken ahead: its prompts, its pending rollout (None: not submitted, or to be submitted again), the
    policy version it was submitted at, the data cursor before its prompts were taken, its completions once
    collected before its step asks (``settle``, a restored snapshot), and ``failed_at``: the version its rollout was
    submitted at when that failed and ``settle`` could not sample it again (its re-sample failed too, or it hung under
    ``watchdog.on_hang=stop``): it is submitted again when its step asks; else None."""

    step: int
    rows: list[Any]
    ids: list[list[int]]
    pending: Any
    version: int
    before: dict | None
    completions: list[Completion] | None = field(default=None)
    failed_at: int | None = field(default=None)


class RolloutPipeline:
    """Keeps the rollouts of steps t..t+k in flight while step t trains (k = max_staleness).

    Step t + k takes its prompts from the data cursor when step t starts, so in async mode the cursor
    runs ahead of the steps done, and DAPO refills that step t draws come after the prompts of steps
    t+1..t+k. ``cursor_state`` records that order, so a restore hands every step the prompts an
    uninterrupted run gives it; ``in_flight_rollouts`` records the steps' samples, so a restore trains
    them on the samples an uninterrupted run trains them on.

    Args:
        rollouts: what the steps sample from: the rollout fleet, or the episode rollout over it.
        take_prompts: returns (rows, prompt token ids) of the next step (advances the data cursor).
        sampling_for: returns the SamplingSpec of a step (its seed depends on the step).
        max_staleness: k, in policy versions; 0 is synchronous.
        cursor: returns the data cursor's state (``PromptStream.state_dict``), recorded before each
            step's prompts are taken, so that a snapshot can name the prompts of the steps in flight.
        restore_cursor: sets the data cursor's state (``PromptStream.load_state_dict``).
        overlap: submit the steps ahead at once, so they generate while step t trains (True), or keep them,
            prompts taken, until their step asks (False: ``rollout.overlap`` off, for stages that share cores;
            the same prompts in the same order, generated with the newest weights).
        settle_before_push: ``before_push`` waits for the rollouts in flight (multi-turn rollouts: environments or
            agents, whose turns would otherwise straddle a weight push); single-turn rollouts need not (Ray runs an
            actor's calls in order: a rollout submitted before a push runs before it).
        recover: brings every rollout actor back to the fleet's latest weights (``RolloutFleet.recover``; a restarted
            one is sent them), called before a failed rollout is sampled again (``settle``); None: nothing to do.

    Attributes:
        rerun_prompts: prompts whose rollout failed before their step asked and was sampled again, over the
            pipeline's life (a counter).
        stale_rerun_prompts: of those, prompts sampled again with newer weights than their rollout was submitted at
            (not the samples of a run without the fault), over the pipeline's life (a counter).
    """

    def __init__(
        self,
        rollouts: RolloutSource,
        take_prompts: Callable[[], tuple[list[Any], list[list[int]]]],
        sampling_for: Callable[[int], SamplingSpec],
        max_staleness: int,
        cursor: Callable[[], dict] | None = None,
        restore_cursor: Callable[[dict], None] | None = None,
        overlap: bool = True,
        settle_before_push: bool = False,
        recover: Callable[[], None] | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.take_prompts = take_prompts
        self.sampling_for = sampling_for
        self.max_staleness = max_staleness
        self.overlap = overlap
        self.settle_before_push = settle_before_push
        self.cursor = cursor
        self.restore_cursor = restore_cursor
        self.recover = recover
        self.rerun_prompts = self.stale_rerun_prompts = 0
        self._queue: collections.deque[_InFlight] = collections.deque()
        # (cursor before, rows, ids, (version, completions) kept by a snapshot or None) of steps to submit again
        self._retake: collections.deque = collections.deque()
        self._next_step: int | None = None
        self._last: _InFlight | None = None  # the step ``next`` returned last

    def next(self, step: int) -> RolloutBatch:
        """Returns step ``step``'s rollout, after submitting those of steps up to ``step + k``.

        A step dropped by ``reset`` or named in a loaded ``cursor_state`` is submitted again with the
        prompts it had, before any step takes new ones (unless the snapshot kept its completions).

        Raises:
            ValueError: steps are not consumed in order.
        """
        if self._next_step is None:
            self._next_step = step
        while self._next_step <= step + self.max_staleness:
            if self._retake:
                before, rows, ids, kept = self._retake.popleft()
            else:
                before, kept = self.cursor() if self.cursor else None, None
                rows, ids = self.take_prompts()
            # queued before it is submitted (kept until its step asks, without overlap): a submit that raises (a hang
            # that stops the run) leaves the step in flight, so a snapshot retakes its prompts
            item = _InFlight(self._next_step, rows, ids, None, self.rollouts.version, before)
            if kept is not None:
                item.version, item.completions = kept
            self._queue.append(item)
            self._next_step += 1
            if item.completions is None and (self.overlap or item.step == step):
                item.pending = self.rollouts.submit(ids, self.sampling_for(item.step), rows)
        item = self._queue.popleft()
        if item.step != step:
            raise ValueError(f"RolloutPipeline: asked for step {step}, the next rollout in flight is step {item.step}")
        try:
            if item.completions is None:
                if item.pending is None:
                    item.pending = self.rollouts.submit(item.ids, self.sampling_for(step), item.rows)
                    item.version = self.rollouts.version
                    if item.failed_at not in (None, item.version):  # its rollout failed in ``settle``, a push since
                        self._count_stale(item, item.failed_at)
                    item.failed_at = None
                item.completions = self.rollouts.collect(item.pending)
        except BaseException:  # a hang that stops the run: the step stays in flight, so a snapshot retakes its prompts
            item.pending = None
            self._queue.appendleft(item)
            raise
        item.pending = None
        self._last = item
        return RolloutBatch(step, item.rows, item.ids, item.completions, item.version)

    def keep_in_flight(self, step: int) -> None:
        """Puts step ``step``, the one ``next`` returned last, back in flight: a later stage of it hit a hang that
        stops the run (a reward or judge call), so the snapshot keeps its prompts (``cursor_state``) and samples.

        Raises:
            ValueError: ``step`` is not the step ``next`` returned last.
        """
        if self._last is None or self._last.step != step:
            raise ValueError(f"RolloutPipeline: step {step} is not the step returned last")
        self._queue.appendleft(self._last)
        self._last = None

    def settle(self) -> None:
        """Collects every submitted rollout in flight now (kept until its step asks for it).

        A rollout that fails here is sampled again at once (``_sample_again``: at the version it was submitted at when
        the actors still hold it); one whose re-sample fails too, or that hit a hang under ``watchdog.on_hang=stop``,
        is submitted again when its step asks (with the weights of then, counted stale), where a lasting fault raises
        as it would have.
        """
        for item in self._queue:
            if item.pending is not None and item.completions is None:
                try:
                    item.completions = self.rollouts.collect(item.pending)
                except Exception as err:  # noqa: BLE001 - sampled again; raised again, or not, when its step asks
                    item.pending = None
                    self._sample_again(item, err)
                item.pending = None

    def _sample_again(self, item: _InFlight, err: Exception) -> None:
        """Samples step ``item.step``'s failed rollout (``err``) again, with its step's seeds, after ``recover``: the
        same samples as an unfailed rollout when the actors hold the version it was submitted at (``item.version``);
        else counted stale and logged. A re-sample that fails too leaves it to its step (``failed_at``)."""
        submitted = item.version
        self.rerun_prompts += len(item.ids)
        if isinstance(err, HangError):  # watchdog.on_hang=stop: not retried here; its step's submit meets the stop
            log.warning("the rollout of step %d hung before its step asked for it (%s); it is sampled again then",
                        item.step + 1, err)
            item.failed_at = submitted
            return
        try:
            if self.recover is not None:
                self.recover()
            version = self.rollouts.version
            item.completions = self.rollouts.generate(item.ids, self.sampling_for(item.step), item.rows)
        except Exception as again:  # noqa: BLE001 - raised again, or not, when its step asks
            log.warning("the rollout of step %d failed before its step asked for it (%s), and again when sampled "
                        "again (%s); it is sampled when its step asks", item.step + 1, err, again)
            item.failed_at = submitted
            return
        item.version = version
        if version == submitted:
            log.warning("the rollout of step %d failed before its step asked for it (%s): sampled again with the "
                        "weights of version %d it was submitted at, and its step's seeds (%d prompts, "
                        "rollout/rerun_prompts)", item.step + 1, err, version, len(item.ids))
        else:
            self._count_stale(item, submitted)

    def _count_stale(self, item: _InFlight, submitted: int) -> None:
        """Counts and logs step ``item.step``'s rollout sampled again with the weights of ``item.version`` instead of
        those of ``submitted`` (gone: the learner moved on)."""
        self.stale_rerun_prompts += len(item.ids)
        log.warning("the rollout of step %d failed before its step asked for it and was sampled again with the weights "
                    "of version %d, not those of version %d it was submitted at (no longer kept): its %d prompts' "
                    "samples differ from a run without the fault (rollout/stale_rerun_prompts)",
                    item.step + 1, item.version, submitted, len(item.ids))

    def before_push(self) -> None:
        """Called before a weight push: with ``settle_before_push`` (and overlap), waits for the rollouts in flight, so
        none samples a turn with the weights being pushed."""
        if self.settle_before_push and self.overlap:
            self.settle()

    def cursor_state(self) -> dict | None:
        """Returns the data cursor a snapshot keeps, or None without a ``cursor`` callable.

        The cursor counts every prompt taken from the stream: the steps done, their DAPO refills and the
        steps in flight (whose prompts an async run takes before the refills of the steps before them).
        "in_flight" holds the cursor before each step in flight, oldest first, so that
        ``load_cursor_state`` hands those steps the same prompts again.
        """
        if self.cursor is None:
            return None
        in_flight = [item.before for item in self._queue] + [entry[0] for entry in self._retake]
        return {**self.cursor(), "in_flight": in_flight}

    def in_flight_rollouts(self) -> list[dict | None]:
        """Returns what a snapshot keeps of the steps in flight, oldest first (``cursor_state``'s "in_flight" order):
        {"version": policy version submitted at, "completions": [``completion_to_dict``]} per step whose rollout was
        submitted (collected now: ``settle``), None for a step not submitted (it samples when its step asks)."""
        self.settle()
        out: list[dict | None] = []
        for item in self._queue:
            kept = None if item.completions is None else (item.version, item.completions)
            out.append(_kept_dict(kept))
        out += [_kept_dict(entry[3]) for entry in self._retake]
        return out

    def load_cursor_state(self, state: dict) -> None:
        """Drops the rollouts in flight and sets the data cursor to ``state`` (``cursor_state``): the steps
        in flight when it was saved are submitted first, with their prompts taken again at their cursors
        (unless ``keep_rollouts`` then gives them the samples the snapshot kept)."""
        self.reset()
        self._retake.clear()
        for before in state.get("in_flight", []):  # absent in snapshots written before it was kept
            self.restore_cursor(before)
            rows, ids = self.take_prompts()
            self._retake.append((before, rows, ids, None))
        self.restore_cursor({k: v for k, v in state.items() if k != "in_flight"})

    def keep_rollouts(self, rollouts: list[dict | None]) -> None:
        """Gives the steps in flight of the ``cursor_state`` just loaded the samples the same snapshot kept of them
        (``in_flight_rollouts``): they train on those instead of sampling again. An entry None samples again.

        Raises:
            ValueError: ``rollouts`` names another number of steps than are in flight, or a step was already submitted.
        """
        if self._queue or len(rollouts) != len(self._retake):
            raise ValueError(f"RolloutPipeline: the snapshot keeps the rollouts of {len(rollouts)} steps in flight, "
                             f"and its cursor names {len(self._retake)} (with {len(self._queue)} already submitted)")
        for i, kept in enumerate(rollouts):
            if kept is not None:
                before, rows, ids, _ = self._retake[i]
                self._retake[i] = (before, rows, ids,
                                   (int(kept["version"]), [completion_from_dict(c) for c in kept["completions"]]))

    def reset(self) -> None:
        """Drops the rollouts in flight (after a restore or rollback: they used old weights); their steps
        are submitted again with the same prompts, and the data cursor stays where it is."""
        for item in self._queue:
            if item.pending is not None:  # submitted: let the engines finish, their calls are ordered before the push
                self.rollouts.collect(item.pending)
        self._retake.extendleft((item.before, item.rows, item.ids, None) for item in reversed(self._queue))
        self._queue.clear()
        self._next_step = None

    @property
    def in_flight(self) -> int:
        """Returns how many later steps' rollouts are taken (submitted, or kept without overlap) and not consumed."""
        return len(self._queue)


def _kept_dict(kept: tuple[int, list[Completion]] | None) -> dict | None:
    """Returns a kept step's (version, completions) as JSON data, or None."""
    return None if kept is None else {"version": kept[0], "completions": [completion_to_dict(c) for c in kept[1]]}
