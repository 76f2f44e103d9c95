"""Admission of synchronous agents (rlray/envs/agents/admission.py ``Admission``, env.agent_threads): a host runs at
most ``agent_threads`` synchronous agent episodes of a batch at once, and under ``env.agent_batching: lockstep`` the
engine calls stay a function of the conversations alone, whatever the agents' timing. End to end without Ray: agents
(tests/fixtures/agents.py ``paced_sync_agent``, ``paced_agent``) call a real HTTP gateway through the real ``openai``
client, on SmolLM2's tokenizer (the tiny-random model's), and ``CallSeededSampler`` stands in for the engine."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from rlray.envs.agents import AgentRequest
from rlray.envs.agents.admission import Admission, admission_waves, thread_shares
from rlray.envs.agents.agent_host import AgentBatch, AgentHost

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "agents.py"
AGENTS = {"sync": f"{FIXTURE}:paced_sync_agent", "async": f"{FIXTURE}:paced_agent"}


class CallSeededSampler:
    """A scripted engine that answers every prompt of call k to actor a with the text ``call a.k``, as
    ``rlray.run.agents.FleetSampler`` seeds a call by its actor and its place among the actor's calls: what an episode
    sees next depends on the call its request went in. It appends each call's (actor, prompts) to ``sampling`` (a list
    the test passes as the batch's sampling)."""

    def __init__(self, actors, sampling, min_version=None) -> None:
        self.num_actors, self.record, self.count = len(actors), sampling, {}

    async def sample(self, actor, prompts, max_new_tokens, stop):
        from rlray.envs.agents.conversation import Sampled
        from tests.fixtures.agents import tokenizer

        k = self.count[actor] = self.count.get(actor, -1) + 1
        self.record.append((actor, [list(p) for p in prompts]))
        await asyncio.sleep(0.005)
        tok = tokenizer()
        ids = tok(f"call {actor}.{k}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [Sampled(list(ids), [-0.5] * len(ids), "stop", 7) for _ in prompts]


def make_host(tiny_model_path, agent_threads, **limits):
    return AgentHost({}, agents=AGENTS, model_dir=tiny_model_path, chat_template="smollm2-tools",
                     sampler_factory=CallSeededSampler, agent_threads=agent_threads, max_episode_tokens=4096,
                     **{"step_timeout_s": 60.0, "episode_timeout_s": 120.0, **limits})


def run_batch(host, agents, sleep_seed, *, actors, max_sleep_s=0.03):
    """Runs one episode per entry of ``agents`` (its agent's name), episode i making 2 or 3 calls (fixed by i) and
    sleeping a random 0-``max_sleep_s`` s (seeded by ``sleep_seed``) before each and after its last; returns (the
    replies, {actor: its engine calls' prompt lists, in order}, {agent: its RunningCount})."""
    from tests.fixtures.agents import RunningCount

    rng, running = random.Random(sleep_seed), {name: RunningCount() for name in set(agents)}
    episodes = []
    for i, name in enumerate(agents):
        calls = 2 + (i * 7 % 3 == 0)
        row = {"prompt": f"Episode {i}.", "calls": calls, "running": running[name],
               "sleeps_s": [rng.uniform(0, max_sleep_s) for _ in range(calls + 1)]}
        episodes.append(AgentRequest(f"{name}-{time.monotonic_ns()}-{i}", name, row, i))
    record: list = []
    replies = host.run_agents(AgentBatch(episodes, [None] * actors, record, 64))
    per_actor = {a: [prompts for actor, prompts in record if actor == a] for a in range(actors)}
    return replies, per_actor, running


@pytest.fixture(scope="module")
def host4(tiny_model_path):
    h = make_host(tiny_model_path, 4)
    yield h
    h.shutdown()


@pytest.mark.parametrize("actors", [1, 2])
def test_synchronous_agents_run_agent_threads_at_a_time_and_lockstep_calls_do_not_depend_on_timing(host4, actors):
    """40 synchronous episodes of 2-3 calls, env.agent_threads=4, random work (0-30 ms) before each call and after the
    last: every episode ends done; exactly 4 agent functions run at once at the peak; the 4 threads are split over the
    actors (2 each with 2 actors), so a call carries at most 4 // actors prompts; and three runs with different
    sleeps send exactly the same engine calls, prompt for prompt (a newcomer takes an ended episode's place in the
    batcher before the batcher can send without it)."""
    runs = [run_batch(host4, ["sync"] * 40, seed, actors=actors) for seed in range(3)]
    replies, calls, running = runs[0]
    assert [(r.stop_reason, r.reward, r.message) for r in replies] == [("done", 1.0, "")] * 40
    assert [r.calls for r in replies] == [2 + (i * 7 % 3 == 0) for i in range(40)]
    assert running["sync"].peak == 4 and running["sync"].now == 0
    sizes = [len(prompts) for a in calls for prompts in calls[a]]
    assert max(sizes) == 4 // actors and sum(sizes) == sum(r.calls for r in replies)
    for other_replies, other_calls, other_running in runs[1:]:
        assert other_calls == calls
        assert [r.segments for r in other_replies] == [r.segments for r in replies]
        assert other_running["sync"].peak == 4


def test_async_agents_start_at_once_beside_admitted_synchronous_ones(host4):
    """24 episodes alternating async and sync on 1 actor, env.agent_threads=4: the 12 async ones all run at once (not
    counted), the sync ones 4 at a time; the first engine call carries the 12 async episodes' first requests and the 4
    admitted sync ones'; two runs with different sleeps send the same calls."""
    agents = ["async", "sync"] * 12
    (replies, calls, running), (_, calls_again, running_again) = (run_batch(host4, agents, s, actors=1) for s in (7, 8))
    assert [(r.stop_reason, r.reward) for r in replies] == [("done", 1.0)] * 24
    assert running["sync"].peak == running_again["sync"].peak == 4
    assert running["async"].peak == 12
    assert len(calls[0][0]) == 16
    assert max(len(p) for p in calls[0]) == 16 and sum(len(p) for p in calls[0]) == sum(r.calls for r in replies)
    assert calls_again == calls


def test_an_episode_s_time_limits_count_from_its_admission(tiny_model_path):
    """env.agent_threads=1, one actor: three synchronous episodes of 1 call, each working 0.45 s before and after it,
    run one after another (~2.7 s in all) under env.episode_timeout_s=1.5: each finishes in ~0.9 s of its own, so all
    three end done (timed from the batch's start, the later ones would not)."""
    host = make_host(tiny_model_path, 1, episode_timeout_s=1.5, step_timeout_s=1.5)
    try:
        from tests.fixtures.agents import RunningCount

        running = RunningCount()
        episodes = [AgentRequest(f"slow-{time.monotonic_ns()}-{i}", "sync",
                                 {"prompt": f"Episode {i}.", "calls": 1, "running": running, "sleeps_s": [0.45, 0.45]},
                                 i) for i in range(3)]
        record: list = []
        started = time.monotonic()
        replies = host.run_agents(AgentBatch(episodes, [None], record, 64))
        took_s = time.monotonic() - started
    finally:
        host.shutdown()
    assert [(r.stop_reason, r.calls) for r in replies] == [("done", 1)] * 3
    assert running.peak == 1 and [len(p) for _, p in record] == [1, 1, 1]
    assert took_s >= 2.7
    # rank 0 waits for such a batch admission_waves x episode_timeout_s (+ watchdog.env_call_s), not one limit
    assert admission_waves({0: 3}, 1) == 3 and 3 * 1.5 > took_s


def test_threads_are_dealt_one_per_actor_then_in_turn_and_waves_bound_a_batch():
    # 8 threads over 10 and 3 episodes: 1 each, then 2-2, 3-3, then actor 0 alone (actor 1 is full): 5 and 3
    assert thread_shares({0: 10, 1: 3}, 8) == {0: 5, 1: 3}
    assert admission_waves({0: 10, 1: 3}, 8) == 2  # ceil(10 / 5), ceil(3 / 3)
    assert thread_shares({0: 4, 1: 4, 2: 4}, 2) == {0: 1, 1: 1, 2: 1}  # each actor with episodes gets one
    assert admission_waves({0: 4, 1: 4, 2: 4}, 2) == 4
    assert thread_shares({0: 2}, 64) == {0: 2} and admission_waves({0: 2}, 64) == 1
    assert admission_waves({}, 64) == 1  # no synchronous episode: one episode limit


def test_rank_0_gives_a_host_call_as_many_episode_limits_as_its_admission_waves(host4):
    """AgentRollout's deadline for a host's run_agents: the waves of its synchronous episodes, pinned as the host pins
    them (actor_key % actors); async episodes do not count. The host says which agents are synchronous."""
    from rlray.run.agents import AgentRollout

    assert host4.sync_agents() == ["sync"]
    rollout = AgentRollout(object(), [object()], object(), None, env_column="environment", default=None,
                           agents=["sync", "async"], agent_threads=4)
    rollout._sync_agents = set(host4.sync_agents())  # what it asks the first host once (a Ray call)
    requests = [AgentRequest(f"k{i}", "sync" if i % 3 else "async", {}, i) for i in range(30)]
    # 20 sync episodes: actor 0 takes keys 1,2,4,5,... -> on 2 actors 10 each, 2 threads each: 5 waves
    assert rollout._waves(requests, 2) == 5
    assert rollout._waves(requests[:3], 2) == 1  # 2 sync episodes, one per actor
    assert rollout._waves([r for r in requests if r.agent == "async"], 2) == 1


def test_a_cancelled_wait_for_admission_hands_the_place_to_the_next_episode():
    """A batch torn down while episodes wait for admission: an ended episode's place skips a cancelled ticket and goes
    to the next waiting episode (no InvalidStateError from setting a cancelled ticket)."""
    from types import SimpleNamespace

    class Batcher:
        sampler = SimpleNamespace(num_actors=1)

        def __init__(self):
            self.entered, self.left = [], []

        def enter(self, key):
            self.entered.append(key)

        def leave(self, key):
            self.left.append(key)

    async def main():
        batcher = Batcher()
        episodes = [AgentRequest(f"e{i}", "sync", {}, i) for i in range(3)]
        admission = Admission(batcher, episodes, lambda r: True, 1)
        waits = [asyncio.ensure_future(admission.wait(r)) for r in episodes[1:]]
        await asyncio.sleep(0)
        waits[0].cancel()  # episode 1's wait is cancelled
        await asyncio.sleep(0)
        admission.end(episodes[0])  # its place goes to episode 2
        await asyncio.wait_for(waits[1], 1.0)
        return batcher.entered, batcher.left

    assert asyncio.run(main()) == ([0, 2], [0])
