"""What a learner rank does after a hang of its own (rlray.run.rank_hangs.hang_action): exit for Ray Train's restart,
or, under watchdog.on_hang=stop, record the run's end in the run control before it exits, so that the group Ray Train
may start again ends at once (rlray.run.worker.train_worker) and the driver ends the run FAILED. The whole path, two
Ray Train ranks and a real stuck collective: tests/run/test_dist_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlray.config import config_from_dict
from rlray.plan import resolve_plan
from rlray.run import rank_hangs
from rlray.run.hooks import RunControl
from rlray.run.state import RunOutcome, RunServices, RunState, WorkerArgs
from rlray.run.worker import train_worker


class Recorder:
    """Stands in for the monitor actor (``RunControl`` and the alerts): each ``.remote`` call is recorded and runs."""

    def __init__(self) -> None:
        self.control, self.calls = RunControl(), []
        for name in ("fail", "alert"):
            setattr(self, name, SimpleNamespace(remote=self._call(name)))

    def _call(self, name):
        def remote(*args):
            self.calls.append((name, *args))
            if name == "fail":
                self.control.fail(*args)

        return remote


def rank(on_hang: str, in_ray_train: bool = True):
    plan = resolve_plan(config_from_dict({"watchdog": {"on_hang": on_hang}}))
    run = RunState(run_id="r1", run_dir="file:///snaps/run-r1", options={}, in_ray_train=in_ray_train, step=4,
                   last_snapshot="file:///snaps/run-r1/step_000004")
    monitor = Recorder()
    return SimpleNamespace(plan=plan, rank=1), run, RunServices(monitor=monitor, control=monitor), monitor


def test_under_stop_the_rank_records_the_runs_end_and_alerts_before_it_exits(monkeypatch):
    exits = []
    monkeypatch.setattr(rank_hangs, "exit_rank", lambda: exits.append(len(monitor.calls)))
    ctx, run, services, monitor = rank("stop")
    action = rank_hangs.hang_action(ctx, run, services)
    assert action.says == ("stopping the run (watchdog.on_hang=stop: it ends FAILED, resumable from its newest snapshot "
                           "if it has one)")
    head = "hang: learner rank 1 (pid 7) has waited in all_reduce_sum (collective 9, ...) for 3.1 s, past ..."
    action.run(head)
    outcome = RunOutcome("FAILED", 4, "file:///snaps/run-r1/step_000004", head, {})
    assert monitor.calls == [("fail", outcome), ("alert", "run_failed", f"the run stops: {head}", 5)]
    assert exits == [2]  # after both were sent
    assert monitor.control.failure() == outcome and monitor.control.outcome() == outcome
    assert monitor.control.stop_reason() == "hang"


def test_under_restart_the_rank_exits_at_once_and_outside_ray_train_it_only_reports(monkeypatch):
    exits = []
    monkeypatch.setattr(rank_hangs, "exit_rank", lambda: exits.append(True))
    ctx, run, services, monitor = rank("restart")
    action = rank_hangs.hang_action(ctx, run, services)
    assert action.says == "exiting the rank (Ray Train restarts the group)"
    action.run("hang: ...")
    assert exits == [True] and monitor.calls == []
    assert rank_hangs.hang_action(*rank("stop", in_ray_train=False)[:3]) is None
    assert rank_hangs.hang_action(*rank("restart", in_ray_train=False)[:3]) is None


def test_the_first_failure_is_the_runs_outcome_and_a_later_record_does_not_replace_it():
    control = RunControl()
    control.record_outcome(RunOutcome("RUNNING", 3, None, "", {}))
    first, second = RunOutcome("FAILED", 4, "s4", "hang: rank 1", {}), RunOutcome("FAILED", 4, "s4", "hang: rank 0", {})
    control.fail(first)
    control.fail(second)
    control.record_outcome(RunOutcome("FINISHED", 9, "s9", "", {}))  # a rank still finishing: too late
    assert control.failure() is first and control.outcome() is first
    assert RunControl().failure() is None


@pytest.mark.ray
def test_a_learner_group_started_again_after_a_rank_ended_the_run_returns_before_any_load(ray_session):
    import ray

    control = ray.remote(RunControl).remote()
    outcome = RunOutcome("FAILED", 2, "s2", "hang: learner rank 0 ...", {})
    ray.get(control.fail.remote(outcome))
    # no config, no model: anything past the check would fail
    args = WorkerArgs(config={"bogus": True}, model_dir="/nonexistent", services=RunServices(control=control))
    assert train_worker({"args": args}) is None
    assert ray.get(control.outcome.remote()) == outcome
    with pytest.raises(Exception, match="bogus"):  # and without the failure it would have gone on
        train_worker({"args": WorkerArgs(config={"bogus": True}, model_dir="/nonexistent",
                                         services=RunServices(control=ray.remote(RunControl).remote()))})
