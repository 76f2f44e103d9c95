"""The start-up record (rlray.observe.startup): the phases of a run from hand-placed timestamps, and that the light
processes (the monitor and run-control actors, Ray Train's controller) import no torch."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlray.observe.startup import ActorTimes, LearnerTimes, StartupClock, process_start_time, startup_summary

REPO = Path(__file__).resolve().parents[2]


def test_summary_places_every_phase_from_its_timestamps():
    clock = StartupClock(origin=100.0)
    clock.phases = {"checks": (100.5, 102.0), "ray": (102.0, 105.0), "actors": (106.0, 130.0)}
    clock.stamps = {"fit_start": 130.0, "fit_end": 160.0}
    actors = {
        "monitor": (106.0, 108.0, ActorTimes(process_start=90.0, init_start=107.5, init_end=107.75)),
        # a worker process created after the actor was asked for: imports count from its creation
        "rollout-0": (106.0, 129.0, ActorTimes(process_start=107.0, init_start=115.0, init_end=128.5)),
        "env-0": (106.0, 110.0, None),
    }
    learner = LearnerTimes(started=140.0, steps=[(150.0, 4.0, 3.0), (152.0, 1.5, 1.0)])
    out = startup_summary(clock, actors, learner, end=165.0)
    assert out == {
        "startup/checks_s": 1.5, "startup/ray_s": 3.0, "startup/actors_s": 24.0,
        "startup/monitor_s": 2.0, "startup/monitor_imports_s": 1.5, "startup/monitor_load_s": 0.25,
        "startup/rollout-0_s": 23.0, "startup/rollout-0_imports_s": 8.0, "startup/rollout-0_load_s": 13.5,
        "startup/env-0_s": 4.0,
        "startup/learner_start_s": 10.0,
        "startup/learner_load_s": 6.0,  # the first step started at 150 - 4 = 146
        "startup/first_step_s": 4.0, "startup/first_rollout_s": 3.0,
        "startup/to_first_step_s": 50.0,
        "startup/after_last_step_s": 8.0,
        "startup/shutdown_s": 5.0,
        "startup/total_s": 65.0,
    }


def test_summary_of_a_run_that_never_stepped_has_no_step_figures():
    clock = StartupClock(origin=0.0)
    clock.phases = {"checks": (0.0, 1.0)}
    clock.stamps = {"fit_start": 2.0, "fit_end": 3.0}
    out = startup_summary(clock, {}, LearnerTimes(started=2.5), end=4.0)
    assert out == {"startup/checks_s": 1.0, "startup/learner_start_s": 0.5, "startup/shutdown_s": 1.0,
                   "startup/total_s": 4.0}


def test_learner_times_keep_the_first_start_and_each_step():
    times = LearnerTimes()
    times.learner_started()
    first = times.started
    times.learner_started()  # a restart keeps the first start
    assert times.started == first
    times.step_recorded({"timing/step_s": 2.5, "timing/rollout_s": 1.25})
    times.step_recorded({"timing/step_s": 1.0})  # a step that did not time its rollout
    assert [(s, r) for _, s, r in times.steps[:1]] == [(2.5, 1.25)]
    assert times.steps[1][1] == 1.0 and math.isnan(times.steps[1][2])
    assert times.steps[0][0] <= times.steps[1][0]
    clock = StartupClock(origin=0.0)
    clock.stamps = {"fit_start": 0.5}
    out = startup_summary(clock, {}, LearnerTimes(started=1.0, steps=[(5.0, 2.0, float("nan"))]), end=6.0)
    assert "startup/first_rollout_s" not in out and out["startup/first_step_s"] == 2.0


def test_actor_times_and_process_start():
    times = ActorTimes.begin()
    assert times.process_start == pytest.approx(process_start_time(os.getpid()))
    assert times.process_start <= times.init_start and times.init_end is None
    assert times.end().init_end >= times.init_start


@pytest.mark.parametrize("module", ["rlray.launch.monitor_actor", "rlray.run.hooks", "rlray.observe.startup",
                                    "rlray.run.state", "rlray.launch.engine_actors"])
def test_light_actor_modules_import_no_torch(module):
    """Issue 39: Ray imports an actor's module in its process; the monitor's and run control's stay off torch (and
    the monitor's off MLflow, loaded at its first alert) -- 3-7 s of CPU each at every run's start. Ray Train's
    controller unpickles the learner's ``WorkerArgs`` (rlray.run.state) with the engine actors' handles in it (their
    class's module, rlray.launch.engine_actors): before, that cost it ~6 s of imports before the learner could start."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'mlflow', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"


def test_start_watch_stops_the_main_thread_with_the_actors_start_error(monkeypatch):
    """An actor that fails to start while the main thread waits in fit (here: a sleep) stops it at once, and the
    actor's own error is what the caller raises (as the blocking wait before the learner started did)."""
    import time

    from rlray.launch import actors

    def fail(launched):
        time.sleep(0.2)
        raise ValueError("rlray: engine failed to start")

    monkeypatch.setattr(actors, "wait_started", fail)
    watch = actors.StartWatch().watch([])
    began = time.monotonic()
    with pytest.raises(ValueError, match="engine failed to start"):
        try:
            try:
                time.sleep(30)  # fit
            finally:
                watch.disarm()
                watch.raise_failure()
        except KeyboardInterrupt:  # the driver's own handler: the start error, not a KeyboardInterrupt
            raise watch.error from None
    assert time.monotonic() - began < 10


def test_start_watch_after_the_guarded_block_never_interrupts(monkeypatch):
    import time

    from rlray.launch import actors

    def slow_fail(launched):
        time.sleep(0.3)
        raise ValueError("killed at shutdown")

    def ok(launched):
        return {"rollout-0": (1.0, 2.0, None)}

    monkeypatch.setattr(actors, "wait_started", slow_fail)
    watch = actors.StartWatch().watch([])
    watch.disarm()  # fit ended first (it failed on its own): the actors are killed, their wait fails later
    time.sleep(0.6)  # no KeyboardInterrupt arrives
    assert isinstance(watch.error, ValueError) and not watch.interrupted
    watch.raise_failure()  # returns: the run's own error stands
    monkeypatch.setattr(actors, "wait_started", ok)
    watch = actors.StartWatch().watch([])
    watch.disarm(timeout_s=5)
    assert watch.started == {"rollout-0": (1.0, 2.0, None)} and watch.error is None


def test_start_watch_runs_in_the_background_where_sigint_is_ignored(monkeypatch):
    """A run started in the background by a shell script (``cmd &``) ignores SIGINT: the watch still waits in the
    background and stops the main thread with its own signal (issue 39: with SIGINT the learner group waited there for
    every engine), and ``disarm`` puts the signal's handler back."""
    import signal
    import time

    from rlray.launch import actors

    def fail(launched):
        time.sleep(0.2)
        raise ValueError("engine failed")

    monkeypatch.setattr(actors, "wait_started", fail)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        watch = actors.StartWatch().watch([])
        assert watch.thread is not None and signal.getsignal(actors.WAKE_SIGNAL) is actors._start_failed
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            time.sleep(30)  # fit
        assert time.monotonic() - began < 10 and watch.interrupted and str(watch.error) == "engine failed"
        watch.disarm()
        assert signal.getsignal(actors.WAKE_SIGNAL) == signal.SIG_DFL
        with pytest.raises(ValueError, match="engine failed"):
            watch.raise_failure()
    finally:
        signal.signal(signal.SIGINT, before)


def test_start_watch_waits_on_the_callers_thread_where_its_signal_is_taken(monkeypatch):
    """A program with its own handler for the watch's signal keeps it: the wait runs before the caller goes on, and an
    actor's start error is raised from ``watch`` itself."""
    import signal

    from rlray.launch import actors

    def mine(signum, frame):
        return None

    monkeypatch.setattr(actors, "wait_started", lambda launched: (_ for _ in ()).throw(ValueError("engine failed")))
    before = signal.signal(actors.WAKE_SIGNAL, mine)
    try:
        with pytest.raises(ValueError, match="engine failed"):
            actors.StartWatch().watch([])
        monkeypatch.setattr(actors, "wait_started", lambda launched: {"rollout-0": (1.0, 2.0, None)})
        watch = actors.StartWatch().watch([])
        assert watch.thread is None and watch.started == {"rollout-0": (1.0, 2.0, None)}
        watch.disarm()
        assert signal.getsignal(actors.WAKE_SIGNAL) is mine
    finally:
        signal.signal(actors.WAKE_SIGNAL, before)


def test_the_monitors_mlflow_client_is_built_on_first_use_or_after_the_first_step(monkeypatch):
    """Issue 39: MLflow's import stays out of the run's start; an alert before the first step builds it then."""
    import threading

    from rlray.launch import monitor_actor
    from rlray.observe import tracking

    built: list[tuple] = []
    release = threading.Event()

    class FakeTracker:
        def __init__(self, uri, experiment, run_id=None):
            release.wait(10)
            built.append((uri, experiment, run_id, threading.current_thread().name))

    monkeypatch.setattr(tracking, "Tracker", FakeTracker)
    release.set()
    lazy = monitor_actor.LazyTracker("sqlite:///m.db", "exp", "r1")
    assert lazy.warming is None and built == []  # nothing at the actor's start
    assert isinstance(lazy.get(), FakeTracker) and lazy.get() is lazy.get()  # first use builds it, once
    assert built == [("sqlite:///m.db", "exp", "r1", "MainThread")]
    lazy.warm()  # already built: no thread
    assert lazy.warming is None

    release.clear()
    later = monitor_actor.LazyTracker("sqlite:///m.db", "exp", "r2")
    later.warm()  # after the first step: built in the background ...
    later.warm()  # ... once
    first = later.warming
    assert first is not None and first.name == "rlray-monitor-mlflow"
    release.set()
    first.join(10)
    assert later.get() is later.tracker and built[-1] == ("sqlite:///m.db", "exp", "r2", "rlray-monitor-mlflow")
    assert len(built) == 2
