"""Rank-0 sampling extras of the online algorithms, between the reward stage and the experience table.

- DAPO dynamic sampling (``dynamic_sampling``): keep the groups whose reward term
  ``algo.dynamic_sampling_metric`` (the summed reward, or one term such as raw correctness) varies, draw further
  prompts until ``prompts_per_step`` such groups are collected, and fail clearly past the round limit.
- DAPO soft overlong punishment (``overlong_shaping``): a length penalty added to the reward.
- ReMax's greedy baseline (``per_completion`` spreads the greedy reward of each prompt over its samples).

Which extras an algorithm takes is its registry entry's ``dynamic_sampling`` and ``greedy_baseline``
(``rlray.algos.registry``). Plain orchestration over ``Rollouts`` records: the step (``rlray.run.experience
.algorithm_sampling``) passes a ``draw`` function that runs stages 1-3 for the next prompts, so these functions
need neither Ray nor an engine (tests pass a fake one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlray import algos
from rlray.rollout import Completion


@dataclass
class Rollouts:
    """What stages 1-3 produce on rank 0: prompt rows, their token ids, completions and reward terms.

    Attributes:
        rows: P prompt rows (``PromptRow``).
        prompt_ids: P prompt token-id lists.
        completions: completions, prompt-major; ``prompt_index`` indexes ``rows``.
        rewards: {"reward", <term name>, ...} lists, one value per completion (``RewardScorer.score``).
        judge_outputs: {judge name: raw output per completion} when judges scored them (``ScoreResult.outputs``).
    """

    rows: list[Any]
    prompt_ids: list[list[int]]
    completions: list[Completion]
    rewards: dict[str, list[float]]
    judge_outputs: dict[str, list[str]] = field(default_factory=dict)

    def __add__(self, other: Rollouts) -> Rollouts:
        """Returns both batches in order; ``other``'s prompt indices are shifted past ``self``'s rows."""
        shift = len(self.rows)
        moved = [dataclasses.replace(c, prompt_index=c.prompt_index + shift) for c in other.completions]
        keys = self.rewards.keys() & other.rewards.keys()
        judged = self.judge_outputs.keys() & other.judge_outputs.keys()
        return Rollouts(
            self.rows + other.rows,
            self.prompt_ids + other.prompt_ids,
            self.completions + moved,
            {k: self.rewards[k] + other.rewards[k] for k in self.rewards if k in keys},
            {k: self.judge_outputs[k] + other.judge_outputs[k] for k in self.judge_outputs if k in judged},
        )

    def select_prompts(self, keep: list[int]) -> Rollouts:
        """Returns the rollouts of prompts ``keep`` (indices into ``rows``, in that order), renumbered 0..len-1."""
        new_index = {old: new for new, old in enumerate(keep)}
        picked = [i for i, c in enumerate(self.completions) if c.prompt_index in new_index]
        picked.sort(key=lambda i: (new_index[self.completions[i].prompt_index], self.completions[i].sample_index))
        return Rollouts(
            [self.rows[i] for i in keep],
            [self.prompt_ids[i] for i in keep],
            [dataclasses.replace(self.completions[i], prompt_index=new_index[self.completions[i].prompt_index]) for i in picked],
            {k: [v[i] for i in picked] for k, v in self.rewards.items()},
            {k: [v[i] for i in picked] for k, v in self.judge_outputs.items()},
        )


def groups_with_spread(batch: Rollouts, metric: str = "reward") -> list[int]:
    """Returns the prompt indices whose completions' ``metric`` term is not constant (``algos.groups_with_spread``).

    Samples whose reward or ``metric`` failed (NaN), or that the ``metric`` term skipped (None), do not count
    toward the spread.

    Raises:
        KeyError: ``metric`` is not one of the batch's reward terms (names algo.dynamic_sampling_metric).
    """
    if not batch.completions:
        return []
    if metric not in batch.rewards:
        raise KeyError(
            f"algo.dynamic_sampling_metric='{metric}' is not a reward term; the reward stage gives {sorted(batch.rewards)}"
        )
    acc = torch.tensor([math.nan if v is None else v for v in batch.rewards[metric]], dtype=torch.float32)
    valid = acc.isfinite() & torch.tensor(batch.rewards["reward"], dtype=torch.float32).isfinite()
    groups = torch.tensor([c.prompt_index for c in batch.completions], dtype=torch.long)
    keep = algos.groups_with_spread(torch.where(valid, acc, 0.0), groups, valid_mask=valid)
    return sorted({int(g) for g in groups[keep].tolist()})


def dynamic_sampling(
    first: Rollouts,
    draw: Callable[[int, int], Rollouts],
    *,
    target_groups: int,
    max_rounds: int,
    metric: str = "reward",
) -> tuple[Rollouts, int]:
    """Returns (``target_groups`` prompt groups whose ``metric`` varies, rollout rounds used), DAPO-style.

    Round 1 is ``first``; each further round calls ``draw(num_prompts, round_index)`` for as many new
    prompts as groups are still missing. The first ``target_groups`` informative groups are kept in the
    order they were drawn.

    Raises:
        algos.DynamicSamplingError: groups still missing after ``max_rounds`` rounds (the message names the
            counts and the ways out).

    Source: Yu et al. 2025 (DAPO) Algorithm 1 and Sec. 3.2; verl DAPO ``filter_groups`` with
    ``max_num_gen_batches``. Deviation: a refill round draws only the missing number of prompts (verl
    draws a whole generation batch).
    """
    pool = first.select_prompts(groups_with_spread(first, metric))
    rounds = 1
    while missing := algos.dynamic_sampling_shortfall(
        len(pool.rows), target_groups, rounds_done=rounds, max_rounds=max_rounds
    ):
        more = draw(missing, rounds)
        pool = pool + more.select_prompts(groups_with_spread(more, metric))
        rounds += 1
    return pool.select_prompts(list(range(target_groups))), rounds


def overlong_shaping(batch: Rollouts, *, max_new_tokens: int, cache_tokens: int, penalty_factor: float) -> Rollouts:
    """Returns ``batch`` with the DAPO soft overlong penalty added to "reward" and kept as the "overlong" term.

    Source: Yu et al. 2025 (DAPO) Sec. 3.4 (``algos.overlong_penalty``).
    """
    lengths = torch.tensor([len(c.response_token_ids) for c in batch.completions], dtype=torch.long)
    penalty = algos.overlong_penalty(
        lengths, max_response_tokens=max_new_tokens, cache_tokens=cache_tokens, penalty_factor=penalty_factor
    ).tolist()
    rewards = dict(batch.rewards)
    rewards["overlong"] = penalty
    rewards["reward"] = [r + p for r, p in zip(rewards["reward"], penalty, strict=True)]
    return dataclasses.replace(batch, rewards=rewards)


def per_completion(values_per_prompt: list[float], completions: list[Completion]) -> list[float]:
    """Returns one value per completion: the value of its prompt (e.g. ReMax's greedy reward)."""
    return [values_per_prompt[c.prompt_index] for c in completions]


@dataclass(frozen=True)
class SamplingExtras:
    """Plain values of ``apply`` (from ``cfg.algo`` and its registry entry, ``cfg.learner`` and ``cfg.rollout``).

    Attributes:
        dynamic_sampling: DAPO's dynamic sampling (``Algorithm.dynamic_sampling``).
        greedy_baseline: ReMax's greedy baseline (``Algorithm.greedy_baseline``).
        target_groups: prompt groups per step (learner.prompts_per_step).
        max_rounds: DAPO rollout rounds per step (algo.dynamic_sampling_max_rounds).
        metric: the reward term whose spread keeps a group (algo.dynamic_sampling_metric).
        max_new_tokens: the generation cap, in tokens.
        overlong_cache_tokens: DAPO overlong interval in tokens (0 off).
        overlong_penalty_factor: the largest overlong penalty.
    """

    dynamic_sampling: bool
    greedy_baseline: bool
    target_groups: int
    max_rounds: int
    max_new_tokens: int
    metric: str = "reward"
    overlong_cache_tokens: int = 0
    overlong_penalty_factor: float = 1.0


def apply(
    batch: Rollouts,
    draw: Callable[[int, int], Rollouts],
    greedy: Callable[[Rollouts], Rollouts],
    spec: SamplingExtras,
) -> tuple[Rollouts, list[float] | None, dict[str, float]]:
    """Returns (rollouts, ReMax baseline per completion or None, metrics) after the algorithm's sampling extras.

    In order: DAPO dynamic sampling (``dynamic_sampling`` with ``draw``), the overlong penalty (when
    ``overlong_cache_tokens`` > 0), and for ReMax the reward of ``greedy(batch)`` (one greedy completion per
    prompt, shaped like the samples) spread over each prompt's samples. Metrics: algo/dynamic_sampling_rounds,
    reward/overlong_penalty_mean, reward/baseline_mean and reward/model_score (the mean reward-model term),
    each when it applies.

    Raises:
        algos.DynamicSamplingError: DAPO could not fill the batch within ``max_rounds`` rounds.
    """
    metrics: dict[str, float] = {}
    baseline = None

    def shape(b: Rollouts) -> Rollouts:
        if not spec.overlong_cache_tokens:
            return b
        return overlong_shaping(b, max_new_tokens=spec.max_new_tokens, cache_tokens=spec.overlong_cache_tokens,
                                penalty_factor=spec.overlong_penalty_factor)  # fmt: skip

    if spec.dynamic_sampling:
        batch, rounds = dynamic_sampling(
            batch, draw, target_groups=spec.target_groups, max_rounds=spec.max_rounds, metric=spec.metric
        )
        metrics["algo/dynamic_sampling_rounds"] = float(rounds)
    batch = shape(batch)
    if spec.greedy_baseline:
        scored = shape(greedy(batch))
        per_prompt = [0.0] * len(batch.rows)
        for c, r in zip(scored.completions, scored.rewards["reward"], strict=True):
            per_prompt[c.prompt_index] = r
        baseline = per_completion(per_prompt, batch.completions)  # NaN where the greedy reward failed
        scored = [r for r in per_prompt if math.isfinite(r)]
        metrics["reward/baseline_mean"] = sum(scored) / len(scored) if scored else math.nan
    n = max(len(batch.completions), 1)
    if spec.overlong_cache_tokens:
        metrics["reward/overlong_penalty_mean"] = sum(batch.rewards["overlong"]) / n
    if "reward_model" in batch.rewards:
        metrics["reward/model_score"] = sum(batch.rewards["reward_model"]) / n
    return batch, baseline, metrics
