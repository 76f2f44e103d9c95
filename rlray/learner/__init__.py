"""Learner: logprobs, the online objective, PPO's critic, offline objectives, optimizer steps, parallelism strategies."""

from rlray.learner.batching import MicroBatching, split_microbatches
from rlray.learner.logprobs import autocast_context, response_logprobs
from rlray.learner.objective import LossSpec, Normaliser, policy_objective
from rlray.learner.policy import OptimizerSpec, PolicyLearner

__all__ = [
    "LossSpec",
    "MicroBatching",
    "Normaliser",
    "OptimizerSpec",
    "PolicyLearner",
    "autocast_context",
    "policy_objective",
    "response_logprobs",
    "split_microbatches",
]
