"""The test-only hold hook (rlray.run.hooks.HoldForTest): made only from its environment variables, it waits after
its step until the release file exists, and stops the run with a reason when the file never comes. The held real run
that uses it is tests/observe/test_held_run.py. The generate hold (hold_generate_from_env) holds a rollout actor's n-th
generate while its hold file exists; tests/launch/test_node_loss.py loses a node under it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from rlray.run.hooks import (
    HOLD_GENERATE_ENV,
    HOLD_RELEASE_ENV,
    HOLD_STEP_ENV,
    HoldForTest,
    StepEnd,
    hold_generate_from_env,
    hold_hooks_from_env,
    run_hooks,
)


def test_no_hold_unless_the_step_variable_is_set(tmp_path):
    assert hold_hooks_from_env({}) == [] and hold_hooks_from_env({HOLD_RELEASE_ENV: str(tmp_path)}) == []
    [hook] = hold_hooks_from_env({HOLD_STEP_ENV: "2", HOLD_RELEASE_ENV: str(tmp_path / "go")})
    assert isinstance(hook, HoldForTest) and (hook.step, hook.release) == (2, str(tmp_path / "go"))
    for env in ({HOLD_STEP_ENV: "2"}, {HOLD_STEP_ENV: "two", HOLD_RELEASE_ENV: "/x"}, {HOLD_STEP_ENV: "0", HOLD_RELEASE_ENV: "/x"}):
        with pytest.raises(ValueError, match=f"{HOLD_STEP_ENV}=.*{HOLD_RELEASE_ENV}=.*needs a step >= 1"):
            hold_hooks_from_env(env)


def test_hold_waits_at_its_step_until_the_release_file_exists(tmp_path):
    release = tmp_path / "go"
    hook = HoldForTest(2, str(release))
    started = time.monotonic()
    assert hook(StepEnd(1, 3)) is None and time.monotonic() - started < 0.1  # another step: no wait
    timer = threading.Timer(0.5, release.touch)
    timer.start()
    assert run_hooks([hook], StepEnd(2, 3)) is None  # a control hook: runs before the step's snapshot
    assert time.monotonic() - started >= 0.5 and release.exists()
    timer.join()


def test_a_release_that_never_comes_stops_the_run_with_the_reason(tmp_path):
    hook = HoldForTest(1, str(tmp_path / "never"), timeout_s=0.3)
    assert hook(StepEnd(1, 3)) == f"test hold: {tmp_path / 'never'} not created within 0.3 s"


def test_the_generate_hold_waits_only_in_its_call_while_its_file_exists(tmp_path):
    hold_generate_from_env(2, {})  # every real run: no variable, no wait
    (tmp_path / "hold-2").touch()
    env = {HOLD_GENERATE_ENV: str(tmp_path)}
    hold_generate_from_env(1, env)  # another call: no wait, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hold-2"]
    timer = threading.Timer(0.5, (tmp_path / "hold-2").unlink)
    started = time.monotonic()
    timer.start()
    hold_generate_from_env(2, env)
    assert time.monotonic() - started >= 0.5  # held until the file was gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"held-2-{os.getpid()}"]  # the test sees it held
    timer.join()
