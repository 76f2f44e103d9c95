"""rlray.hangs without Ray: the stacks of a real stuck process (taken from it on its signal), the report and the
actions of ``HangWatch`` over fake stacks and restarts, and the pipeline keeping a step whose rollout hung."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlray import hangs
from rlray.hangs import ActorProcess, Hang, HangAction, HangError, HangWatch, StepDeadline
from rlray.rollout.pipeline import RolloutPipeline
from rlray.rollout.types import SamplingSpec

REPO = Path(__file__).resolve().parents[1]

STUCK = textwrap.dedent("""
    import sys, threading, time
    from rlray.hangs import enable_stack_dumps

    started = threading.Event()

    def injected_hang():
        print("ready", flush=True)
        time.sleep(600)

    def background_worker():
        started.set()
        time.sleep(600)

    enable_stack_dumps()
    threading.Thread(target=background_worker, daemon=True).start()
    started.wait()
    injected_hang()
""")  # "ready" comes from inside injected_hang, with the other thread in background_worker: the dump's frames are known


def _start(tmp_path: Path, source: str) -> subprocess.Popen:
    script = tmp_path / "stuck.py"
    script.write_text(source)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_the_stacks_come_from_the_stuck_process_and_name_the_sleeping_function(tmp_path):
    proc = _start(tmp_path, STUCK)
    try:
        assert hangs.catches_stack_signal(proc.pid)
        text = hangs.dump_stacks(proc.pid, timeout_s=10.0)
        # faulthandler's format: one block per thread, innermost frame first
        assert text.count("(most recent call first)") == 2
        script = tmp_path / "stuck.py"
        # the main thread (it took the signal: "Current thread") is in injected_hang (its print or its sleep, lines
        # 8-9), called from line 18; "ready" came from there, so a loaded machine cannot catch it earlier
        main = text[text.index("Current thread"):].split("\n\n")[0]
        assert re.search(rf'File "{re.escape(str(script))}", line [89] in injected_hang\n'
                         rf'  File "{re.escape(str(script))}", line 18 in <module>', main), main
        assert "in background_worker" in text  # every thread, not only the main one
        again = hangs.dump_stacks(proc.pid, timeout_s=10.0)  # a second report holds only the new dump
        assert again.count("(most recent call first)") == 2
        assert proc.poll() is None  # the signal does not end the process
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_did_not_enable_dumps_is_not_signalled(tmp_path):
    proc = _start(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    try:
        assert not hangs.catches_stack_signal(proc.pid)
        assert hangs.dump_stacks(proc.pid, timeout_s=1.0).startswith(f"(no stacks: process {proc.pid} does not write")
        time.sleep(0.2)
        assert proc.poll() is None  # SIGUSR2's default action would have ended it
    finally:
        proc.kill()
        proc.wait()


def test_enable_stack_dumps_registers_this_process_once(tmp_path):
    path = hangs.enable_stack_dumps()
    assert path == hangs.stack_file(os.getpid()) and hangs.enable_stack_dumps() == path
    assert hangs.catches_stack_signal(os.getpid())
    assert signal.SIGUSR2 == hangs.STACK_SIGNAL


FAKE_STACKS = 'Thread 0x01 (most recent call first):\n  File "env.py", line 9 in injected_hang\n'


class FakeActors:
    """The seams of HangWatch: stacks and restarts of fake actors, recorded."""

    def __init__(self) -> None:
        self.restarted: list[str] = []

    def stacks(self, actor: str, timeout_s: float) -> tuple[ActorProcess, str]:
        return ActorProcess(f"rlray:{actor}", 4242, "ab" * 28), FAKE_STACKS

    def restart(self, actor: str) -> None:
        self.restarted.append(actor)


def test_a_hang_is_reported_then_its_actor_restarted():
    fakes, alerts = FakeActors(), []
    watch = HangWatch("restart", engine_call_s=2.0, alert=alerts.append, stacks=fakes.stacks, restart=fakes.restart)
    hang = watch.hung("rollout-1", "rollout actor 1", "generate", 2.5, 2.0, "watchdog.engine_call_s")
    assert fakes.restarted == ["rollout-1"]
    assert (watch.hangs, watch.restarts, watch.last) == (1, 1, hang)
    assert watch.metrics() == {"run/hangs": 1.0, "run/hang_restarts": 1.0}
    assert hang.headline() == (
        "hang: rollout actor 1 (rlray:rollout-1) (pid 4242, node abababababab) has run generate for 2.5 s, past "
        "watchdog.engine_call_s=2 s; restarting it (Ray restarts the process; its work runs again elsewhere or after "
        "the restart)")
    assert alerts == [f"{hang.headline()}\nstacks of pid 4242:\n{FAKE_STACKS.rstrip()}"]


def test_under_stop_a_hang_is_reported_then_raised_and_nothing_restarted(caplog):
    fakes, alerts = FakeActors(), []
    watch = HangWatch("stop", alert=alerts.append, stacks=fakes.stacks, restart=fakes.restart)
    with pytest.raises(HangError, match=r"environment host 0 \(rlray:env-0\) .* has run step for 31\.0 s, past "
                                        r"watchdog\.env_call_s=30 s; stopping the run[\s\S]*in injected_hang"):
        watch.hung("env-0", "environment host 0", "step", 31.0, 30.0, "watchdog.env_call_s")
    assert fakes.restarted == [] and watch.hangs == 1 and watch.restarts == 0
    assert len(alerts) == 1 and "in injected_hang" in alerts[0]
    assert any(r.message.startswith("rlray: hang: environment host 0") for r in caplog.records)


def test_a_failing_alert_never_keeps_the_restart_from_running():
    fakes = FakeActors()

    def broken(message: str) -> None:
        raise ConnectionError("monitor away")

    HangWatch(alert=broken, stacks=fakes.stacks, restart=fakes.restart).hung("a", "actor", "f", 1.0, 0.5, "k")
    assert fakes.restarted == ["a"]


def test_an_alert_keeps_the_innermost_frames_within_its_size():
    stacks = "x" * 10_000 + "\n  File \"e.py\", line 1 in injected_hang\n"
    hang = Hang("who", "step", 3.0, 2.0, "watchdog.env_call_s", ActorProcess("", 7, ""), stacks, "stop")
    short = hang.message(hangs.ALERT_STACK_CHARS)
    assert short.endswith("in injected_hang") and len(short) < len(hang.headline()) + hangs.ALERT_STACK_CHARS + 40
    assert "(pid 7, node ?)" in hang.headline()


def test_an_unknown_action_is_refused():
    with pytest.raises(ValueError, match=r"action='kill'; use one of \('restart', 'stop'\)"):
        HangWatch("kill")


class HangingSource:
    """A RolloutSource whose collect raises, as a fleet does under watchdog.on_hang=stop."""

    version = 0

    def submit(self, prompt_ids, sampling, rows=None):
        return prompt_ids

    def collect(self, pending):
        raise HangError("hang: rollout actor 0 ...")


def pipeline(source) -> RolloutPipeline:
    """A synchronous RolloutPipeline over ``source`` whose data cursor takes 2 rows a step (``{"taken": n}``)."""
    cursor = {"taken": 0}

    def take():
        cursor["taken"] += 2
        return ["row"] * 2, [[1], [2]]

    return RolloutPipeline(source, take, lambda step: SamplingSpec(n=1, max_new_tokens=1, temperature=1.0), 0,
                           cursor=lambda: dict(cursor), restore_cursor=cursor.update)


def test_a_step_whose_rollout_hung_stays_in_flight_so_a_stop_snapshot_retakes_its_prompts():
    pipe = pipeline(HangingSource())
    with pytest.raises(HangError):
        pipe.next(0)
    # the cursor before step 0 is kept as in flight: a resume takes step 0's prompts again
    assert pipe.cursor_state() == {"taken": 2, "in_flight": [{"taken": 0}]}


class StoppingSource(HangingSource):
    """A RolloutSource whose submit raises, as the fleet does at the next rollout after a weight push hung under
    watchdog.on_hang=stop."""

    def submit(self, prompt_ids, sampling, rows=None):
        raise HangError("hang: rollout actor 0 ... has run update_weights ...")


@pytest.mark.parametrize("k", [0, 1])
def test_a_rollout_that_cannot_be_submitted_keeps_its_steps_in_flight(k):
    cursor = {"taken": 0}

    def take():
        cursor["taken"] += 2
        return ["row"] * 2, [[1], [2]]

    pipe = RolloutPipeline(StoppingSource(), take, lambda step: SamplingSpec(n=1, max_new_tokens=1, temperature=1.0),
                           k, cursor=lambda: dict(cursor), restore_cursor=cursor.update)
    with pytest.raises(HangError):
        pipe.next(0)
    # step 0 (and with k=1 nothing more: the submit of step 0 raised before step 1 took prompts) stays in flight
    assert pipe.cursor_state() == {"taken": 2, "in_flight": [{"taken": 0}]}


def stuck_in_collective(seconds: float) -> None:
    """Stands in for a rank waiting in an all-reduce that another rank never joins."""
    time.sleep(seconds)


def test_a_learner_step_past_its_deadline_is_reported_once_with_the_ranks_own_stack_then_the_action_runs():
    reports, expired = [], []
    deadline = StepDeadline(0.5, "learner rank 1", reports.append,
                            HangAction("exiting the rank (Ray Train restarts the group)", expired.append))
    deadline.arm(3)
    stuck_in_collective(2.0)
    deadline.disarm()
    head, _, stacks = reports[0].partition("\n")
    assert len(reports) == 1 and expired == [head] and deadline.reports == 1  # the action gets the headline
    assert head == (f"hang: learner rank 1 (pid {os.getpid()}) has run step 3 for 0.5 s, past "
                    "watchdog.learner_step_s=0.5 s; exiting the rank (Ray Train restarts the group)")
    assert f'File "{__file__}", line' in stacks and "in stuck_in_collective" in stacks  # the main thread, from here
    deadline.arm(4)  # a step that ends in time is never reported
    time.sleep(0.1)
    deadline.disarm()
    time.sleep(0.6)
    assert deadline.reports == 1


class QuietSource(HangingSource):
    """A RolloutSource whose rollouts finish (empty): the hang comes later, in the step's reward or judge call."""

    def collect(self, pending):
        return []


def test_a_step_whose_reward_hung_under_stop_is_put_back_in_flight():
    pipe = pipeline(QuietSource())
    pipe.next(0)
    assert pipe.cursor_state() == {"taken": 2, "in_flight": []}
    pipe.keep_in_flight(0)  # collect_experience, on a HangError from stage 3 (a reward or judge call)
    assert pipe.cursor_state() == {"taken": 2, "in_flight": [{"taken": 0}]}
    with pytest.raises(ValueError, match="step 0 is not the step returned last"):
        pipe.keep_in_flight(0)
