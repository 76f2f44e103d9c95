"""The episode loop (rlray.run.episodes) over real environment hosts (Ray actors) and a scripted fake fleet:
mixed environments and single-turn rows in one step, masks, rewards, limits, faults, a host that dies."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray

from rlray.data import PromptRow
from rlray.envs.host import EnvironmentHost
from rlray.envs.limits import EpisodeLimits
from rlray.hangs import HangWatch
from rlray.rollout import Completion, SamplingSpec
from rlray.run.episodes import EpisodeRollout, add_env_reward, episode_metrics
from rlray.run.rerun import RerunOnFault

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "test_envs.py"
ENVS = {name: f"{FIXTURE}:{cls}" for name, cls in
        [("countdown", "CountdownEnv"), ("raise", "RaisingEnv"), ("hang", "HangingEnv"), ("die", "DieOnceEnv"),
         ("limitraise", "LimitRaisingEnv"), ("closeraise", "CloseRaisingEnv"), ("lastturn", "LastTurnEnv"),
         ("hangonce", "HangOnceEnv")]}


class ScriptedFleet:
    """A rollout fleet whose 'engine' answers 'stop' once the prompt holds two 'go on' observations, else 'more'."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.version, self.calls = tokenizer, 0, []
        self.actors, self.failures = [], 0  # RerunOnFault's view: no rollout actor to die

    def recover(self) -> None:
        """Nothing to bring back (RerunOnFault)."""

    def submit(self, prompt_ids, sampling, rows=None, *, actor_keys=None):
        self.calls.append((len(prompt_ids), list(actor_keys or []), sampling))
        return prompt_ids, sampling

    def collect(self, pending):
        prompt_ids, sampling = pending
        out = []
        for i, ids in enumerate(prompt_ids):
            text = "stop" if self.tok.decode(ids).count("go on") >= 2 else "more"
            tokens = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            for s in range(sampling.n):
                out.append(Completion(i, s, tokens, [-0.5] * len(tokens), "stop", self.version))
        return out


def rollout(tokenizer, hosts, *, max_turns=8, max_episode_tokens=4096):
    limits = EpisodeLimits(max_turns, max_episode_tokens, 64, 600.0)
    return EpisodeRollout(ScriptedFleet(tokenizer), hosts, tokenizer, limits, env_column="environment", default_env=None,
                          known_envs=list(ENVS), prepare=lambda m: m)


def host(**kwargs):
    return ray.remote(EnvironmentHost).options(max_concurrency=1, **kwargs).remote(ENVS, step_timeout_s=1.0)


@pytest.fixture(scope="module")
def env_host(ray_session):
    h = host()
    yield h
    ray.kill(h)


def rows(*envs):
    return [PromptRow(f"p{i}", "hello", {"environment": e} if e else {}) for i, e in enumerate(envs)]


def test_mixed_step_masks_rewards_and_metrics(env_host, tiny_tokenizer):
    tok = tiny_tokenizer
    ep = rollout(tok, [env_host])
    batch = rows("countdown", None, "raise")
    single_ids = tok("single", add_special_tokens=False)["input_ids"]
    got = ep.generate([[1, 2], single_ids, [3]], SamplingSpec(n=2, max_new_tokens=8, temperature=1.0, seed=5), batch)
    assert [(c.prompt_index, c.sample_index) for c in got] == [(p, s) for p in range(3) for s in range(2)]
    countdown, single, raised = got[0], got[2], got[4]

    # countdown: "more", "go on", "more", "go on", "stop" -> 3 turns, done, reward 3.0 (the turn count)
    more = tok("more", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    stop = tok("stop", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = tok("\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert countdown.response_token_ids == more + obs + more + obs + stop
    assert countdown.loss_mask == [True] * len(more) + [False] * len(obs) + [True] * len(more) + [False] * len(obs) + [True] * len(stop)
    assert [lp for lp, m in zip(countdown.rollout_logprobs, countdown.loss_mask, strict=True) if not m] == [0.0] * 2 * len(obs)
    assert countdown.episode.stop_reason == "done" and countdown.episode.num_turns == 3
    assert countdown.episode.turn_rewards == [None, None, 3.0] and countdown.episode.env_reward == 3.0
    opening = tok.apply_chat_template([{"role": "user", "content": "countdown"}], tokenize=False, add_generation_prompt=True)
    assert countdown.prompt_token_ids == tok(opening, add_special_tokens=False)["input_ids"]

    # the single-turn row: one completion of its own prompt, every token trained on
    assert single.episode.stop_reason == "single_turn" and single.episode.environment == ""
    assert single.prompt_token_ids == single_ids and all(single.loss_mask)

    # the raising environment fails its episodes; the run goes on
    assert raised.episode.failed and raised.episode.stop_reason == "env_error"
    assert "the environment broke" in raised.episode.message

    # one engine call per turn for all active episodes, each episode on the same actor key every turn
    fleet = ep.fleet
    assert [n for n, _, _ in fleet.calls] == [6, 2, 2]  # 6 episodes, then the 2 countdowns (the rest ended)
    assert fleet.calls[1][1] == fleet.calls[2][1] == [0, 1]
    assert fleet.calls[0][2].seed == 5 and fleet.calls[1][2].seed == 5 + 1_000_003

    # rewards: a function term skipped the env rows (None) and scored the single-turn one
    values = {"reward": [math.nan, math.nan, 0.5, 0.5, math.nan, math.nan], "f": [None, None, 0.5, 0.5, None, None]}
    summed = add_env_reward(values, got, weight=2.0)
    assert summed["reward"][:4] == [6.0, 6.0, 0.5, 0.5]
    assert all(math.isnan(r) for r in summed["reward"][4:])
    assert summed["env"][:4] == [3.0, 3.0, None, None]

    metrics = episode_metrics(got)
    assert metrics["env/episodes"] == 4.0  # the single-turn rows are not episodes of an environment
    assert metrics["env/turns_mean"] == (3 + 3 + 1 + 1) / 4
    assert metrics["env/steps"] == 3 + 3 + 1 + 1  # a step call per turn: the raising ones raised in their first step
    assert metrics["env/failed"] == 2.0
    assert metrics["env/stop_reason/done"] == 2.0 and metrics["env/stop_reason/env_error"] == 2.0
    assert metrics["env/metric/said_stop"] == 1.0  # summed per episode (0 + 0 + 1), mean over the 2 that reported
    assert metrics["env/observation_tokens_mean"] == (2 * len(obs) * 2) / 4
    assert ray.get(env_host.open_episodes.remote()) == 0  # every instance closed


class PartialFleet(ScriptedFleet):
    """A scripted fleet as partial rollouts answer: every call takes one update, after its first token (the turn's
    first token under the version it started with, the rest under the next one)."""

    def collect(self, pending):
        out = ScriptedFleet.collect(self, pending)
        for c in out:
            c.policy_version, c.versions = self.version, [self.version] + [self.version + 1] * (len(c.versions) - 1)
        self.version += 1
        return out


def test_an_episode_across_updates_records_each_token_s_version(env_host, tiny_tokenizer):
    """Partial rollouts (rollout.partial) with environments: each turn may span an update; a sampled token keeps the
    version that sampled it, an observation token (masked out) the version of the token before it."""
    tok = tiny_tokenizer
    ep = rollout(tok, [env_host])
    ep.fleet = PartialFleet(tok)
    got = ep.generate([[1, 2]], SamplingSpec(n=1, max_new_tokens=8, temperature=1.0, seed=5), rows("countdown"))[0]
    more = len(tok("more", add_special_tokens=False)["input_ids"]) + 1  # + EOS
    stop = len(tok("stop", add_special_tokens=False)["input_ids"]) + 1
    obs = len(tok("\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    # turn 1 at versions 0 then 1, turn 2 at 1 then 2, turn 3 at 2 then 3; observations keep the version before them
    assert got.versions == ([0] + [1] * (more - 1) + [1] * obs + [1] + [2] * (more - 1) + [2] * obs + [2]
                            + [3] * (stop - 1))
    assert got.policy_version == 0 and got.episode.num_turns == 3  # the oldest token's
    assert got.loss_mask == [True] * more + [False] * obs + [True] * more + [False] * obs + [True] * stop


@pytest.fixture(scope="module")
def served_host(ray_session):
    """An environment host that starts and serves an echo environment over OpenEnv's protocol (env.servers: the
    action's message comes back as the observation, reward 0.1 per character; tests/fixtures/openenv_echo.py, a
    stand-in for OpenEnv's template that starts in well under a second)."""
    from rlray.envs.servers import ServerSpec
    from rlray.envs.servers.hosted import HostedServer
    from rlray.envs.servers.openenv import OpenEnvOptions

    server = Path(__file__).resolve().parents[1] / "fixtures" / "openenv_echo.py"
    spec = ServerSpec("echo", command=("python", str(server), "--host", "{host}", "--port", "{port}"), max_sessions=2)
    served = HostedServer(spec, openenv=OpenEnvOptions(action_field="message", observation_field="echoed_message"))
    h = ray.remote(EnvironmentHost).options(max_concurrency=1).remote({}, step_timeout_s=60.0, servers=[served])
    ray.get(h.ping.remote())
    yield h
    ray.get(h.stop_servers.remote())
    ray.kill(h)


def test_a_served_environment_s_episode_across_updates_records_each_token_s_version(served_host, tiny_tokenizer):
    """Partial rollouts with env.servers: a served environment's episode runs as an environment's does, each turn
    across an update (the scripted fleet's: after the turn's first token), so the episode spans two updates. Its
    sampled tokens keep their versions and behaviour logprobs; the server's observation tokens (masked out) the
    version of the token before them."""
    tok = tiny_tokenizer
    ep = EpisodeRollout(PartialFleet(tok), [served_host], tok, EpisodeLimits(2, 4096, 64, 600.0),
                        env_column="environment", default_env=None, known_envs=["echo"], prepare=lambda m: m)
    row = PromptRow("e", "Say something.", {"environment": "echo"})
    (got,) = ep.generate([[1, 2]], SamplingSpec(n=1, max_new_tokens=8, temperature=1.0, seed=5), [row])
    more = len(tok("more", add_special_tokens=False)["input_ids"]) + 1  # the scripted turn, EOS included
    obs = got.loss_mask.count(False)  # the echoed "more", as the chat template renders a user message
    assert got.loss_mask == [True] * more + [False] * obs + [True] * more
    assert "more" in tok.decode(got.response_token_ids[more:more + obs])
    # turn 1 at version 0 then 1, the observation at 1, turn 2 at 1 then 2: two updates inside the episode
    assert got.versions == [0] + [1] * (more - 1) + [1] * obs + [1] + [2] * (more - 1)
    assert got.rollout_logprobs == [-0.5] * more + [0.0] * obs + [-0.5] * more and got.policy_version == 0
    assert (got.episode.stop_reason, got.episode.num_turns) == ("max_turns", 2)
    assert got.episode.turn_rewards == pytest.approx([0.4, 0.4])  # the server's reward: 0.1 per character of "more"


def test_limits_end_episodes_with_their_own_stop_reasons(env_host, tiny_tokenizer):
    sampling = SamplingSpec(n=1, max_new_tokens=4, temperature=1.0)
    got = rollout(tiny_tokenizer, [env_host], max_turns=2).generate([[1]], sampling, rows("countdown"))[0]
    assert got.episode.stop_reason == "max_turns" and got.episode.num_turns == 2
    assert got.episode.env_reward == -1.0  # no turn reward; reward_at_limit() of a limit-ended episode
    assert not got.episode.failed

    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "countdown"}], tokenize=False,
                                              add_generation_prompt=True)
    opening = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    tight = rollout(tiny_tokenizer, [env_host], max_episode_tokens=opening + 4 + 10)  # one turn fits, a second does not
    got = tight.generate([[1]], sampling, rows("countdown"))[0]
    assert got.episode.stop_reason == "max_episode_tokens" and got.episode.num_turns == 1


def test_an_environment_that_raises_after_its_episode_ended_fails_it_keeping_the_stop_reason(env_host, tiny_tokenizer):
    """The one failure rule (issue 29): reward_at_limit() (a TRL class's get_reward) raising at a limit, or close()
    raising, fails the episode like a raise in step; it keeps the stop reason of its end, counted by it."""
    sampling = SamplingSpec(n=1, max_new_tokens=4, temperature=1.0)
    got = rollout(tiny_tokenizer, [env_host], max_turns=2).generate([[1], [1], [1]], sampling,
                                                                   rows("limitraise", "closeraise", "countdown"))
    limit, closed, fine = (c.episode for c in got)
    assert (limit.stop_reason, limit.failed, limit.env_reward) == ("max_turns", True, None)
    assert limit.message.startswith("at the max_turns limit, reward_at_limit() (a TRL class: get_reward()) raised "
                                    "KeyError: 'answer' (at ")
    assert (closed.stop_reason, closed.failed) == ("max_turns", True)
    assert closed.message.startswith("close() raised OSError: cannot release (at ")
    assert (fine.stop_reason, fine.failed, fine.env_reward) == ("max_turns", False, -1.0)
    metrics = episode_metrics(got)
    assert metrics["env/failed"] == 2.0 and metrics["env/failed/max_turns"] == 2.0
    assert metrics["env/stop_reason/max_turns"] == 3.0
    assert [math.isnan(v) for v in add_env_reward({"reward": [math.nan] * 3}, got, 1.0)["reward"]] == [True, True, False]


def test_the_last_turn_is_marked_for_the_environment(env_host, tiny_tokenizer):
    """At env.max_turns the turn goes to step with last=True (the TRL adapter then does not run its calls)."""
    got = rollout(tiny_tokenizer, [env_host], max_turns=2).generate(
        [[1]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0), rows("lastturn"))[0]
    assert got.episode.num_turns == 2 and got.episode.stop_reason == "max_turns"
    assert got.episode.metrics == {"said_stop": 0.0, "last": 1.0}  # turn 1 not last, turn 2 last (summed per episode)


def test_a_hanging_environment_times_out(env_host, tiny_tokenizer):
    got = rollout(tiny_tokenizer, [env_host]).generate([[1]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0),
                                                      rows("hang"))[0]
    assert got.episode.stop_reason == "timeout" and got.episode.failed


def test_unknown_environment_names_the_row(env_host, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"prompt row 'p0': column 'environment' names environment 'chess'"):
        rollout(tiny_tokenizer, [env_host]).generate([[1]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0),
                                                    rows("chess"))


def test_the_step_of_a_dead_host_runs_again_whole(ray_session, tiny_tokenizer, tmp_path):
    h = host(max_restarts=1)
    marker = tmp_path / "died"
    batch = [PromptRow("p0", "hello", {"environment": "die", "marker": str(marker)})]
    episodes = rollout(tiny_tokenizer, [h])
    got = RerunOnFault(episodes, episodes.fleet, [h]).generate([[1]], SamplingSpec(n=2, max_new_tokens=4, temperature=1.0),
                                                               batch)
    assert marker.exists()
    assert [c.episode.stop_reason for c in got] == ["done", "done"]
    assert [c.episode.rerun for c in got] == [True, True]
    assert episode_metrics(got)["env/episodes_rerun"] == 2.0
    ray.kill(h)


def test_a_host_stuck_past_watchdog_env_call_s_is_reported_with_its_stack_restarted_and_its_episodes_rerun(
        ray_session, tiny_tokenizer, tmp_path):
    """An environment step that sleeps 600 s under a host limit of 300 s (env.step_timeout_s) and a 3 s
    watchdog.env_call_s: the report names the host, the call and the sleeping frame, the host restarts, and the step's
    episodes run again once and finish."""
    h = ray.remote(EnvironmentHost).options(max_concurrency=1, max_restarts=1).remote(ENVS, step_timeout_s=300.0)
    ray.get(h.ping.remote())
    alerts: list[str] = []
    watch = HangWatch("restart", env_call_s=3.0, alert=alerts.append)
    episodes = EpisodeRollout(ScriptedFleet(tiny_tokenizer), [h], tiny_tokenizer, EpisodeLimits(8, 4096, 64, 600.0),
                              env_column="environment", default_env=None, known_envs=list(ENVS), prepare=lambda m: m,
                              watch=watch)
    batch = [PromptRow("p0", "hello", {"environment": "hangonce", "marker": str(tmp_path / "hung")})]
    got = RerunOnFault(episodes, episodes.fleet, [h]).generate([[1]], SamplingSpec(n=2, max_new_tokens=4, temperature=1.0),
                                                               batch)
    assert [c.episode.stop_reason for c in got] == ["done", "done"] and [c.episode.rerun for c in got] == [True, True]
    assert episode_metrics(got)["env/episodes_rerun"] == 2.0
    assert (watch.hangs, watch.restarts) == (1, 1)
    assert alerts[0].startswith("hang: environment host 0 (") and "has run step for " in alerts[0]
    assert "past watchdog.env_call_s=3 s; restarting it" in alerts[0]
    assert f'File "{FIXTURE}", line' in alerts[0] and "in injected_hang" in alerts[0]  # from the stuck host
    ray.kill(h)


def test_env_reward_defaults_to_zero_and_failed_episodes_are_nan():
    from rlray.rollout.types import EpisodeInfo

    def comp(episode):
        return Completion(0, 0, [1], [0.0], "stop", 0, episode=episode)

    got = [comp(EpisodeInfo("guess", "length", 1)),  # no reward from the environment: 0.0
           comp(EpisodeInfo("guess", "done", 2, [None, 0.9], 0.9)),
           comp(EpisodeInfo("guess", "env_error", 1, failed=True)),
           comp(None)]  # single-turn: keeps the functions' reward
    values = {"reward": [math.nan, 0.25, 1.0, 0.75], "f": [None, 0.25, 1.0, 0.75]}
    out = add_env_reward(values, got, weight=1.0)
    assert out["env"][:2] == [0.0, 0.9] and math.isnan(out["env"][2]) and out["env"][3] is None
    assert out["reward"][0] == 0.0 and out["reward"][1] == 0.25 + 0.9 and math.isnan(out["reward"][2])
    assert out["reward"][3] == 0.75


def test_an_agents_reward_parts_are_logged_as_terms_of_weight_zero():
    """AgentResult.scores (a verifiers rubric's functions) become reward/<agent>/<name>; the reward stays the env's."""
    from rlray.rollout.types import EpisodeInfo

    def comp(episode):
        return Completion(0, 0, [1], [0.0], "stop", 0, episode=episode)

    got = [comp(EpisodeInfo("vf", "done", 1, [1.5], 1.5, scores={"correct": 1.0, "formatted": 1.0})),
           comp(EpisodeInfo("vf", "done", 1, [0.5], 0.5, scores={"correct": 0.0, "formatted": 1.0})),
           comp(EpisodeInfo("vf", "env_error", 1, failed=True, scores={"correct": 1.0})),  # failed: no score shown
           comp(EpisodeInfo("other", "done", 1, [2.0], 2.0, scores={"correct": 0.25})),
           comp(None)]
    out = add_env_reward({"reward": [math.nan, math.nan, math.nan, math.nan, 0.75]}, got, weight=2.0)
    assert list(out) == ["reward", "env", "other/correct", "vf/correct", "vf/formatted"]
    assert out["vf/correct"] == [1.0, 0.0, None, None, None] and out["vf/formatted"] == [1.0, 1.0, None, None, None]
    assert out["other/correct"] == [None, None, None, 0.25, None]
    assert out["reward"][:2] == [3.0, 1.0] and math.isnan(out["reward"][2]) and out["reward"][3:] == [4.0, 0.75]


def test_sandboxed_episodes_have_a_hard_time_limit_that_ends_one_episode(ray_session, tiny_tokenizer):
    h = ray.remote(EnvironmentHost).options(max_concurrency=1).remote(ENVS, step_timeout_s=2.0, sandbox=True)
    got = rollout(tiny_tokenizer, [h]).generate([[1], [2]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0),
                                                rows("hang", "countdown"))
    assert got[0].episode.stop_reason == "timeout" and got[0].episode.failed
    assert got[1].episode.stop_reason == "done" and got[1].episode.env_reward == 3.0  # its neighbour went on
    assert ray.get(h.open_episodes.remote()) == 0
    ray.kill(h)


def test_async_pipeline_runs_episodes_ahead_and_reruns_them_after_a_reset(env_host, tiny_tokenizer):
    """Episodes of step t+1 run while step t trains (max_staleness 1); a reset (restore, rollback) drops the
    episodes in flight and runs their steps again with the same rows, the data cursor left where it is."""
    from rlray.rollout.pipeline import RolloutPipeline

    data = rows("countdown", None, "countdown", None, "countdown", None)
    cursor = {"next": 0}

    def take():
        i = cursor["next"]
        cursor["next"] = i + 2
        picked = [data[i % 6], data[(i + 1) % 6]]
        return picked, [[1 + i], [2 + i]]

    def restore(state):
        cursor.update(state)

    ep = rollout(tiny_tokenizer, [env_host])
    pipe = RolloutPipeline(ep, take, lambda s: SamplingSpec(n=2, max_new_tokens=4, temperature=1.0, seed=s), 1,
                           cursor=lambda: dict(cursor), restore_cursor=restore)
    first = pipe.next(0)
    assert [r.prompt_id for r in first.rows] == ["p0", "p1"] and pipe.in_flight == 1  # step 1's episodes run
    assert [c.episode.stop_reason for c in first.completions] == ["done", "done", "single_turn", "single_turn"]
    assert pipe.cursor_state() == {"next": 4, "in_flight": [{"next": 2}]}  # step 1 took its rows at cursor 2
    pipe.reset()
    assert cursor == {"next": 4} and pipe.in_flight == 0
    again = pipe.next(1)
    assert [r.prompt_id for r in again.rows] == ["p2", "p3"]  # step 1's rows, run again
    pipe.reset()  # waits for step 2's episodes in flight, then drops them
    assert cursor == {"next": 6}
    assert ray.get(env_host.open_episodes.remote()) == 0


def test_the_pipeline_runs_over_the_fleet_or_the_episodes_alike(tiny_tokenizer):
    """``RolloutPipeline`` takes any ``RolloutSource``: over single-turn rows, the episode rollout (no host is called,
    no Ray) gives the completions its fleet gives, prompt-major, with its version."""
    from rlray.rollout.pipeline import RolloutPipeline

    data = rows(None, None, None)
    ids = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("one go on go on", "two", "three")]

    def batches(source) -> list:
        pipe = RolloutPipeline(source, lambda: (data, ids),
                               lambda s: SamplingSpec(n=2, max_new_tokens=4, temperature=1.0, seed=s), 1)
        return [pipe.next(0), pipe.next(1)]

    fleet, episode_rollout = ScriptedFleet(tiny_tokenizer), rollout(tiny_tokenizer, [object()])
    fleet.version = episode_rollout.fleet.version = 4
    direct, episodes = batches(fleet), batches(episode_rollout)
    for by_fleet, by_episodes in zip(direct, episodes, strict=True):
        assert by_episodes.rows == by_fleet.rows == data
        assert by_episodes.submitted_at_version == by_fleet.submitted_at_version == 4
        assert [(c.prompt_index, c.sample_index, c.response_token_ids, c.policy_version) for c in by_episodes.completions] == [
            (c.prompt_index, c.sample_index, c.response_token_ids, c.policy_version) for c in by_fleet.completions]
        assert [c.episode.stop_reason for c in by_episodes.completions] == ["single_turn"] * 6
        assert [c.prompt_token_ids for c in by_episodes.completions] == [p for p in ids for _ in range(2)]
    stop = tiny_tokenizer("stop", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert direct[0].completions[0].response_token_ids == stop  # the first prompt holds "go on" twice
    assert direct[0].completions[2].response_token_ids != stop
