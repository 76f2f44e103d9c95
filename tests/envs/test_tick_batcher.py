"""The agent host's ``TickBatcher`` alone (rlray/envs/agents/agent_host.py), without Ray, HTTP or an engine: episodes
are coroutines that ask at jittered times, a fake sampler records each engine call and answers from the call's seed
(as ``rlray.run.agents.FleetSampler`` seeds: per actor, by the count of its earlier calls)."""

from __future__ import annotations

import asyncio
import random

import pytest

from rlray.envs.agents.agent_host import GatewayStats, TickBatcher
from rlray.envs.agents.conversation import Sampled


class SeededSampler:
    """Two actors; call k to actor a has seed 1000 * a + k, and each prompt's sample is its last token plus the seed
    (so what an episode sees next depends on the call it went in, as with a real engine seeded per call)."""

    num_actors = 2

    def __init__(self, call_s: float = 0.01) -> None:
        self.calls: list[tuple[int, int, list[list[int]]]] = []  # (actor, seed, prompts)
        self.count = {0: 0, 1: 0}
        self.call_s = call_s

    async def sample(self, actor, prompts, max_new_tokens, stop):
        seed = 1000 * actor + self.count[actor]
        self.count[actor] += 1
        self.calls.append((actor, seed, [list(p) for p in prompts]))
        await asyncio.sleep(self.call_s)
        return [Sampled([p[-1] + seed], [0.0], "stop", 0) for p in prompts]


async def run_episodes(batching: str, jitter_seed: int, turns: dict[int, int], max_jitter_s: float = 0.03,
                       call_s: dict[int, float] | None = None) -> tuple[list, dict[int, list[int]], GatewayStats]:
    """Runs episodes {actor key: turns} at once, each sleeping a jittered time (seeded by ``jitter_seed``) before each
    call (an agent's own work); returns (the engine calls, each episode's token history, the stats)."""
    sampler, stats, rng = SeededSampler(), GatewayStats(), random.Random(jitter_seed)
    batcher = TickBatcher(sampler, stats, dict(call_s or {}), batching)
    delays = {key: [rng.uniform(0, max_jitter_s) for _ in range(n)] for key, n in turns.items()}
    for key in turns:
        batcher.enter(key)

    async def episode(key: int) -> list[int]:
        history = [key]
        try:
            for delay in delays[key]:
                await asyncio.sleep(delay)
                got = await batcher.sample(key, list(history), 8, ())
                history += got.token_ids
        finally:
            batcher.leave(key)
        return history

    histories = await asyncio.gather(*(episode(k) for k in turns))
    return sampler.calls, dict(zip(turns, histories, strict=True)), stats


TURNS = {0: 3, 1: 1, 2: 2, 3: 3, 4: 2, 5: 1}  # actor key -> calls; even keys on actor 0, odd on actor 1


def test_lockstep_makes_the_same_calls_and_samples_whatever_the_timing():
    """Five jitter seeds (each episode's agent work 0-30 ms before each call, against 10 ms engine calls): the same
    engine calls (actor, seed, prompts in episode order) and the same samples every time; each call holds every
    episode of its actor that is still running."""
    runs = [asyncio.run(run_episodes("lockstep", seed, TURNS)) for seed in range(5)]
    calls, histories, _ = runs[0]
    calls = sorted(calls)  # per actor in seed order (the two actors' calls interleave as they come)
    assert all((sorted(c), h) == (calls, histories) for c, h, _ in runs[1:])
    # actor 0: keys 0 (3 calls), 2 (2), 4 (2) -> calls of 3, 3 and 1 prompts; actor 1: keys 1 (1), 3 (3), 5 (1)
    assert [(a, s, len(p)) for a, s, p in calls if a == 0] == [(0, 0, 3), (0, 1, 3), (0, 2, 1)]
    assert [(a, s, len(p)) for a, s, p in calls if a == 1] == [(1, 1000, 3), (1, 1001, 1), (1, 1002, 1)]
    assert calls[0][2] == [[0], [2], [4]]  # in episode (actor key) order
    # key 0: 0 -> +0 (seed 0) -> +1 (seed 1) -> +2 (seed 2); key 3: 3 -> 1003 -> 2004 -> 3006
    assert histories[0] == [0, 0, 1, 3] and histories[3] == [3, 1003, 2004, 3006]


def test_window_sends_without_a_late_episode_and_lockstep_waits_for_it():
    """Episode 2 works 300 ms before its first call, episode 0 asks at once; the actor's previous call took 100 ms (a
    10 ms window): window sends episode 0 alone and episode 2 in a call of its own (a seed later), lockstep sends both
    in one call after ~300 ms (counted in batch_wait_s)."""
    turns = {0: 1, 2: 1}

    async def late(batching):
        sampler, stats = SeededSampler(), GatewayStats()
        batcher = TickBatcher(sampler, stats, {0: 0.1}, batching)
        for key in turns:
            batcher.enter(key)

        async def episode(key, delay):
            await asyncio.sleep(delay)
            try:
                return (await batcher.sample(key, [key], 8, ())).token_ids
            finally:
                batcher.leave(key)

        got = await asyncio.gather(episode(0, 0.0), episode(2, 0.3))
        return sampler.calls, got, stats

    calls, got, stats = asyncio.run(late("window"))
    assert calls == [(0, 0, [[0]]), (0, 1, [[2]])] and got == [[0], [3]]
    assert stats.batch_wait_s < 0.25
    calls, got, stats = asyncio.run(late("lockstep"))
    assert calls == [(0, 0, [[0], [2]])] and got == [[0], [2]]
    assert 0.25 < stats.batch_wait_s < 5.0
    assert stats.engine_calls == 1 and stats.engine_prompts == 2


def test_lockstep_stops_waiting_for_an_episode_that_ends_without_asking():
    """An episode that never asks (stuck, then ended by its time limit: ``leave``) holds its actor's call only until
    it ends; the call goes without it."""
    async def stuck_then_ended():
        sampler = SeededSampler()
        batcher = TickBatcher(sampler, GatewayStats(), {}, "lockstep")
        batcher.enter(0)
        batcher.enter(2)

        async def stuck():
            await asyncio.sleep(0.2)  # the episode time limit, as run_agent_episode's watch ends it
            batcher.leave(2)

        async def asks():
            try:
                return (await batcher.sample(0, [0], 8, ())).token_ids
            finally:
                batcher.leave(0)

        loop = asyncio.get_running_loop()
        started = loop.time()
        got, _ = await asyncio.gather(asks(), stuck())
        return sampler.calls, got, loop.time() - started

    calls, got, took_s = asyncio.run(stuck_then_ended())
    assert calls == [(0, 0, [[0]])] and got == [0] and 0.2 <= took_s < 5.0


def test_an_unknown_batching_mode_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"env.agent_batching='fast': need one of \['lockstep', 'window'\]"):
        TickBatcher(SeededSampler(), GatewayStats(), {}, "fast")
