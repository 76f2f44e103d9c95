"""rlray.launch.actors without a cluster: what a reference or teacher actor is asked for (fake ``ray.remote``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlray.config import load_config
from rlray.plan import resolve_plan


@pytest.mark.parametrize(("role", "overrides", "restarts"), [
    ("reference", ["resources.reference.placement=actor"], 1),  # the default: one restart
    ("teacher", ["resources.teacher.max_restarts=3"], 3),
])  # fmt: skip
def test_the_reference_and_teacher_actors_are_restartable_for_a_hang(monkeypatch, role, overrides, restarts):
    """A hung logprobs call restarts the actor (watchdog.reference_call_s, rlray.run.frozen_calls): Ray must restart
    it (resources.<role>.max_restarts), and it loads its frozen model again from the same path."""
    from rlray.launch import actors

    asked: dict = {}

    class FakeRemote:
        def __init__(self, cls: type) -> None:
            asked["cls"] = cls

        def options(self, **options):
            asked["options"] = options
            return self

        def remote(self, *args):
            asked["args"] = args
            return SimpleNamespace(ready=SimpleNamespace(remote=lambda: "ready-ref"))

    monkeypatch.setattr(actors.ray, "remote", FakeRemote)
    monkeypatch.setattr(actors, "wait_for_name", lambda name, namespace: None)
    plan = resolve_plan(load_config("configs/grpo_gsm8k_tiny.yaml", overrides))
    launched = actors.launch_reference_actor(plan, "/models/frozen", "ns", role=role)
    assert asked["cls"] is actors.ReferenceActor and asked["args"][0] == "/models/frozen"
    assert (asked["options"]["name"], asked["options"]["max_restarts"]) == (f"rlray:{role}-0", restarts)
    assert launched.name == f"{role}-0"
