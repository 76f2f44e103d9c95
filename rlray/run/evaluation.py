"""Evaluation of the policy on held-out prompts: training's (rank 0, ``eval.num_problems``) and ``rlray eval``'s.

Both call ``evaluate_prompts`` with the same rollouts and reward client as training, so they log the same keys.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlray.data import PromptRow
from rlray.reward.judges.panel import JudgePanel
from rlray.rollout import RolloutSource, SamplingSpec
from rlray.run.experience import score, term_metrics
from rlray.run.lead import RewardClient


def evaluate_prompts(rollouts: RolloutSource, reward: RewardClient, prompts: list[tuple[PromptRow, list[int]]],
                     tokenizer: Any, sampling: SamplingSpec, env_reward_weight: float = 1.0,
                     pass_k: SamplingSpec | None = None, *, judges: JudgePanel | None = None,
                     judge_seed: int = 0) -> dict[str, float]:
    """Returns eval/reward_mean, eval/<term> and eval/<term>_skipped per reward term, eval/response_tokens_mean and
    eval/num_problems; with environments also eval/env_success (share of episodes whose environment reward is
    above 0), eval/env_turns_mean, eval/env_failed and eval/env_metric/<name> (means of the environments' numbers);
    with ``pass_k`` also eval/pass@<k>.

    One completion (or episode) per prompt (``sampling``: greedy for training's eval and ``rlray eval``), spread
    over the rollout actors, scored by ``reward``. Term means are over the prompts the term applied to
    (``term_metrics``); response length is in tokens, EOS included. ``pass_k`` (k = its n samples per prompt)
    adds the share of prompts with a sample whose reward is above 0.

    Args:
        rollouts: the rollout fleet, or episodes over it.
        reward: the reward client.
        prompts: (row, prompt token ids) of each held-out prompt.
        tokenizer: the policy's tokenizer.
        sampling: the evaluation SamplingSpec (``build.eval_sampling``).
        env_reward_weight: env.reward_weight.
        pass_k: the SamplingSpec of pass@k (n = k samples), or None.
        judges: the judges (``reward.judges``), scoring beside ``reward``; None without any.
        judge_seed: seeds the order group-mode judges see a prompt's samples in.
    """
    rows = [r for r, _ in prompts]
    completions = rollouts.generate([ids for _, ids in prompts], sampling, rows)
    got = score(reward, rows, completions, tokenizer, env_reward_weight, judges, judge_seed).values
    rewards = np.asarray(got["reward"], dtype=np.float64)
    episodes = [c.episode for c in completions if c.episode is not None and c.episode.environment]
    env_metrics = {} if not episodes else {
        "eval/env_success": float(np.mean([(e.env_reward or 0.0) > 0 and not e.failed for e in episodes])),
        "eval/env_turns_mean": float(np.mean([e.num_turns for e in episodes])),
        "eval/env_failed": float(sum(e.failed for e in episodes)),
        **{f"eval/env_metric/{k}": float(np.mean([e.metrics[k] for e in episodes if k in e.metrics]))
           for k in sorted({k for e in episodes for k in e.metrics})},
    }
    if pass_k is not None:
        sampled = rollouts.generate([ids for _, ids in prompts], pass_k, rows)
        values = np.asarray(score(reward, rows, sampled, tokenizer, env_reward_weight, judges, judge_seed).values["reward"],
                            dtype=np.float64)
        solved = np.nan_to_num(values, nan=0.0).reshape(len(rows), pass_k.n) > 0
        env_metrics[f"eval/pass@{pass_k.n}"] = float(solved.any(axis=1).mean())
    return {
        "eval/reward_mean": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else math.nan,
        **term_metrics(got, "eval"),
        **env_metrics,
        "eval/response_tokens_mean": float(np.mean([len(c.response_token_ids) for c in completions])),
        "eval/num_problems": float(len(completions)),
    }
