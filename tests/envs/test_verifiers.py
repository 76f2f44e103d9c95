"""The verifiers bridge: a verifiers 0.4 environment (tests/envs/verifiers/vf_sum.py) scored through its own rubric,
the bridge run by the server supervisor (restarted when killed, its open episode a counted failure).

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
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlray.envs.servers import ServerDown, ServerStartError, supervisor, verifiers_bridge
from rlray.envs.servers.verifiers import BRIDGES, DEFAULT_VENV, VerifiersBridge, bridge_spec, result_of, venv_python

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


def test_a_missing_venv_names_the_make_target(tmp_path):
    with pytest.raises(FileNotFoundError, match="make verifiers-venv"):
        venv_python(tmp_path / "nope" / "python")


def test_the_bridge_is_a_server_spec_in_the_verifiers_venv(tmp_path):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    spec = bridge_spec(VF_SUM, paths=[HERE], python=str(python), max_concurrent=4, max_restarts=2)
    assert spec.command == ("python", str(verifiers_bridge.__file__), "--env", '{"taskset": {"id": "vf_sum"}, "agent": '
                            '{"harness": {"id": "null"}}}', "--host", "{host}", "--port", "{port}",
                            "--path", str(HERE.resolve()), "--max-concurrent", "4")
    assert (spec.name, spec.python, spec.health_path, spec.max_sessions, spec.max_restarts, spec.host) == (
        "verifiers-vf_sum", str(python), "/health", 4, 2, "127.0.0.1")
    unbounded = bridge_spec(VF_SUM, python=str(python), name="mine")
    assert unbounded.name == "mine" and unbounded.max_sessions == 64 and "--max-concurrent" not in unbounded.command


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
def test_the_bridge_scores_each_episode_through_the_rubric(fake_model, tmp_path):
    asyncio.run(_scores_by_hand(fake_model, tmp_path))


async def _scores_by_hand(fake_model, tmp_path):
    bridge = VerifiersBridge(bridge_spec(VF_SUM, paths=[HERE], max_concurrent=4), str(tmp_path))
    try:
        # task 0 is 1 + 3, task 1 is 2 + 5 (vf_sum's load()); reward = 1.0 * correct + 0.5 * formatted
        cases = [({"task_index": 0}, "right", 1.5, 1.0, 1.0), ({"task_index": 1}, "wrong", 0.5, 0.0, 1.0),
                 ({"task_index": 1}, "twice", 1.0, 1.0, 0.0), ({"task_index": 0}, "bare", 0.0, 0.0, 0.0),
                 ({"task": {"a": 10, "b": -4, "prompt": "What is 10 + -4? Answer in <answer></answer> tags."}},
                  "right", 1.5, 1.0, 1.0)]
        for row, mode, reward, correct, formatted in cases:
            got = await bridge.rollout(row, f"{fake_model}/{mode}/v1")
            assert (got.reward, got.scores) == (reward, {"correct": correct, "formatted": formatted}), (row, mode)
        assert (bridge.server.generation, bridge.supervisor.restarts()) == (1, {"verifiers-vf_sum": 0})
        assert bridge.server.log_path == tmp_path / "verifiers-vf_sum.log"
        assert verifiers_bridge.READY_LINE in bridge.server.log_path.read_text()  # the bridge's output is in its log

        with pytest.raises(ValueError, match="'task_index' or 'task'"):
            await bridge.rollout({"prompt": "x"}, f"{fake_model}/right/v1")
        with pytest.raises(RuntimeError, match="task_index 99 is outside the taskset's 8 tasks"):
            await bridge.rollout({"task_index": 99}, f"{fake_model}/right/v1")
        with pytest.raises(RuntimeError, match="did not score the episode"):  # no model there: verifiers' error
            await bridge.rollout({"task_index": 0}, "http://127.0.0.1:9/v1")
    finally:
        bridge.stop()
    assert not bridge.server.alive()


@needs_venv
def test_a_taskset_that_does_not_load_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "START_ATTEMPTS", 1)  # its retries are test_supervisor's; one import of verifiers
    # the bridge exits as soon as verifiers is imported; on a loaded 2-core machine that import took over 60 s once,
    # and the error wanted is its exit status, never the start timeout: the timeout is generous
    bridge = VerifiersBridge(bridge_spec({"taskset": {"id": "no_such_taskset"}}, paths=[HERE], start_timeout_s=240),
                             str(tmp_path))
    with pytest.raises(ServerStartError, match=r"exited with status 1(.|\n)*no_such_taskset"):
        bridge.start()
    assert not bridge.server.alive() and bridge.server.failed
    with pytest.raises(ServerDown, match="is down"):  # later episodes fail at once, counted
        asyncio.run(bridge.rollout({"task_index": 0}, "http://127.0.0.1:9/v1"))


@needs_venv
def test_a_killed_bridge_is_restarted_and_its_open_episode_is_a_counted_failure(tiny_model_path, tmp_path):
    """The agent of configs/envs/verifiers_sum_smollm2.yaml in an AgentHost (no Ray), its model calls answered by the
    scripted engine after 10 s: the bridge is killed while an episode waits on the gateway. That episode fails
    (env_error, one of the stop reasons env/failed counts), the supervisor restarts the bridge on the same URL, and the
    next episode is scored by the rubric ("The answer is 4." has no <answer> tag: correct 0, formatted 0, reward 0)."""
    from rlray.envs.agents import AgentRequest
    from rlray.envs.agents.agent_host import AgentBatch, AgentHost
    from rlray.envs.episode import FAILED_STOP_REASONS
    from tests.fixtures.agents import ScriptedSampler

    host = AgentHost({}, agents={"vf_sum": f"{HERE / 'vf_sum_agent.py'}:agent"}, model_dir=tiny_model_path,
                     chat_template="smollm2-tools", sampler_factory=ScriptedSampler, max_turns=4,
                     max_episode_tokens=1024, step_timeout_s=180.0, episode_timeout_s=300.0)
    replies: list = []
    try:
        before = len(ScriptedSampler.calls)
        batch = AgentBatch([AgentRequest("vf-killed", "vf_sum", {"prompt": "What is 1 + 3?", "task_index": 0}, 0)],
                           [None], 10.0, 16)
        worker = threading.Thread(target=lambda: replies.extend(host.run_agents(batch)), daemon=True)
        worker.start()
        deadline = time.monotonic() + 240
        while len(ScriptedSampler.calls) == before and time.monotonic() < deadline:
            time.sleep(0.1)  # until the harness's first model call reached the gateway: the episode is open
        assert len(ScriptedSampler.calls) > before, "the bridge's harness never called the gateway"
        (bridge,) = [b for b in BRIDGES.values() if b.spec.name == "verifiers-vf_sum"]
        server, url = bridge.server, bridge.server.url
        generation = server.generation
        os.killpg(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while server.alive() and server.generation == generation and time.monotonic() < deadline:
            time.sleep(0.05)  # dead, or already restarted by the supervisor's watcher (a loaded machine sees either)
        assert not server.alive() or server.generation > generation
        worker.join(60)
        (killed,) = replies
        assert killed.stop_reason == "env_error" and killed.stop_reason in FAILED_STOP_REASONS
        assert "dropped the episode" in killed.message and killed.reward is None
        deadline = time.monotonic() + 120
        while server.generation < 2 and time.monotonic() < deadline:  # the supervisor's watcher restarts it
            time.sleep(0.1)
        assert (server.generation, bridge.supervisor.restarts(), server.url) == (2, {"verifiers-vf_sum": 1}, url)
        (after,) = host.run_agents(AgentBatch([AgentRequest("vf-after", "vf_sum", {"prompt": "What is 1 + 3?",
                                                                                  "task_index": 0}, 0)], [None], None, 16))
        assert (after.stop_reason, after.reward) == ("done", 0.0)
    finally:
        host.shutdown()
        for key, bridge in list(BRIDGES.items()):
            bridge.stop()
            del BRIDGES[key]
