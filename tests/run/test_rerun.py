"""RerunOnFault with a fake rollout and fleet (no Ray): a death under a step's rollout runs it again, whole, once the
actors are back; nothing is rerun without a death, or when a host is not back."""

from __future__ import annotations

from types import SimpleNamespace

import ray.exceptions

from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.types import EpisodeInfo
from rlray.run import rerun as rerun_mod
from rlray.run.rerun import RerunOnFault


class FakeFleet:
    """``failures`` rises when the inner rollout says an actor died; ``recover`` counts its calls."""

    def __init__(self):
        self.actors, self.failures, self.recovered, self.version = [object()], 0, 0, 3  # no GCS: restarts read -1

    def recover(self):
        self.recovered += 1


class FakeRollout:
    """Attempt i returns one episode of reward i; the attempts listed in ``deaths`` see an actor die (the fleet's
    failures rise) or end ``actor_died`` (a host)."""

    def __init__(self, fleet, deaths: dict[int, str]):
        self.fleet, self.deaths, self.calls = fleet, deaths, 0
        self.version = 3

    def generate(self, prompt_ids, sampling, rows):
        i, self.calls = self.calls, self.calls + 1
        stop = "done"
        if self.deaths.get(i) == "actor":
            self.fleet.failures += 1
        elif self.deaths.get(i) == "host":
            stop = "actor_died"
        return [Completion(0, 0, [5], [-0.5], "stop", 3, [True], episode=EpisodeInfo("guess", stop, 1, [float(i)]))]


class FakeHost:
    def __init__(self, back: bool):
        self.ping = self
        self.back = back

    def remote(self):
        if not self.back:
            raise ray.exceptions.ActorDiedError()
        return "pong"


def run(deaths, *, host_back=True, monkeypatch=None):
    fleet = FakeFleet()
    inner = FakeRollout(fleet, deaths)
    wrapper = RerunOnFault(inner, fleet, [FakeHost(host_back)])
    monkeypatch.setattr(rerun_mod.ray, "get", lambda ref, timeout=None: ref)
    return wrapper.generate([[1, 2]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0, seed=0), [None]), wrapper, inner, fleet


def test_no_death_runs_the_rollout_once(monkeypatch):
    got, wrapper, inner, fleet = run({}, monkeypatch=monkeypatch)
    assert inner.calls == 1 and wrapper.reruns == 0 and fleet.recovered == 0
    assert got[0].episode.turn_rewards == [0.0] and not got[0].episode.rerun


def test_a_rollout_actor_death_reruns_the_whole_step_after_recovering_the_fleet(monkeypatch):
    got, wrapper, inner, fleet = run({0: "actor"}, monkeypatch=monkeypatch)
    assert inner.calls == 2 and wrapper.reruns == 1 and fleet.recovered == 1
    assert got[0].episode.turn_rewards == [1.0] and got[0].episode.rerun  # the second attempt's samples, counted


def test_a_host_death_reruns_until_an_attempt_sees_none_at_most_max_reruns_times(monkeypatch):
    got, wrapper, inner, _ = run({0: "host", 1: "actor"}, monkeypatch=monkeypatch)
    assert inner.calls == 3 and wrapper.reruns == 2 and got[0].episode.turn_rewards == [2.0]
    got, wrapper, inner, _ = run({0: "host", 1: "host", 2: "host", 3: "host"}, monkeypatch=monkeypatch)
    assert inner.calls == rerun_mod.MAX_RERUNS + 1 and got[0].episode.stop_reason == "actor_died"


def test_a_host_not_back_keeps_the_samples(monkeypatch):
    got, wrapper, inner, fleet = run({0: "host"}, host_back=False, monkeypatch=monkeypatch)
    assert inner.calls == 1 and wrapper.reruns == 0 and fleet.recovered == 0
    assert got[0].episode.stop_reason == "actor_died" and not got[0].episode.rerun


def test_a_restart_the_gcs_counts_is_a_death_and_a_gcs_that_does_not_answer_is_not(monkeypatch):
    fleet = FakeFleet()
    wrapper = RerunOnFault(FakeRollout(fleet, {}), fleet, [])
    answers = iter([{"NumRestarts": 0}, {}, {"NumRestarts": 0}, {"NumRestarts": 1}])
    monkeypatch.setattr(rerun_mod, "gcs_actor_info", lambda actor: next(answers))
    before = wrapper._deaths()
    assert before == (0, 0) and not wrapper._died_since(before)  # the GCS busy (-1): not compared
    assert not wrapper._died_since(before)  # restarts 0 again
    assert wrapper._died_since(before)  # restarted once


def test_the_step_logs_the_pipelines_reruns_with_the_fleets_once_each():
    """rollout/rerun_prompts adds the prompts the pipeline sampled again (a rollout failed before its step asked:
    ``RolloutPipeline.settle``) to those the fleet sent again; rollout/stale_rerun_prompts counts those sampled with
    newer weights than submitted at. Each step logs what happened since the previous one."""
    import torch

    from rlray.run.experience import StageTimer
    from rlray.run.lead import FleetCounts
    from rlray.run.online import step_metrics

    fleet = SimpleNamespace(failures=1, rerun_prompts=3, calls=5, alive=2, watch=None)
    pipe = SimpleNamespace(rerun_prompts=2, stale_rerun_prompts=0)
    lead = SimpleNamespace(fleet=fleet, pipeline=pipe, logged=FleetCounts(), stream=SimpleNamespace(epoch=0),
                           skipped_long_prompts=0)
    batch = SimpleNamespace(advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2, dtype=torch.bool))
    rollout = {"rollout/generated_tokens": 4.0, "timing/rollout_s": 1.0}
    keys = ("rollout/actor_failures", "rollout/rerun_prompts", "rollout/stale_rerun_prompts")

    def logged() -> tuple[float, ...]:
        got = step_metrics(lead, rollout, batch, StageTimer())
        return tuple(got[k] for k in keys)

    assert logged() == (1.0, 5.0, 0.0)  # 3 re-sent by the fleet + 2 sampled again by the pipeline, at their version
    pipe.rerun_prompts, pipe.stale_rerun_prompts = 4, 2  # a step whose rollout was sampled again with newer weights
    assert logged() == (0.0, 2.0, 2.0)
    assert logged() == (0.0, 0.0, 0.0)
