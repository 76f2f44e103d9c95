"""The verifiers bridge: a verifiers 0.4 environment (tests/envs/verifiers/vf_sum.py) scored through its own rubric.

The bridge runs in .venvs/verifiers (`make verifiers-venv`, part of `make install`); the model is a scripted
OpenAI-compatible server (tests/envs/verifiers/fake_openai.py) whose replies make the rubric's values known by hand:
vf_sum's `correct` (weight 1.0) and `formatted` (weight 0.5).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlray.envs.servers import verifiers_bridge
from rlray.envs.servers.verifiers import DEFAULT_VENV, READY_LINE, VerifiersBridge, result_of, venv_python

HERE = Path(__file__).parent / "verifiers"
VF_SUM = {"taskset": {"id": "vf_sum"}, "agent": {"harness": {"id": "null"}}}

needs_venv = pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "python").exists() and "RLRAY_VERIFIERS_PYTHON" not in os.environ,
                                reason="no .venvs/verifiers: `make verifiers-venv` (make install) builds it")


def _trace(rewards, metrics=None, errors=()):
    reward = sum(r.score * r.weight for r in rewards.values() if r is not None)
    return SimpleNamespace(rewards=rewards, metrics=metrics or {}, errors=list(errors), reward=reward)


def _r(score, weight):
    return SimpleNamespace(score=score, weight=weight)


def test_summarize_takes_verifiers_rewards_as_they_are():
    one = SimpleNamespace(traces=[_trace({"correct": _r(1.0, 1.0), "formatted": _r(0.0, 0.5)}, {"length": 12.0})],
                          errors=[], ok=True, num_turns=1)
    got = verifiers_bridge.summarize(one)
    assert got == {"reward": 1.0, "scores": {"correct": 1.0, "formatted": 0.0}, "weights": {"correct": 1.0, "formatted": 0.5},
                   "metrics": {"length": 12.0}, "ok": True, "errors": [], "turns": 1}
    # two traces (a multi-agent episode): rewards and scores averaged; a score that did not run (None) is left out
    two = SimpleNamespace(traces=[_trace({"correct": _r(1.0, 1.0), "formatted": _r(1.0, 0.5)}),
                                  _trace({"correct": _r(0.0, 1.0), "formatted": None})],
                          errors=[SimpleNamespace(type="TaskError", message="boom")], ok=False, num_turns=3)
    got = verifiers_bridge.summarize(two)
    assert got["reward"] == (1.5 + 0.0) / 2 and got["scores"] == {"correct": 0.5, "formatted": 1.0}
    assert got["errors"] == ["TaskError: boom"] and got["ok"] is False and got["turns"] == 3
    # nothing scored: no reward, and rlray fails the episode with verifiers' errors
    none = SimpleNamespace(traces=[], errors=[SimpleNamespace(type="ProviderError", message="no model")], ok=False,
                           num_turns=0)
    assert verifiers_bridge.summarize(none)["reward"] is None
    with pytest.raises(RuntimeError, match="ProviderError: no model"):
        result_of(verifiers_bridge.summarize(none))
    assert verifiers_bridge.READY_LINE == READY_LINE


def test_a_missing_venv_names_the_make_target(tmp_path):
    with pytest.raises(FileNotFoundError, match="make verifiers-venv"):
        venv_python(tmp_path / "nope" / "python")


def test_the_bridge_as_a_supervised_servers_spec(tmp_path):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    bridge = VerifiersBridge(VF_SUM, paths=[HERE], python=str(python), max_concurrent=4)
    argv = bridge.command()
    assert argv[:2] == [str(python), str(verifiers_bridge.__file__)] and argv[argv.index("--port") + 1] == "0"
    fields = bridge.spec_fields("vf_sum")
    assert fields["command"][0] == "python" and fields["command"][1:] == (*argv[1:5], "{host}", "--port", "{port}",
                                                                        "--path", str(HERE.resolve()),
                                                                        "--max-concurrent", "4")
    assert (fields["python"], fields["health_path"], fields["max_sessions"]) == (str(python), "/health", 4)


@pytest.fixture(scope="module")
def fake_model():
    """The scripted model server, in the verifiers venv; yields its base URL."""
    python = venv_python()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([str(python), str(HERE / "fake_openai.py")], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not (found := re.search(r"fake-openai on (\d+)", Path(log.name).read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
        time.sleep(0.1)
    yield f"http://127.0.0.1:{found.group(1)}"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


@needs_venv
def test_the_bridge_scores_each_episode_through_the_rubric(fake_model):
    asyncio.run(_scores_by_hand(fake_model))


async def _scores_by_hand(fake_model):
    bridge = VerifiersBridge(VF_SUM, paths=[HERE], max_concurrent=4)
    try:
        # task 0 is 1 + 3, task 1 is 2 + 5 (vf_sum's load()); reward = 1.0 * correct + 0.5 * formatted
        cases = [({"task_index": 0}, "right", 1.5, 1.0, 1.0), ({"task_index": 1}, "wrong", 0.5, 0.0, 1.0),
                 ({"task_index": 1}, "twice", 1.0, 1.0, 0.0), ({"task_index": 0}, "bare", 0.0, 0.0, 0.0),
                 ({"task": {"a": 10, "b": -4, "prompt": "What is 10 + -4? Answer in <answer></answer> tags."}},
                  "right", 1.5, 1.0, 1.0)]
        for row, mode, reward, correct, formatted in cases:
            got = await bridge.rollout(row, f"{fake_model}/{mode}/v1")
            assert (got.reward, got.scores) == (reward, {"correct": correct, "formatted": formatted}), (row, mode)
        assert bridge.starts == 1

        with pytest.raises(ValueError, match="'task_index' or 'task'"):
            await bridge.rollout({"prompt": "x"}, f"{fake_model}/right/v1")
        with pytest.raises(RuntimeError, match="task_index 99 is outside the taskset's 8 tasks"):
            await bridge.rollout({"task_index": 99}, f"{fake_model}/right/v1")
        with pytest.raises(RuntimeError, match="did not score the episode"):  # no model there: verifiers' error
            await bridge.rollout({"task_index": 0}, "http://127.0.0.1:9/v1")

        # a bridge that died is started again by the next episode, which scores as before
        os.killpg(bridge._proc.pid, signal.SIGKILL)
        bridge._proc.wait()
        got = await bridge.rollout({"task_index": 2}, f"{fake_model}/right/v1")  # 3 + 7
        assert (got.reward, bridge.starts) == (1.5, 2)
    finally:
        bridge.stop()
    assert not bridge.alive


@needs_venv
def test_a_taskset_that_does_not_load_is_a_clear_error():
    bridge = VerifiersBridge({"taskset": {"id": "no_such_taskset"}}, paths=[HERE], start_timeout_s=60)
    with pytest.raises(RuntimeError, match=r"exited with code 1(.|\n)*no_such_taskset"):
        bridge.ensure()
    assert not bridge.alive and bridge.starts == 1
