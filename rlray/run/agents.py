"""Agent episodes on rank 0: ``AgentRollout``, a ``RolloutSource`` whose agent rows run behind the hosts' gateways.

A row whose ``env.column`` names an agent (``env.agents``; or every row, with ``env.default`` naming one) becomes
``n`` agent episodes; the other rows go to the rollout it wraps (the episode rollout of the environments, or the
fleet), at the same time. Agent episodes are spread over the environment hosts (``rlray.envs.agents.agent_host.AgentHost``),
one ``run_agents`` call per host with every episode it runs: the agents drive their own loops there, many at once,
and each of their calls is sampled by the episode's rollout actor (``actor_keys`` as the episode loop pins them:
the prefix cache serves its turns) through ``FleetSampler``.

An episode comes back as token sequences (``rlray.envs.agents.conversation.Segment``): the last one is the episode's
``Completion``; when the agent rewrote history, the earlier ones ride in ``EpisodeInfo.agent.segments`` and become rows
of their own in the step's experience (``rlray.run.experience``), each with the episode's reward. A host that dies
fails its episodes (stop reason ``actor_died``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from concurrent.futures import Future
from typing import Any

import ray

from rlray.envs.agents import AgentReply, AgentRequest
from rlray.envs.agents.admission import admission_waves
from rlray.envs.agents.agent_host import AgentBatch
from rlray.envs.agents.conversation import Sampled
from rlray.envs.episode import FAILED_STOP_REASONS
from rlray.hangs import HangWatch
from rlray.rollout import Completion, RolloutSource, SamplingSpec
from rlray.rollout.fleet import ACTOR_ERRORS, RolloutError, RolloutFleet
from rlray.rollout.types import AgentInfo, EpisodeInfo, in_background
from rlray.run.episodes import await_hosts

log = logging.getLogger(__name__)


class FleetSampler:
    """The engine call of an agent host's batch (``rlray.envs.agents.agent_host.Sampler``): a Ray call to a rollout actor.

    Runs in the host. Each call samples with the batch's ``SamplingSpec``, its max new tokens and stop strings set by
    the call, and a seed of its own: the batch's seed (``AgentRollout`` gives each host's batch its own), plus
    ``ACTOR_SEED_STRIDE`` per actor index and ``CALL_SEED_STRIDE`` per earlier call of the batch to the same actor. The
    host's ``TickBatcher`` sends an actor's waiting requests in episode order, so a call's samples are a function of
    the weights, the seed and the requests it carries: a run repeats its agents' samples wherever the batcher gathers
    the same requests into each call, which ``env.agent_batching: lockstep`` (the default) guarantees (``window`` only
    when every running episode asks within the batcher's window). Unseeded
    (``sampling.seed`` None), calls draw from the engine's own stream. When the actor has died, the call goes to the
    next actor (same seed), and so on once around.

    With partial rollouts (``min_version`` given) a call may continue across weight updates, each token keeping the
    version that sampled it and its behaviour logprob (``Sampled.versions``), and it starts only once its actor holds
    ``min_version`` or the newest version a call of the batch has returned so far: no token is older than the batch's
    step allows (``rollout.max_staleness``), and an episode's versions never decrease, also when its call goes to
    another actor.

    Args:
        actors: the rollout actors' handles.
        sampling: the batch's sampling (temperature, top-p, top-k, min-p, stop strings).
        min_version: partial rollouts: the latest policy version pushed when the batch was sent
            (``AgentBatch.min_version``); None: without partial rollouts (no version is asked for).
    """

    ACTOR_SEED_STRIDE = 7_919
    CALL_SEED_STRIDE = 104_729

    def __init__(self, actors: list[Any], sampling: SamplingSpec, min_version: int | None = None) -> None:
        self.actors, self.sampling, self.num_actors = list(actors), sampling, len(actors)
        self._calls: dict[int, int] = {}  # actor index -> calls sent to it so far
        self._floor = min_version  # partial: the oldest version a call may start with (None: not asked for)

    async def sample(self, actor: int, prompts: list[list[int]], max_new_tokens: int,
                     stop: tuple[str, ...]) -> list[Sampled]:
        """Returns one completion per prompt from rollout actor ``actor`` (or the next live one), in order.

        Raises:
            RolloutError: every actor failed the call.
        """
        extra = tuple(s for s in stop if s not in self.sampling.stop)
        count, self._calls[actor] = self._calls.get(actor, 0), self._calls.get(actor, 0) + 1
        seed = None if self.sampling.seed is None else (
            self.sampling.seed + self.ACTOR_SEED_STRIDE * actor + self.CALL_SEED_STRIDE * count)
        spec = dataclasses.replace(self.sampling, n=1, max_new_tokens=max_new_tokens, seed=seed,
                                   stop=tuple(self.sampling.stop) + extra)
        last: Exception | None = None
        for attempt in range(self.num_actors):
            i = (actor + attempt) % self.num_actors
            try:
                after = () if self._floor is None else (self._floor,)  # partial: the call's min_version
                got = await asyncio.wrap_future(self.actors[i].generate.remote(prompts, spec, *after).future())
            except ACTOR_ERRORS as err:
                last = err
                log.warning("rollout actor %d failed an agent call (%s); trying the next", i, type(err).__name__)
                continue
            if self._floor is not None:  # every live actor was sent the versions a call returned: none starts older
                self._floor = max([self._floor, *(v for c in got for v in c.versions)])
            return [Sampled(list(c.response_token_ids), list(c.rollout_logprobs), c.finish_reason, c.policy_version,
                            list(c.versions)) for c in got]
        raise RolloutError(f"every rollout actor failed an agent call; last error: {last}")


class AgentRollout:
    """Rank 0's rollout when agents are configured: agent rows behind the gateways, the other rows through ``inner``.

    A ``rlray.rollout.RolloutSource`` whose pending handle is a ``concurrent.futures.Future`` of the completions.

    Args:
        fleet: the rollout fleet (its live actors sample the agents' calls).
        hosts: the environment hosts' handles (``AgentHost`` actors; at least one).
        inner: the rollout of the other rows (the episode rollout, or the fleet).
        tokenizer: the policy's tokenizer (its EOS is a failed episode's placeholder token).
        env_column: the row column naming a row's agent or environment.
        default: the name of rows without that column (an agent, an environment, or None).
        agents: the configured agent names.
        environments: the configured environment names (a row naming neither an agent nor one of them is an error).
        prompt_column: the data's prompt column (data.prompt_column): the agent's row holds the prompt as ``prompt``
            and under this name too, with every other column.
        watch: rank 0's hang watch (``HangWatch``); None: no deadline. A host's ``run_agents`` call runs its
            episodes, each ended by the host at ``episode_timeout_s``, its synchronous ones ``agent_threads`` at a time
            (``rlray.envs.agents.admission``: a batch may take ``admission_waves`` episode limits end to end); one
            still running ``watch.env_call_s`` after that is reported with the host's stacks, then restarted (its
            episodes fail, stop reason actor_died) or the run stops (``watchdog.on_hang``).
        episode_timeout_s: the host's limit of one agent episode (env.episode_timeout_s), seconds.
        agent_threads: the hosts' env.agent_threads (the synchronous episodes of a batch running at once).

    Raises:
        ValueError: no host.
    """

    def __init__(self, fleet: RolloutFleet, hosts: list[Any], inner: RolloutSource, tokenizer: Any, *, env_column: str,
                 default: str | None, agents: list[str], environments: list[str] = (), prompt_column: str = "prompt",
                 watch: HangWatch | None = None, episode_timeout_s: float = 600.0, agent_threads: int = 64) -> None:
        if not hosts:
            raise ValueError("AgentRollout needs at least one environment host (resources.env.num_workers)")
        self.fleet, self.hosts, self.inner, self.tokenizer = fleet, list(hosts), inner, tokenizer
        self.env_column, self.default, self.agents = env_column, default or "", set(agents)
        self.environments = set(environments)
        self.prompt_column = prompt_column
        self.watch, self.episode_timeout_s = watch, episode_timeout_s
        self._told_parallel = False  # the parallel-calls warning goes once per run
        self.agent_threads, self._sync_agents = agent_threads, None  # the hosts' synchronous agents, asked once

    @property
    def version(self) -> int:
        """Returns the fleet's latest policy version."""
        return self.fleet.version

    def agent_of(self, row: Any) -> str:
        """Returns the agent a prompt row names ("" when it names an environment or nothing).

        Raises:
            ValueError: the row names neither a configured agent nor a configured environment (names the row and both
                lists).
        """
        name = row.columns.get(self.env_column) or self.default
        if name and name not in self.agents and name not in self.environments:
            raise ValueError(f"prompt row '{row.prompt_id}': column '{self.env_column}' names '{name}', which is not in "
                             f"env.agents {sorted(self.agents)} or env.environments {sorted(self.environments)}")
        return str(name) if name in self.agents else ""

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> Future[list[Completion]]:
        """Starts the rollout of ``rows`` (``sampling.n`` per row) on a background thread; returns at once (arguments as
        ``RolloutSource.submit``)."""
        return in_background(lambda: self.generate(prompt_ids, sampling, rows), "rlray-agents")

    def collect(self, pending: Future[list[Completion]]) -> list[Completion]:
        """Returns the completions, prompt-major (``n`` per row), waiting for them.

        Raises:
            whatever the rollout raised (``RolloutError``, a bad row's ``ValueError``).
        """
        return pending.result()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> list[Completion]:
        """Returns the completions of ``sampling.n`` episodes (or samples) per row, prompt-major: agent rows run behind
        the gateways while the other rows run through ``inner``.

        Raises:
            RolloutError: no rollout actor is alive, or ``inner`` failed.
            ValueError: a row names an agent or environment that is not configured.
        """
        agent_rows = [p for p, row in enumerate(rows) if self.agent_of(row)]
        other = [p for p, row in enumerate(rows) if not self.agent_of(row)]
        if not agent_rows:
            return self.inner.generate(prompt_ids, sampling, rows)
        pending = self.inner.submit([prompt_ids[p] for p in other], sampling, [rows[p] for p in other]) if other else None
        got = self._run_agents(agent_rows, rows, sampling)
        if pending is not None:
            for c in self.inner.collect(pending):
                got.append(dataclasses.replace(c, prompt_index=other[c.prompt_index]))
        return sorted(got, key=lambda c: (c.prompt_index, c.sample_index))

    def _run_agents(self, agent_rows: list[int], rows: list[Any], sampling: SamplingSpec) -> list[Completion]:
        """Returns the completions of the agent rows' episodes, run on the hosts (one call per host)."""
        actors = self.fleet.usable_actors()  # a killed actor is waited for (resources.node_wait_s) as a rollout does
        step_key = uuid.uuid4().hex[:12]
        by_host: dict[int, list[tuple[int, int, AgentRequest]]] = {}
        order = 0
        for p in agent_rows:
            row = rows[p]
            columns = {**row.columns, "prompt": row.prompt, self.prompt_column: row.prompt}
            for s in range(sampling.n):
                request = AgentRequest(f"{step_key}-{p}-{s}", self.agent_of(row), columns, order)
                by_host.setdefault(order % len(self.hosts), []).append((p, s, request))
                order += 1
        min_version = self.fleet.version if self.fleet.partial else None  # partial: no call starts older
        refs = {h: self.hosts[h].run_agents.remote(AgentBatch([r for _, _, r in items], actors, host_sampling(sampling, h),
                                                               sampling.max_new_tokens, min_version))
                for h, items in by_host.items()}
        if self.watch is not None:
            waves = max(self._waves([r for _, _, r in items], len(actors)) for items in by_host.values())
            key = "env.episode_timeout_s+watchdog.env_call_s" if waves == 1 else \
                f"{waves} x env.episode_timeout_s (env.agent_threads admits them in {waves} waves)+watchdog.env_call_s"
            await_hosts(self.watch, self.hosts, refs, "run_agents",
                        waves * self.episode_timeout_s + self.watch.env_call_s, key)
        out = []
        for h, items in by_host.items():
            try:
                replies: list[AgentReply | None] = ray.get(refs[h])
            except ACTOR_ERRORS as err:
                log.warning("environment host %d died (%s); its %d agent episodes fail (stop reason actor_died)", h,
                            type(err).__name__, len(items))
                replies = [None] * len(items)
            for (p, s, request), reply in zip(items, replies, strict=True):
                if reply is None:
                    reply = AgentReply(request.key, [], "actor_died", message=f"environment host {h} died")
                out.append(self._completion(p, s, request.agent, reply))
        return out

    def _waves(self, requests: list[AgentRequest], num_actors: int) -> int:
        """Returns how many episode limits a host's batch of ``requests`` may take end to end (``admission_waves`` of
        its synchronous episodes, pinned to ``num_actors`` actors as the host pins them)."""
        if self._sync_agents is None:  # every host loads the same agents
            self._sync_agents = set(ray.get(self.hosts[0].sync_agents.remote(), timeout=60))
        pinned = collections.Counter(r.actor_key % num_actors for r in requests if r.agent in self._sync_agents)
        return admission_waves(pinned, self.agent_threads)

    def _completion(self, p: int, s: int, agent: str, reply: AgentReply) -> Completion:
        """Returns an agent episode's completion: its last segment, the earlier ones in ``episode.agent.segments``."""
        failed = reply.stop_reason in FAILED_STOP_REASONS
        segments = [  # an earlier segment's own record: where it ended (the rewrite), its turns
            Completion(p, s, seg.response_ids, seg.logprobs, seg.finish_reason, min(seg.policy_versions), seg.loss_mask,
                       prompt_token_ids=seg.prompt_ids, versions=seg.versions,
                       episode=EpisodeInfo(agent, "template_drift", seg.num_turns, [None] * seg.num_turns, failed=failed,
                                           observation_tokens=seg.observation_tokens))
            for seg in reply.segments]
        turns = sum(seg.num_turns for seg in reply.segments)
        if failed:
            log.warning("agent episode %s (%s) failed: %s %s", reply.key, agent, reply.stop_reason, reply.message[:300])
        if reply.parallel_calls and not self._told_parallel:
            self._told_parallel = True
            log.warning("agent episode %s (%s) made %d calls while another of its calls was being answered: the gateway "
                        "answers them one at a time in the order they come, so this run's agent samples can differ from "
                        "a rerun's or a resumed run's (env/agent_parallel_calls counts them; bit-for-bit repeats need "
                        "agents that await each call before the next)", reply.key, agent, reply.parallel_calls)
        info = EpisodeInfo(
            environment=agent, stop_reason=reply.stop_reason, num_turns=turns,
            turn_rewards=[None] * max(turns - 1, 0) + [reply.reward] if turns else [], env_reward=reply.reward,
            failed=failed, tool_calls=reply.tool_calls, tool_errors=reply.tool_errors,
            observation_tokens=sum(seg.observation_tokens for seg in reply.segments), metrics=dict(reply.metrics),
            scores=dict(reply.scores), message=reply.message, agent=AgentInfo(
                segments[:-1], gateway_calls=reply.calls, template_drift=reply.drift, engine_calls=reply.engine_calls,
                engine_prompts=reply.engine_prompts, batch_wait_s=reply.batch_wait_s, parallel_calls=reply.parallel_calls),
        )
        if not segments:  # no answered call: one masked-out placeholder token
            eos = int(self.tokenizer.eos_token_id)
            return Completion(p, s, [eos], [0.0], "stop", self.fleet.version, [False], prompt_token_ids=[eos], episode=info)
        return dataclasses.replace(segments[-1], episode=info)


AGENT_SEED_OFFSET = 500_000_003  # agents' calls: away from the seeds of the episode loop's turns
HOST_SEED_STRIDE = 15_485_863


def host_sampling(sampling: SamplingSpec, host: int) -> SamplingSpec:
    """Returns the sampling of environment host ``host``'s agent batch: the step's, with a seed of its own
    (``AGENT_SEED_OFFSET`` + ``HOST_SEED_STRIDE`` per host; ``FleetSampler`` derives each call's from it), or None
    when the step's is None."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + AGENT_SEED_OFFSET + HOST_SEED_STRIDE * host)


def agent_metrics(completions: list[Completion], agents: set[str]) -> dict[str, float]:
    """Returns env/template_drift (history rewrites, summed), env/gateway_calls (calls answered, summed),
    env/gateway_calls_mean (calls answered per episode), env/agent_engine_calls (the hosts' engine calls of the step's
    batches, summed), env/agent_prompts_per_engine_call (prompts per such call; 0 without one),
    env/agent_parallel_calls (calls that came while another call of their episode was being answered, summed) and
    timing/agent_batch_wait_s (seconds those calls waited for their batch, summed; wall clock) over the step's agent
    episodes (those whose environment is in ``agents``); {} when the step has none."""
    eps = [c.episode.agent or AgentInfo() for c in completions
           if c.episode is not None and c.episode.environment in agents]
    if not eps:
        return {}
    engine_calls = sum(e.engine_calls for e in eps)
    return {"env/template_drift": float(sum(e.template_drift for e in eps)),
            "env/gateway_calls": float(sum(e.gateway_calls for e in eps)),
            "env/gateway_calls_mean": float(sum(e.gateway_calls for e in eps) / len(eps)),
            "env/agent_engine_calls": float(engine_calls),
            "env/agent_prompts_per_engine_call": sum(e.engine_prompts for e in eps) / engine_calls if engine_calls else 0.0,
            "env/agent_parallel_calls": float(sum(e.parallel_calls for e in eps)),
            "timing/agent_batch_wait_s": float(sum(e.batch_wait_s for e in eps))}
