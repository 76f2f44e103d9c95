"""The rollout fleet and the async pipeline on fake rollout actors (real Ray actors, real restarts).

A fake actor "generates" deterministic completions that encode the prompt, the sample, the seed and
the actor's policy version, so every assertion can count and trace exactly what came back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray
from ray.exceptions import ActorUnavailableError

from rlray.hangs import HangError, HangWatch, enable_stack_dumps
from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.fleet import RolloutError, RolloutFleet, gcs_actor_state, offset_seed
from rlray.rollout.fleet_deadlines import FleetDeadlines
from rlray.rollout.pipeline import RolloutPipeline

pytestmark = pytest.mark.ray


def injected_hang() -> None:
    """A call that never ends (as far as a test waits): the frame a hang report must name."""
    time.sleep(600)


class FakeRolloutActor:
    """Same methods as rlray.launch.actors.RolloutActor; dies (os._exit) in generate while an armed flag file exists,
    and hangs (``injected_hang``) in generate or update_weights while an armed hang file exists (once: it removes it)."""

    def __init__(self, restart_delay_s: float = 0.0, update_delay_s: float = 0.0) -> None:
        if ray.get_runtime_context().was_current_actor_reconstructed:
            time.sleep(restart_delay_s)  # a restart that waits for a replacement node
        enable_stack_dumps()
        self.version = 0
        self.update_delay_s = update_delay_s  # a slow weight load (a threaded actor answers meanwhile)
        self.die_flag: str | None = None
        self.hang_flag: str | None = None
        self.calls = 0

    def arm(self, die_flag: str) -> None:
        self.die_flag = die_flag

    def arm_hang(self, hang_flag: str) -> None:
        self.hang_flag = hang_flag

    def _maybe_hang(self) -> None:
        if self.hang_flag and os.path.exists(self.hang_flag):
            os.remove(self.hang_flag)
            injected_hang()

    def reset(self) -> None:
        self.version, self.calls = 0, 0

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        self.calls += 1
        self._maybe_hang()
        if self.die_flag and os.path.exists(self.die_flag):
            os.remove(self.die_flag)  # die once: the restarted actor finds no flag
            os._exit(1)
        return [
            Completion(p, j, [ids[0], j, sampling.seed or 0], [-0.5, -0.5, -0.5], "length", self.version)
            for p, ids in enumerate(prompt_token_ids)
            for j in range(sampling.n)
        ]

    def update_weights(self, named_tensors: dict, version: int) -> int:
        self._maybe_hang()
        time.sleep(self.update_delay_s)
        self.version = version
        return version

    def policy_version(self) -> int:
        return self.version

    def call_count(self) -> int:
        return self.calls


@pytest.fixture(scope="module")
def fake_actors(ray_session) -> list:
    """Two fake rollout actors for the module (Ray restarts each once), reset before every test."""
    cls = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_restarts=1, max_task_retries=0)
    actors = [cls.remote() for _ in range(2)]
    yield actors
    for a in actors:
        ray.kill(a, no_restart=True)


@pytest.fixture
def actors(fake_actors) -> list:
    ray.get([a.reset.remote() for a in fake_actors])
    return fake_actors


SAMPLING = SamplingSpec(n=3, max_new_tokens=3, temperature=1.0, seed=100)


def test_offset_seed_moves_by_whole_groups():
    # chunk starting at prompt 4 with n=3 samples per prompt: seed 100 + 4*3 = 112
    assert offset_seed(SAMPLING, 4).seed == 112
    assert offset_seed(SamplingSpec(n=3, max_new_tokens=3, temperature=1.0), 4).seed is None


def test_prompts_are_split_in_whole_groups_over_actors(actors):
    fleet = RolloutFleet(actors)
    prompts = [[1000 + i] for i in range(7)]
    out = fleet.generate(prompts, SAMPLING)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, j) for p in range(7) for j in range(3)]
    assert [c.response_token_ids[0] for c in out] == [1000 + p for p in range(7) for _ in range(3)]
    # chunks of 4 and 3 prompts: seeds offset by the chunk's first prompt (0, 4) times n=3
    assert sorted({c.response_token_ids[2] for c in out}) == [100, 112]
    assert ray.get([a.call_count.remote() for a in fleet.actors]) == [1, 1] and fleet.calls == 2  # rollout/engine_calls


def test_dead_actor_prompts_go_to_another_actor_exactly_once(actors, tmp_path):
    flag = tmp_path / "die"
    flag.touch()
    ray.get(actors[1].arm.remote(str(flag)))
    fleet = RolloutFleet(actors)
    fleet.push_weights(ray.put({}), 5)
    prompts = [[2000 + i] for i in range(8)]
    out = fleet.generate(prompts, SAMPLING)
    # every prompt id comes back exactly n times: nothing lost, nothing duplicated
    counts = {}
    for c in out:
        counts[c.response_token_ids[0]] = counts.get(c.response_token_ids[0], 0) + 1
    assert counts == {2000 + i: 3 for i in range(8)}
    assert [c.prompt_index for c in out] == [p for p in range(8) for _ in range(3)]
    assert fleet.reassigned == 1
    # the reassigned chunk kept its seed (prompts 4..7 -> 100 + 4*3) and its samples came from version 5
    assert {c.response_token_ids[2] for c in out if c.prompt_index >= 4} == {112}
    assert {c.policy_version for c in out} == {5}
    # while it restarts, the live actor takes all prompts; once back (fresh state, version 0) it is
    # brought to version 5 before it is used again
    assert _wait_restarted(fleet.actors[1]) == 0
    out = fleet.generate(prompts, SAMPLING)
    assert {c.policy_version for c in out} == {5}
    # it rejoins once its probe has answered (how many rollouts that takes depends on the load: a condition)
    _rollouts_until_rejoined(fleet, prompts, first_id=2000)
    assert ray.get(fleet.actors[1].policy_version.remote()) == 5
    assert ray.get(fleet.actors[1].call_count.remote()) >= 1  # its chunk of the rollout after it rejoined
    assert not Path(flag).exists()


def _dying_actors(tmp_path, restart_delay_s: float) -> tuple[list, Path]:
    """Returns (two fresh fake actors, the flag file that kills actor 1 in its next generate); actor 1's restart
    takes ``restart_delay_s``."""
    cls = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_restarts=1, max_task_retries=0)
    actors = [cls.remote(), cls.remote(restart_delay_s)]
    flag = tmp_path / "die"
    flag.touch()
    ray.get(actors[1].arm.remote(str(flag)))
    return actors, flag


def test_an_actor_away_is_waited_for_node_wait_s_then_the_fleet_goes_on_and_takes_it_back(ray_session, tmp_path):
    actors, _ = _dying_actors(tmp_path, restart_delay_s=8.0)
    fleet = RolloutFleet(actors, node_wait_s=1.0)
    prompts = [[3000 + i] for i in range(4)]
    try:
        out = fleet.generate(prompts, SAMPLING)  # actor 1 dies on its chunk (prompts 2, 3): they run again on actor 0
        assert [c.response_token_ids[0] for c in out] == [3000 + p for p in range(4) for _ in range(3)]
        assert (fleet.reassigned, fleet.rerun_prompts, fleet.alive) == (1, 2, 1)
        started = time.monotonic()
        out = fleet.generate(prompts, SAMPLING)  # actor 1 restarts for 8 s: waited for 1 s, then actor 0 alone
        assert time.monotonic() - started >= 1.0  # waited node_wait_s; not for the 8 s restart (next line but one)
        assert [c.response_token_ids[0] for c in out] == [3000 + p for p in range(4) for _ in range(3)]
        assert {c.response_token_ids[2] for c in out} == {100}  # one chunk: every prompt on actor 0
        assert fleet.alive == 1 and fleet.rerun_prompts == 2
        assert _wait_restarted(actors[1]) == 0
        _rollouts_until_rejoined(fleet, prompts, first_id=3000)
        assert ray.get(actors[1].call_count.remote()) >= 1
        assert ray.get(actors[1].policy_version.remote()) == 0  # no weights pushed in this test: version 0
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_with_no_actor_left_the_rollout_fails_after_the_wait_naming_why(ray_session, tmp_path):
    actors, _ = _dying_actors(tmp_path, restart_delay_s=30.0)
    ray.kill(actors[0], no_restart=True)  # dead for good
    fleet = RolloutFleet(actors, node_wait_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(RolloutError) as err:
            fleet.generate([[1], [2]], SAMPLING)
        assert time.monotonic() - started >= 1.0  # waited node_wait_s, then failed naming why (not after the 30 s restart)
        assert ("none of the 2 rollout actors is alive: actors [0] are dead for good (their restarts, "
                "resources.rollout.max_restarts, are spent) and [1] were not back within resources.node_wait_s=1 s"
                ) in str(err.value)
    finally:
        ray.kill(actors[1], no_restart=True)


def test_a_call_sent_before_a_counted_death_fails_without_counting_it_again(ray_session, tmp_path):
    """An actor dies under a chunk; the fleet learns of it first another way (``recover``'s probe, as a multi-turn
    rerun does), counts it, and brings the restarted actor back. The chunk's own error, read after that, is the same
    death: it is sent again, but the failure is not counted twice nor the refreshed actor taken out of use again."""
    actors, flag = _dying_actors(tmp_path, restart_delay_s=0.0)
    fleet = RolloutFleet(actors)
    try:
        fleet.push_weights(ray.put({}), 5)
        pending = fleet.submit([[5000 + i] for i in range(4)], SAMPLING)  # actor 1 dies on prompts 2, 3
        assert _wait_restarted(actors[1]) == 0 and not flag.exists()
        fleet.recover()  # it answers version 0, not 5: counted failed, then refreshed to 5 and back in use
        assert (fleet.failures, fleet.alive, ray.get(actors[1].policy_version.remote())) == (1, 2, 5)
        out = fleet.collect(pending)
        assert [c.response_token_ids[0] for c in out] == [5000 + p for p in range(4) for _ in range(3)]
        assert (fleet.failures, fleet.alive, fleet.reassigned, fleet.rerun_prompts) == (1, 2, 1, 2)
        assert {c.policy_version for c in out} == {5}
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_an_actor_back_while_the_learner_updates_gets_no_export_until_the_next_push(ray_session, tmp_path):
    """NCCL/IPC sync (``mark_synced``): a restarted actor is brought back with an export of the learner's weights.
    While the learner updates (``pause_export``, stage 6) that export would read weights being changed and tag the
    newer ones with the fleet's version, so the actor stays away until the next push, then gets that push's export."""
    actors, _ = _dying_actors(tmp_path, restart_delay_s=0.0)
    exports = []

    def exporter(version: int):
        return lambda: exports.append(version) or ray.put({})

    fleet = RolloutFleet(actors)
    try:
        ray.get([a.update_weights.remote({}, 3) for a in actors])  # as a transfer engine's send would leave them
        fleet.mark_synced(3, exporter(3))
        prompts = [[4000 + i] for i in range(4)]
        out = fleet.generate(prompts, SAMPLING)  # actor 1 dies on its chunk: it runs again on actor 0, at version 3
        assert {c.policy_version for c in out} == {3} and fleet.alive == 1
        assert _wait_restarted(actors[1]) == 0
        fleet.pause_export()  # the learner's update starts
        out = fleet.generate(prompts, SAMPLING)  # its probe is sent (or answered already)
        assert ray.wait([fleet._away[1].probe], timeout=30)[0]  # back: the next rollout would refresh it
        out = fleet.generate(prompts, SAMPLING)  # but not while the learner changes
        assert {c.response_token_ids[2] for c in out} == {100} and {c.policy_version for c in out} == {3}
        assert exports == [] and fleet.alive == 1 and ray.get(actors[1].policy_version.remote()) == 0
        ray.get(actors[0].update_weights.remote({}, 4))
        fleet.mark_synced(4, exporter(4))  # the next push: actor 1 gets its export, tagged with its version
        _rollouts_until_rejoined(fleet, prompts, first_id=4000)
        assert exports == [4] and ray.get(actors[1].policy_version.remote()) == 4
        assert {c.policy_version for c in fleet.generate(prompts, SAMPLING)} == {4}
        fleet.push_weights(ray.put({}), 5)  # an object-store push: its weights are a fixed object, never paused
        fleet.pause_export()
        assert fleet._latest is not None
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_with_its_only_actor_back_during_the_update_a_rollout_fails_saying_why_then_works_after_the_push(ray_session,
                                                                                                         tmp_path):
    actors, flag = _dying_actors(tmp_path, restart_delay_s=0.0)
    ray.kill(actors[0], no_restart=True)
    fleet = RolloutFleet(actors[1:])
    try:
        fleet.mark_synced(3, lambda: ray.put({}))
        fleet.pause_export()  # the learner's update starts; the actor then dies on its chunk, restarts, is back
        deadline, message = time.monotonic() + 30.0, ""
        while "are back" not in message:  # once its probe has answered (a condition: the load decides when)
            assert time.monotonic() < deadline, message
            with pytest.raises(RolloutError) as err:
                fleet.generate([[6000]], SAMPLING)
            message = str(err.value)
            time.sleep(0.2)
        assert "actors [0] restarted and are back, but cannot be given weights while the learner updates" in message
        assert not flag.exists() and ray.get(actors[1].policy_version.remote()) == 0
        fleet.mark_synced(4, lambda: ray.put({}))  # the push: it is brought back
        assert {c.policy_version for c in fleet.generate([[6000]], SAMPLING)} == {4}
    finally:
        ray.kill(actors[1], no_restart=True)


def _restarting_actors(restart_delay_s: float) -> list:
    """Returns two fresh fake actors; actor 1 was killed while idle and is restarting for ``restart_delay_s`` (GCS
    state RESTARTING, as with no node for it): the fleet has not seen it fail, and Ray queues calls to it (its
    ``max_task_retries=-1``; with 0 a call to it fails at once, which the fleet re-sends as a death)."""
    cls = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_restarts=1, max_task_retries=-1)
    actors = [cls.remote(), cls.remote(restart_delay_s)]
    ray.get([a.policy_version.remote() for a in actors])
    assert gcs_actor_state(actors[1]) == "ALIVE"
    ray.kill(actors[1], no_restart=False)
    deadline = time.monotonic() + 60
    while gcs_actor_state(actors[1]) != "RESTARTING":
        assert time.monotonic() < deadline, gcs_actor_state(actors[1])
        time.sleep(0.1)
    return actors


def test_a_call_to_an_actor_that_cannot_run_is_lost_after_node_wait_s_and_its_prompts_run_once_elsewhere(ray_session):
    actors = _restarting_actors(restart_delay_s=6.0)
    fleet = RolloutFleet(actors, node_wait_s=2.0)
    prompts = [[4000 + i] for i in range(4)]
    try:
        started = time.monotonic()
        out = fleet.generate(prompts, SAMPLING)  # actor 1's chunk (prompts 2, 3) waits in Ray's queue: lost after 2 s
        assert time.monotonic() - started >= 2.0  # node_wait_s, counted from when the fleet saw it RESTARTING
        assert [c.response_token_ids[0] for c in out] == [4000 + p for p in range(4) for _ in range(3)]
        assert [c.prompt_index for c in out] == [p for p in range(4) for _ in range(3)]
        # prompts 2, 3 ran again, once, on actor 0 with their own seed (100 + 2*3)
        assert {c.response_token_ids[2] for c in out if c.prompt_index >= 2} == {106}
        assert (fleet.reassigned, fleet.rerun_prompts, fleet.failures, fleet.alive) == (1, 2, 1, 1)
        assert ray.get(actors[0].call_count.remote()) == 2
        fleet.generate(prompts, SAMPLING)  # the lost actor is not waited for again: given up already
        assert fleet.rerun_prompts == 2
        assert _wait_restarted(actors[1]) == 0
        assert ray.get(actors[1].call_count.remote()) == 0  # the lost call was cancelled: it never ran once back
        _rollouts_until_rejoined(fleet, prompts, first_id=4000)
        assert ray.get(actors[1].call_count.remote()) >= 1
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_a_weight_push_to_an_actor_that_cannot_run_is_dropped_after_node_wait_s(ray_session):
    actors = _restarting_actors(restart_delay_s=30.0)
    fleet = RolloutFleet(actors, node_wait_s=1.0)
    try:
        started = time.monotonic()
        fleet.push_weights(ray.put({}), 3)  # blocks for every live actor; actor 1 cannot run it
        assert time.monotonic() - started >= 1.0
        assert (fleet.alive, fleet.failures, fleet.version) == (1, 1, 3)
        assert ray.get(actors[0].policy_version.remote()) == 3
        out = fleet.generate([[1], [2]], SAMPLING)  # actor 0 alone, at version 3, without another wait
        assert {c.policy_version for c in out} == {3} and fleet.rerun_prompts == 0
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_a_partial_fleet_waits_for_its_first_push_and_a_reload_before_it_returns(ray_session):
    """A partial engine loads pushes on a thread of their own and starts a generation once it holds the version sent
    before it (``min_version``): after a push that lowers the version (a restore, a rollback) or the first push of a
    fleet (a restarted learner: the actors' version is unknown), an engine still holding newer weights would start
    under them. Those pushes return once loaded (each load takes 2 s here); a push that raises the version returns at
    once (async), as every push of a fleet without partial rollouts does."""
    actor = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_concurrency=2).remote(update_delay_s=2.0)

    def push(fleet: RolloutFleet, version: int) -> float:
        start = time.monotonic()
        fleet.push_weights(ray.put({}), version, wait=False)
        return time.monotonic() - start

    try:
        assert ray.get(actor.policy_version.remote()) == 0  # started, as the driver hands it over
        fleet = RolloutFleet([actor], partial=True)
        assert push(fleet, 3) >= 2.0 and ray.get(actor.policy_version.remote()) == 3  # the first push: loaded
        assert push(fleet, 4) < 2.0  # raises the version: returns while the actor loads it
        deadline = time.monotonic() + 60
        while ray.get(actor.policy_version.remote()) != 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert push(fleet, 2) >= 2.0  # a rollback to version 2 while the actor holds 4: loaded before it returns
        assert ray.get(actor.policy_version.remote()) == 2 and fleet.version == 2
        assert push(RolloutFleet([actor]), 1) < 2.0  # partial off: Ray runs the push before the calls sent after it
    finally:
        ray.kill(actor, no_restart=True)


def _rollouts_until_rejoined(fleet: RolloutFleet, prompts: list[list[int]], first_id: int, timeout_s: float = 60.0) -> None:
    """Runs rollouts until every actor is in use again, each one whole and in order, then one more (the rejoined
    actor takes its chunk). A given-up actor is checked without waiting at each rollout and rejoins once its probe
    has answered: how many rollouts that takes depends on the machine's load, so it is waited for as a condition."""
    deadline = time.monotonic() + timeout_s
    while fleet.alive < len(fleet.actors):
        assert time.monotonic() < deadline, f"{fleet.alive} of {len(fleet.actors)} actors in use after {timeout_s} s"
        out = fleet.generate(prompts, SAMPLING)
        assert [c.response_token_ids[0] for c in out] == [first_id + p for p in range(len(prompts)) for _ in range(3)]
        time.sleep(0.2)
    fleet.generate(prompts, SAMPLING)


def _wait_restarted(actor, timeout_s: float = 60.0) -> int:
    """Returns the actor's policy version once it answers again after a restart."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.policy_version.remote())
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _pipeline(k: int, fleet: RolloutFleet, overlap: bool = True) -> tuple[RolloutPipeline, list[int]]:
    taken = []

    def take():
        start = len(taken) * 4
        taken.append(start)
        return [f"row{start + i}" for i in range(4)], [[start + i] for i in range(4)]

    sampling = lambda step: SamplingSpec(n=2, max_new_tokens=3, temperature=1.0, seed=step)  # noqa: E731
    return RolloutPipeline(fleet, take, sampling, k, overlap=overlap), taken


@pytest.mark.parametrize("k", [0, 1, 2])
def test_pipeline_staleness_is_bounded_by_k(actors, k):
    fleet = RolloutFleet(actors)
    pipe, taken = _pipeline(k, fleet)
    staleness = []
    for step in range(6):
        batch = pipe.next(step)
        learner_version = step  # the update of step t starts from version t
        staleness.append(max(learner_version - c.policy_version for c in batch.completions))
        # prompts come in order, each step exactly once
        assert [c.response_token_ids[0] for c in batch.completions][::2] == list(range(4 * step, 4 * step + 4))
        assert {c.response_token_ids[2] for c in batch.completions} >= {step}
        assert pipe.in_flight == k
        fleet.push_weights(ray.put({}), step + 1, wait=(k == 0))
    # rollouts run on the weights of k updates ago: 0, 1, .., k, k, k (never more than k)
    assert staleness == [min(step, k) for step in range(6)]
    assert len(taken) == 6 + k  # the data cursor runs k steps ahead


def test_pipeline_without_overlap_takes_the_same_prompts_and_generates_each_step_when_it_comes(actors):
    fleet = RolloutFleet(actors)
    pipe, taken = _pipeline(2, fleet, overlap=False)
    submitted = []
    submit = fleet.submit
    fleet.submit = lambda ids, spec, rows=None, **kw: submitted.append(ids[0][0]) or submit(ids, spec, rows, **kw)
    for step in range(5):
        batch = pipe.next(step)
        assert submitted == [4 * s for s in range(step + 1)]  # only the steps asked for ran, in order
        assert len(taken) == step + 3  # the data cursor runs k = 2 steps ahead, as with overlap
        assert pipe.in_flight == 2
        assert [c.response_token_ids[0] for c in batch.completions][::2] == list(range(4 * step, 4 * step + 4))
        assert {c.policy_version for c in batch.completions} == {step}  # generated with the newest weights
        assert batch.submitted_at_version == step
        fleet.push_weights(ray.put({}), step + 1, wait=False)
    pipe.reset()  # kept steps are not collected (never submitted) and are taken again with their prompts
    assert pipe.in_flight == 0 and [entry[2][0][0] for entry in pipe._retake] == [20, 24]


def test_pipeline_rejects_out_of_order_steps(actors):
    pipe, _ = _pipeline(1, RolloutFleet(actors))
    pipe.next(0)
    with pytest.raises(ValueError, match="asked for step 3, the next rollout in flight is step 1"):
        pipe.next(3)


def test_a_hung_generate_and_a_hung_weight_push_are_reported_with_the_stack_and_the_actor_restarted(ray_session,
                                                                                                    tmp_path):
    """watchdog.engine_call_s / weight_push_s of 3 s on a call that sleeps 600 s: reported within the deadline plus a
    few seconds with the stuck process's stack, the actor restarted, its prompts run once elsewhere."""
    cls = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_restarts=2, max_task_retries=0)
    actors = [cls.remote(), cls.remote()]
    assert ray.get([a.policy_version.remote() for a in actors]) == [0, 0]  # started, as the driver hands them over
    alerts: list[str] = []
    watch = HangWatch("restart", engine_call_s=3.0, weight_push_s=3.0, alert=alerts.append)
    fleet = RolloutFleet(actors, node_wait_s=60.0, watch=watch)
    fleet.push_weights(ray.put({}), 1)
    flag = tmp_path / "hang"
    flag.touch()
    ray.get(actors[1].arm_hang.remote(str(flag)))
    prompts = [[3000 + i] for i in range(8)]
    t0 = time.monotonic()
    out = fleet.generate(prompts, SAMPLING)
    took = time.monotonic() - t0
    assert took < 3.0 + 20.0  # the deadline plus the report (stacks, restart) on a loaded 2-core machine; not 600 s
    assert sorted(c.response_token_ids[0] for c in out) == sorted(3000 + i for i in range(8) for _ in range(3))
    assert (watch.hangs, watch.restarts, fleet.reassigned, fleet.rerun_prompts) == (1, 1, 1, 4)
    assert isinstance(fleet, FleetDeadlines) and not fleet._sent.get(1)  # the restart failed its calls: none timed
    assert alerts[0].startswith("hang: rollout actor 1 (") and "has run generate for " in alerts[0]
    assert "past watchdog.engine_call_s=3 s; restarting it" in alerts[0]
    assert f'File "{__file__}", line' in alerts[0] and "in injected_hang" in alerts[0]  # from the stuck process
    # the restarted actor comes back; a push that hangs is reported the same way and the actor refreshed after
    _rollouts_until_rejoined(fleet, prompts, first_id=3000)
    flag.touch()
    ray.get(fleet.actors[1].arm_hang.remote(str(flag)))
    fleet.push_weights(ray.put({}), 2)
    assert watch.hangs == 2 and "has run update_weights for " in alerts[1]
    assert "past watchdog.weight_push_s=3 s" in alerts[1] and "in injected_hang" in alerts[1]
    _rollouts_until_rejoined(fleet, prompts, first_id=3000)
    assert ray.get(fleet.actors[1].policy_version.remote()) == 2
    for a in actors:
        ray.kill(a, no_restart=True)


def test_under_stop_a_hung_weight_push_is_reported_then_the_next_rollout_stops_the_run(ray_session, tmp_path):
    """watchdog.on_hang=stop: a push found hung (stage 7) restarts its actor so nothing stays stuck, and the next
    rollout (stages 1-3, where every rank stops together) raises the report."""
    cls = ray.remote(FakeRolloutActor).options(num_cpus=0.01, max_restarts=1, max_task_retries=0)
    actors = [cls.remote(), cls.remote()]
    assert ray.get([a.policy_version.remote() for a in actors]) == [0, 0]
    alerts: list[str] = []
    fleet = RolloutFleet(actors, watch=HangWatch("stop", weight_push_s=3.0, alert=alerts.append))
    flag = tmp_path / "hang"
    flag.touch()
    ray.get(actors[0].arm_hang.remote(str(flag)))
    fleet.push_weights(ray.put({}), 1)  # returns: the hung actor was restarted (stale until refreshed)
    assert fleet.alive == 1 and fleet.watch.restarts == 1
    assert "rollout actor 0 (" in alerts[0] and "has run update_weights for" in alerts[0]
    assert "stopping the run (watchdog.on_hang=stop)" in alerts[0] and "in injected_hang" in alerts[0]
    with pytest.raises(HangError, match=r"hang: rollout actor 0 .* has run update_weights"):
        fleet.generate([[1]], SAMPLING)
    for a in actors:
        ray.kill(a, no_restart=True)
