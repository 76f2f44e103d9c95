"""Learner: logprobs, the online objective and advantages, PPO's critic, offline objectives, optimizer steps."""

from rlray.learner.advantages import ADVANTAGE_ESTIMATORS, AdvantageSpec
from rlray.learner.batching import split_microbatches
from rlray.learner.logprobs import autocast_context, response_logprobs
from rlray.learner.objective import POLICY_LOSS_OF, LossSpec, Normaliser, policy_objective
from rlray.learner.policy import PolicyLearner

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSS_OF",
    "AdvantageSpec",
    "LossSpec",
    "Normaliser",
    "PolicyLearner",
    "autocast_context",
    "policy_objective",
    "response_logprobs",
    "split_microbatches",
]
