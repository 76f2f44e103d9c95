"""The deadline per learner collective (``rlray.run.collective_watch``): two real gloo ranks, one never arrives."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from rlray.learner.collective import Collective
from rlray.run.collective_watch import WatchedCollective, watch

FIXTURE = Path(__file__).parents[1] / "fixtures" / "collective_ranks.py"


def test_a_rank_that_never_reaches_an_all_reduce_is_named_with_its_stack_within_the_deadline(tmp_path):
    deadline_s = 2.0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, str(FIXTURE), str(r), str(tmp_path), str(tmp_path), str(deadline_s)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], outputs
    report = (tmp_path / "report.txt").read_text()
    seconds = float((tmp_path / "seconds.txt").read_text())
    assert deadline_s < seconds < deadline_s + 5.0  # reported within the deadline plus a few seconds
    head, _, stacks = report.partition("\n")
    pid0, pid1 = ranks[0].pid, ranks[1].pid
    assert head.startswith(f"hang: learner rank 0 (pid {pid0}) has waited in all_reduce_sum (collective 2, called from "
                           "main (collective_ranks.py:")
    assert head.endswith(f"stage 6 (update) of step 3) for {head.split(' for ')[1].split(' s,')[0]} s, past "
                         "watchdog.collective_s=2 s; ranks behind: 1 (last entered collective 1); exiting the rank "
                         "(Ray Train restarts the group)")
    # the missing rank's stack, taken from its own process through SIGUSR2, comes first: it shows where rank 1 is
    assert stacks.startswith(f"stacks of learner rank 1 (pid {pid1}), which has not entered collective 2:\n")
    missing = stacks.split("stacks of pid")[0]
    assert "in never_arrives" in missing and "collective_ranks.py" in missing
    own = stacks.split(f"stacks of pid {pid0} (learner rank 0):")[1] if "stacks of pid" in stacks else stacks
    assert "in all_reduce_sum" in report and "in main" in own
    assert "rlray: hang: learner rank 0" in outputs[0]  # the log line, with both ranks' stacks
    assert (tmp_path / "done-0").read_text() == "1" and (tmp_path / "done-1").read_text() == "0"
    count, _, action_head = (tmp_path / "expired-0").read_text().partition("\n")
    assert count == "1" and action_head == head and not (tmp_path / "expired-1").exists()  # once, after it, the headline


class Counting(Collective):
    """World-2 stand-in that returns at once (no process group)."""

    world = 2


def test_collectives_are_numbered_and_a_timed_one_that_returns_in_time_is_never_reported():
    coll = WatchedCollective(Counting(), 0.3, poll_s=0.05, store=None)
    reports = []
    coll.start(reports.append)
    coll.barrier()
    with coll.timed("stage 5 (advantages) of step 1"):
        assert coll.all_reduce_sum({"a": 1.0}) == {"a": 1.0}
        assert torch.equal(coll.all_gather(torch.ones(2)), torch.ones(2))
    time.sleep(0.5)
    coll.stop()
    assert coll.seq == 3 and coll.now is None and reports == [] and coll.reports == 0


def test_one_rank_or_no_deadline_is_not_wrapped():
    one = Collective()
    assert watch(one, 5.0, 1.0) is one
    two = Counting()
    assert watch(two, float("inf"), 1.0) is two
    assert isinstance(watch(two, 5.0, 1.0), WatchedCollective)


class CountingStore:
    """A key-value store that records which thread called it."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def set(self, key: str, value: str) -> None:
        self.threads.append(threading.get_ident())

    def check(self, keys: list[str]) -> bool:
        self.threads.append(threading.get_ident())
        return False

    def get(self, key: str) -> bytes:
        raise AssertionError("no peer is read while nothing is late")


def test_the_steps_thread_never_touches_the_store_and_the_watcher_publishes_only_changes():
    # the cost on the step's path is a counter and a frame lookup (measured ~1.4 us a collective, docs/operations.md):
    # no store call, no remote call, however many collectives run; the watcher thread publishes at most once a poll
    store = CountingStore()
    coll = WatchedCollective(Counting(), 600.0, poll_s=0.05, store=store)
    coll.start(lambda message: None)
    with coll.timed("stage 6 (update) of step 1"):
        for _ in range(2000):
            coll.all_reduce_sum({"loss": 1.0})
    time.sleep(0.3)  # several polls with nothing new: no further write
    writes = len(store.threads)
    time.sleep(0.3)
    coll.stop()
    assert coll.seq == 2000
    assert threading.get_ident() not in store.threads
    assert 1 <= writes <= 2 and len(store.threads) == writes  # the last number once (and maybe one on the way), then none
