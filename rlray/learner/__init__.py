"""Policy learner: logprobs, the RL objective, optimizer steps and weight export."""

from rlray.learner.logprobs import autocast_context, response_logprobs
from rlray.learner.objective import LossSpec, Normaliser, policy_objective
from rlray.learner.policy import PolicyLearner, split_microbatches

__all__ = [
    "LossSpec",
    "Normaliser",
    "PolicyLearner",
    "autocast_context",
    "policy_objective",
    "response_logprobs",
    "split_microbatches",
]
