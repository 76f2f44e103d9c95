"""Weight sync through the object store (``rlray.rollout.weight_sync.ObjectStoreSync``) on fake rollout actors.

A synchronous push keeps no copy of the weights in Ray's object store once every actor has loaded them (the next
push then reuses that shared memory instead of touching a second region), and an actor that restarts still gets
the pushed version, exported afresh. An async push (``wait=False``) keeps its copy until the next push, which
releases it before writing its own.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from rlray.rollout.fleet import RolloutFleet
from rlray.rollout.weight_sync import ObjectStoreSync
from rlray.rollout.wire import unpack_weights

pytestmark = pytest.mark.ray


class _Learner:
    """What ObjectStoreSync reads of a PolicyLearner: ``sharded`` and ``export_weights(dtype)`` ({name: tensor})."""

    sharded = False

    def __init__(self) -> None:
        self.weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        self.exports = 0

    def export_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        self.exports += 1
        return {"w": self.weight.to(dtype)}


class _Actor:
    """Loads what it is sent: keeps the received tensor's values and the version."""

    def __init__(self) -> None:
        self.version, self.values = 0, None

    def update_weights(self, named_tensors: dict, version: int) -> int:
        self.values = unpack_weights(named_tensors)["w"].tolist()
        self.version = version
        return version

    def policy_version(self) -> int:
        return self.version

    def loaded(self) -> tuple[int, list | None]:
        return self.version, self.values

    def reset(self) -> None:
        self.version, self.values = 0, None


@pytest.fixture(scope="module")
def plain_actors(ray_session) -> list:
    """Two actors for the module's tests (each actor is a worker process: ~2-4 s of CPU to start one)."""
    actors = [ray.remote(_Actor).options(num_cpus=0.01).remote() for _ in range(2)]
    ray.get([a.policy_version.remote() for a in actors])  # started: the fleet counts an actor not yet ALIVE as lost
    yield actors
    for a in actors:
        ray.kill(a, no_restart=True)


@pytest.fixture
def fleet(plain_actors):
    """A fresh fleet over the module's actors, reset to version 0 with nothing loaded."""
    ray.get([a.reset.remote() for a in plain_actors])
    return RolloutFleet(plain_actors)


def _held_by_this_process(ref_hex: str) -> bool:
    """Returns True when this process still counts a reference to the object ``ref_hex`` (Ray frees it at zero)."""
    counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()  # {hex id bytes: counts}
    return ref_hex.encode() in counts


def _released(ref_hex: str, timeout_s: float = 5.0) -> bool:
    """Returns True once this process counts no reference to ``ref_hex``, waiting up to ``timeout_s`` (Ray drops the
    reference a finished task held on its argument shortly after the task's result arrives)."""
    deadline = time.monotonic() + timeout_s
    while _held_by_this_process(ref_hex):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _spy_puts(monkeypatch) -> list[str]:
    """Records the object id of every ``ray.put`` from now on; returns the (growing) list."""
    real_put, ids = ray.put, []

    def put(value, **kwargs):
        ref = real_put(value, **kwargs)
        ids.append(ref.hex())
        return ref

    monkeypatch.setattr(ray, "put", put)
    return ids


def test_a_synchronous_push_leaves_no_copy_in_the_object_store(fleet, monkeypatch):
    puts = _spy_puts(monkeypatch)
    learner = _Learner()
    sync = ObjectStoreSync(fleet, torch.float32, wait=True)
    sync.push(learner, rank=0, version=1)
    assert len(puts) == 1 and sync.last_metrics["rollout/weight_sync_bytes"] == 6 * 4  # the 2x3 float32 policy (rollout/weight_sync_bytes)
    assert fleet._latest is not None and _released(puts[0])  # dropped once both actors loaded it
    assert ray.get([a.loaded.remote() for a in fleet.actors]) == [(1, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])] * 2
    # a restarted actor is brought to version 1 from a fresh export of the (unchanged) policy
    ref = fleet._latest()
    assert puts[1:] == [ref.hex()] and learner.exports == 2
    assert unpack_weights(ray.get(ref))["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_an_async_push_keeps_its_copy_for_actors_that_restart(fleet, monkeypatch):
    puts = _spy_puts(monkeypatch)
    learner = _Learner()
    ObjectStoreSync(fleet, torch.float32, wait=False).push(learner, rank=0, version=1)
    learner.weight.add_(10.0)  # the learner moves on before the actors load: a later export would not be version 1
    assert _held_by_this_process(puts[0])
    ref = fleet._latest()
    assert ref.hex() == puts[0] and learner.exports == 1
    assert unpack_weights(ray.get(ref))["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_an_async_push_releases_the_previous_copy_before_writing_its_own(fleet, monkeypatch):
    puts = _spy_puts(monkeypatch)
    learner = _Learner()
    sync = ObjectStoreSync(fleet, torch.float32, wait=False)
    sync.push(learner, rank=0, version=1)
    fleet._check_pending_sync(block=True)  # both actors loaded version 1
    assert _held_by_this_process(puts[0])  # kept by the fleet until the next push
    latest_at_second_put = []
    spy = ray.put

    def put(value, **kwargs):  # does the fleet still hold the first copy when the second is written?
        latest_at_second_put.append(fleet._latest)
        return spy(value, **kwargs)

    monkeypatch.setattr(ray, "put", put)
    learner.weight.add_(10.0)
    sync.push(learner, rank=0, version=2)
    fleet._check_pending_sync(block=True)
    assert latest_at_second_put == [None] and _released(puts[0])
    assert ray.get([a.loaded.remote() for a in fleet.actors]) == [(2, [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]])] * 2
    assert fleet._latest().hex() == puts[1]  # the async copy of version 2 is kept until the next push


# ---- delta sync (rollout.weight_payload: delta): the real RolloutActor.update_weights over a fake engine ----------
class _Engine:
    """What RolloutActor reads of a RolloutEngine: ``update_weights`` (keeps a copy of what it loads) and the version."""

    def __init__(self) -> None:
        self.policy_version, self.loaded = 0, None

    def update_weights(self, named_tensors: dict, version: int) -> None:
        self.loaded = {n: t.clone() for n, t in named_tensors.items()}
        self.policy_version = version


def _delta_actor_class():
    from rlray.launch.engine_actors import RolloutActor
    from rlray.rollout.delta import DeltaReceiver

    class _DeltaActor(RolloutActor):
        def __init__(self) -> None:  # no engine build: RolloutActor's own update path over _Engine
            self.engine, self.receiver = _Engine(), DeltaReceiver()

        def restart(self) -> None:  # what Ray's restart leaves: the checkpoint's weights at version 0, no copy
            self.engine, self.receiver = _Engine(), DeltaReceiver()

        def corrupt_copy(self) -> None:  # one bit of the actor's copy flips, in a row the next step leaves alone
            self.receiver.mirror["w"].view(torch.int16).view(-1)[-1] ^= 1

        def loaded(self) -> tuple[int, dict]:
            return self.engine.policy_version, self.engine.loaded

    return _DeltaActor


class _MovingLearner(_Learner):
    """A policy whose weights move by a small step at each update: most bf16 values keep their bits."""

    def __init__(self) -> None:
        self.weight = torch.linspace(-1.0, 1.0, 4096).reshape(64, 64)
        self.exports = 0

    def export_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {"w": self.weight.to(dtype)}

    def step(self) -> None:
        self.weight[:8] += 0.01  # 512 of 4096 values move by more than a bf16 ulp


@pytest.fixture(scope="module")
def delta_actors(ray_session) -> list:
    """Two delta-sync actors for the module's tests."""
    actors = [ray.remote(_delta_actor_class()).options(num_cpus=0.01).remote() for _ in range(2)]
    ray.get([a.policy_version.remote() for a in actors])
    yield actors
    for a in actors:
        ray.kill(a, no_restart=True)


@pytest.fixture
def delta_fleet(delta_actors):
    """A fresh fleet over the module's delta actors, each back at version 0 with no copy."""
    ray.get([a.restart.remote() for a in delta_actors])
    return RolloutFleet(delta_actors)


def _engines_hold(fleet: RolloutFleet, learner: _MovingLearner, version: int) -> bool:
    want = learner.weight.to(torch.bfloat16).view(torch.int16)
    got = ray.get([a.loaded.remote() for a in fleet.actors])
    return all(v == version and torch.equal(w["w"].view(torch.int16), want) for v, w in got)


def test_a_delta_sync_sends_the_changed_values_and_the_engines_hold_the_learners_bits(delta_fleet):
    learner, sync = _MovingLearner(), ObjectStoreSync(delta_fleet, torch.bfloat16, wait=True, delta=True)
    sync.push(learner, rank=0, version=1)
    assert sync.last_metrics == {"rollout/weight_sync_bytes": 4096 * 2, "rollout/weight_sync_changed_fraction": 1.0,
                                 "rollout/weight_sync_full_resyncs": 0.0}
    learner.step()
    sync.push(learner, rank=0, version=2)
    changed = sync.last_metrics["rollout/weight_sync_changed_fraction"]
    assert 0 < changed <= 512 / 4096 and _engines_hold(delta_fleet, learner, 2)
    k = round(changed * 4096)
    assert sync.last_metrics["rollout/weight_sync_bytes"] == min(k * 6, 4096 // 8 + k * 2)  # sparse or bit mask, not dense


def test_an_engine_that_missed_a_version_gets_the_full_weights(delta_fleet):
    learner, sync = _MovingLearner(), ObjectStoreSync(delta_fleet, torch.bfloat16, wait=True, delta=True)
    sync.push(learner, rank=0, version=1)
    ray.get(delta_fleet.actors[1].restart.remote())  # back at version 0 before the fleet noticed
    learner.step()
    sync.push(learner, rank=0, version=2)
    assert delta_fleet.full_resyncs == 1 and sync.last_metrics["rollout/weight_sync_full_resyncs"] == 1.0
    assert _engines_hold(delta_fleet, learner, 2)
    learner.step()
    sync.push(learner, rank=0, version=3)  # both hold version 2 again: deltas only
    assert delta_fleet.full_resyncs == 1 and _engines_hold(delta_fleet, learner, 3)
    # an actor that restarts is refreshed from the learner's copy, whole, at the latest version
    assert ray.get(delta_fleet._latest()).base_version is None and ray.get(delta_fleet._latest()).version == 3


def test_a_corrupted_copy_fails_its_checksum_and_the_engine_gets_the_full_weights(delta_fleet):
    learner, sync = _MovingLearner(), ObjectStoreSync(delta_fleet, torch.bfloat16, wait=True, delta=True)
    sync.push(learner, rank=0, version=1)
    ray.get(delta_fleet.actors[0].corrupt_copy.remote())
    learner.step()
    sync.push(learner, rank=0, version=2)
    assert delta_fleet.full_resyncs == 1 and _engines_hold(delta_fleet, learner, 2)
