"""Rewards: weighted terms in TRL's reward-function convention (built-in verifiers, user functions), a reward model,
judges (generative reward models on Ray Serve: the ``rlray.reward.judges`` package) and the one rule that sums every
term of a sample's reward (``rlray.reward.combine``)."""

from rlray.reward.functions import RewardFunctionError, load_reward_function
from rlray.reward.gsm8k import extract_final_answer, grade_gsm8k, gsm8k_reward
from rlray.reward.scorer import RewardScorer
from rlray.reward.verifiers import (
    BUILTIN_VERIFIERS,
    exact_match,
    gsm8k_correct,
    gsm8k_format,
    math_equal,
    regex_match,
)

__all__ = [
    "BUILTIN_VERIFIERS",
    "RewardFunctionError",
    "RewardScorer",
    "exact_match",
    "extract_final_answer",
    "grade_gsm8k",
    "gsm8k_correct",
    "gsm8k_format",
    "gsm8k_reward",
    "load_reward_function",
    "math_equal",
    "regex_match",
]
