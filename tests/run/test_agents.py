"""Agent episodes on rank 0 (rlray.run.agents): the fleet sampler's Ray calls (fake handles), and AgentRollout over a
real AgentHost actor with a scripted engine: agent rows next to single-turn rows, segments, failures, a dead host."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
import types
from pathlib import Path

import pytest
import ray

from rlray.data import PromptRow
from rlray.envs.agents.conversation import Sampled
from rlray.hangs import ActorProcess, HangError, HangWatch
from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.fleet import RolloutError
from rlray.rollout.types import AgentInfo, EpisodeInfo
from rlray.run.agents import AgentRollout, FleetSampler, agent_metrics
from rlray.run.episodes import await_hosts

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "agents.py"
AGENTS = {n: f"{FIXTURE}:{n}" for n in ("tool_agent", "rewriting_agent", "raising_agent")}


class FakeActor:
    """A rollout actor handle: ``generate.remote`` answers at once (or raises ``ActorDiedError`` when dead), its two
    tokens sampled under ``versions``; ``after`` records each call's arguments after the sampling (its min_version)."""

    def __init__(self, name, dead=False, versions=(5, 5)):
        self.name, self.dead, self.got, self.after, self.versions = name, dead, [], [], list(versions)
        self.generate = types.SimpleNamespace(remote=self._remote)

    def _remote(self, prompts, spec, *after):
        self.got.append((prompts, spec))
        self.after.append(after)
        future = concurrent.futures.Future()
        if self.dead:
            future.set_exception(ray.exceptions.ActorDiedError())
        else:
            future.set_result([Completion(i, 0, [self.name, 2], [-0.1, -0.2], "stop", self.versions[0],
                                          versions=self.versions) for i in range(len(prompts))])
        return types.SimpleNamespace(future=lambda: future)


def test_the_fleet_sampler_calls_the_pinned_actor_with_the_call_s_limits_and_skips_a_dead_one():
    sampling = SamplingSpec(n=4, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=11, stop=("END",))
    alive, dead = FakeActor(100), FakeActor(200, dead=True)
    sampler = FleetSampler([alive, dead], sampling)
    got = asyncio.run(sampler.sample(0, [[1, 2], [3]], 16, ("STOP", "END")))
    assert [s.token_ids for s in got] == [[100, 2], [100, 2]] and got[0].policy_version == 5
    (prompts, spec), = alive.got
    assert prompts == [[1, 2], [3]]
    assert (spec.n, spec.max_new_tokens, spec.temperature, spec.top_p, spec.seed, spec.stop) == (1, 16, 0.7, 0.9, 11,
                                                                                                 ("END", "STOP"))
    got = asyncio.run(sampler.sample(1, [[4]], 8, ()))  # actor 1 died: the call goes to the next one, same seed
    assert got[0].token_ids == [100, 2] and len(dead.got) == 1
    assert dead.got[0][1].seed == alive.got[1][1].seed == 11 + 7_919  # actor 1's first call: 11 + 7919 * 1
    asyncio.run(sampler.sample(0, [[5]], 8, ()))
    assert alive.got[2][1].seed == 11 + 104_729  # actor 0's second call: 11 + 104729 * 1
    asyncio.run(FleetSampler([alive], dataclasses.replace(sampling, seed=None)).sample(0, [[6]], 8, ()))
    assert alive.got[3][1].seed is None  # an unseeded step: the engine's own stream
    with pytest.raises(RolloutError, match="every rollout actor failed"):
        asyncio.run(FleetSampler([dead], sampling).sample(0, [[1]], 8, ()))


def test_with_partial_rollouts_the_fleet_sampler_asks_for_the_batch_s_version_and_keeps_each_token_s():
    """A call may continue across a weight update (rollout.partial): its tokens keep their versions and behaviour
    logprobs, and no call starts under a version older than the batch's (the latest pushed when it was sent) or than
    one a call of the batch already returned (an episode's versions never decrease, on whichever actor)."""
    sampling = SamplingSpec(n=1, max_new_tokens=8, temperature=1.0, seed=3)
    first, second = FakeActor(100, versions=(4, 5)), FakeActor(200, versions=(5, 5))
    sampler = FleetSampler([first, second], sampling, min_version=4)
    (got,) = asyncio.run(sampler.sample(0, [[1]], 8, ()))
    assert (got.versions, got.logprobs, got.policy_version) == ([4, 5], [-0.1, -0.2], 4)
    asyncio.run(sampler.sample(1, [[2]], 8, ()))
    assert (first.after, second.after) == ([(4,)], [(5,)])  # version 5 came back: the next call starts no older
    asyncio.run(FleetSampler([first], sampling).sample(0, [[3]], 8, ()))
    assert first.after[-1] == ()  # without partial rollouts no version is asked for (Ray orders the push first)


def test_the_batcher_sends_an_actor_s_waiting_requests_in_episode_order_not_arrival_order():
    """The same requests make the same engine call (seeded per call by FleetSampler), whichever agent asked first."""
    from rlray.envs.agents.agent_host import GatewayStats, TickBatcher

    class Recorder:
        num_actors = 1

        def __init__(self):
            self.calls = []

        async def sample(self, actor, prompts, max_new_tokens, stop):
            self.calls.append(prompts)
            return [Sampled(p, [0.0] * len(p), "stop", 0) for p in prompts]

    async def three_episodes(arrival):
        sampler = Recorder()
        batcher = TickBatcher(sampler, GatewayStats())
        for key in arrival:
            batcher.enter(key)
        got = await asyncio.gather(*(batcher.sample(key, [key], 4, ()) for key in arrival))
        return sampler.calls, got

    for arrival in ([2, 0, 1], [1, 2, 0]):
        calls, got = asyncio.run(three_episodes(arrival))
        assert calls == [[[0], [1], [2]]]  # one call, in episode (actor key) order
        assert [s.token_ids for s in got] == [[k] for k in arrival]  # each episode gets its own sample back


class FakeFleet:
    """The fleet's face AgentRollout reads: its live actors (the scripted engine counts them), its version, and whether
    its engines run partial rollouts."""

    def __init__(self, partial=False):
        self.live_actors, self.version, self.partial = [None, None], 3, partial
        self.asked = 0

    def usable_actors(self):
        """The actors ready for work (the real fleet waits here for a killed actor, ``resources.node_wait_s``)."""
        self.asked += 1
        return self.live_actors


class FakeInner:
    """The rollout of the non-agent rows: one completion [7, 7] per prompt and sample."""

    def __init__(self):
        self.prompts = []

    def submit(self, prompt_ids, sampling, rows):
        self.prompts.append(prompt_ids)
        return prompt_ids, sampling

    def collect(self, pending):
        ids, sampling = pending
        return [Completion(p, s, [7, 7], [-1.0, -1.0], "stop", 3) for p in range(len(ids)) for s in range(sampling.n)]

    def generate(self, prompt_ids, sampling, rows):
        return self.collect(self.submit(prompt_ids, sampling, rows))


@pytest.fixture(scope="module")
def agent_host(ray_session, tiny_model_path):
    from rlray.envs.agents.agent_host import AgentHost
    from tests.fixtures.agents import ScriptedSampler

    host = ray.remote(AgentHost).options(max_concurrency=4).remote(
        {}, agents=AGENTS, model_dir=tiny_model_path, chat_template="smollm2-tools", sampler_factory=ScriptedSampler,
        max_turns=6, max_episode_tokens=2048)
    ray.get(host.ping.remote())
    yield host
    ray.kill(host)


def test_a_row_naming_no_configured_agent_or_environment_is_an_error():
    rollout = AgentRollout(FakeFleet(), [object()], FakeInner(), None, env_column="environment", default=None,
                           agents=["solver"], environments=["guess"])
    assert rollout.agent_of(PromptRow("a", "x", {"environment": "solver"})) == "solver"
    assert rollout.agent_of(PromptRow("b", "x", {"environment": "guess"})) == ""
    assert rollout.agent_of(PromptRow("c", "x", {})) == ""
    with pytest.raises(ValueError, match=r"prompt row 'd': column 'environment' names 'retry_arith', which is not in "
                                         r"env.agents \['solver'\] or env.environments \['guess'\]"):
        rollout.generate([[1]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0),
                         [PromptRow("d", "x", {"environment": "retry_arith"})])


def test_an_agent_batch_takes_the_actors_the_fleet_waits_for_and_fails_when_none_is_back(monkeypatch):
    """A rollout actor killed just before an agent batch is restarting: the batch asks the fleet for its usable actors
    (which waits up to resources.node_wait_s for it, as a rollout does) instead of failing at once on no live actor."""
    fleet = FakeFleet()
    fleet.live_actors = []  # the only actor was just killed: nothing live yet
    monkeypatch.setattr(fleet, "usable_actors", lambda: (_ for _ in ()).throw(RolloutError("none of the 1 rollout actors "
                                                                                            "is alive")))
    host = type("Host", (), {"run_agents": property(lambda self: pytest.fail("no batch goes out without an actor"))})()
    rollout = AgentRollout(fleet, [host], FakeInner(), None, env_column="environment", default=None, agents=["solver"])
    with pytest.raises(RolloutError, match="none of the 1 rollout actors is alive"):
        rollout.generate([[1]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0),
                         [PromptRow("a", "x", {"environment": "solver"})])


def test_each_step_logs_the_engine_calls_of_its_own_agent_batches_summed_over_the_hosts():
    """A host batch's engine calls ride on its first episode (AgentInfo), so a step's metrics sum its own batches:
    step 1 ran a batch on each of two hosts, step 2 one batch; a single-turn step logs no agent keys."""
    def episode(calls, engine_calls=0, prompts=0, wait_s=0.0, parallel=0):
        info = AgentInfo(gateway_calls=calls, engine_calls=engine_calls, engine_prompts=prompts, batch_wait_s=wait_s,
                         parallel_calls=parallel)
        return Completion(0, 0, [1], [0.0], "stop", 0, episode=EpisodeInfo("solver", "done", calls, [None], agent=info))

    # host 0: 3 episodes, 6 calls in 2 engine calls that waited 0.5 s; host 1: 2 episodes, 4 calls in 2, 0.25 s
    step1 = [episode(2, 2, 6, 0.5), episode(2, parallel=1), episode(2), episode(2, 2, 4, 0.25), episode(2, parallel=1)]
    step2 = [episode(3, 3, 5, 1.5), episode(2)]  # one host: 5 calls in 3 engine calls
    assert agent_metrics(step1, {"solver"}) == {
        "env/template_drift": 0.0, "env/gateway_calls": 10.0, "env/gateway_calls_mean": 2.0,
        "env/agent_engine_calls": 4.0, "env/agent_prompts_per_engine_call": 10 / 4, "env/agent_parallel_calls": 2.0,
        "timing/agent_batch_wait_s": 0.75}
    got = agent_metrics(step2, {"solver"})
    assert (got["env/agent_engine_calls"], got["env/agent_prompts_per_engine_call"], got["timing/agent_batch_wait_s"]) \
        == (3.0, 5 / 3, 1.5)
    assert agent_metrics([episode(0)], {"solver"})["env/agent_prompts_per_engine_call"] == 0.0  # no engine call
    assert agent_metrics([Completion(0, 0, [1], [0.0], "stop", 0)], {"solver"}) == {}  # no agent episode


@pytest.mark.ray
def test_agent_rows_run_behind_the_gateway_next_to_other_rows(agent_host, tiny_tokenizer):
    inner, fleet = FakeInner(), FakeFleet()
    rollout = AgentRollout(fleet, [agent_host], inner, tiny_tokenizer, env_column="environment", default=None,
                           agents=list(AGENTS), prompt_column="question")
    rows = [PromptRow("a", "Add. calls=2", {"environment": "tool_agent"}), PromptRow("s", "single", {}),
            PromptRow("r", "Sum. calls=1", {"environment": "rewriting_agent"}),
            PromptRow("x", "Hi", {"environment": "raising_agent"})]
    got = rollout.collect(rollout.submit([[1], [2], [3], [4]], SamplingSpec(n=2, max_new_tokens=64, temperature=1.0), rows))
    assert [(c.prompt_index, c.sample_index) for c in got] == [(p, s) for p in range(4) for s in range(2)]
    assert inner.prompts == [[[2]]]  # only the single-turn row went to the inner rollout
    assert fleet.asked == 1  # one agent batch, on the actors the fleet found usable
    tool, single, rewrite, raised = got[0], got[2], got[4], got[6]
    assert single.episode is None and single.response_token_ids == [7, 7]
    assert (tool.episode.environment, tool.episode.stop_reason, tool.episode.env_reward) == ("tool_agent", "done", 1.0)
    assert (tool.episode.num_turns, tool.episode.tool_calls, tool.episode.agent.gateway_calls) == (3, 2, 3)
    assert tool.episode.turn_rewards == [None, None, 1.0] and tool.policy_version == 7
    assert tiny_tokenizer.decode(tool.prompt_token_ids).startswith("<|im_start|>system")
    # the rewriting agent: two segments, the earlier one in episode.agent.segments with its own record
    assert rewrite.episode.agent.template_drift == 1 and len(rewrite.episode.agent.segments) == 1
    (earlier,) = rewrite.episode.agent.segments
    assert (earlier.episode.stop_reason, earlier.episode.num_turns) == ("template_drift", 1)
    assert (earlier.prompt_index, earlier.sample_index) == (2, 0)
    # the raising agent failed: its episode is out of the update, the step goes on
    assert raised.episode.failed and raised.episode.stop_reason == "env_error" and "the agent broke" in raised.episode.message
    metrics = agent_metrics(got, set(AGENTS))
    # the host's one batch: its engine calls carried the step's 12 gateway calls, one prompt each
    batching = {k: metrics.pop(k) for k in ("env/agent_engine_calls", "env/agent_prompts_per_engine_call",
                                            "timing/agent_batch_wait_s")}
    assert metrics == {"env/template_drift": 2.0, "env/gateway_calls": 3 + 3 + 2 + 2 + 1 + 1,
                       "env/gateway_calls_mean": (3 + 3 + 2 + 2 + 1 + 1) / 6, "env/agent_parallel_calls": 0.0}
    # lockstep: a call per round and rollout actor of the episodes still asking (3, 3, 2, 2, 1, 1 calls: 3 rounds),
    # two prompts each: 6 calls, the same at every timing
    assert batching["env/agent_engine_calls"] == 6 and batching["timing/agent_batch_wait_s"] >= 0.0
    assert round(batching["env/agent_engine_calls"] * batching["env/agent_prompts_per_engine_call"]) == 12
    assert sum(c.episode.agent.engine_calls > 0 for c in got if c.episode is not None) == 1  # counted once


@pytest.mark.ray
def test_agent_calls_across_weight_updates_reach_the_experience_with_each_token_s_version_and_logprob(agent_host):
    """Partial rollouts (rollout.partial): the batch goes out at the fleet's version 3 and the scripted engine takes a
    weight update inside every call, after its first token. Each sampled token reaches the experience table with the
    version that sampled it and its behaviour logprob; the tool result between two calls (masked out) has the
    version of the token before it; a segment cut where the agent rewrote history keeps its own versions."""
    import numpy as np

    from rlray.run.experience import build_experience, version_stats
    from tests.fixtures.agents import FINAL, tokenizer, tool_call_text

    tok = tokenizer()
    rollout = AgentRollout(FakeFleet(partial=True), [agent_host], FakeInner(), tok, env_column="environment",
                           default=None, agents=list(AGENTS))
    rows = [PromptRow("a", "Add. calls=1", {"environment": "tool_agent"}),
            PromptRow("r", "Sum. calls=1", {"environment": "rewriting_agent"})]
    got = rollout.generate([[1], [2]], SamplingSpec(n=1, max_new_tokens=64, temperature=1.0), rows)
    table = build_experience(rows, [[1], [2]], got, {"reward": [1.0, 1.0]})
    call, final = (len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in
                   (tool_call_text("add", {"a": 0, "b": 2}), FINAL))  # tokens of each call, EOS included
    tool = got[0]
    observed = tool.loss_mask.count(False)  # the tool result the agent sent, as the template renders it
    assert tool.loss_mask == [True] * call + [False] * observed + [True] * final
    # rows: the tool agent's episode, the rewriting agent's last segment, then its earlier segment (cut at the rewrite)
    assert table.column("token_versions").to_pylist() == [
        [3] + [4] * (call - 1) + [4] * observed + [4] + [5] * (final - 1),
        [4] + [5] * (final - 1),
        [3] + [4] * (call - 1)]
    assert table.column("policy_version").to_pylist() == [3, 4, 3]  # each row's oldest token's
    lp = [-(i + 1) / 100 for i in range(max(call, final))]  # the scripted engine's logprob of each call's tokens
    assert table.column("rollout_logprobs").to_pylist() == [
        np.float32(lp[:call] + [0.0] * observed + lp[:final]).tolist(), np.float32(lp[:final]).tolist(),
        np.float32(lp[:call]).tolist()]
    assert table.column("response_mask").to_pylist()[0] == tool.loss_mask
    stats = version_stats(table, 5)  # trained at version 5: the oldest sampled token is 2 versions behind
    assert stats["rollout/partial_samples_frac"] == 1.0 and stats["rollout/token_staleness_max"] == 2.0


@pytest.mark.ray
def test_the_episodes_of_a_dead_host_fail_as_actor_died(ray_session, tiny_model_path, tiny_tokenizer):
    from rlray.envs.agents.agent_host import AgentHost
    from tests.fixtures.agents import ScriptedSampler

    host = ray.remote(AgentHost).remote({}, agents=AGENTS, model_dir=tiny_model_path, sampler_factory=ScriptedSampler)
    ray.get(host.ping.remote())
    ray.kill(host)
    rollout = AgentRollout(FakeFleet(), [host], FakeInner(), tiny_tokenizer, env_column="environment",
                           default="tool_agent", agents=list(AGENTS))
    got = rollout.generate([[1]], SamplingSpec(n=2, max_new_tokens=8, temperature=1.0), [PromptRow("a", "Hi", {})])
    assert [c.episode.stop_reason for c in got] == ["actor_died", "actor_died"] and all(c.episode.failed for c in got)
    assert got[0].loss_mask == [False] and got[0].response_token_ids == [tiny_tokenizer.eos_token_id]


def test_reward_functions_score_an_agent_s_final_conversation():
    """An agent that returns None is scored by reward.functions on its final conversation (the decoded episode: every
    turn it sent and received); one that returns a number adds it as the "env" term."""
    from rlray.reward.server import ScoreResult
    from rlray.rollout.types import EpisodeInfo
    from rlray.run.experience import score

    class Tokenizer:
        def batch_decode(self, ids, skip_special_tokens=True):
            return [" ".join(map(str, x)) for x in ids]

    class Reward:
        seen = []

        def score(self, prompts, texts, columns, ids):
            self.seen.append(texts)
            four = [1.0 if "4" in t.split() else 0.0 for t in texts]
            return ScoreResult(3, {"reward": four, "has_four": four}, [""] * len(texts))

    rows = [PromptRow("a", "What is 2 + 2?", {"environment": "solver"})]
    silent = Completion(0, 0, [2, 9, 4], [-0.1] * 3, "stop", 1, episode=EpisodeInfo("solver", "done", 2, [None, None]))
    paid = Completion(0, 1, [2, 9, 5], [-0.1] * 3, "stop", 1, episode=EpisodeInfo("solver", "done", 2, [None, 0.5], 0.5))
    got = score(Reward(), rows, [silent, paid], Tokenizer(), env_reward_weight=2.0)
    assert Reward.seen == [["2 9 4", "2 9 5"]]  # the whole episode's text: its turns and what came between them
    assert got.values["reward"] == [1.0 + 2.0 * 0.0, 0.0 + 2.0 * 0.5] and got.values["env"] == [0.0, 0.5]
    assert got.values["has_four"] == [1.0, 0.0]


class HungHosts:
    """``ray.wait`` over two hosts' run_agents calls: host 0's answered, host 1's runs ``injected_hang`` (600 s), so
    each wait returns after its timeout with it still pending; stacks and restarts of the hosts, recorded."""

    def __init__(self):
        self.restarted, self.release = [], threading.Event()

    def wait(self, refs, num_returns, timeout, fetch_local):
        self.release.wait(timeout)  # the hung call does not finish within the wait's timeout
        return [r for r in refs if r == "ref-0"], [r for r in refs if r != "ref-0"]

    def stacks(self, host, timeout_s):
        return ActorProcess(f"rlray:{host}", 77, "cd" * 28), '  File "agents.py", line 3 in injected_hang\n'


@pytest.mark.parametrize("action", ["restart", "stop"])
def test_a_run_agents_call_past_episode_timeout_plus_env_call_s_is_reported_with_the_host_stacks(action):
    hosts, alerts = HungHosts(), []
    watch = HangWatch(action, env_call_s=0.5, alert=alerts.append, stacks=hosts.stacks, restart=hosts.restarted.append)
    t0 = time.monotonic()
    try:  # AgentRollout's deadline: env.episode_timeout_s (1.0 here) + watchdog.env_call_s
        await_hosts(watch, ["env-0", "env-1"], {0: "ref-0", 1: "ref-1"}, "run_agents", 1.0 + watch.env_call_s,
                    "env.episode_timeout_s+watchdog.env_call_s", wait=hosts.wait)
    except HangError as err:
        assert action == "stop" and "stopping the run" in str(err)
    assert 1.5 < time.monotonic() - t0 < 1.5 + 3.0  # the deadline plus a wait's second and the report
    assert hosts.restarted == (["env-1"] if action == "restart" else []) and watch.hangs == 1 and len(alerts) == 1
    assert alerts[0].startswith("hang: environment host 1 (rlray:env-1) (pid 77, node cdcdcdcdcdcd) has run run_agents "
                                "for 2.")
    assert "past env.episode_timeout_s+watchdog.env_call_s=1.5 s" in alerts[0]
    assert alerts[0].endswith("in injected_hang")
    hosts.release.set()
