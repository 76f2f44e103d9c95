"""benchmarks/gateway.py: its two runs differ only in how the task runs, its summary, and its capacity measurement (a
second's worth, on the instant engine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rlray.config import load_config
from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    yield load_bench("gateway")


def test_the_two_runs_train_the_same_task_one_behind_the_gateway(bench, tmp_path):
    size = bench.SIZES["default"]
    native = load_config(bench.CONFIG, bench.overrides("native", size, tmp_path))
    agent = load_config(bench.CONFIG, bench.overrides("agent", size, tmp_path))
    assert native.env.environments and not native.env.agents
    # the shipped rows name their environment (column environment: retry_arith): the agent takes that name
    assert agent.env.agents == {"retry_arith": bench.AGENT} and list(native.env.environments) == ["retry_arith"]
    assert not agent.env.environments and agent.env.default is None
    assert native.model_dump(exclude={"env"}) == agent.model_dump(exclude={"env"})
    rows = [json.loads(line) for line in Path(native.data.train_files[0]).read_text().splitlines()[:50]]
    assert {r["environment"] for r in rows} == {"retry_arith"}
    env_agent = load_bench("env_agent")  # the agent plays the config's episode: its system prompt, turns
    assert env_agent.SYSTEM_PROMPT == native.data.system_prompt and env_agent.MAX_TURNS == native.env.max_turns


def test_the_agent_plays_the_environment_as_the_episode_loop_does(bench):
    env_agent = load_bench("env_agent")
    answers = iter(["12", "16"])  # wrong, then right: reward 0.5 on the second attempt
    sent = []

    class Client:
        class chat:  # noqa: N801 - the openai client's shape
            class completions:  # noqa: N801
                @staticmethod
                async def create(model, messages):
                    sent.append([dict(m) for m in messages])
                    message = type("M", (), {"content": next(answers)})()
                    return type("R", (), {"choices": [type("C", (), {"message": message, "finish_reason": "stop"})()]})()

    row = {"a": 7, "op": "+", "b": 9, "answer": 16, "feedback": "direction"}
    assert asyncio.run(env_agent.retry_arith_agent(Client(), row)) == 0.5
    assert sent[0][0] == {"role": "system", "content": env_agent.SYSTEM_PROMPT} and len(sent) == 2
    assert sent[1][-2] == {"role": "assistant", "content": "12"} and sent[1][-1]["role"] == "user"


def test_summary_and_capacity(bench):
    run = {"generated_tokens": [100.0, 200.0, 400.0], "timings": {"timing/step_s": [9.0, 4.0, 6.0],
                                                                 "timing/rollout_s": [5.0, 2.0, 2.0]},
           "series": {"env/turns_mean": [2.0, 2.0, 3.0], "env/gateway_calls_mean": [None, None, None],
                      "env/template_drift": [None, None, None], "env/failed": [0.0, 0.0, 1.0]}}
    got = bench.summarise([run], warmup=1)
    assert (got["step_s"], got["rollout_s"], got["generated_tokens"]) == (5.0, 2.0, 300.0)
    assert got["rollout_s_per_1k_tokens"] == (10.0 + 5.0) / 2 and got["failed"] == 1.0 and got["gateway_calls_mean"] is None
    again = {**run, "timings": {"timing/step_s": [1.0, 8.0, 10.0], "timing/rollout_s": [1.0, 4.0, 4.0]}}
    pooled = bench.summarise([run, again], warmup=1)  # the kept steps of both runs: 4, 6, 8, 10
    assert (pooled["runs"], pooled["steps"], pooled["step_s"], pooled["step_s_per_run"]) == (2, 4, 7.0, [5.0, 9.0])
    assert pooled["failed"] == 2.0 and "agent / native - 1" in bench.overhead_table(
        {"runs": {"native": got, "agent": pooled}, "overhead": {"step_s": 0.4, "rollout_s_per_1k_tokens": 0.1}})
    rows = bench.capacity(2, (1, 8))
    assert [(r["agents"], r["calls"], r["drift"], r["failed"]) for r in rows] == [(1, 2, 0, 0), (8, 16, 0, 0)]
    assert all(r["calls_per_s"] > 0 for r in rows)
    assert "| concurrent agents |" in bench.capacity_table(rows)
