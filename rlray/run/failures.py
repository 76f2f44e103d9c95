"""A step's failures (rank 0): why each sample has no reward, the step's alerts, and the guard on a run that cannot learn.

- ``sample_failure``: one sample's failure text, naming the source: "environment '<name>' (<stop reason>): <where> raised
  <Type>: <message>" for a failed episode (``rlray.run.episodes``), "reward function '<name>': <Type>: <message>" for a
  reward function that raised, timed out or gave NaN (``rlray.reward.RewardScorer.score_with_failures``), or why no
  term scored it. It goes into the experience table (column ``failure``) and so into the kept samples.
- ``failure_alerts``: the first failure of each kind in a step (``env_failed``, ``reward_failed``) as one alert line
  each, with the count; rank 0 sends them through the monitor, whose alerts the driver's console prints
  (``rlray.launch.console.DriverProgress``).
- ``watch_learning``: after ``guard.max_failed_steps`` steps in a row in which every sample failed, the run ends
  (``CannotLearnError``: a fatal step error, the run's status FAILED, the message on the console and in MLflow's
  tag ``rlray.error``); after as many steps in a row in which no prompt group's rewards differ (and groups have 2
  samples or more), a ``no_signal`` alert names the likely causes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlray.reward.server import ScoreResult
from rlray.rollout import Completion
from rlray.run.context import StepAlert

MESSAGE_CHARS = 600  # an alert's failure text is cut to this many characters (the samples table keeps it whole)


class CannotLearnError(RuntimeError):
    """Every sample of ``guard.max_failed_steps`` steps in a row failed; the message gives the first failures."""


@dataclass
class LearningStreaks:
    """Rank 0's counts of steps in a row that could not teach the policy anything (``watch_learning``).

    Attributes:
        failed_steps: steps in a row in which every sample failed; first_failures: the distinct failure texts of
            the streak's first step (at most 3).
        flat_steps: steps in a row in which no prompt group's rewards differed (zero advantages).
    """

    failed_steps: int = 0
    first_failures: list[str] = field(default_factory=list)
    flat_steps: int = 0


def reward_failures(completions: list[Completion], result: ScoreResult) -> dict[int, str]:
    """Returns {id(completion): failure text} for the completions whose reward failed in ``result`` (the scorer's
    texts; {} when the client gave none). Keyed by object identity: the step's completions live until its table
    is built, and DAPO's refills and ReMax's baseline are scored separately."""
    if not result.failures:
        return {}
    return {id(c): text for c, text in zip(completions, result.failures, strict=True) if text}


def sample_failure(completion: Completion, reward: float, reward_failure: str) -> str:
    """Returns why a sample has no reward ("" when its reward is a number): its episode's failure first, else the
    reward's (``reward_failure``: the scorer's text, "" when unknown)."""
    ep = completion.episode
    if ep is not None and ep.failed:
        return f"environment '{ep.environment}' ({ep.stop_reason}): {ep.message or 'failed'}"
    if math.isfinite(reward):
        return ""
    return reward_failure or "a reward term failed (raised, timed out or gave NaN)"


def failure_alerts(completions: list[Completion], failures: list[str]) -> list[StepAlert]:
    """Returns the alerts of a step: one per kind of failure that happened (``env_failed``: failed episodes;
    ``reward_failed``: samples whose reward failed), each with the count and the kind's first text (the alert
    carries the step: the console prints 'rlray: alert <kind> at step <step>: <message>')."""
    episode = [t for c, t in zip(completions, failures, strict=True) if t and c.episode is not None and c.episode.failed]
    reward = [t for c, t in zip(completions, failures, strict=True)
              if t and not (c.episode is not None and c.episode.failed)]
    episodes = sum(c.episode is not None and bool(c.episode.environment) for c in completions)
    alerts = []
    if episode:
        alerts.append(StepAlert("env_failed", f"{len(episode)} of {episodes} episodes failed (env/failed); first: "
                                f"{episode[0][:MESSAGE_CHARS]}"))
    if reward:
        alerts.append(StepAlert("reward_failed", f"{len(reward)} of {len(completions)} samples have no reward "
                                f"(reward/failed); first: {reward[0][:MESSAGE_CHARS]}"))
    return alerts


def watch_learning(streaks: LearningStreaks, failures: list[str], *, step: int, no_signal: bool, group_size: int,
                   max_failed_steps: int) -> list[StepAlert]:
    """Updates ``streaks`` with 1-based ``step``; returns a ``no_signal`` alert when the flat streak reaches
    ``max_failed_steps`` (else []).

    Args:
        failures: the step's B failure texts (``sample_failure``; "" for a sample with a reward).
        no_signal: no prompt group's rewards differ (``algo/groups_without_signal`` == 1).
        group_size: samples per prompt (``rollout.samples_per_prompt``); a group of 1 never has spread, so it
            never counts as flat.
        max_failed_steps: ``guard.max_failed_steps``.

    Raises:
        CannotLearnError: every sample failed in ``max_failed_steps`` steps in a row (the message names the steps,
            the guard and the streak's first failures).
    """
    if failures and all(failures):
        streaks.failed_steps += 1
        if streaks.failed_steps == 1:
            streaks.first_failures = list(dict.fromkeys(failures))[:3]
        if streaks.failed_steps >= max_failed_steps:
            first = "; ".join(t[:MESSAGE_CHARS] for t in streaks.first_failures)
            raise CannotLearnError(
                f"every sample failed in {streaks.failed_steps} steps in a row (steps {step - streaks.failed_steps + 1}-"
                f"{step}; guard.max_failed_steps={max_failed_steps}): the run cannot learn. First failures: {first}")
        streaks.flat_steps = 0
        return []
    streaks.failed_steps, streaks.first_failures = 0, []
    streaks.flat_steps = streaks.flat_steps + 1 if no_signal and group_size >= 2 else 0
    if streaks.flat_steps != max_failed_steps:
        return []
    return [StepAlert("no_signal", (
        f"steps {step - max_failed_steps + 1}-{step}: no prompt group's rewards differed in {max_failed_steps} steps in "
        "a row (algo/groups_without_signal=1), so every advantage is zero and the policy does not move. Likely causes: "
        "the reward is the same for every sample (a reward function or environment that returns a constant, e.g. "
        "get_reward() that never sees the answer; tasks all too hard or all too easy for the model), or the samples "
        "of a group are identical (rollout.temperature near 0). Check reward/<term>, env/* and the samples on the "
        "live page"))]
