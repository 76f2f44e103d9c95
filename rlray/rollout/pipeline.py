"""The async rollout pipeline on rank 0: keeps later steps' rollouts in flight with bounded staleness.

``RolloutPipeline`` runs the rollout of step t+1..t+k while step t trains (k =
``rollout.max_staleness``). Ray runs one actor's calls in the order one caller submitted them, so a
rollout submitted while the learner is at version v runs after every weight push up to v: its
samples lag the update that consumes them by at most k versions. k = 0 submits each step's rollout
only when that step starts, which is exactly the synchronous loop.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlray.rollout import Completion, RolloutSource, SamplingSpec


@dataclass
class RolloutBatch:
    """One step's prompts and completions, as the step consumes them."""

    step: int
    rows: list[Any]
    prompt_ids: list[list[int]]
    completions: list[Completion]
    submitted_at_version: int


class RolloutPipeline:
    """Keeps the rollouts of steps t..t+k in flight while step t trains (k = max_staleness).

    Step t + k takes its prompts from the data cursor when step t starts, so in async mode the cursor
    runs ahead of the steps done, and DAPO refills that step t draws come after the prompts of steps
    t+1..t+k. ``cursor_state`` records that order, so a restore hands every step the prompts an
    uninterrupted run gives it.

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
    ) -> None:
        self.rollouts = rollouts
        self.take_prompts = take_prompts
        self.sampling_for = sampling_for
        self.max_staleness = max_staleness
        self.overlap = overlap
        self.cursor = cursor
        self.restore_cursor = restore_cursor
        self._queue: collections.deque = collections.deque()  # (step, rows, ids, pending, version, cursor before)
        self._retake: collections.deque = collections.deque()  # (cursor before, rows, ids) of steps to submit again
        self._next_step: int | None = None
        self._last: tuple | None = None  # (step, rows, ids, None, version, cursor before) of the step ``next`` returned

    def next(self, step: int) -> RolloutBatch:
        """Returns step ``step``'s rollout, after submitting those of steps up to ``step + k``.

        A step dropped by ``reset`` or named in a loaded ``cursor_state`` is submitted again with the
        prompts it had, before any step takes new ones.

        Raises:
            ValueError: steps are not consumed in order.
        """
        if self._next_step is None:
            self._next_step = step
        while self._next_step <= step + self.max_staleness:
            if self._retake:
                before, rows, ids = self._retake.popleft()
            else:
                before = self.cursor() if self.cursor else None
                rows, ids = self.take_prompts()
            # queued before it is submitted (kept until its step asks, without overlap): a submit that raises (a hang
            # that stops the run) leaves the step in flight, so a snapshot retakes its prompts
            self._queue.append((self._next_step, rows, ids, None, self.rollouts.version, before))
            self._next_step += 1
            if self.overlap or self._next_step - 1 == step:
                pending = self.rollouts.submit(ids, self.sampling_for(self._next_step - 1), rows)
                self._queue[-1] = (self._next_step - 1, rows, ids, pending, self.rollouts.version, before)
        got, rows, ids, pending, version, before = self._queue.popleft()
        if got != step:
            raise ValueError(f"RolloutPipeline: asked for step {step}, the next rollout in flight is step {got}")
        try:
            if pending is None:
                pending, version = self.rollouts.submit(ids, self.sampling_for(step), rows), self.rollouts.version
            completions = self.rollouts.collect(pending)
        except BaseException:  # a hang that stops the run: the step stays in flight, so a snapshot retakes its prompts
            self._queue.appendleft((got, rows, ids, None, version, before))
            raise
        self._last = (got, rows, ids, None, version, before)
        return RolloutBatch(step, rows, ids, completions, version)

    def keep_in_flight(self, step: int) -> None:
        """Puts step ``step``, the one ``next`` returned last, back in flight: a later stage of it hit a hang that
        stops the run (a reward or judge call), so the snapshot's cursor (``cursor_state``) retakes its prompts.

        Raises:
            ValueError: ``step`` is not the step ``next`` returned last.
        """
        if self._last is None or self._last[0] != step:
            raise ValueError(f"RolloutPipeline: step {step} is not the step returned last")
        self._queue.appendleft(self._last)
        self._last = None

    def cursor_state(self) -> dict | None:
        """Returns the data cursor a snapshot keeps, or None without a ``cursor`` callable.

        The cursor counts every prompt taken from the stream: the steps done, their DAPO refills and the
        steps in flight (whose prompts an async run takes before the refills of the steps before them).
        "in_flight" holds the cursor before each step in flight, oldest first, so that
        ``load_cursor_state`` hands those steps the same prompts again.
        """
        if self.cursor is None:
            return None
        in_flight = [item[5] for item in self._queue] + [item[0] for item in self._retake]
        return {**self.cursor(), "in_flight": in_flight}

    def load_cursor_state(self, state: dict) -> None:
        """Drops the rollouts in flight and sets the data cursor to ``state`` (``cursor_state``): the steps
        in flight when it was saved are submitted first, with their prompts taken again at their cursors."""
        self.reset()
        self._retake.clear()
        for before in state.get("in_flight", []):  # absent in snapshots written before it was kept
            self.restore_cursor(before)
            rows, ids = self.take_prompts()
            self._retake.append((before, rows, ids))
        self.restore_cursor({k: v for k, v in state.items() if k != "in_flight"})

    def reset(self) -> None:
        """Drops the rollouts in flight (after a restore or rollback: they used old weights); their steps
        are submitted again with the same prompts, and the data cursor stays where it is."""
        for item in self._queue:
            if item[3] is not None:  # submitted: let the engines finish, their calls are ordered before the push
                self.rollouts.collect(item[3])
        self._retake.extendleft((before, rows, ids) for _, rows, ids, _, _, before in reversed(self._queue))
        self._queue.clear()
        self._next_step = None

    @property
    def in_flight(self) -> int:
        """Returns how many later steps' rollouts are taken (submitted, or kept without overlap) and not consumed."""
        return len(self._queue)
