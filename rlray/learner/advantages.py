"""Stage 5 of the online step: per-token advantages of each online algorithm, from ``rlray.algos`` pieces.

``ADVANTAGE_ESTIMATORS[algo.name](data, spec, sum_fn)`` returns {"advantages": [B, T]} (and "returns" for PPO's
critic). Every estimator reads the same inputs:

- ``data`` (one rank's shard, ``schema.collate`` output plus stage 4): reward [B] float32, group_id [B] int64,
  response_mask [B, T] bool; old_logprobs and ref_logprobs [B, T] float32 when the KL sits in the reward;
  old_values [B, T] float32 (PPO's critic at rollout time); baseline_reward [B] float32 (ReMax).
- ``spec``: plain numbers (``AdvantageSpec``).
- ``sum_fn``: ``algos.SumFn`` over the learner ranks. Shards hold whole groups (``loop.distribute``), so group
  statistics are local; batch statistics (GRPO's batch std, REINFORCE++ and PPO whitening) go through it.

The reward is first spread over tokens (``token_rewards``): the sequence reward on the last valid token, minus
``kl_coef * KL(old || ref)`` on every token when the KL sits in the reward. Sequence-level estimators use the
row sum of these token rewards, as verl's outcome estimators do (``token_level_rewards.sum(-1)``).

Legend: B sequences in the shard, T response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlray import algos


@dataclass(frozen=True)
class AdvantageSpec:
    """Plain values of the advantage stage (built from the config by the loop).

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


Estimator = Callable[[dict[str, Tensor], AdvantageSpec, algos.SumFn], dict[str, Tensor]]


def token_rewards(data: dict[str, Tensor], spec: AdvantageSpec) -> Tensor:
    """Returns [B, T] float32 per-token rewards: the sequence reward on the last valid token, minus the KL penalty.

    Raises:
        KeyError: the KL sits in the reward but old_logprobs or ref_logprobs is missing.
    """
    kl = None
    if spec.reward_kl_coef > 0:
        kl = algos.kl_penalty(data["old_logprobs"], data["ref_logprobs"], spec.kl_estimator)
    return algos.token_level_rewards(data["reward"], data["response_mask"], kl=kl, kl_coef=spec.reward_kl_coef)


def _broadcast(advantages: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Returns {"advantages": [B, T]}: a [B] sequence advantage on every valid token, 0 elsewhere."""
    adv = advantages[:, None].expand(mask.shape).float()
    return {"advantages": torch.where(mask, adv, torch.zeros_like(adv))}


def _sequence_inputs(data: dict[str, Tensor], spec: AdvantageSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (sequence rewards [B], valid rows [B] bool, response_mask [B, T])."""
    mask = data["response_mask"]
    return token_rewards(data, spec).sum(-1), mask.any(-1), mask


def grpo(data: dict[str, Tensor], spec: AdvantageSpec, sum_fn: algos.SumFn) -> dict[str, Tensor]:
    """Returns {"advantages"}: GRPO group-normalised (also DAPO, GSPO and CISPO); ``algos.grpo_advantages``."""
    rewards, valid, mask = _sequence_inputs(data, spec)
    adv = algos.grpo_advantages(
        rewards, data["group_id"], std_scale=spec.std_scale, eps=spec.eps, valid_mask=valid, sum_fn=sum_fn
    )
    return _broadcast(adv, mask)


def dr_grpo(data: dict[str, Tensor], spec: AdvantageSpec, sum_fn: algos.SumFn) -> dict[str, Tensor]:
    """Returns {"advantages"}: Dr.GRPO group-centred rewards, no std; ``algos.dr_grpo_advantages``."""
    rewards, valid, mask = _sequence_inputs(data, spec)
    return _broadcast(algos.dr_grpo_advantages(rewards, data["group_id"], valid_mask=valid), mask)


def rloo(data: dict[str, Tensor], spec: AdvantageSpec, sum_fn: algos.SumFn) -> dict[str, Tensor]:
    """Returns {"advantages"}: RLOO leave-one-out; ``algos.rloo_advantages``."""
    rewards, valid, mask = _sequence_inputs(data, spec)
    return _broadcast(algos.rloo_advantages(rewards, data["group_id"], valid_mask=valid), mask)


def remax(data: dict[str, Tensor], spec: AdvantageSpec, sum_fn: algos.SumFn) -> dict[str, Tensor]:
    """Returns {"advantages"}: ReMax, reward minus the greedy response's reward; ``algos.remax_advantages``.

    Raises:
        KeyError: the shard has no baseline_reward (the rollout stage did not decode the greedy baseline).
    """
    rewards, valid, mask = _sequence_inputs(data, spec)
    return _broadcast(algos.remax_advantages(rewards, data["baseline_reward"], valid_mask=valid), mask)


def reinforce_pp(data: dict[str, Tensor], spec: AdvantageSpec, sum_fn: algos.SumFn) -> dict[str, Tensor]:
    """Returns {"advantages"}: REINFORCE++ batch-whitened discounted returns; ``algos.reinforce_pp_advantages``."""
    adv = algos.reinforce_pp_advantages(token_rewards(data, spec), data["response_mask"], gamma=spec.gamma, sum_fn=sum_fn)
    return {"advantages": adv}


def reinforce_pp_baseline(data: dict[str, Tensor], spec: AdvantageSpec, sum_fn: algos.SumFn) -> dict[str, Tensor]:
    """Returns {"advantages"}: REINFORCE++-baseline, group-centred and batch-whitened (``algos``)."""
    rewards, valid, mask = _sequence_inputs(data, spec)
    adv = algos.reinforce_pp_baseline_advantages(rewards, data["group_id"], mask, valid_mask=valid, sum_fn=sum_fn)
    return {"advantages": adv}


def ppo(data: dict[str, Tensor], spec: AdvantageSpec, sum_fn: algos.SumFn) -> dict[str, Tensor]:
    """Returns {"advantages", "returns"}: PPO's GAE(gamma, lambda) on the critic's values, advantages whitened.

    Source: Schulman et al. 2017 with GAE (``algos.gae_advantages``); whitening as verl
    ``compute_gae_advantage_return`` and OpenRLHF do.

    Raises:
        KeyError: the shard has no old_values (stage 4 runs the critic for PPO).
    """
    mask = data["response_mask"]
    adv, returns = algos.gae_advantages(token_rewards(data, spec), data["old_values"], mask, gamma=spec.gamma, lam=spec.lam)
    return {"advantages": algos.whiten(adv, mask, sum_fn=sum_fn), "returns": returns}


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "dapo": grpo,
    "gspo": grpo,
    "cispo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "remax": remax,
    "ppo": ppo,
}


def collective_sum(all_reduce_sum: Callable[[dict[str, float]], dict[str, float]]) -> algos.SumFn:
    """Returns an ``algos.SumFn`` over a collective's ``all_reduce_sum`` (float64 on the wire, the input's dtype back)."""

    def total(x: Tensor) -> Tensor:
        return torch.tensor(all_reduce_sum({"x": float(x)})["x"], dtype=x.dtype)

    return total
