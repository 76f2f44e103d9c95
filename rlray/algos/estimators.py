"""Stage 5 of the online step: per-token advantages of each online algorithm, from the estimators of this package.

Every estimator has one signature, ``Estimator``: ``fn(inputs, spec, sum_fn) -> Advantages``, where

- ``inputs`` (``AdvantageInputs``) holds one learner rank's shard: reward [B] float32, group_id [B] int64,
  response_mask [B, T] bool; old_logprobs and ref_logprobs [B, T] float32 when the KL sits in the reward;
  old_values [B, T] float32 (PPO's critic at rollout time); baseline_reward [B] float32 (ReMax).
- ``spec`` (``AdvantageSpec``) holds plain numbers.
- ``sum_fn`` (``SumFn``) sums over the learner ranks. Shards hold whole groups (``rlray.run.online.distribute``
  hands each rank a contiguous run of groups), so group statistics are local; batch statistics (GRPO's batch std,
  REINFORCE++ and PPO whitening) go through it.

The reward is first spread over tokens (``token_rewards``): the sequence reward on the last valid token, minus
``kl_coef * KL(old || ref)`` on every token when the KL sits in the reward. Sequence-level estimators use the
row sum of these token rewards, as verl's outcome estimators do (``token_level_rewards.sum(-1)``). The
algorithm registry (``registry.py``) names each algorithm's estimator.

Legend: B sequences in the shard, T response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlray.algos.advantages import (
    SumFn,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)
from rlray.algos.kl import kl_penalty
from rlray.algos.value import gae_advantages


@dataclass(frozen=True)
class AdvantageSpec:
    """Plain values of the advantage stage (built from the config by ``rlray.run.build.update_spec``).

    Attributes:
        std_scale: GRPO std scale, "group" | "batch" | "none".
        eps: floor added to a std before dividing (advantage units).
        gamma: discount per valid token (PPO, REINFORCE++).
        lam: GAE lambda (PPO).
        reward_kl_coef: beta of the KL penalty in the reward (0 when the KL sits in the loss or is off).
        kl_estimator: "k1" | "k2" | "k3".
    """

    std_scale: str = "group"
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 1.0
    reward_kl_coef: float = 0.0
    kl_estimator: str = "k1"


@dataclass(frozen=True)
class AdvantageInputs:
    """The tensors an estimator reads (one rank's shard); optional ones are None where the step has none.

    Attributes:
        reward: [B] float32 sequence rewards (NaN where the reward failed; such rows have no True in the mask).
        group_id: [B] int64, samples of one prompt share it.
        response_mask: [B, T] bool, True where a response token counts.
        old_logprobs: [B, T] float32 (nats), the learner's policy before the update; needed with a KL in the reward.
        ref_logprobs: [B, T] float32 (nats), the reference policy; needed with a KL in the reward.
        old_values: [B, T] float32 critic values at rollout time (PPO), reward units.
        baseline_reward: [B] float32 reward of the greedy response to the same prompt (ReMax).
    """

    reward: Tensor
    group_id: Tensor
    response_mask: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    baseline_reward: Tensor | None = None


@dataclass(frozen=True)
class Advantages:
    """What an estimator returns.

    Attributes:
        advantages: [B, T] float32 per-token advantages (0 where response_mask is False for sequence estimators).
        returns: [B, T] float32 value targets for a critic (PPO), else None.
    """

    advantages: Tensor
    returns: Tensor | None = None


Estimator = Callable[[AdvantageInputs, AdvantageSpec, SumFn], Advantages]


def _required(value: Tensor | None, name: str, why: str) -> Tensor:
    """Returns ``value``; raises ValueError naming the missing input and the stage that fills it."""
    if value is None:
        raise ValueError(f"advantage estimator: inputs.{name} is None; {why}")
    return value


def token_rewards(inputs: AdvantageInputs, spec: AdvantageSpec) -> Tensor:
    """Returns [B, T] float32 per-token rewards: the sequence reward on the last valid token, minus the KL penalty.

    Raises:
        ValueError: the KL sits in the reward but old_logprobs or ref_logprobs is missing.
    """
    kl = None
    if spec.reward_kl_coef > 0:
        why = "a KL in the reward needs stage 4's old and reference logprobs"
        old = _required(inputs.old_logprobs, "old_logprobs", why)
        kl = kl_penalty(old, _required(inputs.ref_logprobs, "ref_logprobs", why), spec.kl_estimator)
    return token_level_rewards(inputs.reward, inputs.response_mask, kl=kl, kl_coef=spec.reward_kl_coef)


def broadcast(advantages: Tensor, mask: Tensor) -> Advantages:
    """Returns a [B] sequence advantage on every valid token of ``mask`` [B, T] bool, 0 elsewhere."""
    adv = advantages[:, None].expand(mask.shape).float()
    return Advantages(torch.where(mask, adv, torch.zeros_like(adv)))


def sequence_inputs(inputs: AdvantageInputs, spec: AdvantageSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (sequence rewards [B] float32 after the KL penalty, valid rows [B] bool, response_mask [B, T] bool)."""
    mask = inputs.response_mask
    return token_rewards(inputs, spec).sum(-1), mask.any(-1), mask


def grpo(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: SumFn) -> Advantages:
    """Returns GRPO group-normalised advantages (also DAPO, GSPO and CISPO's); ``grpo_advantages``."""
    rewards, valid, mask = sequence_inputs(inputs, spec)
    adv = grpo_advantages(rewards, inputs.group_id, std_scale=spec.std_scale, eps=spec.eps, valid_mask=valid, sum_fn=sum_fn)
    return broadcast(adv, mask)


def dr_grpo(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: SumFn) -> Advantages:
    """Returns Dr.GRPO group-centred rewards, no std; ``dr_grpo_advantages``."""
    rewards, valid, mask = sequence_inputs(inputs, spec)
    return broadcast(dr_grpo_advantages(rewards, inputs.group_id, valid_mask=valid), mask)


def rloo(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: SumFn) -> Advantages:
    """Returns RLOO leave-one-out advantages; ``rloo_advantages``."""
    rewards, valid, mask = sequence_inputs(inputs, spec)
    return broadcast(rloo_advantages(rewards, inputs.group_id, valid_mask=valid), mask)


def remax(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: SumFn) -> Advantages:
    """Returns ReMax advantages, reward minus the greedy response's reward; ``remax_advantages``.

    Raises:
        ValueError: no baseline_reward (the rollout stage did not decode the greedy baseline).
    """
    rewards, valid, mask = sequence_inputs(inputs, spec)
    baseline = _required(inputs.baseline_reward, "baseline_reward", "ReMax needs the greedy baseline of stage 3")
    return broadcast(remax_advantages(rewards, baseline, valid_mask=valid), mask)


def reinforce_pp(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: SumFn) -> Advantages:
    """Returns REINFORCE++ batch-whitened discounted returns; ``reinforce_pp_advantages``."""
    rewards = token_rewards(inputs, spec)
    return Advantages(reinforce_pp_advantages(rewards, inputs.response_mask, gamma=spec.gamma, sum_fn=sum_fn))


def reinforce_pp_baseline(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: SumFn) -> Advantages:
    """Returns REINFORCE++-baseline advantages, group-centred and batch-whitened (``reinforce_pp_baseline_advantages``)."""
    rewards, valid, mask = sequence_inputs(inputs, spec)
    return Advantages(reinforce_pp_baseline_advantages(rewards, inputs.group_id, mask, valid_mask=valid, sum_fn=sum_fn))


def ppo(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: SumFn) -> Advantages:
    """Returns PPO's GAE(gamma, lambda) advantages on the critic's values, whitened, and the returns.

    Source: Schulman et al. 2017 with GAE (``gae_advantages``); whitening as verl ``compute_gae_advantage_return``
    and OpenRLHF do.

    Raises:
        ValueError: no old_values (stage 4 runs the critic for PPO).
    """
    mask = inputs.response_mask
    values = _required(inputs.old_values, "old_values", "PPO needs stage 4's critic values")
    adv, returns = gae_advantages(token_rewards(inputs, spec), values, mask, gamma=spec.gamma, lam=spec.lam)
    return Advantages(whiten(adv, mask, sum_fn=sum_fn), returns)
