"""Learner: logprobs, the online objective, PPO's critic, offline objectives, optimizer steps, parallelism strategies.

Importing this package imports only the micro-batching (``rlray.learner.batching``: torch and the experience record),
which the run plan holds; the rest is imported on first use (PEP 562). The driver resolves a plan before Ray starts
and never trains: the policy, reference and scoring modules (the value and reward heads, and through transformers'
losses SciPy) cost ~1 s of CPU there (issue 39).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from rlray.learner.batching import MicroBatching, split_microbatches

if TYPE_CHECKING:
    from rlray.learner.logprobs import autocast_context, response_logprobs
    from rlray.learner.objective import LossSpec, Normaliser, policy_objective
    from rlray.learner.policy import OptimizerSpec, PolicyLearner

_LAZY = {
    "autocast_context": "rlray.learner.logprobs",
    "response_logprobs": "rlray.learner.logprobs",
    "LossSpec": "rlray.learner.objective",
    "Normaliser": "rlray.learner.objective",
    "policy_objective": "rlray.learner.objective",
    "OptimizerSpec": "rlray.learner.policy",
    "PolicyLearner": "rlray.learner.policy",
}

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


def __getattr__(name: str) -> Any:
    """Returns a name of ``__all__`` from its module, imported on first use (PEP 562); any other missing name raises
    AttributeError."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
