"""Episodes: multi-turn rollouts that alternate engine turns and environment steps (rank 0).

``EpisodeRollout`` is a ``rlray.rollout.RolloutSource``, as the rollout fleet is, so the step, the async
pipeline, DAPO's refill, ReMax's greedy baseline and evaluation use either. Each prompt row
becomes ``n`` episodes (the group); a row whose ``env.column`` names an environment (or every row, with
``env.default``) runs in that environment, any other row is a one-turn episode (a single-turn prompt,
stop reason ``single_turn``).

One step's episodes advance turn by turn together:
  1. reset every environment episode (one call per environment host, the host runs them on threads);
  2. while any episode is active: check its limits (turns, episode tokens, time), send every active
     episode's token sequence to the engines in one ``submit`` (an episode keeps its rollout actor,
     ``actor_keys``, so vLLM's prefix cache serves its turns), append the sampled tokens (loss mask on),
     send every environment episode's turn to its host in one call per host (``host.step.remote`` with
     typed ``StepRequest``s), and append the observation tokens (loss mask off, ``rlray.envs.episode.Trajectory``);
  3. close the episodes on their hosts.

Faults, one rule: an environment that raises or passes its time limit fails its episode wherever it does (reward
NaN, so the update and the group statistics leave it out; counted in ``env/failed`` and ``env/failed/<stop
reason>``). In ``reset`` or ``step`` the stop reason says so (``env_error`` or ``timeout``); in
``reward_at_limit()`` (a TRL class's ``get_reward``) of an episode a limit ended, or in ``close()``, the episode
keeps the stop reason of its end (``max_turns``, ``done``, ...) and fails all the same. The failure's message says
where (``rlray.envs.host.describe_error``). The episodes of a host that dies fail (stop reason ``actor_died``); in a
run ``rlray.run.rerun.RerunOnFault`` then runs the step's rollout again, whole, once Ray has restarted the host
(``env/episodes_rerun``), and a host ALIVE again takes episodes again from the next rollout on. A host call that runs
past ``watchdog.env_call_s`` (with ``watch``, a ``rlray.hangs.HangWatch``) is reported with the host's stacks and the
host is restarted, a death like any other, or the run stops (``watchdog.on_hang``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from rlray.envs.episode import TemplateDriftError, Trajectory, open_trajectory, truncate_observations
from rlray.envs.host import ResetRequest, StepRequest
from rlray.envs.limits import EpisodeLimits
from rlray.envs.probe import reset_kwargs, row_environment
from rlray.hangs import HangWatch
from rlray.reward.combine import Term, combine
from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.fleet import ACTOR_ERRORS, RolloutFleet
from rlray.rollout.gcs import gcs_actor_state
from rlray.rollout.types import EpisodeInfo, in_background

log = logging.getLogger(__name__)

SEED_STRIDE_PER_TURN = 1_000_003  # a turn's sampling seed: the step's seed + turn * stride (then offset per chunk)
# Stop reasons of an episode a limit ended before the environment said done: its reward_at_limit() is asked for.
LIMIT_STOP_REASONS = ("max_turns", "length", "max_episode_tokens", "template_drift")


@dataclass
class RunningEpisode:
    """One episode while the rollout runs it: where it sits in its group, where it runs, and what it has recorded so
    far (``EpisodeRollout._completion`` turns it into a ``Completion`` and its ``EpisodeInfo``).

    Attributes:
        prompt_index, sample_index: its row in the step and its place in that row's group.
        order: its position in the step's episode list (picks its rollout actor and its host).
        environment: the environment's name; "" for a single-turn row.
        key: the episode's key on its host (unique per step and run).
        traj: its token sequence (None until reset); stop: its environment's extra stop strings.
        host: the index of its environment host.
        started: when it started (time.monotonic(), seconds), for env.episode_timeout_s.
        tool_calls, tool_errors, observation_tokens, metrics, env_steps: sums over its turns (``EpisodeInfo``).
        message: why it failed ("" otherwise); limit_reward: ``reward_at_limit()`` of an episode a limit ended.
        failed_at_end: its ``reward_at_limit()`` or ``close()`` raised after it ended (it keeps its stop reason).
    """

    prompt_index: int
    sample_index: int
    order: int
    environment: str
    key: str
    traj: Trajectory | None = None
    stop: tuple[str, ...] = ()
    host: int = 0
    started: float = field(default_factory=time.monotonic)
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    env_steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""
    limit_reward: float | None = None
    failed_at_end: bool = False


class EpisodeRollout:
    """Rank 0's rollout when environments are configured: episodes across the rollout fleet and environment hosts.

    A ``rlray.rollout.RolloutSource`` whose pending handle is a ``concurrent.futures.Future`` of the completions.

    Args:
        fleet: the rollout fleet (engines).
        hosts: ``EnvironmentHost`` actor handles (at least one).
        tokenizer: the policy's tokenizer (chat template set).
        limits: the episode limits.
        env_column: the row column naming a row's environment.
        default_env: the environment of rows without that column ("" or None: they are single-turn).
        known_envs: the configured environment names (a row naming another is an error).
        prepare: turns a row's opening messages into the final ones (data.instruction and data.system_prompt).
        chat_template_kwargs: extra chat-template variables (rollout.chat_template_kwargs).
        prompt_column: the data's prompt column (data.prompt_column); ``reset`` gets the row's prompt as ``prompt``
            and under this name too, with every other column.
        watch: the deadline of a host call (``HangWatch.env_call_s``) and what a call past it does; None: none.

    Raises:
        ValueError: no host.
    """

    def __init__(self, fleet: RolloutFleet, hosts: list[Any], tokenizer: Any, limits: EpisodeLimits, *,
                 env_column: str, default_env: str | None, known_envs: list[str],
                 prepare: Callable[[list[dict]], list[dict]], chat_template_kwargs: dict[str, Any] | None = None,
                 prompt_column: str = "prompt", watch: HangWatch | None = None) -> None:
        if not hosts:
            raise ValueError("EpisodeRollout needs at least one environment host (resources.env.num_workers)")
        self.fleet, self.hosts, self.tokenizer, self.limits = fleet, list(hosts), tokenizer, limits
        self.env_column, self.default_env, self.known_envs = env_column, default_env or "", set(known_envs)
        self.prepare, self.chat_template_kwargs = prepare, dict(chat_template_kwargs or {})
        self.prompt_column, self.watch = prompt_column, watch
        self._dead: set[int] = set()

    @property
    def version(self) -> int:
        """Returns the fleet's latest policy version."""
        return self.fleet.version

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> Future[list[Completion]]:
        """Starts the episodes of ``rows`` (``sampling.n`` per row) on a background thread; returns at once.

        Args:
            prompt_ids: P prompts' token ids (a single-turn row's prompt; an environment's row opens with the
                prompt its ``reset`` returns).
            sampling: what to sample each turn.
            rows: the P prompt rows (``rlray.data.PromptRow``): their columns name their environments and are
                ``reset``'s keyword arguments.

        Returns:
            A future of ``generate``'s result; ``collect`` waits for it.
        """
        return in_background(lambda: self.generate(prompt_ids, sampling, rows), "rlray-episodes")

    def collect(self, pending: Future[list[Completion]]) -> list[Completion]:
        """Returns the episodes' completions, prompt-major (``n`` per row), waiting for them.

        Raises:
            whatever the episode loop raised (``RolloutError``, a bad row's ``ValueError``).
        """
        return pending.result()

    # ---- running episodes ------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec, rows: list[Any]) -> list[Completion]:
        """Returns the completions of ``sampling.n`` episodes per row, run to their end on the caller's thread,
        prompt-major (``collect(submit(...))`` without the thread; arguments as ``submit``).

        Episodes whose environment host died fail (stop reason ``actor_died``; ``RerunOnFault`` runs the step again).

        Raises:
            ValueError: a row names an environment that is not configured.
            RolloutError: the rollout fleet cannot sample a turn.
        """
        self._dead = {h for h in self._dead if gcs_actor_state(self.hosts[h]) != "ALIVE"}  # restarted: back in use
        step_key = uuid.uuid4().hex[:12]
        episodes = []
        for p, row in enumerate(rows):
            env = self.environment_of(row)
            for s in range(sampling.n):
                episodes.append(RunningEpisode(p, s, len(episodes), env, f"{step_key}-{p}-{s}"))
        self._run_episodes(episodes, rows, prompt_ids, sampling)
        return [self._completion(ep) for ep in episodes]

    def _run_episodes(self, episodes: list[RunningEpisode], rows: list[Any], prompt_ids: list[list[int]],
                      sampling: SamplingSpec) -> None:
        live = self._live_hosts()
        for ep in episodes:
            ep.host = live[ep.order % len(live)]
            if not ep.environment:
                ep.traj = Trajectory(list(prompt_ids[ep.prompt_index]), [])
        self._reset([ep for ep in episodes if ep.environment], rows)
        turn_sampling = dataclasses.replace(sampling, n=1)
        turn = 0
        while active := [ep for ep in episodes if not ep.traj.done]:
            self._check_limits(active, sampling.max_new_tokens)
            active = [ep for ep in active if not ep.traj.done]
            if not active:
                break
            self._sample_turn(active, turn_sampling, turn)
            self._step_envs([ep for ep in active if ep.environment and not ep.traj.done])
            turn += 1
        self._close(episodes)

    def _live_hosts(self) -> list[int]:
        """Returns the hosts not known dead (all of them when every one is: their calls then fail as actor_died)."""
        return [h for h in range(len(self.hosts)) if h not in self._dead] or list(range(len(self.hosts)))

    def environment_of(self, row: Any) -> str:
        """Returns the environment name of a prompt row ("" for a single-turn row).

        Raises:
            ValueError: the row names an environment that is not configured (names the row and the known ones).
        """
        name = row_environment(row.columns, self.env_column, self.default_env)
        if name and name not in self.known_envs:
            raise ValueError(f"prompt row '{row.prompt_id}': column '{self.env_column}' names environment '{name}', "
                             f"which is not in env.environments {sorted(self.known_envs)}")
        return name

    def _reset(self, episodes: list[RunningEpisode], rows: list[Any]) -> None:
        def request(ep: RunningEpisode) -> ResetRequest:
            row = rows[ep.prompt_index]
            return ResetRequest(ep.key, ep.environment, reset_kwargs(row.columns, row.prompt, self.prompt_column))

        for ep, reply in self._per_host(episodes, lambda host, eps: host.reset.remote([request(ep) for ep in eps]),
                                      "reset"):
            ep.traj = Trajectory([], [])  # replaced below unless the reset failed
            if reply is None or reply.error:
                self._fail(ep, "actor_died" if reply is None else reply.error, "" if reply is None else reply.message)
                continue
            ep.stop = tuple(reply.stop)
            try:
                ep.traj = open_trajectory(self.tokenizer, self.prepare(reply.prompt), tools=reply.tools,
                                          chat_template_kwargs=self.chat_template_kwargs)
            except Exception as err:  # noqa: BLE001 - a prompt the template cannot render fails its episode
                self._fail(ep, "env_error", f"chat template: {type(err).__name__}: {err}")

    def _check_limits(self, active: list[RunningEpisode], max_new_tokens: int) -> None:
        now = time.monotonic()
        for ep in active:
            if ep.environment and now - ep.started > self.limits.episode_timeout_s:
                self._fail(ep, "episode_timeout", f"ran past env.episode_timeout_s={self.limits.episode_timeout_s}")
            elif len(ep.traj.token_ids) + max_new_tokens > self.limits.max_episode_tokens:
                if ep.traj.num_turns:
                    ep.traj.stop_reason = "max_episode_tokens"
                else:
                    self._fail(ep, "prompt_too_long", f"the opening prompt has {len(ep.traj.prompt_ids)} tokens; with "
                               f"rollout.max_new_tokens={max_new_tokens} it exceeds env.max_episode_tokens="
                               f"{self.limits.max_episode_tokens}")

    def _sample_turn(self, active: list[RunningEpisode], sampling: SamplingSpec, turn: int) -> None:
        """Sends every active episode's next turn to the engines (one submit per distinct stop-string set)."""
        seed = None if sampling.seed is None else sampling.seed + SEED_STRIDE_PER_TURN * turn
        groups: dict[tuple[str, ...], list[RunningEpisode]] = {}
        for ep in active:
            groups.setdefault(tuple(sampling.stop) + ep.stop, []).append(ep)
        submitted = []
        for stop, eps in groups.items():
            spec = dataclasses.replace(sampling, seed=seed, stop=stop)
            submitted.append((eps, self.fleet.submit([ep.traj.token_ids for ep in eps], spec,
                                                     actor_keys=[ep.order for ep in eps])))
        for eps, pending in submitted:
            for ep, c in zip(eps, self.fleet.collect(pending), strict=True):
                text = self.tokenizer.decode(c.response_token_ids, skip_special_tokens=True)
                ep.traj.add_turn(c.response_token_ids, c.rollout_logprobs, c.finish_reason, c.policy_version, text,
                                 c.versions)
                if not ep.environment:
                    ep.traj.stop_reason = "single_turn"
                elif c.finish_reason == "length":
                    ep.traj.stop_reason = "length"

    def _step_envs(self, episodes: list[RunningEpisode]) -> None:
        def request(ep: RunningEpisode) -> StepRequest:
            return StepRequest(ep.key, ep.traj.messages[-1]["content"], ep.traj.finish_reason, ep.traj.num_turns - 1,
                               last=ep.traj.num_turns >= self.limits.max_turns)

        for ep, reply in self._per_host(episodes, lambda host, eps: host.step.remote([request(ep) for ep in eps]),
                                      "step"):
            ep.env_steps += 1
            if reply is None or reply.error:
                self._fail(ep, "actor_died" if reply is None else reply.error, "" if reply is None else reply.message)
                continue
            step = reply.step
            ep.traj.turn_rewards.append(None if step.reward is None else float(step.reward))
            ep.tool_calls += reply.tool_calls
            ep.tool_errors += reply.tool_errors
            for k, v in step.metrics.items():
                ep.metrics[k] = ep.metrics.get(k, 0.0) + float(v)
            if step.done:
                ep.traj.stop_reason = "done"
            elif step.truncated:
                ep.traj.stop_reason = "env_truncated"
            elif ep.traj.num_turns >= self.limits.max_turns:
                ep.traj.stop_reason = "max_turns"
            elif not step.observations:
                continue  # the model takes another turn right after its own (no observation)
            else:
                observations, cut = truncate_observations(self.tokenizer, step.observations,
                                                          self.limits.max_observation_tokens)
                ep.traj.observations_truncated += cut
                try:
                    ep.observation_tokens += ep.traj.add_observations(self.tokenizer, observations)
                except TemplateDriftError as err:
                    ep.traj.stop_reason, ep.message = "template_drift", str(err)

    def _close(self, episodes: list[RunningEpisode]) -> None:
        """Asks each host for the final rewards of episodes a limit ended, then drops every episode's instance; an
        episode whose ``reward_at_limit()`` or ``close()`` raised fails (it keeps its stop reason)."""
        by_host: dict[int, list[RunningEpisode]] = {}
        for ep in episodes:
            if ep.environment and ep.traj.stop_reason != "actor_died":
                by_host.setdefault(ep.host, []).append(ep)
        for h, eps in by_host.items():
            if h in self._dead:
                continue
            limited = [ep for ep in eps if ep.traj.stop_reason in LIMIT_STOP_REASONS]
            try:
                if limited:
                    ref = self.hosts[h].rewards_at_limit.remote([e.key for e in limited])
                    self._await_hosts({h: ref}, "rewards_at_limit")
                    replies = ray.get(ref)
                    for ep, reply in zip(limited, replies, strict=True):
                        ep.limit_reward = reply.reward
                        if reply.error:
                            self._fail_at_end(ep, f"at the {ep.traj.stop_reason} limit, {reply.message}")
                ref = self.hosts[h].close.remote([ep.key for ep in eps])
                self._await_hosts({h: ref}, "close")
                closed = ray.get(ref)
                for ep, message in zip(eps, closed, strict=True):
                    if message and not ep.traj.failed:
                        self._fail_at_end(ep, message)
            except ACTOR_ERRORS as err:
                self._dead.add(h)
                log.warning("environment host %d died while closing episodes (%s)", h, type(err).__name__)

    def _per_host(self, episodes: list[RunningEpisode], send: Callable[[Any, list[RunningEpisode]], Any],
                  call: str) -> list[tuple[RunningEpisode, Any]]:
        """Returns (episode, its reply, or None when its host died) for one batched call per host.

        Args:
            send: makes one host's call for its episodes and returns the ObjectRef of its list of replies (one per
                episode, in order): ``lambda host, eps: host.step.remote([...])``.
            call: the host method ``send`` calls ("reset", "step"), for a hang report.
        """
        by_host: dict[int, list[RunningEpisode]] = {}
        for ep in episodes:
            by_host.setdefault(ep.host, []).append(ep)
        refs = {h: send(self.hosts[h], eps) for h, eps in by_host.items()}
        self._await_hosts(refs, call)
        out = []
        for h, eps in by_host.items():
            try:
                replies = ray.get(refs[h])
            except ACTOR_ERRORS as err:
                self._dead.add(h)
                log.warning("environment host %d died (%s); its %d episodes fail (stop reason actor_died)", h,
                            type(err).__name__, len(eps))
                replies = [None] * len(eps)
            out += list(zip(eps, replies, strict=True))
        return out

    def _await_hosts(self, refs: dict[int, Any], call: str) -> None:
        """Waits for the hosts' calls ``refs`` up to ``watch.env_call_s`` (``await_hosts``)."""
        if self.watch is not None:
            await_hosts(self.watch, self.hosts, refs, call, self.watch.env_call_s, "watchdog.env_call_s")

    def _fail(self, ep: RunningEpisode, reason: str, message: str) -> None:
        if ep.traj is None:
            ep.traj = Trajectory([], [])
        ep.traj.stop_reason, ep.message = reason, message
        log.warning("episode %s (%s) failed: %s %s", ep.key, ep.environment, reason, message[:300])

    def _fail_at_end(self, ep: RunningEpisode, message: str) -> None:
        ep.failed_at_end, ep.message = True, message
        log.warning("episode %s (%s) failed after it ended (%s): %s", ep.key, ep.environment, ep.traj.stop_reason,
                    message[:300])

    def _completion(self, ep: RunningEpisode) -> Completion:
        traj = ep.traj
        env_reward = traj.env_reward
        if ep.limit_reward is not None:
            env_reward = (env_reward or 0.0) + float(ep.limit_reward)
        info = EpisodeInfo(
            environment=ep.environment, stop_reason=traj.stop_reason, num_turns=traj.num_turns,
            turn_rewards=list(traj.turn_rewards), env_reward=env_reward, failed=traj.failed or ep.failed_at_end,
            tool_calls=ep.tool_calls, tool_errors=ep.tool_errors, observation_tokens=ep.observation_tokens,
            observations_truncated=traj.observations_truncated, metrics=dict(ep.metrics), message=ep.message,
            env_steps=ep.env_steps,
        )
        if not traj.response_ids:  # failed before its first turn: one masked-out placeholder token
            eos = int(self.tokenizer.eos_token_id)
            return Completion(ep.prompt_index, ep.sample_index, [eos], [0.0], "stop", self.fleet.version, [False],
                              prompt_token_ids=traj.prompt_ids or [eos], episode=info)
        return Completion(ep.prompt_index, ep.sample_index, list(traj.response_ids), list(traj.logprobs),
                          traj.finish_reason, min(traj.policy_versions), list(traj.loss_mask),
                          prompt_token_ids=list(traj.prompt_ids), episode=info, versions=list(traj.versions))


# --------------------------------------------------------------------------------------------
# Rewards and metrics of episodes
# --------------------------------------------------------------------------------------------
def add_env_reward(values: dict[str, list[float | None]], completions: list[Completion], weight: float) -> dict[str, list]:
    """Returns the scored values with the environment's reward added as the term "env" (``rlray.reward.combine``).

    For each completion: a failed episode's reward is NaN (left out of the update); an environment's
    episode gets ``reward = functions' reward + weight * r`` with r its environment reward, 0.0 when the
    environment gave none (the episode happened and earned nothing), where the functions' reward counts
    as 0 when every function skipped the sample (None) and stays NaN when one failed; a single-turn
    completion keeps its reward and gets None for "env" (skipped). An agent's ``AgentResult.scores`` (the parts of its
    reward, e.g. a verifiers rubric's functions) are added as terms "<environment>/<name>" of weight 0: logged as
    ``reward/<environment>/<name>`` means, None for the other samples, the reward unchanged.

    Args:
        values: ``RewardScorer.score``'s result: {"reward": [B], <term>: [B]}.
        completions: the B completions (``Completion.episode``).
        weight: env.reward_weight.
    """
    env: list[float | None] = []
    for c in completions:
        ep = c.episode
        if ep is not None and ep.failed:
            env.append(math.nan)  # a NaN term fails the sample's reward
        elif ep is None or not ep.environment:
            env.append(None)
        else:
            env.append(0.0 if ep.env_reward is None else ep.env_reward)
    # An agent's reported parts of its reward (AgentResult.scores): shown as terms of weight 0, never added again.
    parts = sorted({(c.episode.environment, k) for c in completions if c.episode is not None for k in c.episode.scores})
    scores = [Term(f"{e}/{k}", 0.0, [c.episode.scores.get(k) if c.episode is not None and not c.episode.failed
                                     and c.episode.environment == e else None for c in completions])
              for e, k in parts]
    return combine([Term("env", weight, env), *scores], len(completions), prior=values)


def episode_metrics(completions: list[Completion]) -> dict[str, float]:
    """Returns env/* metrics of a step's episodes (an empty dict when no completion is an episode).

    env/steps (environment ``step`` calls, summed), env/turns_mean, env/tool_calls_mean, env/tool_errors (sum),
    env/failed (count), env/observation_tokens_mean,
    env/observations_truncated (sum), env/episodes_rerun (sum), env/stop_reason/<reason> (count per reason),
    env/failed/<reason> (failed episodes per stop reason: env_error, timeout, ..., or the limit or end after which
    reward_at_limit() or close() raised) and
    env/metric/<name> (the mean of each number in the environments' EnvStep.metrics, summed per episode, over the
    episodes that reported it) over the multi-turn episodes of the step (``rlray.observe.metrics.FAMILIES``).
    """
    eps = [c.episode for c in completions if c.episode is not None and c.episode.environment]
    if not eps:
        return {}
    out = {
        "env/episodes": float(len(eps)),
        "env/steps": float(sum(e.env_steps for e in eps)),
        "env/turns_mean": float(np.mean([e.num_turns for e in eps])),
        "env/tool_calls_mean": float(np.mean([e.tool_calls for e in eps])),
        "env/tool_errors": float(sum(e.tool_errors for e in eps)),
        "env/failed": float(sum(e.failed for e in eps)),
        "env/observation_tokens_mean": float(np.mean([e.observation_tokens for e in eps])),
        "env/observations_truncated": float(sum(e.observations_truncated for e in eps)),
        "env/episodes_rerun": float(sum(e.rerun for e in eps)),
    }
    for e in eps:
        out[f"env/stop_reason/{e.stop_reason}"] = out.get(f"env/stop_reason/{e.stop_reason}", 0.0) + 1.0
        if e.failed:
            out[f"env/failed/{e.stop_reason}"] = out.get(f"env/failed/{e.stop_reason}", 0.0) + 1.0
    names = sorted({k for e in eps for k in e.metrics})
    for k in names:
        vals = [e.metrics[k] for e in eps if k in e.metrics]
        out[f"env/metric/{k}"] = float(np.mean(vals))
    return out


def await_hosts(watch: HangWatch, hosts: list[Any], refs: dict[int, Any], call: str, deadline_s: float, key: str, *,
                wait: Callable[..., tuple[list, list]] = ray.wait) -> None:
    """Waits for the hosts' calls ``refs`` ({host index: ObjectRef}) up to ``deadline_s`` seconds since now; each host
    whose call is still running then is reported and restarted (``watch.hung``: its call then fails with an actor
    error, which the caller handles as a death) or the run stops (``HangError``).

    Args:
        watch: rank 0's hang watch; hosts: the host handles, by index.
        call: the host method ("step", "run_agents"); key: the config key(s) that set ``deadline_s``.
        wait: ``ray.wait`` (a test passes a fake).
    """
    started, pending = time.monotonic(), dict(refs)
    while pending:
        ready, _ = wait(list(pending.values()), num_returns=len(pending), timeout=1.0, fetch_local=False)
        pending = {h: r for h, r in pending.items() if r not in ready}
        waited = time.monotonic() - started
        if pending and waited > deadline_s:
            for h in sorted(pending):
                watch.hung(hosts[h], f"environment host {h}", call, waited, deadline_s, key)
            return


def server_restarts(hosts: list[Any], timeout_s: float = 10.0) -> dict[str, float]:
    """Returns env/server_restarts/<server>: each environment server's restarts so far (``env.servers``, agents'
    verifiers bridges), summed over the environment hosts (``EnvironmentHost.server_restarts``); {} when none runs one.

    A host that does not answer within ``timeout_s`` (busy with the next step's calls) or has died is left out of this
    step's count (a host Ray restarted counts from 0 again).
    """
    if not hosts:  # no environment hosts (an in-process rollout): nothing to ask, and no Ray to start
        return {}
    refs = [h.server_restarts.remote() for h in hosts]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out: dict[str, float] = {}
    for ref in ready:
        try:
            counts = ray.get(ref)
        except Exception:  # noqa: BLE001 - a dead host's episodes are counted where they fail
            continue
        for name, count in counts.items():
            out[f"env/server_restarts/{name}"] = out.get(f"env/server_restarts/{name}", 0.0) + float(count)
    return out
