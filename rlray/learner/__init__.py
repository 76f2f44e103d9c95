"""Learner: logprobs, the online objective, PPO's critic, offline objectives, optimizer steps."""

from rlray.learner.batching import MicroBatching, split_microbatches
from rlray.learner.logprobs import autocast_context, response_logprobs
from rlray.learner.objective import LossSpec, Normaliser, policy_objective
from rlray.learner.policy import PolicyLearner

__all__ = [
    "LossSpec",
    "MicroBatching",
    "Normaliser",
    "PolicyLearner",
    "autocast_context",
    "policy_objective",
    "response_logprobs",
    "split_microbatches",
]
