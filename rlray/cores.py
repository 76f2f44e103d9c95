"""CPU core lists ("0-1", "1", "0,2-3") and pinning a whole process to them (Linux).

The rollout engine (``resources.rollout.cpu_threads``) and the learner (``learner.cpu_affinity``)
use this to keep to their own cores on a CPU machine, so that in async mode the rollout and the
update do not preempt each other. ``os.sched_setaffinity(0, ...)`` pins only the calling thread on
Linux; ``pin_process`` pins every thread that exists now, and threads started later inherit the
mask of the thread that starts them. ``plan_cores`` decides the default split of a machine's cores between the
rollout actors and the learner workers (``rlray.run.build.core_plan`` applies it to a config).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

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


def split_cores(count: int, cores: list[int]) -> list[str]:
    """Returns one core list per actor, splitting ``cores`` into ``count`` contiguous parts.

    With fewer cores than actors, actor i gets core ``cores[i % len(cores)]``.

    Example: ``split_cores(2, [0, 1])`` is ``["0", "1"]``; ``split_cores(1, [0, 1])`` is ``["0-1"]``.
    """
    if count <= len(cores):
        parts = [cores[len(cores) * i // count : len(cores) * (i + 1) // count] for i in range(count)]
    else:
        parts = [[cores[i % len(cores)]] for i in range(count)]
    return [_core_list(p) for p in parts]


def _core_list(cores: list[int]) -> str:
    """Returns "a-b" for a contiguous run of two or more cores, else "a,b,..."."""
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


SPLIT_MIN_CORES = 8  # async on CPU splits the cores between rollout and learner from this many cores on


@dataclass(frozen=True)
class CorePlan:
    """How the CPU roles of a run share one machine's cores when the config leaves it to rlray.

    Attributes:
        rollout: one core list per rollout actor (its vLLM CPU threads: their number and the cores they run on).
        learner_threads: torch intra-op threads per learner worker (and per reference/teacher actor).
        learner_cores: one core list per learner worker to pin it to, or None (not pinned).
        why: one line for the log: which rule chose this.
    """

    rollout: list[str]
    learner_threads: int
    learner_cores: list[str] | None
    why: str


def plan_cores(cores: list[int], *, rollout_actors: int, learner_workers: int, rollout_on_gpu: bool,
               learner_on_gpu: bool, overlap: bool) -> CorePlan:
    """Returns the default use of ``cores`` by the rollout actors and learner workers of a run on one machine.

    The rule follows when the stages compute:

    - **They take turns** (a synchronous run: ``rollout.max_staleness=0``), or one of them runs on GPUs: each
      stage gets every core while it runs. The rollout actors split the cores among themselves, the learner
      workers split them too (threads = cores // workers, at least 1), nothing is pinned. A split between the
      stages would leave half the cores idle in every stage.
    - **They overlap** (async, both on CPU) on ``SPLIT_MIN_CORES`` cores or more: the rollout actors get the last
      ``n // 2`` cores and the learner workers the others, each side pinned to its own, so they do not fight.
    - **They overlap on fewer cores**: shared as in a synchronous run. A split halves each stage's cores, and
      since CPU compute scales about linearly with cores at these sizes, max(rollout on n/2, update on n/2) is
      no shorter than rollout + update on n: the split only pays where scaling is sublinear (many cores). On
      2 cores (SmolLM2, `benchmarks/grpo_vs_trl.py`) the shared async step took 1.12x the sync step.

    Args:
        cores: the cores this machine gives the run (``os.sched_getaffinity(0)``), at least one.
        rollout_actors, learner_workers: how many of each role run on this machine (>= 1).
        rollout_on_gpu, learner_on_gpu: the role computes on GPUs (its CPU threads only feed them).
        overlap: the rollout of step t+1 runs while step t's update does (``rollout.max_staleness > 0``).

    Raises:
        ValueError: no cores, or a role count below 1.

    Example: 2 cores, 1 actor, 1 worker, sync or async: rollout ["0-1"], 2 learner threads, unpinned; 16 cores
    async: rollout ["8-15"], 8 learner threads pinned to ["0-7"].
    """
    if not cores or rollout_actors < 1 or learner_workers < 1:
        raise ValueError(f"plan_cores: cores={cores}, rollout_actors={rollout_actors}, learner_workers={learner_workers}")
    cores = sorted(cores)
    n = len(cores)
    if not overlap or rollout_on_gpu or learner_on_gpu or n < SPLIT_MIN_CORES:
        why = ("synchronous: the stages take turns, each on every core" if not overlap
               else "a stage on GPU: no CPU split" if (rollout_on_gpu or learner_on_gpu)
               else f"async on {n} < {SPLIT_MIN_CORES} cores: a split would slow each stage more than overlap saves")
        return CorePlan(split_cores(rollout_actors, cores), max(1, n // learner_workers), None, why)
    rollout_part = cores[n - max(1, n // 2):]
    learner_part = cores[: n - len(rollout_part)]
    learner_lists = split_cores(learner_workers, learner_part)
    threads = max(1, len(learner_part) // learner_workers)
    return CorePlan(split_cores(rollout_actors, rollout_part), threads, learner_lists,
                    "async on CPU: rollout and update overlap, each on its own cores")
