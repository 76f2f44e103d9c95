"""Where a run's time goes before its first step and after its last: the ``startup/*`` seconds of ``rlray train``'s
JSON summary (``benchmarks/startup.py`` prints them as a table).

Three kinds of timestamps (wall-clock ``time.time()`` seconds, comparable between the processes of one node):

- the driver's phases, in order (``StartupClock``: checks, Ray, MLflow, the actors, the learner group, shutdown),
- each actor's own start (``ActorTimes``: its process's creation, the start and end of its ``__init__``: imports
  before, model or engine load within),
- the learner's (``LearnerTimes``, kept by the monitor actor): rank 0's start, and each recorded step's end with its
  ``timing/step_s`` and ``timing/rollout_s``.

``startup_summary`` turns them into the flat ``startup/<phase>_s`` figures. Nothing here imports torch or Ray (the
monitor actor's process imports this module).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

KEY_PREFIX = "startup/"


def process_start_time(pid: int | None = None) -> float:
    """Returns when process ``pid`` (this one by default) was created, in ``time.time()`` seconds."""
    return psutil.Process(pid or os.getpid()).create_time()


@dataclass
class ActorTimes:
    """One actor's start as the actor saw it (``time.time()`` seconds).

    Attributes:
        process_start: its process's creation (a Ray worker may be created before the actor was asked for).
        init_start: the start of the actor's ``__init__`` (its module and every import above it are loaded by then).
        init_end: the end of ``__init__`` (the model or engine is loaded); None while it runs.
    """

    process_start: float
    init_start: float
    init_end: float | None = None

    @classmethod
    def begin(cls) -> ActorTimes:
        """Returns the times of an ``__init__`` that starts now, in this process."""
        return cls(process_start_time(), time.time())

    def end(self) -> ActorTimes:
        """Stamps the end of ``__init__``; returns self."""
        self.init_end = time.time()
        return self


@dataclass
class LearnerTimes:
    """The learner's timestamps as the monitor recorded them (``time.time()`` seconds).

    Attributes:
        started: when learner rank 0 first counted its start (before it loads the model); None before.
        steps: each recorded step's (end time, ``timing/step_s``, ``timing/rollout_s``), in order; a missing figure
            is NaN.
    """

    started: float | None = None
    steps: list[tuple[float, float, float]] = field(default_factory=list)

    def learner_started(self) -> None:
        """Stamps rank 0's first start (a restart keeps the first)."""
        if self.started is None:
            self.started = time.time()

    def step_recorded(self, metrics: dict[str, float]) -> None:
        """Stamps a recorded step's end with its step and rollout wall times (``timing/step_s``, ``timing/rollout_s``)."""
        nan = float("nan")
        self.steps.append((time.time(), float(metrics.get("timing/step_s", nan)), float(metrics.get("timing/rollout_s", nan))))


@dataclass
class Launched:
    """An actor asked for and not yet waited on (``rlray.launch.actors.wait_started`` waits on many together).

    Attributes:
        name: its short name in the ``startup/*`` figures (``rollout-0``, ``reference-0``, ``env-0``, ``monitor``).
        handle: the Ray actor handle.
        ready: the object ref that resolves once it has started (its ``ready``, ``ping`` or ``serve`` call).
        launched_at: when it was asked for (``time.time()`` seconds).
        keeps_times: whether it answers ``startup_times()`` with its ``ActorTimes``.
    """

    name: str
    handle: Any
    ready: Any
    launched_at: float
    keeps_times: bool = True


class StartupClock:
    """The driver's phases: ``with clock.phase("ray"): ...`` records the block's start and end under its name.

    Args:
        origin: the run's time zero (``time.time()`` seconds); by default now (``run_training``'s start: the
            driver's own imports before it are outside, ``benchmarks/startup.py`` counts them from its wall time).
    """

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.time() if origin is None else origin
        self.phases: dict[str, tuple[float, float]] = {}
        self.stamps: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Records the wall time of the block as phase ``name`` (also when it raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.phases[name] = (start, time.time())

    def stamp(self, name: str) -> float:
        """Records the moment ``name`` happened; returns it."""
        self.stamps[name] = now = time.time()
        return now


def startup_summary(clock: StartupClock, actors: dict[str, tuple[float, float, ActorTimes | None]],
                    learner: LearnerTimes | None, end: float) -> dict[str, float]:
    """Returns the ``startup/<phase>_s`` seconds of a run, rounded to 10 ms.

    Args:
        clock: the driver's phases and stamps. Phases become ``startup/<name>_s``; the stamps ``fit_start`` and
            ``fit_end`` (around Ray Train's ``fit``) place the learner's times.
        actors: per actor name (``rollout-0``, ``monitor``, ...): (launch time, ready time on the driver, the actor's
            own ``ActorTimes`` or None when it keeps none). Each gives ``startup/<name>_s`` (launch to ready) and,
            with ``ActorTimes``, ``<name>_imports_s`` (launch, or its process's creation when later, to ``__init__``)
            and ``<name>_load_s`` (``__init__``).
        learner: the monitor's ``LearnerTimes`` (None without a monitor): ``learner_start_s`` (``fit`` to rank 0's
            start: Ray Train's controller, the worker processes, their imports), ``learner_load_s`` (rank 0's start
            to the first step's start: model, optimizer, data), ``first_step_s``, ``first_rollout_s``,
            ``to_first_step_s`` (time zero to the end of the first step), ``after_last_step_s`` (the last recorded
            step to ``fit``'s return: its snapshot, the learner's finish, Ray Train's teardown).
        end: the end of the run on the driver; ``shutdown_s`` is ``fit``'s return to it, ``total_s`` time zero to it.
    """
    out: dict[str, float] = {}
    for name, (start, stop) in clock.phases.items():
        out[name] = stop - start
    for name, (launched, ready, own) in actors.items():
        out[name] = ready - launched
        if own is not None and own.init_end is not None:
            out[f"{name}_imports"] = own.init_start - max(launched, own.process_start)
            out[f"{name}_load"] = own.init_end - own.init_start
    fit_start, fit_end = clock.stamps.get("fit_start"), clock.stamps.get("fit_end")
    if learner is not None and learner.started is not None and fit_start is not None:
        out["learner_start"] = learner.started - fit_start
        if learner.steps:
            first_end, first_step, first_rollout = learner.steps[0]
            out["learner_load"] = first_end - first_step - learner.started
            out["first_step"] = first_step
            out["first_rollout"] = first_rollout
            out["to_first_step"] = first_end - clock.origin
            if fit_end is not None:
                out["after_last_step"] = fit_end - learner.steps[-1][0]
    if fit_end is not None:
        out["shutdown"] = end - fit_end
    out["total"] = end - clock.origin
    return {f"{KEY_PREFIX}{k}_s": round(v, 2) for k, v in out.items() if v == v}  # NaN: a figure the step did not log
