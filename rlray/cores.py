"""CPU core lists ("0-1", "1", "0,2-3") and pinning a whole process to them (Linux).

The rollout engine (``resources.rollout.cpu_threads``) and the learner (``learner.cpu_affinity``)
use this to keep to their own cores on a CPU machine, so that in async mode the rollout and the
update do not preempt each other. ``os.sched_setaffinity(0, ...)`` pins only the calling thread on
Linux; ``pin_process`` pins every thread that exists now, and threads started later inherit the
mask of the thread that starts them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def parse_core_list(text: str) -> list[int]:
    """Returns the sorted core ids a core list such as "0-1", "1" or "0,2-3" names.

    Raises:
        ValueError: the list is malformed or names no core (names the value).
    """
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"core list {text!r} is malformed; use e.g. '0-1', '1' or '0,2-3'") from None
    if not cores:
        raise ValueError(f"core list {text!r} names no cores; use e.g. '0-1'")
    return sorted(cores)


def pin_process(cores: list[int]) -> list[int]:
    """Pins every thread of this process to ``cores``; returns the cores applied (empty when nothing changed).

    Cores this machine does not have (another node's numbering) are dropped. When none is left, or
    the kernel refuses the mask (a container's cpuset without them), nothing changes (logged). Off
    Linux (no ``os.sched_setaffinity``) nothing changes either.
    """
    if not hasattr(os, "sched_setaffinity"):
        return []
    mask = sorted(set(cores) & set(range(os.cpu_count() or 1)))
    if not mask:
        log.warning("cores %s do not exist on this machine (%s cores); not pinning", cores, os.cpu_count())
        return []
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile, or is not ours to move
            continue
        except OSError as err:  # EINVAL: no core of the mask is allowed here (cpuset)
            log.warning("cannot pin to cores %s (%s); not pinning", mask, err)
            return []
    return mask


def _thread_ids() -> list[int]:
    """Returns the kernel ids of this process's threads (the calling thread first)."""
    try:
        others = [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no procfs: the calling thread only
        others = []
    return [0, *others]
