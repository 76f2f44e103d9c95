"""A step's failures (issue 29): why each sample has no reward (its episode's or its reward function's error, in the
experience table), the step's alerts, and the guard that ends a run whose every sample fails."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from rlray.config import config_from_dict
from rlray.data import PromptRow
from rlray.plan import resolve_plan
from rlray.reward.server import LocalRewardClient, ScoreResult
from rlray.rollout import Completion
from rlray.rollout.types import EpisodeInfo
from rlray.run import experience, online
from rlray.run.experience import StageTimer
from rlray.run.failures import (
    CannotLearnError,
    LearningStreaks,
    failure_alerts,
    reward_failures,
    sample_failure,
    watch_learning,
)
from rlray.run.lead import FleetCounts, OnlineLead

G = 2
ROWS = [PromptRow("p0", "q0", {"answer": "1"}), PromptRow("p1", "q1", {"answer": "2"})]
BROKE = "step raised KeyError: 'a' (at env.py:9)"


def episode(failed: bool, stop_reason: str = "done", message: str = "") -> EpisodeInfo:
    return EpisodeInfo("calc", stop_reason, 1, failed=failed, message=message, env_reward=None if failed else 1.0)


def completions(episodes: list[EpisodeInfo | None]) -> list[Completion]:
    return [Completion(i // G, i % G, [5, 6], [-0.1, -0.1], "stop", 0, episode=e) for i, e in enumerate(episodes)]


def test_a_samples_failure_names_its_source():
    failed = completions([episode(True, "env_error", BROKE)])[0]
    assert sample_failure(failed, math.nan, "reward function 'f': ValueError: x") == (
        f"environment 'calc' (env_error): {BROKE}")  # the episode's failure comes first
    ok = completions([episode(False)])[0]
    assert sample_failure(ok, 1.0, "") == ""
    assert sample_failure(ok, math.nan, "reward function 'f': ValueError: x") == "reward function 'f': ValueError: x"
    assert sample_failure(ok, math.nan, "") == "a reward term failed (raised, timed out or gave NaN)"
    late = completions([episode(True, "max_turns", "at the max_turns limit, reward_at_limit() raised KeyError: 'x'")])[0]
    assert sample_failure(late, math.nan, "") == (
        "environment 'calc' (max_turns): at the max_turns limit, reward_at_limit() raised KeyError: 'x'")
    batch = completions([None, None])
    assert reward_failures(batch, ScoreResult(1, {"reward": [math.nan, 1.0]}, ["reward function 'f': E", ""])) == {
        id(batch[0]): "reward function 'f': E"}
    assert reward_failures(batch, ScoreResult(1, {"reward": [math.nan, 1.0]})) == {}  # a client without texts


def test_the_first_failure_of_each_kind_is_one_alert():
    batch = completions([episode(True, "env_error", BROKE), episode(True, "timeout", "step ran past ..."),
                         episode(False), None])
    texts = [sample_failure(c, r, f) for c, r, f in zip(batch, [math.nan, math.nan, math.nan, 1.0],
                                                         ["", "", "reward function 'f': ValueError: bad", ""],
                                                         strict=True)]
    alerts = failure_alerts(batch, texts)
    assert [(a.kind, a.message) for a in alerts] == [
        ("env_failed", f"2 of 3 episodes failed (env/failed); first: environment 'calc' (env_error): {BROKE}"),
        ("reward_failed", "1 of 4 samples have no reward (reward/failed); first: reward function 'f': ValueError: bad"),
    ]
    assert failure_alerts(batch, ["", "", "", ""]) == []


def test_every_sample_failing_for_max_failed_steps_steps_ends_the_run():
    streaks = LearningStreaks()
    args = dict(no_signal=True, group_size=2, max_failed_steps=2)
    assert watch_learning(streaks, ["a", "b", "a"], step=1, **args) == []  # no no_signal alert: failures explain it
    assert (streaks.failed_steps, streaks.first_failures, streaks.flat_steps) == (1, ["a", "b"], 0)
    assert watch_learning(streaks, ["", "b", "a"], step=2, **args) == []  # one sample had a reward: the streak ends
    assert streaks.failed_steps == 0 and streaks.flat_steps == 1
    watch_learning(streaks, ["x", "x"], step=3, **args)
    with pytest.raises(CannotLearnError, match=r"every sample failed in 2 steps in a row \(steps 3-4; "
                                               r"guard.max_failed_steps=2\): the run cannot learn. First failures: x$"):
        watch_learning(streaks, ["y", "y"], step=4, **args)
    assert CannotLearnError in online.FATAL_STEP_ERRORS  # the run ends FAILED with the message, not restarted


def test_no_signal_for_max_failed_steps_steps_is_one_alert_per_streak():
    streaks = LearningStreaks()
    flat = dict(no_signal=True, group_size=4, max_failed_steps=3)
    assert watch_learning(streaks, ["", ""], step=1, **flat) == []
    assert watch_learning(streaks, ["", ""], step=2, **flat) == []
    [alert] = watch_learning(streaks, ["", ""], step=3, **flat)
    assert alert.kind == "no_signal" and alert.message.startswith("steps 1-3: no prompt group's rewards differed in 3 "
                                                                  "steps in a row (algo/groups_without_signal=1)")
    assert "Likely causes" in alert.message and "rollout.temperature" in alert.message
    assert watch_learning(streaks, ["", ""], step=4, **flat) == []  # once per streak
    assert watch_learning(streaks, ["", ""], step=5, no_signal=False, group_size=4, max_failed_steps=3) == []
    assert streaks.flat_steps == 0
    singles = LearningStreaks()  # a group of one sample never has spread: never counted
    for step in range(1, 5):
        assert watch_learning(singles, [""], step=step, no_signal=True, group_size=1, max_failed_steps=2) == []


class _FailingScorer:
    """Scores every completion NaN with a failure text (a reward function that raises on everything)."""

    def score_with_failures(self, prompts, completions, columns, completion_ids=None):
        n = len(completions)
        return {"reward": [math.nan] * n, "f": [math.nan] * n}, ["reward function 'f': ValueError: cannot grade"] * n

    def close(self):
        pass


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def test_collect_experience_writes_each_failure_alerts_and_stops_a_run_that_cannot_learn():
    cfg = config_from_dict({}, ["learner.prompts_per_step=2", f"rollout.samples_per_prompt={G}", "guard.max_failed_steps=2",
                                "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2"])
    batch = completions([episode(True, "env_error", BROKE), episode(False), episode(False), episode(False)])
    got = SimpleNamespace(rows=ROWS, prompt_ids=[[1], [2]], completions=batch)
    lead = OnlineLead(stream=None, prompt_ids={}, skipped_long_prompts=0, eval_prompts=[], reward_columns=[],
                      reward=LocalRewardClient(_FailingScorer(), 1), reward_kwargs={}, fleet=None, rollouts=None,
                      pipeline=SimpleNamespace(next=lambda step: got), logged=FleetCounts())
    first = experience.collect_experience(lead, resolve_plan(cfg), _Tokenizer(), 0, StageTimer(), policy_version=0)
    assert first.table.column("failure").to_pylist() == [f"environment 'calc' (env_error): {BROKE}"] + [
        "reward function 'f': ValueError: cannot grade"] * 3
    assert [a.kind for a in first.alerts] == ["env_failed", "reward_failed"]
    assert first.metrics["reward/failed"] == 4.0 and lead.streaks.failed_steps == 1
    samples = experience.step_samples(_Tokenizer(), first.table, [0, 1], [math.nan, math.nan], 1)
    assert samples[0].failure == f"environment 'calc' (env_error): {BROKE}"
    with pytest.raises(CannotLearnError, match=r"steps 1-2; guard.max_failed_steps=2\): the run cannot learn. First "
                                               r"failures: environment 'calc' \(env_error\): step raised KeyError"):
        experience.collect_experience(lead, resolve_plan(cfg), _Tokenizer(), 1, StageTimer(), policy_version=0)
