"""rlray.cores: core lists ("0-1", "1", "0,2-3") and pinning every thread of this process to cores."""

from __future__ import annotations

import os
import threading

import pytest

from rlray.cores import parse_core_list, pin_process

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("1", [1]),
        ("0-1", [0, 1]),
        ("0,2-3", [0, 2, 3]),
        ("5-7,1", [1, 5, 6, 7]),  # sorted
        ("2-3,3,1-2", [1, 2, 3]),  # overlaps counted once
        (" 4 , 0 ", [0, 4]),  # spaces around parts
        ("3-3", [3]),
    ],
)
def test_parse_core_list(text, cores):
    assert parse_core_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "0,,1", "-1", "1-x", "0;1", "1.5"])
def test_parse_core_list_malformed_names_the_value(text):
    with pytest.raises(ValueError, match=f"core list {text!r} is malformed"):
        parse_core_list(text)


def test_parse_core_list_empty_range_names_no_cores():
    with pytest.raises(ValueError, match="core list '3-1' names no cores"):  # range(3, 2) is empty
        parse_core_list("3-1")


def _thread_affinities() -> dict[int, set[int]]:
    """Returns {kernel thread id: its CPU affinity} for every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return out


def _restore(cores: set[int]) -> None:
    for tid in _thread_affinities():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            continue


@needs_affinity
def test_pin_process_pins_every_thread():
    original = os.sched_getaffinity(0)
    core = max(original & set(range(os.cpu_count() or 1)))
    stop = threading.Event()
    before = threading.Thread(target=stop.wait, daemon=True)  # started before pinning: must be moved too
    before.start()
    try:
        assert pin_process([core]) == [core]
        assert os.sched_getaffinity(0) == {core}
        assert os.sched_getaffinity(before.native_id) == {core}
        affinities = _thread_affinities()
        assert before.native_id in affinities and len(affinities) >= 2
        assert {tid: a for tid, a in affinities.items() if a != {core}} == {}
        seen = []
        after = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))  # inherits the pinned mask
        after.start()
        after.join()
        assert seen == [{core}]
    finally:
        stop.set()
        before.join()
        _restore(original)
    assert os.sched_getaffinity(0) == original


@needs_affinity
def test_pin_process_drops_cores_the_machine_lacks():
    original = os.sched_getaffinity(0)
    missing = (os.cpu_count() or 1) + 7
    core = min(original & set(range(os.cpu_count() or 1)))
    try:
        assert pin_process([missing]) == []  # nothing left: nothing changes
        assert os.sched_getaffinity(0) == original
        assert pin_process([missing, core]) == [core]
        assert os.sched_getaffinity(0) == {core}
    finally:
        _restore(original)
