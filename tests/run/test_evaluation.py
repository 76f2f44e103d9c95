"""Evaluation on held-out prompts (rlray.run.evaluation.evaluate_prompts) with a scripted rollout and reward: every
key's value computed by hand, single-turn and episode rows, and pass@k."""

from __future__ import annotations

import math

import pytest

from rlray.data import PromptRow
from rlray.reward.server import LocalRewardClient
from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.types import EpisodeInfo
from rlray.run.evaluation import evaluate_prompts

ROWS = [PromptRow("a", "qa", {}), PromptRow("b", "qb", {}), PromptRow("c", "qc", {})]
PROMPTS = [(row, [1, 2]) for row in ROWS]
GREEDY = SamplingSpec(n=1, max_new_tokens=8, temperature=0.0)


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


class _Rollouts:
    """Generates ``lengths[i]`` tokens for prompt i (greedy), or ``n`` samples of 1 token each (pass@k)."""

    def __init__(self, lengths: list[int], episodes: list[EpisodeInfo | None] | None = None) -> None:
        self.lengths, self.episodes = lengths, episodes or [None] * len(lengths)

    def generate(self, prompt_ids, sampling, rows):
        if sampling.n > 1:
            return [Completion(p, s, [7 + s], [-1.0], "stop", 0) for p in range(len(prompt_ids)) for s in range(sampling.n)]
        return [Completion(p, 0, list(range(n)), [-1.0] * n, "stop", 0, episode=self.episodes[p])
                for p, n in enumerate(self.lengths)]


class _Scorer:
    """Reward = the completion's first token (as an int), a term 'parity' that skips odd rewards, and for pass@k
    samples (completions '7', '8', ...) the reward 1.0 only for sample 1 of prompt 'qb'."""

    def score(self, prompts, completions, columns, completion_ids=None):
        if all(len(ids) == 1 and ids[0] >= 7 for ids in completion_ids):
            return {"reward": [1.0 if p == "qb" and c == "8" else 0.0 for p, c in zip(prompts, completions, strict=True)]}
        rewards = [float(ids[0]) if ids else math.nan for ids in completion_ids]
        return {"reward": rewards, "parity": [None if r % 2 else 1.0 for r in rewards]}

    def score_with_failures(self, prompts, completions, columns, completion_ids=None):
        return self.score(prompts, completions, columns, completion_ids), []  # no failure texts

    def close(self):
        pass


def test_single_turn_metrics_are_means_over_the_prompts():
    # completions: prompt a 3 tokens [0,1,2], b 1 token [0], c 2 tokens [0,1]; reward = first token = 0 for all
    got = evaluate_prompts(_Rollouts([3, 1, 2]), LocalRewardClient(_Scorer(), 1), PROMPTS, _Tokenizer(), GREEDY)
    assert got == {
        "eval/reward_mean": 0.0,
        "eval/parity": 1.0,  # every reward is even (0): scored 1.0 three times
        "eval/parity_skipped": 0.0,
        "eval/response_tokens_mean": 2.0,  # (3 + 1 + 2) / 3
        "eval/num_problems": 3.0,
    }


def test_episode_rows_add_success_turns_failures_and_their_numbers():
    eps = [EpisodeInfo("calc", "done", 2, env_reward=1.0, metrics={"hits": 2.0}),
           EpisodeInfo("calc", "max_turns", 3, env_reward=0.0, metrics={"hits": 1.0}),
           EpisodeInfo("calc", "env_error", 1, failed=True)]
    got = evaluate_prompts(_Rollouts([1, 1, 1], eps), LocalRewardClient(_Scorer(), 1), PROMPTS, _Tokenizer(), GREEDY)
    assert got["eval/env_success"] == pytest.approx(1 / 3)  # only the first earned a reward above 0
    assert got["eval/env_turns_mean"] == 2.0  # (2 + 3 + 1) / 3
    assert got["eval/env_failed"] == 1.0
    assert got["eval/env_metric/hits"] == 1.5  # over the episodes that reported it
    assert got["eval/env"] == 0.5  # the env term: 1.0 and 0.0 (the failed episode's NaN left out)


def test_pass_at_k_counts_prompts_with_a_rewarded_sample():
    pass_k = SamplingSpec(n=2, max_new_tokens=8, temperature=1.0)
    got = evaluate_prompts(_Rollouts([1, 1, 1]), LocalRewardClient(_Scorer(), 1), PROMPTS, _Tokenizer(), GREEDY,
                           pass_k=pass_k)
    assert got["eval/pass@2"] == pytest.approx(1 / 3)  # prompt b's second sample only
