"""A deadline per learner collective (``watchdog.collective_s``): who is stuck, in which collective, and who never came.

``WatchedCollective`` wraps a rank's ``Collective``. Each collective it forwards is numbered (every rank calls the
same collectives in the same order, so the numbers line up across ranks) and noted in one attribute (number, op,
caller, the stage of the ``timed`` scope, entry time): a few microseconds a call, no extra remote call. A daemon
thread (``start``) polls that note every ``poll_s`` seconds and

1. publishes this rank's note (collective number, inside or not, pid, node) to the learner group's
   ``torch.distributed`` key-value store when it changed (one small write a second at most, off the step's thread);
2. finds a collective inside a ``timed`` scope that this rank has waited in for longer than the deadline, and reports
   it once: an ``rlray: hang`` line and the ``hang`` alert (``report``: rank 0's alert path, the others' through the
   monitor) naming the rank, the op, the caller, the stage, the ranks behind (the ranks whose published number is
   lower: they have not entered this collective) and the stacks: this rank's own (``hangs.own_stacks``) and, from the
   lowest rank waiting, each rank behind's, taken from that process through the SIGUSR2 dump (``hangs.dump_stacks``
   on this node, ``hangs.process_stacks`` on another; every watched rank calls ``hangs.enable_stack_dumps``);
3. runs ``on_expiry`` (the session's ``hang_action``: under Ray Train the rank exits, so that Ray Train restarts the
   group from the newest snapshot, or under ``watchdog.on_hang=stop`` the run ends FAILED at it).

Only collectives inside a ``timed`` scope have the deadline: the ones that follow work every rank does alike (the
learner's stages 5-6 of an online step, the offline update). A collective that waits on rank 0's own work (its
rollouts and rewards, its snapshot writes, evaluation, the reference calls' agreement) stays under the step's
deadline (``watchdog.learner_step_s``, ``hangs.StepDeadline``), which already covers it. The model's own collectives
(DDP's gradient all-reduce, FSDP's gathers) do not pass through here: the step's deadline covers them too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlray import hangs
from rlray.learner.collective import Collective

log = logging.getLogger(__name__)

STORE_PREFIX = "rlray/collective/"  # + rank: that rank's published note (JSON) in the learner group's store


@dataclass(frozen=True)
class Entry:
    """The collective a rank is in (or last entered).

    Attributes:
        seq: 1-based number of the collective among those this rank called.
        op: the method ("all_reduce_sum", "all_gather", ...).
        caller: the function that called it, with file and line ("update (objective.py:88)").
        stage: the ``timed`` scope's label ("stage 6 (update) of step 3"), or None outside one (no deadline).
        since: ``time.monotonic()`` when the rank entered it.
    """

    seq: int
    op: str
    caller: str
    stage: str | None
    since: float


class WatchedCollective(Collective):
    """``inner``'s collectives, each numbered and, inside a ``timed`` scope, under a deadline (module docstring).

    Args:
        inner: the rank's collectives (``RayTrainCollective``, or a ``Collective`` over a process group in tests).
        deadline_s: seconds a rank may wait in one collective inside a ``timed`` scope (``watchdog.collective_s``).
        stacks_timeout_s: seconds to wait for another rank's stacks (``watchdog.stacks_timeout_s``).
        store: the learner group's key-value store (``set``, ``get``, ``check``); None: the ``torch.distributed``
            default group's, when one is initialised (else the ranks behind cannot be named).
        poll_s: how often the watcher thread looks, seconds; None: min(1, deadline_s / 4).

    Attributes:
        reports: collectives reported past their deadline on this rank.
        last_report: the latest report's text (headline and stacks), or "".
    """

    def __init__(self, inner: Collective, deadline_s: float, *, stacks_timeout_s: float = 10.0, store: Any = None,
                 poll_s: float | None = None) -> None:
        self.inner, self.rank, self.world = inner, inner.rank, inner.world
        self.deadline_s, self.stacks_timeout_s = deadline_s, stacks_timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, deadline_s / 4)
        self._store = store
        self.seq = 0
        self.now: Entry | None = None  # the collective this rank is in; None between collectives
        self._stage: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._node = ""
        self.reports = 0
        self.last_report = ""

    # ---------------------------------------------------------------- the collectives (the step's thread)
    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Puts the collectives called inside under the deadline, labelled ``stage`` in a report."""
        outer, self._stage = self._stage, stage
        try:
            yield
        finally:
            self._stage = outer

    def _enter(self, op: str) -> None:
        frame = sys._getframe(2)  # the caller of the collective method
        code = frame.f_code
        self.seq += 1
        self.now = Entry(self.seq, op, f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})",
                         self._stage, time.monotonic())

    def broadcast(self, obj: Any) -> Any:
        """Returns rank 0's ``obj`` on every rank (``Collective.broadcast``), numbered and watched."""
        self._enter("broadcast")
        try:
            return self.inner.broadcast(obj)
        finally:
            self.now = None

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Returns the element-wise sum over ranks (``Collective.all_reduce_sum``), numbered and watched."""
        self._enter("all_reduce_sum")
        try:
            return self.inner.all_reduce_sum(values)
        finally:
            self.now = None

    def all_reduce_max(self, values: dict[str, float]) -> dict[str, float]:
        """Returns the element-wise max over ranks (``Collective.all_reduce_max``), numbered and watched."""
        self._enter("all_reduce_max")
        try:
            return self.inner.all_reduce_max(values)
        finally:
            self.now = None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns every rank's ``tensor`` concatenated along dim 0 (``Collective.all_gather``), numbered and watched."""
        self._enter("all_gather")
        try:
            return self.inner.all_gather(tensor)
        finally:
            self.now = None

    def barrier(self) -> None:
        """Waits until every rank has reached this call (``Collective.barrier``), numbered and watched."""
        self._enter("barrier")
        try:
            self.inner.barrier()
        finally:
            self.now = None

    # ---------------------------------------------------------------- the watcher thread
    def start(self, report: Callable[[str], None], on_expiry: hangs.HangAction | None = None) -> WatchedCollective:
        """Starts the watcher thread (idempotent); ``report`` sends a report (the alert; the log line is written here),
        ``on_expiry`` runs after it with the report's headline (None: nothing). Returns self."""
        if self._thread is None:
            hangs.enable_stack_dumps()  # the lowest waiting rank of a hang takes this rank's stacks from here
            self._node = _node_id()
            self._thread = threading.Thread(target=self._watch, args=(report, on_expiry), daemon=True,
                                            name=f"rlray:collective-watch-{self.rank}")
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the watcher thread (the run ends)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _watch(self, report: Callable[[str], None], on_expiry: hangs.HangAction | None) -> None:
        published, reported = None, 0
        while not self._stop.wait(self.poll_s):
            entry = self.now
            note = (entry.seq, True) if entry is not None else (self.seq, False)
            if note != published:
                self._publish(*note)
                published = note
            if entry is None or entry.stage is None or entry.seq == reported:
                continue
            waited = time.monotonic() - entry.since
            if waited > self.deadline_s and self.now is entry:
                reported = entry.seq
                self._report(entry, waited, report, on_expiry)

    def _report(self, entry: Entry, waited_s: float, report: Callable[[str], None],
                on_expiry: hangs.HangAction | None) -> None:
        self.reports += 1
        notes = {r: self._peer(r) for r in range(self.world) if r != self.rank}
        behind = {r: n for r, n in notes.items() if n is not None and n["seq"] < entry.seq}
        waiting = [self.rank] + [r for r, n in notes.items() if n is not None and n["seq"] == entry.seq and n["in"]]
        unknown = sorted(r for r, n in notes.items() if n is None)
        then = f"; {on_expiry.says}" if on_expiry is not None else ""
        names = ", ".join(f"{r} (last entered collective {n['seq']})" for r, n in sorted(behind.items()))
        head = (f"hang: learner rank {self.rank} (pid {os.getpid()}) has waited in {entry.op} (collective {entry.seq}, "
                f"called from {entry.caller}, {entry.stage}) for {waited_s:.1f} s, past watchdog.collective_s="
                f"{self.deadline_s:g} s; ranks behind: {names or 'none known'}"
                + (f"; no note from ranks {unknown}" if unknown else "") + then)
        parts = [f"{head}\nstacks of pid {os.getpid()} (learner rank {self.rank}):\n{hangs.own_stacks().rstrip()}"]
        for r, n in sorted(behind.items()):
            if self.rank == min(waiting):
                stacks = self._peer_stacks(r, n)
            else:
                stacks = f"(taken by learner rank {min(waiting)}, the lowest rank waiting, in its report)"
            parts.append(f"stacks of learner rank {r} (pid {n['pid']}), which has not entered collective {entry.seq}:"
                         f"\n{stacks.rstrip()}")
        text = "\n".join(parts)
        self.last_report = text
        log.error("rlray: %s", text)
        try:
            report(_alert_text(head, parts[1:], parts[0]))
        except Exception as err:  # noqa: BLE001 - the action must run
            log.error("hang alert failed: %s: %s", type(err).__name__, err)
        if on_expiry is not None:
            on_expiry.run(head)

    def _peer_stacks(self, rank: int, note: dict[str, Any]) -> str:
        where = hangs.ActorProcess(f"rlray:learner-{rank}", int(note["pid"]), str(note["node"]))
        if where.node_id in ("", self._node):
            return hangs.dump_stacks(where.pid, self.stacks_timeout_s)
        return hangs.process_stacks(where, self.stacks_timeout_s)

    # ---------------------------------------------------------------- the store
    def _kv(self) -> Any:
        if self._store is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def _publish(self, seq: int, inside: bool) -> None:
        store = self._kv()
        if store is None:
            return
        note = {"seq": seq, "in": inside, "pid": os.getpid(), "node": self._node}
        try:
            store.set(f"{STORE_PREFIX}{self.rank}", json.dumps(note))
        except Exception as err:  # noqa: BLE001 - a note lost is a rank unnamed, never a failed step
            log.debug("could not publish the collective note: %s", err)

    def _peer(self, rank: int) -> dict[str, Any] | None:
        store, key = self._kv(), f"{STORE_PREFIX}{rank}"
        try:
            if store is None or not store.check([key]):
                return None
            return json.loads(store.get(key))
        except Exception as err:  # noqa: BLE001 - the report goes on without that rank's note
            log.debug("could not read rank %d's collective note: %s", rank, err)
            return None


def _alert_text(head: str, behind: list[str], own: str) -> str:
    """Returns the alert's text: the headline, then the ranks behind's stacks (where the hang is), then this rank's,
    cut to ``hangs.ALERT_STACK_CHARS`` characters of stacks (innermost frames first: faulthandler's order)."""
    body = "\n".join([*behind, own.partition("\n")[2]])
    return f"{head}\n{body[:hangs.ALERT_STACK_CHARS]}"


def _node_id() -> str:
    """Returns this process's Ray node id (hex), or "" outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - unknown: stacks are then taken from this node
        return ""


def watch(coll: Collective, deadline_s: float, stacks_timeout_s: float) -> Collective:
    """Returns ``coll`` wrapped in a ``WatchedCollective`` when several ranks share a finite deadline, else ``coll``."""
    if coll.world <= 1 or deadline_s == float("inf"):
        return coll
    return WatchedCollective(coll, deadline_s, stacks_timeout_s=stacks_timeout_s)
