"""Stage 4's calls to the reference and teacher actors under watchdog.reference_call_s (rlray.run.frozen_calls), with
fake actor handles, a fake ray.wait/ray.get and a fake clock (no Ray): a hung call is reported with the actor's stacks,
the actor restarted and the call made once more; under stop the run stops, every rank together, with the step kept in
flight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ray.exceptions import RayActorError

from rlray.config import config_from_dict
from rlray.hangs import HangWatch
from rlray.run import frozen_calls
from rlray.run.frozen_calls import FrozenCalls
from rlray.run.online import OnlineRun, frozen_logprobs
from rlray.run.session import FatalStepError, hang_alert
from tests.test_hangs import FAKE_STACKS, FakeActors, QuietSource, pipeline

HANG = object()  # a call that never returns
MOVED = SimpleNamespace(at_reference=False)  # a learner whose weights left the reference's (after a run's first step)


class FakeRef:
    """A pending call: ``HANG``, a value, or an exception that ``get`` raises (an actor error)."""

    def __init__(self, outcome: object) -> None:
        self.outcome = outcome


class FakeActor:
    """A ``ReferenceActor`` handle whose logprobs calls end as ``outcomes`` say, one per call, in order."""

    def __init__(self, name: str, outcomes: list[object]) -> None:
        self.name, self.outcomes, self.calls = name, list(outcomes), []
        self.logprobs = SimpleNamespace(remote=self._remote)

    def _remote(self, inputs: object, batching: object) -> FakeRef:
        self.calls.append((inputs, batching))
        return FakeRef(self.outcomes.pop(0))

    def __str__(self) -> str:
        return self.name


class FakeRay:
    """``ray.wait`` / ``ray.get`` over ``FakeRef``s, and a clock that each wait advances by its timeout."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def wait(self, refs: list[FakeRef], timeout: float, fetch_local: bool) -> tuple[list, list]:
        ready = [r for r in refs if r.outcome is not HANG]
        if not ready:
            self.now += timeout
        return ready, [r for r in refs if r not in ready]

    def get(self, ref: FakeRef) -> object:
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome


def frozen(action: str, rank: int = 0, *, states: list[str] | None = None,
           alerts: list[str] | None = None) -> tuple[FrozenCalls, FakeActors]:
    """A rank's FrozenCalls under reference_call_s=3 s, stacks_timeout_s=10 s, polling each 1 s of the fake clock; the
    GCS says ``states`` in turn (then ALIVE)."""
    fakes, fake_ray, states = FakeActors(), FakeRay(), list(states or [])
    watch = HangWatch(action, reference_call_s=3.0, stacks_timeout_s=10.0, stacks=fakes.stacks, restart=fakes.restart,
                      alert=None if alerts is None else alerts.append)
    calls = FrozenCalls(watch, rank, wait=fake_ray.wait, get=fake_ray.get, clock=fake_ray.clock,
                        state=lambda actor: states.pop(0) if states else "ALIVE")
    return calls, fakes


def test_a_hung_reference_call_is_reported_with_the_actors_stacks_then_restarted_and_made_once_more(caplog):
    calls, fakes = frozen("restart", alerts=(alerts := []))
    retried = torch.tensor([[-0.5, -1.25]])
    actor = FakeActor("reference-0", [HANG, retried])
    got = calls.logprobs(actor, "reference actor", "shard inputs", "micro-batching")
    assert got is retried and actor.calls == [("shard inputs", "micro-batching")] * 2
    assert fakes.restarted == [actor] and (calls.watch.hangs, calls.watch.restarts, calls.retries) == (1, 1, 1)
    # waited: 4 polls of 1 s, the first past the 3 s deadline (rank 0 reports at the deadline)
    assert calls.watch.last.headline() == (
        "hang: reference actor (rlray:reference-0) (pid 4242, node abababababab) has run logprobs for 4.0 s, past "
        "watchdog.reference_call_s=3 s; restarting it (Ray restarts the process; its work runs again elsewhere or "
        "after the restart)")
    assert alerts == [f"{calls.watch.last.headline()}\nstacks of pid 4242:\n{FAKE_STACKS.rstrip()}"]
    assert any(r.message.startswith("rlray: hang: reference actor") and "in injected_hang" in r.message
               for r in caplog.records)
    assert calls.stopped is None


def test_under_stop_a_hung_teacher_call_stops_the_run_and_nothing_is_restarted():
    calls, fakes = frozen("stop")
    actor = FakeActor("teacher-0", [HANG, torch.zeros(1, 2)])
    assert calls.logprobs(actor, "teacher actor", "x", "m") is None
    assert fakes.restarted == [] and len(actor.calls) == 1 and (calls.watch.hangs, calls.watch.restarts) == (1, 0)
    assert calls.stopped.startswith("HangError: hang: teacher actor (rlray:teacher-0) (pid 4242, node abababababab) "
                                    "has run logprobs for 4.0 s, past watchdog.reference_call_s=3 s; stopping the run")
    assert "in injected_hang" in calls.stopped
    assert calls.logprobs(actor, "teacher actor", "x", "m") is None and len(actor.calls) == 1  # stopped: no new call


def test_a_call_failed_by_another_ranks_restart_is_made_once_more_unreported():
    calls, fakes = frozen("restart", rank=1)
    actor = FakeActor("reference-0", [RayActorError(), torch.ones(1, 1)])
    assert torch.equal(calls.logprobs(actor, "reference actor", "x", "m"), torch.ones(1, 1))
    assert (calls.watch.hangs, fakes.restarted, calls.retries, calls.stopped) == (0, [], 1, None)


def test_a_call_that_fails_twice_stops_the_run():
    calls, fakes = frozen("restart")
    actor = FakeActor("reference-0", [HANG, RayActorError()])
    assert calls.logprobs(actor, "reference actor", "x", "m") is None
    assert fakes.restarted == [actor] and calls.retries == 1
    assert calls.stopped.startswith("reference actor's logprobs call failed twice on learner rank 0 (the second time: "
                                    "RayActorError")


def test_rank_r_reports_after_its_stagger_and_not_while_the_actor_restarts():
    # rank 2: 3 s + 2 x (10 s + 5 s) = 33 s; then 2 polls find the actor RESTARTING (the clock starts again), and the
    # call is reported 34 s after the second of them
    calls, fakes = frozen("restart", rank=2, states=["RESTARTING", "RESTARTING"])
    assert calls.patience_s == 3.0 + 2 * (10.0 + frozen_calls.STAGGER_S) == 33.0
    actor = FakeActor("reference-0", [HANG, torch.ones(1, 1)])
    calls.logprobs(actor, "reference actor", "x", "m")
    assert calls.watch.last.waited_s == 34.0 and fakes.restarted == [actor]


def test_every_rank_agrees_on_a_stop_and_sums_the_counts():
    rank0, _ = frozen("restart")
    rank1, _ = frozen("stop", rank=1)
    rank0.logprobs(FakeActor("reference-0", [torch.ones(1, 1)]), "reference actor", "x", "m")  # rank 0's was served
    rank1.logprobs(FakeActor("reference-0", [HANG]), "reference actor", "x", "m")  # rank 1's hung: it stops
    def plus(other: FrozenCalls):  # a rank's all_reduce_sum over 2 ranks: its values plus the other rank's
        return lambda values: {k: v + other.contribution(2)[k] for k, v in values.items()}

    assert rank0.agree(plus(rank1), 2) == [1] and rank1.agree(plus(rank0), 2) == [1]
    assert rank0.run_counts == rank1.run_counts == {"run/hangs": 1.0, "run/hang_restarts": 0.0}
    assert rank1.stop_message([1]).startswith("HangError: hang: reference actor (rlray:reference-0)")
    assert rank0.stop_message([1]) == (
        "HangError: a logprobs call to the reference or teacher actor stopped the run on learner rank(s) [1] "
        "(watchdog.reference_call_s; their log's 'rlray: hang' line names the actor and its stacks)")


def test_rank0_puts_the_step_back_in_flight_then_every_rank_stops_with_a_snapshot():
    calls, _ = frozen("stop")
    pipe = pipeline(QuietSource())
    pipe.next(0)
    ctx = SimpleNamespace(settings=config_from_dict({}), frozen=calls, coll=SimpleNamespace(all_reduce_sum=dict),
                          world=1, reference_actor=FakeActor("reference-0", [HANG]), teacher_actor=None, learner=MOVED,
                          lead=SimpleNamespace(pipeline=pipe))
    batch = SimpleNamespace(inputs="x", ref_logprobs=None, teacher_logprobs=None)
    with pytest.raises(FatalStepError, match=r"^HangError: hang: reference actor .* stopping the run") as err:
        frozen_logprobs(ctx, batch, SimpleNamespace(distill_weight=0.0), 0)
    assert err.value.stop_snapshot
    assert pipe.cursor_state() == {"taken": 2, "in_flight": [{"taken": 0}]}  # a resume takes step 0's prompts again


def test_a_served_step_fills_both_logprobs_and_goes_on():
    calls, _ = frozen("restart")
    ref, teacher = torch.full((1, 2), -1.0), torch.full((1, 2), -2.0)
    ctx = SimpleNamespace(settings=config_from_dict({}), frozen=calls, coll=SimpleNamespace(all_reduce_sum=dict),
                          world=1, reference_actor=FakeActor("reference-0", [ref]),
                          teacher_actor=FakeActor("teacher-0", [teacher]), lead=None, learner=MOVED)
    batch = SimpleNamespace(inputs="x", ref_logprobs=None, teacher_logprobs=None)
    frozen_logprobs(ctx, batch, SimpleNamespace(distill_weight=0.5), 3)
    assert batch.ref_logprobs is ref and batch.teacher_logprobs is teacher
    assert calls.run_counts == {"run/hangs": 0.0, "run/hang_restarts": 0.0}


def test_at_a_runs_first_step_the_reference_actor_is_not_called_but_the_teacher_is():
    """While the policy is still the reference (``at_reference``) its own logprobs are the reference's
    (``reference_and_old``, ``train_minibatch``): the reference actor gets no call; the teacher, another model, does."""
    calls, _ = frozen("restart")
    teacher = torch.full((1, 2), -2.0)
    reference_actor = FakeActor("reference-0", [])  # a call would pop from an empty list
    ctx = SimpleNamespace(settings=config_from_dict({}), frozen=calls, coll=SimpleNamespace(all_reduce_sum=dict),
                          world=1, reference_actor=reference_actor, teacher_actor=FakeActor("teacher-0", [teacher]),
                          lead=None, learner=SimpleNamespace(at_reference=True))
    batch = SimpleNamespace(inputs="x", ref_logprobs=None, teacher_logprobs=None)
    frozen_logprobs(ctx, batch, SimpleNamespace(distill_weight=0.5), 1)
    assert reference_actor.calls == [] and batch.ref_logprobs is None and batch.teacher_logprobs is teacher


class FakeMonitor:
    """The monitor actor's ``alert.remote(kind, message, step)``, recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, int]] = []
        self.alert = SimpleNamespace(remote=lambda kind, message, step: self.sent.append((kind, message, step)))


def test_a_hung_call_on_rank_1_alerts_through_the_monitor_when_it_is_found():
    """Every rank's watch sends its reports to the run's alerts (``session.begin``: ``ctx.watch_hangs(hang_alert)``),
    so rank 1's stuck call is an alert with the actor's stacks at once, not only the stop's final failure."""
    calls, fakes = frozen("restart", rank=1)
    monitor = FakeMonitor()
    ctx = SimpleNamespace(rank=1, lead=None, frozen=calls)
    OnlineRun.watch_hangs(ctx, hang_alert(ctx, SimpleNamespace(step=6), SimpleNamespace(monitor=monitor)))
    actor = FakeActor("reference-0", [HANG, torch.ones(1, 1)])
    calls.logprobs(actor, "reference actor", "x", "m")
    # rank 1 waits 3 s + 1 x (10 s + 5 s) = 18 s, and reports at the first poll past it (19 s of the fake clock)
    assert fakes.restarted == [actor] and calls.watch.last.waited_s == 19.0
    assert monitor.sent == [("hang", f"{calls.watch.last.headline()}\nstacks of pid 4242:\n{FAKE_STACKS.rstrip()}", 7)]
    assert monitor.sent[0][1].startswith("hang: reference actor (rlray:reference-0) (pid 4242, node abababababab) "
                                         "has run logprobs for 19.0 s, past watchdog.reference_call_s=3 s")


def test_without_a_monitor_rank_1_reports_in_its_log_only(caplog):
    calls, _ = frozen("stop", rank=1)
    ctx = SimpleNamespace(rank=1, lead=None, frozen=calls)
    OnlineRun.watch_hangs(ctx, hang_alert(ctx, SimpleNamespace(step=0), SimpleNamespace(monitor=None)))
    assert calls.logprobs(FakeActor("teacher-0", [HANG]), "teacher actor", "x", "m") is None
    assert calls.stopped.startswith("HangError: hang: teacher actor") and calls.watch.hangs == 1
    assert any(r.message.startswith("rlray: hang: teacher actor") for r in caplog.records)
