"""The sandbox (rlray.sandbox): a child process built from a factory, called over a pipe, killed at its time limit,
restarted after a crash; errors of the code inside come back typed. (Untrusted reward code under its limits:
tests/faults/test_reward_faults.py; sandboxed environments: tests/envs/test_host.py.)"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from rlray import hangs
from rlray.sandbox import Limits, ProcessSandbox, SandboxCrashed, SandboxError, SandboxTimeout

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import faulty_rewards  # noqa: E402  (by name: sandbox children import it from sys.path)


def test_process_sandbox_timeout_crash_and_errors():
    box = ProcessSandbox(faulty_rewards.sleep_then_double, {"seconds": 0.0}, timeout_s=5.0, name="doubler")
    try:
        assert box(21) == 42
        with pytest.raises(SandboxError, match=r"TypeError: unsupported operand type\(s\) for \*: 'dict' and 'int'") as err:
            box({"a": 1})
        assert err.value.type_name == "TypeError" and isinstance(err.value.original, TypeError)
        assert box("ab") == "abab"  # the child serves on after an error
    finally:
        box.close()
    slow = ProcessSandbox(faulty_rewards.sleep_then_double, {"seconds": 30.0}, timeout_s=1.0, name="slow")
    pid = slow.pid
    try:
        with pytest.raises(SandboxTimeout, match="slow: a call took longer than 1 s; the process was killed"):
            slow(1)
        assert slow.pid != pid  # a fresh child took over
    finally:
        slow.close()
    dies = ProcessSandbox(faulty_rewards.exit_now, timeout_s=5.0, name="dies")
    try:
        with pytest.raises(SandboxCrashed, match=r"dies: the process died during a call \(exit code 3\)"):
            dies()
    finally:
        dies.close()
    with pytest.raises(SandboxError, match="ZeroDivisionError: division by zero"):
        ProcessSandbox(faulty_rewards.fails_to_build, timeout_s=5.0)


@pytest.mark.parametrize("untrusted", [False, True])
def test_a_call_past_its_limit_carries_the_stacks_taken_from_the_child_before_the_kill(untrusted):
    box = ProcessSandbox(faulty_rewards.sleep_then_double, {"seconds": 30.0}, timeout_s=1.0, name="slow",
                         limits=Limits(untrusted=untrusted))
    pid = box.pid
    try:
        assert hangs.catches_stack_signal(pid)  # registered before the limits (an untrusted child's env is emptied)
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeout, match="slow: a call took longer than 1 s") as err:
            box(1)
        assert time.monotonic() - t0 < 1.0 + 5.0  # the limit, then the stacks (a fraction of a second) and the kill
        assert err.value.pid == pid and box.pid != pid
        # faulthandler's format, innermost first: the sleep inside the served callable, called by the child's loop
        assert re.search(r'File ".*faulty_rewards\.py", line 46 in call\n  File ".*sandbox\.py", line \d+ in '
                         r"_child_main", err.value.stacks), err.value.stacks
        assert not hangs.stack_file(pid).exists()  # the killed child's stack file goes with it
    finally:
        box.close()
